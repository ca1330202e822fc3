//! A connection's bytes in the transmission phase: the socket itself, or TLS over it.
//!
//! Plain text is what it was before TLS existed: one `sendmsg` of the request headers and
//! the caller's write buffers, one `recv` per header, one `recvmsg` of read data straight
//! into the caller's buffers. Under TLS the same slices go through
//! [`TlsStream`](zcnbd_tls::TlsStream): writes are encrypted from the caller's buffers, read
//! data is decrypted into them (what OpenSSL copies on the way is listed in
//! `zcnbd_tls`'s `stream.rs` and docs/guides/client.md). Every call is non-blocking: `Ok(None)` means
//! the socket has no room or no bytes now.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::io::Errno;
use rustix::net::{RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendFlags};
use zcnbd_tls::TlsStream;

use crate::error::Error;
use crate::sock::Sock;
use crate::stats::Stats;

/// What a non-blocking call did: moved this many bytes, or `None` (would block).
pub type Moved = Result<Option<usize>, Error>;

/// The byte stream of one connection.
pub enum Link {
    /// The socket.
    Plain(OwnedFd),
    /// TLS over the socket (boxed: the plain variant stays a descriptor).
    Tls(Box<TlsStream<Sock>>),
}

impl Link {
    /// Counts the socket calls TLS makes in `stats` from now on (plain calls are counted
    /// where they are made).
    pub fn count_into(&mut self, stats: &Arc<Stats>) {
        if let Link::Tls(t) = self {
            t.get_mut().count_into(stats.clone());
        }
    }

    /// The socket, for readiness waits and shutdown.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Link::Plain(fd) => fd.as_fd(),
            Link::Tls(t) => t.get_ref().as_fd(),
        }
    }

    /// Whether bytes already taken wait for the socket (TLS ciphertext).
    pub fn has_pending(&self) -> bool {
        match self {
            Link::Plain(_) => false,
            Link::Tls(t) => t.wants_write(),
        }
    }

    /// Sends a prefix of `slices`; returns how much of them was taken.
    pub fn send(&mut self, slices: &[IoSlice<'_>], stats: &Stats) -> Moved {
        match self {
            Link::Plain(fd) => loop {
                let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
                let control = &mut SendAncillaryBuffer::default();
                stats.add_syscalls(1);
                match rustix::net::sendmsg(&*fd, slices, control, flags) {
                    Ok(n) => return Ok(Some(n)),
                    Err(Errno::AGAIN) => return Ok(None),
                    Err(Errno::INTR) => continue,
                    Err(e) => return Err(Error::io("send", e.into())),
                }
            },
            Link::Tls(t) => {
                let taken = tls_moved(t.write_from(slices), "TLS send")?;
                stats.add_tls_encrypted(taken.unwrap_or(0) as u64);
                Ok(taken)
            }
        }
    }

    /// Sends TLS ciphertext still waiting (nothing to do in plain text).
    pub fn send_pending(&mut self) -> Moved {
        match self {
            Link::Plain(_) => Ok(Some(0)),
            Link::Tls(t) => tls_moved(t.send_pending().map(|()| 0), "TLS send"),
        }
    }

    /// Receives into `buf` (a reply header). `Ok(Some(0))`: the server closed.
    pub fn recv(&mut self, buf: &mut [u8], stats: &Stats) -> Moved {
        match self {
            Link::Plain(fd) => loop {
                stats.add_syscalls(1);
                match rustix::net::recv(&*fd, &mut *buf, RecvFlags::DONTWAIT) {
                    Ok((_, n)) => return Ok(Some(n)),
                    Err(Errno::AGAIN) => return Ok(None),
                    Err(Errno::INTR) => continue,
                    Err(e) => return Err(Error::io("receive", e.into())),
                }
            },
            Link::Tls(t) => {
                let got = tls_moved(t.read_into(&mut [IoSliceMut::new(buf)]), "TLS receive")?;
                stats.add_tls_decrypted(got.unwrap_or(0) as u64);
                Ok(got)
            }
        }
    }

    /// Receives into `slices` in order (read data). `Ok(Some(0))`: the server closed.
    pub fn recv_vectored(&mut self, slices: &mut [IoSliceMut<'_>], stats: &Stats) -> Moved {
        match self {
            Link::Plain(fd) => loop {
                let control = &mut RecvAncillaryBuffer::default();
                stats.add_syscalls(1);
                match rustix::net::recvmsg(&*fd, slices, control, RecvFlags::DONTWAIT) {
                    Ok(msg) => return Ok(Some(msg.bytes)),
                    Err(Errno::AGAIN) => return Ok(None),
                    Err(Errno::INTR) => continue,
                    Err(e) => return Err(Error::io("receive", e.into())),
                }
            },
            Link::Tls(t) => {
                let got = tls_moved(t.read_into(slices), "TLS receive")?;
                stats.add_tls_decrypted(got.unwrap_or(0) as u64);
                Ok(got)
            }
        }
    }

    /// Whether a receive that returned less than it asked for left the socket empty (so a
    /// level-triggered wait sees whatever comes next): a plain socket. TLS may hold
    /// decrypted bytes of its own that no wait on the socket would announce.
    pub fn short_receive_drains(&self) -> bool {
        matches!(self, Link::Plain(_))
    }

    /// Whether data arrived into a caller's buffer by the socket call itself (plain text),
    /// rather than decrypted into it.
    pub fn receives_in_place(&self) -> bool {
        matches!(self, Link::Plain(_))
    }

    /// Best effort, never blocking: sends `bytes` (`NBD_CMD_DISC`) and, under TLS, the
    /// close_notify alert behind it.
    pub fn send_last(&mut self, bytes: &[u8]) {
        match self {
            Link::Plain(fd) => {
                let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
                let _ = rustix::net::send(&*fd, bytes, flags);
            }
            Link::Tls(t) => {
                let _ = t.write_from(&[IoSlice::new(bytes)]);
                t.close_notify();
            }
        }
    }

    /// Shuts the socket down both ways (a hang-up).
    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(self.fd(), rustix::net::Shutdown::Both);
    }
}

/// A TLS call's result as a [`Moved`]; a refusal (an alert) keeps its type.
fn tls_moved(r: io::Result<usize>, context: &'static str) -> Moved {
    match r {
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(tls_error(e, context)),
    }
}

/// An I/O error from TLS: a [`Refusal`](zcnbd_tls::Refusal) if that is what it carries.
pub fn tls_error(e: io::Error, context: &'static str) -> Error {
    match zcnbd_tls::refusal_of(&e) {
        Some(refusal) => Error::Tls(refusal.clone()),
        None => Error::io(context, e),
    }
}
