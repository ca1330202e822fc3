//! A regular file or block device, buffered or with O_DIRECT. The memory export is this same
//! backend over a memfd.
//!
//! With O_DIRECT, a request whose offset, length and buffer are all 4 KiB aligned goes to the
//! direct descriptor as one I/O; anything else goes through a second, buffered descriptor of
//! the same file (Linux keeps the two coherent: direct reads write back dirty cached pages in
//! their range first, direct writes invalidate them).
//!
//! Holes: a read that wants them (a structured reply leaves them out) asks `SEEK_DATA` /
//! `SEEK_HOLE` once per 64 KiB chunk at most. What the file system said is data is remembered
//! ([`KnownData`], as the memory export does with `mincore`): only this backend's trims and
//! zeroes can make a hole where there was data, and they forget the chunks they touch,
//! before and after. A chunk wrongly remembered as data costs nothing but a hole sent as
//! data (the bytes read are the file's); one that is not remembered costs a look.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use rustix::fs::{fallocate, fdatasync, FallocateFlags, SeekFrom};
use rustix::io::{pwritev2, Errno as HostErrno, ReadWriteFlags};
use zcnbd_proto::Extent;

use super::holes::{next_boundary, seeks_are_cheap};
use super::known_data::{KnownData, CHUNK_BYTES};
use crate::export::backend::map_with_holes;
use crate::export::{Backend, Capabilities, Map, MapFor, Medium, Place, ZeroError, ZeroFlags};

/// Alignment O_DIRECT requests must have to go to the direct descriptor.
pub const DIRECT_ALIGN_BYTES: u64 = 4096;
/// Chunk size when zeroes must be written out by hand.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// The largest file whose data the backend remembers (one bit per 64 KiB: 8 MiB of bits at
/// 4 TiB); a larger one asks the file system on every read that wants holes (logged).
pub const KNOWN_DATA_FILE_BYTES_MAX: u64 = 4 << 40;
/// The most data one look at the file system marks as known (the run `SEEK_HOLE` reports
/// may be the whole file): 64 MiB, 1024 chunks.
const LEARN_AHEAD_BYTES: u64 = 64 << 20;

/// How the file's data is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileMode {
    /// Through the page cache.
    Buffered,
    /// O_DIRECT for aligned requests.
    Direct,
}

/// A file-backed export.
#[derive(Debug)]
pub struct FileBackend {
    buffered: File,
    direct: Option<File>,
    size: u64,
    writable: bool,
    /// Holes are asked of the file system (`holes::seeks_are_cheap`); else all is data.
    seeks: bool,
    /// The chunks known to be all data, where holes are asked and the file is not too large.
    known: Option<KnownData>,
    /// Whether its syncs have all succeeded (kept across a reload with the descriptors).
    durability: std::sync::Arc<crate::export::Durability>,
}

impl FileBackend {
    /// Opens `path` (a regular file or block device).
    pub fn open(path: &Path, mode: FileMode, writable: bool) -> io::Result<Self> {
        let open = |extra: i32| {
            OpenOptions::new()
                .read(true)
                .write(writable)
                .custom_flags(extra)
                .open(path)
        };
        let buffered = open(0)?;
        let direct = match mode {
            FileMode::Buffered => None,
            FileMode::Direct => {
                Some(open(rustix::fs::OFlags::DIRECT.bits() as i32).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("O_DIRECT open of {}: {e}", path.display()),
                    )
                })?)
            }
        };
        Self::from_file(buffered, direct, writable)
    }

    /// Wraps an open file (the memory export wraps its memfd).
    pub fn from_file(buffered: File, direct: Option<File>, writable: bool) -> io::Result<Self> {
        // Block devices report length 0 in metadata; seeking to the end works for both.
        let size = rustix::fs::seek(&buffered, SeekFrom::End(0))?;
        let seeks = seeks_are_cheap(&buffered);
        if seeks && size > KNOWN_DATA_FILE_BYTES_MAX {
            tracing::info!(
                size,
                limit = KNOWN_DATA_FILE_BYTES_MAX,
                "file larger than the known-data limit: reads that want holes ask the file system each time"
            );
        }
        Ok(FileBackend {
            seeks,
            known: (seeks && size <= KNOWN_DATA_FILE_BYTES_MAX).then(|| KnownData::new(size)),
            buffered,
            direct,
            size,
            writable,
            durability: Default::default(),
        })
    }

    /// The buffered descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.buffered.as_fd()
    }

    /// The descriptor to use for an I/O of `len` bytes at `offset` from/to `buf_addr`.
    fn fd_for(&self, buf_addr: usize, offset: u64, len: usize) -> &File {
        match &self.direct {
            Some(direct)
                if (buf_addr as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
                    && offset.is_multiple_of(DIRECT_ALIGN_BYTES)
                    && (len as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
                    // The tail of a file whose size is not aligned cannot be read directly.
                    && offset + len as u64 <= self.size / DIRECT_ALIGN_BYTES * DIRECT_ALIGN_BYTES =>
            {
                direct
            }
            _ => &self.buffered,
        }
    }

    fn write_all_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let file = self.fd_for(buf.as_ptr() as usize, offset, buf.len());
        let flags = if fua {
            ReadWriteFlags::DSYNC
        } else {
            ReadWriteFlags::empty()
        };
        let (mut done, mut at) = (0usize, offset);
        while done < buf.len() {
            let n = pwritev2(file, &[IoSlice::new(&buf[done..])], at, flags)?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            done += n;
            at += n as u64;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        static ZEROES: [u8; ZERO_CHUNK_BYTES] = [0; ZERO_CHUNK_BYTES];
        let (mut at, end) = (offset, offset + len);
        while at < end {
            let n = (end - at).min(ZERO_CHUNK_BYTES as u64) as usize;
            self.write_all_at(&ZEROES[..n], at, false)?;
            at += n as u64;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn punch(&self, offset: u64, len: u64) -> rustix::io::Result<()> {
        let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        fallocate(&self.buffered, mode, offset, len)
    }

    /// Runs `change`, which may make holes in `[offset, offset + len)` (a punch, or
    /// ZERO_RANGE's unwritten extents, which `SEEK_DATA` may call holes), forgetting what was
    /// known of those chunks before and after (a read that looked meanwhile may have marked
    /// one).
    fn holing<T>(&self, offset: u64, len: u64, change: impl FnOnce() -> T) -> T {
        let Some(known) = &self.known else {
            return change();
        };
        known.forget(offset, len);
        let result = change();
        known.forget(offset, len);
        result
    }

    /// The run `offset` lies in (where it ends, and its flags) for a read's range: the known
    /// data, else one look at the file system from the start of its chunk, whose data run is
    /// remembered. `None`: not known this way (the caller looks from `offset` itself).
    fn run_at(&self, offset: u64, end: u64) -> Option<(u64, u32)> {
        let known = self.known.as_ref()?;
        // A read's range; block status over more asks the file system (the answer is the
        // runs it has, not one extent per chunk).
        if end.saturating_sub(offset) > LEARN_AHEAD_BYTES {
            return None;
        }
        if known.covers(offset, end) {
            return Some((end, 0));
        }
        let start = offset / CHUNK_BYTES * CHUNK_BYTES;
        let (run_end, flags) = next_boundary(&self.buffered, start, self.size)?;
        if flags == 0 {
            // Whole chunks of the data run from `start`, and a partial last chunk of the file.
            let learnt = run_end.min(start.saturating_add(LEARN_AHEAD_BYTES));
            let mut chunk = start;
            while chunk < learnt && (chunk + CHUNK_BYTES <= learnt || learnt == self.size) {
                known.mark(chunk);
                chunk += CHUNK_BYTES;
            }
        }
        // A hole from `start` that ends before `offset` says nothing of `offset`.
        (run_end > offset).then_some((run_end, flags))
    }

    /// Zeroes without writing: ZERO_RANGE, or (tmpfs) punch then allocate for NO_HOLE.
    fn zero_by_fallocate(&self, offset: u64, len: u64, may_trim: bool) -> rustix::io::Result<()> {
        if may_trim {
            return self.punch(offset, len);
        }
        let zero_range = FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE;
        match fallocate(&self.buffered, zero_range, offset, len) {
            Err(HostErrno::OPNOTSUPP) | Err(HostErrno::NOSYS) | Err(HostErrno::INVAL) => {
                self.punch(offset, len)?;
                fallocate(&self.buffered, FallocateFlags::KEEP_SIZE, offset, len)
            }
            other => other,
        }
    }
}

fn is_unsupported(e: HostErrno) -> bool {
    matches!(
        e,
        HostErrno::OPNOTSUPP | HostErrno::NOSYS | HostErrno::INVAL
    )
}

impl Backend for FileBackend {
    fn durability(&self) -> Option<std::sync::Arc<crate::export::Durability>> {
        Some(std::sync::Arc::clone(&self.durability))
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            write: self.writable,
            flush: true,
            fua: true,
            trim: true,
            zero: true,
            fast_zero: true,
            cache: true,
            multi_conn: true,
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let file = self.fd_for(buf.as_ptr() as usize, offset, buf.len());
        file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
            // The file shrank under us: report an I/O error, not a short read.
            io::ErrorKind::UnexpectedEof => io::Error::from_raw_os_error(5),
            _ => e,
        })
    }

    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.write_all_at(buf, offset, fua)
    }

    fn flush(&self) -> io::Result<()> {
        Ok(fdatasync(&self.buffered)?)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        match self.holing(offset, len, || self.punch(offset, len)) {
            // Trim is advisory: a file system that cannot punch holes simply keeps the data.
            Err(e) if is_unsupported(e) => Ok(()),
            Err(e) => Err(e.into()),
            Ok(()) if fua => self.flush(),
            Ok(()) => Ok(()),
        }
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        let zeroed = self.holing(offset, len, || {
            self.zero_by_fallocate(offset, len, flags.may_trim)
        });
        match zeroed {
            Ok(()) if flags.fua => Ok(self.flush()?),
            Ok(()) => Ok(()),
            Err(e) if is_unsupported(e) && flags.fast => Err(ZeroError::NotFast),
            Err(e) if is_unsupported(e) => Ok(self.write_zeroes(offset, len, flags.fua)?),
            Err(e) => Err(ZeroError::Io(e.into())),
        }
    }

    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        let advice = rustix::fs::Advice::WillNeed;
        Ok(rustix::fs::fadvise(
            &self.buffered,
            offset,
            std::num::NonZeroU64::new(len),
            advice,
        )?)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let end = offset.saturating_add(len).min(self.size);
        let mut pos = offset;
        let mut pushed = 0;
        let mut first = match pos < end && extents_max > 0 {
            true => self.run_at(offset, end),
            false => None,
        };
        while pos < end && pushed < extents_max {
            let boundary = match (first.take(), self.seeks) {
                (Some(run), _) => Some(run),
                (None, true) => next_boundary(&self.buffered, pos, self.size),
                (None, false) => None,
            };
            // SEEK_DATA unsupported (or costly): everything is data.
            let (next, flags) = boundary.unwrap_or((end, 0));
            let next = next.clamp(pos + 1, end);
            out.push(Extent {
                length: next - pos,
                flags,
            });
            pos = next;
            pushed += 1;
        }
        Ok(())
    }

    /// The file itself, at the same offset; a read that wants holes asks `SEEK_DATA` /
    /// `SEEK_HOLE` for two extents (all data, all hole, or mixed: the rest to the stack).
    fn map(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<()> {
        let buffered = self.buffered.as_raw_fd();
        let direct = self.direct.as_ref().map(|d| d.as_raw_fd());
        let place_at = |offset: u64, _len: u64| match direct {
            Some(direct) => Place::Direct {
                direct,
                buffered,
                offset,
            },
            None => Place::File {
                fd: buffered,
                offset,
            },
        };
        map_with_holes(self, offset, len, how, out, place_at)
    }

    fn medium(&self) -> Option<Medium> {
        Some(match self.direct {
            Some(_) => Medium::Direct,
            None => Medium::PageCache,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(mode: FileMode) -> (tempfile::NamedTempFile, FileBackend) {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(1 << 20).unwrap();
        let b = FileBackend::open(file.path(), mode, true).unwrap();
        (file, b)
    }

    #[test]
    fn write_read_trim_zero_and_extents() {
        let (_f, b) = backend(FileMode::Buffered);
        b.pwrite(&[7u8; 8192], 65536, true).unwrap();
        let mut buf = [0u8; 8192];
        b.pread(&mut buf, 65536).unwrap();
        assert_eq!(buf, [7u8; 8192]);
        let mut ext = Vec::new();
        b.extents(0, 1 << 20, 16, &mut ext).unwrap();
        let total: u64 = ext.iter().map(|e| e.length).sum();
        assert_eq!(total, 1 << 20);
        assert!(ext.iter().any(|e| e.flags == 0));
        b.trim(65536, 8192, false).unwrap();
        b.pread(&mut buf, 65536).unwrap();
        assert_eq!(buf, [0u8; 8192]);
        b.pwrite(&[9u8; 4096], 0, false).unwrap();
        b.zero(
            0,
            4096,
            ZeroFlags {
                may_trim: false,
                fast: false,
                fua: false,
            },
        )
        .unwrap();
        b.pread(&mut buf[..4096], 0).unwrap();
        assert_eq!(buf[..4096], [0u8; 4096]);
    }

    fn punch_from_outside(path: &Path, offset: u64, len: u64) {
        let other = OpenOptions::new().write(true).open(path).unwrap();
        let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        fallocate(&other, mode, offset, len).unwrap();
    }

    fn flags_of(b: &FileBackend, offset: u64, len: u64) -> Vec<(u64, u32)> {
        let mut ext = Vec::new();
        b.extents(offset, len, 16, &mut ext).unwrap();
        ext.iter().map(|e| (e.length, e.flags)).collect()
    }

    #[test]
    fn data_found_once_is_remembered_per_chunk_until_this_backend_makes_a_hole() {
        // On a disk's file system (/tmp may be a tmpfs, where holes are never asked).
        let f = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let b = FileBackend::open(f.path(), FileMode::Buffered, true).unwrap();
        if !b.seeks {
            eprintln!("/var/tmp is a tmpfs: skipped");
            return;
        }
        let hole = zcnbd_proto::consts::state::HOLE | zcnbd_proto::consts::state::ZERO;
        b.pwrite(&[3u8; 200 << 10], 0, false).unwrap();
        // A 4 KiB look learns the data run's whole chunks from its chunk's start (64K..192K).
        assert_eq!(flags_of(&b, 70 << 10, 4096), [(4096, 0)]);
        let known = b.known.as_ref().unwrap();
        assert!(known.covers(64 << 10, 192 << 10));
        assert!(!known.covers(0, 4096) && !known.covers(64 << 10, (192 << 10) + 1));
        // Remembered: a hole made behind the backend's back is still answered as data (the
        // bytes a read sends are the file's, zeroes)...
        punch_from_outside(f.path(), 64 << 10, 64 << 10);
        assert_eq!(flags_of(&b, 64 << 10, 4096), [(4096, 0)]);
        // ...but not past the data run, nor over more than a read's range.
        assert_eq!(
            flags_of(&b, 192 << 10, 16 << 10),
            [(8 << 10, 0), (8 << 10, hole)]
        );
        // This backend's own trims and zeroes forget the chunks they touch.
        b.trim(4096, 4096, false).unwrap();
        assert_eq!(flags_of(&b, 4096, 4096), [(4096, hole)]);
        let zero = ZeroFlags {
            may_trim: true,
            fast: false,
            fua: false,
        };
        b.zero(132 << 10, 4096, zero).unwrap();
        assert_eq!(flags_of(&b, 132 << 10, 4096), [(4096, hole)]);
    }

    #[test]
    fn on_tmpfs_block_status_reports_data_without_seeking() {
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("no /dev/shm: skipped");
            return;
        };
        let path = dir.path().join("f");
        std::fs::write(&path, b"").unwrap();
        let b = FileBackend::open(&path, FileMode::Buffered, true).unwrap();
        assert!(
            !b.seeks,
            "/dev/shm is a tmpfs: SEEK_HOLE walks every page there"
        );
        let b = {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            f.set_len(1 << 20).unwrap();
            FileBackend::from_file(f, None, true).unwrap()
        };
        b.pwrite(&[1u8; 4096], 65536, false).unwrap();
        let mut ext = Vec::new();
        b.extents(0, 1 << 20, 16, &mut ext).unwrap();
        assert_eq!(
            ext,
            [Extent {
                length: 1 << 20,
                flags: 0
            }]
        );
    }

    #[test]
    fn extents_are_capped() {
        let (_f, b) = backend(FileMode::Buffered);
        for i in 0..8u64 {
            b.pwrite(&[1u8; 4096], i * 65536, false).unwrap();
        }
        let mut ext = Vec::new();
        b.extents(0, 1 << 20, 3, &mut ext).unwrap();
        assert_eq!(ext.len(), 3);
    }
}
