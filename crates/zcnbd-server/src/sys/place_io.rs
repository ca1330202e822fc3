//! Plain system calls on a descriptor that an export's stack named in a place (a
//! [`Place`](crate::export::Place) carries a `RawFd`, as io_uring operations take them).
//!
//! The invariant the `unsafe` here rests on is the one the io_uring driver's file operations
//! rest on: a place's descriptor stays open as long as the stack that named it, and the
//! connection using the place holds that stack (through its dispatcher) until none of its
//! operations is in flight.

use std::os::fd::{AsFd, BorrowedFd, RawFd};

use super::mapping::Mapping;

/// `sendfile(2)` of up to `len` bytes of the file `file` from `*position` to `socket`.
pub fn sendfile(
    socket: impl AsFd,
    file: RawFd,
    position: &mut u64,
    len: usize,
) -> rustix::io::Result<usize> {
    // SAFETY: `file` is a place's descriptor, open while the stack that named it is held (the
    // module's invariant); it is borrowed only for this call.
    let file = unsafe { BorrowedFd::borrow_raw(file) };
    rustix::fs::sendfile(socket, file, Some(position), len)
}

/// Whether `file` lives in memory (tmpfs - `/tmp` on many systems, `/dev/shm`, a memfd - or
/// ramfs): a read or write there is a copy that waits for no device, and such a file has no
/// non-blocking reads (`FMODE_NOWAIT`), so io_uring hands every operation on it to a worker
/// thread. `false` when the file system cannot be told.
pub fn in_memory(file: RawFd) -> bool {
    // SAFETY: as in `sendfile`: a place's descriptor, borrowed only for this call.
    let file = unsafe { BorrowedFd::borrow_raw(file) };
    // ramfs's magic (include/uapi/linux/magic.h), which the libc crate does not name.
    const RAMFS_MAGIC: libc::c_long = 0x8584_58f6_u32 as libc::c_long;
    match rustix::fs::fstatfs(file) {
        Ok(fs) => fs.f_type == libc::TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC,
        Err(_) => false,
    }
}

/// A shared mapping of the whole of `file` as it is now (writable if the descriptor was
/// opened for writing), and whether the file has no holes (its blocks cover its size: a
/// read through the mapping then never makes the file take memory it did not hold).
/// `None`: the file is empty.
pub fn map_whole(file: RawFd) -> std::io::Result<Option<(Mapping, bool)>> {
    // SAFETY: as in `sendfile`: a place's descriptor, borrowed only for this call (the mapping
    // holds the file by itself once made).
    let file = unsafe { BorrowedFd::borrow_raw(file) };
    let stat = rustix::fs::fstat(file)?;
    let size = u64::try_from(stat.st_size).unwrap_or(0);
    if size == 0 {
        return Ok(None);
    }
    let dense = u64::try_from(stat.st_blocks)
        .unwrap_or(0)
        .saturating_mul(512)
        >= size;
    let mode = rustix::fs::fcntl_getfl(file)? & rustix::fs::OFlags::ACCMODE;
    let writable = mode == rustix::fs::OFlags::RDWR || mode == rustix::fs::OFlags::WRONLY;
    Ok(Some((Mapping::with_access(file, size, writable)?, dense)))
}

/// Fills `buf` from `file` at `offset`; EIO if the file ends first (it shrank).
pub fn read_exact_at(file: RawFd, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    // SAFETY: as in `sendfile`: a place's descriptor, borrowed only for this call.
    let file = unsafe { BorrowedFd::borrow_raw(file) };
    while !buf.is_empty() {
        match rustix::io::pread(file, &mut *buf, offset) {
            Ok(0) => return Err(std::io::Error::from_raw_os_error(libc::EIO)),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes all of `buf` to `file` at `offset`, durably first if `dsync` (`RWF_DSYNC`).
pub fn write_all_at(
    file: RawFd,
    mut buf: &[u8],
    mut offset: u64,
    dsync: bool,
) -> std::io::Result<()> {
    // SAFETY: as in `sendfile`: a place's descriptor, borrowed only for this call.
    let file = unsafe { BorrowedFd::borrow_raw(file) };
    let flags = match dsync {
        true => rustix::io::ReadWriteFlags::DSYNC,
        false => rustix::io::ReadWriteFlags::empty(),
    };
    while !buf.is_empty() {
        match rustix::io::pwritev2(file, &[std::io::IoSlice::new(buf)], offset, flags) {
            Ok(0) => return Err(std::io::Error::from_raw_os_error(libc::EIO)),
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn a_memfd_is_in_memory_and_a_file_on_disk_may_not_be() {
        let memfd = rustix::fs::memfd_create("place-io", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        assert!(in_memory(memfd.as_raw_fd()));
        // The test's own binary is on whatever holds the build: only tmpfs and ramfs count.
        let exe = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
        let fs = rustix::fs::fstatfs(&exe).unwrap();
        assert_eq!(in_memory(exe.as_raw_fd()), fs.f_type == libc::TMPFS_MAGIC);
    }

    #[test]
    fn a_whole_file_is_mapped_with_its_access_and_whether_it_has_holes() {
        let memfd = rustix::fs::memfd_create("place-io", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let fd = memfd.as_raw_fd();
        assert!(map_whole(fd).unwrap().is_none());
        write_all_at(fd, &[7u8; 8192], 0, false).unwrap();
        let (map, dense) = map_whole(fd).unwrap().unwrap();
        assert!(dense && map.writable());
        rustix::fs::ftruncate(&memfd, 1 << 20).unwrap();
        let (_, dense) = map_whole(fd).unwrap().unwrap();
        assert!(!dense);
        let path = format!("/proc/self/fd/{fd}");
        let read_only = std::fs::File::open(path).unwrap();
        let (map, _) = map_whole(read_only.as_raw_fd()).unwrap().unwrap();
        assert!(!map.writable());
    }

    #[test]
    fn reads_and_writes_whole_ranges_and_a_short_file_is_an_io_error() {
        let memfd = rustix::fs::memfd_create("place-io", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let fd = memfd.as_raw_fd();
        write_all_at(fd, &[7u8; 8192], 4096, false).unwrap();
        write_all_at(fd, &[9u8; 100], 0, true).unwrap();
        let mut back = vec![0u8; 12288];
        read_exact_at(fd, &mut back, 0).unwrap();
        assert!(back[..100].iter().all(|&b| b == 9));
        assert!(back[100..4096].iter().all(|&b| b == 0));
        assert!(back[4096..].iter().all(|&b| b == 7));
        // The file ends 4 KiB into this read.
        let err = read_exact_at(fd, &mut back[..8192], 8192).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO));
    }
}
