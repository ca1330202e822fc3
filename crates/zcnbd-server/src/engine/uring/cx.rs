//! What a connection gets from its ring for one event.

use std::io;
use std::time::Instant;

use super::key::ConnKey;
use super::mailbox::Mailbox;
use super::sendfile_trial::SendfileTrial;
use super::shared::EngineShared;
use crate::sys::uring::{FixedPool, Op, Sqe, Submit};

/// What a connection needs from its ring while handling an event.
pub(super) struct Cx<'a> {
    /// The only way to the kernel.
    pub driver: &'a mut dyn Submit,
    pub shared: &'a EngineShared,
    pub mailbox: &'a Mailbox,
    /// The ring's registered region, once an O_DIRECT connection asked for it.
    pub fixed: Option<&'a FixedPool>,
    /// Connections whose replies go out at the end of this turn.
    pub sends: &'a mut Vec<ConnKey>,
    /// Connections with a request waiting for buffer memory, tried again each turn.
    pub parked: &'a mut Vec<ConnKey>,
    /// When this turn of the ring began (the clock deadlines are measured with).
    pub now: Instant,
    /// Requests the ring's connections started since it last waited.
    pub started: &'a mut u64,
    /// The ring overlaps its replies with its clients' bursts (`engine/wait_trial.rs`,
    /// [`crate::engine::wait_trial::Wait::Overlap`]): a connection stops starting requests
    /// while [`crate::engine::wait_trial::OVERLAP_REPLIES`] replies wait to be sent, so they
    /// leave at the end of this turn and the rest of the burst is started in the next.
    pub overlap: bool,
    /// How the ring sends large reads to clients on other hosts (`sendfile_trial.rs`).
    pub sendfile_trial: &'a mut SendfileTrial,
}

impl Cx<'_> {
    /// Sends `key`'s queued replies at the end of the ring's turn, in one send with every
    /// other reply the turn produces for it.
    pub fn send_later(&mut self, key: ConnKey) {
        if self.sends.last() != Some(&key) {
            self.sends.push(key);
        }
    }

    /// Tries `key`'s parked request again at the next turn (memory given back wakes the
    /// ring).
    pub fn park_later(&mut self, key: ConnKey) {
        if !self.parked.contains(&key) {
            self.parked.push(key);
        }
    }

    /// Submits one operation.
    pub fn submit(&mut self, user_data: u64, op: Op<'_>) -> io::Result<()> {
        self.driver.submit(&mut [Sqe::new(user_data, op)])
    }
}
