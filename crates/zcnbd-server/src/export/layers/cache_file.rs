//! The cache layer's file: a sparse file as large as the export in the cache directory,
//! unnamed (`O_TMPFILE`, or created and unlinked at once where the filesystem has no
//! unnamed files), so nothing is left behind whatever way the server ends. Block `n` of the
//! export lives at the same offset in the file; a block dropped from the cache becomes a
//! hole again.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rustix::fs::{fallocate, FallocateFlags};

/// The directory `--cache-dir` named, for every cache layer without a `cache-dir` option.
static COMMAND_LINE_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Sets the directory cache files go to when a cache layer names none (`--cache-dir`); the
/// first call counts.
pub fn set_default_dir(dir: PathBuf) {
    let _ = COMMAND_LINE_DIR.set(dir);
}

/// Where cache files go when no directory is named: `--cache-dir`, else `$TMPDIR`, else
/// /var/tmp (as nbdkit's cache filter: /tmp is often a small tmpfs).
pub fn default_dir() -> PathBuf {
    if let Some(dir) = COMMAND_LINE_DIR.get() {
        return dir.clone();
    }
    std::env::var_os("TMPDIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp"))
}

/// An unnamed sparse file.
#[derive(Debug)]
pub struct CacheFile {
    file: File,
}

impl CacheFile {
    /// A new file of `size` bytes (all hole) in `dir`.
    pub fn create(dir: &Path, size: u64) -> io::Result<CacheFile> {
        let unnamed = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(dir);
        let file = match unnamed {
            Ok(file) => file,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
                Self::create_and_unlink(dir)?
            }
            Err(e) => return Err(e),
        };
        file.set_len(size)?;
        Ok(CacheFile { file })
    }

    fn create_and_unlink(dir: &Path) -> io::Result<File> {
        for attempt in 0..100u32 {
            let path = dir.join(format!(".zcnbd-cache-{}-{attempt}", std::process::id()));
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(file) => {
                    std::fs::remove_file(&path)?;
                    return Ok(file);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "no free name for a cache file",
        ))
    }

    /// The file's descriptor, for places an engine reads from (block `n` at its own offset).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    pub fn write(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    /// Makes `[offset, offset+len)` a hole (its blocks leave the cache).
    pub fn drop_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        fallocate(&self.file, mode, offset, len).map_err(io::Error::from)
    }

    /// Bytes the file holds on disk.
    #[cfg(test)]
    pub fn allocated(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map_or(0, |m| m.blocks() * 512)
    }
}
