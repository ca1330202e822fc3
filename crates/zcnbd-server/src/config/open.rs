//! Opening an export's base backend from its spec: memory, null, a Ceph RBD image, or a file -
//! its bytes, or the disk a disk image holds (qcow2, VMDK: `--format`, or what the file's first
//! bytes say) - and for `--snapshot`, a throwaway overlay over any of the last two.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{info, warn};

use super::{BackendSpec, ConfigError, ExportSpec, RbdSpec};
use crate::export::{
    memory_backend, overlay_over_file, overlay_over_source, probe_image, Backend, BackendSource,
    BitmapRequest, FileBackend, FileMode, HttpBackend, HttpSpec, ImageBackend, ImageError,
    ImageFormat, ImageOpenOptions, NbdBackend, NullBackend, RbdBackend, OVERLAY_DIR_DEFAULT,
};

impl ExportSpec {
    /// Opens (or for memory, allocates) the backend.
    pub(super) fn open(&self) -> Result<Arc<dyn Backend>, ConfigError> {
        let name = &self.name;
        let open_err = |source| ConfigError::Open {
            name: name.clone(),
            source,
        };
        Ok(match &self.backend {
            BackendSpec::Memory(size) => Arc::new(memory_backend(*size).map_err(open_err)?),
            BackendSpec::Null(size) => Arc::new(NullBackend::new(*size)),
            BackendSpec::File { path, direct } => self.open_file(path, *direct)?,
            BackendSpec::Rbd(spec) if self.image.snapshot => {
                let base = rbd_backend(spec, true).map_err(open_err)?;
                let source = Arc::new(BackendSource::new(base, format!("rbd:{}", spec.image)));
                let overlay = overlay_over_source(source, &overlay_dir());
                Arc::new(overlay.map_err(|e| self.image_error(e))?)
            }
            BackendSpec::Rbd(spec) => rbd_backend(spec, self.read_only).map_err(open_err)?,
            BackendSpec::Nbd {
                uri,
                connections,
                reconnect,
            } if self.image.snapshot => {
                let base = NbdBackend::connect(uri, *connections, *reconnect);
                let base = Arc::new(base.map_err(open_err)?);
                let source = Arc::new(BackendSource::new(base, self.source()));
                let overlay = overlay_over_source(source, &overlay_dir());
                Arc::new(overlay.map_err(|e| self.image_error(e))?)
            }
            BackendSpec::Nbd {
                uri,
                connections,
                reconnect,
            } => Arc::new(NbdBackend::connect(uri, *connections, *reconnect).map_err(open_err)?),
            BackendSpec::Http(spec) if self.image.snapshot => {
                let base = Arc::new(self.http_backend(spec)?);
                let source = Arc::new(BackendSource::new(base, spec.redacted()));
                let overlay = overlay_over_source(source, &overlay_dir());
                info!(export = %self.name, "--snapshot: writes go to an overlay deleted at exit");
                Arc::new(overlay.map_err(|e| self.image_error(e))?)
            }
            BackendSpec::Http(spec) => Arc::new(self.http_backend(spec)?),
        })
    }

    /// A file on a web server: its size and range support asked at once.
    fn http_backend(&self, spec: &HttpSpec) -> Result<HttpBackend, ConfigError> {
        HttpBackend::open(spec).map_err(|source| ConfigError::Http {
            name: self.name.clone(),
            url: spec.redacted(),
            source,
        })
    }

    /// A file: its bytes, or the disk image in it, maybe under an overlay.
    fn open_file(&self, path: &Path, direct: bool) -> Result<Arc<dyn Backend>, ConfigError> {
        let format = self.file_format(path)?;
        let settings = &self.image;
        if settings.snapshot {
            let overlay = overlay_over_file(path, format, settings.force_share, &overlay_dir());
            let overlay = overlay.map_err(|e| self.image_error(e))?;
            info!(export = %self.name, "--snapshot: writes go to an overlay deleted at exit");
            return Ok(Arc::new(overlay));
        }
        if format == ImageFormat::Raw {
            let mode = if direct {
                FileMode::Direct
            } else {
                FileMode::Buffered
            };
            let file = FileBackend::open(path, mode, !self.read_only).map_err(|source| {
                ConfigError::OpenFile {
                    name: self.name.clone(),
                    path: path.to_owned(),
                    source,
                }
            })?;
            return Ok(Arc::new(file));
        }
        let writable = !self.read_only && format != ImageFormat::Vmdk;
        if !self.read_only && !writable {
            warn!(export = %self.name, "VMDK images are read only (imago does not write them): served read-only");
        }
        let options = ImageOpenOptions {
            writable,
            force_share: settings.force_share,
            direct,
        };
        let bitmaps = BitmapRequest {
            names: &self.bitmaps.names,
            invalidate: self.bitmaps.invalidate,
        };
        let image = ImageBackend::open(path, format, options, bitmaps);
        let image = image.map_err(|e| self.image_error(e))?;
        Ok(Arc::new(image))
    }

    /// What `--check` says of this export: its settings checked, and a file opened as it
    /// would be served but read-only and sharing it (QEMU's `--force-share`: a running server
    /// holding it is no conflict), so that a missing file, a broken backing chain or a
    /// format that does not match is found before a SIGHUP. An RBD image is not contacted; a
    /// web server is asked for the size (and whether it serves ranges) as at start.
    pub fn dry_run(&self) -> Result<String, ConfigError> {
        self.check()?;
        let what = match &self.backend {
            BackendSpec::Memory(size) => format!("memory, {size} bytes"),
            BackendSpec::Null(size) => format!("null, {size} bytes"),
            BackendSpec::Rbd(_) | BackendSpec::Nbd { .. } => {
                format!("{} (not contacted)", self.source())
            }
            BackendSpec::Http(spec) => {
                let size = self.http_backend(spec)?.size();
                format!("{} ({size} bytes, ranges served)", self.source())
            }
            BackendSpec::File { path, .. } => {
                let format = self.file_format(path)?;
                let size = if format == ImageFormat::Raw {
                    let file = File::open(path).map_err(|source| ConfigError::OpenFile {
                        name: self.name.clone(),
                        path: path.to_owned(),
                        source,
                    })?;
                    let mut file = &file;
                    std::io::Seek::seek(&mut file, std::io::SeekFrom::End(0)).map_err(|source| {
                        ConfigError::OpenFile {
                            name: self.name.clone(),
                            path: path.to_owned(),
                            source,
                        }
                    })?
                } else {
                    let options = ImageOpenOptions {
                        writable: false,
                        force_share: true,
                        direct: false,
                    };
                    let image = ImageBackend::open(path, format, options, Default::default());
                    image.map_err(|e| self.image_error(e))?.size()
                };
                format!("{}, {} ({size} bytes)", self.source(), format.name())
            }
        };
        let read_only = if self.read_only { ", read-only" } else { "" };
        Ok(format!("export {:?}: {what}{read_only}", self.name))
    }

    /// `format`, or what the file's first bytes say (logged when it is an image's).
    fn file_format(&self, path: &Path) -> Result<ImageFormat, ConfigError> {
        if let Some(format) = self.image.format {
            return Ok(format);
        }
        let probed = File::open(path)
            .and_then(|f| probe_image(&f))
            .map_err(|source| ConfigError::OpenFile {
                name: self.name.clone(),
                path: path.to_owned(),
                source,
            })?;
        let format = probed.format();
        if format != ImageFormat::Raw {
            info!(
                export = %self.name,
                file = %path.display(),
                format = format.name(),
                "the file is a disk image: serving the disk it holds (--format raw serves the file's own bytes)"
            );
        }
        Ok(format)
    }

    fn image_error(&self, source: ImageError) -> ConfigError {
        ConfigError::Image {
            name: self.name.clone(),
            source,
        }
    }

    /// What the image settings ask that the backend or the other settings refuse.
    pub(super) fn check_image(&self) -> Result<(), &'static str> {
        let s = &self.image;
        let file = matches!(self.backend, BackendSpec::File { .. });
        let direct = matches!(self.backend, BackendSpec::File { direct: true, .. });
        let remote = matches!(
            self.backend,
            BackendSpec::Rbd(_) | BackendSpec::Nbd { .. } | BackendSpec::Http(_)
        );
        if s.format.is_some() && !file {
            return Err("format is for files");
        }
        if s.snapshot && !(file || remote) {
            return Err("snapshot needs a file, disk image, RBD image, NBD export or URL under it");
        }
        if s.force_share && !self.read_only && !s.snapshot {
            // QEMU: "force-share=on can only be used with read-only images".
            return Err("force_share goes with read_only (or snapshot)");
        }
        if s.force_share && !file {
            return Err("force_share is for files");
        }
        if direct && s.snapshot {
            return Err("direct is for files and images served as they are, not under snapshot");
        }
        Ok(())
    }
}

/// Where `--snapshot` makes its overlays: `$TMPDIR`, as QEMU does, else /var/tmp.
fn overlay_dir() -> PathBuf {
    std::env::var_os("TMPDIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(OVERLAY_DIR_DEFAULT), PathBuf::from)
}

fn rbd_backend(spec: &RbdSpec, read_only: bool) -> std::io::Result<Arc<dyn Backend>> {
    Ok(Arc::new(RbdBackend::open(spec, read_only)?))
}
