//! A reply laid out for one vectored send: a list of pieces, each a header (in one small
//! buffer) optionally followed by a range of the data buffer, so the engine can send the
//! whole reply in one vectored send with no copy of the data.

use std::io::IoSlice;
use std::ops::Range;

use zcnbd_proto::{Errno, ReplyMode, ReplyTo, RequestHeader};

use crate::buffer_pool::PooledBuf;

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
    /// The data buffer the pieces' data ranges point into.
    pub(super) data: Option<PooledBuf>,
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

    /// The reply's bytes, in order, as slices of the reply's own buffers (what
    /// [`Reply::io_slices`] points at).
    pub fn wire_slices(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.pieces.iter().flat_map(|piece| {
            let header = &self.headers[piece.header.clone()];
            let data = match (&piece.data, &self.data) {
                (Some(range), Some(data)) => Some(&data[range.clone()]),
                _ => None,
            };
            std::iter::once(header).chain(data)
        })
    }

    /// The reply's bytes, in order, without copying the data.
    pub fn io_slices(&self) -> Vec<IoSlice<'_>> {
        let mut slices = Vec::with_capacity(self.pieces.len() * 2);
        for piece in &self.pieces {
            slices.push(IoSlice::new(&self.headers[piece.header.clone()]));
            if let (Some(range), Some(data)) = (&piece.data, &self.data) {
                slices.push(IoSlice::new(&data[range.clone()]));
            }
        }
        slices
    }

    /// How many iovecs [`Reply::io_slices`] returns.
    pub fn slice_count(&self) -> usize {
        let data = self.data.is_some();
        self.pieces
            .iter()
            .map(|p| 1 + usize::from(data && p.data.is_some()))
            .sum()
    }

    /// Total bytes on the wire.
    pub fn wire_bytes(&self) -> usize {
        self.io_slices().iter().map(|s| s.len()).sum()
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

/// An error reply to `header`.
pub fn error_reply(mode: ReplyMode, header: &RequestHeader, errno: Errno, message: &str) -> Reply {
    let to = ReplyTo {
        mode,
        cookie: header.cookie,
        offset: header.offset,
    };
    Reply::single(|out| to.encode_error(errno, message, out))
}
