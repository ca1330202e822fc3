//! The files in memory (tmpfs) a device's queues copy small requests to and from in zero-copy
//! mode through shared mappings (`sys/window_copy.rs`: one `pwritev`/`preadv` on
//! `/dev/ublkcN`, one copy, where a `pread` into a buffer and a `pwrite` of it cost two of
//! each). One mapping per file, made on first use, serves all the device's queues.
//!
//! A read through a mapping makes the file take a page where it had a hole (tmpfs fills a
//! hole it is asked to map), where `pread` reads zeroes from nothing. So reads go through a
//! file's mapping only if the file had no holes when it was mapped and no discard or write
//! of zeroes has been asked of the device since (either may punch one): then a read never
//! makes the file hold more than it did. Writes go through any writable mapping: a write
//! takes the page either way. What a mapping cannot do - a range past the file's size when
//! it was mapped (a file that grew), a failed or short copy (a file that shrank) - goes the
//! `pread`/`pwrite` way instead.
//!
//! A file is named by its descriptor, as the stack's places name it: a place's descriptor
//! stays open, and means the same file, for as long as the stack that named it.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::mapping::Mapping;
use crate::sys::place_io;

/// A file's mapping, and whether the file had no holes when it was mapped.
#[derive(Debug)]
pub(super) struct Window {
    pub(super) map: Mapping,
    dense: bool,
}

/// A device's mappings of its source's files in memory.
#[derive(Debug, Default)]
pub(super) struct Windows {
    /// Per descriptor asked for: its mapping, or `None` (empty, or it could not be mapped).
    maps: Mutex<Vec<(RawFd, Option<Arc<Window>>)>>,
    /// A discard or write of zeroes was asked of the device: a file may have holes now.
    punched: AtomicBool,
}

impl Windows {
    /// The mapping of `fd` (made on the first call for it), or `None` if it has none.
    pub(super) fn window(&self, fd: RawFd) -> Option<Arc<Window>> {
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, window)) = maps.iter().find(|(f, _)| *f == fd) {
            return window.clone();
        }
        let window = match place_io::map_whole(fd) {
            Ok(made) => made.map(|(map, dense)| {
                tracing::debug!(
                    fd,
                    dense,
                    writable = map.writable(),
                    "a file in memory is mapped for the queues' small copies"
                );
                Arc::new(Window { map, dense })
            }),
            Err(e) => {
                tracing::info!(
                    fd,
                    error = %e,
                    "a file in memory could not be mapped: its small requests are copied by \
                     pread and pwrite"
                );
                None
            }
        };
        maps.push((fd, window.clone()));
        window
    }

    /// A discard or write of zeroes was asked of the device: reads stop going through the
    /// mappings, for good.
    pub(super) fn punched(&self) {
        if !self.punched.swap(true, Ordering::AcqRel) {
            tracing::debug!(
                "a discard or write of zeroes: reads of files in memory go by pread from now on"
            );
        }
    }

    /// Whether a read may go through `window` (see the module's doc).
    pub(super) fn reads_through(&self, window: &Window) -> bool {
        window.dense && !self.punched.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    use super::*;

    fn memfd() -> std::fs::File {
        let fd = rustix::fs::memfd_create("windows", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        std::fs::File::from(fd)
    }

    #[test]
    fn one_mapping_per_file_and_reads_only_while_it_has_no_holes() {
        let windows = Windows::default();
        let dense = memfd();
        dense.write_all_at(&[1u8; 65536], 0).unwrap();
        let sparse = memfd();
        sparse.set_len(1 << 20).unwrap();
        let empty = memfd();

        let a = windows.window(dense.as_raw_fd()).unwrap();
        let again = windows.window(dense.as_raw_fd()).unwrap();
        assert!(Arc::ptr_eq(&a, &again));
        assert!(windows.reads_through(&a));
        let b = windows.window(sparse.as_raw_fd()).unwrap();
        assert!(!windows.reads_through(&b));
        assert!(windows.window(empty.as_raw_fd()).is_none());

        windows.punched();
        assert!(!windows.reads_through(&a));
    }
}
