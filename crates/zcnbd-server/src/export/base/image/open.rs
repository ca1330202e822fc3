//! Opening a disk image with imago, and the files it names: every file of the backing chain
//! is opened through one gate ([`ChainGate`]) that refuses loops (a file that names itself,
//! or one earlier in the chain), chains deeper than [`BACKING_DEPTH_MAX`], and files that
//! are neither regular files nor block devices (a FIFO would hang the open, a character
//! device would be served as a disk); checks each qcow2 header before imago reads it
//! (`header.rs`); and locks each file as QEMU would (`sys::image_lock`).

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use imago::format::gate::ImplicitOpenGate;
use imago::format::Format;
use imago::qcow2::Qcow2;
use imago::vmdk::Vmdk;
use imago::{FormatAccess, FormatDriverBuilder, StorageOpenOptions};

use super::header::{extensions_refusal, probe, ImageFormat, Probed, Qcow2Header};
use super::refcounts;
use super::write_order::WriteOrder;
use crate::export::Durability;
use crate::sys::image_file::ImageFile;
use crate::sys::image_lock::{lock, LockError, LockUse};
use crate::sys::image_storage::{ImageStorage, View};

/// The deepest backing chain opened (the image itself is depth 1). imago opens a chain by
/// recursion, so without a bound a hostile chain would exhaust the stack.
pub const BACKING_DEPTH_MAX: usize = 64;

/// Why an image could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file of the chain could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    /// A qcow2 header says what zcnbd cannot serve.
    #[error("{}: {why}", path.display())]
    Unsupported { path: PathBuf, why: String },
    /// A file of the chain is locked by another user (QEMU's locks).
    #[error("{}: {source}", path.display())]
    Locked { path: PathBuf, source: LockError },
    /// A backing file names a file already in the chain.
    #[error("{}: backing chain loop (the file is already in the chain)", path.display())]
    Loop { path: PathBuf },
    /// The chain is deeper than [`BACKING_DEPTH_MAX`].
    #[error("{}: backing chain deeper than {BACKING_DEPTH_MAX} (BACKING_DEPTH_MAX)", path.display())]
    TooDeep { path: PathBuf },
    /// A file of the chain is not a regular file or block device.
    #[error("{}: not a regular file or block device", path.display())]
    NotAFile { path: PathBuf },
    /// imago refused the image.
    #[error("{}: {source}", path.display())]
    Format { path: PathBuf, source: io::Error },
    /// The image's persistent dirty bitmaps (or the one asked for) cannot be read.
    #[error("{}: {source}", path.display())]
    Bitmaps {
        path: PathBuf,
        source: super::bitmaps::BitmapError,
    },
    /// A writable open would leave the image's persistent bitmaps stale.
    #[error("{}: {why}", path.display())]
    BitmapsNotKept { path: PathBuf, why: String },
}

/// How an image is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    pub writable: bool,
    /// Lock it as `--force-share` does: read-only, sharing everything.
    pub force_share: bool,
    /// Every file of the chain also opened with O_DIRECT (`--direct`, QEMU's `cache=none`):
    /// data clusters are read and written through it (`sys::image_file`).
    pub direct: bool,
}

impl OpenOptions {
    fn top_lock(self) -> LockUse {
        match (self.writable, self.force_share) {
            (true, _) => LockUse::ReadWrite,
            (false, true) => LockUse::ForceShare,
            (false, false) => LockUse::ReadOnly,
        }
    }

    fn backing_lock(self) -> LockUse {
        if self.force_share {
            LockUse::ForceShare
        } else {
            LockUse::BackingImage
        }
    }
}

/// One layer of an opened chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    pub path: PathBuf,
    pub format: ImageFormat,
}

/// An open image: imago's access to it, and its layers top first.
#[derive(Debug)]
pub struct Opened {
    pub access: FormatAccess<ImageStorage>,
    pub layers: Vec<LayerInfo>,
    /// The top layer's qcow2 header (`None` for other formats).
    pub header: Option<Qcow2Header>,
    /// Whether its syncs have all succeeded (a failed write-order barrier counts).
    pub durability: Arc<Durability>,
}

/// What the gates of one chain share.
#[derive(Debug)]
struct Chain {
    options: OpenOptions,
    /// (device, inode) of every file opened so far.
    seen: Vec<(u64, u64)>,
    /// Layers below the top, in the order they were opened (by depth).
    layers: Vec<LayerInfo>,
    /// The files opened, for the layers' paths (storage comes before its format).
    last_path: Option<PathBuf>,
    /// A writable qcow2's write order, which its external data file joins.
    order: Option<Arc<WriteOrder>>,
}

/// imago's gate for the files an image names: see the module's documentation.
#[derive(Debug)]
struct ChainGate {
    /// Depth of the image whose dependencies this gate opens (the top: 1).
    depth: usize,
    chain: Arc<Mutex<Chain>>,
}

fn chain_lock(chain: &Mutex<Chain>) -> std::sync::MutexGuard<'_, Chain> {
    chain
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn format_of(format: Format) -> ImageFormat {
    match format {
        Format::Qcow2 => ImageFormat::Qcow2,
        Format::Vmdk => ImageFormat::Vmdk,
        _ => ImageFormat::Raw,
    }
}

impl ImplicitOpenGate<ImageStorage> for ChainGate {
    fn open_format<F: FormatDriverBuilder<ImageStorage>>(
        &mut self,
        builder: F,
    ) -> io::Result<FormatAccess<ImageStorage>> {
        let depth = self.depth + 1;
        let path = builder.get_image_path().unwrap_or_default();
        if depth > BACKING_DEPTH_MAX {
            return Err(io::Error::other(ImageError::TooDeep { path }));
        }
        {
            let mut chain = chain_lock(&self.chain);
            let path = chain.last_path.take().unwrap_or(path);
            let format = format_of(F::FORMAT);
            chain.layers.push(LayerInfo { path, format });
        }
        let child = ChainGate {
            depth,
            chain: Arc::clone(&self.chain),
        };
        Ok(FormatAccess::new(builder.open(child)?))
    }

    fn open_storage(&mut self, opts: StorageOpenOptions) -> io::Result<ImageStorage> {
        let path = opts
            .get_filename()
            .ok_or_else(|| io::Error::other("a file without a name"))?
            .to_owned();
        let mut chain = chain_lock(&self.chain);
        // imago opens data files writable, backing files read-only.
        let (writable, how) = if opts.get_writable() {
            (chain.options.writable, chain.options.top_lock())
        } else {
            (false, chain.options.backing_lock())
        };
        let direct = chain.options.direct;
        let file =
            open_file(&path, (writable, direct), how, &mut chain.seen).map_err(io::Error::other)?;
        chain.last_path = Some(path);
        // Only a writable image's data file is opened writable.
        match (&chain.order, writable) {
            (Some(order), true) => {
                let file = Arc::new(file);
                order.add_data_file(&file);
                Ok(ImageStorage::Ordered {
                    file,
                    view: View::Data,
                    rule: Arc::clone(order) as _,
                })
            }
            _ => Ok(ImageStorage::File(file)),
        }
    }
}

/// Opens one file of a chain: checks its kind and identity, opens it, checks a qcow2
/// header, locks it.
fn open_file(
    path: &Path,
    (writable, direct): (bool, bool),
    how: LockUse,
    seen: &mut Vec<(u64, u64)>,
) -> Result<ImageFile, ImageError> {
    let io_err = |source| ImageError::Io {
        path: path.to_owned(),
        source,
    };
    let meta = fs::metadata(path).map_err(io_err)?;
    let kind = meta.file_type();
    if !kind.is_file() && !kind.is_block_device() {
        return Err(ImageError::NotAFile {
            path: path.to_owned(),
        });
    }
    let id = (meta.dev(), meta.ino());
    if seen.contains(&id) {
        return Err(ImageError::Loop {
            path: path.to_owned(),
        });
    }
    seen.push(id);
    let file = ImageFile::open(path, writable).map_err(io_err)?;
    if let Probed::Qcow2(header) = probe(file.file()).map_err(io_err)? {
        // The fixed fields first: the extensions' walk needs a sane cluster size.
        let extensions = match header.refusal() {
            Some(_) => None,
            None => extensions_refusal(file.file(), &header).map_err(io_err)?,
        };
        let refused = header.refusal().or(extensions).or_else(|| {
            // Only a writable image allocates clusters (and refcount blocks).
            writable
                .then(|| refcounts::uncovered(file.file(), file.length(), &header))
                .flatten()
        });
        if let Some(why) = refused {
            return Err(ImageError::Unsupported {
                path: path.to_owned(),
                why,
            });
        }
    }
    lock(file.file(), how).map_err(|source| ImageError::Locked {
        path: path.to_owned(),
        source,
    })?;
    if direct {
        return file.with_direct().map_err(io_err);
    }
    Ok(file)
}

/// An image's own file, open and locked as the export will use it: what is read of the
/// image before imago opens it (its persistent bitmaps' directory) is read under the lock,
/// through this descriptor.
#[derive(Debug)]
pub struct Top {
    file: ImageFile,
    /// (device, inode) of the files opened so far (this one).
    seen: Vec<(u64, u64)>,
}

impl Top {
    /// Opens and locks the image file at `path` (checked as every file of a chain is).
    pub fn open(path: &Path, options: OpenOptions) -> Result<Top, ImageError> {
        let mut seen = Vec::new();
        let how = (options.writable, options.direct);
        let file = open_file(path, how, options.top_lock(), &mut seen)?;
        Ok(Top { file, seen })
    }

    /// The open file.
    pub fn file(&self) -> &std::fs::File {
        self.file.file()
    }

    /// A second descriptor of the same open file (sharing its locks).
    fn duplicate(&self, path: &Path) -> Result<Top, ImageError> {
        let file = self.file.duplicate().map_err(|source| ImageError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok(Top {
            file,
            seen: self.seen.clone(),
        })
    }
}

/// Opens the image at `path` in `format` (qcow2 or VMDK) with its whole chain.
///
/// A writable qcow2 is opened read-only first: a writable open clears the header's autoclear
/// bits as soon as it starts (as the qcow2 specification asks of a program that does not know
/// them), so an image that is then refused, or whose chain is broken, is left as it was.
pub fn open(path: &Path, format: ImageFormat, options: OpenOptions) -> Result<Opened, ImageError> {
    open_locked(Top::open(path, options)?, path, format, options)
}

/// [`open`], of a file already open and locked.
pub fn open_locked(
    top: Top,
    path: &Path,
    format: ImageFormat,
    options: OpenOptions,
) -> Result<Opened, ImageError> {
    if options.writable {
        let read_only = OpenOptions {
            writable: false,
            ..options
        };
        drop(open_once(top.duplicate(path)?, path, format, read_only)?);
    }
    open_once(top, path, format, options)
}

fn open_once(
    top: Top,
    path: &Path,
    format: ImageFormat,
    options: OpenOptions,
) -> Result<Opened, ImageError> {
    let Top { file, seen } = top;
    let header = match probe(file.file()) {
        Ok(Probed::Qcow2(header)) => Some(header),
        _ => None,
    };
    let durability = Arc::new(Durability::default());
    // A writable qcow2's writes are ordered for a crash (image/mod.rs): imago writes its
    // metadata through one view of the file and the data through another (or through the
    // external data file's, which the gate opens).
    let (storage, data, order) = match (header, options.writable) {
        (Some(h), true) => {
            let file = Arc::new(file);
            let order = WriteOrder::new(&file, &h, Arc::clone(&durability)).map_err(|source| {
                ImageError::Io {
                    path: path.to_owned(),
                    source,
                }
            })?;
            let view = |view| ImageStorage::Ordered {
                file: Arc::clone(&file),
                view,
                rule: Arc::clone(&order) as _,
            };
            let data = (!h.has_data_file()).then(|| view(View::Data));
            (view(View::Metadata), data, Some(order))
        }
        _ => (ImageStorage::File(file), None, None),
    };
    let chain = Arc::new(Mutex::new(Chain {
        options,
        seen,
        layers: Vec::new(),
        last_path: None,
        order,
    }));
    let gate = ChainGate {
        depth: 1,
        chain: Arc::clone(&chain),
    };
    let opened = match format {
        ImageFormat::Qcow2 => {
            let mut builder = Qcow2::<ImageStorage>::builder(storage).write(options.writable);
            if data.is_some() {
                builder = builder.data_file(data);
            }
            builder.open(gate).map(FormatAccess::new)
        }
        ImageFormat::Vmdk => Vmdk::<ImageStorage>::builder(storage)
            .write(options.writable)
            .open(gate)
            .map(FormatAccess::new),
        ImageFormat::Raw => Err(io::Error::other("raw files are not opened as images")),
    };
    let access = opened.map_err(|e| chain_error(path, e))?;
    let mut layers = vec![LayerInfo {
        path: path.to_owned(),
        format,
    }];
    layers.append(&mut chain_lock(&chain).layers);
    Ok(Opened {
        access,
        layers,
        header,
        durability,
    })
}

/// The error of a chain's open: a gate's own (a loop, a lock) as it is, imago's about the
/// image named.
fn chain_error(path: &Path, e: io::Error) -> ImageError {
    let format = |source| ImageError::Format {
        path: path.to_owned(),
        source,
    };
    if !e.get_ref().is_some_and(|inner| inner.is::<ImageError>()) {
        return format(e);
    }
    match e.into_inner().map(|inner| inner.downcast::<ImageError>()) {
        Some(Ok(ours)) => *ours,
        _ => format(io::Error::other("the open failed")),
    }
}
