//! One client's connection, from accept to close: a place in the handshake budget, the
//! handshake (`crate::session`, with a narrow context), then the transmission phase on an
//! engine - the io_uring engine if there is one and it takes the connection, else the
//! portable engine on this thread. The server keeps a handle to each live socket, to stop it
//! at shutdown.

use std::collections::HashMap;
use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{debug, info, warn};

use super::Server;
use crate::dispatch::Dispatcher;
use crate::engine::{Attachment, Engine};
use crate::export_set::Offered;
use crate::session::admission::AttachTicket;
use crate::session::{self, transmission_context, Attached, SessionContext};
use crate::stream::Stream;

impl Server {
    /// Serves one client on `stream`, from handshake to close; returns once it is closed.
    /// The connection takes a place in the handshake budget first (see
    /// [`Limits::handshakes_max`](crate::Limits::handshakes_max)).
    pub fn serve_stream(self: &Arc<Self>, stream: Stream, peer: &str) {
        let (done, closed) = crossbeam_channel::bounded(1);
        self.start_session(stream, peer, Some(done));
        // Sent, or dropped unsent, once the connection is closed.
        let _ = closed.recv();
    }

    /// Runs one client's handshake in the calling thread, then its transmission phase here
    /// (portable engine) or on a ring (io_uring engine: this returns once the connection is
    /// handed over). `done` is signalled once the connection is closed.
    pub(crate) fn start_session(
        self: &Arc<Self>,
        stream: Stream,
        peer: &str,
        done: Option<crossbeam_channel::Sender<()>>,
    ) {
        let (Ok(handle), Ok(budget_handle)) = (stream.try_clone(), stream.try_clone()) else {
            warn!(%peer, "cannot duplicate the socket: closing");
            return;
        };
        let ticket = self.admission.begin_handshake(budget_handle, peer);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.live.lock().insert(id, handle);
        let closed = Closed {
            live: Arc::clone(&self.live),
            id,
            done,
        };
        if let Err(e) = stream.set_blocking() {
            return warn!(%peer, "cannot configure socket: {e}");
        }
        let context = self.session_context();
        let attached = session::handshake(&context, stream, peer, &ticket);
        drop(ticket);
        let attached = match attached {
            Ok(Some(attached)) => attached,
            Ok(None) => return debug!(%peer, "handshake ended without transmission"),
            Err(e) => return debug!(%peer, "handshake failed: {e}"),
        };
        self.transmit(attached, peer, closed);
    }

    /// What a handshake needs of the server.
    fn session_context(&self) -> SessionContext<'_> {
        SessionContext {
            limits: &self.limits,
            exports: &self.exports,
            admission: &self.admission,
            tls: self.tls(),
            kernel_tls: self.kernel_tls,
            stats: &self.stats,
            stopping: &self.shutting_down,
        }
    }

    /// Hands an attached client to an engine: the io_uring engine if it takes it, else the
    /// portable engine (which returns once the connection is closed).
    fn transmit(&self, attached: Attached, peer: &str, closed: Closed) {
        let Attached {
            negotiated,
            export,
            leftover,
            ticket,
            channel,
        } = attached;
        let clients = self.admission.attached();
        let (tls, name) = (channel.is_tls(), export.name());
        info!(%peer, export = %name, mode = ?negotiated.mode, tls, clients, "client attached");
        let ctx = transmission_context(&export, &negotiated);
        let dispatcher = Dispatcher::new(
            Arc::clone(&export.export.stack),
            ctx,
            Arc::clone(&self.pool),
            Arc::clone(&self.stats),
            &self.workers,
            export.info.meta_contexts.clone(),
        );
        let detach = Detach {
            peer: peer.to_owned(),
            _ticket: ticket,
            _closed: closed,
            _export: export,
        };
        let mut conn = Attachment {
            peer: peer.to_owned(),
            channel,
            ctx,
            dispatcher,
            leftover,
            detach: Box::new(detach),
        };
        if let Some(uring) = &self.engine {
            conn = match uring.attach(conn) {
                Ok(()) => return,
                Err(conn) => *conn,
            };
        }
        // The portable engine takes every connection.
        let _ = self.portable.attach(conn);
    }
}

/// What an attached client holds until its connection is closed: its place among the
/// attached (admission) and among the live sockets, and its export (which a reload may have
/// removed: the last client's `Detach` closes it). Dropping it logs the detach.
struct Detach {
    peer: String,
    _ticket: AttachTicket,
    _closed: Closed,
    _export: Arc<Offered>,
}

impl Drop for Detach {
    fn drop(&mut self) {
        info!(peer = %self.peer, "client detached");
    }
}

/// Every live connection's socket, by connection id.
#[derive(Debug, Default)]
pub(crate) struct LiveSockets(Mutex<HashMap<u64, Stream>>);

impl LiveSockets {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Stream>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shuts every live socket's receiving side: readers see end-of-stream and stop taking
    /// requests; replies still go out.
    pub(crate) fn shut_reads(&self) {
        for stream in self.lock().values() {
            let _ = stream.shutdown(Shutdown::Read);
        }
    }
}

/// A connection's entry among the live sockets, removed (and `done` signalled) when this is
/// dropped: when the connection is closed, on whichever thread closes it.
pub(crate) struct Closed {
    live: Arc<LiveSockets>,
    id: u64,
    done: Option<crossbeam_channel::Sender<()>>,
}

impl Drop for Closed {
    fn drop(&mut self) {
        self.live.lock().remove(&self.id);
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
    }
}
