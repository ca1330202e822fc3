//! A loaded dirty bitmap and its block status: one bit per granule of the disk, in 64-bit
//! words (bit `b` of word `w` is granule `64 * w + b`); bits past the disk's last granule are
//! kept clear, so a search never runs past the disk.

use zcnbd_proto::meta::DIRTY_BITMAP_PREFIX;
use zcnbd_proto::Extent;

use super::STATE_DIRTY;

/// A bitmap in memory, read from an image by [`super::BitmapDirectory::load`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    name: String,
    granularity_bits: u8,
    virtual_bytes: u64,
    /// Granules: `virtual_bytes` divided by the granularity, rounded up.
    bits: u64,
    /// Invariant: `words.len() == bits.div_ceil(64)`, and bits `>= bits` are clear.
    words: Vec<u64>,
}

impl DirtyBitmap {
    /// The bitmap `name` of a disk of `virtual_bytes`, `bits` granules of
    /// `1 << granularity_bits` bytes, from `words` (bits past `bits` are cleared).
    pub(super) fn new(
        name: String,
        granularity_bits: u8,
        virtual_bytes: u64,
        bits: u64,
        mut words: Vec<u64>,
    ) -> DirtyBitmap {
        words.resize(bits.div_ceil(64) as usize, 0);
        if let (Some(last), tail @ 1..) = (words.last_mut(), bits % 64) {
            *last &= (1u64 << tail) - 1;
        }
        DirtyBitmap {
            name,
            granularity_bits,
            virtual_bytes,
            bits,
            words,
        }
    }

    /// The bitmap's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The metadata context that serves it: `qemu:dirty-bitmap:NAME`.
    pub fn context(&self) -> String {
        format!("{DIRTY_BITMAP_PREFIX}{}", self.name)
    }

    /// Bytes of disk per bit.
    pub fn granularity_bytes(&self) -> u64 {
        1u64 << self.granularity_bits
    }

    /// The disk's size.
    pub fn virtual_bytes(&self) -> u64 {
        self.virtual_bytes
    }

    /// Bytes of memory its bits take.
    pub fn memory_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Whether the granule holding byte `offset` of the disk is dirty (false past the end).
    pub fn is_dirty(&self, offset: u64) -> bool {
        self.bit(offset >> self.granularity_bits)
    }

    /// Appends up to `extents_max` extents covering `[offset, offset+len)` from `offset` on,
    /// clipped to the disk's end: maximal runs of clean (flags 0) or dirty
    /// ([`STATE_DIRTY`]) granules, the first and last cut at the range's edges. Nothing past
    /// the end of the disk, or for an empty range.
    pub fn extents(&self, offset: u64, len: u64, extents_max: usize, out: &mut Vec<Extent>) {
        let end = offset.saturating_add(len).min(self.virtual_bytes);
        let mut pos = offset;
        let mut count = 0;
        while pos < end && count < extents_max {
            let granule = pos >> self.granularity_bits;
            let dirty = self.bit(granule);
            // The first granule of the next run; its start is past `pos`, so each extent
            // has a length.
            let next = self.next_change(granule + 1, dirty);
            let next_pos = next
                .checked_mul(self.granularity_bytes())
                .map_or(end, |p| p.min(end));
            out.push(Extent {
                length: next_pos - pos,
                flags: if dirty { STATE_DIRTY } else { 0 },
            });
            pos = next_pos;
            count += 1;
        }
    }

    /// Granule `i`'s bit (clear past the end).
    fn bit(&self, i: u64) -> bool {
        let word = self.words.get((i / 64) as usize).copied().unwrap_or(0);
        word >> (i % 64) & 1 == 1
    }

    /// The first granule at or after `from` whose bit is not `value`, or `bits` if none is.
    fn next_change(&self, from: u64, value: bool) -> u64 {
        let flip = if value { !0 } else { 0 };
        let mut w = (from / 64) as usize;
        let Some(first) = self.words.get(w) else {
            return self.bits;
        };
        // Bits before `from` in its word do not count.
        let mut differ = (first ^ flip) & (!0u64 << (from % 64));
        loop {
            if differ != 0 {
                let i = w as u64 * 64 + u64::from(differ.trailing_zeros());
                return i.min(self.bits);
            }
            w += 1;
            match self.words.get(w) {
                Some(word) => differ = word ^ flip,
                None => return self.bits,
            }
        }
    }
}
