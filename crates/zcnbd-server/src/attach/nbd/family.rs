//! The kernel's `nbd` generic netlink family, asked over a socket: its id resolved once, then
//! one request at a time, each waiting for its acknowledgement.

use std::io;
use std::time::Duration;

use super::error::{kernel, NbdError};
use super::genl;
use super::netlink::{family_id, get_family, Answer};
use crate::sys::netlink::NetlinkSocket;

/// How long the kernel may take to answer a request (a CONNECT reads the partition table
/// first).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest datagram taken from the kernel (its answers to zcnbd's requests are a few
/// dozen bytes).
pub const NETLINK_DATAGRAM_BYTES_MAX: usize = 16 << 10;

/// The family on a socket of this process.
pub struct NbdFamily {
    socket: NetlinkSocket,
    id: u16,
    seq: u32,
}

impl NbdFamily {
    /// Opens a socket and resolves the family (`NoDriver` where nbd.ko is not loaded).
    pub fn open() -> Result<NbdFamily, NbdError> {
        Self::resolve(genl::FAMILY_NAME)
    }

    /// A socket to generic netlink family `name` (`NoDriver` where the kernel has none).
    fn resolve(name: &str) -> Result<NbdFamily, NbdError> {
        let socket =
            NetlinkSocket::generic(ANSWER_TIMEOUT).map_err(kernel("open a netlink socket"))?;
        let mut family = NbdFamily {
            socket,
            id: 0,
            seq: 0,
        };
        let seq = family.next_seq();
        let answer = family
            .exchange(&get_family(name, seq)?, seq)
            .map_err(|e| match e {
                Refused(libc::ENOENT) => NbdError::NoDriver,
                e => e.into_error("resolve the nbd netlink family"),
            })?;
        let (_, reply) = answer.reply.ok_or(NbdError::NoDriver)?;
        family.id = family_id(&reply)?;
        Ok(family)
    }

    /// The family's id.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// The next request's sequence number.
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends `message` (numbered `seq`), returns the kernel's answer once acknowledged;
    /// `what` names it in errors.
    pub fn call(
        &mut self,
        message: &[u8],
        seq: u32,
        what: &'static str,
    ) -> Result<Answer, NbdError> {
        self.exchange(message, seq).map_err(|e| e.into_error(what))
    }

    fn exchange(&mut self, message: &[u8], seq: u32) -> Result<Answer, Failure> {
        self.socket.send(message).map_err(Failure::Io)?;
        let mut buf = vec![0u8; NETLINK_DATAGRAM_BYTES_MAX];
        let mut answer = Answer::default();
        loop {
            let datagram = self.socket.recv(&mut buf).map_err(Failure::Io)?;
            answer.take(datagram, seq).map_err(Failure::Malformed)?;
            match answer.done {
                Some(Ok(())) => return Ok(answer),
                Some(Err(errno)) => return Err(Refused(errno)),
                None => {}
            }
        }
    }
}

/// How an exchange failed.
enum Failure {
    Io(io::Error),
    Malformed(super::netlink::NetlinkError),
    Refused(i32),
}
use Failure::Refused;

impl Failure {
    fn into_error(self, what: &'static str) -> NbdError {
        match self {
            Failure::Io(e) => kernel(what)(e),
            Failure::Malformed(e) => NbdError::Netlink(e),
            Refused(libc::EPERM) => NbdError::NotPermitted,
            Refused(errno) => kernel(what)(io::Error::from_raw_os_error(errno)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The controller itself is a family every kernel has: its id is fixed.
    #[test]
    fn the_kernel_resolves_a_family_over_the_socket() {
        let family = NbdFamily::resolve("nlctrl").unwrap();
        assert_eq!(family.id(), super::super::netlink::CONTROLLER);
    }

    #[test]
    fn a_missing_family_is_no_driver() {
        let missing = NbdFamily::resolve("zcnbd-none");
        assert!(
            matches!(missing, Err(NbdError::NoDriver)),
            "{:?}",
            missing.err()
        );
    }
}
