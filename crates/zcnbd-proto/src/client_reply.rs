//! What a client knows of one request in flight, and the checks each reply chunk must pass
//! against it (the spec's MUSTs for servers, seen from the client).

use crate::client_session::{decode_extents, Request};
use crate::consts::{chunk, cmd_flags};
use crate::cursor::Reader;
use crate::reply::ReplyError;
use crate::types::{Command, Extent, ReplyMode};

/// The wire value of `NBD_EIO`, reported for replies that end without what they owed.
const EIO: u32 = 5;

/// Something a reply said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyEvent {
    /// `bytes` bytes of read data for `cookie` come next, to go `at` bytes into its buffer.
    Data { cookie: u64, at: u64, bytes: u64 },
    /// `bytes` bytes at `at` into the request's buffer read as zeroes (the caller fills them).
    Hole { cookie: u64, at: u64, bytes: u64 },
    /// Block status for the request, in the context `context_id`.
    Extents {
        cookie: u64,
        context_id: u32,
        extents: Vec<Extent>,
    },
    /// The reply is complete and the cookie is free again.
    Done {
        cookie: u64,
        result: Result<(), ReplyFailure>,
    },
}

/// A request the server failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyFailure {
    /// The `NBD_E*` value (nonzero).
    pub errno: u32,
    /// The server's message, if it sent one (lossy UTF-8).
    pub message: String,
    /// Where the error happened, from an `ERROR_OFFSET` chunk.
    pub offset: Option<u64>,
}

/// A reply the client must not trust: the spec says to hang up ("initiate a hard disconnect").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// The header's magic does not fit the negotiated mode.
    #[error("bad reply header: {0}")]
    Header(ReplyError),
    /// The cookie names no request in flight.
    #[error("reply to unknown cookie {0:#x}")]
    UnknownCookie(u64),
    /// A simple reply to a read after structured replies were negotiated, or after chunks.
    #[error("simple reply where the spec forbids it (cookie {0:#x})")]
    SimpleReply(u64),
    /// A chunk type not valid for the request's command or the negotiated mode.
    #[error("unexpected chunk type {kind} for {command:?}")]
    UnexpectedChunk { kind: u16, command: Command },
    /// A chunk whose length or fields are inconsistent.
    #[error("malformed chunk type {kind} of length {length}")]
    BadChunk { kind: u16, length: u64 },
    /// A buffered chunk larger than `chunk_payload_bytes_max`.
    #[error("chunk type {kind} of {length} bytes exceeds the limit")]
    ChunkTooLarge { kind: u16, length: u64 },
    /// Data, a hole or an error offset outside the request.
    #[error("chunk range {offset}+{bytes} outside the request")]
    OutOfRange { offset: u64, bytes: u64 },
    /// Content chunks that overlap.
    #[error("chunk range {offset}+{bytes} overlaps an earlier chunk")]
    Overlap { offset: u64, bytes: u64 },
    /// An extended reply whose offset is not the request's.
    #[error("extended reply for cookie {cookie:#x} carries offset {got}")]
    OffsetMismatch { cookie: u64, got: u64 },
    /// More chunks in one reply than `chunks_per_reply_max`.
    #[error("more than {0} chunks in one reply")]
    TooManyChunks(u32),
    /// Block status for a context that was not negotiated, or twice for one.
    #[error("block status for context {0} not negotiated or repeated")]
    UnknownContext(u32),
}

/// One request waiting for its reply.
#[derive(Debug)]
pub(crate) struct InFlight {
    request: Request,
    chunks: u32,
    /// Sorted, disjoint `[start, end)` ranges (relative to the request) data and holes covered.
    covered: Vec<(u64, u64)>,
    covered_bytes: u64,
    /// Bit `n`: a block status chunk for the session's context `n` arrived.
    status_seen: u64,
    failure: Option<ReplyFailure>,
}

impl InFlight {
    pub(crate) fn new(request: Request) -> Self {
        InFlight {
            request,
            chunks: 0,
            covered: Vec::new(),
            covered_bytes: 0,
            status_seen: 0,
            failure: None,
        }
    }

    pub(crate) fn command(&self) -> Command {
        self.request.command
    }

    pub(crate) fn length(&self) -> u64 {
        self.request.length
    }

    pub(crate) fn offset(&self) -> u64 {
        self.request.offset
    }

    /// "If structured replies are negotiated, the server ... MUST NOT use a simple reply for
    /// NBD_CMD_READ"; nor may one reply mix chunks with a simple reply.
    pub(crate) fn check_simple(&self, mode: ReplyMode, cookie: u64) -> Result<(), Violation> {
        let read = self.request.command == Command::Read;
        if (read && mode != ReplyMode::Simple) || self.chunks > 0 {
            return Err(Violation::SimpleReply(cookie));
        }
        Ok(())
    }

    /// Records an error; the first one is what the caller sees.
    pub(crate) fn fail(&mut self, errno: u32, message: String, offset: Option<u64>) {
        self.failure.get_or_insert(ReplyFailure {
            errno,
            message,
            offset,
        });
    }

    pub(crate) fn note_chunk(&mut self, chunks_max: u32) -> Result<(), Violation> {
        self.chunks += 1;
        if self.chunks > chunks_max {
            return Err(Violation::TooManyChunks(chunks_max));
        }
        Ok(())
    }

    /// Marks `[at, at + bytes)` covered; false if it overlaps what was covered before.
    pub(crate) fn cover(&mut self, at: u64, bytes: u64) -> bool {
        let end = at + bytes;
        let i = self.covered.partition_point(|&(start, _)| start < at);
        let clear_before = i == 0 || self.covered[i - 1].1 <= at;
        let clear_after = i == self.covered.len() || self.covered[i].0 >= end;
        if !(clear_before && clear_after) {
            return false;
        }
        self.covered.insert(i, (at, end));
        self.covered_bytes += bytes;
        true
    }

    /// Checks a content chunk's absolute range and returns where it falls in the request.
    fn content_range(&mut self, kind: u16, offset: u64, bytes: u64) -> Result<u64, Violation> {
        if self.request.command != Command::Read {
            return Err(Violation::UnexpectedChunk {
                kind,
                command: self.request.command,
            });
        }
        // "The data MUST lie within the bounds of the original offset and length of the
        // client's request, and MUST NOT overlap with the bounds of any earlier content chunk".
        let at = self.relative(offset, bytes)?;
        if !self.cover(at, bytes) {
            return Err(Violation::Overlap { offset, bytes });
        }
        Ok(at)
    }

    fn relative(&self, offset: u64, bytes: u64) -> Result<u64, Violation> {
        let out = Violation::OutOfRange { offset, bytes };
        let at = offset.checked_sub(self.request.offset).ok_or(out.clone())?;
        let end = at.checked_add(bytes).ok_or(out.clone())?;
        if end > self.request.length {
            return Err(out);
        }
        Ok(at)
    }

    /// `OFFSET_DATA`: "length MUST be at least 9"; the prefix holds the absolute offset.
    pub(crate) fn data_chunk(
        &mut self,
        length: u64,
        prefix: &[u8],
    ) -> Result<(u64, u64), Violation> {
        let kind = chunk::OFFSET_DATA;
        let offset = Reader::new(prefix).u64();
        let (Some(offset), true) = (offset, length >= 9) else {
            return Err(Violation::BadChunk { kind, length });
        };
        let bytes = length - 8;
        Ok((self.content_range(kind, offset, bytes)?, bytes))
    }

    /// `OFFSET_HOLE`: "length MUST be exactly 12"; "hole size (unsigned, MUST be nonzero)".
    pub(crate) fn hole_chunk(
        &mut self,
        length: u64,
        prefix: &[u8],
    ) -> Result<(u64, u64), Violation> {
        let kind = chunk::OFFSET_HOLE;
        let mut r = Reader::new(prefix);
        let (Some(offset), Some(bytes)) = (r.u64(), r.u32()) else {
            return Err(Violation::BadChunk { kind, length });
        };
        if length != 12 || bytes == 0 {
            return Err(Violation::BadChunk { kind, length });
        }
        let bytes = u64::from(bytes);
        Ok((self.content_range(kind, offset, bytes)?, bytes))
    }

    /// Whether a chunk that is buffered whole (status, error) may answer this request.
    pub(crate) fn check_buffered_chunk(
        &self,
        kind: u16,
        mode: ReplyMode,
        length: u64,
    ) -> Result<(), Violation> {
        let status = self.request.command == Command::BlockStatus;
        let ok = match kind {
            _ if kind & chunk::ERROR_BIT != 0 => length >= 6,
            // "when extended headers are in use, the extended reply chunk MUST be used".
            chunk::BLOCK_STATUS => status && mode == ReplyMode::Structured,
            chunk::BLOCK_STATUS_EXT => status && mode == ReplyMode::Extended,
            _ => false,
        };
        if ok {
            return Ok(());
        }
        if kind & chunk::ERROR_BIT != 0 {
            return Err(Violation::BadChunk { kind, length });
        }
        Err(Violation::UnexpectedChunk {
            kind,
            command: self.request.command,
        })
    }

    /// An error chunk: "32 bits: error (MUST be nonzero); 16 bits: message length (no more
    /// than header length - 6)"; `ERROR_OFFSET` adds an offset within the request.
    pub(crate) fn error_chunk(&mut self, kind: u16, payload: &[u8]) -> Result<(), Violation> {
        let length = payload.len() as u64;
        let bad = Violation::BadChunk { kind, length };
        let mut r = Reader::new(payload);
        let errno = r.u32().ok_or(bad.clone())?;
        let message_bytes = usize::from(r.u16().ok_or(bad.clone())?);
        let message = r.take(message_bytes).ok_or(bad.clone())?;
        let message = String::from_utf8_lossy(message).into_owned();
        let offset = if kind == chunk::ERROR_OFFSET {
            let offset = r.u64().ok_or(bad.clone())?;
            self.relative(offset, 0)?;
            Some(offset)
        } else {
            None
        };
        if errno == 0 {
            return Err(bad);
        }
        self.fail(errno, message, offset);
        Ok(())
    }

    /// A block status chunk, checked against the request and the negotiated contexts
    /// (`contexts`: their ids, at most 64).
    pub(crate) fn status_chunk(
        &mut self,
        kind: u16,
        mode: ReplyMode,
        contexts: &[u32],
        payload: &[u8],
    ) -> Result<(u32, Vec<Extent>), Violation> {
        let length = payload.len() as u64;
        let bad = Violation::BadChunk { kind, length };
        let extended = mode == ReplyMode::Extended;
        let mut r = Reader::new(payload);
        let context_id = r.u32().ok_or(bad.clone())?;
        if extended {
            // "descriptor count ... such that the header length is equal to descriptor count
            // * 16 + 8".
            let count = r.u32().ok_or(bad.clone())? as usize;
            if count.checked_mul(16) != Some(r.remaining()) {
                return Err(bad);
            }
        }
        // "length MUST be 4 + (a positive integer multiple of 8)".
        let size = if extended { 16 } else { 8 };
        if r.remaining() == 0 || !r.remaining().is_multiple_of(size) {
            return Err(bad);
        }
        // A context the handshake did not select, or "exactly one status chunk per negotiated
        // metadata context ID" broken.
        let bit = contexts
            .iter()
            .position(|&id| id == context_id)
            .and_then(|n| 1u64.checked_shl(n as u32))
            .filter(|bit| self.status_seen & bit == 0)
            .ok_or(Violation::UnknownContext(context_id))?;
        self.status_seen |= bit;
        let extents = decode_extents(&mut r, extended).ok_or(bad.clone())?;
        self.check_extents(&extents).then_some(()).ok_or(bad)?;
        Ok((context_id, extents))
    }

    /// "If the client used NBD_CMD_FLAG_REQ_ONE ... every reply chunk MUST contain exactly one
    /// descriptor, and that descriptor MUST NOT exceed the length of the original request. If
    /// the client did not use the flag ... the sum of the length fields within the first N-1
    /// extents (if any) MUST be less than the requested length"; lengths "MUST be nonzero".
    fn check_extents(&self, extents: &[Extent]) -> bool {
        if extents.iter().any(|e| e.length == 0) {
            return false;
        }
        let Some((last, first)) = extents.split_last() else {
            return false;
        };
        if self.request.flags & cmd_flags::REQ_ONE != 0 {
            return first.is_empty() && last.length <= self.request.length;
        }
        let mut sum: u64 = 0;
        for e in first {
            sum = sum.saturating_add(e.length);
        }
        first.is_empty() || sum < self.request.length
    }

    /// The request's outcome once its last chunk is in; `contexts`: how many the session
    /// selected (a successful block status owes a chunk to each).
    pub(crate) fn result(&self, contexts: usize) -> Result<(), ReplyFailure> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        let short = match self.request.command {
            Command::Read if self.covered_bytes != self.request.length => Some(format!(
                "server sent {} of {} bytes of a read",
                self.covered_bytes, self.request.length
            )),
            Command::BlockStatus if self.status_seen == 0 => {
                Some("server sent no block status".to_string())
            }
            Command::BlockStatus if (self.status_seen.count_ones() as usize) < contexts => {
                Some(format!(
                    "server sent block status for {} of {contexts} metadata contexts",
                    self.status_seen.count_ones()
                ))
            }
            _ => None,
        };
        match short {
            Some(message) => Err(ReplyFailure {
                errno: EIO,
                message,
                offset: None,
            }),
            None => Ok(()),
        }
    }
}
