//! What identifies the content state of the file an export serves, for a tracked bitmap's
//! file: a bitmap saved cleanly is trusted at the next start only if the served file is the
//! same file, unchanged since the save (same device and inode, length, modification and
//! change times). Anything else that wrote it while zcnbd was stopped (QEMU, `dd`, a restore)
//! changed its times, and the bitmap then starts all dirty.
//!
//! A block device's node keeps its times when the device is written: for a device only the
//! device number and inode are compared (writes while stopped cannot be seen; the log says
//! so when such a bitmap is kept).

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// Bytes of an identity in a bitmap's file.
pub const IDENTITY_BYTES: usize = 56;

/// The identity of a file's content state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentIdentity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl ContentIdentity {
    /// The identity of the file at `path` now.
    pub fn of(path: &Path) -> io::Result<ContentIdentity> {
        let meta = std::fs::metadata(path)?;
        if meta.file_type().is_block_device() {
            return Ok(ContentIdentity {
                dev: meta.rdev(),
                ino: meta.ino(),
                len: 0,
                mtime: (0, 0),
                ctime: (0, 0),
            });
        }
        Ok(ContentIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }

    /// Whether it is a block device's (whose writes it cannot tell).
    pub fn is_device(&self) -> bool {
        self.mtime == (0, 0) && self.ctime == (0, 0) && self.len == 0
    }

    /// As stored (little-endian).
    pub fn to_bytes(self) -> [u8; IDENTITY_BYTES] {
        let fields = [
            self.dev,
            self.ino,
            self.len,
            self.mtime.0 as u64,
            self.mtime.1 as u64,
            self.ctime.0 as u64,
            self.ctime.1 as u64,
        ];
        let mut out = [0u8; IDENTITY_BYTES];
        for (chunk, field) in out.chunks_exact_mut(8).zip(fields) {
            chunk.copy_from_slice(&field.to_le_bytes());
        }
        out
    }

    /// From its stored form.
    pub fn from_bytes(bytes: &[u8; IDENTITY_BYTES]) -> ContentIdentity {
        let f =
            |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        ContentIdentity {
            dev: f(0),
            ino: f(1),
            len: f(2),
            mtime: (f(3) as i64, f(4) as i64),
            ctime: (f(5) as i64, f(6) as i64),
        }
    }
}
