//! What one connection's reader shares with its workers and its writer.

use std::sync::Arc;

use super::writer::{ReplyQueue, Writer};
use crate::dispatch::{Dispatcher, Reply};
use crate::engine::budget::SharedBudget;

/// State the reader shares with the workers and the writer of one connection.
pub(super) struct ConnState {
    pub replies: ReplyQueue,
    pub inflight: SharedBudget,
    pub dispatcher: Arc<Dispatcher>,
    /// Every request runs on the reader (the stack never waits): no hand-off to a worker.
    pub inline: bool,
    /// Write payloads are received straight into the export (a memory export's mapping).
    pub in_place: bool,
    /// A memory export's reads of at least this many bytes are answered from its mapping,
    /// shorter ones copied out of it (`None`: not from the mapping).
    pub mapped_min: Option<usize>,
}

impl ConnState {
    /// What sends this connection's replies.
    pub fn writer(&self, write_timeout_ms: u64) -> Writer<'_> {
        Writer {
            queue: &self.replies,
            inflight: &self.inflight,
            stats: &self.dispatcher.stats,
            write_timeout_ms,
        }
    }

    /// Hands a reply to the writer; if the connection already failed, the request's place
    /// is given back at once.
    pub fn answer(&self, reply: Reply, held: usize) {
        if !self.replies.push(reply, held) {
            self.inflight.release(held);
        }
    }
}
