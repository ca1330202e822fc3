//! A connected client socket, TCP, Unix or vsock, with the few operations the server needs.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::net::sockopt::Timeout;

use crate::vsock::VsockStream;

/// A client connection's socket.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    Vsock(VsockStream),
}

impl Stream {
    /// Another handle to the same socket (for a writer beside the reader).
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Vsock(s) => Stream::Vsock(s.try_clone()?),
        })
    }

    /// The socket's descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
            Stream::Vsock(s) => s.as_fd(),
        }
    }

    /// Shuts down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
            Stream::Vsock(s) => s.shutdown(how),
        }
    }

    /// Hard disconnect that also drops whatever the kernel still holds to send: a TCP
    /// connection is reset (connect(AF_UNSPEC)) rather than left to drain to a client that
    /// stopped reading.
    pub fn abort(&self) {
        if let Stream::Tcp(s) = self {
            reset(s);
        }
        let _ = self.shutdown(Shutdown::Both);
    }

    /// Bounds how long one read may block (`None`: forever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(timeout),
            Stream::Unix(s) => s.set_read_timeout(timeout),
            Stream::Vsock(s) => s.set_timeout(Timeout::Recv, timeout),
        }
    }

    /// Bounds how long one send may wait for the peer to make room (`None`: forever).
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(timeout),
            Stream::Unix(s) => s.set_write_timeout(timeout),
            Stream::Vsock(s) => s.set_timeout(Timeout::Send, timeout),
        }
    }

    /// TCP keepalive: probes after `idle` of silence, every `idle / 6` (at least 1 s), and
    /// the connection is dropped after 6 unanswered probes. Unix and vsock sockets need none
    /// (vsock's transports notice a peer that went away).
    pub fn set_keepalive(&self, idle: Duration) -> io::Result<()> {
        use rustix::net::sockopt;
        let Stream::Tcp(s) = self else {
            return Ok(());
        };
        let idle = idle.max(Duration::from_secs(1));
        sockopt::set_socket_keepalive(s, true)?;
        sockopt::set_tcp_keepidle(s, idle)?;
        sockopt::set_tcp_keepintvl(s, (idle / 6).max(Duration::from_secs(1)))?;
        sockopt::set_tcp_keepcnt(s, 6)?;
        Ok(())
    }

    /// Puts the socket in blocking mode (accepted sockets inherit nothing, but be explicit).
    pub fn set_blocking(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_nonblocking(false)?;
                // Replies are whole messages written at once; don't let Nagle delay them.
                s.set_nodelay(true)
            }
            Stream::Unix(s) => s.set_nonblocking(false),
            Stream::Vsock(s) => s.set_nonblocking(false),
        }
    }

    /// Writes every byte of `bufs`, in as few vectored writes as the kernel allows.
    pub fn write_all_vectored(&mut self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            match self.write_vectored(bufs) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what has already arrived, without waiting: `WouldBlock` if nothing has.
    pub fn read_nowait(&self, buf: &mut [u8]) -> io::Result<usize> {
        let (received, _) = rustix::net::recv(self.fd(), buf, rustix::net::RecvFlags::DONTWAIT)?;
        Ok(received)
    }

    /// Waits for bytes to arrive (or the peer to close), for at most `timeout` if given;
    /// whether they did (a signal ends a timed wait early, an untimed one waits on).
    pub fn wait_readable(&self, timeout: Option<Duration>) -> io::Result<bool> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let timeout = timeout.map(|t| Timespec {
            tv_sec: i64::try_from(t.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(t.subsec_nanos()),
        });
        loop {
            let mut fds = [PollFd::from_borrowed_fd(self.fd(), PollFlags::IN)];
            match poll(&mut fds, timeout.as_ref()) {
                Ok(ready) => return Ok(ready > 0),
                Err(rustix::io::Errno::INTR) if timeout.is_some() => return Ok(false),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Fills `buf` completely; `Ok(false)` on a clean end of stream before the first byte.
    pub fn read_exact_or_eof(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let mut done = 0;
        while done < buf.len() {
            match self.read(&mut buf[done..]) {
                Ok(0) if done == 0 => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            Stream::Vsock(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            Stream::Vsock(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Vsock(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What a TLS session needs from the socket (`zcnbd-tls`).
impl zcnbd_tls::Transport for Stream {
    fn try_clone(&self) -> io::Result<Self> {
        Stream::try_clone(self)
    }
    fn read_timeout(&self) -> io::Result<Option<Duration>> {
        match self {
            Stream::Tcp(s) => s.read_timeout(),
            Stream::Unix(s) => s.read_timeout(),
            Stream::Vsock(s) => s.timeout(Timeout::Recv),
        }
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        Stream::set_read_timeout(self, timeout)
    }
    fn write_timeout(&self) -> io::Result<Option<Duration>> {
        match self {
            Stream::Tcp(s) => s.write_timeout(),
            Stream::Unix(s) => s.write_timeout(),
            Stream::Vsock(s) => s.timeout(Timeout::Send),
        }
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        Stream::set_write_timeout(self, timeout)
    }
    fn read_nowait(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Stream::read_nowait(self, buf)
    }
    fn kernel_socket(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match self {
            Stream::Tcp(s) => Some(std::os::fd::AsFd::as_fd(s)),
            Stream::Unix(_) | Stream::Vsock(_) => None,
        }
    }
}
/// Resets a TCP connection (connect(AF_UNSPEC)), dropping whatever the kernel still holds to
/// send on it; other sockets refuse it, harmlessly (their queue goes with the socket).
pub fn reset(socket: impl std::os::fd::AsFd) {
    let _ = rustix::net::connect_unspec(socket);
}
