//! The receive side of a connection: the header stage and what the request stream means
//! (the session), what is being received now (a header, a payload, a refused payload, a
//! spliced write), and the memory and settings receives use.

use std::ops::Range;

use zcnbd_proto::{RequestHeader, ServerSession, ServerWant, TransmissionContext};

use super::piped_write::PipedWrite;
use crate::dispatch::Reply;
use crate::engine::DISCARD_BYTES;
use crate::export::{Lease, Place};
use crate::pipe::Pipe;
use crate::sys::uring::{Dest, Lent, RecvMem};

/// Request headers one receive may take while the client sends no writes (16 extended
/// headers): a run of reads costs one receive, not one per request.
pub(super) const HEADER_STAGE_BYTES: usize = 16 * 32;
/// Payload-less requests in a row after which headers are received in batches. After a
/// write larger than [`BULK_PAYLOAD_MAX_BYTES`] the receive goes back to one exact header, so
/// the next payload lands in place rather than in the stage (from where it would have to be
/// copied).
pub(super) const BATCH_AFTER_PLAIN_REQUESTS: u32 = 16;
/// While the client writes payloads this short, requests are received in bulk: whatever has
/// arrived, up to [`BULK_STAGE_BYTES`], in one receive, each payload then copied from the
/// stage into place (`--data-path auto` only). Copying a small payload costs less than what
/// it saves: a receive per request, and a reply sent per request (the replies of a bulk go
/// out in one send). Measured while building it (`zcnbd bench`, one run, AMD EPYC): 4 KiB
/// writes at iodepth 16 on a memory export went from 152k to 182k IOPS and from 1.72 to 1.43
/// s of server CPU per GiB; with held replies (below) docs/benchmarks/history.md, section 22 has
/// 170k IOPS at 1.23 s/GiB, 0.67x nbdkit's CPU. At a request boundary after such a write the
/// next receive is a bulk one even when the client keeps one request in flight: its header
/// and payload usually arrive together, and an exact header receive would cost a second
/// receive for the payload (under fio at iodepth 16, 0.45 of them per request before this:
/// section 22's second part).
pub(super) const BULK_PAYLOAD_MAX_BYTES: usize = 16 * 1024;
/// The stage a connection grows to the first time it receives in bulk.
pub(super) const BULK_STAGE_BYTES: usize = 64 * 1024;
/// When a receive leaves bytes in the socket (the client has sent more requests already),
/// the replies of the requests received so far wait for the next receive, which takes what
/// is there at once (it is posted without `MSG_WAITALL`), so both go out in one send - for
/// at most this many turns in a row. Replies never wait for bytes the client has yet to send.
pub(super) const HOLD_TURNS_MAX: u32 = 4;
/// Payloads up to this long are received together with the next request's header, in one
/// `recvmsg` of two iovecs (payload in place, then the header into the stage): a stream of
/// small writes costs one receive per request rather than two. Such a receive cannot wait
/// for all its bytes (the next request may never come), so larger payloads, which would
/// then arrive in many pieces, are received alone with `MSG_WAITALL`.
pub(super) const PAYLOAD_WITH_HEADER_MAX_BYTES: usize = 64 * 1024;

/// What the receive side is doing.
pub(super) enum Recv {
    /// Between requests: headers are received into the connection's stage.
    Header,
    Payload {
        header: RequestHeader,
        /// Lent to the receive posted for the payload, if any.
        dest: Lent<Dest>,
        got: usize,
        len: usize,
        held: usize,
        /// Bytes that arrived in the header stage and were copied into place.
        staged: usize,
        /// Where the stack mapped the payload (`None`: it goes through the stack).
        place: Option<Place>,
        /// The place's lease, until the write is finished or dropped.
        lease: Lease,
    },
    Discard {
        remaining: usize,
        reply: Option<Reply>,
    },
    /// A buffered-file write spliced from the socket through a pipe into the file.
    Piped(Box<PipedWrite>),
}

/// A request waiting for buffer memory (see `engine/memory.rs`).
pub(super) struct Parked {
    pub header: RequestHeader,
    pub command: zcnbd_proto::Command,
    pub payload_bytes: usize,
    /// What it may hold: its length, for a read or a write.
    pub need: usize,
}

/// Everything a connection needs to receive requests.
pub(super) struct RecvSide {
    /// The request stream's meaning: what each header asks, and what to read next.
    pub session: ServerSession,
    /// Stage, scratch and `recvmsg` header, lent as a whole to the receive in flight, if any
    /// (whichever part it points at): one receive at a time, so "lent" is "posted".
    pub mem: Lent<Box<RecvMem>>,
    /// Received request bytes not yet parsed are `stage[stage_start..stage_end]`.
    pub stage_start: usize,
    pub stage_end: usize,
    /// Payload-less requests since the last write (see [`BATCH_AFTER_PLAIN_REQUESTS`]).
    pub plain_run: u32,
    /// The last request was a write of at most [`BULK_PAYLOAD_MAX_BYTES`].
    pub small_write: bool,
    /// ... and its payload went to the memory export's mapping, so the next header may be
    /// received with what follows it (see [`Self::bulk_target`]): for a file export the
    /// payload lands in a registered run or is spliced, with no copy to lose.
    pub small_write_to_memory: bool,
    /// Requests whose headers were parsed since the last receive completed.
    pub parsed: u32,
    /// The last receive of a payload brought bytes of the next request too.
    pub overflow: bool,
    /// Small writes may be received in bulk (`--data-path auto`).
    pub bulk_allowed: bool,
    /// The last receive left bytes in the socket, and only receives have taken bytes off it
    /// since (a spliced write clears it): the next receive completes at once.
    pub more_waiting: bool,
    /// The receive in flight takes whatever has arrived (no `MSG_WAITALL`): with bytes
    /// waiting in the socket it completes as soon as it is submitted.
    pub posted_nowait: bool,
    /// Turns in a row whose replies waited for bytes already in the socket (see
    /// [`HOLD_TURNS_MAX`]).
    pub held_turns: u32,
    /// What is being received.
    pub state: Recv,
    /// Bytes of the posted receive that go to the payload; any beyond go to the stage.
    pub payload_bytes: usize,
    /// The pipe spliced writes pass through (the send side has its own).
    pub pipe: Option<Pipe>,
    /// `auto`: memory-export writes up to this long are received in place.
    pub in_place_max: usize,
    /// The socket answers `FIONREAD` (probed once), so writes may be spliced off it.
    pub socket_fionread: bool,
    /// Large payloads are received with `MSG_WAITALL` (one completion for the whole payload).
    pub payload_wait_all: bool,
    /// A request whose header is read but which waits for the server's buffer memory: no
    /// further request is read until it starts.
    pub parked: Option<Parked>,
}

/// The header stage, holding the request bytes that arrived with the handshake.
fn stage_with(mut leftover: Vec<u8>) -> Box<[u8]> {
    let len = leftover.len().max(HEADER_STAGE_BYTES);
    leftover.resize(len, 0);
    leftover.into_boxed_slice()
}

impl RecvSide {
    /// Starts with the request bytes that arrived with the handshake (`leftover`).
    pub fn new(
        ctx: TransmissionContext,
        leftover: Vec<u8>,
        in_place_max: usize,
        socket_fionread: bool,
        payload_wait_all: bool,
        bulk_allowed: bool,
    ) -> RecvSide {
        RecvSide {
            session: ServerSession::new(ctx),
            stage_end: leftover.len(),
            mem: Lent::new(RecvMem::new(stage_with(leftover), DISCARD_BYTES)),
            stage_start: 0,
            plain_run: 0,
            small_write: false,
            small_write_to_memory: false,
            parsed: 0,
            overflow: false,
            bulk_allowed,
            more_waiting: false,
            posted_nowait: false,
            held_turns: 0,
            state: Recv::Header,
            payload_bytes: 0,
            pipe: None,
            in_place_max,
            socket_fionread,
            payload_wait_all,
            parked: None,
        }
    }

    /// Whether no received byte waits in the stage.
    pub fn stage_is_empty(&self) -> bool {
        self.stage_start == self.stage_end
    }

    /// Grows the stage for a bulk receive after a small write (see
    /// [`BULK_PAYLOAD_MAX_BYTES`]); the end of the stage to receive up to. The caller has
    /// moved any partial request to the front of the stage.
    /// `between_requests`: no payload is due, so the next receive starts with a header of
    /// `header_bytes`; while one is, only a client with more requests in flight gets a bulk
    /// receive (otherwise the payload lands in place, with the next header).
    pub fn bulk_target(&mut self, between_requests: bool, header_bytes: usize) -> Option<usize> {
        if !(self.small_write && self.bulk_allowed) {
            return None;
        }
        // The client keeps several requests in flight: a receive brought more than one, or
        // part of the next is here already.
        let pipelined = (between_requests && self.more_waiting)
            || self.overflow
            || self.parsed >= 2
            || self.stage_end > 0;
        let end = if pipelined {
            BULK_STAGE_BYTES
        } else if between_requests && self.small_write_to_memory {
            // One request in flight (the stage is empty, or it would count as pipelined):
            // its header and a small payload, which usually arrive together. A larger
            // payload has at most this much staged (and copied); the rest lands in place.
            header_bytes + BULK_PAYLOAD_MAX_BYTES
        } else {
            return None;
        };
        let mem = self.mem.get_mut()?;
        if mem.stage.len() < BULK_STAGE_BYTES {
            let mut grown = vec![0u8; BULK_STAGE_BYTES].into_boxed_slice();
            grown[..self.stage_end].copy_from_slice(&mem.stage[..self.stage_end]);
            mem.stage = grown;
        }
        Some(end)
    }

    /// Whether this turn's replies might wait for the next receive ([`Self::hold_replies`]
    /// decides once it is posted); if not, the turn's held run ends.
    pub fn may_hold_replies(&mut self) -> bool {
        let may = self.more_waiting && self.held_turns < HOLD_TURNS_MAX;
        if !may {
            self.held_turns = 0;
        }
        may
    }

    /// Whether this turn's replies wait for the receive just posted: it takes bytes already
    /// in the socket and completes at once (see [`HOLD_TURNS_MAX`]). Counts the turn held.
    pub fn hold_replies(&mut self) -> bool {
        let hold = self.more_waiting
            && self.posted_nowait
            && self.is_posted()
            && self.held_turns < HOLD_TURNS_MAX;
        self.held_turns = if hold { self.held_turns + 1 } else { 0 };
        hold
    }

    /// A receive completed: what it brings is parsed next (`overflow`: bytes beyond the
    /// payload it was for).
    pub fn received(&mut self, overflow: bool) {
        self.parsed = 0;
        self.overflow = overflow;
    }

    /// Whether a receive is in flight.
    pub fn is_posted(&self) -> bool {
        self.mem.is_lent()
    }

    /// The posted receive completed (or was never submitted): the receive side's memory and
    /// the payload destination lent to it come back.
    pub fn returned(&mut self) {
        self.mem.complete();
        // A bulk receive lends the stage only, even while a payload is due.
        if let Recv::Payload { dest, .. } = &mut self.state {
            if dest.is_lent() {
                dest.complete();
            }
        }
    }

    /// Which bytes of the stage the next header receive fills, and whether it waits for all
    /// of them; `None` when there is no `room` for another request or a whole header is
    /// here already.
    pub fn header_target(
        &mut self,
        header_bytes: usize,
        room: bool,
    ) -> Option<(Range<usize>, bool)> {
        if !room || self.stage_end - self.stage_start >= header_bytes {
            // No room, or a whole header is already here (parsed once room frees).
            return None;
        }
        // `None` only while a receive is in flight, which posts none.
        let mem = self.mem.get_mut()?;
        // Keep the partial header at the front of the stage.
        mem.stage.copy_within(self.stage_start..self.stage_end, 0);
        self.stage_end -= self.stage_start;
        self.stage_start = 0;
        let (want, wait_all) = if let Some(bulk) = self.bulk_target(true, header_bytes) {
            (bulk, false)
        } else if self.plain_run >= BATCH_AFTER_PLAIN_REQUESTS {
            // Whatever has arrived, up to a stage full: many headers per receive.
            (HEADER_STAGE_BYTES, false)
        } else {
            // Exactly one header, so a write's payload is received in place.
            (header_bytes, true)
        };
        Some((self.stage_end..want, wait_all))
    }

    /// Counts a run of payload-less requests (see [`BATCH_AFTER_PLAIN_REQUESTS`]) and notes
    /// small writes (see [`BULK_PAYLOAD_MAX_BYTES`]).
    pub fn count_plain(&mut self, payload_bytes: usize) {
        self.small_write = (1..=BULK_PAYLOAD_MAX_BYTES).contains(&payload_bytes);
        self.small_write_to_memory = false;
        self.plain_run = if payload_bytes > 0 {
            0
        } else {
            self.plain_run.saturating_add(1)
        };
    }

    /// After a refused request's header the session drops its payload: receive that into
    /// scratch (the session tells the reply once the last byte is gone).
    pub fn start_discard(&mut self) {
        if let ServerWant::Discard { remaining } = self.session.want() {
            self.state = Recv::Discard {
                remaining,
                reply: None,
            };
        }
    }
}
