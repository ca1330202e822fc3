//! A reply laid out for one vectored send: a list of pieces, each a header (in one small
//! buffer) optionally followed by a range of the data, so the engine can send the whole
//! reply in one vectored send with no copy of the data. The data is a pooled buffer, or (a
//! memory export's read, on the portable engine) the export's own pages.

use std::ops::Range;

use zcnbd_proto::{Errno, ReplyMode, ReplyTo, RequestHeader};

use crate::buffer_pool::PooledBuf;
use crate::export::Lease;
use crate::pipe::Pipe;
use crate::sys::mapped_io::OutPiece;
use crate::sys::mapping::MappedRange;

/// Where a reply's data is.
#[derive(Debug)]
pub enum ReplyData {
    /// A buffer the data was read into.
    Pooled(PooledBuf),
    /// The read's range of a memory export's mapping: the reply has one piece whose data is
    /// all of it (`Reply::mapped`). The lease keeps the range the read's until the reply is
    /// sent (dropped with it).
    Mapped(MappedRange, Lease),
    /// A pipe holding the read's data (an upstream's bytes spliced into it), then more pipes
    /// with the bytes each holds, where the first filled early, then the data's last bytes,
    /// which no pipe took (usually none: see `PipedRead`), for an engine that takes piped
    /// replies (the io_uring engine splices them on to the socket; [`Reply::into_piped`]):
    /// the reply has one piece.
    Piped(Pipe, Vec<(Pipe, usize)>, Vec<u8>),
}

/// A piped reply taken apart ([`Reply::into_piped`]).
#[derive(Debug)]
pub struct PipedData {
    /// The reply's header bytes.
    pub header: Vec<u8>,
    /// The first pipe, and the data bytes it holds.
    pub pipe: Pipe,
    pub len: usize,
    /// The pipes after it, each with the bytes it holds.
    pub more: Vec<(Pipe, usize)>,
    /// The data's last bytes, which no pipe took.
    pub tail: Vec<u8>,
}

/// One header, optionally followed by part of the data buffer.
#[derive(Debug, Clone)]
struct Piece {
    header: Range<usize>,
    data: Option<Range<usize>>,
}

/// A reply laid out for one vectored send.
#[derive(Debug)]
pub struct Reply {
    /// Every piece's header, back to back.
    pub(super) headers: Vec<u8>,
    pieces: Vec<Piece>,
    /// The data the pieces' data ranges point into.
    pub(super) data: Option<ReplyData>,
}

impl Reply {
    pub(super) fn new() -> Self {
        Reply {
            headers: Vec::with_capacity(64),
            pieces: Vec::with_capacity(2),
            data: None,
        }
    }

    /// Records what was appended to `headers` since `start` as one header piece.
    pub(super) fn push_header(&mut self, start: usize, data: Option<Range<usize>>) {
        let header = start..self.headers.len();
        self.pieces.push(Piece { header, data });
    }

    /// A reply that is a single header-only message built by `encode`.
    pub(super) fn single(encode: impl FnOnce(&mut Vec<u8>)) -> Self {
        let mut reply = Reply::new();
        encode(&mut reply.headers);
        reply.push_header(0, None);
        reply
    }

    /// The reply's bytes, in order, as pieces of the reply's own buffers and of the export's
    /// mapping, with no copy of the data.
    pub fn pieces(&self) -> impl Iterator<Item = OutPiece<'_>> + '_ {
        self.pieces.iter().flat_map(|piece| {
            let header = OutPiece::Bytes(&self.headers[piece.header.clone()]);
            let data = match (&piece.data, &self.data) {
                (Some(range), Some(ReplyData::Pooled(buf))) => {
                    Some(OutPiece::Bytes(&buf[range.clone()]))
                }
                (Some(_), Some(ReplyData::Mapped(map, _))) => Some(OutPiece::Mapped(map)),
                // Never sent this way: the engine that asked for it takes the pipe first.
                (Some(_), Some(ReplyData::Piped(..))) => None,
                _ => None,
            };
            std::iter::once(header).chain(data)
        })
    }

    /// How many pieces [`Reply::pieces`] gives.
    pub fn piece_count(&self) -> usize {
        let data = self.data.is_some();
        self.pieces
            .iter()
            .map(|p| 1 + usize::from(data && p.data.is_some()))
            .sum()
    }

    /// Total bytes on the wire.
    pub fn wire_bytes(&self) -> usize {
        self.pieces().map(|p| p.len()).sum()
    }

    /// The ranges of the data buffer the reply sends, in order.
    pub(super) fn data_ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.pieces.iter().filter_map(|p| p.data.clone())
    }

    /// Bytes of read data (not headers) this reply carries.
    pub fn data_bytes(&self) -> usize {
        self.pieces
            .iter()
            .filter_map(|p| p.data.as_ref())
            .map(|r| r.len())
            .sum()
    }

    /// A reply made of `headers` (one piece) followed by all of `data`.
    pub fn with_data(headers: Vec<u8>, data: PooledBuf) -> Self {
        let len = data.len();
        Reply::one_piece(headers, len, ReplyData::Pooled(data))
    }

    /// A reply made of `headers` (one piece) followed by all of `range`, sent from the
    /// export's mapping, held by `lease` until the reply is sent.
    pub fn mapped(headers: Vec<u8>, range: MappedRange, lease: Lease) -> Self {
        let len = range.len();
        Reply::one_piece(headers, len, ReplyData::Mapped(range, lease))
    }

    fn one_piece(headers: Vec<u8>, len: usize, data: ReplyData) -> Self {
        let pieces = vec![Piece {
            header: 0..headers.len(),
            data: Some(0..len),
        }];
        Reply {
            headers,
            pieces,
            data: Some(data),
        }
    }

    /// Whether the reply's data waits in a pipe ([`Reply::into_piped`]).
    pub fn is_piped(&self) -> bool {
        matches!(self.data, Some(ReplyData::Piped(..)))
    }

    /// A reply whose data waits in pipes: its header bytes, the pipe and how many of the
    /// data's bytes it holds, the pipes after it with theirs, and the data's last bytes that
    /// follow them (`None` for another reply).
    pub fn into_piped(self) -> Option<PipedData> {
        let len = self.data_bytes();
        match self.data {
            Some(ReplyData::Piped(pipe, more, tail)) => {
                let more_bytes: usize = more.iter().map(|(_, n)| n).sum();
                let in_pipe = len - tail.len() - more_bytes;
                Some(PipedData {
                    header: self.headers,
                    pipe,
                    len: in_pipe,
                    more,
                    tail,
                })
            }
            _ => None,
        }
    }

    /// A header-only reply.
    pub fn header_only(headers: Vec<u8>) -> Self {
        let pieces = vec![Piece {
            header: 0..headers.len(),
            data: None,
        }];
        Reply {
            headers,
            pieces,
            data: None,
        }
    }
}

/// Where a reply to `header` goes, on a connection that replies in `mode`.
pub fn reply_to(mode: ReplyMode, header: &RequestHeader) -> ReplyTo {
    ReplyTo {
        mode,
        cookie: header.cookie,
        offset: header.offset,
    }
}

/// A success reply to `header` that carries no data.
pub fn ok_reply(mode: ReplyMode, header: &RequestHeader) -> Reply {
    let to = reply_to(mode, header);
    Reply::single(|out| to.encode_ok(out))
}

/// An error reply to `header`.
pub fn error_reply(mode: ReplyMode, header: &RequestHeader, errno: Errno, message: &str) -> Reply {
    let to = reply_to(mode, header);
    Reply::single(|out| to.encode_error(errno, message, out))
}

/// The header of a read's reply whose data is `len` bytes in one piece (a simple reply's
/// header, or one data chunk's): what goes before data sent from the export itself.
pub fn data_header(mode: ReplyMode, header: &RequestHeader, len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(40);
    reply_to(mode, header).encode_data_header(header.offset, len as u64, true, &mut bytes);
    bytes
}
