//! Admission: who may hold the server's resources, so that idle connections cannot lock out
//! real clients.
//!
//! Two budgets, as sshd keeps `MaxStartups` apart from its sessions:
//! - **Handshakes** (`handshakes_max`): connections that have not attached to an export yet.
//!   A new connection is always admitted; when the budget is full, the handshake that has been
//!   silent longest is closed to make room (a real client finishes its handshake in a few
//!   round trips, an idle one never does, so the idle one is the one that goes).
//! - **Attached clients** (`connections_max` for the server, and each export's
//!   `clients_max`): checked when the client asks to attach (`NBD_OPT_GO` or
//!   `NBD_OPT_EXPORT_NAME`); a client over a limit is refused then, and the log says which.
//!   An export's count lives with the export (`export_set.rs`), so a reload that adds an
//!   export brings its count and one that keeps an export keeps its count.
//!
//! Each place is held by a ticket whose drop gives it back, so no path can leak one.

use std::collections::HashMap;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tracing::warn;

use crate::stream::Stream;

/// The admission state of one server.
#[derive(Debug)]
pub struct Admission {
    handshakes_max: usize,
    connections_max: usize,
    handshakes: Mutex<HashMap<u64, Handshaking>>,
    next_id: AtomicU64,
    attached: AtomicUsize,
    epoch: Instant,
}

/// A connection in its handshake, as admission sees it.
#[derive(Debug)]
struct Handshaking {
    /// Another handle to the socket, to close it when evicted.
    socket: Stream,
    peer: String,
    /// Milliseconds since `epoch` when the client last sent a byte (or connected).
    active_ms: Arc<AtomicU64>,
}

/// Why a client may not attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `connections_max` clients are attached already.
    #[error("connection limit ({0}) reached")]
    Connections(usize),
    /// The export's `connections_max` clients are attached already.
    #[error("export's client limit ({0}) reached")]
    Export(usize),
}

impl Admission {
    /// Admission with these budgets.
    pub fn new(handshakes_max: usize, connections_max: usize) -> Admission {
        Admission {
            handshakes_max: handshakes_max.max(1),
            connections_max,
            handshakes: Mutex::default(),
            next_id: AtomicU64::new(0),
            attached: AtomicUsize::new(0),
            epoch: Instant::now(),
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<u64, Handshaking>> {
        self.handshakes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Admits a new connection to the handshake budget, closing the longest-silent handshake
    /// if the budget is full. `socket` is another handle to the connection's socket.
    pub fn begin_handshake(self: &Arc<Self>, socket: Stream, peer: &str) -> HandshakeTicket {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let active_ms = Arc::new(AtomicU64::new(self.now_ms()));
        let mut table = self.table();
        while table.len() >= self.handshakes_max {
            let Some(oldest) = table
                .iter()
                .min_by_key(|(_, h)| h.active_ms.load(Ordering::Relaxed))
                .map(|(id, _)| *id)
            else {
                break;
            };
            if let Some(evicted) = table.remove(&oldest) {
                let idle_ms =
                    self.now_ms() - evicted.active_ms.load(Ordering::Relaxed).min(self.now_ms());
                warn!(
                    peer = %evicted.peer,
                    idle_ms,
                    "handshake limit ({}) reached: closing the longest-silent handshake",
                    self.handshakes_max
                );
                let _ = evicted.socket.shutdown(Shutdown::Both);
            }
        }
        let entry = Handshaking {
            socket,
            peer: peer.to_owned(),
            active_ms: Arc::clone(&active_ms),
        };
        table.insert(id, entry);
        HandshakeTicket {
            admission: Arc::clone(self),
            id,
            active_ms,
        }
    }

    /// Takes a place for one more client attached to an export whose clients `export`
    /// counts and `export_max` limits, or says which limit refuses it.
    pub fn attach(
        self: &Arc<Self>,
        export: &Arc<AtomicUsize>,
        export_max: Option<usize>,
    ) -> Result<AttachTicket, Refusal> {
        let taken = self
            .attached
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.connections_max).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Refusal::Connections(self.connections_max));
        }
        let mut ticket = AttachTicket {
            admission: Arc::clone(self),
            export: None,
        };
        let max = export_max.unwrap_or(usize::MAX);
        if export
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_err()
        {
            // Dropping the ticket gives the server-wide place back.
            return Err(Refusal::Export(max));
        }
        ticket.export = Some(Arc::clone(export));
        Ok(ticket)
    }

    /// Clients attached now.
    pub fn attached(&self) -> usize {
        self.attached.load(Ordering::Relaxed)
    }

    /// Connections in their handshake now.
    #[cfg(test)]
    pub fn handshaking(&self) -> usize {
        self.table().len()
    }
}

/// A connection's place in the handshake budget; dropped when the handshake ends.
#[derive(Debug)]
pub struct HandshakeTicket {
    admission: Arc<Admission>,
    id: u64,
    active_ms: Arc<AtomicU64>,
}

impl HandshakeTicket {
    /// The client sent something: it is not idle.
    pub fn touch(&self) {
        self.active_ms
            .store(self.admission.now_ms(), Ordering::Relaxed);
    }
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        self.admission.table().remove(&self.id);
    }
}

/// An attached client's place; dropped when the client detaches.
#[derive(Debug)]
pub struct AttachTicket {
    admission: Arc<Admission>,
    /// The export's count, once this ticket holds a place in it.
    export: Option<Arc<AtomicUsize>>,
}

impl Drop for AttachTicket {
    fn drop(&mut self) {
        self.admission.attached.fetch_sub(1, Ordering::AcqRel);
        if let Some(export) = &self.export {
            export.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn socket() -> (Stream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Stream::Unix(a), b)
    }

    #[test]
    fn a_full_handshake_budget_closes_the_longest_silent_one() {
        let admission = Arc::new(Admission::new(2, 10));
        let (a, peer_a) = socket();
        let first = admission.begin_handshake(a, "a");
        std::thread::sleep(std::time::Duration::from_millis(5));
        let (b, peer_b) = socket();
        let _second = admission.begin_handshake(b, "b");
        std::thread::sleep(std::time::Duration::from_millis(5));
        // The older one spoke last: the silent newer one goes.
        first.touch();
        let (c, _peer_c) = socket();
        let _third = admission.begin_handshake(c, "c");
        assert_eq!(admission.handshaking(), 2);
        let mut byte = [0u8; 1];
        use std::io::Read;
        assert_eq!((&peer_b).read(&mut byte).unwrap(), 0, "b was closed");
        peer_a.set_nonblocking(true).unwrap();
        assert!((&peer_a).read(&mut byte).is_err(), "a is still open");
        drop(first);
        assert_eq!(admission.handshaking(), 1);
    }

    #[test]
    fn attach_limits_server_wide_and_per_export_and_tickets_give_back() {
        let admission = Arc::new(Admission::new(4, 3));
        let (limited, free) = (Arc::default(), Arc::default());
        let one = admission.attach(&limited, Some(1)).unwrap();
        assert_eq!(
            admission.attach(&limited, Some(1)).unwrap_err(),
            Refusal::Export(1)
        );
        let two = admission.attach(&free, None).unwrap();
        let three = admission.attach(&free, None).unwrap();
        assert_eq!(
            admission.attach(&free, None).unwrap_err(),
            Refusal::Connections(3)
        );
        assert_eq!(admission.attached(), 3);
        assert_eq!(free.load(Ordering::Relaxed), 2);
        drop(one);
        let _again = admission.attach(&limited, Some(1)).unwrap();
        drop((two, three));
        assert_eq!(admission.attached(), 1);
        assert_eq!(free.load(Ordering::Relaxed), 0);
    }
}
