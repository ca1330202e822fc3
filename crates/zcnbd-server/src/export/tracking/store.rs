//! Where a tracked bitmap is kept between runs: a small file of its own, with QEMU's rule for
//! crashes. While the server runs, the file says "in use"; a clean stop writes the bits and
//! the identity of the served file's content state as it was left (`identity.rs`), then
//! clears that flag. A file found in use at start was not closed cleanly (a crash, a kill, a
//! power cut), and one whose served file is no longer as it was left was written by someone
//! else while zcnbd was stopped: either way its bits are not trusted, and the bitmap starts
//! all dirty (the next incremental backup copies everything, never less than changed).
//!
//! Layout (little-endian): `ZCNBDBM\0`, version (u32, 2), flags (u32, bit 0: in use),
//! granularity (u64), export size (u64), the served file's identity (56 bytes; zeroes when
//! there is no file), then the bitmap's words (u64 each). A version 1 file (no identity) is
//! read as one whose file changed.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::sys::image_lock::{LOCK_CONFLICT_RETRIES, LOCK_RETRY_WAIT};

use super::bitmap::{BitmapError, DirtyBitmap};
use super::identity::{ContentIdentity, IDENTITY_BYTES};

const MAGIC: &[u8; 8] = b"ZCNBDBM\0";
const VERSION: u32 = 2;
/// Files without the identity.
const VERSION_1: u32 = 1;
const IN_USE: u32 = 1;
const HEADER_BYTES_1: u64 = 32;
const HEADER_BYTES: u64 = HEADER_BYTES_1 + IDENTITY_BYTES as u64;
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
    /// Closed cleanly, but the served file is not as it was left (or the file does not say
    /// how it was left): written while zcnbd was stopped, so all dirty.
    Changed,
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
    /// in use before anything is served. `opened_as` is the served file's identity from
    /// before the export opened it (`None`: no file to compare, as for RBD).
    pub fn open(
        path: &Path,
        size: u64,
        granularity: u64,
        opened_as: Option<ContentIdentity>,
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
        // Asked again a few times: a child another thread forks holds a copy of a bitmap
        // file just closed (and its lock) until its exec (as for images' locks).
        let mut tries = 0;
        while file.try_lock().is_err() {
            if tries == LOCK_CONFLICT_RETRIES {
                return Err(StoreError::Locked {
                    path: path.to_owned(),
                });
            }
            tries += 1;
            std::thread::sleep(LOCK_RETRY_WAIT);
        }
        let len = file.metadata().map_err(io_err)?.len();
        let store = BitmapFile {
            path: path.to_owned(),
            file,
        };
        let (bitmap, mut found, left_as) = if len == 0 {
            (store.bitmap(size, granularity)?, Found::New, None)
        } else {
            store.load(len, size)?
        };
        if found == Found::Clean && opened_as.is_some() && left_as != opened_as {
            found = Found::Changed;
        }
        if matches!(found, Found::Unclean | Found::Changed) {
            bitmap.set_all();
        }
        store.write(&bitmap, true, opened_as).map_err(io_err)?;
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

    /// Reads a file of `len` bytes, checked before anything is allocated: its bits, how it
    /// was closed, and the identity of the served file it recorded.
    fn load(
        &self,
        len: u64,
        size: u64,
    ) -> Result<(DirtyBitmap, Found, Option<ContentIdentity>), StoreError> {
        let mut header = [0u8; HEADER_BYTES as usize];
        if len < HEADER_BYTES_1 {
            return Err(self.malformed("too short"));
        }
        let header_bytes = (len.min(HEADER_BYTES)) as usize;
        self.file
            .read_exact_at(&mut header[..header_bytes], 0)
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
        let (header_bytes, left_as) = match u32_at(8) {
            VERSION if len >= HEADER_BYTES => {
                let identity = header[HEADER_BYTES_1 as usize..]
                    .try_into()
                    .map(ContentIdentity::from_bytes)
                    .ok();
                (HEADER_BYTES, identity)
            }
            VERSION => return Err(self.malformed("too short")),
            VERSION_1 => (HEADER_BYTES_1, None),
            _ => return Err(self.malformed("unknown version")),
        };
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
        if len != header_bytes + bitmap.bytes() as u64 {
            return Err(self.malformed("its length does not match its header"));
        }
        let mut bytes = Vec::with_capacity(bitmap.bytes());
        let mut body = &self.file;
        io::Seek::seek(&mut body, io::SeekFrom::Start(header_bytes))
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
        } else if left_as.is_none() {
            // A version 1 file does not say how it left the served file.
            Found::Changed
        } else {
            Found::Clean
        };
        Ok((bitmap, found, left_as))
    }

    /// Writes the header (flagged in use or not, with the served file's identity) and the
    /// bits, durably.
    fn write(
        &self,
        bitmap: &DirtyBitmap,
        in_use: bool,
        identity: Option<ContentIdentity>,
    ) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(HEADER_BYTES as usize + bitmap.bytes());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&(if in_use { IN_USE } else { 0 }).to_le_bytes());
        bytes.extend_from_slice(&bitmap.granularity().to_le_bytes());
        bytes.extend_from_slice(&bitmap.size().to_le_bytes());
        let identity = identity.map(ContentIdentity::to_bytes);
        bytes.extend_from_slice(&identity.unwrap_or([0; IDENTITY_BYTES]));
        for w in bitmap.words() {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        self.file.write_all_at(&bytes, 0)?;
        self.file.set_len(bytes.len() as u64)?;
        self.file.sync_data()
    }

    /// A clean stop: the bits and `left_as` (the served file's identity now, after the last
    /// write to it), durable, then the flag cleared, durable.
    pub fn close(
        &self,
        bitmap: &DirtyBitmap,
        left_as: Option<ContentIdentity>,
    ) -> Result<(), StoreError> {
        let io_err = |source| StoreError::Io {
            path: self.path.clone(),
            source,
        };
        self.write(bitmap, true, left_as).map_err(io_err)?;
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
        let (store, bitmap, found) = BitmapFile::open(&path, 100 * G, G, None).unwrap();
        assert_eq!(found, Found::New);
        // A second server cannot take it.
        assert!(matches!(
            BitmapFile::open(&path, 100 * G, G, None),
            Err(StoreError::Locked { .. })
        ));
        bitmap.set(5 * G, 1);
        store.close(&bitmap, None).unwrap();
        drop(store);
        let (store, bitmap, found) = BitmapFile::open(&path, 100 * G, 4096, None).unwrap();
        assert_eq!(found, Found::Clean);
        assert_eq!(bitmap.granularity(), G, "the file's granularity is kept");
        assert_eq!(bitmap.dirty_bytes(), G);
        drop(store); // no close: as after kill -9
        let (_store, bitmap, found) = BitmapFile::open(&path, 100 * G, G, None).unwrap();
        assert_eq!(found, Found::Unclean);
        assert_eq!(bitmap.dirty_bytes(), 100 * G);
    }

    #[test]
    fn a_served_file_changed_while_stopped_makes_the_bitmap_all_dirty() {
        let dir = tempfile::tempdir().unwrap();
        let (path, served) = (dir.path().join("b"), dir.path().join("disk"));
        std::fs::write(&served, [0u8; 4096]).unwrap();
        let now = || Some(ContentIdentity::of(&served).unwrap());
        let (store, bitmap, _) = BitmapFile::open(&path, 100 * G, G, now()).unwrap();
        bitmap.set(5 * G, 1);
        store.close(&bitmap, now()).unwrap();
        drop(store);
        // Unchanged: kept.
        let (store, bitmap, found) = BitmapFile::open(&path, 100 * G, G, now()).unwrap();
        assert_eq!((found, bitmap.dirty_bytes()), (Found::Clean, G));
        store.close(&bitmap, now()).unwrap();
        drop(store);
        // Written while stopped (same length): all dirty.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&served)
            .unwrap()
            .write_all_at(b"x", 7)
            .unwrap();
        let (store, bitmap, found) = BitmapFile::open(&path, 100 * G, G, now()).unwrap();
        assert_eq!((found, bitmap.dirty_bytes()), (Found::Changed, 100 * G));
        store.close(&bitmap, now()).unwrap();
        drop(store);
        // A version 1 file does not say: all dirty too.
        let mut old = std::fs::read(&path).unwrap();
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
        old.drain(HEADER_BYTES_1 as usize..HEADER_BYTES as usize);
        std::fs::write(&path, &old).unwrap();
        let (_store, bitmap, found) = BitmapFile::open(&path, 100 * G, G, now()).unwrap();
        assert_eq!((found, bitmap.dirty_bytes()), (Found::Changed, 100 * G));
    }

    #[test]
    fn damaged_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b");
        let (store, bitmap, _) = BitmapFile::open(&path, 100 * G, G, None).unwrap();
        store.close(&bitmap, None).unwrap();
        drop(store);
        let good = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8]| {
            std::fs::write(&path, bytes).unwrap();
            BitmapFile::open(&path, 100 * G, G, None)
                .unwrap_err()
                .to_string()
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
        let err = BitmapFile::open(&path, 1 << 60, G, None).unwrap_err();
        assert!(matches!(err, StoreError::Bitmap { .. }), "{err}");
        std::fs::write(&path, &good).unwrap();
        let err = BitmapFile::open(&path, 200 * G, G, None).unwrap_err();
        assert!(matches!(err, StoreError::SizeChanged { .. }), "{err}");
    }
}
