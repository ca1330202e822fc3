//! Generic netlink messages, sans-IO: a request built into a buffer this module owns
//! ([`Request`]: the netlink header, the generic header, attributes and nested attributes),
//! and the kernel's answer read back from the datagrams the caller receives ([`Answer`]: a
//! reply's attributes, then the acknowledgement or the errno). The socket is `sys::netlink`.
//!
//! The layout is the kernel's (`include/uapi/linux/netlink.h`, `genetlink.h`): a 16-byte
//! `nlmsghdr` (length, type, flags, sequence, port), a 4-byte `genlmsghdr` (command,
//! version, reserved), then attributes, each a 4-byte `nlattr` (length, type) and its value,
//! padded to 4 bytes. Every number is in the host's byte order. What the kernel sends is read
//! with checked lengths: a truncated message or attribute is an error, never a panic.

/// `struct nlmsghdr`'s length.
pub const MESSAGE_HEADER_BYTES: usize = 16;
/// `struct genlmsghdr`'s length.
pub const GENERIC_HEADER_BYTES: usize = 4;
/// `struct nlattr`'s length.
pub const ATTR_HEADER_BYTES: usize = 4;
/// The largest attribute (its length is 16 bits, header included).
pub const ATTR_BYTES_MAX: usize = u16::MAX as usize;

/// `NLM_F_REQUEST`: a request to the kernel.
const FLAG_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`: answer with an acknowledgement (an `NLMSG_ERROR` of 0) on success.
const FLAG_ACK: u16 = 0x4;
/// `NLMSG_ERROR`: an acknowledgement or an error.
const TYPE_ERROR: u16 = 0x2;
/// `NLMSG_DONE`: the end of a dump.
const TYPE_DONE: u16 = 0x3;
/// `NLA_F_NESTED`: the attribute holds attributes.
const ATTR_NESTED: u16 = 1 << 15;
/// The attribute type's bits (`NLA_TYPE_MASK`: without `NLA_F_NESTED` and
/// `NLA_F_NET_BYTEORDER`).
const ATTR_TYPE_MASK: u16 = !(ATTR_NESTED | 1 << 14);

/// The generic netlink controller's family (`GENL_ID_CTRL`).
pub const CONTROLLER: u16 = 0x10;
/// `CTRL_CMD_GETFAMILY`.
const CTRL_CMD_GETFAMILY: u8 = 3;
/// `CTRL_ATTR_FAMILY_ID` (u16).
const CTRL_ATTR_FAMILY_ID: u16 = 1;
/// `CTRL_ATTR_FAMILY_NAME` (a NUL-terminated string).
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
/// The controller's interface version.
const CTRL_VERSION: u8 = 2;

/// Why a message could not be built or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetlinkError {
    /// Fewer bytes than a header or a length said.
    #[error("netlink: truncated {0}")]
    Truncated(&'static str),
    /// A length shorter than its own header.
    #[error("netlink: {what} says it is {len} bytes")]
    BadLength { what: &'static str, len: usize },
    /// An attribute's value has the wrong size for its type.
    #[error("netlink: attribute {kind} has {len} bytes, not {want}")]
    BadValue { kind: u16, len: usize, want: usize },
    /// An attribute the answer must carry is absent.
    #[error("netlink: the kernel's reply has no attribute {0}")]
    Missing(u16),
    /// A request's attribute does not fit its 16-bit length.
    #[error("netlink: an attribute of {0} bytes is too long")]
    TooLong(usize),
}

/// A request being built: its headers first, attributes appended, lengths filled in by
/// [`Request::finish`].
#[derive(Debug)]
pub struct Request {
    buf: Vec<u8>,
    /// An attribute did not fit (reported by `finish`).
    too_long: Option<usize>,
}

impl Request {
    /// A request for command `cmd` (interface `version`) of generic netlink family `family`,
    /// numbered `seq`, acknowledged.
    pub fn new(family: u16, cmd: u8, version: u8, seq: u32) -> Request {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&family.to_ne_bytes());
        buf.extend_from_slice(&(FLAG_REQUEST | FLAG_ACK).to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        // Port 0: the kernel assigns ours.
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[cmd, version, 0, 0]);
        Request {
            buf,
            too_long: None,
        }
    }

    fn attr(&mut self, kind: u16, value: &[u8]) {
        let len = ATTR_HEADER_BYTES + value.len();
        let Ok(len16) = u16::try_from(len) else {
            self.too_long.get_or_insert(len);
            return;
        };
        self.buf.extend_from_slice(&len16.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// A u32 attribute.
    pub fn u32(&mut self, kind: u16, value: u32) -> &mut Request {
        self.attr(kind, &value.to_ne_bytes());
        self
    }

    /// A u64 attribute.
    pub fn u64(&mut self, kind: u16, value: u64) -> &mut Request {
        self.attr(kind, &value.to_ne_bytes());
        self
    }

    /// A string attribute (NUL-terminated, as `NLA_STRING` and `NLA_NUL_STRING` take it).
    pub fn string(&mut self, kind: u16, value: &str) -> &mut Request {
        let mut bytes = Vec::with_capacity(value.len() + 1);
        bytes.extend_from_slice(value.as_bytes());
        bytes.push(0);
        self.attr(kind, &bytes);
        self
    }

    /// A nested attribute holding what `inner` appends.
    pub fn nested(&mut self, kind: u16, inner: impl FnOnce(&mut Request)) -> &mut Request {
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0; ATTR_HEADER_BYTES]);
        inner(self);
        let len = self.buf.len() - at;
        match u16::try_from(len) {
            Ok(len16) => {
                self.buf[at..at + 2].copy_from_slice(&len16.to_ne_bytes());
                self.buf[at + 2..at + 4].copy_from_slice(&(kind | ATTR_NESTED).to_ne_bytes());
            }
            Err(_) => {
                self.too_long.get_or_insert(len);
            }
        }
        self
    }

    /// The message, its length filled in.
    pub fn finish(mut self) -> Result<Vec<u8>, NetlinkError> {
        if let Some(len) = self.too_long {
            return Err(NetlinkError::TooLong(len));
        }
        let len = u32::try_from(self.buf.len()).map_err(|_| NetlinkError::TooLong(usize::MAX))?;
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        Ok(self.buf)
    }
}

/// A bounds-checked reader over received bytes.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], NetlinkError> {
        if self.rest.len() < n {
            return Err(NetlinkError::Truncated(what));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn take_array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], NetlinkError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    /// Skips the padding to the next 4-byte boundary (the last item may lack it).
    fn align(&mut self, len: usize) {
        let pad = (4 - len % 4) % 4;
        self.rest = self.rest.get(pad..).unwrap_or_default();
    }
}

/// One netlink message of a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// `nlmsg_type`: a family, or `NLMSG_ERROR`, `NLMSG_DONE`.
    pub kind: u16,
    pub seq: u32,
    /// What follows the header.
    pub payload: &'a [u8],
}

/// The messages of one datagram.
pub fn messages(datagram: &[u8]) -> Result<Vec<Message<'_>>, NetlinkError> {
    let mut r = Reader { rest: datagram };
    let mut out = Vec::new();
    while !r.rest.is_empty() {
        let len = u32::from_ne_bytes(r.take_array("message header")?) as usize;
        let kind = u16::from_ne_bytes(r.take_array("message header")?);
        let _flags = u16::from_ne_bytes(r.take_array("message header")?);
        let seq = u32::from_ne_bytes(r.take_array("message header")?);
        let _port = u32::from_ne_bytes(r.take_array("message header")?);
        let Some(body) = len.checked_sub(MESSAGE_HEADER_BYTES) else {
            return Err(NetlinkError::BadLength {
                what: "message",
                len,
            });
        };
        let payload = r.take(body, "message")?;
        r.align(len);
        out.push(Message { kind, seq, payload });
    }
    Ok(out)
}

/// One attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// Its type, without the nested and byte-order flags.
    pub kind: u16,
    pub value: &'a [u8],
}

impl<'a> Attr<'a> {
    fn exact<const N: usize>(&self) -> Result<[u8; N], NetlinkError> {
        <[u8; N]>::try_from(self.value).map_err(|_| NetlinkError::BadValue {
            kind: self.kind,
            len: self.value.len(),
            want: N,
        })
    }

    /// A u8 value.
    pub fn u8(&self) -> Result<u8, NetlinkError> {
        Ok(self.exact::<1>()?[0])
    }

    /// A u16 value.
    pub fn u16(&self) -> Result<u16, NetlinkError> {
        Ok(u16::from_ne_bytes(self.exact()?))
    }

    /// A u32 value.
    pub fn u32(&self) -> Result<u32, NetlinkError> {
        Ok(u32::from_ne_bytes(self.exact()?))
    }

    /// The attributes a nested attribute holds.
    pub fn nested(&self) -> Result<Vec<Attr<'a>>, NetlinkError> {
        attrs(self.value)
    }
}

/// The attributes in `bytes`.
pub fn attrs(bytes: &[u8]) -> Result<Vec<Attr<'_>>, NetlinkError> {
    let mut r = Reader { rest: bytes };
    let mut out = Vec::new();
    while !r.rest.is_empty() {
        let len = u16::from_ne_bytes(r.take_array("attribute header")?) as usize;
        let kind = u16::from_ne_bytes(r.take_array("attribute header")?) & ATTR_TYPE_MASK;
        let Some(body) = len.checked_sub(ATTR_HEADER_BYTES) else {
            return Err(NetlinkError::BadLength {
                what: "attribute",
                len,
            });
        };
        let value = r.take(body, "attribute")?;
        r.align(len);
        out.push(Attr { kind, value });
    }
    Ok(out)
}

/// The first attribute of type `kind`.
pub fn find<'a>(attrs: &[Attr<'a>], kind: u16) -> Result<Attr<'a>, NetlinkError> {
    attrs
        .iter()
        .find(|a| a.kind == kind)
        .copied()
        .ok_or(NetlinkError::Missing(kind))
}

/// The kernel's answer to one request, gathered from the datagrams received after it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The first reply's command and attributes (a command that answers with data).
    pub reply: Option<(u8, Vec<u8>)>,
    /// The end: `Ok` (acknowledged) or the kernel's errno.
    pub done: Option<Result<(), i32>>,
}

impl Answer {
    /// Takes in a datagram: messages of other requests (other sequence numbers) are left
    /// aside.
    pub fn take(&mut self, datagram: &[u8], seq: u32) -> Result<(), NetlinkError> {
        for m in messages(datagram)? {
            if m.seq != seq || self.done.is_some() {
                continue;
            }
            match m.kind {
                TYPE_ERROR => {
                    let code = m
                        .payload
                        .get(..4)
                        .ok_or(NetlinkError::Truncated("error message"))?;
                    let code = i32::from_ne_bytes([code[0], code[1], code[2], code[3]]);
                    // The errno is negative; 0 acknowledges.
                    self.done = Some(match code {
                        0 => Ok(()),
                        c => Err(c.checked_neg().unwrap_or(i32::MAX)),
                    });
                }
                TYPE_DONE => self.done = Some(Ok(())),
                _ => {
                    let header = m
                        .payload
                        .get(..GENERIC_HEADER_BYTES)
                        .ok_or(NetlinkError::Truncated("generic header"))?;
                    let body = &m.payload[GENERIC_HEADER_BYTES..];
                    // Checked now, so a reply that is read later is well formed.
                    attrs(body)?;
                    if self.reply.is_none() {
                        self.reply = Some((header[0], body.to_vec()));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The request that asks the controller for family `name`'s id.
pub fn get_family(name: &str, seq: u32) -> Result<Vec<u8>, NetlinkError> {
    let mut req = Request::new(CONTROLLER, CTRL_CMD_GETFAMILY, CTRL_VERSION, seq);
    req.string(CTRL_ATTR_FAMILY_NAME, name);
    req.finish()
}

/// The family id in the controller's reply's attributes.
pub fn family_id(reply: &[u8]) -> Result<u16, NetlinkError> {
    find(&attrs(reply)?, CTRL_ATTR_FAMILY_ID)?.u16()
}

#[cfg(test)]
#[path = "netlink_tests.rs"]
mod tests;
