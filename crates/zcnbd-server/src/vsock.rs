//! AF_VSOCK sockets (`vsock(7)`: between a virtual machine and its host, or within one
//! machine through `vsock_loopback`), with the operations std's TCP and Unix types give the
//! others: a listener, and a connected stream that reads, writes, times out and shuts down.
//! The address structure is in `sys::vsock`; the calls are rustix's.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::net::sockopt::{self, Timeout};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

pub use crate::sys::vsock::{VsockAddr, CID_ANY, PORT_ANY};

/// Pending connections the kernel queues (std's listeners use 128 too).
const BACKLOG: i32 = 128;

impl std::fmt::Display for VsockAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cid {
            CID_ANY => write!(f, "vsock:any:{}", self.port),
            cid => write!(f, "vsock:{cid}:{}", self.port),
        }
    }
}

/// Says which call failed and what that most likely means: a kernel without AF_VSOCK (or
/// with no transport loaded) answers in errnos that name nothing about vsock. (The caller
/// names the address: `ServerError::Listen`.)
fn explain(call: &str, e: rustix::io::Errno) -> io::Error {
    let hint = match e {
        rustix::io::Errno::AFNOSUPPORT => {
            " (this kernel has no AF_VSOCK: load the vsock module, \
             or vsock_loopback for CID 1)"
        }
        rustix::io::Errno::ADDRNOTAVAIL | rustix::io::Errno::NODEV => {
            " (no vsock transport serves that CID: vsock_loopback for CID 1, \
             vhost_vsock on a host, virtio/vmw vsock in a guest)"
        }
        _ => "",
    };
    let e = io::Error::from(e);
    io::Error::new(e.kind(), format!("{call}: {e}{hint}"))
}

/// A listening vsock socket.
#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
}

impl VsockListener {
    /// Listens on `addr` (a [`PORT_ANY`] port is chosen by the kernel; see [`Self::local_addr`]).
    pub fn bind(addr: &VsockAddr) -> io::Result<VsockListener> {
        let fd = rustix::net::socket_with(
            AddressFamily::VSOCK,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| explain("socket(AF_VSOCK)", e))?;
        rustix::net::bind(&fd, addr).map_err(|e| explain("bind", e))?;
        rustix::net::listen(&fd, BACKLOG).map_err(|e| explain("listen", e))?;
        Ok(VsockListener { fd })
    }

    /// A listening socket opened elsewhere; the descriptor back (`Err`) if it is not
    /// AF_VSOCK.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Result<VsockListener, OwnedFd>> {
        let family = rustix::net::getsockname(&fd)?.address_family();
        Ok(match family {
            AddressFamily::VSOCK => Ok(VsockListener { fd }),
            _ => Err(fd),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> io::Result<VsockAddr> {
        let any = rustix::net::getsockname(&self.fd)?;
        VsockAddr::from_any(&any)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a vsock address"))
    }

    /// Accepting without waiting (`WouldBlock` when nobody is waiting) or not.
    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        Ok(rustix::io::ioctl_fionbio(&self.fd, nonblocking)?)
    }

    /// The next connection, and the peer's address (`None` if the kernel gave none).
    pub fn accept(&self) -> io::Result<(VsockStream, Option<VsockAddr>)> {
        let (fd, peer) = rustix::net::acceptfrom_with(&self.fd, SocketFlags::CLOEXEC)?;
        let peer = peer.as_ref().and_then(VsockAddr::from_any);
        Ok((VsockStream { fd }, peer))
    }
}

impl From<VsockListener> for OwnedFd {
    fn from(listener: VsockListener) -> OwnedFd {
        listener.fd
    }
}

impl AsFd for VsockListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A connected vsock socket.
#[derive(Debug)]
pub struct VsockStream {
    fd: OwnedFd,
}

impl VsockStream {
    /// Another handle to the same socket.
    pub fn try_clone(&self) -> io::Result<VsockStream> {
        let fd = rustix::io::fcntl_dupfd_cloexec(&self.fd, 0)?;
        Ok(VsockStream { fd })
    }

    /// Shuts down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        let how = match how {
            Shutdown::Read => rustix::net::Shutdown::Read,
            Shutdown::Write => rustix::net::Shutdown::Write,
            Shutdown::Both => rustix::net::Shutdown::Both,
        };
        Ok(rustix::net::shutdown(&self.fd, how)?)
    }

    /// Blocking or not.
    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        Ok(rustix::io::ioctl_fionbio(&self.fd, nonblocking)?)
    }

    /// How long a read (`Timeout::Recv`) or a write (`Timeout::Send`) may block.
    pub fn timeout(&self, which: Timeout) -> io::Result<Option<Duration>> {
        Ok(sockopt::socket_timeout(&self.fd, which)?)
    }

    /// Bounds how long a read or a write may block (`None`: forever).
    pub fn set_timeout(&self, which: Timeout, timeout: Option<Duration>) -> io::Result<()> {
        Ok(sockopt::set_socket_timeout(&self.fd, which, timeout)?)
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(rustix::net::recv(&self.fd, buf, RecvFlags::empty())?.1)
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(rustix::net::send(&self.fd, buf, SendFlags::NOSIGNAL)?)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut control = rustix::net::SendAncillaryBuffer::default();
        Ok(rustix::net::sendmsg(
            &self.fd,
            bufs,
            &mut control,
            SendFlags::NOSIGNAL,
        )?)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for VsockStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl From<VsockStream> for OwnedFd {
    fn from(stream: VsockStream) -> OwnedFd {
        stream.fd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Listening needs AF_VSOCK in the kernel, not a transport: where the kernel has it, a
    /// listener binds and reports the port the kernel chose; where it has not, the error
    /// says so.
    #[test]
    fn a_listener_reports_its_port_or_why_it_cannot_listen() {
        let any = VsockAddr {
            cid: CID_ANY,
            port: PORT_ANY,
        };
        match VsockListener::bind(&any) {
            Ok(listener) => {
                let addr = listener.local_addr().unwrap();
                assert_eq!(addr.cid, CID_ANY);
                assert_ne!(addr.port, PORT_ANY, "the kernel picks a port");
                let fd = OwnedFd::from(listener);
                assert!(VsockListener::from_fd(fd).unwrap().is_ok());
            }
            Err(e) => {
                eprintln!("SKIP: no AF_VSOCK here: {e}");
                assert!(e.to_string().to_lowercase().contains("vsock"), "{e}");
            }
        }
        let (unix, _) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(VsockListener::from_fd(unix.into()).unwrap().is_err());
    }

    #[test]
    fn errors_name_the_call_and_what_is_missing() {
        let e = explain("socket(AF_VSOCK)", rustix::io::Errno::AFNOSUPPORT);
        let text = e.to_string();
        assert!(text.starts_with("socket(AF_VSOCK): "), "{text}");
        assert!(text.contains("no AF_VSOCK"), "{text}");
        let e = explain("bind", rustix::io::Errno::ADDRNOTAVAIL);
        assert!(e.to_string().contains("no vsock transport"), "{e}");
        let any = VsockAddr {
            cid: CID_ANY,
            port: 10809,
        };
        assert_eq!(any.to_string(), "vsock:any:10809");
    }
}
