//! The blocking calls that lend caller memory to a request: the borrow is held by a call
//! that does not return before the request has finished with it.

use std::io::{IoSlice, IoSliceMut};

use zcnbd_proto::Command;

use crate::client::{fua, Client, WriteFlags};
use crate::error::Result;
use crate::sys::Buffer;

impl Client {
    /// Reads `buf.len()` bytes at `offset` straight into `buf`. An NBD read is whole or
    /// failed, so this returns `buf.len()`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        // SAFETY: `blocking` does not return (nor unwind) while the request may still write
        // into `buf`: it waits for completion, or detaches the buffer first.
        let buffer = unsafe { Buffer::from_slice(buf) };
        self.blocking_rw(Command::Read, 0, offset, buffer)
    }

    /// Reads into several buffers in order, straight from the socket.
    pub fn read_vectored_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> Result<usize> {
        let pieces = bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len()));
        // SAFETY: as in `read_at`: the borrows outlive the blocking call.
        let buffer = unsafe { Buffer::from_raw(pieces) };
        self.blocking_rw(Command::Read, 0, offset, buffer)
    }

    /// Writes `buf` at `offset` (header and data in one vectored send).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        self.write_vectored_at(&[IoSlice::new(buf)], offset, WriteFlags::default())
    }

    /// Writes several buffers in order at `offset`, with `flags`.
    pub fn write_vectored_at(
        &self,
        bufs: &[IoSlice<'_>],
        offset: u64,
        flags: WriteFlags,
    ) -> Result<usize> {
        // The buffer is only ever read for a write: the mutable pointer is never written.
        let pieces = bufs.iter().map(|b| (b.as_ptr().cast_mut(), b.len()));
        // SAFETY: as in `read_at`; a write's buffer is only read from.
        let buffer = unsafe { Buffer::from_raw(pieces) };
        self.blocking_rw(Command::Write, fua(flags.fua), offset, buffer)
    }
}
