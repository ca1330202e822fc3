//! Plain system calls on a descriptor that an export's stack named in a place (a
//! [`Place`](crate::export::Place) carries a `RawFd`, as io_uring operations take them).
//!
//! The invariant the `unsafe` here rests on is the one the io_uring driver's file operations
//! rest on: a place's descriptor stays open as long as the stack that named it, and the
//! connection using the place holds that stack (through its dispatcher) until none of its
//! operations is in flight.

use std::os::fd::{AsFd, BorrowedFd, RawFd};

/// `sendfile(2)` of up to `len` bytes of the file `file` from `*position` to `socket`.
pub fn sendfile(
    socket: impl AsFd,
    file: RawFd,
    position: &mut u64,
    len: usize,
) -> rustix::io::Result<usize> {
    // SAFETY: `file` is a place's descriptor, open while the stack that named it is held (the
    // module's invariant); it is borrowed only for this call.
    let file = unsafe { BorrowedFd::borrow_raw(file) };
    rustix::fs::sendfile(socket, file, Some(position), len)
}
