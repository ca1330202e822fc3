//! The kernel NBD client's generic netlink family (`include/uapi/linux/nbd-netlink.h`),
//! sans-IO: the CONNECT, DISCONNECT and RECONFIGURE requests zcnbd sends, and the device index
//! read from CONNECT's reply. A socket is handed over as its descriptor's number in an
//! attribute (`NBD_SOCK_FD`, no `SCM_RIGHTS`): the kernel looks it up in the sending process.

use super::netlink::{attrs, find, NetlinkError, Request};

/// The family's name (`NBD_GENL_FAMILY_NAME`).
pub const FAMILY_NAME: &str = "nbd";
/// `NBD_GENL_VERSION`.
const VERSION: u8 = 1;

/// `NBD_CMD_*`.
mod cmd {
    pub const CONNECT: u8 = 1;
    pub const DISCONNECT: u8 = 2;
    pub const RECONFIGURE: u8 = 3;
}

/// `NBD_ATTR_INDEX`, which CONNECT's reply carries.
pub const ATTR_INDEX: u16 = attr::INDEX;

/// `NBD_ATTR_*`.
mod attr {
    /// u32: the device's index, N of `/dev/nbdN`.
    pub const INDEX: u16 = 1;
    /// u64: the device's size.
    pub const SIZE_BYTES: u16 = 2;
    /// u64: its logical block size.
    pub const BLOCK_SIZE_BYTES: u16 = 3;
    /// u64: seconds a request may take before its connection is given up (0: never).
    pub const TIMEOUT: u16 = 4;
    /// u64: the export's transmission flags from the handshake.
    pub const SERVER_FLAGS: u16 = 5;
    /// Nested: `NBD_SOCK_ITEM`s.
    pub const SOCKETS: u16 = 7;
    /// u64: seconds I/O waits for a dead connection to be replaced (RECONFIGURE).
    pub const DEAD_CONN_TIMEOUT: u16 = 8;
    /// String: what serves the device, shown in `/sys/block/nbdN/backend`.
    pub const BACKEND_IDENTIFIER: u16 = 10;
    /// `NBD_SOCK_ITEM`, in `SOCKETS`: nested, holding `NBD_SOCK_FD`.
    pub const SOCK_ITEM: u16 = 1;
    /// `NBD_SOCK_FD`, in a `SOCK_ITEM`: u32, a descriptor of the sending process.
    pub const SOCK_FD: u16 = 1;
}

/// What NBD_CMD_CONNECT gives the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect<'a> {
    /// The device to use (`None`: the kernel picks a free one, or makes one).
    pub index: Option<u32>,
    pub size_bytes: u64,
    pub block_size_bytes: u64,
    /// The export's transmission flags (read-only, flush, FUA, trim, multi-conn...).
    pub server_flags: u16,
    /// Seconds a request may take (0: no limit: the server is this process).
    pub timeout_s: u64,
    /// Seconds I/O waits for dead connections to be replaced (0: it fails at once).
    pub dead_conn_timeout_s: u64,
    /// The kernel's ends of the connections, already past the handshake.
    pub sockets: &'a [u32],
    /// Marks the device as zcnbd's, with its source.
    pub backend: &'a str,
}

fn sockets(req: &mut Request, fds: &[u32]) {
    req.nested(attr::SOCKETS, |s| {
        for fd in fds {
            s.nested(attr::SOCK_ITEM, |item| {
                item.u32(attr::SOCK_FD, *fd);
            });
        }
    });
}

/// NBD_CMD_CONNECT for family id `family`.
pub fn connect(family: u16, seq: u32, c: &Connect<'_>) -> Result<Vec<u8>, NetlinkError> {
    let mut req = Request::new(family, cmd::CONNECT, VERSION, seq);
    if let Some(index) = c.index {
        req.u32(attr::INDEX, index);
    }
    req.u64(attr::SIZE_BYTES, c.size_bytes)
        .u64(attr::BLOCK_SIZE_BYTES, c.block_size_bytes)
        .u64(attr::SERVER_FLAGS, u64::from(c.server_flags))
        .u64(attr::TIMEOUT, c.timeout_s)
        .u64(attr::DEAD_CONN_TIMEOUT, c.dead_conn_timeout_s)
        .string(attr::BACKEND_IDENTIFIER, c.backend);
    sockets(&mut req, c.sockets);
    req.finish()
}

/// NBD_CMD_DISCONNECT of device `index`.
pub fn disconnect(family: u16, seq: u32, index: u32) -> Result<Vec<u8>, NetlinkError> {
    let mut req = Request::new(family, cmd::DISCONNECT, VERSION, seq);
    req.u32(attr::INDEX, index);
    req.finish()
}

/// NBD_CMD_RECONFIGURE of device `index`: `sockets` replace its dead connections. The kernel
/// asks for the backend identifier the device was connected with ("must specify backend").
pub fn reconfigure(
    family: u16,
    seq: u32,
    index: u32,
    sockets_fds: &[u32],
    backend: &str,
) -> Result<Vec<u8>, NetlinkError> {
    let mut req = Request::new(family, cmd::RECONFIGURE, VERSION, seq);
    req.u32(attr::INDEX, index)
        .string(attr::BACKEND_IDENTIFIER, backend);
    sockets(&mut req, sockets_fds);
    req.finish()
}

/// The device index in CONNECT's reply.
pub fn connected_index(reply: &[u8]) -> Result<u32, NetlinkError> {
    find(&attrs(reply)?, attr::INDEX)?.u32()
}

#[cfg(test)]
#[path = "genl_tests.rs"]
mod tests;
