//! The `reply` target: the client's `ReplyHeader::decode` on a stream of arbitrary reply
//! headers in every mode, and the server's reply encoders with parameters taken from the
//! input, decoded back.

use zcnbd_proto::consts::{chunk, reply_flags, EXTENDED_REPLY_MAGIC};
use zcnbd_proto::cursor::{PutBe, Reader};
use zcnbd_proto::reply::{ReplyError, ERROR_MESSAGE_BYTES_MAX};
use zcnbd_proto::{BlockSize, Errno, Extent, ReplyHeader, ReplyMode, ReplyTo};

use super::request::MODES;
use super::Bytes;

/// Every errno a reply may carry.
pub const ERRNOS: [Errno; 8] = [
    Errno::Perm,
    Errno::Io,
    Errno::NoMem,
    Errno::Inval,
    Errno::NoSpc,
    Errno::Overflow,
    Errno::NotSup,
    Errno::Shutdown,
];

/// Runs the target.
pub fn run(data: &[u8]) {
    for mode in MODES {
        decode_stream(data, mode);
    }
    round_trip(&mut Bytes::new(data));
}

/// Decodes headers as a client would, skipping each chunk's payload.
fn decode_stream(mut input: &[u8], mode: ReplyMode) {
    loop {
        let (header, size) = match ReplyHeader::decode(input, mode) {
            Ok(Some(decoded)) => decoded,
            Ok(None) => return assert!(input.len() < 32, "{} bytes, no header", input.len()),
            Err(ReplyError::BadMagic(magic)) => {
                return assert_eq!(input[..4], magic.to_be_bytes(), "reported magic");
            }
        };
        assert!(
            size <= input.len(),
            "header of {size} bytes from {}",
            input.len()
        );
        let mut wire = Vec::new();
        encode_header(&header, mode, &mut wire);
        assert_eq!(
            wire,
            input[..size],
            "{header:?} in {mode:?} does not round-trip"
        );
        input = &input[size..];
        if let ReplyHeader::Chunk { length, .. } = header {
            let skip = usize::try_from(length)
                .unwrap_or(usize::MAX)
                .min(input.len());
            input = &input[skip..];
        }
    }
}

/// The wire form of a decoded header (the protocol crate has encoders for replies, not for
/// arbitrary headers, which only a fuzzer or a broken server would send).
fn encode_header(header: &ReplyHeader, mode: ReplyMode, out: &mut Vec<u8>) {
    match *header {
        ReplyHeader::Simple { error, cookie } => {
            assert_ne!(mode, ReplyMode::Extended, "simple reply in extended mode");
            out.put_u32(zcnbd_proto::consts::SIMPLE_REPLY_MAGIC);
            out.put_u32(error);
            out.put_u64(cookie);
        }
        ReplyHeader::Chunk {
            flags,
            kind,
            cookie,
            offset,
            length,
        } => {
            let extended = mode == ReplyMode::Extended;
            assert!(
                extended || mode == ReplyMode::Structured,
                "chunk in simple mode"
            );
            out.put_u32(if extended {
                EXTENDED_REPLY_MAGIC
            } else {
                zcnbd_proto::consts::STRUCTURED_REPLY_MAGIC
            });
            out.put_u16(flags);
            out.put_u16(kind);
            out.put_u64(cookie);
            if extended {
                out.put_u64(offset);
                out.put_u64(length);
            } else {
                assert_eq!(offset, 0, "offset in a structured chunk");
                out.put_u32(u32::try_from(length).expect("32-bit length"));
            }
        }
    }
}

/// Encodes one reply with parameters from `p` and decodes it back.
fn round_trip(p: &mut Bytes<'_>) {
    let mode = MODES[usize::from(p.u8()) % MODES.len()];
    let to = ReplyTo {
        mode,
        cookie: p.u64(),
        offset: p.u64(),
    };
    let mut out = Vec::new();
    let expected = match p.u8() % 5 {
        0 => encode_ok(&to, &mut out),
        1 => encode_error(&to, p, &mut out),
        2 => encode_data(&to, p, &mut out),
        3 if mode != ReplyMode::Simple => encode_hole(&to, p, &mut out),
        4 if mode != ReplyMode::Simple => encode_block_status(&to, p, &mut out),
        _ => return,
    };
    let (header, size) = ReplyHeader::decode(&out, mode)
        .expect("own reply decodes")
        .expect("own reply is complete");
    assert_eq!(header, expected);
    if let ReplyHeader::Chunk { kind, length, .. } = header {
        // A data chunk's data follows on the wire but is never in `out`.
        let data = if kind == chunk::OFFSET_DATA {
            length - 8
        } else {
            0
        };
        assert_eq!(
            out.len() as u64 + data,
            size as u64 + length,
            "payload length field"
        );
    }
}

/// Size of a chunk header in `mode`.
fn header_bytes(mode: ReplyMode) -> usize {
    match mode {
        ReplyMode::Extended => zcnbd_proto::reply::EXTENDED_REPLY_BYTES,
        _ => zcnbd_proto::reply::STRUCTURED_REPLY_BYTES,
    }
}

/// The chunk header `to` should produce (offsets are echoed only in extended mode).
fn chunk_of(to: &ReplyTo, flags: u16, kind: u16, length: u64) -> ReplyHeader {
    let offset = if to.mode == ReplyMode::Extended {
        to.offset
    } else {
        0
    };
    ReplyHeader::Chunk {
        flags,
        kind,
        cookie: to.cookie,
        offset,
        length,
    }
}

fn encode_ok(to: &ReplyTo, out: &mut Vec<u8>) -> ReplyHeader {
    to.encode_ok(out);
    match to.mode {
        ReplyMode::Simple => ReplyHeader::Simple {
            error: 0,
            cookie: to.cookie,
        },
        _ => chunk_of(to, reply_flags::DONE, chunk::NONE, 0),
    }
}

fn encode_error(to: &ReplyTo, p: &mut Bytes<'_>, out: &mut Vec<u8>) -> ReplyHeader {
    let errno = ERRNOS[usize::from(p.u8()) % ERRNOS.len()];
    // Repeat the input so messages reach past the cut at ERROR_MESSAGE_BYTES_MAX.
    let repeat = usize::from(p.u8());
    let message = String::from_utf8_lossy(p.rest()).repeat(repeat);
    to.encode_error(errno, &message, out);
    if to.mode == ReplyMode::Simple {
        return ReplyHeader::Simple {
            error: errno.to_wire(),
            cookie: to.cookie,
        };
    }
    let header_bytes = header_bytes(to.mode);
    let mut r = Reader::new(&out[header_bytes..]);
    assert_eq!(r.u32(), Some(errno.to_wire()));
    let sent = usize::from(r.u16().expect("message length"));
    let text = r.rest();
    assert_eq!(text.len(), sent, "message length field");
    assert_eq!(text, &message.as_bytes()[..sent], "message is not a prefix");
    // "MUST be <= 4096 bytes" and "UTF-8 encoded": cut to the limit, between characters.
    assert!(sent <= ERROR_MESSAGE_BYTES_MAX, "message of {sent} bytes");
    assert!(
        sent + 3 >= message.len().min(ERROR_MESSAGE_BYTES_MAX),
        "cut too short"
    );
    assert!(
        std::str::from_utf8(text).is_ok(),
        "message cut inside a character"
    );
    chunk_of(to, reply_flags::DONE, chunk::ERROR, 6 + sent as u64)
}

fn encode_data(to: &ReplyTo, p: &mut Bytes<'_>, out: &mut Vec<u8>) -> ReplyHeader {
    let data_offset = p.u64();
    // Callers never send more than the payload limit in one chunk.
    let data_bytes = u64::from(p.u32() % (BlockSize::PAYLOAD_BYTES_MAX + 1));
    let done = p.u8() & 1 != 0;
    to.encode_data_header(data_offset, data_bytes, done, out);
    if to.mode == ReplyMode::Simple {
        return ReplyHeader::Simple {
            error: 0,
            cookie: to.cookie,
        };
    }
    assert_eq!(out[out.len() - 8..], data_offset.to_be_bytes());
    let flags = if done { reply_flags::DONE } else { 0 };
    chunk_of(to, flags, chunk::OFFSET_DATA, 8 + data_bytes)
}

fn encode_hole(to: &ReplyTo, p: &mut Bytes<'_>, out: &mut Vec<u8>) -> ReplyHeader {
    let (hole_offset, hole_bytes, done) = (p.u64(), p.u32(), p.u8() & 1 != 0);
    to.encode_hole(hole_offset, hole_bytes, done, out);
    let mut r = Reader::new(&out[out.len() - 12..]);
    assert_eq!((r.u64(), r.u32()), (Some(hole_offset), Some(hole_bytes)));
    let flags = if done { reply_flags::DONE } else { 0 };
    chunk_of(to, flags, chunk::OFFSET_HOLE, 12)
}

fn encode_block_status(to: &ReplyTo, p: &mut Bytes<'_>, out: &mut Vec<u8>) -> ReplyHeader {
    let id = p.u32();
    let count = usize::from(p.u8() % 16);
    let extents: Vec<Extent> = (0..count)
        .map(|_| Extent {
            // Lengths around the 32-bit limit as often as small ones.
            length: match p.u8() % 3 {
                0 => u64::from(u32::MAX) - u64::from(p.u32() % 0x20000),
                _ => p.u64(),
            },
            flags: p.u32(),
        })
        .collect();
    let start = out.len();
    to.encode_block_status(id, &extents, out);
    let sent = sent_extents(to.mode, &out[start..]);
    assert_faithful(&extents, &sent);
    let count = sent.len() as u64;
    match to.mode {
        ReplyMode::Extended => chunk_of(
            to,
            reply_flags::DONE,
            chunk::BLOCK_STATUS_EXT,
            8 + 16 * count,
        ),
        _ => chunk_of(to, reply_flags::DONE, chunk::BLOCK_STATUS, 4 + 8 * count),
    }
}

/// The extents a block status chunk (`wire`: header and payload) carries, decoded here
/// independently of the codec.
fn sent_extents(mode: ReplyMode, wire: &[u8]) -> Vec<(u64, u32)> {
    let (header, payload) = match mode {
        ReplyMode::Extended => (32 + 8, 16),
        _ => (20 + 4, 8),
    };
    wire[header..]
        .chunks(payload)
        .map(|e| match mode {
            ReplyMode::Extended => (
                u64::from_be_bytes(e[..8].try_into().unwrap()),
                u64::from_be_bytes(e[8..].try_into().unwrap()) as u32,
            ),
            _ => (
                u64::from(u32::from_be_bytes(e[..4].try_into().unwrap())),
                u32::from_be_bytes(e[4..].try_into().unwrap()),
            ),
        })
        .collect()
}

/// What was sent describes a prefix of what was asked, faithfully: every extent as asked
/// but the last, which may be shorter (never empty) and then ends the list - an extent after
/// a shortened one would start in the wrong place and mislabel the bytes there.
fn assert_faithful(asked: &[Extent], sent: &[(u64, u32)]) {
    assert!(sent.len() <= asked.len(), "more extents sent than asked");
    for (i, (&(length, flags), e)) in sent.iter().zip(asked).enumerate() {
        assert_eq!(flags, e.flags, "extent {i}'s flags");
        let last = i + 1 == sent.len();
        if length != e.length {
            assert!(
                last,
                "extent {i} shortened ({length} of {}) but not last",
                e.length
            );
            assert!(
                length > 0 && length < e.length,
                "extent {i} length {length}"
            );
        }
    }
    if sent.len() < asked.len() {
        let i = sent.len() - 1;
        assert!(
            sent[i].0 < asked[i].length,
            "extents dropped after a whole one"
        );
    }
}
