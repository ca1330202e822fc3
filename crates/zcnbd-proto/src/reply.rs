//! Transmission-phase replies: encoders that append to a caller-owned buffer, and the
//! header decoder a client uses.
//!
//! A read reply's payload is never copied here: the encoder writes only the header (and, for
//! `OFFSET_DATA`, the 8-byte offset), so the I/O layer can send header and data in one
//! vectored send straight from where the data lives.

use crate::consts::{
    chunk, reply_flags, EXTENDED_REPLY_MAGIC, SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};
use crate::cursor::{PutBe, Reader};
use crate::types::{Errno, Extent, ReplyMode};

/// Size of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Size of a structured reply chunk header.
pub const STRUCTURED_REPLY_BYTES: usize = 20;
/// Size of an extended reply chunk header.
pub const EXTENDED_REPLY_BYTES: usize = 32;
/// The longest header plus fixed prefix a data reply needs (extended header + offset).
pub const DATA_REPLY_PREFIX_BYTES_MAX: usize = EXTENDED_REPLY_BYTES + 8;
/// Longest error message sent in an error chunk.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 4096;

/// Identifies the request a reply answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTo {
    /// Framing negotiated for the connection.
    pub mode: ReplyMode,
    /// The request's cookie.
    pub cookie: u64,
    /// The request's offset (echoed in extended headers).
    pub offset: u64,
}

impl ReplyTo {
    /// Appends a chunk header (structured or extended; never called in simple mode).
    fn chunk_header(&self, flags: u16, kind: u16, payload_bytes: u64, out: &mut Vec<u8>) {
        if self.mode == ReplyMode::Extended {
            out.put_u32(EXTENDED_REPLY_MAGIC);
            out.put_u16(flags);
            out.put_u16(kind);
            out.put_u64(self.cookie);
            out.put_u64(self.offset);
            out.put_u64(payload_bytes);
        } else {
            out.put_u32(STRUCTURED_REPLY_MAGIC);
            out.put_u16(flags);
            out.put_u16(kind);
            out.put_u64(self.cookie);
            // Callers bound payloads by the advertised maximum, far below 4 GiB.
            out.put_u32(payload_bytes as u32);
        }
    }

    fn simple(&self, error: u32, out: &mut Vec<u8>) {
        out.put_u32(SIMPLE_REPLY_MAGIC);
        out.put_u32(error);
        out.put_u64(self.cookie);
    }

    /// Appends the successful end of a reply with no data: a simple reply with error 0, or a
    /// `NONE` chunk with `DONE`.
    pub fn encode_ok(&self, out: &mut Vec<u8>) {
        match self.mode {
            ReplyMode::Simple => self.simple(0, out),
            _ => self.chunk_header(reply_flags::DONE, chunk::NONE, 0, out),
        }
    }

    /// Appends an error reply: a simple reply, or an `ERROR` chunk with `DONE` and `message`
    /// (cut to [`ERROR_MESSAGE_BYTES_MAX`]).
    pub fn encode_error(&self, errno: Errno, message: &str, out: &mut Vec<u8>) {
        if self.mode == ReplyMode::Simple {
            return self.simple(errno.to_wire(), out);
        }
        let message = &message.as_bytes()[..message.floor_char_boundary(ERROR_MESSAGE_BYTES_MAX)];
        let payload = 6 + message.len() as u64;
        self.chunk_header(reply_flags::DONE, chunk::ERROR, payload, out);
        out.put_u32(errno.to_wire());
        out.put_u16(message.len() as u16);
        out.extend_from_slice(message);
    }

    /// Appends the header for `data_bytes` of read data at `data_offset`; the data itself
    /// follows on the wire. Simple mode: the simple reply header (only for the whole read).
    pub fn encode_data_header(
        &self,
        data_offset: u64,
        data_bytes: u64,
        done: bool,
        out: &mut Vec<u8>,
    ) {
        if self.mode == ReplyMode::Simple {
            return self.simple(0, out);
        }
        let flags = if done { reply_flags::DONE } else { 0 };
        self.chunk_header(flags, chunk::OFFSET_DATA, 8 + data_bytes, out);
        out.put_u64(data_offset);
    }

    /// Appends an `OFFSET_HOLE` chunk (structured or extended mode only).
    pub fn encode_hole(&self, hole_offset: u64, hole_bytes: u32, done: bool, out: &mut Vec<u8>) {
        let flags = if done { reply_flags::DONE } else { 0 };
        self.chunk_header(flags, chunk::OFFSET_HOLE, 12, out);
        out.put_u64(hole_offset);
        out.put_u32(hole_bytes);
    }

    /// Appends a final block status chunk for `context_id` (compact `BLOCK_STATUS` with
    /// 32-bit lengths, or `BLOCK_STATUS_EXT` in extended mode). A compact extent longer than
    /// [`COMPACT_EXTENT_BYTES_MAX`] is shortened to it and ends the list: the spec lets the
    /// server describe less than asked, but the extents after it must start where it ends,
    /// so none may follow a shortened one (they would shift, and a hole could be reported
    /// over data).
    pub fn encode_block_status(&self, context_id: u32, extents: &[Extent], out: &mut Vec<u8>) {
        self.encode_block_status_chunk(context_id, extents, true, out);
    }

    /// One block status chunk of a reply that has one per selected context; `done` on the
    /// last.
    pub fn encode_block_status_chunk(
        &self,
        context_id: u32,
        extents: &[Extent],
        done: bool,
        out: &mut Vec<u8>,
    ) {
        let flags = if done { reply_flags::DONE } else { 0 };
        if self.mode == ReplyMode::Extended {
            let count = extents.len() as u64;
            self.chunk_header(flags, chunk::BLOCK_STATUS_EXT, 8 + 16 * count, out);
            out.put_u32(context_id);
            out.put_u32(count as u32);
            for e in extents {
                out.put_u64(e.length);
                out.put_u64(u64::from(e.flags));
            }
            return;
        }
        let kept = compact_extents(extents);
        let count = kept.len() as u64;
        self.chunk_header(flags, chunk::BLOCK_STATUS, 4 + 8 * count, out);
        out.put_u32(context_id);
        for e in kept {
            out.put_u32(e.length.min(COMPACT_EXTENT_BYTES_MAX) as u32);
            out.put_u32(e.flags);
        }
    }
}

/// The longest extent a compact (32-bit) block status reply describes: 4 GiB less 64 KiB, a
/// multiple of every minimum block size a server may advertise.
pub const COMPACT_EXTENT_BYTES_MAX: u64 = u32::MAX as u64 + 1 - 65536;

/// The extents a compact reply carries: all of them up to and including the first one longer
/// than [`COMPACT_EXTENT_BYTES_MAX`] (which is then shortened).
fn compact_extents(extents: &[Extent]) -> &[Extent] {
    match extents
        .iter()
        .position(|e| e.length > COMPACT_EXTENT_BYTES_MAX)
    {
        Some(capped) => &extents[..=capped],
        None => extents,
    }
}

/// A decoded reply header, as a client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply; for a successful read, the request's length of data follows.
    Simple { error: u32, cookie: u64 },
    /// A structured or extended chunk; `length` payload bytes follow.
    Chunk {
        flags: u16,
        kind: u16,
        cookie: u64,
        offset: u64,
        length: u64,
    },
}

/// Why a reply header could not be decoded; the client must hang up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The magic is not valid for the negotiated mode.
    #[error("bad reply magic {0:#010x}")]
    BadMagic(u32),
}

impl ReplyHeader {
    /// Decodes a header from `input`; `Ok(None)` when more bytes are needed, otherwise the
    /// header and its size. The magic decides the size, within what `mode` allows.
    pub fn decode(
        input: &[u8],
        mode: ReplyMode,
    ) -> Result<Option<(ReplyHeader, usize)>, ReplyError> {
        let mut r = Reader::new(input);
        let Some(magic) = r.u32() else {
            return Ok(None);
        };
        let size = match (magic, mode) {
            (SIMPLE_REPLY_MAGIC, ReplyMode::Simple | ReplyMode::Structured) => SIMPLE_REPLY_BYTES,
            (STRUCTURED_REPLY_MAGIC, ReplyMode::Structured) => STRUCTURED_REPLY_BYTES,
            (EXTENDED_REPLY_MAGIC, ReplyMode::Extended) => EXTENDED_REPLY_BYTES,
            _ => return Err(ReplyError::BadMagic(magic)),
        };
        let Some(body) = r.take(size - 4) else {
            return Ok(None);
        };
        let mut r = Reader::new(body);
        let header = match size {
            SIMPLE_REPLY_BYTES => ReplyHeader::Simple {
                error: r.u32().unwrap_or(0),
                cookie: r.u64().unwrap_or(0),
            },
            _ => {
                let flags = r.u16().unwrap_or(0);
                let kind = r.u16().unwrap_or(0);
                let cookie = r.u64().unwrap_or(0);
                let (offset, length) = if size == EXTENDED_REPLY_BYTES {
                    (r.u64().unwrap_or(0), r.u64().unwrap_or(0))
                } else {
                    (0, u64::from(r.u32().unwrap_or(0)))
                };
                ReplyHeader::Chunk {
                    flags,
                    kind,
                    cookie,
                    offset,
                    length,
                }
            }
        };
        Ok(Some((header, size)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(mode: ReplyMode) -> ReplyTo {
        ReplyTo {
            mode,
            cookie: 0xabcd,
            offset: 512,
        }
    }

    #[test]
    fn ok_reply_per_mode() {
        let mut out = Vec::new();
        to(ReplyMode::Simple).encode_ok(&mut out);
        assert_eq!(out.len(), SIMPLE_REPLY_BYTES);
        let (h, n) = ReplyHeader::decode(&out, ReplyMode::Simple)
            .unwrap()
            .unwrap();
        assert_eq!(
            (h, n),
            (
                ReplyHeader::Simple {
                    error: 0,
                    cookie: 0xabcd
                },
                16
            )
        );

        out.clear();
        to(ReplyMode::Extended).encode_ok(&mut out);
        let (h, n) = ReplyHeader::decode(&out, ReplyMode::Extended)
            .unwrap()
            .unwrap();
        let none = ReplyHeader::Chunk {
            flags: 1,
            kind: 0,
            cookie: 0xabcd,
            offset: 512,
            length: 0,
        };
        assert_eq!((h, n), (none, 32));
    }

    #[test]
    fn error_chunk_carries_message() {
        let mut out = Vec::new();
        to(ReplyMode::Structured).encode_error(Errno::Inval, "bad", &mut out);
        let (h, n) = ReplyHeader::decode(&out, ReplyMode::Structured)
            .unwrap()
            .unwrap();
        assert_eq!(
            h,
            ReplyHeader::Chunk {
                flags: 1,
                kind: chunk::ERROR,
                cookie: 0xabcd,
                offset: 0,
                length: 9
            }
        );
        assert_eq!(&out[n..], &[0, 0, 0, 22, 0, 3, b'b', b'a', b'd']);
    }

    #[test]
    fn data_header_counts_offset_prefix() {
        let mut out = Vec::new();
        to(ReplyMode::Structured).encode_data_header(1024, 4096, true, &mut out);
        assert_eq!(out.len(), STRUCTURED_REPLY_BYTES + 8);
        let (h, _) = ReplyHeader::decode(&out, ReplyMode::Structured)
            .unwrap()
            .unwrap();
        assert!(matches!(
            h,
            ReplyHeader::Chunk {
                length: 4104,
                kind: chunk::OFFSET_DATA,
                ..
            }
        ));
        assert_eq!(&out[20..], &1024u64.to_be_bytes());
    }

    #[test]
    fn compact_block_status_clamps_long_extents() {
        let mut out = Vec::new();
        let extents = [Extent {
            length: 1 << 40,
            flags: 3,
        }];
        to(ReplyMode::Structured).encode_block_status(1, &extents, &mut out);
        assert_eq!(out.len(), 20 + 4 + 8);
        assert_eq!(&out[24..28], &(u32::MAX - 65535).to_be_bytes());
        out.clear();
        to(ReplyMode::Extended).encode_block_status(1, &extents, &mut out);
        assert_eq!(out.len(), 32 + 8 + 16);
        assert_eq!(&out[40..48], &(1u64 << 40).to_be_bytes());
    }

    #[test]
    fn nothing_follows_a_shortened_compact_extent() {
        // Data from 0x800 for 4 GiB - 2 KiB, then a hole: shortened, the data extent must end
        // the list, or the hole would be reported over data (a sparse copy would skip it).
        let hole = 3;
        let extents = [
            Extent {
                length: 0xFFFF_F800,
                flags: 0,
            },
            Extent {
                length: 0x800,
                flags: hole,
            },
        ];
        let mut out = Vec::new();
        to(ReplyMode::Structured).encode_block_status(1, &extents, &mut out);
        assert_eq!(out.len(), 20 + 4 + 8, "one extent");
        assert_eq!(&out[24..28], &(u32::MAX - 65535).to_be_bytes());
        assert_eq!(&out[28..32], &0u32.to_be_bytes(), "data");
        // Extents that fit are all kept.
        let short = [extents[1], extents[1], extents[1]];
        out.clear();
        to(ReplyMode::Structured).encode_block_status(1, &short, &mut out);
        assert_eq!(out.len(), 20 + 4 + 3 * 8);
    }

    #[test]
    fn simple_magic_is_refused_in_extended_mode() {
        let mut out = Vec::new();
        to(ReplyMode::Simple).encode_ok(&mut out);
        assert_eq!(
            ReplyHeader::decode(&out, ReplyMode::Extended),
            Err(ReplyError::BadMagic(SIMPLE_REPLY_MAGIC))
        );
    }
}
