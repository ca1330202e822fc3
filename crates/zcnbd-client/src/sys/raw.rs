//! Submissions over raw caller memory, for the C ABI: the caller promises the memory stays
//! valid and untouched until the completion runs.

use zcnbd_proto::Command;

use crate::client::{fua, Client, WriteFlags};
use crate::conn::Completer;
use crate::error::Result;
use crate::plan;
use crate::sys::Buffer;

impl Client {
    /// Starts a read into `pieces` (`(pointer, length)`, in order) at `offset`.
    ///
    /// # Safety
    /// Every piece must be valid for writes of its length, and not be accessed by anyone
    /// else, until `completer` has run.
    pub unsafe fn submit_read_raw(
        &self,
        pieces: &[(*mut u8, usize)],
        offset: u64,
        completer: Completer,
    ) -> Result<()> {
        // SAFETY: forwarded to our caller.
        let buffer = unsafe { Buffer::from_raw(pieces.iter().copied()) };
        let parts = plan::read_write(self.geometry(), Command::Read, 0, offset, buffer)?;
        self.submit_parts(parts, completer)
    }

    /// Starts a write of `pieces` at `offset`.
    ///
    /// # Safety
    /// Every piece must be valid for reads of its length, and not be written by anyone,
    /// until `completer` has run.
    pub unsafe fn submit_write_raw(
        &self,
        pieces: &[(*const u8, usize)],
        offset: u64,
        flags: WriteFlags,
        completer: Completer,
    ) -> Result<()> {
        // A write's buffer is only read from; the cast never leads to a write.
        let pieces = pieces.iter().map(|&(p, n)| (p.cast_mut(), n));
        // SAFETY: forwarded to our caller.
        let buffer = unsafe { Buffer::from_raw(pieces) };
        let flags = fua(flags.fua);
        let parts = plan::read_write(self.geometry(), Command::Write, flags, offset, buffer)?;
        self.submit_parts(parts, completer)
    }

    /// Starts a flush.
    pub fn submit_flush_with(&self, completer: Completer) -> Result<()> {
        let parts = plan::flush(self.geometry())?;
        self.submit_parts(parts, completer)
    }
}
