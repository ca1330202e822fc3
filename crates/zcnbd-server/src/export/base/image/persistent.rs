//! A qcow2 image's persistent dirty bitmaps as the export's `qemu:dirty-bitmap:NAME` contexts
//! (`-B NAME`, read by `bitmaps/`), and the rule for writable opens: zcnbd does not update
//! persistent bitmaps, so an image that has any is opened for writing only if the user says
//! to mark them in use (inconsistent) first (`--invalidate-bitmaps`); never a stale bitmap
//! that a later backup trusts. (The writable open also clears the header's bitmaps autoclear
//! bit, as a program without bitmap support must, after which QEMU ignores them too.)

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use tracing::{info, warn};

use super::bitmaps::{
    BitmapDirectory, BitmapEntry, BitmapError, DirtyBitmap, Extension, BITMAP_BYTES_MAX_DEFAULT,
};
use super::{ImageError, ImageFormat};

/// The bit of a bitmap directory entry's flags that marks it in use.
const IN_USE: u32 = 1;

/// What an export asks of an image's persistent bitmaps.
#[derive(Debug, Clone, Copy, Default)]
pub struct BitmapRequest<'a> {
    /// The bitmaps to serve (`-B`); names the image lacks are left to the tracking layer.
    pub names: &'a [String],
    /// A writable open may mark the image's bitmaps in use (`--invalidate-bitmaps`).
    pub invalidate: bool,
}

/// What the image's bitmap directory says, read before the image is opened for real.
#[derive(Debug, Default)]
pub(super) struct Persistent {
    /// The bitmaps to serve, loaded (read-only opens).
    pub(super) served: Vec<DirtyBitmap>,
    /// Where the flags of the bitmaps to mark in use are (writable opens with `invalidate`).
    to_invalidate: Vec<(String, u64)>,
}

fn bitmap_error(path: &Path, source: BitmapError) -> ImageError {
    ImageError::Bitmaps {
        path: path.to_owned(),
        source,
    }
}

impl Persistent {
    /// Reads the bitmap directory of the image at `path`, open (and locked: nobody moves
    /// the directory while it is read and until its flags are written) as `file`, if it is a
    /// qcow2 image, and decides: the bitmaps a read-only export serves, loaded; or, for a
    /// writable one, a refusal if it has bitmaps and `invalidate` is not set.
    pub(super) fn read(
        file: &File,
        path: &Path,
        format: ImageFormat,
        writable: bool,
        request: BitmapRequest<'_>,
    ) -> Result<Persistent, ImageError> {
        if format != ImageFormat::Qcow2 {
            return Ok(Persistent::default());
        }
        let io_err = |source| ImageError::Io {
            path: path.to_owned(),
            source,
        };
        // A block device's metadata says 0 bytes: its end says how long it is.
        let len = std::io::Seek::seek(&mut &*file, std::io::SeekFrom::End(0)).map_err(io_err)?;
        let directory = match BitmapDirectory::read(file, len) {
            Ok(directory) => directory,
            // Bitmaps nobody asked for, of an image opened read-only: not our concern.
            Err(e) if !writable && request.names.is_empty() => {
                warn!(file = %path.display(), "the image's bitmap directory is unreadable ({e}): no bitmap is served");
                return Ok(Persistent::default());
            }
            Err(e) => return Err(bitmap_error(path, e)),
        };
        let entries = match directory.extension() {
            Extension::Present(_) => directory.entries(),
            Extension::Ignored => {
                if !request.names.is_empty() {
                    warn!(file = %path.display(), "{}", BitmapError::Ignored);
                }
                return Ok(Persistent::default());
            }
            Extension::Absent => return Ok(Persistent::default()),
        };
        if writable {
            return Persistent::for_writing(path, entries, request);
        }
        Persistent::for_serving(file, path, &directory, entries, request)
    }

    /// A writable open of an image whose bitmaps are `entries`: refused if it has any,
    /// unless `invalidate` says to mark them in use first (and `-B` names none of them).
    fn for_writing(
        path: &Path,
        entries: &[BitmapEntry],
        request: BitmapRequest<'_>,
    ) -> Result<Persistent, ImageError> {
        if entries.is_empty() {
            return Ok(Persistent::default());
        }
        let refused = |why: String| ImageError::BitmapsNotKept {
            path: path.to_owned(),
            why,
        };
        if let Some(asked) = request
            .names
            .iter()
            .find(|n| entries.iter().any(|e| &e.name == *n))
        {
            return Err(refused(format!("-B {asked} names a persistent bitmap of the image, which only a read-only export serves (zcnbd does not update it): add -r")));
        }
        if !request.invalidate {
            let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
            return Err(refused(format!("the image has persistent dirty bitmaps ({}) that zcnbd would not keep up to date: serve it read-only (-r), or pass --invalidate-bitmaps to mark them in use (inconsistent) first", names.join(", "))));
        }
        let to_invalidate = entries
            .iter()
            .filter(|e| !e.in_use())
            .map(|e| (e.name.clone(), e.flags_offset))
            .collect();
        Ok(Persistent {
            served: Vec::new(),
            to_invalidate,
        })
    }

    /// A read-only open: the bitmaps `-B` names that the image has, loaded.
    fn for_serving(
        file: &File,
        path: &Path,
        directory: &BitmapDirectory,
        entries: &[BitmapEntry],
        request: BitmapRequest<'_>,
    ) -> Result<Persistent, ImageError> {
        let mut served = Vec::new();
        for name in request.names {
            if !entries.iter().any(|e| &e.name == name) {
                continue;
            }
            let bitmap = directory
                .load(file, name, BITMAP_BYTES_MAX_DEFAULT)
                .map_err(|e| bitmap_error(path, e))?;
            info!(
                file = %path.display(),
                bitmap = %name,
                granularity = bitmap.granularity_bytes(),
                memory = bitmap.memory_bytes(),
                "serving the image's persistent bitmap as {}",
                bitmap.context()
            );
            served.push(bitmap);
        }
        Ok(Persistent {
            served,
            to_invalidate: Vec::new(),
        })
    }

    /// Marks the bitmaps [`Persistent::read`] found in use, durably, through `file` (the
    /// image's, open for writing and locked since the directory was read): called once the
    /// image is open, before anything is served.
    pub(super) fn invalidate(&self, file: &File, path: &Path) -> Result<(), ImageError> {
        if self.to_invalidate.is_empty() {
            return Ok(());
        }
        let io_err = |source| ImageError::Io {
            path: path.to_owned(),
            source,
        };
        for (name, at) in &self.to_invalidate {
            let mut flags = [0u8; 4];
            file.read_exact_at(&mut flags, *at).map_err(io_err)?;
            let marked = u32::from_be_bytes(flags) | IN_USE;
            file.write_all_at(&marked.to_be_bytes(), *at)
                .map_err(io_err)?;
            warn!(file = %path.display(), bitmap = %name, "--invalidate-bitmaps: persistent bitmap marked in use (inconsistent): zcnbd does not update it");
        }
        file.sync_data().map_err(io_err)
    }
}
