//! Turning one caller operation into wire requests: the export's constraints are checked
//! here (range, alignment, what the server allows) and large operations are split at the
//! server's maximum payload, never per page.

use zcnbd_proto::consts::{cmd_flags, transmission_flags as tf};
use zcnbd_proto::{Command, ReplyMode, Request};

use crate::conn::PartSpec;
use crate::error::{Error, Result};
use crate::sys::Buffer;

/// Largest payload the client sends or asks for in one request, whatever the server allows.
pub const PAYLOAD_BYTES_MAX: u32 = 64 * 1024 * 1024;
/// Payload limit when the server states none: "the client SHOULD NOT send a request with a
/// payload larger than 32 MiB" without block size information.
const DEFAULT_PAYLOAD_BYTES_MAX: u32 = 32 * 1024 * 1024;

/// What the handshake told the client about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
    /// Every offset and length must be a multiple of this.
    pub minimum: u32,
    /// The preferred I/O size.
    pub preferred: u32,
    /// Largest read or write payload per request.
    pub payload_max: u32,
    /// Reply framing.
    pub mode: ReplyMode,
    /// Whether `base:allocation` was negotiated.
    pub base_allocation: bool,
}

impl Geometry {
    /// The geometry from a handshake's result.
    pub fn from_negotiated(n: &zcnbd_proto::ClientNegotiated) -> Geometry {
        let (minimum, preferred, payload_max) = match n.block_size {
            Some(b) => (b.minimum, b.preferred, b.payload_max),
            None => (1, 4096, DEFAULT_PAYLOAD_BYTES_MAX),
        };
        Geometry {
            size: n.size,
            flags: n.flags,
            minimum: minimum.max(1),
            preferred,
            payload_max: payload_max.min(PAYLOAD_BYTES_MAX).max(minimum.max(1)),
            mode: n.mode,
            base_allocation: n.base_allocation_id.is_some(),
        }
    }

    /// Whether the server advertised transmission flag `flag`.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    fn check_range(&self, offset: u64, length: u64) -> Result<()> {
        let end = offset.checked_add(length);
        if end.is_none_or(|end| end > self.size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size: self.size,
            });
        }
        let minimum = u64::from(self.minimum);
        if !offset.is_multiple_of(minimum) || !length.is_multiple_of(minimum) {
            return Err(Error::Misaligned {
                offset,
                length,
                minimum: self.minimum,
            });
        }
        Ok(())
    }

    fn check_write(&self, flags: u16) -> Result<()> {
        if self.has(tf::READ_ONLY) {
            return Err(Error::Unsupported("the export is read-only"));
        }
        if flags & cmd_flags::FUA != 0 && !self.has(tf::SEND_FUA) {
            return Err(Error::Unsupported("the server does not support FUA"));
        }
        Ok(())
    }

    /// Largest effect length of one request without a payload.
    fn effect_max(&self) -> u64 {
        let cap = match self.mode {
            ReplyMode::Extended => 1 << 62,
            _ => u64::from(u32::MAX),
        };
        cap / u64::from(self.minimum) * u64::from(self.minimum)
    }
}

/// Plans a read or write of `buffer` at `offset`.
pub fn read_write(
    geo: &Geometry,
    command: Command,
    flags: u16,
    offset: u64,
    buffer: Buffer,
) -> Result<Vec<PartSpec>> {
    if command == Command::Write {
        geo.check_write(flags)?;
    }
    let length = buffer.len();
    geo.check_range(offset, length)?;
    let step = u64::from(geo.payload_max);
    if length <= step {
        if buffer.is_empty() {
            return Ok(Vec::new());
        }
        let request = Request {
            command,
            flags,
            offset,
            length,
        };
        return Ok(vec![PartSpec {
            request,
            buffer,
            pipe: None,
        }]);
    }
    let mut parts = Vec::new();
    let mut at = 0;
    while at < length {
        let n = step.min(length - at);
        let request = Request {
            command,
            flags,
            offset: offset + at,
            length: n,
        };
        parts.push(PartSpec {
            request,
            buffer: buffer.sub(at, n),
            pipe: None,
        });
        at += n;
    }
    Ok(parts)
}

/// Plans a trim, zero or cache of `length` bytes at `offset` (no payload).
pub fn effect(
    geo: &Geometry,
    command: Command,
    flags: u16,
    offset: u64,
    length: u64,
) -> Result<Vec<PartSpec>> {
    let needed = match command {
        Command::Trim => Some((tf::SEND_TRIM, "the server does not support trim")),
        Command::WriteZeroes => Some((tf::SEND_WRITE_ZEROES, "the server does not support zero")),
        Command::Cache => Some((tf::SEND_CACHE, "the server does not support cache")),
        _ => None,
    };
    if let Some((flag, why)) = needed {
        if !geo.has(flag) {
            return Err(Error::Unsupported(why));
        }
    }
    if command.is_write() {
        geo.check_write(flags)?;
    }
    if flags & cmd_flags::FAST_ZERO != 0 && !geo.has(tf::SEND_FAST_ZERO) {
        return Err(Error::Unsupported("the server does not support fast zero"));
    }
    geo.check_range(offset, length)?;
    let step = geo.effect_max();
    let mut parts = Vec::new();
    let mut at = 0;
    while at < length {
        let n = step.min(length - at);
        let request = Request {
            command,
            flags,
            offset: offset + at,
            length: n,
        };
        parts.push(PartSpec {
            request,
            buffer: Buffer::default(),
            pipe: None,
        });
        at += n;
    }
    Ok(parts)
}

/// Plans a flush.
pub fn flush(geo: &Geometry) -> Result<Vec<PartSpec>> {
    if !geo.has(tf::SEND_FLUSH) {
        return Err(Error::Unsupported("the server does not support flush"));
    }
    let request = Request {
        command: Command::Flush,
        flags: 0,
        offset: 0,
        length: 0,
    };
    Ok(vec![PartSpec {
        request,
        buffer: Buffer::default(),
        pipe: None,
    }])
}

/// Plans a block status query (one request: the server may answer for less). The caller
/// checks a metadata context was selected: "A client MUST NOT send NBD_CMD_BLOCK_STATUS
/// unless ... the server returned at least one metadata context without an error".
pub fn block_status(geo: &Geometry, offset: u64, length: u64, flags: u16) -> Result<Vec<PartSpec>> {
    geo.check_range(offset, length)?;
    if length == 0 {
        return Ok(Vec::new());
    }
    let request = Request {
        command: Command::BlockStatus,
        flags,
        offset,
        length: length.min(geo.effect_max()),
    };
    Ok(vec![PartSpec {
        request,
        buffer: Buffer::default(),
        pipe: None,
    }])
}
