//! The portable engine's reply side: workers queue each connection's replies and one writer
//! thread per connection sends them, so a worker never waits on a client's socket and a
//! client that stops reading holds up only its own writer. A connection whose requests all
//! run on its reader has no writer thread: the reader sends what is queued
//! ([`Writer::send_queued`]) before it waits for the client.
//!
//! Memory is bounded: a reply holds its request's place in the connection's in-flight budget
//! (`SharedBudget`) until it is sent, so the reader stops taking requests from a client that does
//! not read its replies. Time is bounded: the writer's socket has a send timeout of
//! `write_timeout_ms`; a send that makes no progress for that long disconnects the client.

use std::collections::VecDeque;
use std::io;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use tracing::debug;

use crate::dispatch::Reply;
use crate::engine::budget::SharedBudget;
use crate::engine::log_write_timeout;
use crate::session::channel::Outbound;
use crate::stats::{SendPath, Stats};
use crate::sys::mapped_io::{OutPiece, PIECES_MAX};

/// A reply waiting to be sent, with the in-flight bytes its request holds.
#[derive(Debug)]
struct Queued {
    reply: Reply,
    held: usize,
}

#[derive(Debug, Default)]
struct Queue {
    replies: VecDeque<Queued>,
    /// No more replies will be queued: the writer exits once the queue is empty.
    closing: bool,
    /// The socket failed: nothing more is sent, replies are dropped as they come.
    failed: bool,
    /// The writer is waiting for replies: a push must wake it (else it will find the reply
    /// when it comes back for the next batch, and a wake would be a wasted system call).
    waiting: bool,
}

impl Queue {
    /// Moves as many replies as one send can carry into `batch` (none once the connection
    /// failed); whether `batch` holds any.
    fn fill(&mut self, batch: &mut Vec<Queued>) -> bool {
        if self.failed {
            return false;
        }
        let mut slices = 0;
        while let Some(front) = self.replies.front() {
            let n = front.reply.piece_count();
            if !batch.is_empty() && slices + n > PIECES_MAX {
                break;
            }
            slices += n;
            batch.extend(self.replies.pop_front());
        }
        !batch.is_empty()
    }
}

/// One connection's queued replies.
#[derive(Debug, Default)]
pub struct ReplyQueue {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl ReplyQueue {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `reply` for the writer; false (and the reply dropped) once the connection
    /// failed, in which case the caller gives back what the request held.
    pub fn push(&self, reply: Reply, held: usize) -> bool {
        let mut queue = self.lock();
        if queue.failed {
            return false;
        }
        queue.replies.push_back(Queued { reply, held });
        if queue.waiting {
            self.ready.notify_one();
        }
        true
    }

    /// Tells the writer no more replies will come.
    pub fn close(&self) {
        self.lock().closing = true;
        self.ready.notify_one();
    }

    /// Whether the connection failed (nothing more can be sent).
    pub fn failed(&self) -> bool {
        self.lock().failed
    }

    /// Waits for replies and moves as many as one send can carry into `batch`; false when
    /// the writer should exit.
    fn next_batch(&self, batch: &mut Vec<Queued>) -> bool {
        let mut queue = self.lock();
        while queue.replies.is_empty() && !queue.closing && !queue.failed {
            queue.waiting = true;
            queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner());
            queue.waiting = false;
        }
        queue.fill(batch)
    }

    /// Moves as many replies as one send can carry into `batch`, without waiting; false if
    /// there are none or the connection failed.
    fn take_batch(&self, batch: &mut Vec<Queued>) -> bool {
        self.lock().fill(batch)
    }

    /// Whether replies wait to be sent.
    pub fn has_pending(&self) -> bool {
        !self.lock().replies.is_empty()
    }

    /// How many replies wait to be sent.
    pub fn pending(&self) -> usize {
        self.lock().replies.len()
    }

    /// Marks the connection failed; returns the replies that will never be sent.
    fn fail(&self) -> Vec<Queued> {
        let mut queue = self.lock();
        queue.failed = true;
        queue.replies.drain(..).collect()
    }
}

/// What the writer needs of its connection.
pub struct Writer<'a> {
    pub queue: &'a ReplyQueue,
    pub inflight: &'a SharedBudget,
    pub stats: &'a Stats,
    pub write_timeout_ms: u64,
}

impl Writer<'_> {
    /// On the writer's thread: sends queued replies until the queue closes or the socket
    /// fails.
    pub fn run(&self, mut out: Outbound) {
        self.prepare(&out);
        let mut batch = Vec::new();
        while self.queue.next_batch(&mut batch) {
            self.send_batch(&mut out, &mut batch);
        }
        self.finish(&mut out);
    }

    /// Bounds each send by the write timeout.
    pub fn prepare(&self, out: &Outbound) {
        let timeout = Duration::from_millis(self.write_timeout_ms.max(1));
        if let Err(e) = out.socket().set_write_timeout(Some(timeout)) {
            debug!("cannot set the send timeout: {e}");
        }
    }

    /// On the caller's thread (a connection whose requests all run on its reader): sends
    /// every reply queued now; false once the connection has failed.
    pub fn send_queued(&self, out: &mut Outbound) -> bool {
        let mut batch = Vec::new();
        while self.queue.take_batch(&mut batch) {
            self.send_batch(out, &mut batch);
        }
        !self.queue.failed()
    }

    /// The end of the connection: under TLS a close_notify, unless sending failed.
    pub fn finish(&self, out: &mut Outbound) {
        if !self.queue.failed() {
            out.finish();
        }
    }

    /// Sends `batch` and gives back what its requests held; on failure the connection is
    /// cut and every queued reply dropped.
    fn send_batch(&self, out: &mut Outbound, batch: &mut Vec<Queued>) {
        if let Err(e) = self.send(out, batch) {
            self.report(&e);
            out.socket().abort();
            batch.extend(self.queue.fail());
        }
        for queued in batch.drain(..) {
            self.inflight.release(queued.held);
        }
    }

    fn send(&self, stream: &mut Outbound, batch: &[Queued]) -> io::Result<()> {
        let pieces: Vec<OutPiece<'_>> = batch.iter().flat_map(|q| q.reply.pieces()).collect();
        let data: usize = batch.iter().map(|q| q.reply.data_bytes()).sum();
        self.stats.syscall();
        stream.write_all_pieces(&pieces)?;
        self.stats.replies_sent(SendPath::Plain, batch.len(), data);
        Ok(())
    }

    fn report(&self, e: &io::Error) {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            log_write_timeout(self.write_timeout_ms);
        } else {
            debug!("reply failed: {e}; disconnecting");
        }
    }
}
