//! Which of an export's `-B NAME` bitmaps zcnbd tracks itself, and where it keeps them: a
//! bitmap the backend has of its own (a qcow2 image's persistent bitmap, an RBD snapshot) is
//! served from there; any other is tracked (`export::tracking`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use zcnbd_proto::meta::DIRTY_BITMAP_PREFIX;

use super::{BackendSpec, ConfigError, ExportSpec};
use crate::export::tracking::{BitmapHome, Bitmaps, ServedFile, GRANULARITY_DEFAULT};
use crate::export::Backend;

impl ExportSpec {
    /// The bitmaps zcnbd tracks for this export over `backend`: `kept` (a reload's) with any
    /// name the spec adds, or new ones, for the content of `served` (the file as it was
    /// before the backend opened it); `None` when there are none to track and none may be
    /// made while the server runs.
    pub(super) fn tracked_bitmaps(
        &self,
        backend: &dyn Backend,
        kept: Option<Arc<Bitmaps>>,
        served: Option<ServedFile>,
    ) -> Result<Option<Arc<Bitmaps>>, ConfigError> {
        let own = backend.meta_contexts();
        let tracked: Vec<&String> = self
            .bitmaps
            .names
            .iter()
            .filter(|name| !own.contains(&format!("{DIRTY_BITMAP_PREFIX}{name}")))
            .collect();
        let bitmaps = match kept {
            Some(kept) => kept,
            None if tracked.is_empty() && !self.bitmaps.on_demand => return Ok(None),
            None => Arc::new(Bitmaps::new(
                &self.name,
                backend.size(),
                self.bitmap_home()?,
                self.bitmaps.granularity.unwrap_or(GRANULARITY_DEFAULT),
                served,
            )),
        };
        for name in tracked {
            if !bitmaps.has(name) {
                bitmaps
                    .add(name, self.bitmaps.granularity)
                    .map_err(|source| ConfigError::Bitmap {
                        name: self.name.clone(),
                        source: Box::new(source),
                    })?;
            }
        }
        Ok(Some(bitmaps))
    }

    /// The file this export serves, as it is now (call before opening it).
    pub(crate) fn served_file(&self) -> Option<ServedFile> {
        match &self.backend {
            BackendSpec::File { path, .. } if !self.image.snapshot => ServedFile::now(path),
            _ => None,
        }
    }

    /// Where tracked bitmaps are kept: `bitmap_dir`, else beside the export's file; in
    /// memory for data that does not outlive the server (memory, null, a `--snapshot`
    /// overlay).
    fn bitmap_home(&self) -> Result<BitmapHome, ConfigError> {
        let dir = self.bitmaps.dir.clone();
        let needs_dir = |what: &'static str| ConfigError::BitmapDir {
            name: self.name.clone(),
            what,
        };
        let (stem, beside) = match &self.backend {
            BackendSpec::Memory(_) | BackendSpec::Null(_) => return Ok(BitmapHome::Memory),
            _ if self.image.snapshot => return Ok(BitmapHome::Memory),
            BackendSpec::File { path, .. } => file_home(path),
            BackendSpec::Rbd(spec) => {
                let namespace = spec
                    .namespace
                    .as_deref()
                    .map(|n| format!("{n}."))
                    .unwrap_or_default();
                (format!("rbd.{}.{namespace}{}", spec.pool, spec.image), None)
            }
            BackendSpec::Nbd { .. } => ("nbd".to_owned(), None),
            BackendSpec::Http(_) => ("http".to_owned(), None),
        };
        match (dir, beside) {
            (Some(dir), _) | (None, Some(dir)) => Ok(BitmapHome::Files { dir, stem }),
            (None, None) if matches!(self.backend, BackendSpec::Rbd(_)) => {
                Err(needs_dir("an RBD image"))
            }
            (None, None) if matches!(self.backend, BackendSpec::Nbd { .. }) => {
                Err(needs_dir("an NBD export"))
            }
            (None, None) if matches!(self.backend, BackendSpec::Http(_)) => {
                Err(needs_dir("a file on a web server"))
            }
            (None, None) => Err(needs_dir("a device")),
        }
    }
}

/// A file's bitmaps' stem (its name), and the directory beside it (`None` unless it is a
/// regular file: a device's directory is /dev).
fn file_home(path: &Path) -> (String, Option<PathBuf>) {
    let stem = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".to_owned());
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let dir = path
        .parent()
        .map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        })
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_owned()));
    (stem, dir.filter(|_| regular))
}
