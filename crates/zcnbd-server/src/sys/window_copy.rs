//! A ublk request's data copied straight between the request's pages and a file's shared
//! mapping, by one `pwritev`/`preadv` on `/dev/ublkcN` (USER_COPY): the kernel copies between
//! the page cache and the request, once, where a `pread` into a buffer and a `pwrite` of it
//! would copy twice and cost two system calls.
//!
//! The mapping's bytes are only touched by the kernel, through the addresses handed to it
//! (the rule of `sys/mapping.rs`); a page that faults there (the file shrank under the
//! mapping) makes the call fail or come up short, never a signal.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use super::mapping::Mapping;

/// The most pieces one copy takes (Linux's `IOV_MAX`).
pub const PIECES_MAX: usize = 1024;

/// Zeroes a read's holes are copied from (a hole longer than this is several pieces).
static ZEROES: [u8; ZEROES_LEN] = [0; ZEROES_LEN];
const ZEROES_LEN: usize = 64 << 10;

/// A piece of a request, in order.
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    /// `len` bytes of the mapped file from `offset`.
    Mapped {
        map: &'a Mapping,
        offset: u64,
        len: usize,
    },
    /// `len` zero bytes (a read's hole; never part of a write).
    Zeroes(usize),
}

/// Copies `pieces` into the request at `pos` of `cdev` (a read's answer); the bytes copied.
pub fn give<'a>(
    cdev: &File,
    pos: u64,
    pieces: impl IntoIterator<Item = Piece<'a>>,
) -> io::Result<usize> {
    let iov = iovecs(pieces, false)?;
    let offset = libc::off_t::try_from(pos).map_err(|_| einval())?;
    // SAFETY: every iovec names memory that stays valid for the call: a range of a mapping
    // the caller borrows (checked inside it by `range_ptr`), or the static zeroes; the
    // kernel only reads them, and a fault in the mapping is its error to return.
    let n = unsafe { libc::pwritev(cdev.as_raw_fd(), iov.as_ptr(), iov.len() as i32, offset) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Copies the request at `pos` of `cdev` into `pieces` (a write's data); the bytes copied.
/// Every piece must be a writable mapping's.
pub fn take<'a>(
    cdev: &File,
    pos: u64,
    pieces: impl IntoIterator<Item = Piece<'a>>,
) -> io::Result<usize> {
    let iov = iovecs(pieces, true)?;
    let offset = libc::off_t::try_from(pos).map_err(|_| einval())?;
    // SAFETY: every iovec names a range inside a writable mapping the caller borrows
    // (`iovecs` checked both), so it stays mapped for the call; no Rust reference to those
    // bytes exists, and a fault there is the kernel's error to return.
    let n = unsafe { libc::preadv(cdev.as_raw_fd(), iov.as_ptr(), iov.len() as i32, offset) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

/// The iovecs of `pieces` (`into`: the kernel writes them, so only writable mappings).
fn iovecs<'a>(
    pieces: impl IntoIterator<Item = Piece<'a>>,
    into: bool,
) -> io::Result<Vec<libc::iovec>> {
    let mut iov = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Mapped { map, offset, len } => {
                if into && !map.writable() {
                    return Err(io::Error::from_raw_os_error(libc::EBADF));
                }
                let base = map.range_ptr(offset, len).ok_or_else(einval)?;
                iov.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: len,
                });
            }
            Piece::Zeroes(_) if into => return Err(einval()),
            Piece::Zeroes(mut len) => {
                while len > 0 {
                    let n = len.min(ZEROES_LEN);
                    iov.push(libc::iovec {
                        iov_base: ZEROES.as_ptr() as *mut libc::c_void,
                        iov_len: n,
                    });
                    len -= n;
                }
            }
        }
    }
    if iov.len() > PIECES_MAX {
        return Err(einval());
    }
    Ok(iov)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    use super::*;

    /// A plain file stands in for `/dev/ublkcN`: the same system calls at an offset.
    fn memfd(len: u64) -> File {
        let fd = rustix::fs::memfd_create("window", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        File::from(fd)
    }

    #[test]
    fn a_read_is_given_from_the_mapping_and_zeroes_in_one_call() {
        let file = memfd(1 << 20);
        file.write_all_at(&[7u8; 4096], 8192).unwrap();
        let map = Mapping::with_access(file.as_fd(), 1 << 20, false).unwrap();
        let dev = memfd(0);
        let pieces = [
            Piece::Mapped {
                map: &map,
                offset: 8192,
                len: 4096,
            },
            Piece::Zeroes(100_000),
        ];
        dev.write_all_at(&[1u8; 200_000], 0).unwrap();
        assert_eq!(give(&dev, 10, pieces).unwrap(), 104_096);
        let mut back = vec![0u8; 104_096];
        dev.read_exact_at(&mut back, 10).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 7));
        assert!(back[4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_write_is_taken_into_a_writable_mapping_only() {
        let file = memfd(1 << 20);
        let dev = memfd(0);
        dev.write_all_at(&[9u8; 4096], 4096).unwrap();
        let read_only = Mapping::with_access(file.as_fd(), 1 << 20, false).unwrap();
        let into = |map| Piece::Mapped {
            map,
            offset: 65536,
            len: 4096,
        };
        let err = take(&dev, 4096, [into(&read_only)]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBADF));
        let writable = Mapping::with_access(file.as_fd(), 1 << 20, true).unwrap();
        assert_eq!(take(&dev, 4096, [into(&writable)]).unwrap(), 4096);
        let mut back = [0u8; 4096];
        file.read_exact_at(&mut back, 65536).unwrap();
        assert!(back.iter().all(|&b| b == 9));
        // Zeroes are never a write's destination; a range outside the mapping is refused.
        assert!(take(&dev, 0, [Piece::Zeroes(10)]).is_err());
        let outside = Piece::Mapped {
            map: &writable,
            offset: (1 << 20) - 10,
            len: 4096,
        };
        assert!(give(&dev, 0, [outside]).is_err());
    }

    #[test]
    fn a_file_that_shrank_under_its_mapping_is_an_error_not_a_signal() {
        let file = memfd(1 << 20);
        let map = Mapping::with_access(file.as_fd(), 1 << 20, true).unwrap();
        file.set_len(4096).unwrap();
        let dev = memfd(0);
        let past = Piece::Mapped {
            map: &map,
            offset: 65536,
            len: 4096,
        };
        assert!(give(&dev, 0, [past]).is_err());
        assert!(take(&dev, 0, [past]).map_or(true, |n| n < 4096));
    }
}
