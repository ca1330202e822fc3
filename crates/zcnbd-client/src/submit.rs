//! The submit/complete API: many requests in flight from one thread. Each request owns its
//! buffer until it completes; [`Client::complete`] hands the buffer back with the result.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zcnbd_proto::Command;

use crate::client::{fua, Client, WriteFlags};
use crate::conn::Completed;
use crate::error::Result;
use crate::plan;
use crate::wait::lock;

/// A finished request of the submit API.
#[derive(Debug)]
pub struct Completion {
    /// The value given at submission.
    pub user_data: u64,
    /// What the server said.
    pub result: Result<Completed>,
    /// The request's buffer, back to the caller (filled, for a read).
    pub buffer: Vec<u8>,
}

/// Finished requests waiting for [`Client::complete`].
pub(crate) type CompletionQueue = Arc<Mutex<VecDeque<Completion>>>;

impl Client {
    /// Starts a read of `buffer.len()` bytes at `offset` into `buffer`.
    pub fn submit_read(&self, buffer: Vec<u8>, offset: u64, user_data: u64) -> Result<()> {
        self.submit_owned(Command::Read, 0, buffer, offset, user_data)
    }

    /// Starts a write of `buffer` at `offset`.
    pub fn submit_write(
        &self,
        buffer: Vec<u8>,
        offset: u64,
        flags: WriteFlags,
        user_data: u64,
    ) -> Result<()> {
        self.submit_owned(Command::Write, fua(flags.fua), buffer, offset, user_data)
    }

    /// Starts a flush; its completion carries an empty buffer.
    pub fn submit_flush(&self, user_data: u64) -> Result<()> {
        let parts = plan::flush(self.geometry())?;
        let queue = self.queue.clone();
        self.submit_parts(
            parts,
            Box::new(move |result| {
                lock(&queue).push_back(Completion {
                    user_data,
                    result,
                    buffer: Vec::new(),
                })
            }),
        )
    }

    fn submit_owned(
        &self,
        command: Command,
        flags: u16,
        mut buffer: Vec<u8>,
        offset: u64,
        user_data: u64,
    ) -> Result<()> {
        let lent = crate::sys::lend_vec(&mut buffer);
        let parts = plan::read_write(self.geometry(), command, flags, offset, lent)?;
        let queue = self.queue.clone();
        // The Vec moves into the completer; its heap memory, which the request uses, stays
        // where it is until the completer hands it back.
        self.submit_parts(
            parts,
            Box::new(move |result| {
                lock(&queue).push_back(Completion {
                    user_data,
                    result,
                    buffer,
                })
            }),
        )
    }

    /// Moves finished requests into `out`, waiting up to `timeout` for at least one
    /// (`None`: until one finishes or nothing is in flight). Returns how many were added.
    pub fn complete(&self, out: &mut Vec<Completion>, timeout: Option<Duration>) -> usize {
        let has = || !lock(&self.queue).is_empty();
        let idle = || self.cells.iter().all(|c| lock(&c.conn).in_flight() == 0);
        if !has() {
            self.waiter
                .drive(&self.cells, &|_| has() || idle(), timeout);
        }
        let mut queue = lock(&self.queue);
        let n = queue.len();
        out.extend(queue.drain(..));
        n
    }
}
