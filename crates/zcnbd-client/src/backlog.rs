//! Operations waiting for room on a connection: the callback submit API (`callback.rs`)
//! never makes its caller wait or retry. An operation that finds every request slot of its
//! connection taken waits here, in order, and goes on the wire from whichever thread drives
//! the connection next, as replies free slots.

use std::collections::VecDeque;

use crate::conn::{Completer, PartSpec};

/// Most operations waiting for room on one connection, unless the options say otherwise:
/// a caller that submits faster than the server answers gets [`Error::Busy`] beyond this.
///
/// [`Error::Busy`]: crate::Error::Busy
pub const OPERATIONS_QUEUED_MAX_DEFAULT: usize = 4096;

/// An operation's parts and its completer, not yet on the wire.
pub(crate) struct Waiting {
    pub parts: Vec<PartSpec>,
    pub completer: Completer,
}

/// The operations of one connection waiting for room, oldest first.
/// Invariant: `ops.len() <= operations_max`.
pub(crate) struct Backlog {
    ops: VecDeque<Waiting>,
    operations_max: usize,
}

impl Backlog {
    /// An empty backlog holding at most `operations_max` operations.
    pub fn new(operations_max: usize) -> Backlog {
        Backlog {
            ops: VecDeque::new(),
            operations_max,
        }
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Queues `waiting` last; gives it back when the backlog is full.
    pub fn push(&mut self, waiting: Waiting) -> Result<(), Waiting> {
        if self.ops.len() >= self.operations_max {
            return Err(waiting);
        }
        self.ops.push_back(waiting);
        Ok(())
    }

    /// The oldest operation, if it fits in `room` request slots.
    pub fn pop_fitting(&mut self, room: usize) -> Option<Waiting> {
        if self.ops.front()?.parts.len() > room {
            return None;
        }
        self.ops.pop_front()
    }

    /// Every waiting operation, oldest first (the connection died).
    pub fn take_all(&mut self) -> VecDeque<Waiting> {
        std::mem::take(&mut self.ops)
    }
}
