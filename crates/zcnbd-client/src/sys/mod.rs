//! The client's only unsafe code: caller memory held as raw pieces while a request is in
//! flight, turned back into slices for the socket calls that receive into it or send from it;
//! owned buffers whose bytes stay put while their owner moves (`stable.rs`); a caller's pipe
//! that read data is spliced into (`pipe.rs`); the vsock address structure (`vsock.rs`); and
//! a TCP socket's receive low-water mark (`low_water.rs`).
//!
//! The rule every constructor's caller signs ([`Buffer::from_raw`]): the memory stays valid,
//! and nothing else reads or writes it, until the request completes (its completion runs) or
//! is abandoned ([`Buffer::detach`]). The blocking API upholds it by not returning before the
//! completion; the submit API by owning the buffer until then; the C ABI by its documented
//! contract.

use std::io::{IoSlice, IoSliceMut};

mod blocking;
pub mod low_water;
mod pipe;
mod raw;
mod stable;
pub mod vsock;

pub use pipe::{lend_pipe, PipeEnd, Spliced};
pub use stable::{lend_stable, StableBuffer};

/// One piece of caller memory.
#[derive(Debug, Clone, Copy)]
struct RawPiece {
    ptr: *mut u8,
    len: usize,
}

/// A request's buffer: caller memory in one or more pieces, in order.
#[derive(Debug, Default)]
pub struct Buffer {
    pieces: Vec<RawPiece>,
    total: u64,
}

// SAFETY: a Buffer is only pointers to memory the caller handed over for the life of a
// request (see the module rule); which thread receives into it does not matter, and every
// access happens under the connection's lock, one thread at a time.
unsafe impl Send for Buffer {}

impl Buffer {
    /// A buffer over `pieces` (`(pointer, length)` pairs).
    ///
    /// # Safety
    /// Each piece must be valid for reads and writes of its length, and must not be accessed
    /// by anyone else, until the request using this buffer completes or is detached.
    pub unsafe fn from_raw(pieces: impl IntoIterator<Item = (*mut u8, usize)>) -> Buffer {
        let pieces: Vec<RawPiece> = pieces
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(ptr, len)| RawPiece { ptr, len })
            .collect();
        let total = pieces.iter().map(|p| p.len as u64).sum();
        Buffer { pieces, total }
    }

    /// A buffer over one mutable slice, for a call that blocks until the request completes.
    ///
    /// # Safety
    /// The caller must not let `slice`'s borrow end before the request completes or is
    /// detached (the blocking calls wait for completion, and detach on unwind).
    pub unsafe fn from_slice(slice: &mut [u8]) -> Buffer {
        // SAFETY: forwarded to the caller of this function.
        unsafe { Buffer::from_raw([(slice.as_mut_ptr(), slice.len())]) }
    }

    /// Total bytes.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The pieces covering `[at, at + bytes)`, as `(piece index, offset in piece, length)`.
    fn range(&self, at: u64, bytes: u64) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let mut skip = at;
        let mut left = bytes;
        self.pieces.iter().enumerate().filter_map(move |(i, p)| {
            let len = p.len as u64;
            if skip >= len {
                skip -= len;
                return None;
            }
            if left == 0 {
                return None;
            }
            let start = skip;
            let take = (len - start).min(left);
            skip = 0;
            left -= take;
            Some((i, start as usize, take as usize))
        })
    }

    /// A buffer over `[at, at + bytes)` of this one (for one part of a split request).
    pub fn sub(&self, at: u64, bytes: u64) -> Buffer {
        let pieces: Vec<RawPiece> = self
            .range(at, bytes)
            .map(|(i, start, len)| RawPiece {
                ptr: self.pieces[i].ptr.wrapping_add(start),
                len,
            })
            .collect();
        let total = pieces.iter().map(|p| p.len as u64).sum();
        Buffer { pieces, total }
    }

    /// Mutable slices over `[at, at + bytes)`, at most `max` of them, for a vectored receive.
    pub fn slices_mut(&mut self, at: u64, bytes: u64, max: usize) -> Vec<IoSliceMut<'_>> {
        let ranges: Vec<(usize, usize, usize)> = self.range(at, bytes).take(max).collect();
        ranges
            .into_iter()
            .map(|(i, start, len)| {
                let p = self.pieces[i];
                // SAFETY: `from_raw`'s contract makes the piece valid and ours alone until the
                // request completes; the range lies inside it; the slice's life is tied to
                // `&mut self`, so no two exist at once.
                IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(p.ptr.add(start), len) })
            })
            .collect()
    }

    /// Slices over `[at, at + bytes)`, appended to `out`, for a vectored send.
    pub fn slices<'a>(&'a self, at: u64, bytes: u64, out: &mut Vec<IoSlice<'a>>, max: usize) {
        for (i, start, len) in self.range(at, bytes) {
            if out.len() >= max {
                return;
            }
            let p = self.pieces[i];
            // SAFETY: as in `slices_mut`; shared slices tied to `&self`.
            out.push(IoSlice::new(unsafe {
                std::slice::from_raw_parts(p.ptr.add(start), len)
            }));
        }
    }

    /// Fills `[at, at + bytes)` with zeroes (a hole in a read reply).
    pub fn zero(&mut self, at: u64, bytes: u64) {
        for mut slice in self.slices_mut(at, bytes, usize::MAX) {
            slice.fill(0);
        }
    }

    /// Forgets the caller's memory: what was still to arrive for it is discarded. Used when
    /// the caller stops waiting (a panic unwinding through a blocking call).
    pub fn detach(&mut self) {
        self.pieces.clear();
    }

    /// Whether [`Buffer::detach`] was called (the memory is no longer ours to write).
    pub fn is_detached(&self) -> bool {
        self.pieces.is_empty() && self.total > 0
    }
}

/// Lends an owned vector's memory to a request; the vector must then move into the
/// request's completer, which keeps its heap memory alive and in place until the end.
pub fn lend_vec(v: &mut Vec<u8>) -> Buffer {
    // SAFETY: the caller (`submit_owned`) moves `v` into the completer, so the heap memory
    // outlives the request, and nobody touches it until the completer hands it back.
    unsafe { Buffer::from_raw([(v.as_mut_ptr(), v.len())]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cross_piece_boundaries() {
        let mut a = [0u8; 3];
        let mut b = [0u8; 5];
        // SAFETY: both arrays outlive the buffer and are used only through it below.
        let mut buf =
            unsafe { Buffer::from_raw([(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len())]) };
        assert_eq!(buf.len(), 8);
        for (n, mut s) in buf.slices_mut(2, 4, 16).into_iter().enumerate() {
            s.fill(n as u8 + 1);
        }
        let sub = buf.sub(1, 6);
        let mut shared = Vec::new();
        sub.slices(0, 6, &mut shared, 16);
        let seen: Vec<u8> = shared.iter().flat_map(|s| s.iter().copied()).collect();
        assert_eq!(seen, [0, 1, 2, 2, 2, 0]);
        drop(shared);
        buf.zero(0, 8);
        drop(buf);
        assert_eq!(a, [0; 3]);
        assert_eq!(b, [0; 5]);
    }
}
