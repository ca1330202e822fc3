//! The memory a connection's operations point at, in the forms the driver knows: a buffer a
//! file operation or a write payload's receive uses ([`IoBuf`], [`Dest`]), and the receive
//! side's own memory ([`RecvMem`]). Each lives on the heap (or in a mapping) and keeps its
//! address when the value that owns it moves, which is what lets an operation point at it
//! while it sits in a [`Lent`](super::lent::Lent) that moves with the connection.
//!
//! Safe code may read and write all of it through these types while it is not lent; only the
//! driver turns it into addresses for the kernel (`op.rs`).

use std::ops::Range;

use super::fixed::FixedBuf;
use crate::buffer_pool::PooledBuf;
use crate::sys::mapping::MappedRange;

/// A buffer of the connection's own: where a file operation reads into or writes from, and
/// where a write payload may be received.
pub enum IoBuf {
    /// A pooled buffer: plain `READ` / `WRITE`.
    Pooled(PooledBuf),
    /// A run of the ring's registered region: `READ_FIXED` / `WRITE_FIXED`.
    Fixed(FixedBuf),
}

impl IoBuf {
    /// Bytes the buffer holds.
    pub fn len(&self) -> usize {
        match self {
            IoBuf::Pooled(buf) => buf.len(),
            IoBuf::Fixed(buf) => buf.len(),
        }
    }

    /// The buffer's bytes, to read or fill while no operation uses them.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            IoBuf::Pooled(buf) => buf,
            IoBuf::Fixed(buf) => buf.data_mut(),
        }
    }

    /// The address of `range`, and the registered buffer it lies in (if any), for an
    /// operation; `None` if `range` is not inside the buffer.
    pub(super) fn io_range(&mut self, range: Range<usize>) -> Option<(*mut u8, Option<u16>)> {
        let fixed = match self {
            IoBuf::Fixed(buf) => Some(buf.index()),
            IoBuf::Pooled(_) => None,
        };
        let bytes = self.as_mut_slice().get_mut(range)?;
        Some((bytes.as_mut_ptr(), fixed))
    }
}

/// Where a write payload is received.
pub enum Dest {
    /// Straight into the memory export's mapping, in place.
    Mapped(MappedRange),
    /// Into a buffer of the connection's own.
    Buf(IoBuf),
}

impl Dest {
    /// Bytes of payload the destination takes.
    pub fn len(&self) -> usize {
        match self {
            Dest::Mapped(range) => range.len(),
            Dest::Buf(buf) => buf.len(),
        }
    }

    /// Copies `bytes` into the destination at `at` (payload bytes that arrived in the header
    /// stage); false if they do not fit.
    pub fn copy_in(&mut self, at: usize, bytes: &[u8]) -> bool {
        let fits = at
            .checked_add(bytes.len())
            .is_some_and(|end| end <= self.len());
        if !fits {
            return false;
        }
        match self {
            Dest::Mapped(range) => range.copy_in(at, bytes),
            Dest::Buf(buf) => {
                buf.as_mut_slice()[at..at + bytes.len()].copy_from_slice(bytes);
                true
            }
        }
    }

    /// The address of `range` for a receive; `None` if it is not inside the destination.
    pub(super) fn io_range(&mut self, range: Range<usize>) -> Option<*mut u8> {
        match self {
            Dest::Mapped(mapped) => mapped.io_range(range),
            Dest::Buf(buf) => buf.io_range(range).map(|(ptr, _)| ptr),
        }
    }
}

/// The receive side's own memory: the header stage, the scratch space refused payloads go
/// to, and the `msghdr` and iovecs of a payload-plus-header `recvmsg`. Boxed by its owner, so
/// the addresses the kernel holds do not move with the connection.
pub struct RecvMem {
    /// Received request bytes (at least one stage of headers long).
    pub stage: Box<[u8]>,
    /// Scratch space refused payloads are received into.
    pub scratch: Box<[u8]>,
    msg: libc::msghdr,
    iov: [libc::iovec; 2],
}

impl RecvMem {
    /// A stage holding `stage` (the request bytes that came with the handshake, then room)
    /// and `scratch_bytes` of scratch space.
    pub fn new(stage: Box<[u8]>, scratch_bytes: usize) -> Box<RecvMem> {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        Box::new(RecvMem {
            stage,
            scratch: vec![0u8; scratch_bytes].into_boxed_slice(),
            // SAFETY: msghdr is a plain C struct of integers and pointers (plus, on some
            // libcs, padding), for all of which zero is a valid value.
            msg: unsafe { std::mem::zeroed() },
            iov: [empty; 2],
        })
    }

    /// Points the `msghdr` at `payload_len` bytes at `payload`, then the first
    /// `header_bytes` of the stage; `None` if the stage is shorter. Returns its address.
    pub(super) fn point_msg(
        &mut self,
        payload: *mut u8,
        payload_len: usize,
        header_bytes: usize,
    ) -> Option<*mut libc::msghdr> {
        let stage = self.stage.get_mut(..header_bytes)?;
        self.iov = [
            libc::iovec {
                iov_base: payload.cast(),
                iov_len: payload_len,
            },
            libc::iovec {
                iov_base: stage.as_mut_ptr().cast(),
                iov_len: header_bytes,
            },
        ];
        self.msg.msg_iov = self.iov.as_mut_ptr();
        self.msg.msg_iovlen = 2;
        Some(&mut self.msg)
    }
}
