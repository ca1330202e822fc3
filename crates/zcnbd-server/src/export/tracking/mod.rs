//! Dirty bitmaps zcnbd tracks itself (`-B NAME` on an export that is not a qcow2 image holding
//! a bitmap of that name): the top layer of the export's stack records every write, trim and
//! write-zeroes in each of the export's bitmaps, and offers each as QEMU's
//! `qemu:dirty-bitmap:NAME` context, which backup tools read to copy only what changed.
//!
//! A bit is set once its write has landed and before the write is acknowledged (the engines
//! tell the stack of writes they land in place themselves: `Backend::wrote_in_place`), so a
//! bitmap cleared at any moment records every write acknowledged after that moment.
//!
//! Bitmaps are kept in files (`store.rs`) beside the export's file, or in `--bitmap-dir`;
//! a memory export's live only as long as its data. Bitmaps are created, cleared and removed
//! while clients are attached ([`Bitmaps::add`], [`Bitmaps::clear`], [`Bitmaps::remove`]:
//! the control socket, and a reload of `--config`).

mod bitmap;
mod identity;
mod store;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tracing::{info, warn};
use zcnbd_proto::meta::DIRTY_BITMAP_PREFIX;
use zcnbd_proto::Extent;

pub use bitmap::{
    BitmapError, DirtyBitmap, BITMAP_BITS_MAX, DIRTY, GRANULARITY_DEFAULT, GRANULARITY_MAX,
    GRANULARITY_MIN, SCAN_BITS_MAX,
};
pub use identity::ContentIdentity;
pub use store::{Found, StoreError};

use super::async_op::{AsyncOp, Completion};
use super::backend::Backend;
use super::flags::{ZeroError, ZeroFlags};
use super::layer::Layer;
use store::BitmapFile;

/// Most bitmaps one export tracks (each is a metadata context, and a selection numbers at
/// most 32 of them).
pub const TRACKED_BITMAPS_MAX: usize = 16;
/// The longest bitmap name (QEMU's).
pub const BITMAP_NAME_BYTES_MAX: usize = 1023;

/// Why a tracked bitmap cannot be made, found or kept.
#[derive(Debug, thiserror::Error)]
pub enum TrackingError {
    #[error(
        "bitmap name {0:?}: use 1 to 1023 letters, digits, '.', '_' or '-', not starting with '.'"
    )]
    Name(String),
    #[error("export {export:?} already has a bitmap {name:?}")]
    Exists { export: String, name: String },
    #[error("export {export:?} has no bitmap {name:?}")]
    NoSuch { export: String, name: String },
    #[error("export {export:?} has {max} bitmaps already (TRACKED_BITMAPS_MAX)")]
    TooMany { export: String, max: usize },
    #[error("export {export:?}, bitmap {name:?}: {source}")]
    Bitmap {
        export: String,
        name: String,
        source: BitmapError,
    },
    #[error("export {export:?}, bitmap {name:?}: {source}")]
    Store {
        export: String,
        name: String,
        source: StoreError,
    },
}

/// Where an export's tracked bitmaps are kept between runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BitmapHome {
    /// In memory only (a memory or null export: its data does not outlive the server).
    Memory,
    /// In files `DIR/STEM.NAME.zcnbd-bitmap`.
    Files { dir: PathBuf, stem: String },
}

impl BitmapHome {
    fn path(&self, name: &str) -> Option<PathBuf> {
        match self {
            BitmapHome::Memory => None,
            BitmapHome::Files { dir, stem } => {
                Some(dir.join(format!("{stem}.{name}.zcnbd-bitmap")))
            }
        }
    }
}

/// The file an export serves, for its bitmaps' files (see `identity.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedFile {
    pub path: PathBuf,
    /// Its identity from before the export opened it (and so before zcnbd wrote it).
    pub opened_as: ContentIdentity,
}

impl ServedFile {
    /// The file at `path`, as it is now (`None` if it cannot be looked at: then nothing is
    /// compared, and the open that follows fails anyway).
    pub fn now(path: &Path) -> Option<ServedFile> {
        let opened_as = ContentIdentity::of(path).ok()?;
        Some(ServedFile {
            path: path.to_owned(),
            opened_as,
        })
    }
}

/// Whether `name` can name a tracked bitmap (and so a file).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= BITMAP_NAME_BYTES_MAX
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// One tracked bitmap.
#[derive(Debug)]
struct Tracked {
    name: String,
    /// `qemu:dirty-bitmap:NAME`.
    context: String,
    bits: DirtyBitmap,
    /// Its file, while it has one.
    file: Mutex<Option<BitmapFile>>,
}

/// What [`Bitmaps::list`] says of one bitmap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u64,
    /// Bytes of the export written since it was made or cleared.
    pub dirty_bytes: u64,
    /// Its file (`None`: in memory only).
    pub file: Option<PathBuf>,
}

/// An export's tracked bitmaps.
#[derive(Debug)]
pub struct Bitmaps {
    export: String,
    size: u64,
    home: BitmapHome,
    /// The file the export serves (none for memory, RBD).
    served: Option<ServedFile>,
    /// The granularity of bitmaps made without one.
    granularity: u64,
    tracked: RwLock<Vec<Arc<Tracked>>>,
    /// Saved since the last change to the set (so a second save at exit does nothing).
    saved: AtomicBool,
}

impl Bitmaps {
    /// The bitmaps of export `export` (of `size` bytes, the content of `served` if it serves
    /// a file), kept in `home`; new ones get `granularity` unless given one. None yet.
    pub fn new(
        export: &str,
        size: u64,
        home: BitmapHome,
        granularity: u64,
        served: Option<ServedFile>,
    ) -> Bitmaps {
        Bitmaps {
            export: export.to_owned(),
            size,
            home,
            served,
            granularity,
            tracked: RwLock::new(Vec::new()),
            saved: AtomicBool::new(false),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Tracked>>> {
        self.tracked.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Tracked>>> {
        self.tracked.write().unwrap_or_else(|e| e.into_inner())
    }

    fn no_such(&self, name: &str) -> TrackingError {
        TrackingError::NoSuch {
            export: self.export.clone(),
            name: name.to_owned(),
        }
    }

    /// Starts tracking `name`: from its file if it has one (as it was left: clean, or all
    /// dirty after an unclean stop), else empty. What it found is logged.
    pub fn add(&self, name: &str, granularity: Option<u64>) -> Result<(), TrackingError> {
        if !valid_name(name) {
            return Err(TrackingError::Name(name.to_owned()));
        }
        let mut tracked = self.write();
        if tracked.iter().any(|t| t.name == name) {
            return Err(TrackingError::Exists {
                export: self.export.clone(),
                name: name.to_owned(),
            });
        }
        if tracked.len() >= TRACKED_BITMAPS_MAX {
            return Err(TrackingError::TooMany {
                export: self.export.clone(),
                max: TRACKED_BITMAPS_MAX,
            });
        }
        let granularity = granularity.unwrap_or(self.granularity);
        let (bits, file) = match self.home.path(name) {
            None => {
                let bits = DirtyBitmap::new(self.size, granularity).map_err(|source| {
                    TrackingError::Bitmap {
                        export: self.export.clone(),
                        name: name.to_owned(),
                        source,
                    }
                })?;
                (bits, None)
            }
            Some(path) => {
                let opened_as = self.served.as_ref().map(|s| s.opened_as);
                let (file, bits, found) =
                    BitmapFile::open(&path, self.size, granularity, opened_as).map_err(
                        |source| TrackingError::Store {
                            export: self.export.clone(),
                            name: name.to_owned(),
                            source,
                        },
                    )?;
                self.log_found(name, &path, found, &bits);
                (bits, Some(file))
            }
        };
        info!(
            export = %self.export,
            bitmap = name,
            granularity = bits.granularity(),
            memory = bits.bytes(),
            "tracking dirty bitmap qemu:dirty-bitmap:{name}"
        );
        tracked.push(Arc::new(Tracked {
            context: format!("{DIRTY_BITMAP_PREFIX}{name}"),
            name: name.to_owned(),
            bits,
            file: Mutex::new(file),
        }));
        Ok(())
    }

    fn log_found(&self, name: &str, path: &Path, found: Found, bits: &DirtyBitmap) {
        let (export, file) = (&self.export, path.display());
        match found {
            Found::New => info!(%export, bitmap = name, %file, "new bitmap: empty"),
            Found::Clean
                if self
                    .served
                    .as_ref()
                    .is_some_and(|s| s.opened_as.is_device()) =>
            {
                info!(%export, bitmap = name, %file, dirty = bits.dirty_bytes(), "bitmap kept from the last run (the export is a device: writes to it while zcnbd was stopped cannot be seen)")
            }
            Found::Clean => {
                info!(%export, bitmap = name, %file, dirty = bits.dirty_bytes(), "bitmap kept from the last run")
            }
            Found::Changed => warn!(
                %export,
                bitmap = name,
                %file,
                "the export's file was changed while zcnbd was stopped (or the bitmap file is from an older zcnbd): reported all dirty, so the next incremental backup copies everything"
            ),
            Found::Unclean => warn!(
                %export,
                bitmap = name,
                %file,
                "bitmap was not saved cleanly (the server crashed or was killed): reported all dirty, so the next incremental backup copies everything"
            ),
        }
    }

    /// Marks `name` clean (a backup tool's checkpoint): writes acknowledged from now on are
    /// recorded, earlier ones forgotten.
    pub fn clear(&self, name: &str) -> Result<(), TrackingError> {
        let tracked = self.read();
        let t = tracked
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| self.no_such(name))?;
        t.bits.clear();
        info!(export = %self.export, bitmap = name, "bitmap cleared");
        Ok(())
    }

    /// Stops tracking `name` and deletes its file. Clients that selected its context get
    /// an error for it from now on.
    pub fn remove(&self, name: &str) -> Result<(), TrackingError> {
        let removed = {
            let mut tracked = self.write();
            let at = tracked
                .iter()
                .position(|t| t.name == name)
                .ok_or_else(|| self.no_such(name))?;
            tracked.remove(at)
        };
        let file = removed
            .file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(file) = file {
            file.remove().map_err(|source| TrackingError::Store {
                export: self.export.clone(),
                name: name.to_owned(),
                source,
            })?;
        }
        info!(export = %self.export, bitmap = name, "bitmap removed");
        Ok(())
    }

    /// The bitmaps, in the order they were added.
    pub fn list(&self) -> Vec<BitmapInfo> {
        self.read()
            .iter()
            .map(|t| BitmapInfo {
                name: t.name.clone(),
                granularity: t.bits.granularity(),
                dirty_bytes: t.bits.dirty_bytes(),
                file: t
                    .file
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .map(|f| f.path().to_owned()),
            })
            .collect()
    }

    /// Whether it tracks `name`.
    pub fn has(&self, name: &str) -> bool {
        self.read().iter().any(|t| t.name == name)
    }

    /// Saves every bitmap that has a file and marks it closed cleanly (at shutdown, or when
    /// the export's last client leaves after a reload removed it). Failures are logged: the
    /// file then stays "in use", and the next start reports the bitmap all dirty.
    pub fn save(&self) {
        if self.saved.swap(true, Ordering::AcqRel) {
            return;
        }
        // The served file as this run leaves it (the caller flushed it: no write follows).
        let left_as = self
            .served
            .as_ref()
            .and_then(|s| ContentIdentity::of(&s.path).ok());
        for t in self.read().iter() {
            let file = t.file.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(file) = file.as_ref() {
                match file.close(&t.bits, left_as) {
                    Ok(()) => info!(export = %self.export, bitmap = %t.name, "bitmap saved"),
                    Err(e) => {
                        warn!(export = %self.export, bitmap = %t.name, "bitmap not saved: {e}")
                    }
                }
            }
        }
    }

    /// Records a change to `[offset, offset+len)` in every bitmap.
    fn dirty(&self, offset: u64, len: u64) {
        for t in self.read().iter() {
            t.bits.set(offset, len);
        }
    }

    fn find_context(&self, context: &str) -> Option<Arc<Tracked>> {
        self.read().iter().find(|t| t.context == context).cloned()
    }
}

impl Drop for Bitmaps {
    /// The last export that held them let go (a reload removed it, or the server stopped).
    fn drop(&mut self) {
        self.save();
    }
}

/// The layer that records writes in an export's [`Bitmaps`] and answers their contexts.
#[derive(Debug)]
pub struct Tracking(pub Arc<Bitmaps>);

/// The range an operation changes, if it changes one.
fn changed_range(op: &AsyncOp) -> Option<(u64, u64)> {
    match op {
        AsyncOp::Write { buf, offset, .. } => Some((*offset, buf.len() as u64)),
        AsyncOp::Trim { offset, len, .. } | AsyncOp::Zero { offset, len, .. } => {
            Some((*offset, *len))
        }
        _ => None,
    }
}

impl Layer for Tracking {
    fn name(&self) -> &'static str {
        "dirty-bitmaps"
    }

    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let result = next.pwrite(buf, offset, fua);
        // Even a failed write may have changed part of the range.
        self.0.dirty(offset, buf.len() as u64);
        result
    }

    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let result = next.trim(offset, len, fua);
        self.0.dirty(offset, len);
        result
    }

    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        let result = next.zero(offset, len, flags);
        if !matches!(result, Err(ZeroError::NotFast)) {
            self.0.dirty(offset, len);
        }
        result
    }

    fn wrote_in_place(&self, next: &dyn Backend, offset: u64, len: u64) {
        self.0.dirty(offset, len);
        next.wrote_in_place(offset, len);
    }

    fn submit(&self, next: &dyn Backend, op: AsyncOp, done: Completion) {
        let Some((offset, len)) = changed_range(&op) else {
            return next.submit(op, done);
        };
        let bitmaps = Arc::clone(&self.0);
        let then = Completion::new(move |op, result| {
            bitmaps.dirty(offset, len);
            match op {
                Some(op) => done.complete(op, result),
                // Dropped below: dropping `done` answers EIO.
                None => drop(done),
            }
        });
        next.submit(op, then);
    }

    /// The source's contexts, then the tracked bitmaps' - but for a name the source has
    /// too (an NBD upstream's `qemu:dirty-bitmap:NAME`, an image's bitmap): the source's
    /// wins, as at start (`config/bitmaps.rs` tracks no `-B` bitmap the source has), since it
    /// records every write to the data, not only those made through zcnbd.
    fn meta_contexts(&self, next: &dyn Backend) -> Vec<String> {
        let mut contexts = next.meta_contexts();
        let own = self.0.read();
        let tracked = own.iter().map(|t| &t.context);
        let beside: Vec<String> = tracked.filter(|c| !contexts.contains(c)).cloned().collect();
        contexts.extend(beside);
        contexts
    }

    fn meta_extents(
        &self,
        next: &dyn Backend,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        // The source's context wins over a tracked bitmap of the same name (see above);
        // its list is asked for only when the name is a tracked one.
        let tracked = self.0.find_context(context);
        let tracked = tracked.filter(|_| !next.meta_contexts().iter().any(|c| c == context));
        match tracked {
            Some(t) => {
                t.bits.extents(offset, len, extents_max, out);
                Ok(())
            }
            None => next.meta_extents(context, offset, len, extents_max, out),
        }
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
