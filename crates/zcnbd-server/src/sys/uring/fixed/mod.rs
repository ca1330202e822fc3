//! Registered ("fixed") buffers of one ring: one anonymous mapping, registered with the ring
//! once, carved into page-aligned runs that O_DIRECT reads and writes use with
//! `READ_FIXED` / `WRITE_FIXED` and that read replies leave from with `SEND_ZC` (`buf_index`).
//! The kernel pinned the pages once at registration, so these operations skip the per-I/O
//! page pinning an ordinary buffer costs.
//!
//! Bounded: the region is `--fixed-buffer-bytes-max` bytes per ring (at most 1 GiB, the
//! kernel's limit for one registered buffer), registered only when the ring first serves an
//! O_DIRECT export. A request that finds no free run, or is larger than the region, uses a
//! pooled buffer as before: the fixed path never waits and never splits a request.
//!
//! Ownership: `PageRuns` hands each page to at most one [`FixedBuf`] at a time, and a
//! `FixedBuf` gives its pages back only when dropped. Whoever holds a `FixedBuf` whose memory
//! the kernel is using (a file operation, a send and its zero-copy notification) keeps it until
//! the last completion of that operation, so the pages are never reused under the kernel.

mod runs;

use std::cell::RefCell;
use std::io;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Once;

use io_uring::IoUring;
use rustix::mm::{mmap_anonymous, munmap, MapFlags, ProtFlags};
use tracing::{debug, warn};

use runs::PageRuns;

/// Granularity of the region: every run starts on a page, so data placed at a page boundary
/// of its run suits O_DIRECT.
pub(super) const FIXED_PAGE_BYTES: usize = 4096;
/// The kernel refuses a single registered buffer over 1 GiB.
const REGISTERED_BYTES_MAX: usize = 1 << 30;
/// The region's slot in the ring's registered-buffer table.
const REGION_INDEX: u16 = 0;

/// One anonymous mapping and which of its pages are in use.
struct Region {
    base: NonNull<u8>,
    len: usize,
    runs: RefCell<PageRuns>,
}

impl Region {
    fn new(len: usize) -> io::Result<Region> {
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: a fresh private mapping chosen by the kernel (null hint) aliases no Rust
        // object; it is unmapped only in Drop, once no FixedBuf (each holds an Rc) is left.
        let ptr = unsafe { mmap_anonymous(std::ptr::null_mut(), len, prot, MapFlags::PRIVATE)? };
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        Ok(Region {
            base,
            len,
            runs: RefCell::new(PageRuns::new(len / FIXED_PAGE_BYTES)),
        })
    }

    /// The address `offset` bytes into the region.
    fn at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len, "offset outside the fixed region");
        // SAFETY: offset <= len, so the result stays inside the mapping (or one past it).
        unsafe { self.base.as_ptr().add(offset) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: base/len are what mmap returned. Every FixedBuf holds an Rc, so none is
        // left; the ring that registered the region is dropped before its FixedBuffers (field
        // order of the ring thread), and the kernel keeps its own reference to pinned pages.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A ring's registered region, from which [`FixedBuf`]s are taken. Ring-thread only (`Rc`).
#[derive(Clone)]
pub struct FixedPool {
    region: Rc<Region>,
}

impl FixedPool {
    /// A run with `head_bytes` of room (rounded up to pages) before `len` bytes of data, or
    /// `None` when no such run is free.
    pub fn take(&self, head_bytes: usize, len: usize) -> Option<FixedBuf> {
        let head_pages = head_bytes.div_ceil(FIXED_PAGE_BYTES);
        let pages = head_pages.checked_add(len.div_ceil(FIXED_PAGE_BYTES))?;
        let first_page = self.region.runs.borrow_mut().take(pages)?;
        Some(FixedBuf {
            region: Rc::clone(&self.region),
            first_page,
            pages,
            data_offset: (first_page + head_pages) * FIXED_PAGE_BYTES,
            header_len: 0,
            len,
        })
    }
}

/// A run of registered pages: room for a reply header, then `len` bytes of data starting on a
/// page boundary. Its pages return to the pool when it is dropped.
pub struct FixedBuf {
    region: Rc<Region>,
    first_page: usize,
    pages: usize,
    /// Where the data starts, from the region's base (page-aligned).
    data_offset: usize,
    /// Header bytes written just before the data.
    header_len: usize,
    len: usize,
}

impl FixedBuf {
    /// The registered buffer this run lies in (`buf_index` of the fixed operations).
    pub fn index(&self) -> u16 {
        REGION_INDEX
    }

    /// Bytes of data.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first byte of data (page-aligned).
    fn data_ptr(&self) -> *mut u8 {
        self.region.at(self.data_offset)
    }

    /// The data, to fill or read while no operation uses it.
    pub fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: the `len` bytes at data_ptr lie in this run's data pages (`take` sized the
        // run for them), which PageRuns gave to this FixedBuf alone, in a mapping its Rc
        // keeps mapped; `&mut self` is exclusive, and no operation in flight uses the run:
        // operations are pointed at it only through a `Lent` holding it, which gives no
        // `&mut` while lent.
        unsafe { std::slice::from_raw_parts_mut(self.data_ptr(), self.len) }
    }

    /// Writes `header` just before the data, so header and data leave in one contiguous send;
    /// false if the run has no room for it.
    pub fn set_header(&mut self, header: &[u8]) -> bool {
        let room = self.data_offset - self.first_page * FIXED_PAGE_BYTES;
        if header.len() > room {
            return false;
        }
        let dst = self.region.at(self.data_offset - header.len());
        // SAFETY: `dst..dst + header.len()` lies in this run's head room (checked above),
        // whose pages PageRuns gave to this FixedBuf alone; no operation in flight uses the
        // head room (file I/O targets the data pages, and the send is posted after this).
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), dst, header.len()) };
        self.header_len = header.len();
        true
    }

    /// The header (if any) and the data, as one contiguous range: where it starts and its
    /// length.
    pub fn wire(&self) -> (*const u8, usize) {
        let start = self.region.at(self.data_offset - self.header_len);
        (start.cast_const(), self.header_len + self.len)
    }
}

impl Drop for FixedBuf {
    fn drop(&mut self) {
        self.region
            .runs
            .borrow_mut()
            .give(self.first_page, self.pages);
    }
}

/// A ring's fixed buffers: off, a reserved (empty) table slot, or a registered region.
pub(super) enum FixedBuffers {
    Off,
    Reserved { bytes: usize },
    Ready(FixedPool),
}

/// The fallback is logged once per process, not once per ring.
static FALLBACK_LOGGED: Once = Once::new();

fn log_fallback(why: &str) {
    FALLBACK_LOGGED.call_once(|| {
        let memlock = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
        let memlock = memlock.map_or("unlimited".to_string(), |b| format!("{} KiB", b / 1024));
        warn!(
            "registered buffers off, O_DIRECT uses pooled buffers: {why} \
             (RLIMIT_MEMLOCK {memlock}; see --fixed-buffer-bytes-max)"
        );
    });
}

impl FixedBuffers {
    /// Reserves one empty slot in the ring's buffer table for a region of `bytes` (rounded
    /// down to pages, at most 1 GiB; 0 turns fixed buffers off). Filling a reserved slot later
    /// is an update, which never waits for the ring's operations in flight.
    pub fn reserve(ring: &IoUring, bytes: usize) -> FixedBuffers {
        let bytes = bytes.min(REGISTERED_BYTES_MAX) / FIXED_PAGE_BYTES * FIXED_PAGE_BYTES;
        if bytes == 0 {
            return FixedBuffers::Off;
        }
        match ring.submitter().register_buffers_sparse(1) {
            Ok(()) => FixedBuffers::Reserved { bytes },
            Err(e) => {
                log_fallback(&format!("cannot reserve a buffer table: {e}"));
                FixedBuffers::Off
            }
        }
    }

    /// Maps and registers the region if it is only reserved; on failure, turns fixed buffers
    /// off for this ring (with one log line per process).
    pub fn ensure(&mut self, ring: &IoUring) {
        let FixedBuffers::Reserved { bytes } = *self else {
            return;
        };
        *self = match register(ring, bytes) {
            Ok(pool) => {
                debug!(bytes, "registered a fixed-buffer region");
                FixedBuffers::Ready(pool)
            }
            Err(e) => {
                log_fallback(&format!("registering {} KiB failed: {e}", bytes / 1024));
                FixedBuffers::Off
            }
        };
    }

    /// The registered region, if there is one.
    pub fn pool(&self) -> Option<&FixedPool> {
        match self {
            FixedBuffers::Ready(pool) => Some(pool),
            _ => None,
        }
    }
}

fn register(ring: &IoUring, bytes: usize) -> io::Result<FixedPool> {
    let region = Region::new(bytes)?;
    let iov = libc::iovec {
        iov_base: region.base.as_ptr().cast(),
        iov_len: region.len,
    };
    // SAFETY: the iovec covers exactly the region's mapping, which stays mapped as long as
    // this pool (and any FixedBuf) lives; the ring thread drops its ring before its
    // FixedBuffers, so the registration never outlives the mapping.
    unsafe {
        ring.submitter()
            .register_buffers_update(u32::from(REGION_INDEX), &[iov], None)?;
    }
    Ok(FixedPool {
        region: Rc::new(region),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(pages: usize) -> FixedPool {
        FixedPool {
            region: Rc::new(Region::new(pages * FIXED_PAGE_BYTES).unwrap()),
        }
    }

    #[test]
    fn header_sits_right_before_page_aligned_data() {
        let pool = pool(4);
        let mut buf = pool.take(40, 5000).unwrap();
        assert_eq!(buf.data_ptr() as usize % FIXED_PAGE_BYTES, 0);
        assert!(buf.set_header(&[7; 40]));
        let (start, len) = buf.wire();
        assert_eq!(start as usize + 40, buf.data_ptr() as usize);
        assert_eq!(len, 5040);
        // SAFETY: `start` points at the 40 header bytes just written into the live run.
        let written = unsafe { std::slice::from_raw_parts(start, 40) };
        assert_eq!(written, &[7; 40]);
        assert!(!buf.set_header(&[0; FIXED_PAGE_BYTES + 1]));
    }

    #[test]
    fn runs_return_on_drop_and_never_block() {
        let pool = pool(4);
        let a = pool.take(1, 8192).unwrap();
        assert!(pool.take(0, 8192).is_none(), "only one page is left");
        assert!(pool.take(0, 1 << 20).is_none(), "larger than the region");
        drop(a);
        assert!(pool.take(0, 4 * FIXED_PAGE_BYTES).is_some());
    }
}
