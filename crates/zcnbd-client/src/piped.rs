//! A read whose data goes to the caller's pipe: payload at the front of the read is spliced
//! from the socket into the pipe as it comes; from the first byte that cannot go there (a
//! chunk out of order, a hole, bytes that came with a header, a full pipe, a socket that
//! cannot splice) on, the rest goes to the read's buffer at its place. The pipe then holds
//! the read's first [`PipeCursor::in_pipe`] bytes, the buffer all the others.

use std::os::fd::BorrowedFd;

use crate::sys::{PipeEnd, Spliced};

/// Where a piped read's next bytes go.
#[derive(Debug)]
pub(crate) struct PipeCursor {
    end: PipeEnd,
    in_pipe: u64,
    to_memory: bool,
}

impl PipeCursor {
    pub fn new(end: PipeEnd) -> PipeCursor {
        PipeCursor {
            end,
            in_pipe: 0,
            to_memory: false,
        }
    }

    /// Bytes at the read's front now in the pipe.
    pub fn in_pipe(&self) -> u64 {
        self.in_pipe
    }

    /// Whether payload at `at` (from the read's start) goes to the pipe.
    pub fn takes(&self, at: u64) -> bool {
        !self.to_memory && at == self.in_pipe
    }

    /// Payload at `at` went to memory: from there on, all of it does.
    pub fn went_to_memory(&mut self, at: u64) {
        if at >= self.in_pipe {
            self.to_memory = true;
        }
    }

    /// Splices up to `want` bytes at the pipe's end from `socket`. On
    /// [`Spliced::NoRoom`] the rest of the read goes to memory.
    pub fn splice(&mut self, socket: BorrowedFd<'_>, want: u64) -> std::io::Result<Spliced> {
        let want = usize::try_from(want).unwrap_or(usize::MAX);
        let spliced = self.end.splice_from(socket, want)?;
        match spliced {
            Spliced::Moved(n) => self.in_pipe += n as u64,
            Spliced::NoRoom => self.to_memory = true,
            Spliced::WouldBlock => {}
        }
        Ok(spliced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::lend_pipe;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn splices_in_order_then_goes_to_memory_for_good() {
        let (read, write) = rustix::pipe::pipe().unwrap();
        let (mut tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        let mut cursor = PipeCursor::new(lend_pipe(&write));
        assert_eq!(
            cursor.splice(rx.as_fd(), 10).unwrap(),
            Spliced::WouldBlock,
            "an empty socket"
        );
        tx.write_all(b"hello").unwrap();
        assert!(cursor.takes(0));
        assert_eq!(cursor.splice(rx.as_fd(), 10).unwrap(), Spliced::Moved(5));
        assert_eq!(cursor.in_pipe(), 5);
        assert!(!cursor.takes(0) && cursor.takes(5));
        // A chunk further on went to memory: nothing more goes to the pipe.
        cursor.went_to_memory(8);
        assert!(!cursor.takes(5));
        let mut got = [0u8; 8];
        let n = rustix::io::read(&read, &mut got).unwrap();
        assert_eq!(&got[..n], b"hello");
    }

    #[test]
    fn a_full_pipe_sends_the_rest_to_memory() {
        let (_read, write) = rustix::pipe::pipe().unwrap();
        let (mut tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        tx.set_nonblocking(true).unwrap();
        let mut cursor = PipeCursor::new(lend_pipe(&write));
        let chunk = vec![7u8; 4096];
        let mut moved = 0;
        loop {
            // Keep the socket fed; stop when the pipe says it is full.
            let _ = tx.write(&chunk);
            match cursor.splice(rx.as_fd(), 1 << 20).unwrap() {
                Spliced::Moved(n) => moved += n,
                Spliced::NoRoom => break,
                Spliced::WouldBlock => panic!("the socket was fed"),
            }
            assert!(moved <= 16 << 20, "a pipe that never fills");
        }
        assert!(moved > 0);
        assert!(!cursor.takes(cursor.in_pipe()));
    }
}
