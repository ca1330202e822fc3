//! The null export: writes vanish, reads are zeroes (a benchmark baseline, like nbdkit null).

use std::io;

use zcnbd_proto::consts::state;
use zcnbd_proto::Extent;

use crate::export::{Backend, Capabilities, ZeroError, ZeroFlags};

/// A backend that stores nothing.
#[derive(Debug)]
pub struct NullBackend {
    size: u64,
}

impl NullBackend {
    /// A null export of `size` bytes.
    pub fn new(size: u64) -> Self {
        NullBackend { size }
    }
}

impl Backend for NullBackend {
    fn never_waits(&self) -> bool {
        true
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            write: true,
            flush: true,
            fua: true,
            trim: true,
            zero: true,
            fast_zero: true,
            cache: true,
            multi_conn: true,
        }
    }

    fn pread(&self, buf: &mut [u8], _offset: u64) -> io::Result<()> {
        buf.fill(0);
        Ok(())
    }

    fn pwrite(&self, _buf: &[u8], _offset: u64, _fua: bool) -> io::Result<()> {
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn trim(&self, _offset: u64, _len: u64, _fua: bool) -> io::Result<()> {
        Ok(())
    }

    fn zero(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<(), ZeroError> {
        Ok(())
    }

    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64, _max: usize, out: &mut Vec<Extent>) -> io::Result<()> {
        let length = len.min(self.size.saturating_sub(offset));
        if length > 0 {
            out.push(Extent {
                length,
                flags: state::HOLE | state::ZERO,
            });
        }
        Ok(())
    }
}
