//! What a TLS session needs from its socket: bytes both ways, a second handle for the other
//! thread, and timeouts it can set for the handshake and put back afterwards.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A blocking, connected socket.
pub trait Transport: Read + Write + Send + Sized + 'static {
    /// Another handle to the same socket.
    fn try_clone(&self) -> io::Result<Self>;
    /// The current receive timeout.
    fn read_timeout(&self) -> io::Result<Option<Duration>>;
    /// Bounds how long one read may block (`None`: forever).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// The current send timeout.
    fn write_timeout(&self) -> io::Result<Option<Duration>>;
    /// Bounds how long one write may block (`None`: forever).
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// The socket, if the kernel's TLS can be attached to it (a TCP socket).
    fn kernel_socket(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Reads what has already arrived, without waiting: `WouldBlock` if nothing has. The
    /// default says nothing ever has, which is always safe for a caller that does something
    /// (sends what it owes, say) before it reads again and waits.
    fn read_nowait(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let _ = buf;
        Err(io::ErrorKind::WouldBlock.into())
    }
}

macro_rules! std_transport {
    ($t:ty, $tcp:literal) => {
        impl Transport for $t {
            fn try_clone(&self) -> io::Result<Self> {
                <$t>::try_clone(self)
            }
            fn read_timeout(&self) -> io::Result<Option<Duration>> {
                <$t>::read_timeout(self)
            }
            fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$t>::set_read_timeout(self, timeout)
            }
            fn write_timeout(&self) -> io::Result<Option<Duration>> {
                <$t>::write_timeout(self)
            }
            fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$t>::set_write_timeout(self, timeout)
            }
            fn kernel_socket(&self) -> Option<BorrowedFd<'_>> {
                $tcp.then(|| self.as_fd())
            }
        }
    };
}

std_transport!(TcpStream, true);
std_transport!(UnixStream, false);
