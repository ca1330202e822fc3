//! A generic netlink socket (`AF_NETLINK`, `NETLINK_GENERIC`) to the kernel: datagrams out and
//! in, with a receive timeout. rustix's calls are safe; what the datagrams say is
//! `attach::nbd::netlink`'s.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::net::netlink::{SocketAddrNetlink, GENERIC};
use rustix::net::sockopt::{set_socket_timeout, Timeout};
use rustix::net::{bind, recv, send, socket_with, AddressFamily, RecvFlags, SendFlags};
use rustix::net::{SocketFlags, SocketType};

/// A socket bound to a port the kernel chose.
pub struct NetlinkSocket {
    fd: OwnedFd,
}

impl NetlinkSocket {
    /// A generic netlink socket whose receives give up after `timeout`.
    pub fn generic(timeout: Duration) -> io::Result<NetlinkSocket> {
        let fd = socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC,
            Some(GENERIC),
        )?;
        bind(&fd, &SocketAddrNetlink::new(0, 0))?;
        set_socket_timeout(&fd, Timeout::Recv, Some(timeout))?;
        Ok(NetlinkSocket { fd })
    }

    /// Sends one message to the kernel.
    pub fn send(&self, message: &[u8]) -> io::Result<()> {
        let sent = send(&self.fd, message, SendFlags::empty())?;
        if sent != message.len() {
            return Err(io::Error::other("netlink: the message went out in part"));
        }
        Ok(())
    }

    /// Receives one datagram into `buf`: its bytes (an error if it did not fit).
    pub fn recv<'a>(&self, buf: &'a mut [u8]) -> io::Result<&'a [u8]> {
        let (n, whole) = loop {
            match recv(&self.fd, &mut *buf, RecvFlags::TRUNC) {
                Err(rustix::io::Errno::INTR) => continue,
                other => break other?,
            }
        };
        if whole > n {
            return Err(io::Error::other(format!(
                "netlink: a datagram of {whole} bytes is larger than {} (NETLINK_DATAGRAM_BYTES_MAX)",
                buf.len()
            )));
        }
        Ok(&buf[..n])
    }
}
