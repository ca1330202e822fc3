//! The header fields the bitmaps need (version and cluster size through `header.rs`'s probe;
//! virtual size, autoclear bits, header length and backing file offset read here) and the
//! walk of the header extensions that finds the bitmaps extension, with QEMU's checks of it
//! (`qcow2_read_extensions`).

use std::fs::File;
use std::os::unix::fs::FileExt;

use zcnbd_proto::cursor::Reader;

use super::{BitmapError, BITMAPS_MAX, BITMAP_DIRECTORY_BYTES_MAX};
use crate::export::base::image::header::{probe, Probed};

/// The bitmaps header extension's type, and its length.
const EXT_BITMAPS: u32 = 0x2385_2875;
const EXT_BITMAPS_BYTES: u32 = 24;
/// The end of the header extensions.
const EXT_END: u32 = 0;
/// Autoclear feature bit 0: the bitmaps extension is consistent.
const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// Where the header fields read here are (docs/interop/qcow2.rst, "Header").
const BACKING_FILE_OFFSET_AT: usize = 8;
const SIZE_AT: usize = 24;
const AUTOCLEAR_AT: usize = 88;
const HEADER_LENGTH_AT: usize = 100;
/// A version 2 header's length; a version 3 header's shortest.
const HEADER_V2_BYTES: u64 = 72;
const HEADER_V3_BYTES_MIN: u64 = 104;
/// The cluster sizes QEMU opens (as `header.rs` checks them): 512 B to 2 MiB.
const CLUSTER_BITS_MIN: u32 = 9;
const CLUSTER_BITS_MAX: u32 = 21;

/// What the header says about the image's size and layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageShape {
    /// Bytes in the image file (what may be read).
    pub file_bytes: u64,
    /// Bytes per cluster.
    pub cluster_bytes: u64,
    /// The disk's size.
    pub virtual_bytes: u64,
}

/// What the header says about bitmaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extension {
    /// No bitmaps extension.
    Absent,
    /// A bitmaps extension without autoclear bit 0 (or in a version 2 image, which has no
    /// autoclear bits): a program without bitmap support wrote to the image, so QEMU ignores
    /// every bitmap, and so does zcnbd.
    Ignored,
    /// A bitmaps extension to read.
    Present(BitmapsExtension),
}

/// The bitmaps extension's fields, checked as QEMU checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapsExtension {
    /// How many bitmaps the directory holds (1 to [`BITMAPS_MAX`]).
    pub nb_bitmaps: u32,
    /// The directory's size in bytes (1 to [`BITMAP_DIRECTORY_BYTES_MAX`]).
    pub directory_bytes: u64,
    /// Where the directory is (cluster aligned, inside the file).
    pub directory_offset: u64,
}

/// The fixed header fields read here.
struct Fields {
    backing_file_offset: u64,
    virtual_bytes: u64,
    autoclear: u64,
    header_bytes: u64,
}

/// Reads `file`'s qcow2 header (the file has `file_bytes` bytes): its shape, and what it says
/// about bitmaps.
pub(super) fn locate(file: &File, file_bytes: u64) -> Result<(ImageShape, Extension), BitmapError> {
    let h = match probe(file) {
        Ok(Probed::Qcow2(h)) => h,
        Ok(_) => return Err(BitmapError::Header("not a qcow2 image".to_owned())),
        Err(source) => return Err(io_error("the qcow2 header", source)),
    };
    if !(2..=3).contains(&h.version) {
        return Err(BitmapError::Header(format!(
            "qcow2 version {} is not supported",
            h.version
        )));
    }
    if !(CLUSTER_BITS_MIN..=CLUSTER_BITS_MAX).contains(&h.cluster_bits) {
        return Err(BitmapError::Header(format!(
            "cluster_bits {} is out of range",
            h.cluster_bits
        )));
    }
    let cluster_bytes = h.cluster_bytes();
    // The extensions end at the backing file's name, or at the end of the first cluster.
    let end = cluster_bytes.min(file_bytes);
    let mut first = vec![0u8; end as usize];
    file.read_exact_at(&mut first, 0)
        .map_err(|e| io_error("the qcow2 header", e))?;
    let fields = fields(&first, h.version, cluster_bytes)?;
    let shape = ImageShape {
        file_bytes,
        cluster_bytes,
        virtual_bytes: fields.virtual_bytes,
    };
    let ext_end = match fields.backing_file_offset {
        0 => cluster_bytes,
        at => at,
    };
    let area = first
        .get(fields.header_bytes as usize..ext_end.min(end) as usize)
        .unwrap_or_default();
    let extension = match find_bitmaps(area)? {
        None => Extension::Absent,
        Some(_) if fields.autoclear & AUTOCLEAR_BITMAPS == 0 => Extension::Ignored,
        Some(bytes) => Extension::Present(bitmaps_extension(bytes, &shape)?),
    };
    Ok((shape, extension))
}

/// The fixed fields of the header at the start of `first` (the first cluster, or as much of
/// it as the file has).
fn fields(first: &[u8], version: u32, cluster_bytes: u64) -> Result<Fields, BitmapError> {
    let short = || BitmapError::Header("the header is cut short".to_owned());
    let backing_file_offset = be64_at(first, BACKING_FILE_OFFSET_AT).ok_or_else(short)?;
    let virtual_bytes = be64_at(first, SIZE_AT).ok_or_else(short)?;
    if version < 3 {
        return Ok(Fields {
            backing_file_offset,
            virtual_bytes,
            autoclear: 0,
            header_bytes: HEADER_V2_BYTES,
        });
    }
    let autoclear = be64_at(first, AUTOCLEAR_AT).ok_or_else(short)?;
    let header_bytes = be32_at(first, HEADER_LENGTH_AT).ok_or_else(short)?;
    let header_bytes = u64::from(header_bytes);
    // QEMU: "qcow2 header too short" / "qcow2 header exceeds cluster size".
    if header_bytes < HEADER_V3_BYTES_MIN || header_bytes > cluster_bytes {
        return Err(BitmapError::Header(format!(
            "header_length {header_bytes} is out of range"
        )));
    }
    // QEMU: "Invalid backing file offset".
    if backing_file_offset > cluster_bytes {
        return Err(BitmapError::Header(format!(
            "backing_file_offset {backing_file_offset} is past the first cluster"
        )));
    }
    Ok(Fields {
        backing_file_offset,
        virtual_bytes,
        autoclear,
        header_bytes,
    })
}

fn be32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Reader::new(bytes.get(at..)?).u32()
}

fn be64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Reader::new(bytes.get(at..)?).u64()
}

/// The bitmaps extension's data in the extension area `area`, if there is one. Each
/// extension must fit in the area, as QEMU requires ("Header extension too large").
fn find_bitmaps(area: &[u8]) -> Result<Option<&[u8]>, BitmapError> {
    let too_large = || BitmapError::Header("a header extension is too large".to_owned());
    let mut r = Reader::new(area);
    let mut found = None;
    while !r.is_empty() {
        let kind = r.u32().ok_or_else(too_large)?;
        let len = r.u32().ok_or_else(too_large)? as usize;
        let data = r.take(len).ok_or_else(too_large)?;
        if kind == EXT_END {
            break;
        }
        // Padding to 8 (`len` is at most the area's length: no overflow); the last
        // extension's padding may be cut by the area's end.
        let padding = len.next_multiple_of(8) - len;
        r.take(padding.min(r.remaining()));
        if kind != EXT_BITMAPS {
            continue;
        }
        // "Each header extension type shall appear at most once."
        if found.is_some() {
            return Err(BitmapError::Directory(
                "two bitmaps header extensions".to_owned(),
            ));
        }
        if len != EXT_BITMAPS_BYTES as usize {
            return Err(BitmapError::Directory(format!(
                "the bitmaps extension is {len} bytes, not {EXT_BITMAPS_BYTES}"
            )));
        }
        found = Some(data);
    }
    Ok(found)
}

/// The bitmaps extension's 24 bytes, checked as QEMU checks them, and the directory inside
/// the file.
fn bitmaps_extension(bytes: &[u8], shape: &ImageShape) -> Result<BitmapsExtension, BitmapError> {
    let bad = |why: String| Err(BitmapError::Directory(why));
    let mut r = Reader::new(bytes);
    let (Some(nb_bitmaps), Some(reserved), Some(directory_bytes), Some(directory_offset)) =
        (r.u32(), r.u32(), r.u64(), r.u64())
    else {
        return bad("the bitmaps extension is cut short".to_owned());
    };
    if reserved != 0 {
        return bad(format!(
            "the bitmaps extension's reserved field is {reserved:#x}, not 0"
        ));
    }
    if nb_bitmaps == 0 || nb_bitmaps > BITMAPS_MAX {
        return bad(format!(
            "nb_bitmaps {nb_bitmaps} is out of range (1 to {BITMAPS_MAX})"
        ));
    }
    if directory_bytes == 0 || directory_bytes > BITMAP_DIRECTORY_BYTES_MAX {
        return bad(format!(
            "the directory's size {directory_bytes} is out of range (1 to \
             {BITMAP_DIRECTORY_BYTES_MAX}, BITMAP_DIRECTORY_BYTES_MAX)"
        ));
    }
    if !directory_offset.is_multiple_of(shape.cluster_bytes) || directory_offset == 0 {
        return bad(format!(
            "the directory's offset {directory_offset:#x} is not a cluster's"
        ));
    }
    if !within(directory_offset, directory_bytes, shape.file_bytes) {
        return bad(format!(
            "the directory ({directory_bytes} bytes at {directory_offset:#x}) is outside the \
             file ({} bytes)",
            shape.file_bytes
        ));
    }
    Ok(BitmapsExtension {
        nb_bitmaps,
        directory_bytes,
        directory_offset,
    })
}

/// Whether `[offset, offset+len)` is inside a file of `file_bytes` bytes.
pub(super) fn within(offset: u64, len: u64, file_bytes: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= file_bytes)
}

/// An I/O error reading `what`.
pub(super) fn io_error(what: &str, source: std::io::Error) -> BitmapError {
    BitmapError::Io {
        what: what.to_owned(),
        source,
    }
}
