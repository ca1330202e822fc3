//! What an image's layers are stored in, as imago's storage: a file ([`ImageFile`]), or for
//! the base of a throwaway overlay (`--snapshot`) over an export that is not a file (a Ceph
//! RBD image), the bytes of that export read through its stack ([`ByteSource`]). One type,
//! because imago's backing chain has one storage type throughout.

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

/// One layer's storage.
#[derive(Debug)]
pub enum ImageStorage {
    /// A file the engines can reach by its descriptor.
    File(ImageFile),
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
            ImageStorage::Source { .. } => None,
        }
    }
}

impl fmt::Display for ImageStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageStorage::File(file) => file.fmt(f),
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
            ImageStorage::Source { source, .. } => Ok(source.size()),
        }
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        match self {
            ImageStorage::File(file) => file.resolve_relative_path(relative),
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
            ImageStorage::Source { source, .. } => read_source(&**source, bufv, offset),
        }
    }

    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        match self {
            // SAFETY: the caller's contract is passed on unchanged.
            ImageStorage::File(file) => unsafe { file.pure_writev(bufv, offset) },
            ImageStorage::Source { .. } => Err(read_only()),
        }
    }

    fn flush(&self) -> io::Result<()> {
        match self {
            ImageStorage::File(file) => file.flush(),
            ImageStorage::Source { .. } => Ok(()),
        }
    }

    fn sync(&self) -> io::Result<()> {
        match self {
            ImageStorage::File(file) => file.sync(),
            ImageStorage::Source { .. } => Ok(()),
        }
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        match self {
            ImageStorage::File(file) => file.get_storage_helper(),
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
