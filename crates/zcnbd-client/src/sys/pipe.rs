//! The write end of a caller's pipe, lent to a read while it is in flight: the read's data
//! moves from the socket into the pipe by `splice`, never through user memory (the caller
//! then splices the pipe on, to another socket or a file).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::pipe::{splice, SpliceFlags};

/// What one splice from the socket into the pipe did.
#[derive(Debug, PartialEq, Eq)]
pub enum Spliced {
    /// Moved this many bytes (0: the peer closed the socket).
    Moved(usize),
    /// The socket has nothing now.
    WouldBlock,
    /// The pipe has no room (it holds buffers, not bytes: a pipe of 1 MiB may fill before
    /// 1 MiB is in it), or this socket cannot splice: the rest goes to memory.
    NoRoom,
}

/// A pipe's write end, by number, for the life of one read.
#[derive(Debug)]
pub struct PipeEnd {
    fd: RawFd,
}

impl PipeEnd {
    /// The descriptor, borrowed for one call.
    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `lend_pipe`'s caller keeps the descriptor open, and the same pipe, until
        // the read that holds this value completes (its owner moves into the completer).
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }

    /// Splices up to `want` bytes from `socket` (non-blocking) into the pipe, never waiting
    /// on the pipe either.
    pub fn splice_from(&self, socket: BorrowedFd<'_>, want: usize) -> std::io::Result<Spliced> {
        let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
        loop {
            match splice(socket, None, self.fd(), None, want, flags) {
                Ok(n) => return Ok(Spliced::Moved(n)),
                Err(Errno::INTR) => continue,
                // Either side may be why: the pipe says whether it has room.
                Err(Errno::AGAIN) if self.is_full() => return Ok(Spliced::NoRoom),
                Err(Errno::AGAIN) => return Ok(Spliced::WouldBlock),
                // A socket family that cannot splice (no `splice_read`).
                Err(Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => return Ok(Spliced::NoRoom),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether every buffer of the pipe is taken.
    fn is_full(&self) -> bool {
        let fd = self.fd();
        let mut fds = [PollFd::new(&fd, PollFlags::OUT)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        !matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
    }
}

/// Lends `owner`'s descriptor (a pipe's write end) to a read; `owner` must then move into
/// the read's completer, which keeps it open until the read is done.
pub fn lend_pipe<P: AsFd>(owner: &P) -> PipeEnd {
    PipeEnd {
        fd: owner.as_fd().as_raw_fd(),
    }
}
