//! Throwaway overlays (`--snapshot`, qemu-nbd's `-s`): a new qcow2 image in a file with no
//! name (`O_TMPFILE`, so it is gone when the server exits however it exits), whose backing is
//! the export - a raw file, a disk image with its chain, or the bytes of another backend
//! (a Ceph RBD image). Writes land in the overlay; the base is opened read-only and never
//! written.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatCreateBuilder, FormatDriverBuilder};
use rustix::fs::{Mode, OFlags};

use super::header::{ImageFormat, Qcow2Header};
use super::open::{self, ImageError, LayerInfo, OpenOptions, Opened};
use super::ImageBackend;
use crate::sys::image_file::ImageFile;
use crate::sys::image_lock::{lock, LockUse};
use crate::sys::image_storage::{ByteSource, ImageStorage};

/// Where overlays are made unless configured (qemu-nbd's choice too: `/var/tmp` is on disk,
/// where a large overlay fits better than in `/tmp`'s memory).
pub const OVERLAY_DIR_DEFAULT: &str = "/var/tmp";
/// The overlay's cluster size (qemu-img's default).
const OVERLAY_CLUSTER_BYTES: usize = 64 << 10;

/// An overlay over the file at `path` in `format` (raw: its bytes; else the image and its
/// chain), made in `dir`.
pub fn overlay_over_file(
    path: &Path,
    format: ImageFormat,
    force_share: bool,
    dir: &Path,
) -> Result<ImageBackend, ImageError> {
    let options = OpenOptions {
        writable: false,
        force_share,
        direct: false,
    };
    let base = match format {
        ImageFormat::Raw => raw_file_base(path, options)?,
        _ => open::open(path, format, options)?,
    };
    overlay(base, dir)
}

/// An overlay over `source` (an export's bytes), made in `dir`.
pub fn overlay_over_source(
    source: Arc<dyn ByteSource>,
    dir: &Path,
) -> Result<ImageBackend, ImageError> {
    let name = PathBuf::from(source.name());
    overlay(raw_base(ImageStorage::source(source), name)?, dir)
}

/// A raw file as the base of an overlay, locked as a read-only user.
fn raw_file_base(path: &Path, options: OpenOptions) -> Result<Opened, ImageError> {
    let io_err = |source| ImageError::Io {
        path: path.to_owned(),
        source,
    };
    let file = ImageFile::open(path, false).map_err(io_err)?;
    let how = if options.force_share {
        LockUse::ForceShare
    } else {
        LockUse::ReadOnly
    };
    lock(file.file(), how).map_err(|source| ImageError::Locked {
        path: path.to_owned(),
        source,
    })?;
    raw_base(ImageStorage::File(file), path.to_owned())
}

/// `storage`'s bytes, called `name`, as a raw layer.
fn raw_base(storage: ImageStorage, name: PathBuf) -> Result<Opened, ImageError> {
    let access = Raw::<ImageStorage>::builder(storage)
        .write(false)
        .open(DenyImplicitOpenGate::default())
        .map_err(|source| ImageError::Format {
            path: name.clone(),
            source,
        })?;
    Ok(Opened {
        access: FormatAccess::new(access),
        layers: vec![LayerInfo {
            path: name,
            format: ImageFormat::Raw,
        }],
        header: None,
        durability: Default::default(),
    })
}

/// A new qcow2 overlay in `dir` over `base`.
fn overlay(base: Opened, dir: &Path) -> Result<ImageBackend, ImageError> {
    let name = dir.join("(zcnbd --snapshot overlay)");
    let io_err = |source| ImageError::Io {
        path: dir.to_owned(),
        source,
    };
    let file = unnamed_file(dir).map_err(io_err)?;
    let storage = ImageStorage::File(ImageFile::from_file(file, name.clone()).map_err(io_err)?);
    let size = base.access.size();
    let backing = base.access;
    let image = Qcow2::<ImageStorage>::create_builder(storage)
        .size(size)
        .cluster_size(OVERLAY_CLUSTER_BYTES)
        .create_open(DenyImplicitOpenGate::default(), move |image| {
            Ok(Qcow2::<ImageStorage>::builder(image)
                .backing(Some(backing))
                .write(true))
        })
        .map_err(|source| ImageError::Format {
            path: name.clone(),
            source,
        })?;
    let mut layers = vec![LayerInfo {
        path: name,
        format: ImageFormat::Qcow2,
    }];
    layers.extend(base.layers);
    let opened = Opened {
        access: FormatAccess::new(image),
        layers,
        header: Some(Qcow2Header {
            version: 3,
            cluster_bits: OVERLAY_CLUSTER_BYTES.trailing_zeros(),
            crypt_method: 0,
            incompatible_features: 0,
            l1_size: 0,
            l1_table_offset: 0,
            refcount_table_offset: 0,
            refcount_table_clusters: 0,
            refcount_order: 4,
        }),
        // Thrown away at exit: nothing to order for a crash.
        durability: Default::default(),
    };
    Ok(ImageBackend::from_opened(opened, true))
}

/// A file in `dir` that no name reaches: removed by the kernel when it is closed.
fn unnamed_file(dir: &Path) -> io::Result<File> {
    let flags = OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC;
    let fd = rustix::fs::open(dir, flags, Mode::from_raw_mode(0o600))?;
    Ok(File::from(fd))
}

/// An export's bytes as the base of an overlay (read through its blocking methods).
#[derive(Debug)]
pub struct BackendSource {
    backend: Arc<dyn crate::export::Backend>,
    name: String,
}

impl BackendSource {
    /// `backend`'s bytes, called `name` in the log.
    pub fn new(backend: Arc<dyn crate::export::Backend>, name: String) -> BackendSource {
        BackendSource { backend, name }
    }
}

impl ByteSource for BackendSource {
    fn size(&self) -> u64 {
        self.backend.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.backend.pread(buf, offset)
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}
