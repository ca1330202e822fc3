//! QEMU's persistent dirty bitmaps in a qcow2 image (imago does not read them), for the
//! `qemu:dirty-bitmap:NAME` metadata context: which ranges of the disk were written while a
//! bitmap was enabled. The layout is QEMU's `docs/interop/qcow2.rst` ("Bitmaps extension",
//! "Bitmap directory", "Bitmap table", "Bitmap data"); the checks follow QEMU's
//! `block/qcow2.c` and `block/qcow2-bitmap.c`, so a bitmap QEMU would not use is not served.
//! Two differences: where QEMU refuses the whole image for one unusable bitmap, only that
//! bitmap is refused here; and extra data marked `extra_data_compatible` is ignored, as the
//! specification allows (QEMU refuses any extra data).
//!
//! Three steps, each bounded before it allocates:
//!
//! - [`BitmapDirectory::read`] (`directory.rs`, over `extension.rs`): the header's bitmaps
//!   extension and the directory it points to - names, granularities, flags and, for a writer
//!   that marks bitmaps in use, the file offset of each entry's flags. Cheap: the directory
//!   is at most [`BITMAP_DIRECTORY_BYTES_MAX`].
//! - [`BitmapDirectory::load`] (`load.rs`): one bitmap's table and data clusters into memory
//!   as a [`DirtyBitmap`], refusing a bitmap marked in use, of another type, with a
//!   granularity QEMU does not accept, or larger than the caller's memory limit
//!   ([`BITMAP_BYTES_MAX_DEFAULT`]).
//! - [`DirtyBitmap::extents`] (`dirty.rs`): block status of a range, runs of equal bits
//!   joined, flag [`STATE_DIRTY`] where written.
//!
//! As QEMU does, the extension is ignored unless the header's autoclear bit 0 ("bitmaps") is
//! set: a program without bitmap support that wrote to the image cleared that bit, so the
//! bitmaps may not reflect its writes ([`Extension::Ignored`]).

mod directory;
mod dirty;
mod extension;
mod load;

#[doc(hidden)]
pub mod fuzz;

use std::io;

pub use directory::{BitmapDirectory, BitmapEntry};
pub use dirty::DirtyBitmap;
pub use extension::{BitmapsExtension, Extension, ImageShape};

/// The largest bitmap directory read: QEMU's `QCOW2_MAX_BITMAP_DIRECTORY_SIZE` (64 MiB).
pub const BITMAP_DIRECTORY_BYTES_MAX: u64 = 64 << 20;
/// The most bitmaps an image may have: QEMU's `QCOW2_MAX_BITMAPS`.
pub const BITMAPS_MAX: u32 = 65535;
/// The longest bitmap name, in bytes: QEMU's `BME_MAX_NAME_SIZE`.
pub const BITMAP_NAME_BYTES_MAX: u16 = 1023;
/// The granularities QEMU accepts, as log2 of bytes per bit (512 B to 2 GiB).
pub const GRANULARITY_BITS_MIN: u8 = 9;
pub const GRANULARITY_BITS_MAX: u8 = 31;
/// The default memory one loaded bitmap may take (one bit per granule, in 64-bit words):
/// 256 MiB holds a 1 TiB disk at 512-byte granularity, or a 128 TiB disk at QEMU's default
/// 64 KiB.
pub const BITMAP_BYTES_MAX_DEFAULT: u64 = 256 << 20;

/// `qemu:dirty-bitmap:` extent flag: the range was written while the bitmap was enabled
/// (QEMU's `NBD_STATE_DIRTY`, docs/interop/nbd.rst). Clean ranges have flags 0.
pub const STATE_DIRTY: u32 = 1 << 0;

/// Why an image's bitmaps, or one of them, cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BitmapError {
    /// The image file could not be read.
    #[error("reading {what}: {source}")]
    Io { what: String, source: io::Error },
    /// The file is not a qcow2 image, or its header is malformed.
    #[error("qcow2 header: {0}")]
    Header(String),
    /// The bitmaps extension or the bitmap directory is malformed: no bitmap can be read.
    #[error("bitmap directory: {0}")]
    Directory(String),
    /// The extension is there but its autoclear bit is clear: QEMU ignores every bitmap.
    #[error(
        "the image's bitmaps are ignored, as QEMU ignores them: a program without bitmap \
         support wrote to the image (autoclear bit 0 is clear), so they may miss its writes"
    )]
    Ignored,
    /// No bitmap has the name asked for.
    #[error("no bitmap {name:?} in the image ({have})")]
    NotFound { name: String, have: String },
    /// The bitmap is marked in use, so its contents cannot be trusted.
    #[error(
        "bitmap {name:?} is in use: the image was not closed cleanly or is open elsewhere, so \
         it is inconsistent (`qemu-img check -r all` does not repair it; \
         `qemu-img bitmap --remove IMAGE {name}` deletes it)"
    )]
    InUse { name: String },
    /// The bitmap is well formed but not one that can be served (type, flags, granularity,
    /// extra data).
    #[error("bitmap {name:?}: {why}")]
    Unsupported { name: String, why: String },
    /// The bitmap's table or data is malformed.
    #[error("bitmap {name:?} is damaged: {why}")]
    Damaged { name: String, why: String },
    /// Loading the bitmap would take more memory than the limit allows.
    #[error(
        "bitmap {name:?} needs {bytes} bytes of memory ({bits} bits), more than the limit of \
         {limit} bytes: raise the limit, or use a bitmap of a coarser granularity"
    )]
    TooLarge {
        name: String,
        bits: u64,
        bytes: u64,
        limit: u64,
    },
}

#[cfg(test)]
mod qemu_tests;
#[cfg(test)]
mod test_image;
#[cfg(test)]
mod tests;
