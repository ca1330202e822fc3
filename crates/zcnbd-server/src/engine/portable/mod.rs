//! The portable engine: the thread that ran a connection's handshake becomes its request
//! reader (`reader.rs`): it decodes and validates requests, receives each write payload
//! straight into the buffer the stack writes from (or, for a memory export, into its
//! mapping), and starts the request. A request whose stack never waits runs right there;
//! others go to the dispatcher (the worker pool, or an asynchronous backend), which hands the
//! reply back. Replies are queued for the connection's writer (`writer.rs`), a thread of its
//! own, so no worker ever waits on a client's socket; when every request runs on the reader,
//! the reader sends the queued replies itself whenever its next read would wait, and there is
//! no writer thread. A memory export's reads are sent from its mapping (`mapped.rs`).

mod conn;
mod mapped;
mod reader;
mod writer;

use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::debug;

use super::budget::SharedBudget;
use super::memory::MemoryBudget;
use super::poll::PollWindow;
use super::wait_trial::{Wait, WaitTrial};
use super::{log_idle_timeout, Attachment, Engine};
use crate::limits::Limits;
use conn::ConnState;
use reader::{read_requests, Direct, RequestReader, IDLE};
use writer::ReplyQueue;

/// The portable engine: no threads of its own; each connection runs on the thread that
/// attaches it.
#[derive(Debug)]
pub struct PortableEngine {
    limits: Limits,
    /// The buffer memory all connections together may hold.
    memory: Arc<MemoryBudget>,
    /// Set when the server shuts down: readers take no further request.
    stopping: Arc<AtomicBool>,
    /// How long a connection whose requests all run on its reader polls before sleeping.
    poll_max: Duration,
    /// How long such a connection's reader holds replies for more requests at most, while
    /// trials say it pays (zero: never).
    coalesce_max: Duration,
}

impl PortableEngine {
    /// An engine under `limits` and `memory`; readers stop taking requests once `stopping`
    /// is set, and poll up to `poll_max` before sleeping (and hold replies up to
    /// `coalesce_max` for more requests) where they answer every request.
    pub fn new(
        limits: Limits,
        memory: Arc<MemoryBudget>,
        stopping: Arc<AtomicBool>,
        poll_max: Duration,
        coalesce_max: Duration,
    ) -> PortableEngine {
        PortableEngine {
            limits,
            memory,
            stopping,
            poll_max,
            coalesce_max,
        }
    }
}

impl Engine for PortableEngine {
    /// Runs the connection's transmission phase on this thread; returns once it is closed.
    fn attach(&self, conn: Attachment) -> Result<(), Box<Attachment>> {
        let peer = conn.peer.clone();
        if let Err(e) = self.transmission(conn) {
            debug!(%peer, "connection ended: {e}");
        }
        Ok(())
    }

    /// Nothing to wait for here: each connection ends with the thread that runs it, which the
    /// server joins.
    fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }
}

impl PortableEngine {
    /// One connection's transmission phase, from the first request to close.
    fn transmission(&self, conn: Attachment) -> io::Result<()> {
        let Attachment {
            channel,
            dispatcher,
            leftover,
            detach,
            ..
        } = conn;
        let limits = &self.limits;
        let idle = limits
            .idle_timeout_ms
            .map(|ms| Duration::from_millis(ms.max(1)));
        channel.socket().set_read_timeout(idle)?;
        let stack = &dispatcher.stack;
        let conn = Arc::new(ConnState {
            replies: ReplyQueue::default(),
            inflight: SharedBudget::new(limits, Arc::clone(&self.memory)),
            inline: stack.never_waits() && !stack.is_asynchronous(),
            in_place: mapped::is_memory(stack),
            mapped_min: mapped::min_len(&channel, stack),
            dispatcher: Arc::new(dispatcher),
        });
        let (inbound, outbound) = channel.split()?;
        let write_timeout_ms = limits.write_timeout_ms;
        // When every request runs on the reader, the reader sends the replies too: no
        // hand-off to a writer thread and back, and under TLS no contention with one for the
        // session. Otherwise a writer thread sends them, so no worker or backend completion
        // ever waits on the client's socket.
        let (direct, writer) = if conn.inline {
            let writer = conn.writer(write_timeout_ms);
            writer.prepare(&outbound);
            let direct = Direct {
                writer,
                out: outbound,
                poll: PollWindow::new(self.poll_max),
                stats: Arc::clone(&conn.dispatcher.stats),
                started: 0,
                polls_here: false,
                in_short_payload: false,
                trial: WaitTrial::new(Instant::now(), !self.coalesce_max.is_zero(), true),
                wait: Wait::Sleep,
                coalesce_max: self.coalesce_max,
                holding: None,
            };
            (Some(direct), None)
        } else {
            let writer_conn = Arc::clone(&conn);
            let thread = std::thread::Builder::new()
                .name("conn-writer".into())
                .spawn(move || writer_conn.writer(write_timeout_ms).run(outbound))?;
            (None, Some(thread))
        };
        let mut reader = RequestReader::new(inbound, leftover, direct);
        let result = read_requests(&self.stopping, &conn, &mut reader);
        if let (Err(e), Some(ms)) = (&result, limits.idle_timeout_ms) {
            if e.to_string() == IDLE {
                log_idle_timeout(ms);
            }
        }
        // "The server MUST handle all outstanding requests" before closing.
        reader.finish();
        conn.inflight.wait_idle();
        conn.replies.close();
        if let Some(writer) = writer {
            let _ = writer.join();
        }
        let _ = reader.socket().shutdown(Shutdown::Both);
        drop(detach);
        result
    }
}
