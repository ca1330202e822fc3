//! What the server's transmission session tells its I/O layer: what to read next
//! ([`ServerWant`]), what a request said ([`ServerEvent`]), why the requests ended
//! ([`EndReason`]), and what a hang-up cut short ([`CutShort`]).

use crate::request::RequestHeader;
#[cfg(doc)]
use crate::server_session::ServerSession;
use crate::types::Command;
use crate::validate::Rejection;

/// What the I/O layer should read next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerWant {
    /// This many bytes complete the current request header; feed them (or more: the rest is
    /// left unconsumed) to [`ServerSession::handle_input`].
    Header(usize),
    /// The current write's payload: `remaining` more bytes, which belong `received` bytes
    /// into its destination. Report them with [`ServerSession::payload_received`].
    Payload {
        /// Payload bytes already reported.
        received: usize,
        /// Payload bytes still to come.
        remaining: usize,
    },
    /// A refused request's payload: `remaining` more bytes to feed to
    /// [`ServerSession::handle_input`], which drops them.
    Discard {
        /// Bytes still to drop.
        remaining: usize,
    },
    /// No more requests: read nothing more, answer the requests in flight, then close.
    Ended,
}

/// Something the client's request stream said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerEvent {
    /// A valid request to run. `payload_bytes` is nonzero only for a write: `want()` is then
    /// [`ServerWant::Payload`] and the write may run once
    /// [`ServerSession::payload_received`] returns `true`.
    Request {
        /// The header as sent.
        header: RequestHeader,
        /// What to run (never [`Command::Disc`]).
        command: Command,
        /// Payload bytes that follow the header.
        payload_bytes: usize,
    },
    /// A request refused with an error reply (`rejection.errno`), which the caller sends at
    /// once: this event comes only after the `payload_bytes` of payload that followed the
    /// header have all been consumed and dropped, as both engines have always done (so a
    /// refused write cut short by a hang-up gets no reply, like an accepted one).
    Rejected {
        /// The header as sent.
        header: RequestHeader,
        /// The errno to reply with, and why.
        rejection: Rejection,
        /// Payload bytes that followed the header and were dropped.
        payload_bytes: usize,
    },
    /// No more requests. The requests in flight are still answered before closing: "The
    /// server MUST handle all outstanding requests" (for `NBD_CMD_DISC`; a hard disconnect
    /// loses nothing by doing the same).
    End(EndReason),
}

/// Why the request stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EndReason {
    /// The client sent `NBD_CMD_DISC`: a soft disconnect.
    #[error("client sent NBD_CMD_DISC")]
    Disconnect,
    /// A header whose magic does not fit the negotiated mode: a hard disconnect.
    #[error("bad request magic {0:#010x}")]
    BadMagic(u32),
    /// A payload over the advertised maximum: a hard disconnect.
    #[error("payload of {payload} bytes over the advertised maximum of {max}")]
    PayloadTooLarge {
        /// The payload length the header claimed.
        payload: u64,
        /// The advertised maximum payload.
        max: u32,
    },
}

impl EndReason {
    /// Whether the client is at fault (a protocol violation), not just done.
    pub fn is_violation(self) -> bool {
        self != EndReason::Disconnect
    }
}

/// What a hang-up cut short (see [`ServerSession::close`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutShort {
    /// Part of a request header: nothing is owed for it.
    Header {
        /// Header bytes received.
        received: usize,
    },
    /// A write whose payload never arrived in full. Its [`ServerEvent::Request`] was
    /// reported: the caller drops it unanswered (it can never be answered correctly).
    Payload {
        /// The write's header.
        header: RequestHeader,
        /// Payload bytes received.
        received: usize,
        /// Payload bytes the header announced.
        payload_bytes: usize,
    },
    /// A refused request whose payload was being dropped. It was never reported, so
    /// nothing is owed for it.
    Discard {
        /// The refused request's header.
        header: RequestHeader,
        /// Payload bytes that never arrived.
        remaining: usize,
    },
}

impl CutShort {
    /// The cookie of the request cut short, if its header was whole.
    pub fn cookie(&self) -> Option<u64> {
        match self {
            CutShort::Header { .. } => None,
            CutShort::Payload { header, .. } | CutShort::Discard { header, .. } => {
                Some(header.cookie)
            }
        }
    }
}
