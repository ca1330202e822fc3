//! A disk image's file as imago's storage (`imago::Storage`): the descriptor the image's
//! reads and writes go through is one the engines can reach too, so a data cluster the image
//! maps to a file offset is sent and received there by splice, sendfile or a ring write
//! (`export::base::image`). imago's own `File` keeps its descriptor to itself, hence this.
//!
//! The `unsafe` here is imago's: its storage reads and writes are `unsafe fn`s that take
//! vectors of caller memory ("the caller must not access the buffers while the call runs",
//! which imago upholds), and the vectors become `iovec`s for `preadv`/`pwritev`.
//!
//! With `--direct` (QEMU's `cache=none`) a file also has an O_DIRECT descriptor of the same
//! file: the engines read and write data clusters through it ([`ImageFile::direct_fd`]), and
//! imago's own reads and writes use it when every buffer, the offset and the length are
//! aligned to [`DIRECT_ALIGN_BYTES`] (guest data in an engine's buffers); anything else -
//! imago's tables in its own buffers, a partial cluster - goes through the buffered one. Linux
//! keeps the two coherent: a direct read writes back dirty cached pages of its range first, a
//! direct write drops them.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::Storage;
use rustix::fs::{fallocate, fdatasync, FallocateFlags, SeekFrom};

/// The alignment of buffers, offsets and lengths that go to an O_DIRECT descriptor (the
/// logical block size of every disk and file system zcnbd serves from, at most).
pub const DIRECT_ALIGN_BYTES: u64 = 4096;

/// One file of an image (the image itself, a backing file, an overlay), open read-only or
/// read-write.
#[derive(Debug)]
pub struct ImageFile {
    file: File,
    /// The same file opened with O_DIRECT, with `--direct`.
    direct: Option<File>,
    /// What backing file names in it are resolved against; what the log calls it.
    path: PathBuf,
    /// Its length, which writes past the end grow.
    size: AtomicU64,
    helper: CommonStorageHelper,
}

impl ImageFile {
    /// Opens `path` (a regular file or a block device).
    pub fn open(path: &Path, writable: bool) -> io::Result<ImageFile> {
        let file = OpenOptions::new().read(true).write(writable).open(path)?;
        ImageFile::from_file(file, path.to_owned())
    }

    /// An open file, called `path` (an overlay made unnamed, named for the log).
    pub fn from_file(file: File, path: PathBuf) -> io::Result<ImageFile> {
        // Block devices report length 0 in metadata; seeking to the end works for both.
        let size = rustix::fs::seek(&file, SeekFrom::End(0))?;
        Ok(ImageFile {
            file,
            direct: None,
            path,
            size: AtomicU64::new(size),
            helper: CommonStorageHelper::default(),
        })
    }

    /// This file with an O_DIRECT descriptor of its own beside the buffered one (opened
    /// through `/proc/self/fd`: the same inode whatever became of the path). A file system
    /// that refuses O_DIRECT (tmpfs) is an error that says so.
    pub fn with_direct(mut self) -> io::Result<ImageFile> {
        let proc_path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        let writable = rustix::fs::fcntl_getfl(&self.file)?.contains(rustix::fs::OFlags::RDWR);
        let direct = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(proc_path)
            .map_err(|e| io::Error::new(e.kind(), format!("O_DIRECT open: {e}")))?;
        self.direct = Some(direct);
        Ok(self)
    }

    /// The O_DIRECT descriptor, with `--direct`.
    pub fn direct_fd(&self) -> Option<RawFd> {
        self.direct.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// A second descriptor of the same open file (its OFD locks are the same locks).
    pub fn duplicate(&self) -> io::Result<ImageFile> {
        Ok(ImageFile {
            file: self.file.try_clone()?,
            direct: self.direct.as_ref().map(File::try_clone).transpose()?,
            path: self.path.clone(),
            size: AtomicU64::new(self.length()),
            helper: CommonStorageHelper::default(),
        })
    }

    /// The descriptor (open as long as the image is).
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The open file (for locks).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its length in bytes (as of the last write through it).
    pub fn length(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// Gives the file system back the blocks of `[offset, offset+len)`, which then read as
    /// zeroes; a file system that cannot punch holes keeps them (the caller's data already
    /// reads as zeroes through the image's metadata, so this only saves space).
    pub fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        match fallocate(&self.file, mode, offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Makes what was written durable.
    pub fn sync_data(&self) -> io::Result<()> {
        Ok(fdatasync(&self.file)?)
    }
}

impl ImageFile {
    /// The descriptor for an I/O of `iov` at `offset`: the O_DIRECT one if there is one and
    /// every buffer's address and length, and the offset, are aligned, and the range lies in
    /// the file's aligned length (a direct read of the tail would come back short); else the
    /// buffered one.
    fn fd_for(&self, iov: &[libc::iovec], offset: u64) -> RawFd {
        let Some(direct) = &self.direct else {
            return self.raw_fd();
        };
        let aligned = |n: u64| n.is_multiple_of(DIRECT_ALIGN_BYTES);
        let mut total = 0u64;
        let buffers_aligned = iov.iter().all(|v| {
            total = total.saturating_add(v.iov_len as u64);
            aligned(v.iov_base as u64) && aligned(v.iov_len as u64)
        });
        let inside = offset
            .checked_add(total)
            .is_some_and(|end| end <= self.length() / DIRECT_ALIGN_BYTES * DIRECT_ALIGN_BYTES);
        if buffers_aligned && aligned(offset) && total > 0 && inside {
            direct.as_raw_fd()
        } else {
            self.raw_fd()
        }
    }
}

impl fmt::Display for ImageFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())
    }
}

impl Storage for ImageFile {
    fn size(&self) -> io::Result<u64> {
        Ok(self.size.load(Ordering::Relaxed))
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        // As QEMU does: a relative backing file name is relative to the image's directory.
        let relative = relative.as_ref();
        if relative.is_absolute() {
            return Ok(relative.to_owned());
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        Ok(dir.join(relative))
    }

    fn get_filename(&self) -> Option<PathBuf> {
        Some(self.path.clone())
    }

    unsafe fn pure_readv(&self, mut bufv: IoVectorMut<'_>, mut offset: u64) -> io::Result<()> {
        while !bufv.is_empty() {
            // SAFETY: the vector's buffers are caller memory imago lends for this call (the
            // trait's contract); the iovecs live as long as `bufv`, past the system call.
            let iov = unsafe { bufv.as_iovec() };
            let fd = self.fd_for(iov, offset);
            let n = retry(|| {
                // SAFETY: `iov` describes `iov.len()` writable buffers (above); the
                // descriptor is ours and open.
                unsafe {
                    libc::preadv(
                        fd,
                        iov.as_ptr(),
                        iov.len().min(libc::c_int::MAX as usize) as libc::c_int,
                        offset as libc::off_t,
                    )
                }
            })?;
            if n == 0 {
                // Past the end of the file reads as zeroes (the trait asks for it).
                bufv.fill(0);
                break;
            }
            bufv = bufv.split_tail_at(n);
            offset += n;
        }
        Ok(())
    }

    unsafe fn pure_writev(&self, mut bufv: IoVector<'_>, mut offset: u64) -> io::Result<()> {
        while !bufv.is_empty() {
            // SAFETY: as in `pure_readv`, the buffers are lent for this call.
            let iov = unsafe { bufv.as_iovec() };
            let fd = self.fd_for(iov, offset);
            let n = retry(|| {
                // SAFETY: `iov` describes `iov.len()` readable buffers; the descriptor is
                // ours and open.
                unsafe {
                    libc::pwritev(
                        fd,
                        iov.as_ptr(),
                        iov.len().min(libc::c_int::MAX as usize) as libc::c_int,
                        offset as libc::off_t,
                    )
                }
            })?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            bufv = bufv.split_tail_at(n);
            offset += n;
            self.size.fetch_max(offset, Ordering::Relaxed);
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        // Nothing buffered here: writes are system calls.
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        // No cache of its own to drop.
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        &self.helper
    }
}

/// Runs a system call that returns a byte count or -1, again when interrupted.
fn retry(call: impl Fn() -> isize) -> io::Result<u64> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as u64);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(buf: &[u8]) -> libc::iovec {
        libc::iovec {
            iov_base: buf.as_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        }
    }

    #[test]
    fn only_aligned_io_inside_the_aligned_length_goes_direct() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![0u8; 3 * 4096 + 100]).unwrap();
        let plain = ImageFile::open(&path, true).unwrap();
        let mem = vec![0u8; 4 * 4096];
        let a = mem.as_ptr().align_offset(4096);
        let page = &mem[a..a + 4096];
        assert_eq!(plain.fd_for(&[iov(page)], 0), plain.raw_fd());
        let file = plain.with_direct().unwrap();
        let direct = file.direct_fd().unwrap();
        assert_ne!(direct, file.raw_fd());
        let two = [iov(page), iov(&mem[a + 4096..a + 8192])];
        assert_eq!(file.fd_for(&two, 4096), direct);
        // Unaligned memory, offset or length; the file's last partial block; nothing.
        assert_eq!(file.fd_for(&[iov(&mem[a + 1..a + 4097])], 0), file.raw_fd());
        assert_eq!(file.fd_for(&[iov(page)], 512), file.raw_fd());
        assert_eq!(file.fd_for(&[iov(&page[..512])], 0), file.raw_fd());
        assert_eq!(file.fd_for(&[iov(page)], 3 * 4096), file.raw_fd());
        assert_eq!(file.fd_for(&[], 0), file.raw_fd());
        let copy = file.duplicate().unwrap();
        assert!(copy.direct_fd().is_some_and(|d| d != direct));
    }
}
