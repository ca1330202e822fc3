//! Loading one bitmap into memory: the checks QEMU makes before it uses a bitmap
//! (`check_dir_entry`, `check_table_entry`, `load_bitmap_data` in `block/qcow2-bitmap.c`),
//! then its table and data clusters.
//!
//! The bitmap data is the disk's bits in order, `cluster_bytes * 8` bits per data cluster:
//! bit `i` (least significant first) of byte `j` stands for granule `8 * j + i` (QEMU
//! serializes its bitmaps as little-endian words; the images `qemu-img` writes confirm it).
//! So eight bytes read as a little-endian `u64` are one word of the in-memory bitmap.

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::directory::{BitmapDirectory, BitmapEntry};
use super::directory::{FLAG_AUTO, FLAG_EXTRA_DATA_COMPATIBLE, FLAG_IN_USE};
use super::dirty::DirtyBitmap;
use super::extension::{io_error, within, Extension, ImageShape};
use super::{BitmapError, GRANULARITY_BITS_MAX, GRANULARITY_BITS_MIN};

/// The only bitmap type: dirty tracking.
const KIND_DIRTY_TRACKING: u8 = 1;
/// Flag bits the specification defines; the rest are reserved.
const FLAGS_KNOWN: u32 = FLAG_IN_USE | FLAG_AUTO | FLAG_EXTRA_DATA_COMPATIBLE;
/// A bitmap table entry: bits 9-55 the data cluster's offset; bit 0, where the offset is 0,
/// "all ones" (else all zeros); the rest reserved (QEMU's `BME_TABLE_ENTRY_*`).
const TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const TABLE_ALL_ONES: u64 = 1 << 0;
const TABLE_RESERVED_MASK: u64 = 0xff00_0000_0000_01fe;

impl BitmapDirectory {
    /// Loads the bitmap called `name` from `file` (the file this directory was read from)
    /// into memory, if it can be served and its bits take at most `bytes_max` bytes of memory
    /// ([`super::BITMAP_BYTES_MAX_DEFAULT`] is the default limit). While it loads, its table
    /// (1/64 of that at most) and one cluster's buffer are allocated too.
    pub fn load(
        &self,
        file: &File,
        name: &str,
        bytes_max: u64,
    ) -> Result<DirtyBitmap, BitmapError> {
        if self.extension() == Extension::Ignored {
            return Err(BitmapError::Ignored);
        }
        let entry = self.find(name)?;
        usable(entry)?;
        let layout = Layout::of(entry, &self.shape(), bytes_max)?;
        let mut loading = Loading {
            file,
            entry,
            cluster: vec![0u8; layout.cluster_bytes.min(layout.data_bytes) as usize],
            layout,
        };
        let table = loading.table()?;
        let mut words = vec![0u64; loading.layout.words];
        for (i, raw) in table.iter().enumerate() {
            loading.fill(i, *raw, &mut words)?;
        }
        Ok(DirtyBitmap::new(
            entry.name.clone(),
            entry.granularity_bits,
            self.shape().virtual_bytes,
            loading.layout.bits,
            words,
        ))
    }
}

/// Why `entry` cannot be served, if it cannot: QEMU's refusals of a bitmap.
fn usable(entry: &BitmapEntry) -> Result<(), BitmapError> {
    let unsupported = |why: String| {
        Err(BitmapError::Unsupported {
            name: entry.name.clone(),
            why,
        })
    };
    if entry.in_use() {
        return Err(BitmapError::InUse {
            name: entry.name.clone(),
        });
    }
    if entry.kind != KIND_DIRTY_TRACKING {
        return unsupported(format!(
            "type {} is not a dirty tracking bitmap ({KIND_DIRTY_TRACKING})",
            entry.kind
        ));
    }
    if entry.flags & !FLAGS_KNOWN != 0 {
        return unsupported(format!("unknown flags {:#x}", entry.flags & !FLAGS_KNOWN));
    }
    // "If it is not set, the bitmap must not be used."
    if entry.extra_data_bytes != 0 && !entry.extra_data_compatible() {
        return unsupported(format!(
            "{} bytes of extra data that zcnbd does not know, not marked compatible",
            entry.extra_data_bytes
        ));
    }
    if !(GRANULARITY_BITS_MIN..=GRANULARITY_BITS_MAX).contains(&entry.granularity_bits) {
        return unsupported(format!(
            "granularity_bits {} is out of range ({GRANULARITY_BITS_MIN} to \
             {GRANULARITY_BITS_MAX})",
            entry.granularity_bits
        ));
    }
    Ok(())
}

/// How a usable bitmap of a disk is laid out, checked against the memory limit.
struct Layout {
    /// One bit per granule of the disk.
    bits: u64,
    /// Bytes of bitmap data in the image (`bits` rounded up to bytes).
    data_bytes: u64,
    /// Words in memory.
    words: usize,
    cluster_bytes: u64,
    file_bytes: u64,
}

impl Layout {
    fn of(entry: &BitmapEntry, shape: &ImageShape, bytes_max: u64) -> Result<Layout, BitmapError> {
        let damaged = |why: String| BitmapError::Damaged {
            name: entry.name.clone(),
            why,
        };
        // Granularity bits are 9 to 31 (checked): no overflow.
        let bits = shape.virtual_bytes.div_ceil(1u64 << entry.granularity_bits);
        let word_count = bits.div_ceil(64);
        let bytes = word_count * 8;
        let too_large = || BitmapError::TooLarge {
            name: entry.name.clone(),
            bits,
            bytes,
            limit: bytes_max,
        };
        if bytes > bytes_max {
            return Err(too_large());
        }
        let words = usize::try_from(word_count).map_err(|_| too_large())?;
        let data_bytes = bits.div_ceil(8);
        // QEMU refuses an empty table (`check_dir_entry`), and any other size than the
        // disk's (`load_bitmap_data`).
        let needed = data_bytes.div_ceil(shape.cluster_bytes);
        if entry.table_entries == 0 || u64::from(entry.table_entries) != needed {
            return Err(damaged(format!(
                "its table has {} entries where a disk of {} bytes needs {needed}",
                entry.table_entries, shape.virtual_bytes
            )));
        }
        Ok(Layout {
            bits,
            data_bytes,
            words,
            cluster_bytes: shape.cluster_bytes,
            file_bytes: shape.file_bytes,
        })
    }
}

/// One bitmap being read: what it reads into, and the cluster buffer its data passes
/// through.
struct Loading<'a> {
    file: &'a File,
    entry: &'a BitmapEntry,
    layout: Layout,
    /// One data cluster (or all of the data, if less).
    cluster: Vec<u8>,
}

impl Loading<'_> {
    fn damaged(&self, why: String) -> BitmapError {
        BitmapError::Damaged {
            name: self.entry.name.clone(),
            why,
        }
    }

    /// The bitmap's table, after checking it is where it may be. Its size was checked
    /// against the disk's ([`Layout::of`]): one entry per cluster of data, so at most 1/64
    /// of the memory limit.
    fn table(&self) -> Result<Vec<u64>, BitmapError> {
        let (at, layout) = (self.entry.table_offset, &self.layout);
        let table_bytes = u64::from(self.entry.table_entries) * 8;
        if at == 0 || !at.is_multiple_of(layout.cluster_bytes) {
            return Err(self.damaged(format!("its table offset {at:#x} is not a cluster's")));
        }
        if !within(at, table_bytes, layout.file_bytes) {
            return Err(self.damaged(format!(
                "its table ({table_bytes} bytes at {at:#x}) is outside the file ({} bytes)",
                layout.file_bytes
            )));
        }
        let mut bytes = vec![0u8; table_bytes as usize];
        self.file
            .read_exact_at(&mut bytes, at)
            .map_err(|e| io_error(&format!("bitmap {:?}'s table", self.entry.name), e))?;
        Ok(bytes
            .chunks_exact(8)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap_or_default()))
            .collect())
    }

    /// Fills the words of `words` that table entry `i` (`raw`) stands for: zeros, ones, or
    /// a data cluster's bytes.
    fn fill(&mut self, i: usize, raw: u64, words: &mut [u64]) -> Result<(), BitmapError> {
        let cluster_bytes = self.layout.cluster_bytes;
        let offset = raw & TABLE_OFFSET_MASK;
        // QEMU's `check_table_entry`.
        if raw & TABLE_RESERVED_MASK != 0
            || (offset != 0 && (raw & TABLE_ALL_ONES != 0 || !offset.is_multiple_of(cluster_bytes)))
        {
            return Err(self.damaged(format!("table entry {i} ({raw:#x}) is malformed")));
        }
        // The bytes of data this entry holds: a cluster's, the last one's up to the end.
        let start = i as u64 * cluster_bytes;
        let len = cluster_bytes.min(self.layout.data_bytes.saturating_sub(start));
        let first_word = (start / 8) as usize;
        let Some(dest) = words.get_mut(first_word..first_word + len.div_ceil(8) as usize) else {
            return Err(self.damaged(format!("table entry {i} is past the bitmap's end")));
        };
        if offset == 0 {
            dest.fill(if raw & TABLE_ALL_ONES != 0 { !0 } else { 0 });
            return Ok(());
        }
        if !within(offset, len, self.layout.file_bytes) {
            return Err(self.damaged(format!(
                "table entry {i}'s data cluster at {offset:#x} is outside the file"
            )));
        }
        let buf = self.cluster.get_mut(..len as usize).unwrap_or_default();
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| io_error(&format!("bitmap {:?}'s data", self.entry.name), e))?;
        for (word, bytes) in dest.iter_mut().zip(buf.chunks(8)) {
            let mut le = [0u8; 8];
            le[..bytes.len()].copy_from_slice(bytes);
            *word = u64::from_le_bytes(le);
        }
        Ok(())
    }
}
