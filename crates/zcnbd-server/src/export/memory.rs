//! The in-memory export: a sparse memfd served by the file backend.
//!
//! A memfd is a tmpfs file, so it is sparse (never-written pages use no memory), trims punch
//! real holes that SEEK_DATA/SEEK_HOLE report, and its pages can later be spliced straight
//! from the page cache to a socket.

use std::fs::File;
use std::io;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};

use super::FileBackend;

/// A sparse in-memory export of `size` bytes.
pub fn memory_backend(size: u64) -> io::Result<FileBackend> {
    let fd = memfd_create("zcnbd-memory", MemfdFlags::CLOEXEC)?;
    ftruncate(&fd, size)?;
    FileBackend::from_file(File::from(fd), None, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{Backend, ZeroFlags};
    use zcnbd_proto::consts::state;

    #[test]
    fn terabyte_export_is_sparse_and_reports_holes() {
        let b = memory_backend(1 << 40).unwrap();
        assert_eq!(b.size(), 1 << 40);
        b.pwrite(&[5u8; 4096], 1 << 39, false).unwrap();
        let mut ext = Vec::new();
        b.extents((1 << 39) - 4096, 3 * 4096, 8, &mut ext).unwrap();
        let flags: Vec<u32> = ext.iter().map(|e| e.flags).collect();
        assert_eq!(
            flags,
            [state::HOLE | state::ZERO, 0, state::HOLE | state::ZERO]
        );
    }

    #[test]
    fn zero_without_hole_allocates_zeroes() {
        let b = memory_backend(1 << 20).unwrap();
        b.pwrite(&[5u8; 8192], 0, false).unwrap();
        b.zero(
            0,
            8192,
            ZeroFlags {
                may_trim: false,
                fast: true,
                fua: false,
            },
        )
        .unwrap();
        let mut buf = [1u8; 8192];
        b.pread(&mut buf, 0).unwrap();
        assert_eq!(buf, [0u8; 8192]);
        // tmpfs reports fallocated-but-unwritten pages as a hole to SEEK_DATA, which the spec
        // allows; what NO_HOLE promises is allocation, which fallocate gives.
    }
}
