//! Transmission-phase request headers: decoding, and encoding for clients and tests.

use crate::consts::{cmd_flags, EXTENDED_REQUEST_MAGIC, REQUEST_MAGIC};
use crate::cursor::{PutBe, Reader};
use crate::types::{Command, ReplyMode};

/// Size of a compact request header.
pub const COMPACT_REQUEST_BYTES: usize = 28;
/// Size of an extended request header.
pub const EXTENDED_REQUEST_BYTES: usize = 32;

/// A request header as sent, before validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags (`cmd_flags::*`).
    pub flags: u16,
    /// Raw request type (see [`Command::from_wire`]).
    pub kind: u16,
    /// Opaque value echoed in the reply.
    pub cookie: u64,
    /// Offset into the export.
    pub offset: u64,
    /// Payload length or effect length (see [`RequestHeader::payload_bytes`]).
    pub length: u64,
}

/// Why a request header could not be decoded; the connection cannot continue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The header does not start with the magic the negotiated mode requires.
    #[error("bad request magic {0:#010x}")]
    BadMagic(u32),
}

impl RequestHeader {
    /// Decodes one header from the start of `input`; `Ok(None)` if more bytes are needed.
    pub fn decode(input: &[u8], mode: ReplyMode) -> Result<Option<RequestHeader>, RequestError> {
        let size = mode.request_header_bytes();
        let mut r = Reader::new(input);
        let Some(header) = r.take(size) else {
            return Ok(None);
        };
        Self::decode_exact(header, mode).map(Some)
    }

    fn decode_exact(header: &[u8], mode: ReplyMode) -> Result<RequestHeader, RequestError> {
        let mut r = Reader::new(header);
        let magic = r.u32().unwrap_or(0);
        let expected = match mode {
            ReplyMode::Extended => EXTENDED_REQUEST_MAGIC,
            _ => REQUEST_MAGIC,
        };
        if magic != expected {
            return Err(RequestError::BadMagic(magic));
        }
        let flags = r.u16().unwrap_or(0);
        let kind = r.u16().unwrap_or(0);
        let cookie = r.u64().unwrap_or(0);
        let offset = r.u64().unwrap_or(0);
        let length = match mode {
            ReplyMode::Extended => r.u64().unwrap_or(0),
            _ => u64::from(r.u32().unwrap_or(0)),
        };
        Ok(RequestHeader {
            flags,
            kind,
            cookie,
            offset,
            length,
        })
    }

    /// How many payload bytes follow this header on the wire.
    ///
    /// Compact: "the only command where *length* represents payload length instead of effect
    /// length is `NBD_CMD_WRITE`". Extended: the payload is present when the flag
    /// `NBD_CMD_FLAG_PAYLOAD_LEN` is set, and always for `NBD_CMD_WRITE`: the spec says a
    /// write MUST set the flag, but QEMU's client (10.0) sends write payloads without it and
    /// QEMU's server reads them, so a write's length is its payload either way.
    pub fn payload_bytes(&self, mode: ReplyMode) -> u64 {
        let is_write = self.kind == Command::Write.to_wire();
        match mode {
            ReplyMode::Extended if self.flags & cmd_flags::PAYLOAD_LEN != 0 => self.length,
            _ if is_write => self.length,
            _ => 0,
        }
    }

    /// Appends the wire form of this header for `mode` (the compact form truncates `length`
    /// to 32 bits, as only a client that negotiated extended headers may send more).
    pub fn encode(&self, mode: ReplyMode, out: &mut Vec<u8>) {
        let extended = mode == ReplyMode::Extended;
        out.put_u32(if extended {
            EXTENDED_REQUEST_MAGIC
        } else {
            REQUEST_MAGIC
        });
        out.put_u16(self.flags);
        out.put_u16(self.kind);
        out.put_u64(self.cookie);
        out.put_u64(self.offset);
        if extended {
            out.put_u64(self.length);
        } else {
            out.put_u32(self.length as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RequestHeader {
        RequestHeader {
            flags: 1,
            kind: 1,
            cookie: 7,
            offset: 4096,
            length: 512,
        }
    }

    #[test]
    fn round_trips_in_both_sizes() {
        for mode in [
            ReplyMode::Simple,
            ReplyMode::Structured,
            ReplyMode::Extended,
        ] {
            let mut wire = Vec::new();
            sample().encode(mode, &mut wire);
            assert_eq!(wire.len(), mode.request_header_bytes());
            assert_eq!(
                RequestHeader::decode(&wire[..wire.len() - 1], mode),
                Ok(None)
            );
            assert_eq!(RequestHeader::decode(&wire, mode), Ok(Some(sample())));
        }
    }

    #[test]
    fn wrong_magic_for_mode_is_an_error() {
        let mut wire = Vec::new();
        sample().encode(ReplyMode::Simple, &mut wire);
        wire.extend_from_slice(&[0; 4]);
        assert_eq!(
            RequestHeader::decode(&wire, ReplyMode::Extended),
            Err(RequestError::BadMagic(REQUEST_MAGIC))
        );
    }

    #[test]
    fn payload_follows_write_only_in_compact_mode() {
        let write = sample();
        assert_eq!(write.payload_bytes(ReplyMode::Structured), 512);
        let trim = RequestHeader { kind: 4, ..write };
        assert_eq!(trim.payload_bytes(ReplyMode::Simple), 0);
        // Extended: PAYLOAD_LEN decides, and a write always carries its payload.
        assert_eq!(write.payload_bytes(ReplyMode::Extended), 512);
        assert_eq!(trim.payload_bytes(ReplyMode::Extended), 0);
        let flagged = RequestHeader {
            flags: cmd_flags::PAYLOAD_LEN,
            ..trim
        };
        assert_eq!(flagged.payload_bytes(ReplyMode::Extended), 512);
    }
}
