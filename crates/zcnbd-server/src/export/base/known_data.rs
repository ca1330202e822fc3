//! Which parts of the memory export are known to hold data, so that a read need not ask the
//! kernel (`mincore`, a system call that was a tenth of the server's CPU time at 4 KiB reads)
//! whether its range has holes before it can be sent straight from the mapping.
//!
//! One bit per 64 KiB chunk, set once `mincore` saw every page of the chunk resident. Only a
//! punched hole (trim, zeroing) can make such a chunk sparse again, and those clear the bits
//! of every chunk they touch, before and after punching. A bit that is wrongly set would make
//! a read of a hole fault a zero page into the memfd: the data stays right (zeroes), only the
//! hole is lost. A bit that is wrongly clear costs one `mincore`.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes per bit. 1 TiB of export takes 2 MiB of bits.
pub const CHUNK_BYTES: u64 = 64 * 1024;

#[derive(Debug)]
pub struct KnownData {
    size: u64,
    bits: Box<[AtomicU64]>,
}

impl KnownData {
    /// Nothing known yet, for an export of `size` bytes.
    pub fn new(size: u64) -> KnownData {
        let words = size.div_ceil(CHUNK_BYTES).div_ceil(64) as usize;
        KnownData {
            size,
            bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// `[offset, end)` widened to whole chunks, clipped to the export.
    pub fn widen(&self, offset: u64, end: u64) -> (u64, u64) {
        let start = offset / CHUNK_BYTES * CHUNK_BYTES;
        let end = end
            .checked_next_multiple_of(CHUNK_BYTES)
            .unwrap_or(u64::MAX)
            .min(self.size);
        (start.min(end), end)
    }

    /// Whether every chunk that `[offset, end)` touches is known to be all data.
    pub fn covers(&self, offset: u64, end: u64) -> bool {
        if offset >= end || end > self.size {
            return false;
        }
        (offset / CHUNK_BYTES..end.div_ceil(CHUNK_BYTES)).all(|chunk| self.is_set(chunk))
    }

    /// Records that the chunk starting at `chunk_offset` (a multiple of [`CHUNK_BYTES`]) is
    /// all data.
    pub fn mark(&self, chunk_offset: u64) {
        let chunk = chunk_offset / CHUNK_BYTES;
        if let Some(word) = self.bits.get((chunk / 64) as usize) {
            word.fetch_or(1 << (chunk % 64), Ordering::Release);
        }
    }

    /// Forgets every chunk that `[offset, offset + len)` touches (a hole may appear there).
    pub fn forget(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        for chunk in offset / CHUNK_BYTES..end.div_ceil(CHUNK_BYTES) {
            if let Some(word) = self.bits.get((chunk / 64) as usize) {
                word.fetch_and(!(1 << (chunk % 64)), Ordering::Release);
            }
        }
    }

    fn is_set(&self, chunk: u64) -> bool {
        self.bits
            .get((chunk / 64) as usize)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1 << (chunk % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_only_what_was_marked_and_not_forgotten() {
        let k = KnownData::new(10 * CHUNK_BYTES + 100);
        assert!(!k.covers(0, 1));
        k.mark(0);
        k.mark(CHUNK_BYTES);
        assert!(k.covers(0, 2 * CHUNK_BYTES));
        assert!(k.covers(100, CHUNK_BYTES + 5));
        assert!(!k.covers(100, 2 * CHUNK_BYTES + 1));
        k.forget(CHUNK_BYTES + 4095, 1);
        assert!(k.covers(0, CHUNK_BYTES));
        assert!(!k.covers(0, CHUNK_BYTES + 1));
        // The partial last chunk, and nothing past the end.
        k.mark(10 * CHUNK_BYTES);
        assert!(k.covers(10 * CHUNK_BYTES, 10 * CHUNK_BYTES + 100));
        assert!(!k.covers(10 * CHUNK_BYTES, 10 * CHUNK_BYTES + 101));
        assert!(!k.covers(5, 5));
    }

    #[test]
    fn widen_rounds_out_to_chunks_within_the_export() {
        let k = KnownData::new(3 * CHUNK_BYTES + 10);
        assert_eq!(k.widen(5, 6), (0, CHUNK_BYTES));
        assert_eq!(
            k.widen(CHUNK_BYTES, 2 * CHUNK_BYTES),
            (CHUNK_BYTES, 2 * CHUNK_BYTES)
        );
        assert_eq!(
            k.widen(3 * CHUNK_BYTES + 1, u64::MAX),
            (3 * CHUNK_BYTES, 3 * CHUNK_BYTES + 10)
        );
    }
}
