//! The server side of the transmission phase, as a sans-IO state machine.
//!
//! [`ServerSession`] is the server's one request reader. It decodes each request header for
//! the negotiated framing, hangs up where the spec lets a server hang up, checks the request
//! with [`validate_request`], consumes and drops the payload of a refused request, and says
//! when a write's payload follows. It never sees that payload: the I/O layer receives it
//! wherever it likes (the export's mapping, a pooled buffer, a pipe) and reports how much
//! arrived with [`ServerSession::payload_received`], so nothing of a payload is copied here.
//!
//! An engine that receives exactly what [`ServerSession::want`] asks feeds each receive to
//! [`ServerSession::handle_input`]. One that receives many headers at once into a staging
//! buffer feeds the buffer with [`ServerSession::handle_batch`]; bytes left over when
//! `want()` says [`ServerWant::Payload`] are the start of a write's payload, which it copies
//! to the payload's destination.
//!
//! Every request the session reports as [`ServerEvent::Request`] or [`ServerEvent::Rejected`]
//! is owed exactly one reply, except a write whose payload never arrived in full (see
//! [`ServerSession::close`]). Replies may go out in any order; the session does not track
//! them.

use crate::reply::ReplyTo;
use crate::request::{RequestError, RequestHeader, EXTENDED_REQUEST_BYTES};
use crate::types::Command;
use crate::validate::{validate_request, Rejection, TransmissionContext};

pub use crate::server_event::{CutShort, EndReason, ServerEvent, ServerWant};

/// Where the request reader is.
#[derive(Debug, Clone, Copy)]
enum Rx {
    /// Collecting a header in `ServerSession::header`.
    Header,
    /// A write's payload flows to the caller's destination.
    Payload {
        header: RequestHeader,
        received: usize,
        payload_bytes: usize,
    },
    /// A refused request's payload is dropped; the rejection is reported at its end.
    Discard {
        header: RequestHeader,
        rejection: Rejection,
        remaining: usize,
        payload_bytes: usize,
    },
    /// No more requests.
    Ended,
}

/// The server's view of one connection in the transmission phase: the request reader.
#[derive(Debug, Clone)]
pub struct ServerSession {
    ctx: TransmissionContext,
    rx: Rx,
    // Invariant: `header_have < ctx.mode.request_header_bytes() <= header.len()` between
    // calls, and `header_have` is 0 unless `rx` is `Rx::Header`.
    header: [u8; EXTENDED_REQUEST_BYTES],
    header_have: usize,
}

impl ServerSession {
    /// A session for a connection negotiated as `ctx` says, waiting for the first header.
    pub fn new(ctx: TransmissionContext) -> Self {
        ServerSession {
            ctx,
            rx: Rx::Header,
            header: [0; EXTENDED_REQUEST_BYTES],
            header_have: 0,
        }
    }

    /// What requests are checked against.
    pub fn context(&self) -> &TransmissionContext {
        &self.ctx
    }

    /// Size of one request header in the negotiated mode (28 or 32 bytes).
    pub fn header_bytes(&self) -> usize {
        self.ctx.mode.request_header_bytes()
    }

    /// What to read next.
    pub fn want(&self) -> ServerWant {
        match self.rx {
            Rx::Header => ServerWant::Header(self.header_bytes().saturating_sub(self.header_have)),
            Rx::Payload {
                received,
                payload_bytes,
                ..
            } => ServerWant::Payload {
                received,
                remaining: payload_bytes.saturating_sub(received),
            },
            Rx::Discard { remaining, .. } => ServerWant::Discard { remaining },
            Rx::Ended => ServerWant::Ended,
        }
    }

    /// Whether the reader is between requests: no partial header, payload or discard.
    pub fn is_idle(&self) -> bool {
        matches!(self.rx, Rx::Header) && self.header_have == 0
    }

    /// Whether the request stream has ended (a [`ServerEvent::End`], or [`Self::close`]).
    pub fn is_ended(&self) -> bool {
        matches!(self.rx, Rx::Ended)
    }

    /// Feeds received bytes; returns how many were used and what they completed.
    ///
    /// Reading a header, it takes at most what completes that one header (a partial header
    /// is kept here, so the caller need not keep it) and reports the request. Dropping a
    /// refused payload, it takes up to the rest of it, and reports the rejection when the
    /// last byte is in. During a write's payload, or once ended, it takes nothing: `(0,
    /// None)`.
    pub fn handle_input(&mut self, input: &[u8]) -> (usize, Option<ServerEvent>) {
        match self.rx {
            Rx::Header => self.take_header(input),
            Rx::Discard { .. } => self.discard(input),
            Rx::Payload { .. } | Rx::Ended => (0, None),
        }
    }

    /// Feeds `input` request after request, passing each event to `on_event`, until it is
    /// all used, a write's payload is next, the stream ends, or `on_event` returns `false`
    /// (no room for another request: nothing more is consumed). Returns the bytes used.
    pub fn handle_batch(
        &mut self,
        input: &[u8],
        mut on_event: impl FnMut(ServerEvent) -> bool,
    ) -> usize {
        let mut used = 0;
        loop {
            let (n, event) = self.handle_input(input.get(used..).unwrap_or_default());
            used += n;
            match event {
                Some(event) if !on_event(event) => return used,
                Some(_) => {}
                None if n == 0 => return used,
                None => {}
            }
        }
    }

    /// Reports that `bytes` more of the current write's payload reached its destination.
    /// Returns `true` when the payload is complete: the write may run now.
    ///
    /// `bytes` must not exceed what [`Self::want`] asked; more is counted as the rest (and
    /// asserted against in debug builds).
    pub fn payload_received(&mut self, bytes: usize) -> bool {
        let Rx::Payload {
            received,
            payload_bytes,
            ..
        } = &mut self.rx
        else {
            debug_assert_eq!(bytes, 0, "payload reported with none pending");
            return false;
        };
        let remaining = payload_bytes.saturating_sub(*received);
        debug_assert!(
            bytes <= remaining,
            "{bytes} payload bytes, {remaining} owed"
        );
        *received = received.saturating_add(bytes.min(remaining));
        if *received < *payload_bytes {
            return false;
        }
        self.rx = Rx::Header;
        true
    }

    /// The peer closed or the connection failed: ends the session and returns what was cut
    /// short, if anything. Requests already reported and complete are still owed replies.
    pub fn close(&mut self) -> Option<CutShort> {
        let have = std::mem::take(&mut self.header_have);
        match std::mem::replace(&mut self.rx, Rx::Ended) {
            Rx::Header if have > 0 => Some(CutShort::Header { received: have }),
            Rx::Header | Rx::Ended => None,
            Rx::Payload {
                header,
                received,
                payload_bytes,
            } => Some(CutShort::Payload {
                header,
                received,
                payload_bytes,
            }),
            Rx::Discard {
                header, remaining, ..
            } => Some(CutShort::Discard { header, remaining }),
        }
    }

    /// The reply encoder for `header`'s request.
    pub fn reply_to(&self, header: &RequestHeader) -> ReplyTo {
        ReplyTo {
            mode: self.ctx.mode,
            cookie: header.cookie,
            offset: header.offset,
        }
    }

    /// Collects header bytes; decodes the header once it is whole.
    fn take_header(&mut self, input: &[u8]) -> (usize, Option<ServerEvent>) {
        let size = self.header_bytes();
        let have = self.header_have;
        let used = size.saturating_sub(have).min(input.len());
        // In bounds: `have + used <= size <= EXTENDED_REQUEST_BYTES` and `used <= input.len()`.
        self.header[have..have + used].copy_from_slice(&input[..used]);
        self.header_have = have + used;
        if self.header_have < size {
            return (used, None);
        }
        self.header_have = 0;
        let raw = self.header;
        (used, self.on_header(&raw[..size]))
    }

    /// A whole header: hang up, refuse, end, or report the request.
    fn on_header(&mut self, raw: &[u8]) -> Option<ServerEvent> {
        let mode = self.ctx.mode;
        let header = match RequestHeader::decode(raw, mode) {
            Ok(Some(header)) => header,
            // "Either side MAY initiate a hard disconnect if it detects a violation by the
            // other party of a mandatory condition within this document."
            Err(RequestError::BadMagic(magic)) => {
                return Some(self.end(EndReason::BadMagic(magic)))
            }
            // Cannot happen (`raw` is a whole header); ending beats waiting for nothing.
            Ok(None) => return Some(self.end(EndReason::BadMagic(0))),
        };
        let payload = header.payload_bytes(mode);
        let max = self.ctx.block_size.payload_max;
        // "A server SHOULD initiate hard disconnect if a client sets the
        // NBD_CMD_FLAG_PAYLOAD_LEN flag and uses a length larger than a server's advertised
        // or default maximum payload length"; a compact write that large gets the same.
        let payload_bytes = match usize::try_from(payload) {
            Ok(bytes) if payload <= u64::from(max) => bytes,
            _ => return Some(self.end(EndReason::PayloadTooLarge { payload, max })),
        };
        match validate_request(&header, &self.ctx) {
            Err(rejection) => self.reject(header, rejection, payload_bytes),
            // "A client MUST NOT send anything to the server after sending an NBD_CMD_DISC
            // command", and "There is no reply to an NBD_CMD_DISC": read no further.
            Ok(Command::Disc) => Some(self.end(EndReason::Disconnect)),
            Ok(command) => {
                if payload_bytes > 0 {
                    self.rx = Rx::Payload {
                        header,
                        received: 0,
                        payload_bytes,
                    };
                }
                Some(ServerEvent::Request {
                    header,
                    command,
                    payload_bytes,
                })
            }
        }
    }

    /// A refused request: reported now, or after its payload is dropped.
    fn reject(
        &mut self,
        header: RequestHeader,
        rejection: Rejection,
        payload_bytes: usize,
    ) -> Option<ServerEvent> {
        // "in all other cases, a server SHOULD gracefully consume length bytes of payload
        // (even if it then replies with an NBD_EINVAL failure because the particular command
        // was not expecting a payload), and proceed with the next client command."
        if payload_bytes > 0 {
            self.rx = Rx::Discard {
                header,
                rejection,
                remaining: payload_bytes,
                payload_bytes,
            };
            return None;
        }
        Some(ServerEvent::Rejected {
            header,
            rejection,
            payload_bytes,
        })
    }

    /// Drops refused payload bytes; reports the rejection after the last one.
    fn discard(&mut self, input: &[u8]) -> (usize, Option<ServerEvent>) {
        let Rx::Discard {
            header,
            rejection,
            remaining,
            payload_bytes,
        } = self.rx
        else {
            return (0, None);
        };
        let used = remaining.min(input.len());
        if used < remaining {
            self.rx = Rx::Discard {
                header,
                rejection,
                remaining: remaining - used,
                payload_bytes,
            };
            return (used, None);
        }
        self.rx = Rx::Header;
        let event = ServerEvent::Rejected {
            header,
            rejection,
            payload_bytes,
        };
        (used, Some(event))
    }

    fn end(&mut self, reason: EndReason) -> ServerEvent {
        self.rx = Rx::Ended;
        ServerEvent::End(reason)
    }
}
