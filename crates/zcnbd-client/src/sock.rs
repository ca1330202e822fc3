//! The client's socket as a byte stream for TLS (`zcnbd-tls` reads and writes it through
//! `Read`/`Write`): blocking with timeouts during the handshake, non-blocking afterwards
//! (`EAGAIN` is `WouldBlock`). Sends never raise `SIGPIPE` (a C program linking libzcnbd
//! may not ignore it), and in the transmission phase every call is counted.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::net::sockopt::{self, Timeout};
use rustix::net::{RecvFlags, SendFlags};

use crate::stats::Stats;

/// A connected stream socket, TCP or Unix.
pub struct Sock {
    fd: OwnedFd,
    /// Where socket calls are counted (the transmission phase's).
    stats: Option<Arc<Stats>>,
}

impl Sock {
    /// Wraps a connected socket.
    pub fn new(fd: OwnedFd) -> Sock {
        Sock { fd, stats: None }
    }

    /// Counts every later socket call in `stats`.
    pub fn count_into(&mut self, stats: Arc<Stats>) {
        self.stats = Some(stats);
    }

    /// Sets both timeouts (`None`: block forever).
    pub fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        sockopt::set_socket_timeout(&self.fd, Timeout::Recv, timeout)?;
        sockopt::set_socket_timeout(&self.fd, Timeout::Send, timeout)?;
        Ok(())
    }

    /// The descriptor, given up.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    fn count(&self) {
        if let Some(stats) = &self.stats {
            stats.add_syscalls(1);
        }
    }
}

impl AsFd for Sock {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.count();
        Ok(rustix::net::recv(&self.fd, buf, RecvFlags::empty())?.1)
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.count();
        Ok(rustix::net::send(&self.fd, buf, SendFlags::NOSIGNAL)?)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl zcnbd_tls::Transport for Sock {
    fn try_clone(&self) -> io::Result<Self> {
        let fd = rustix::io::fcntl_dupfd_cloexec(&self.fd, 0)?;
        Ok(Sock {
            fd,
            stats: self.stats.clone(),
        })
    }

    fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(sockopt::socket_timeout(&self.fd, Timeout::Recv)?)
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        Ok(sockopt::set_socket_timeout(
            &self.fd,
            Timeout::Recv,
            timeout,
        )?)
    }

    fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(sockopt::socket_timeout(&self.fd, Timeout::Send)?)
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        Ok(sockopt::set_socket_timeout(
            &self.fd,
            Timeout::Send,
            timeout,
        )?)
    }
}
