//! The client side of the transmission phase, as a sans-IO state machine.
//!
//! [`ClientSession`] names each request with a cookie, encodes its header, and checks every
//! reply against the request it answers, as the spec demands of a client ("If the client
//! receives an unknown or unexpected type, other than an error chunk, it MUST initiate a hard
//! disconnect"). A [`Violation`] means exactly that: the caller hangs up.
//!
//! Read data is never copied here. The session tells the I/O layer how many bytes to read next
//! ([`ClientSession::want`]), never more than the current header or chunk prefix, so nothing
//! of a payload is ever read into a staging buffer. When data follows, `want` says whose it is
//! and where it belongs in that request's buffer ([`Want::Payload`]); the I/O layer receives it
//! straight there and reports with [`ClientSession::payload_received`].

use crate::consts::{
    chunk, cmd_flags, reply_flags, EXTENDED_REPLY_MAGIC, SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};
use crate::cursor::Reader;
use crate::reply::{ReplyHeader, EXTENDED_REPLY_BYTES, SIMPLE_REPLY_BYTES, STRUCTURED_REPLY_BYTES};
use crate::request::RequestHeader;
use crate::types::{Command, Extent, ReplyMode};

use crate::client_meta::META_CONTEXTS_SELECTED_MAX;
use crate::client_reply::InFlight;
pub use crate::client_reply::{ReplyEvent, ReplyFailure, Violation};

/// Bytes of the header buffer: the longest header plus the longest chunk prefix.
const HEADER_BUFFER_BYTES: usize = EXTENDED_REPLY_BYTES + 12;

/// Limits on what one server may make the client hold.
#[derive(Debug, Clone, Copy)]
pub struct SessionLimits {
    /// Most requests in flight on one connection.
    pub requests_in_flight_max: u32,
    /// Largest payload of a chunk that is buffered here (block status, error).
    pub chunk_payload_bytes_max: u32,
    /// Most content chunks tracked for one read (to check they do not overlap).
    pub chunks_per_reply_max: u32,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            requests_in_flight_max: 1024,
            // 2^20 extended descriptors, the most the spec lets a server send, plus headers.
            chunk_payload_bytes_max: 16 * 1024 * 1024 + 64,
            chunks_per_reply_max: 64 * 1024,
        }
    }
}

/// One request to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The command.
    pub command: Command,
    /// Command flags (`cmd_flags::*`); `PAYLOAD_LEN` is added for writes in extended mode.
    pub flags: u16,
    /// Offset into the export.
    pub offset: u64,
    /// Length: the payload of a write, the effect length of anything else.
    pub length: u64,
}

/// Why a request cannot be started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// `requests_in_flight_max` requests already wait for replies.
    #[error("{0} requests already in flight")]
    Full(u32),
    /// Without extended headers a length must fit in 32 bits.
    #[error("length {0} does not fit a compact request")]
    LengthTooLarge(u64),
}

/// What the I/O layer should read next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Up to this many bytes, fed to [`ClientSession::handle_input`]; never past a header.
    Header(usize),
    /// `bytes` bytes of read data for `cookie`, belonging `at` bytes into its buffer.
    Payload { cookie: u64, at: u64, bytes: u64 },
}

/// Where the reply decoder is.
#[derive(Debug)]
enum Rx {
    /// Collecting a header (and the fixed prefix of a data or hole chunk) in `header`.
    Header,
    /// Collecting `need` more bytes of a chunk payload into `fixed`.
    Chunk {
        kind: u16,
        done: bool,
        cookie: u64,
        need: usize,
    },
    /// `remaining` bytes of read data flow to the caller's buffer at `at`.
    Payload {
        cookie: u64,
        at: u64,
        remaining: u64,
        done: bool,
    },
}

/// The client's view of one connection in the transmission phase.
#[derive(Debug)]
pub struct ClientSession {
    mode: ReplyMode,
    /// The ids of the metadata contexts selected, at most [`META_CONTEXTS_SELECTED_MAX`]: a
    /// block status reply owes one chunk to each.
    contexts: Vec<u32>,
    limits: SessionLimits,
    slots: Vec<Option<InFlight>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    rx: Rx,
    header: [u8; HEADER_BUFFER_BYTES],
    header_have: usize,
    fixed: Vec<u8>,
}

impl ClientSession {
    /// A session in `mode`, with `base:allocation` under `base_allocation_id` if negotiated
    /// (and no other context: see [`ClientSession::with_context_ids`]).
    pub fn new(mode: ReplyMode, base_allocation_id: Option<u32>, limits: SessionLimits) -> Self {
        let count = limits.requests_in_flight_max.max(1);
        ClientSession {
            mode,
            contexts: base_allocation_id.into_iter().collect(),
            limits,
            slots: Vec::new(),
            generations: Vec::new(),
            free: (0..count).rev().collect(),
            rx: Rx::Header,
            header: [0; HEADER_BUFFER_BYTES],
            header_have: 0,
            fixed: Vec::new(),
        }
    }

    /// The session with `ids` as the selected metadata contexts instead (those of
    /// [`ClientNegotiated::meta_contexts`](crate::ClientNegotiated::meta_contexts)): block
    /// status chunks must carry one of them, each at most once per reply, and a successful
    /// reply must carry all ("A successful block status request MUST have exactly one status
    /// chunk per negotiated metadata context ID"). Repeated ids count once; ids past the
    /// first [`META_CONTEXTS_SELECTED_MAX`] are dropped (a handshake never selects more).
    pub fn with_context_ids(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.contexts.clear();
        for id in ids {
            if self.contexts.len() == META_CONTEXTS_SELECTED_MAX {
                break;
            }
            if !self.contexts.contains(&id) {
                self.contexts.push(id);
            }
        }
        self
    }

    /// The ids of the selected metadata contexts.
    pub fn context_ids(&self) -> &[u32] {
        &self.contexts
    }

    /// The framing in use.
    pub fn mode(&self) -> ReplyMode {
        self.mode
    }

    /// Requests waiting for (the end of) their reply.
    pub fn in_flight(&self) -> usize {
        self.limits.requests_in_flight_max.max(1) as usize - self.free.len()
    }

    /// How many more requests may start now.
    pub fn room(&self) -> usize {
        self.free.len()
    }

    /// Whether the decoder is between replies (no partial header or payload pending).
    pub fn is_idle(&self) -> bool {
        matches!(self.rx, Rx::Header) && self.header_have == 0
    }

    /// Starts `request`: appends its header to `out` (a write's payload must follow it on the
    /// wire) and returns its cookie.
    pub fn start(&mut self, request: Request, out: &mut Vec<u8>) -> Result<u64, SessionError> {
        if self.mode != ReplyMode::Extended && request.length > u64::from(u32::MAX) {
            return Err(SessionError::LengthTooLarge(request.length));
        }
        let Some(index) = self.free.pop() else {
            return Err(SessionError::Full(self.limits.requests_in_flight_max));
        };
        let i = index as usize;
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
            self.generations.resize(i + 1, 0);
        }
        self.generations[i] = self.generations[i].wrapping_add(1);
        let cookie = u64::from(self.generations[i]) << 32 | u64::from(index);
        self.slots[i] = Some(InFlight::new(request));
        let mut flags = request.flags;
        // "The command NBD_CMD_WRITE MUST use the flag NBD_CMD_FLAG_PAYLOAD_LEN in this mode".
        if self.mode == ReplyMode::Extended && request.command == Command::Write {
            flags |= cmd_flags::PAYLOAD_LEN;
        }
        RequestHeader {
            flags,
            kind: request.command.to_wire(),
            cookie,
            offset: request.offset,
            length: request.length,
        }
        .encode(self.mode, out);
        Ok(cookie)
    }

    /// Forgets a request whose header was never sent (the caller could not send it).
    pub fn abandon(&mut self, cookie: u64) {
        if self.slot_mut(cookie).is_some() {
            self.release(cookie);
        }
    }

    /// What to read next.
    pub fn want(&self) -> Want {
        match self.rx {
            Rx::Header => Want::Header(self.header_need().saturating_sub(self.header_have)),
            Rx::Chunk { need, .. } => Want::Header(need.saturating_sub(self.fixed.len())),
            Rx::Payload {
                cookie,
                at,
                remaining,
                ..
            } => Want::Payload {
                cookie,
                at,
                bytes: remaining,
            },
        }
    }

    /// How many bytes the I/O layer may read for the next header without ever reading into
    /// read data: more than [`ClientSession::want`] asks while the message type is unknown,
    /// since every message is at least as long as the shortest header and a data chunk's
    /// header and offset prefix is exactly this long. Extra bytes are the next message's
    /// header or a buffered chunk's payload, so feeding them all to `handle_input` in turn
    /// is always right. One receive per data chunk header instead of two.
    pub fn header_read_hint(&self) -> usize {
        let Want::Header(exact) = self.want() else {
            return 0;
        };
        if !matches!(self.rx, Rx::Header) || self.header_have >= 8 {
            return exact;
        }
        let data_header = match self.mode {
            // A simple reply to a read is followed by its data: never read past it.
            ReplyMode::Simple => SIMPLE_REPLY_BYTES,
            ReplyMode::Structured => STRUCTURED_REPLY_BYTES + 8,
            ReplyMode::Extended => EXTENDED_REPLY_BYTES + 8,
        };
        data_header.saturating_sub(self.header_have).max(exact)
    }

    /// Feeds bytes of a header or buffered chunk (never payload: see [`Want`]). Returns how
    /// many were used and, when a message is complete, what it said.
    pub fn handle_input(&mut self, input: &[u8]) -> Result<(usize, Option<ReplyEvent>), Violation> {
        match self.want() {
            Want::Header(need) => {
                let used = need.min(input.len());
                match self.rx {
                    Rx::Header => {
                        let have = self.header_have;
                        self.header[have..have + used].copy_from_slice(&input[..used]);
                        self.header_have += used;
                        if self.header_have >= self.header_need() {
                            return Ok((used, self.on_header()?));
                        }
                    }
                    Rx::Chunk { need, .. } => {
                        self.fixed.extend_from_slice(&input[..used]);
                        if self.fixed.len() >= need {
                            return Ok((used, self.on_chunk_payload()?));
                        }
                    }
                    Rx::Payload { .. } => {}
                }
                Ok((used, None))
            }
            Want::Payload { .. } => Ok((0, None)),
        }
    }

    /// Reports `bytes` of payload received into the caller's buffer; the reply's end when it
    /// was the last of a final chunk.
    pub fn payload_received(&mut self, bytes: u64) -> Option<ReplyEvent> {
        let Rx::Payload {
            cookie,
            at,
            remaining,
            done,
        } = self.rx
        else {
            return None;
        };
        let bytes = bytes.min(remaining);
        if bytes < remaining {
            self.rx = Rx::Payload {
                cookie,
                at: at + bytes,
                remaining: remaining - bytes,
                done,
            };
            return None;
        }
        self.rx = Rx::Header;
        done.then(|| self.finish(cookie))
    }

    /// Ends every request in flight (the connection is gone): their cookies, in no order.
    pub fn drain(&mut self) -> Vec<u64> {
        let mut cookies = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if slot.take().is_some() {
                cookies.push(u64::from(self.generations[i]) << 32 | i as u64);
                self.free.push(i as u32);
            }
        }
        cookies
    }

    /// Total header bytes (with a data or hole chunk's prefix) the current message needs.
    fn header_need(&self) -> usize {
        let minimum = match self.mode {
            ReplyMode::Extended => EXTENDED_REPLY_BYTES,
            _ => SIMPLE_REPLY_BYTES,
        };
        if self.header_have < 8 {
            return minimum;
        }
        let mut r = Reader::new(&self.header);
        let magic = r.u32().unwrap_or(0);
        let _flags = r.u16();
        let kind = r.u16().unwrap_or(0);
        let base = match magic {
            SIMPLE_REPLY_MAGIC if self.mode != ReplyMode::Extended => return SIMPLE_REPLY_BYTES,
            STRUCTURED_REPLY_MAGIC if self.mode == ReplyMode::Structured => STRUCTURED_REPLY_BYTES,
            EXTENDED_REPLY_MAGIC if self.mode == ReplyMode::Extended => EXTENDED_REPLY_BYTES,
            // A bad magic is reported by the decoder once `minimum` bytes are in.
            _ => return minimum,
        };
        base + match kind {
            chunk::OFFSET_DATA => 8,
            chunk::OFFSET_HOLE => 12,
            _ => 0,
        }
    }

    /// A whole header (and prefix) is in `header`.
    fn on_header(&mut self) -> Result<Option<ReplyEvent>, Violation> {
        let have = self.header_have;
        let decoded = ReplyHeader::decode(&self.header[..have], self.mode);
        let (header, size) = match decoded {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(None),
            Err(e) => return Err(Violation::Header(e)),
        };
        if size > have {
            return Ok(None);
        }
        let mut prefix = [0u8; 12];
        let prefix_bytes = (have - size).min(prefix.len());
        prefix[..prefix_bytes].copy_from_slice(&self.header[size..size + prefix_bytes]);
        let prefix = &prefix[..prefix_bytes];
        self.header_have = 0;
        match header {
            ReplyHeader::Simple { error, cookie } => self.on_simple(cookie, error),
            ReplyHeader::Chunk {
                flags,
                kind,
                cookie,
                offset,
                length,
            } => {
                let done = flags & reply_flags::DONE != 0;
                self.on_chunk(kind, done, cookie, offset, length, prefix)
            }
        }
    }

    fn on_simple(&mut self, cookie: u64, error: u32) -> Result<Option<ReplyEvent>, Violation> {
        let mode = self.mode;
        let request = self
            .slot_mut(cookie)
            .ok_or(Violation::UnknownCookie(cookie))?;
        request.check_simple(mode, cookie)?;
        if error != 0 {
            request.fail(error, String::new(), None);
            return Ok(Some(self.finish(cookie)));
        }
        if request.command() != Command::Read || request.length() == 0 {
            return Ok(Some(self.finish(cookie)));
        }
        let length = request.length();
        request.cover(0, length);
        self.rx = Rx::Payload {
            cookie,
            at: 0,
            remaining: length,
            done: true,
        };
        Ok(Some(ReplyEvent::Data {
            cookie,
            at: 0,
            bytes: length,
        }))
    }

    fn on_chunk(
        &mut self,
        kind: u16,
        done: bool,
        cookie: u64,
        header_offset: u64,
        length: u64,
        prefix: &[u8],
    ) -> Result<Option<ReplyEvent>, Violation> {
        let mode = self.mode;
        let chunks_max = self.limits.chunks_per_reply_max;
        let request = self
            .slot_mut(cookie)
            .ok_or(Violation::UnknownCookie(cookie))?;
        // "The extended reply has an additional field offset which MUST match the offset of
        // the client's request".
        if mode == ReplyMode::Extended && header_offset != request.offset() {
            return Err(Violation::OffsetMismatch {
                cookie,
                got: header_offset,
            });
        }
        request.note_chunk(chunks_max)?;
        match kind {
            chunk::NONE => {
                // "length MUST be 0 ... This chunk type MUST always be used with the
                // NBD_REPLY_FLAG_DONE bit set".
                if length != 0 || !done {
                    return Err(Violation::BadChunk { kind, length });
                }
                Ok(Some(self.finish(cookie)))
            }
            chunk::OFFSET_DATA => {
                let (at, bytes) = request.data_chunk(length, prefix)?;
                self.rx = Rx::Payload {
                    cookie,
                    at,
                    remaining: bytes,
                    done,
                };
                Ok(Some(ReplyEvent::Data { cookie, at, bytes }))
            }
            chunk::OFFSET_HOLE => {
                let (at, bytes) = request.hole_chunk(length, prefix)?;
                if done {
                    // The caller zero-fills on this event; the reply ends with it.
                    self.rx = Rx::Payload {
                        cookie,
                        at,
                        remaining: 0,
                        done,
                    };
                }
                Ok(Some(ReplyEvent::Hole { cookie, at, bytes }))
            }
            _ => {
                request.check_buffered_chunk(kind, mode, length)?;
                self.start_buffered_chunk(kind, done, cookie, length)
            }
        }
    }

    /// A block status or error chunk: its payload is collected in `fixed` (bounded by
    /// `chunk_payload_bytes_max`) before it is checked.
    fn start_buffered_chunk(
        &mut self,
        kind: u16,
        done: bool,
        cookie: u64,
        length: u64,
    ) -> Result<Option<ReplyEvent>, Violation> {
        if length > u64::from(self.limits.chunk_payload_bytes_max) {
            return Err(Violation::ChunkTooLarge { kind, length });
        }
        self.fixed.clear();
        self.rx = Rx::Chunk {
            kind,
            done,
            cookie,
            need: length as usize,
        };
        if length == 0 {
            return self.on_chunk_payload();
        }
        Ok(None)
    }

    /// A buffered chunk (block status or error) is complete in `fixed`.
    fn on_chunk_payload(&mut self) -> Result<Option<ReplyEvent>, Violation> {
        let Rx::Chunk {
            kind, done, cookie, ..
        } = self.rx
        else {
            return Ok(None);
        };
        self.rx = Rx::Header;
        let payload = std::mem::take(&mut self.fixed);
        let mode = self.mode;
        // Moved out and back (no allocation) so the request can be borrowed beside it.
        let contexts = std::mem::take(&mut self.contexts);
        let event = match self.slot_mut(cookie) {
            None => Err(Violation::UnknownCookie(cookie)),
            Some(request) if kind & chunk::ERROR_BIT != 0 => {
                request.error_chunk(kind, &payload).map(|()| None)
            }
            Some(request) => request.status_chunk(kind, mode, &contexts, &payload).map(
                |(context_id, extents)| {
                    Some(ReplyEvent::Extents {
                        cookie,
                        context_id,
                        extents,
                    })
                },
            ),
        };
        self.contexts = contexts;
        self.fixed = payload;
        let event = event?;
        if !done {
            return Ok(event);
        }
        match event {
            // The status chunk was also the last: report it now and the end with the next
            // call (an empty payload step).
            Some(e) => {
                self.rx = Rx::Payload {
                    cookie,
                    at: 0,
                    remaining: 0,
                    done: true,
                };
                Ok(Some(e))
            }
            None => Ok(Some(self.finish(cookie))),
        }
    }

    fn finish(&mut self, cookie: u64) -> ReplyEvent {
        let contexts = self.contexts.len();
        let result = match self.slot_mut(cookie) {
            Some(request) => request.result(contexts),
            None => Ok(()),
        };
        self.release(cookie);
        ReplyEvent::Done { cookie, result }
    }

    fn slot_mut(&mut self, cookie: u64) -> Option<&mut InFlight> {
        let index = (cookie & 0xffff_ffff) as usize;
        let generation = (cookie >> 32) as u32;
        if self.generations.get(index) != Some(&generation) {
            return None;
        }
        self.slots.get_mut(index)?.as_mut()
    }

    fn release(&mut self, cookie: u64) {
        let index = (cookie & 0xffff_ffff) as usize;
        if let Some(slot) = self.slots.get_mut(index) {
            if slot.take().is_some() {
                self.free.push(index as u32);
            }
        }
    }
}

/// Decodes a descriptor list: compact (`u32` length, `u32` flags) or extended (`u64`, `u64`).
pub(crate) fn decode_extents(r: &mut Reader<'_>, extended: bool) -> Option<Vec<Extent>> {
    let size = if extended { 16 } else { 8 };
    let mut extents = Vec::with_capacity(r.remaining() / size);
    while !r.is_empty() {
        let (length, flags) = if extended {
            (r.u64()?, r.u64()?)
        } else {
            (u64::from(r.u32()?), u64::from(r.u32()?))
        };
        // "For metadata contexts that only return a 32-bit status (including all contexts in
        // the base: namespace), the most-significant 32 bits of status MUST be all zeroes."
        let flags = u32::try_from(flags).ok()?;
        extents.push(Extent { length, flags });
    }
    Some(extents)
}
