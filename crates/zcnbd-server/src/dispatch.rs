//! Runs one validated request against an export and lays out its reply. Engine-independent:
//! an engine only moves bytes in and out; what a request does and what its reply looks like
//! is decided here.
//!
//! A reply is a list of pieces, each a header (in one small buffer) optionally followed by a
//! range of the data buffer, so the engine can send the whole reply in one vectored send with
//! no copy of the data.

use std::io::IoSlice;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use tracing::error;

use zcnbd_proto::consts::{cmd_flags, state};
use zcnbd_proto::{Command, Errno, Extent, ReplyMode, ReplyTo, RequestHeader, TransmissionContext};

use crate::buffer_pool::{BufferPool, PooledBuf};
use crate::export::{errno_of, Backend, ZeroError, ZeroFlags};
use crate::stats::{ReadPath, Stats, WritePath};

/// Most extents one block status reply describes (the spec allows far more; clients ask again
/// from where the reply ended).
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 1024;
/// Most content chunks one read reply is split into; past that the rest is sent as data.
pub const READ_CHUNKS_MAX: usize = 64;

/// A request ready to run: validated, with its payload (writes) received.
#[derive(Debug)]
pub struct Request {
    pub header: RequestHeader,
    pub command: Command,
    pub payload: Option<PooledBuf>,
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
    headers: Vec<u8>,
    pieces: Vec<Piece>,
    data: Option<PooledBuf>,
}

impl Reply {
    fn new() -> Self {
        Reply {
            headers: Vec::with_capacity(64),
            pieces: Vec::with_capacity(2),
            data: None,
        }
    }

    /// Records what was appended to `headers` since `start` as one header piece.
    fn push_header(&mut self, start: usize, data: Option<Range<usize>>) {
        let header = start..self.headers.len();
        self.pieces.push(Piece { header, data });
    }

    /// A reply that is a single header-only message built by `encode`.
    fn single(encode: impl FnOnce(&mut Vec<u8>)) -> Self {
        let mut reply = Reply::new();
        encode(&mut reply.headers);
        reply.push_header(0, None);
        reply
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

/// Runs requests for one connection's export.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub backend: Arc<dyn Backend>,
    pub ctx: TransmissionContext,
    pub pool: Arc<BufferPool>,
    pub stats: Arc<Stats>,
}

/// What a caught panic said, for the log.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "no message"
    }
}

/// A failed request: the errno and a message for the error chunk.
type Failure = (Errno, String);

fn io_failure(what: &str, e: &std::io::Error) -> Failure {
    (errno_of(e), format!("{what}: {e}"))
}

impl Dispatcher {
    /// Runs `req` and returns its reply; a panic in the backend becomes an `EIO` reply for
    /// this request (logged), so the connection's accounting is released as for any reply
    /// and the server goes on serving.
    pub fn execute_guarded(&self, req: Request) -> Reply {
        let header = req.header;
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.execute(req))) {
            Ok(reply) => reply,
            Err(panic) => {
                let what = panic_message(panic.as_ref());
                error!(
                    cookie = header.cookie,
                    "backend panicked ({what}): answering EIO"
                );
                error_reply(self.ctx.mode, &header, Errno::Io, "internal server error")
            }
        }
    }

    /// Runs `req` and returns its reply.
    pub fn execute(&self, req: Request) -> Reply {
        let h = req.header;
        let to = ReplyTo {
            mode: self.ctx.mode,
            cookie: h.cookie,
            offset: h.offset,
        };
        let result = match req.command {
            Command::Read => self.read(&to, &h),
            Command::Write => self.write(&h, req.payload),
            Command::BlockStatus => self.block_status(&to, &h),
            command => self.no_data(command, &h),
        };
        match result {
            Ok(reply) => reply,
            Err((errno, message)) => Reply::single(|out| to.encode_error(errno, &message, out)),
        }
    }

    fn ok(&self, h: &RequestHeader) -> Reply {
        let to = ReplyTo {
            mode: self.ctx.mode,
            cookie: h.cookie,
            offset: h.offset,
        };
        Reply::single(|out| to.encode_ok(out))
    }

    fn write(&self, h: &RequestHeader, payload: Option<PooledBuf>) -> Result<Reply, Failure> {
        let fua = h.flags & cmd_flags::FUA != 0;
        if let Some(data) = payload.as_deref().filter(|d| !d.is_empty()) {
            self.backend
                .pwrite(data, h.offset, fua)
                .map_err(|e| io_failure("write", &e))?;
            // pwrite from our buffer into the page cache is a copy beyond the socket's.
            self.stats.write_done(WritePath::Copied, data.len());
        }
        Ok(self.ok(h))
    }

    fn no_data(&self, command: Command, h: &RequestHeader) -> Result<Reply, Failure> {
        let fua = h.flags & cmd_flags::FUA != 0;
        let (offset, len) = (h.offset, h.length);
        let b = &self.backend;
        match command {
            Command::Flush => b.flush().map_err(|e| io_failure("flush", &e))?,
            Command::Trim if len > 0 => b
                .trim(offset, len, fua)
                .map_err(|e| io_failure("trim", &e))?,
            Command::Cache if len > 0 => {
                b.cache(offset, len).map_err(|e| io_failure("cache", &e))?
            }
            Command::WriteZeroes if len > 0 => {
                let flags = ZeroFlags {
                    may_trim: h.flags & cmd_flags::NO_HOLE == 0,
                    fast: h.flags & cmd_flags::FAST_ZERO != 0,
                    fua,
                };
                b.zero(offset, len, flags).map_err(|e| match e {
                    ZeroError::NotFast => (Errno::NotSup, "zeroing would not be fast".to_owned()),
                    ZeroError::Io(e) => io_failure("write zeroes", &e),
                })?;
            }
            _ => {}
        }
        Ok(self.ok(h))
    }

    fn block_status(&self, to: &ReplyTo, h: &RequestHeader) -> Result<Reply, Failure> {
        // A status chunk must hold at least one extent of nonzero length, which a zero-length
        // query cannot give.
        if h.length == 0 {
            return Err((Errno::Inval, "zero-length block status".to_owned()));
        }
        let max = if h.flags & cmd_flags::REQ_ONE != 0 {
            1
        } else {
            BLOCK_STATUS_EXTENTS_MAX
        };
        let mut extents = Vec::new();
        self.backend
            .extents(h.offset, h.length, max, &mut extents)
            .map_err(|e| io_failure("block status", &e))?;
        if extents.is_empty() {
            extents.push(Extent {
                length: h.length,
                flags: 0,
            });
        }
        let id = self.ctx.base_allocation.unwrap_or(0);
        Ok(Reply::single(|out| {
            to.encode_block_status(id, &extents, out)
        }))
    }

    fn read(&self, to: &ReplyTo, h: &RequestHeader) -> Result<Reply, Failure> {
        // Validation bounded the length by the 32 MiB payload limit.
        let len = h.length as usize;
        let mut reply = Reply::new();
        if len == 0 {
            to.encode_ok(&mut reply.headers);
            reply.push_header(0, None);
            return Ok(reply);
        }
        let mut data = self.pool.get(len);
        let one_chunk = self.ctx.mode == ReplyMode::Simple || h.flags & cmd_flags::DF != 0;
        let extents = if one_chunk {
            Vec::new()
        } else {
            self.read_extents(h)
        };
        let path = if extents.iter().all(|e| e.flags & state::ZERO == 0) {
            // All data (the common case for written ranges): one read, one content chunk.
            self.backend
                .pread(&mut data, h.offset)
                .map_err(|e| io_failure("read", &e))?;
            to.encode_data_header(h.offset, len as u64, true, &mut reply.headers);
            reply.push_header(0, Some(0..len));
            ReadPath::Copied
        } else {
            self.read_sparse(to, h, &extents, &mut data, &mut reply)?;
            ReadPath::Sparse
        };
        reply.data = Some(data);
        self.stats.read_done(path, len);
        Ok(reply)
    }

    /// Extents of a read's range, covering it entirely (the tail past the cap is data).
    fn read_extents(&self, h: &RequestHeader) -> Vec<Extent> {
        let mut extents = Vec::new();
        if self
            .backend
            .extents(h.offset, h.length, READ_CHUNKS_MAX, &mut extents)
            .is_err()
        {
            extents.clear();
        }
        let covered: u64 = extents.iter().map(|e| e.length).sum();
        if covered < h.length {
            extents.push(Extent {
                length: h.length - covered,
                flags: 0,
            });
        }
        extents
    }

    fn read_sparse(
        &self,
        to: &ReplyTo,
        h: &RequestHeader,
        extents: &[Extent],
        data: &mut PooledBuf,
        reply: &mut Reply,
    ) -> Result<(), Failure> {
        let mut rel = 0usize;
        for (i, e) in extents.iter().enumerate() {
            let done = i + 1 == extents.len();
            let pos = h.offset + rel as u64;
            let n = e.length as usize;
            let start = reply.headers.len();
            if e.flags & state::ZERO != 0 {
                to.encode_hole(pos, n as u32, done, &mut reply.headers);
                reply.push_header(start, None);
            } else {
                let range = rel..rel + n;
                self.backend
                    .pread(&mut data[range.clone()], pos)
                    .map_err(|e| io_failure("read", &e))?;
                self.stats.copied(n);
                to.encode_data_header(pos, n as u64, done, &mut reply.headers);
                reply.push_header(start, Some(range));
            }
            rel += n;
        }
        Ok(())
    }
}
