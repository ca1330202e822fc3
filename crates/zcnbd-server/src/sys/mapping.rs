//! A shared mapping of a memory export's memfd: the place write payloads are received into
//! and small read replies are sent from, so the memory export's data path has no bounce
//! buffer; and, through `mincore`, the memory export's cheap answer to "where are the holes"
//! (`SEEK_HOLE` on tmpfs walks every page up to the next hole, which on a written export is
//! the end of the file).
//!
//! The mapping is only ever touched by the kernel (recv into it, sendmsg from it) or by
//! `copy_in` (the `--data-path copy` baseline); no Rust reference to its bytes is ever formed,
//! because other connections may be writing the same pages concurrently (NBD leaves the
//! result of overlapping requests undefined, but Rust must not see a data race).

use std::io;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// A read-write shared mapping of a whole file.
#[derive(Debug)]
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is plain shared memory; all access goes through raw pointers handed to
// the kernel or through `copy_in`, which tolerates concurrent writers (see the module doc).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only gives out raw pointers.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared and writable (`MAP_NORESERVE`: a sparse 1 TiB export
    /// costs address space, not memory).
    pub fn new(fd: BorrowedFd<'_>, len: u64) -> io::Result<Mapping> {
        Mapping::with_access(fd, len, true)
    }

    /// Maps `len` bytes of `fd` shared, writable only if `writable` (a descriptor opened
    /// read-only cannot be mapped writable).
    pub fn with_access(fd: BorrowedFd<'_>, len: u64, writable: bool) -> io::Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let prot = match writable {
            true => ProtFlags::READ | ProtFlags::WRITE,
            false => ProtFlags::READ,
        };
        let flags = MapFlags::SHARED | MapFlags::NORESERVE;
        // SAFETY: a fresh mapping chosen by the kernel (null hint) aliases no Rust object;
        // it is unmapped only in Drop, after every user (Arc holders, whose in-flight
        // operations keep the Arc alive) is gone.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, flags, fd, 0)? };
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        Ok(Mapping {
            base,
            len,
            writable,
        })
    }

    /// Whether the mapping may be written (by the kernel, or by `copy_in`).
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// `len` bytes at `offset` of `map`, or `None` if the range is outside the mapping.
    pub fn range(map: &Arc<Mapping>, offset: u64, len: usize) -> Option<MappedRange> {
        map.range_ptr(offset, len)?;
        Some(MappedRange {
            map: Arc::clone(map),
            offset: usize::try_from(offset).ok()?,
            len,
        })
    }

    /// The address of `len` bytes at `offset`, or `None` if the range is outside the mapping.
    pub(crate) fn range_ptr(&self, offset: u64, len: usize) -> Option<*mut u8> {
        let offset = usize::try_from(offset).ok()?;
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: offset + len <= self.len, so the result stays inside the mapping.
        Some(unsafe { self.base.as_ptr().add(offset) })
    }

    /// Appends one byte per page of `[offset, offset + len)` to `out` (widened to whole pages):
    /// nonzero where the page is in the page cache, i.e. holds data. Returns the offset of the
    /// first page described.
    pub fn resident_pages(&self, offset: u64, len: u64, out: &mut Vec<u8>) -> io::Result<u64> {
        let page = rustix::param::page_size() as u64;
        let start = offset / page * page;
        let end = offset
            .checked_add(len)
            .and_then(|e| e.checked_next_multiple_of(page));
        let span = end
            .map(|e| e.min(self.len as u64).saturating_sub(start))
            .unwrap_or(0);
        let span = usize::try_from(span).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let Some(addr) = self.range_ptr(start, span) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        let pages = span.div_ceil(page as usize);
        let used = out.len();
        out.resize(used + pages, 0);
        // SAFETY: `addr` is page aligned (start is a multiple of the page size and the mapping
        // base is page aligned) and `addr..addr+span` lies inside the mapping (range_ptr);
        // mincore writes exactly ceil(span / page) bytes, which `out` has room for after
        // `used`.
        let rc = unsafe { libc::mincore(addr.cast(), span, out.as_mut_ptr().add(used).cast()) };
        if rc != 0 {
            out.truncate(used);
            return Err(io::Error::last_os_error());
        }
        Ok(start)
    }

    /// Copies `data` into the mapping at `offset` (the copy baseline); false if out of range.
    pub fn copy_in(&self, offset: u64, data: &[u8]) -> bool {
        let Some(dst) = self.range_ptr(offset, data.len()).filter(|_| self.writable) else {
            return false;
        };
        // SAFETY: `dst..dst+len` is inside the mapping (checked above) and cannot overlap
        // `data`, which is a Rust-owned buffer, not part of any mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        true
    }
}

/// A range of a memory export's mapping, which it keeps mapped: where a write payload is
/// received in place, or read data is sent from.
#[derive(Debug, Clone)]
pub struct MappedRange {
    map: Arc<Mapping>,
    offset: usize,
    len: usize,
}

impl MappedRange {
    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the range starts in the mapping (and in the file mapped from its start).
    pub fn offset(&self) -> u64 {
        self.offset as u64
    }

    /// Copies `bytes` into the range at `at`; false if they do not fit.
    pub fn copy_in(&self, at: usize, bytes: &[u8]) -> bool {
        let end = at.checked_add(bytes.len());
        if end.is_none_or(|end| end > self.len) {
            return false;
        }
        self.map.copy_in((self.offset + at) as u64, bytes)
    }

    /// Copies the range's bytes from `at` into `out` (all of `out`); false if they are not
    /// all inside the range.
    pub fn copy_out(&self, at: usize, out: &mut [u8]) -> bool {
        let Some(src) = at
            .checked_add(out.len())
            .and_then(|end| self.io_range(at..end))
        else {
            return false;
        };
        // SAFETY: `src..src+len` is inside the mapping (io_range), which this range keeps
        // mapped, and cannot overlap `out`, a Rust-owned buffer outside any mapping; as for
        // `copy_in`, the bytes are copied without ever being seen through a Rust reference.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        true
    }

    /// The address of `range` (relative to this range), for the kernel to receive into or
    /// send from; `None` if it is not inside this range.
    pub(crate) fn io_range(&self, range: Range<usize>) -> Option<*mut u8> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        self.map
            .range_ptr((self.offset + range.start) as u64, range.len())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned, and no operation can still use the
        // mapping: every in-flight operation holds an Arc<Mapping>.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn writes_through_the_mapping_are_seen_by_the_file() {
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
        let file = std::fs::File::from(fd);
        let map = Mapping::new(file.as_fd(), 1 << 20).unwrap();
        assert!(map.copy_in(4096, b"hello"));
        assert!(!map.copy_in((1 << 20) - 2, b"hello"));
        assert!(map.range_ptr(u64::MAX, 1).is_none());
        let mut buf = [0u8; 5];
        file.read_exact_at(&mut buf, 4096).unwrap();
        assert_eq!(&buf, b"hello");
        let mut pages = Vec::new();
        assert_eq!(map.resident_pages(100, 3 * 4096, &mut pages).unwrap(), 0);
        let resident: Vec<bool> = pages.iter().map(|p| p & 1 != 0).collect();
        assert_eq!(resident, [false, true, false, false]);
    }
}
