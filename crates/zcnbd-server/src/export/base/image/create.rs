//! Making an empty qcow2 image file, optionally over a backing file named in its header:
//! what the unit tests and the image fuzz target start from (`qemu-img create -f qcow2`).

use std::fs::OpenOptions;
use std::io;
use std::path::Path;

use imago::qcow2::Qcow2;
use imago::FormatCreateBuilder;

use super::header::ImageFormat;
use crate::sys::image_file::ImageFile;
use crate::sys::image_storage::ImageStorage;

/// Creates (or truncates) `path` as a qcow2 image of `size` bytes with clusters of
/// `cluster_bytes`, whose backing file is `backing` (its name as the header records it,
/// relative to the image, and its format).
pub fn create_qcow2(
    path: &Path,
    size: u64,
    cluster_bytes: usize,
    backing: Option<(&str, ImageFormat)>,
) -> io::Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let file = ImageFile::from_file(file, path.to_owned())?;
    let mut builder = Qcow2::<ImageStorage>::create_builder(ImageStorage::File(file))
        .size(size)
        .cluster_size(cluster_bytes);
    if let Some((name, format)) = backing {
        builder = builder.backing(name.to_owned(), format.name().to_owned());
    }
    builder.create()
}
