//! The buffer memory all connections together may hold (`--buffers-max`, [`Limits`]'s
//! `buffers_bytes_max`): read replies waiting to be sent and write payloads waiting to be
//! written. Each connection's own budget (`budget.rs`) bounds one client; this bounds them
//! all, so that many clients that stop reading their replies cannot take the host's memory.
//!
//! Fairness: every connection may always hold its reserve (`reserve`: 1 MiB, less when
//! `connections_max` is large) whatever the others hold, so clients that stall with their
//! budgets full cannot starve a well-behaved one; beyond its reserve a connection draws on
//! what the reserves leave of the limit, shared first come, first served. A request that finds
//! too little waits - the engine reads nothing more from that client - until others give
//! memory back (their replies sent, or their connections cut at the write timeout).
//!
//! The bound: the portable engine takes memory before it holds it; the io_uring engine checks
//! first and takes when the request starts, so two rings may both pass the check: the memory
//! held stays under `buffers_bytes_max` plus one largest payload per ring.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::limits::Limits;

/// Most a connection's reserve is.
pub const RESERVE_BYTES_MAX: usize = 1 << 20;
/// How long a waiting reader sleeps at most before it looks again (a backstop: a release
/// wakes it).
const WAIT_MS_MAX: u64 = 50;
/// At most one log line this often while memory keeps making requests wait.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// What wakes a ring whose connections wait for memory.
pub type Waker = Box<dyn Fn() + Send + Sync>;

/// The server-wide buffer memory budget.
pub struct MemoryBudget {
    /// Bytes held beyond the holders' reserves.
    shared_used: AtomicUsize,
    /// What the reserves leave of the limit.
    shared_max: usize,
    /// What each connection may hold whatever the others hold.
    reserve: usize,
    /// The limit, for the log.
    limit: usize,
    /// Requests waiting for memory now, server-wide.
    waiting: AtomicUsize,
    /// Times a request had to wait (`--stats`).
    waits: AtomicU64,
    /// Readers of the portable engine wait here; the rings' wakers are called on a release.
    waiters: Mutex<Waiters>,
    released: Condvar,
}

#[derive(Default)]
struct Waiters {
    wakers: Vec<Waker>,
    last_log: Option<Instant>,
}

impl std::fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("shared_used", &self.shared_used)
            .field("shared_max", &self.shared_max)
            .field("reserve", &self.reserve)
            .finish_non_exhaustive()
    }
}

impl MemoryBudget {
    /// The budget `limits` set: `buffers_bytes_max` for `connections_max` connections.
    pub fn new(limits: &Limits) -> MemoryBudget {
        let limit = limits.buffers_bytes_max;
        let per_connection = limit / 2 / limits.connections_max.max(1);
        let reserve = per_connection.min(RESERVE_BYTES_MAX);
        MemoryBudget {
            shared_used: AtomicUsize::new(0),
            shared_max: limit.saturating_sub(reserve * limits.connections_max),
            reserve,
            limit,
            waiting: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            waiters: Mutex::default(),
            released: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What of `held` bytes a connection holds lies beyond its reserve.
    fn beyond(&self, held: usize) -> usize {
        held.saturating_sub(self.reserve)
    }

    /// What a connection holding `held` bytes takes from the shared part to hold `more`.
    fn extra(&self, held: usize, more: usize) -> usize {
        self.beyond(held.saturating_add(more)) - self.beyond(held)
    }

    /// Whether a connection holding `held` bytes may hold `more` now.
    pub fn has_room(&self, held: usize, more: usize) -> bool {
        let extra = self.extra(held, more);
        extra == 0 || self.shared_used.load(Ordering::Relaxed) + extra <= self.shared_max
    }

    /// Takes what a connection holding `held` needs to hold `more`; false (nothing taken) if
    /// the shared part cannot give it.
    pub fn take(&self, held: usize, more: usize) -> bool {
        let extra = self.extra(held, more);
        extra == 0
            || self
                .shared_used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    (used + extra <= self.shared_max).then_some(used + extra)
                })
                .is_ok()
    }

    /// Takes it whatever is left (the io_uring engine, after [`MemoryBudget::has_room`]).
    pub fn force(&self, held: usize, more: usize) {
        let extra = self.extra(held, more);
        if extra > 0 {
            self.shared_used.fetch_add(extra, Ordering::AcqRel);
        }
    }

    /// A connection holding `held` gives back `less` of it; waiters are told.
    pub fn give(&self, held: usize, less: usize) {
        let extra = self.beyond(held) - self.beyond(held.saturating_sub(less));
        if extra == 0 {
            return;
        }
        self.shared_used.fetch_sub(extra, Ordering::AcqRel);
        if self.waiting.load(Ordering::Acquire) > 0 {
            let waiters = self.lock();
            for wake in &waiters.wakers {
                wake();
            }
            self.released.notify_all();
        }
    }

    /// A request starts waiting for memory (counted, logged now and then).
    pub fn start_waiting(&self) {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        self.waits.fetch_add(1, Ordering::Relaxed);
        let mut waiters = self.lock();
        let now = Instant::now();
        if waiters.last_log.is_none_or(|t| now - t >= LOG_EVERY) {
            waiters.last_log = Some(now);
            warn!(
                buffers_bytes_max = self.limit,
                reserve_bytes = self.reserve,
                waits = self.waits.load(Ordering::Relaxed),
                "buffer memory for all connections is taken (--buffers-max): requests wait"
            );
        }
    }

    /// A request no longer waits for memory.
    pub fn stop_waiting(&self) {
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }

    /// Sleeps until memory is given back (or a short while has passed).
    pub fn wait(&self) {
        let waiters = self.lock();
        let timeout = Duration::from_millis(WAIT_MS_MAX);
        let _ = self.released.wait_timeout(waiters, timeout);
    }

    /// Calls `wake` whenever memory is given back while requests wait (a ring's mailbox).
    pub fn add_waker(&self, wake: Waker) {
        self.lock().wakers.push(wake);
    }

    /// Times a request waited for memory.
    #[cfg(test)]
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// The limit all connections together may hold (`buffers_bytes_max`).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held beyond reserves now.
    #[cfg(test)]
    pub fn shared_used(&self) -> usize {
        self.shared_used.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: usize, connections: usize) -> MemoryBudget {
        MemoryBudget::new(&Limits {
            buffers_bytes_max: limit,
            connections_max: connections,
            ..Limits::default()
        })
    }

    #[test]
    fn each_connection_keeps_its_reserve_whatever_the_shared_part_holds() {
        let m = budget(8 << 20, 2);
        assert_eq!((m.reserve, m.shared_max), (1 << 20, 6 << 20));
        // A stalled client takes its reserve and all that is shared.
        assert!(m.take(0, 7 << 20));
        assert!(!m.has_room(7 << 20, 1));
        assert!(!m.take(7 << 20, 4096));
        // Another still has its reserve.
        assert!(m.has_room(0, 1 << 20));
        assert!(m.take(0, 1 << 20));
        assert!(!m.take(1 << 20, 1));
        // What the first gives back is shared again.
        m.give(7 << 20, 2 << 20);
        assert_eq!(m.shared_used(), 4 << 20);
        assert!(m.take(1 << 20, 2 << 20));
        assert!(!m.take(3 << 20, 1));
    }

    #[test]
    fn the_reserve_leaves_half_the_limit_shared_for_many_connections() {
        let m = budget(512 << 20, 1024);
        assert_eq!(m.reserve, 256 << 10);
        assert_eq!(m.shared_max, 256 << 20);
    }

    #[test]
    fn a_release_wakes_the_rings() {
        let m = budget(4 << 20, 1);
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        m.add_waker(Box::new(move || {
            let _ = tx.lock().unwrap().send(());
        }));
        assert!(m.take(0, 4 << 20));
        m.give(4 << 20, 1 << 20);
        assert!(rx.try_recv().is_err(), "nobody waited");
        m.start_waiting();
        m.give(3 << 20, 1 << 20);
        assert!(rx.try_recv().is_ok());
        m.stop_waiting();
    }
}
