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
use crate::sys::vsock::VsockAddr;

/// Connects an AF_VSOCK stream socket to `cid`:`port`. The error names the address, and what
/// is likely missing when the kernel's answer does not say (no AF_VSOCK, no transport to
/// that CID; vsock_loopback gives CID 1, the local machine).
pub fn connect_vsock(cid: u32, port: u32) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let explain = |e: rustix::io::Errno| {
        let hint = match e {
            rustix::io::Errno::AFNOSUPPORT => {
                " (this kernel has no AF_VSOCK: load the vsock module, or vsock_loopback for CID 1)"
            }
            rustix::io::Errno::NODEV
            | rustix::io::Errno::ADDRNOTAVAIL
            | rustix::io::Errno::HOSTUNREACH
            | rustix::io::Errno::NETUNREACH
            | rustix::io::Errno::TIMEDOUT => {
                " (no vsock transport reaches that CID: vsock_loopback for CID 1, \
                 vhost_vsock on a host, virtio/vmw vsock in a guest)"
            }
            _ => "",
        };
        let e = io::Error::from(e);
        io::Error::new(e.kind(), format!("vsock CID {cid} port {port}: {e}{hint}"))
    };
    let fd = rustix::net::socket_with(
        AddressFamily::VSOCK,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(explain)?;
    rustix::net::connect(&fd, &VsockAddr { cid, port }).map_err(explain)?;
    Ok(fd)
}

/// A connected stream socket, TCP, Unix or vsock.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// No server listens on port 1 of this machine's CID: whatever the kernel has (no
    /// AF_VSOCK, no loopback transport, or vsock_loopback), the error names the address.
    #[test]
    fn a_failed_vsock_connect_names_the_address() {
        let e = connect_vsock(1, 1).expect_err("nobody listens on vsock port 1");
        assert!(e.to_string().starts_with("vsock CID 1 port 1: "), "{e}");
        let Err(e) = crate::Client::connect("nbd+vsock://1:1/") else {
            panic!("connected to nobody");
        };
        assert!(e.to_string().contains("vsock CID 1 port 1"), "{e}");
    }
}
