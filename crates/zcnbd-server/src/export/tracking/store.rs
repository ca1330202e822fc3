//! Where a tracked bitmap is kept between runs: a small file of its own, with QEMU's rule for
//! crashes. While the server runs, the file says "in use"; a clean stop writes the bits and
//! then clears that flag. A file found in use at start was not closed cleanly (a crash, a
//! kill, a power cut): its bits are not trusted, and the bitmap starts all dirty (the next
//! incremental backup copies everything, never less than changed).
//!
//! Layout (little-endian): `ZCNBDBM\0`, version (u32, 1), flags (u32, bit 0: in use),
//! granularity (u64), export size (u64), then the bitmap's words (u64 each).

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::bitmap::{BitmapError, DirtyBitmap};

const MAGIC: &[u8; 8] = b"ZCNBDBM\0";
const VERSION: u32 = 1;
const IN_USE: u32 = 1;
const HEADER_BYTES: u64 = 32;
/// Where the flags are.
const FLAGS_AT: u64 = 12;

/// Why a bitmap's file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: not a zcnbd bitmap file ({why})", path.display())]
    Malformed { path: PathBuf, why: &'static str },
    #[error("{}: made for an export of {was} bytes, which now has {now}: remove the file to start the bitmap afresh", path.display())]
    SizeChanged { path: PathBuf, was: u64, now: u64 },
    #[error("{}: in use by another server (it is locked)", path.display())]
    Locked { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Bitmap { path: PathBuf, source: BitmapError },
}

/// What opening a bitmap's file found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// No file: a new, empty bitmap.
    New,
    /// Closed cleanly: its bits.
    Clean,
    /// Still marked in use: not closed cleanly, so all dirty.
    Unclean,
}

/// A bitmap's file, open, locked and marked in use.
#[derive(Debug)]
pub struct BitmapFile {
    path: PathBuf,
    file: File,
}

impl BitmapFile {
    /// Opens (or creates) the file at `path` for a bitmap of an export of `size` bytes at
    /// `granularity` (a file keeps the granularity it was made with), locks it, and marks it
    /// in use before anything is served.
    pub fn open(
        path: &Path,
        size: u64,
        granularity: u64,
    ) -> Result<(BitmapFile, DirtyBitmap, Found), StoreError> {
        let io_err = |source| StoreError::Io {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err)?;
        if file.try_lock().is_err() {
            return Err(StoreError::Locked {
                path: path.to_owned(),
            });
        }
        let len = file.metadata().map_err(io_err)?.len();
        let store = BitmapFile {
            path: path.to_owned(),
            file,
        };
        let (bitmap, found) = if len == 0 {
            (store.bitmap(size, granularity)?, Found::New)
        } else {
            store.load(len, size)?
        };
        if found == Found::Unclean {
            bitmap.set_all();
        }
        store.write(&bitmap, true).map_err(io_err)?;
        if found == Found::New {
            if let Some(dir) = path.parent() {
                // The new name itself is durable.
                File::open(dir).and_then(|d| d.sync_all()).map_err(io_err)?;
            }
        }
        Ok((store, bitmap, found))
    }

    fn bitmap(&self, size: u64, granularity: u64) -> Result<DirtyBitmap, StoreError> {
        DirtyBitmap::new(size, granularity).map_err(|source| StoreError::Bitmap {
            path: self.path.clone(),
            source,
        })
    }

    fn malformed(&self, why: &'static str) -> StoreError {
        StoreError::Malformed {
            path: self.path.clone(),
            why,
        }
    }

    /// Reads a file of `len` bytes, checked before anything is allocated.
    fn load(&self, len: u64, size: u64) -> Result<(DirtyBitmap, Found), StoreError> {
        let mut header = [0u8; HEADER_BYTES as usize];
        if len < HEADER_BYTES {
            return Err(self.malformed("too short"));
        }
        self.file
            .read_exact_at(&mut header, 0)
            .map_err(|source| StoreError::Io {
                path: self.path.clone(),
                source,
            })?;
        let u32_at =
            |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap_or_default());
        let u64_at =
            |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or_default());
        if &header[..8] != MAGIC {
            return Err(self.malformed("bad magic"));
        }
        if u32_at(8) != VERSION {
            return Err(self.malformed("unknown version"));
        }
        let flags = u32_at(12);
        if flags & !IN_USE != 0 {
            return Err(self.malformed("unknown flags"));
        }
        let (granularity, was) = (u64_at(16), u64_at(24));
        if was != size {
            return Err(StoreError::SizeChanged {
                path: self.path.clone(),
                was,
                now: size,
            });
        }
        let bitmap = self.bitmap(size, granularity)?;
        if len != HEADER_BYTES + bitmap.bytes() as u64 {
            return Err(self.malformed("its length does not match its header"));
        }
        let mut bytes = Vec::with_capacity(bitmap.bytes());
        let mut body = &self.file;
        io::Seek::seek(&mut body, io::SeekFrom::Start(HEADER_BYTES))
            .and_then(|_| body.take(bitmap.bytes() as u64).read_to_end(&mut bytes))
            .map_err(|source| StoreError::Io {
                path: self.path.clone(),
                source,
            })?;
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        bitmap.merge_words(&words);
        let found = if flags & IN_USE != 0 {
            Found::Unclean
        } else {
            Found::Clean
        };
        Ok((bitmap, found))
    }

    /// Writes the header (flagged in use or not) and the bits, durably.
    fn write(&self, bitmap: &DirtyBitmap, in_use: bool) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(HEADER_BYTES as usize + bitmap.bytes());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&(if in_use { IN_USE } else { 0 }).to_le_bytes());
        bytes.extend_from_slice(&bitmap.granularity().to_le_bytes());
        bytes.extend_from_slice(&bitmap.size().to_le_bytes());
        for w in bitmap.words() {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        self.file.write_all_at(&bytes, 0)?;
        self.file.set_len(bytes.len() as u64)?;
        self.file.sync_data()
    }

    /// A clean stop: the bits, durable, then the flag cleared, durable.
    pub fn close(&self, bitmap: &DirtyBitmap) -> Result<(), StoreError> {
        let io_err = |source| StoreError::Io {
            path: self.path.clone(),
            source,
        };
        self.write(bitmap, true).map_err(io_err)?;
        self.file
            .write_all_at(&0u32.to_le_bytes(), FLAGS_AT)
            .and_then(|()| self.file.sync_data())
            .map_err(io_err)
    }

    /// Deletes the file (the bitmap was removed).
    pub fn remove(self) -> Result<(), StoreError> {
        std::fs::remove_file(&self.path).map_err(|source| StoreError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 64 << 10;

    #[test]
    fn a_clean_close_keeps_the_bits_and_an_unclean_one_makes_them_all_dirty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b");
        let (store, bitmap, found) = BitmapFile::open(&path, 100 * G, G).unwrap();
        assert_eq!(found, Found::New);
        // A second server cannot take it.
        assert!(matches!(
            BitmapFile::open(&path, 100 * G, G),
            Err(StoreError::Locked { .. })
        ));
        bitmap.set(5 * G, 1);
        store.close(&bitmap).unwrap();
        drop(store);
        let (store, bitmap, found) = BitmapFile::open(&path, 100 * G, 4096).unwrap();
        assert_eq!(found, Found::Clean);
        assert_eq!(bitmap.granularity(), G, "the file's granularity is kept");
        assert_eq!(bitmap.dirty_bytes(), G);
        drop(store); // no close: as after kill -9
        let (_store, bitmap, found) = BitmapFile::open(&path, 100 * G, G).unwrap();
        assert_eq!(found, Found::Unclean);
        assert_eq!(bitmap.dirty_bytes(), 100 * G);
    }

    #[test]
    fn damaged_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b");
        let (store, bitmap, _) = BitmapFile::open(&path, 100 * G, G).unwrap();
        store.close(&bitmap).unwrap();
        drop(store);
        let good = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8]| {
            std::fs::write(&path, bytes).unwrap();
            BitmapFile::open(&path, 100 * G, G).unwrap_err().to_string()
        };
        assert!(refused(&good[..10]).contains("too short"));
        assert!(refused(&good[..good.len() - 1]).contains("length"));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(refused(&bad).contains("magic"));
        let mut bad = good.clone();
        bad[16..24].copy_from_slice(&3000u64.to_le_bytes());
        assert!(refused(&bad).contains("granularity"));
        let mut bad = good.clone();
        bad[16..24].copy_from_slice(&512u64.to_le_bytes());
        bad[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        std::fs::write(&path, &bad).unwrap();
        let err = BitmapFile::open(&path, 1 << 60, G).unwrap_err();
        assert!(matches!(err, StoreError::Bitmap { .. }), "{err}");
        std::fs::write(&path, &good).unwrap();
        let err = BitmapFile::open(&path, 200 * G, G).unwrap_err();
        assert!(matches!(err, StoreError::SizeChanged { .. }), "{err}");
    }
}
