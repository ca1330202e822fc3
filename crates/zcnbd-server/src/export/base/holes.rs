//! Where a file's holes are (`SEEK_DATA` / `SEEK_HOLE`), for block status of the files that
//! hold an export's bytes: a raw file, and the raw layers of an image's backing chain.

use std::fs::File;

use rustix::fs::SeekFrom;
use rustix::io::Errno as HostErrno;
use zcnbd_proto::consts::state;

/// Whether `SEEK_HOLE` on `file` costs little whatever the file holds. Not on tmpfs (a memfd,
/// `/dev/shm`): there it walks the page cache one page at a time to the next hole, so on a
/// file full of data one question costs as much as the file is large (a 1 GiB file read in
/// 256 KiB requests, each asking first: 16 s instead of 0.3 s). Block status there reports
/// data, which the protocol allows for any range.
pub(crate) fn seeks_are_cheap(file: &File) -> bool {
    match rustix::fs::fstatfs(file) {
        Ok(fs) => fs.f_type != libc::TMPFS_MAGIC,
        Err(_) => true,
    }
}

/// Where the data or hole run of `file` starting at `pos` ends (at most `size`, the file's
/// length), and its `base:allocation` flags; `None` if the file system cannot tell.
pub(crate) fn next_boundary(file: &File, pos: u64, size: u64) -> Option<(u64, u32)> {
    match rustix::fs::seek(file, SeekFrom::Data(pos)) {
        Ok(data) if data > pos => Some((data.min(size), state::HOLE | state::ZERO)),
        Ok(_) => {
            let hole = rustix::fs::seek(file, SeekFrom::Hole(pos)).ok()?;
            Some((hole.min(size), 0))
        }
        // ENXIO: no data from `pos` to the end of the file.
        Err(HostErrno::NXIO) => Some((size, state::HOLE | state::ZERO)),
        Err(_) => None,
    }
}
