//! A dirty bitmap in memory: one bit per granule of an export (set: written since the bitmap
//! was created or last cleared), set by any thread without a lock, read as the extents of
//! QEMU's `qemu:dirty-bitmap:NAME` context (flag bit 0: dirty).

use std::sync::atomic::{AtomicU64, Ordering};

use zcnbd_proto::Extent;

/// The granularity of a bitmap unless configured (QEMU's default for a 64 KiB-cluster image).
pub const GRANULARITY_DEFAULT: u64 = 64 << 10;
/// The smallest granularity (QEMU's).
pub const GRANULARITY_MIN: u64 = 512;
/// The largest granularity (QEMU's).
pub const GRANULARITY_MAX: u64 = 1 << 31;
/// Most bits one bitmap may have: 256 MiB of memory (a 128 TiB export at 64 KiB, 1 TiB at
/// 512 bytes). A bitmap that would have more is refused when it is made, with the numbers.
pub const BITMAP_BITS_MAX: u64 = 1 << 31;
/// Most granules one block status question examines (the spec lets a reply describe less
/// than was asked): 128 KiB of bitmap, 1 TiB of export at 64 KiB.
pub const SCAN_BITS_MAX: u64 = 1 << 24;

/// The flag of a dirty extent.
pub const DIRTY: u32 = 1;

/// Why a bitmap cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BitmapError {
    /// The granularity is not a power of two in range.
    #[error("granularity {0} is not a power of two from 512 bytes to 2 GiB")]
    Granularity(u64),
    /// The bitmap would be larger than the limit.
    #[error("{bits} bits ({size} bytes at granularity {granularity}) is over the limit of {max} bits (BITMAP_BITS_MAX, 256 MiB of memory): choose a larger granularity")]
    TooLarge {
        bits: u64,
        size: u64,
        granularity: u64,
        max: u64,
    },
}

/// One bit per `granularity` bytes of a `size`-byte export.
#[derive(Debug)]
pub struct DirtyBitmap {
    size: u64,
    granularity_bits: u32,
    words: Box<[AtomicU64]>,
}

impl DirtyBitmap {
    /// An empty (all clean) bitmap.
    pub fn new(size: u64, granularity: u64) -> Result<DirtyBitmap, BitmapError> {
        if !granularity.is_power_of_two()
            || !(GRANULARITY_MIN..=GRANULARITY_MAX).contains(&granularity)
        {
            return Err(BitmapError::Granularity(granularity));
        }
        let bits = size.div_ceil(granularity);
        if bits > BITMAP_BITS_MAX {
            return Err(BitmapError::TooLarge {
                bits,
                size,
                granularity,
                max: BITMAP_BITS_MAX,
            });
        }
        let words = (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Ok(DirtyBitmap {
            size,
            granularity_bits: granularity.trailing_zeros(),
            words,
        })
    }

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        1 << self.granularity_bits
    }

    /// The size of the export it describes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How many bits it has.
    pub fn bits(&self) -> u64 {
        self.size.div_ceil(self.granularity())
    }

    /// Memory its bits take.
    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Marks every granule that `[offset, offset+len)` touches dirty.
    pub fn set(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        let first = offset >> self.granularity_bits;
        let last = (end - 1) >> self.granularity_bits;
        self.set_bits(first, last + 1);
    }

    /// Marks every granule dirty.
    pub fn set_all(&self) {
        self.set_bits(0, self.bits());
    }

    /// Sets bits `[from, to)`. A word whose bits are already set is only read, so that
    /// writes to one region do not bounce its cache line between CPUs.
    fn set_bits(&self, from: u64, to: u64) {
        let mut bit = from;
        while bit < to {
            let word = (bit / 64) as usize;
            let lo = bit % 64;
            let hi = (to - (bit - lo)).min(64);
            let mask = ones(hi) & !ones(lo);
            let w = &self.words[word];
            if w.load(Ordering::Acquire) & mask != mask {
                w.fetch_or(mask, Ordering::AcqRel);
            }
            bit = bit - lo + 64;
        }
    }

    /// Marks everything clean.
    pub fn clear(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::Release);
        }
    }

    /// Whether bit `n` is set.
    fn get(&self, n: u64) -> bool {
        self.words[(n / 64) as usize].load(Ordering::Acquire) >> (n % 64) & 1 != 0
    }

    /// The first bit from `n` (before `to`) that differs from `value`, or `to`.
    fn run_end(&self, n: u64, to: u64, value: bool) -> u64 {
        let mut bit = n;
        while bit < to {
            let word = self.words[(bit / 64) as usize].load(Ordering::Acquire);
            let word = if value { !word } else { word };
            // Bits at or above `bit % 64` that differ from `value`.
            let differing = word & !ones(bit % 64);
            if differing != 0 {
                return (bit - bit % 64 + u64::from(differing.trailing_zeros())).min(to);
            }
            bit = bit - bit % 64 + 64;
        }
        to
    }

    /// Appends up to `max` extents of `[offset, offset+len)` from `offset` on (flag
    /// [`DIRTY`] or 0), examining at most [`SCAN_BITS_MAX`] granules: at least one extent
    /// when `len > 0` and the range is inside the export.
    pub fn extents(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return;
        }
        let last = (end - 1) >> self.granularity_bits;
        let mut bit = offset >> self.granularity_bits;
        let scan_to = (last + 1).min(bit.saturating_add(SCAN_BITS_MAX));
        let mut at = offset;
        let mut added = 0;
        while bit < scan_to && added < max.max(1) {
            let dirty = self.get(bit);
            let stop = self.run_end(bit, scan_to, dirty);
            let stop_byte = (stop << self.granularity_bits).min(end);
            out.push(Extent {
                length: stop_byte - at,
                flags: if dirty { DIRTY } else { 0 },
            });
            added += 1;
            at = stop_byte;
            bit = stop;
        }
    }

    /// Bytes of the export marked dirty (whole granules; the last one clipped).
    pub fn dirty_bytes(&self) -> u64 {
        let bits: u64 = self
            .words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Acquire).count_ones()))
            .sum();
        let total = bits << self.granularity_bits;
        let tail = self.bits() << self.granularity_bits;
        if self.bits() > 0 && self.get(self.bits() - 1) {
            total - (tail - self.size)
        } else {
            total
        }
    }

    /// Its words, for saving (bit `n` is bit `n % 64` of word `n / 64`).
    pub fn words(&self) -> Vec<u64> {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Acquire))
            .collect()
    }

    /// Sets the bits `words` has (as [`DirtyBitmap::words`] gives them); bits past the end,
    /// and words past the last, are ignored.
    pub fn merge_words(&self, words: &[u64]) {
        let bits = self.bits();
        for (i, (w, &saved)) in self.words.iter().zip(words).enumerate() {
            let first = i as u64 * 64;
            let valid = ones((bits - first).min(64));
            w.fetch_or(saved & valid, Ordering::AcqRel);
        }
    }
}

/// A mask of the low `n` bits (`n` up to 64).
fn ones(n: u64) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1 << n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 64 << 10;

    fn extents(b: &DirtyBitmap, offset: u64, len: u64, max: usize) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        b.extents(offset, len, max, &mut out);
        out.iter().map(|e| (e.length, e.flags)).collect()
    }

    #[test]
    fn a_write_dirties_every_granule_it_touches() {
        let b = DirtyBitmap::new(100 * G, G).unwrap();
        b.set(G - 1, 2);
        assert_eq!(extents(&b, 0, 100 * G, 10), [(2 * G, DIRTY), (98 * G, 0)]);
        b.set(10 * G, G);
        assert_eq!(
            extents(&b, 0, 100 * G, 10),
            [(2 * G, DIRTY), (8 * G, 0), (G, DIRTY), (89 * G, 0)]
        );
        assert_eq!(b.dirty_bytes(), 3 * G);
    }

    #[test]
    fn extents_start_at_the_offset_and_stop_at_the_end_of_the_question() {
        let b = DirtyBitmap::new(200 * G, G).unwrap();
        b.set(64 * G, 70 * G); // across word boundaries
        assert_eq!(
            extents(&b, 100, 64 * G, 10),
            [(64 * G - 100, 0), (100, DIRTY)]
        );
        assert_eq!(extents(&b, 70 * G + 5, 200, 10), [(200, DIRTY)]);
        assert_eq!(extents(&b, 0, 200 * G, 2), [(64 * G, 0), (70 * G, DIRTY)]);
        assert_eq!(extents(&b, 0, 200 * G, 1), [(64 * G, 0)]);
    }

    #[test]
    fn the_last_granule_is_clipped_to_the_export() {
        let b = DirtyBitmap::new(3 * G + 7, G).unwrap();
        assert_eq!(b.bits(), 4);
        b.set(3 * G, 7);
        assert_eq!(extents(&b, 0, 3 * G + 7, 10), [(3 * G, 0), (7, DIRTY)]);
        assert_eq!(b.dirty_bytes(), 7);
        b.set(3 * G + 7, 100); // past the end: nothing
        b.set_all();
        assert_eq!(extents(&b, 0, 3 * G + 7, 10), [(3 * G + 7, DIRTY)]);
        assert_eq!(b.dirty_bytes(), 3 * G + 7);
        b.clear();
        assert_eq!(b.dirty_bytes(), 0);
    }

    #[test]
    fn words_round_trip_and_ignore_bits_past_the_end() {
        let b = DirtyBitmap::new(70 * G, G).unwrap();
        b.set(65 * G, G);
        let c = DirtyBitmap::new(70 * G, G).unwrap();
        c.merge_words(&[0, u64::MAX, 5]);
        assert_eq!(c.dirty_bytes(), 6 * G);
        let d = DirtyBitmap::new(70 * G, G).unwrap();
        d.merge_words(&b.words());
        assert_eq!(d.words(), b.words());
    }

    #[test]
    fn sizes_and_granularities_are_bounded() {
        assert_eq!(
            DirtyBitmap::new(G, 3000).unwrap_err(),
            BitmapError::Granularity(3000)
        );
        assert!(DirtyBitmap::new(G, 256).is_err());
        let err = DirtyBitmap::new(1 << 50, 512).unwrap_err();
        assert!(matches!(err, BitmapError::TooLarge { bits, .. } if bits == 1 << 41));
        // 1 TiB at 64 KiB: 2 MiB.
        assert_eq!(DirtyBitmap::new(1 << 40, G).unwrap().bytes(), 2 << 20);
        // Empty exports have no bits and no extents.
        let e = DirtyBitmap::new(0, G).unwrap();
        assert_eq!(extents(&e, 0, 0, 1), []);
    }

    #[test]
    fn one_question_scans_a_bounded_number_of_granules() {
        let b = DirtyBitmap::new((SCAN_BITS_MAX + 10) * 512, 512).unwrap();
        let e = extents(&b, 0, (SCAN_BITS_MAX + 10) * 512, 10);
        assert_eq!(e, [(SCAN_BITS_MAX * 512, 0)]);
    }
}
