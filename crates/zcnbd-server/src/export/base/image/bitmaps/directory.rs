//! The bitmap directory: one entry per bitmap, in the order QEMU wrote them. Reading it is
//! cheap (one read of at most [`BITMAP_DIRECTORY_BYTES_MAX`]) and checks only its structure,
//! as QEMU's `bitmap_list_load` does: entries that fit, as many as the extension says, names
//! of 1 to [`BITMAP_NAME_BYTES_MAX`] bytes. Whether a bitmap can be served (its flags, type,
//! granularity, table) is checked when it is loaded, so one unusable bitmap does not hide
//! the others, and a writer can still mark it.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;

use zcnbd_proto::cursor::Reader;

use super::extension::{io_error, locate, BitmapsExtension, Extension, ImageShape};
use super::{BitmapError, BITMAP_DIRECTORY_BYTES_MAX, BITMAP_NAME_BYTES_MAX};

/// A directory entry's fixed part, before its extra data and name.
const ENTRY_FIXED_BYTES: usize = 24;
/// Where an entry's flags field is, from the entry's start.
const ENTRY_FLAGS_AT: u64 = 12;
/// Flag bits: the bitmap was not saved (inconsistent); it is enabled (tracks every write);
/// its extra data may be ignored.
pub(super) const FLAG_IN_USE: u32 = 1 << 0;
pub(super) const FLAG_AUTO: u32 = 1 << 1;
pub(super) const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 1 << 2;
/// Names listed in an error before "and N more".
const NAMES_LISTED_MAX: usize = 8;

/// One bitmap directory entry, as the image has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapEntry {
    /// The bitmap's name (UTF-8, 1 to [`BITMAP_NAME_BYTES_MAX`] bytes, unique).
    pub name: String,
    /// Where its bitmap table is in the file.
    pub table_offset: u64,
    /// How many 8-byte entries its table has.
    pub table_entries: u32,
    /// The flag bits (`in_use`, `auto`, `extra_data_compatible`; others reserved).
    pub flags: u32,
    /// The bitmap's type (1: dirty tracking).
    pub kind: u8,
    /// log2 of the bytes of disk one bit stands for.
    pub granularity_bits: u8,
    /// Bytes of type-specific extra data.
    pub extra_data_bytes: u32,
    /// Where in the file this entry's flags field is (4 bytes, big-endian): for a writer
    /// that marks the bitmap in use or disables it.
    pub flags_offset: u64,
}

impl BitmapEntry {
    /// Whether it is marked in use: not saved cleanly, so inconsistent.
    pub fn in_use(&self) -> bool {
        self.flags & FLAG_IN_USE != 0
    }

    /// Whether it is enabled (QEMU's `auto` flag): a writer must record its writes in it.
    pub fn auto(&self) -> bool {
        self.flags & FLAG_AUTO != 0
    }

    /// Whether its extra data, if any, may be ignored.
    pub fn extra_data_compatible(&self) -> bool {
        self.flags & FLAG_EXTRA_DATA_COMPATIBLE != 0
    }

    /// Bytes of disk per bit (`None` for granularity bits of 64 or more).
    pub fn granularity_bytes(&self) -> Option<u64> {
        1u64.checked_shl(u32::from(self.granularity_bits))
    }
}

/// An image's bitmaps: what its header says and its directory's entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapDirectory {
    shape: ImageShape,
    extension: Extension,
    entries: Vec<BitmapEntry>,
}

impl BitmapDirectory {
    /// Reads the bitmaps of the qcow2 image `file`, which has `file_bytes` bytes (its
    /// length, or a block device's size): none if it has no bitmaps extension, or if the
    /// extension is ignored (see [`Extension::Ignored`]).
    pub fn read(file: &File, file_bytes: u64) -> Result<BitmapDirectory, BitmapError> {
        let (shape, extension) = locate(file, file_bytes)?;
        let entries = match extension {
            Extension::Present(ext) => read_entries(file, &ext)?,
            Extension::Absent | Extension::Ignored => Vec::new(),
        };
        Ok(BitmapDirectory {
            shape,
            extension,
            entries,
        })
    }

    /// The image's size and layout, as its header says.
    pub fn shape(&self) -> ImageShape {
        self.shape
    }

    /// Whether the image has a bitmaps extension, and whether it is ignored.
    pub fn extension(&self) -> Extension {
        self.extension
    }

    /// The bitmaps, in directory order.
    pub fn entries(&self) -> &[BitmapEntry] {
        &self.entries
    }

    /// The bitmap called `name`.
    pub fn find(&self, name: &str) -> Result<&BitmapEntry, BitmapError> {
        if self.extension == Extension::Ignored {
            return Err(BitmapError::Ignored);
        }
        self.entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| BitmapError::NotFound {
                name: name.to_owned(),
                have: self.names_for_error(),
            })
    }

    /// "it has: a, b, c and N more", or "it has none".
    fn names_for_error(&self) -> String {
        if self.entries.is_empty() {
            return "it has none".to_owned();
        }
        let names: Vec<String> = self
            .entries
            .iter()
            .take(NAMES_LISTED_MAX)
            .map(|e| format!("{:?}", e.name))
            .collect();
        let more = self.entries.len() - names.len();
        let mut s = format!("it has: {}", names.join(", "));
        if more > 0 {
            s.push_str(&format!(" and {more} more"));
        }
        s
    }
}

/// Reads and parses the directory the extension points to.
fn read_entries(file: &File, ext: &BitmapsExtension) -> Result<Vec<BitmapEntry>, BitmapError> {
    // The extension's checks bound the size by BITMAP_DIRECTORY_BYTES_MAX and the file.
    debug_assert!(ext.directory_bytes <= BITMAP_DIRECTORY_BYTES_MAX);
    let mut dir = vec![0u8; ext.directory_bytes as usize];
    file.read_exact_at(&mut dir, ext.directory_offset)
        .map_err(|e| io_error("the bitmap directory", e))?;
    parse(&dir, ext)
}

/// The entries of the directory `dir`, read from the extension's offset.
fn parse(dir: &[u8], ext: &BitmapsExtension) -> Result<Vec<BitmapEntry>, BitmapError> {
    let nb = ext.nb_bitmaps as usize;
    // Each entry takes at least 32 bytes (24, a name, padding): no more than that many.
    let mut entries = Vec::with_capacity(nb.min(dir.len() / 32 + 1));
    let mut r = Reader::new(dir);
    while !r.is_empty() {
        let i = entries.len();
        // QEMU: "More bitmaps found than specified in header extension".
        if i == nb {
            return Err(bad(format!(
                "more bitmaps than the {nb} the extension says"
            )));
        }
        let at = (dir.len() - r.remaining()) as u64;
        let entry = parse_entry(&mut r, i)?;
        entries.push(BitmapEntry {
            flags_offset: ext.directory_offset + at + ENTRY_FLAGS_AT,
            ..entry
        });
    }
    // QEMU: "Less bitmaps found than specified in header extension".
    if entries.len() != nb {
        return Err(bad(format!(
            "{} bitmaps where the extension says {nb}",
            entries.len()
        )));
    }
    let mut seen = HashSet::with_capacity(entries.len());
    if let Some(twice) = entries.iter().find(|e| !seen.insert(e.name.as_str())) {
        return Err(bad(format!("two bitmaps are named {:?}", twice.name)));
    }
    Ok(entries)
}

/// Entry `i` at the reader's position (its flags offset still to be set).
fn parse_entry(r: &mut Reader<'_>, i: usize) -> Result<BitmapEntry, BitmapError> {
    let cut = || bad(format!("entry {i} runs past the directory's end"));
    let mut fixed = Reader::new(r.take(ENTRY_FIXED_BYTES).ok_or_else(cut)?);
    let (
        Some(table_offset),
        Some(table_entries),
        Some(flags),
        Some([kind, granularity_bits]),
        Some(name_bytes),
        Some(extra_data_bytes),
    ) = (
        fixed.u64(),
        fixed.u32(),
        fixed.u32(),
        fixed.take_array::<2>(),
        fixed.u16(),
        fixed.u32(),
    )
    else {
        return Err(cut());
    };
    if name_bytes == 0 || name_bytes > BITMAP_NAME_BYTES_MAX {
        return Err(bad(format!(
            "entry {i}'s name_size {name_bytes} is out of range (1 to {BITMAP_NAME_BYTES_MAX})"
        )));
    }
    // The variable part and the padding to 8 must be in the directory (QEMU's
    // `next_dir_entry(e) > dir_end` check): extra data first, then the name.
    let extra = extra_data_bytes as usize;
    let body = extra + usize::from(name_bytes);
    let padded = (ENTRY_FIXED_BYTES + body).next_multiple_of(8) - ENTRY_FIXED_BYTES;
    let rest = r.take(padded).ok_or_else(cut)?;
    let name = rest.get(extra..body).ok_or_else(cut)?;
    let name = std::str::from_utf8(name)
        .map_err(|_| bad(format!("entry {i}'s name is not UTF-8")))?
        .to_owned();
    Ok(BitmapEntry {
        name,
        table_offset,
        table_entries,
        flags,
        kind,
        granularity_bits,
        extra_data_bytes,
        flags_offset: 0,
    })
}

fn bad(why: String) -> BitmapError {
    BitmapError::Directory(why)
}
