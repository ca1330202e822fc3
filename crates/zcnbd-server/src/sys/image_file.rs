//! A disk image's file as imago's storage (`imago::Storage`): the descriptor the image's
//! reads and writes go through is one the engines can reach too, so a data cluster the image
//! maps to a file offset is sent and received there by splice, sendfile or a ring write
//! (`export::base::image`). imago's own `File` keeps its descriptor to itself, hence this.
//!
//! The `unsafe` here is imago's: its storage reads and writes are `unsafe fn`s that take
//! vectors of caller memory ("the caller must not access the buffers while the call runs",
//! which imago upholds), and the vectors become `iovec`s for `preadv`/`pwritev`.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::Storage;
use rustix::fs::{fallocate, fdatasync, FallocateFlags, SeekFrom};

/// One file of an image (the image itself, a backing file, an overlay), open read-only or
/// read-write.
#[derive(Debug)]
pub struct ImageFile {
    file: File,
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
            path,
            size: AtomicU64::new(size),
            helper: CommonStorageHelper::default(),
        })
    }

    /// A second descriptor of the same open file (its OFD locks are the same locks).
    pub fn duplicate(&self) -> io::Result<ImageFile> {
        Ok(ImageFile {
            file: self.file.try_clone()?,
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
            let n = retry(|| {
                // SAFETY: `iov` describes `iov.len()` writable buffers (above); the
                // descriptor is ours and open.
                unsafe {
                    libc::preadv(
                        self.raw_fd(),
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
            let n = retry(|| {
                // SAFETY: `iov` describes `iov.len()` readable buffers; the descriptor is
                // ours and open.
                unsafe {
                    libc::pwritev(
                        self.raw_fd(),
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
