//! The in-memory export: a sparse memfd.
//!
//! A memfd is a tmpfs file, so it is sparse (never-written pages use no memory), trims punch
//! real holes, and its pages can be spliced straight from the page cache to a socket. Reads
//! and writes go through the file backend; holes are found with `mincore` on a shared mapping
//! of the memfd, which costs one byte per page of the range asked about, whereas `SEEK_HOLE`
//! on tmpfs walks every page up to the next hole (to the end of a fully written export).
//! What `mincore` found is remembered per 64 KiB chunk ([`KnownData`]), so reads of written
//! data do not ask again.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use zcnbd_proto::consts::state;
use zcnbd_proto::Extent;

use super::known_data::{KnownData, CHUNK_BYTES};
use super::FileBackend;
use crate::export::backend::map_with_holes;
use crate::export::{Backend, Capabilities, Map, MapFor, Medium, Place, ZeroError, ZeroFlags};
use crate::sys::mapping::Mapping;

/// Most bytes of the export one block-status question examines (8 GiB: 2 million pages,
/// about 30 ms of `mincore` here; a whole 1 TiB export would be 268 million pages, seconds).
/// More than the 4 GiB a compact reply's extent can describe, so such replies still show the
/// 32-bit limit.
pub const EXTENTS_SCAN_BYTES_MAX: u64 = 8 << 30;

/// A sparse in-memory export.
#[derive(Debug)]
pub struct MemoryBackend {
    file: FileBackend,
    mapping: Arc<Mapping>,
    known: KnownData,
}

impl MemoryBackend {
    /// A memory export of `size` bytes.
    pub fn new(size: u64) -> io::Result<Self> {
        let fd = memfd_create("zcnbd-memory", MemfdFlags::CLOEXEC)?;
        ftruncate(&fd, size)?;
        let file = File::from(fd);
        let mapping = Arc::new(Mapping::new(file.as_fd(), size)?);
        Ok(MemoryBackend {
            file: FileBackend::from_file(file, None, true)?,
            mapping,
            known: KnownData::new(size),
        })
    }

    /// Runs `punch`, which may make holes in `[offset, offset + len)`, forgetting what was
    /// known of those chunks before (reads from then on look again) and after (a read that
    /// looked while the hole was being punched may have marked a chunk).
    fn punching<T>(&self, offset: u64, len: u64, punch: impl FnOnce() -> T) -> T {
        self.known.forget(offset, len);
        let result = punch();
        self.known.forget(offset, len);
        result
    }

    /// Marks the chunks of `pages` (from `mincore`, starting at the chunk boundary `start`)
    /// whose every page is resident.
    fn learn(&self, start: u64, pages: &[u8]) {
        let page = rustix::param::page_size() as u64;
        if !start.is_multiple_of(CHUNK_BYTES) || !CHUNK_BYTES.is_multiple_of(page) {
            return;
        }
        let per_chunk = (CHUNK_BYTES / page) as usize;
        // Only the export's last chunk can be short here (the range asked about was widened
        // to whole chunks, clipped to the export).
        for (k, chunk) in pages.chunks(per_chunk).enumerate() {
            if chunk.iter().all(|resident| resident & 1 != 0) {
                self.known.mark(start + k as u64 * CHUNK_BYTES);
            }
        }
    }
}

/// A sparse in-memory export of `size` bytes.
pub fn memory_backend(size: u64) -> io::Result<MemoryBackend> {
    MemoryBackend::new(size)
}

impl Backend for MemoryBackend {
    fn never_waits(&self) -> bool {
        true
    }

    fn size(&self) -> u64 {
        self.file.size()
    }

    fn capabilities(&self) -> Capabilities {
        self.file.capabilities()
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.pread(buf, offset)
    }

    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.file.pwrite(buf, offset, fua)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.flush()
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.punching(offset, len, || self.file.trim(offset, len, fua))
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        self.punching(offset, len, || self.file.zero(offset, len, flags))
    }

    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.file.cache(offset, len)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        /// Pages examined per mincore call (64 KiB of vector per 256 MiB of export).
        const PAGES_PER_CALL: u64 = 65536;
        let page = rustix::param::page_size() as u64;
        // At most EXTENTS_SCAN_BYTES_MAX of the export is examined per question: the reply
        // may describe less than asked, and a client asks again from where it ended.
        let scan = len.min(EXTENTS_SCAN_BYTES_MAX);
        let end = offset.saturating_add(scan).min(self.size());
        let first = out.len();
        if self.known.covers(offset, end) {
            push_extent(out, first, extents_max, end - offset, 0);
            return Ok(());
        }
        let mut pages = Vec::new();
        let mut pos = offset;
        // Stopping at the cap describes less than asked, which is allowed ("the server MAY
        // return less data than requested").
        while pos < end {
            let chunk_end = end.min((pos / page + PAGES_PER_CALL) * page);
            // Asked about whole known-data chunks, so that what is learnt can be kept.
            let (ask, ask_end) = self.known.widen(pos, chunk_end);
            pages.clear();
            let start = self
                .mapping
                .resident_pages(ask, ask_end - ask, &mut pages)?;
            self.learn(start, &pages);
            for (i, resident) in pages.iter().enumerate() {
                let page_start = start + i as u64 * page;
                if page_start >= chunk_end {
                    break;
                }
                let page_end = (page_start + page).min(chunk_end);
                if page_end <= pos {
                    continue;
                }
                let flags = if resident & 1 != 0 {
                    0
                } else {
                    state::HOLE | state::ZERO
                };
                if !push_extent(out, first, extents_max, page_end - pos, flags) {
                    return Ok(());
                }
                pos = page_end;
            }
        }
        Ok(())
    }

    /// The memfd and its mapping; a read that wants holes learns whether the range is all
    /// data (two extents at most: the known-data chunks answer most reads without `mincore`),
    /// and leaves anything more mixed to the stack.
    fn map(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<()> {
        let fd = self.file.fd().as_raw_fd();
        let place_at = |offset: u64, len: u64| match usize::try_from(len)
            .ok()
            .and_then(|len| Mapping::range(&self.mapping, offset, len))
        {
            Some(range) => Place::Memory { fd, range },
            None => Place::Stack,
        };
        map_with_holes(self, offset, len, how, out, place_at)
    }

    fn medium(&self) -> Option<Medium> {
        Some(Medium::Memory)
    }
}

/// Extends the last extent when the flags match, else starts a new one; false when the cap
/// leaves no room for a new one (the caller must stop: the extents must stay contiguous).
fn push_extent(out: &mut Vec<Extent>, first: usize, max: usize, length: u64, flags: u32) -> bool {
    let count = out.len() - first;
    match out.last_mut() {
        Some(last) if count > 0 && last.flags == flags => last.length += length,
        _ if count < max => out.push(Extent { length, flags }),
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terabyte_export_is_sparse_and_reports_holes() {
        let b = memory_backend(1 << 40).unwrap();
        assert_eq!(b.size(), 1 << 40);
        b.pwrite(&[5u8; 4096], 1 << 39, false).unwrap();
        let mut ext = Vec::new();
        b.extents((1 << 39) - 4096, 3 * 4096, 8, &mut ext).unwrap();
        let flags: Vec<u32> = ext.iter().map(|e| e.flags).collect();
        assert_eq!(
            flags,
            [state::HOLE | state::ZERO, 0, state::HOLE | state::ZERO]
        );
        let lengths: Vec<u64> = ext.iter().map(|e| e.length).collect();
        assert_eq!(lengths, [4096, 4096, 4096]);
    }

    fn flags_and_lengths(b: &MemoryBackend, offset: u64, len: u64) -> Vec<(u64, u32)> {
        let mut ext = Vec::new();
        b.extents(offset, len, 16, &mut ext).unwrap();
        ext.iter().map(|e| (e.length, e.flags)).collect()
    }

    #[test]
    fn learnt_data_is_forgotten_where_holes_are_punched() {
        let hole = state::HOLE | state::ZERO;
        let b = memory_backend(4 * CHUNK_BYTES + 4096).unwrap();
        b.pwrite(&vec![7u8; 2 * CHUNK_BYTES as usize], 0, false)
            .unwrap();
        // A small look learns its whole chunk; then the chunk answers without mincore.
        assert_eq!(flags_and_lengths(&b, 4096, 4096), [(4096, 0)]);
        assert!(b.known.covers(0, CHUNK_BYTES));
        assert!(!b.known.covers(0, CHUNK_BYTES + 1));
        assert_eq!(
            flags_and_lengths(&b, 0, 2 * CHUNK_BYTES),
            [(2 * CHUNK_BYTES, 0)]
        );
        assert!(b.known.covers(0, 2 * CHUNK_BYTES));
        b.trim(8192, 4096, false).unwrap();
        assert_eq!(
            flags_and_lengths(&b, 4096, 3 * 4096),
            [(4096, 0), (4096, hole), (4096, 0)]
        );
        let zeroes = ZeroFlags {
            may_trim: true,
            fast: false,
            fua: false,
        };
        assert_eq!(flags_and_lengths(&b, CHUNK_BYTES, 4096), [(4096, 0)]);
        b.zero(CHUNK_BYTES, 4096, zeroes).unwrap();
        assert_eq!(flags_and_lengths(&b, CHUNK_BYTES, 4096), [(4096, hole)]);
        // The short last chunk is learnt too, and nothing past the export's end.
        b.pwrite(&[1u8; 4096], 4 * CHUNK_BYTES, false).unwrap();
        assert_eq!(flags_and_lengths(&b, 4 * CHUNK_BYTES, 4096), [(4096, 0)]);
        assert!(b.known.covers(4 * CHUNK_BYTES, 4 * CHUNK_BYTES + 4096));
    }

    #[test]
    fn unaligned_ranges_and_caps() {
        let b = memory_backend(1 << 20).unwrap();
        b.pwrite(&[1u8; 8192], 8192, false).unwrap();
        let mut ext = Vec::new();
        b.extents(100, 20000, 16, &mut ext).unwrap();
        let got: Vec<(u64, u32)> = ext.iter().map(|e| (e.length, e.flags)).collect();
        assert_eq!(got, [(8092, 3), (8192, 0), (20100 - 16384, 3)]);
        ext.clear();
        b.extents(0, 1 << 20, 1, &mut ext).unwrap();
        assert_eq!(ext.len(), 1);
        assert_eq!(
            ext[0],
            Extent {
                length: 8192,
                flags: 3
            }
        );
    }

    #[test]
    fn one_question_examines_a_bounded_part_of_a_huge_export() {
        let b = memory_backend(1 << 40).unwrap();
        b.pwrite(&[1u8; 4096], (1 << 40) - 4096, false).unwrap();
        let start = std::time::Instant::now();
        let mut ext = Vec::new();
        b.extents(0, 1 << 40, 1024, &mut ext).unwrap();
        let covered: u64 = ext.iter().map(|e| e.length).sum();
        assert_eq!(covered, EXTENTS_SCAN_BYTES_MAX, "{ext:?}");
        assert!(start.elapsed().as_millis() < 1000, "{:?}", start.elapsed());
        // Asked again from where the reply ended, the client gets further.
        ext.clear();
        b.extents(
            (1 << 40) - EXTENTS_SCAN_BYTES_MAX,
            EXTENTS_SCAN_BYTES_MAX,
            8,
            &mut ext,
        )
        .unwrap();
        assert_eq!(ext.last().map(|e| e.flags), Some(0), "the data at the end");
    }

    #[test]
    fn trim_makes_a_hole_again() {
        let b = memory_backend(1 << 20).unwrap();
        b.pwrite(&[1u8; 65536], 0, false).unwrap();
        b.trim(0, 65536, false).unwrap();
        let mut ext = Vec::new();
        b.extents(0, 65536, 4, &mut ext).unwrap();
        assert_eq!(
            ext,
            [Extent {
                length: 65536,
                flags: 3
            }]
        );
    }

    #[test]
    fn zero_without_hole_reads_zeroes() {
        let b = memory_backend(1 << 20).unwrap();
        b.pwrite(&[5u8; 8192], 0, false).unwrap();
        let flags = ZeroFlags {
            may_trim: false,
            fast: true,
            fua: false,
        };
        b.zero(0, 8192, flags).unwrap();
        let mut buf = [1u8; 8192];
        b.pread(&mut buf, 0).unwrap();
        assert_eq!(buf, [0u8; 8192]);
    }
}
