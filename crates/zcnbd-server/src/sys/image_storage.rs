//! What an image's layers are stored in, as imago's storage: a file ([`ImageFile`]); a
//! writable qcow2's file seen twice, once for imago's metadata and once for its data, with a
//! [`WriteRule`] that orders the writes of the two views for a crash
//! (`export::base::image::write_order`); or for the base of a throwaway overlay (`--snapshot`)
//! over an export that is not a file (a Ceph RBD image), the bytes of that export read through
//! its stack ([`ByteSource`]). One type, because imago's backing chain has one storage type
//! throughout.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::Storage;

use super::image_file::ImageFile;

/// Bytes an overlay reads its unwritten clusters from (never written through it).
pub trait ByteSource: Send + Sync + fmt::Debug {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset` (within the size).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// What the log calls it.
    fn name(&self) -> String;
}

/// Which of an image's writes a view of its file carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// The image's tables and header.
    Metadata,
    /// Guest data (and data copied from a backing file).
    Data,
}

/// What a write is, for the order in which writes must become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    Data,
    Refcounts,
    /// A table not counted above (an L2 table, a new table not linked yet).
    Table,
    /// What links tables: the header, the L1 table, the refcount table.
    Link,
}

/// The order in which the writes of an image's views become durable.
pub trait WriteRule: Send + Sync + fmt::Debug {
    /// Before a write of `len` bytes at `offset` through `view`: makes durable what must be
    /// first, and says what the write is.
    fn before(&self, view: View, offset: u64, len: u64) -> io::Result<WriteKind>;
    /// After that write ended (whether it landed or not) in `file`.
    fn after(&self, kind: WriteKind, file: &ImageFile, offset: u64, len: u64);
    /// Makes every write through `view` (of `file`) durable.
    fn sync(&self, view: View, file: &ImageFile) -> io::Result<()>;
}

/// One layer's storage.
#[derive(Debug)]
pub enum ImageStorage {
    /// A file the engines can reach by its descriptor.
    File(ImageFile),
    /// One view of a file whose writes are ordered by `rule`.
    Ordered {
        file: Arc<ImageFile>,
        view: View,
        rule: Arc<dyn WriteRule>,
    },
    /// An export's bytes, read through its stack (read-only).
    Source {
        source: Arc<dyn ByteSource>,
        helper: CommonStorageHelper,
    },
}

impl ImageStorage {
    /// `source` as storage.
    pub fn source(source: Arc<dyn ByteSource>) -> ImageStorage {
        ImageStorage::Source {
            source,
            helper: CommonStorageHelper::default(),
        }
    }

    /// The file, if it is one.
    pub fn file(&self) -> Option<&ImageFile> {
        match self {
            ImageStorage::File(file) => Some(file),
            ImageStorage::Ordered { file, .. } => Some(file),
            ImageStorage::Source { .. } => None,
        }
    }
}

impl fmt::Display for ImageStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageStorage::File(file) => file.fmt(f),
            ImageStorage::Ordered { file, .. } => file.fmt(f),
            ImageStorage::Source { source, .. } => f.write_str(&source.name()),
        }
    }
}

/// A source cannot be written through an overlay.
fn read_only() -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        "the base of an overlay is not written",
    )
}

impl Storage for ImageStorage {
    fn size(&self) -> io::Result<u64> {
        match self {
            ImageStorage::File(file) => file.size(),
            ImageStorage::Ordered { file, .. } => file.size(),
            ImageStorage::Source { source, .. } => Ok(source.size()),
        }
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        match self {
            ImageStorage::File(file) => file.resolve_relative_path(relative),
            ImageStorage::Ordered { file, .. } => file.resolve_relative_path(relative),
            ImageStorage::Source { .. } => Err(io::ErrorKind::Unsupported.into()),
        }
    }

    fn get_filename(&self) -> Option<PathBuf> {
        self.file().and_then(ImageFile::get_filename)
    }

    unsafe fn pure_readv(&self, bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
        match self {
            // SAFETY: the caller's contract is passed on unchanged.
            ImageStorage::File(file) => unsafe { file.pure_readv(bufv, offset) },
            // SAFETY: as above.
            ImageStorage::Ordered { file, .. } => unsafe { file.pure_readv(bufv, offset) },
            ImageStorage::Source { source, .. } => read_source(&**source, bufv, offset),
        }
    }

    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        match self {
            // SAFETY: the caller's contract is passed on unchanged.
            ImageStorage::File(file) => unsafe { file.pure_writev(bufv, offset) },
            ImageStorage::Ordered { file, view, rule } => {
                let len = bufv.len();
                let kind = rule.before(*view, offset, len)?;
                // SAFETY: as above.
                let written = unsafe { file.pure_writev(bufv, offset) };
                rule.after(kind, file, offset, len);
                written
            }
            ImageStorage::Source { .. } => Err(read_only()),
        }
    }

    fn flush(&self) -> io::Result<()> {
        match self {
            ImageStorage::File(file) => file.flush(),
            ImageStorage::Ordered { file, .. } => file.flush(),
            ImageStorage::Source { .. } => Ok(()),
        }
    }

    fn sync(&self) -> io::Result<()> {
        match self {
            ImageStorage::File(file) => file.sync(),
            ImageStorage::Ordered { file, view, rule } => rule.sync(*view, file),
            ImageStorage::Source { .. } => Ok(()),
        }
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        match self {
            // Both views of a file share its writes' range blockers.
            ImageStorage::File(file) => file.get_storage_helper(),
            ImageStorage::Ordered { file, .. } => file.get_storage_helper(),
            ImageStorage::Source { helper, .. } => helper,
        }
    }
}

/// Reads the vector from `source`, zeroes past its end.
fn read_source(source: &dyn ByteSource, bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
    let size = source.size();
    let mut at = offset;
    for mut slice in bufv.into_inner() {
        let buf: &mut [u8] = &mut slice;
        let len = buf.len() as u64;
        let inside = size.saturating_sub(at).min(len) as usize;
        let (data, past_end) = buf.split_at_mut(inside);
        if !data.is_empty() {
            source.read_at(data, at)?;
        }
        past_end.fill(0);
        at += len;
    }
    Ok(())
}
