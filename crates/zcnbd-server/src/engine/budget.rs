//! A connection's in-flight budget, one rule for both engines: the requests it has accepted
//! and not yet answered, and the buffer bytes they hold, against `requests_inflight_max` and
//! `inflight_bytes_max`. While there is no room an engine reads no further request from that
//! client, so a client that stops reading its replies stops only itself.
//!
//! The rule ([`Budget::has_room`]): a request holding `bytes` is taken while fewer than
//! `requests_inflight_max` are in flight and the bytes held stay within `inflight_bytes_max`;
//! a request larger than the byte limit is still taken when nothing else is in flight.
//!
//! Every byte held also counts against the server-wide [`MemoryBudget`] (`memory.rs`), which
//! can make a request wait although its connection has room.
//!
//! Invariant: `held` is the sum of what the requests counted in `inflight` hold, and what the
//! memory budget counts for this connection is what `held` takes beyond its reserve.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::memory::MemoryBudget;
use crate::limits::Limits;

/// Requests in flight and the bytes they hold: the io_uring engine keeps one per connection
/// on its ring thread; the portable engine shares one between threads ([`SharedBudget`]).
#[derive(Debug)]
pub struct Budget {
    /// Requests accepted and not yet answered (sent, or dropped because broken).
    inflight: usize,
    /// Buffer bytes those requests hold.
    held: usize,
    requests_max: usize,
    bytes_max: usize,
    /// The server-wide budget every byte held also counts against.
    memory: Arc<MemoryBudget>,
}

impl Budget {
    /// An empty budget with the limits of `limits`, drawing on `memory`.
    pub fn new(limits: &Limits, memory: Arc<MemoryBudget>) -> Budget {
        Budget {
            inflight: 0,
            held: 0,
            requests_max: limits.requests_inflight_max,
            bytes_max: limits.inflight_bytes_max,
            memory,
        }
    }

    /// Whether a request holding `bytes` fits this connection's own limits (0 when its size
    /// is not known yet: before its header is read).
    pub fn fits(&self, bytes: usize) -> bool {
        self.inflight < self.requests_max
            && (self.inflight == 0 || self.held.saturating_add(bytes) <= self.bytes_max)
    }

    /// Whether a request holding `bytes` may be taken now: it fits, and the server's memory
    /// has room for it.
    pub fn has_room(&self, bytes: usize) -> bool {
        self.fits(bytes) && self.memory_room(bytes)
    }

    /// Whether the server's memory has room for `bytes` more held here.
    pub fn memory_room(&self, bytes: usize) -> bool {
        self.memory.has_room(self.held, bytes)
    }

    /// The server-wide budget this one draws on.
    pub fn memory(&self) -> &Arc<MemoryBudget> {
        &self.memory
    }

    /// Requests accepted and not yet answered.
    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// One more request is accepted (it holds nothing yet).
    pub fn accept(&mut self) {
        self.inflight += 1;
    }

    /// A request in flight takes `bytes` more of buffer (checked with
    /// [`Budget::memory_room`] when the request started).
    pub fn hold(&mut self, bytes: usize) {
        self.memory.force(self.held, bytes);
        self.held += bytes;
    }

    /// Takes `bytes` more of buffer if the server's memory gives them; false (nothing taken)
    /// if not.
    pub fn try_hold(&mut self, bytes: usize) -> bool {
        let taken = self.memory.take(self.held, bytes);
        if taken {
            self.held += bytes;
        }
        taken
    }

    /// A request is answered or dropped, giving back the `held` bytes it held.
    pub fn retire(&mut self, held: usize) {
        self.memory.give(self.held, held);
        self.inflight -= 1;
        self.held -= held;
    }
}

/// A [`Budget`] shared by a connection's threads (the portable engine's reader, the workers
/// and the writer): the reader waits in [`SharedBudget::acquire`] while there is no room.
#[derive(Debug)]
pub struct SharedBudget {
    budget: Mutex<Guarded>,
    changed: Condvar,
    memory: Arc<MemoryBudget>,
}

/// The budget and who waits for it to change.
///
/// Invariant: `waiters` counts the threads between deciding to wait (under the lock) and
/// waking: a release wakes them only when there are any, so the common release (nobody
/// waits) costs no futex system call (the standard condition variable makes one per
/// notify, waiters or not: one per request answered, measured).
#[derive(Debug)]
struct Guarded {
    budget: Budget,
    waiters: usize,
}

impl std::ops::Deref for Guarded {
    type Target = Budget;

    fn deref(&self) -> &Budget {
        &self.budget
    }
}

impl std::ops::DerefMut for Guarded {
    fn deref_mut(&mut self) -> &mut Budget {
        &mut self.budget
    }
}

impl SharedBudget {
    /// An empty budget with the limits of `limits`, drawing on `memory`.
    pub fn new(limits: &Limits, memory: Arc<MemoryBudget>) -> SharedBudget {
        SharedBudget {
            budget: Mutex::new(Guarded {
                budget: Budget::new(limits, Arc::clone(&memory)),
                waiters: 0,
            }),
            changed: Condvar::new(),
            memory,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Guarded> {
        self.budget.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the next change (registered as a waiter while it sleeps).
    fn wait<'a>(&self, mut guard: MutexGuard<'a, Guarded>) -> MutexGuard<'a, Guarded> {
        guard.waiters += 1;
        let mut guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
        guard.waiters -= 1;
        guard
    }

    /// Waits for room, then takes one more request holding `bytes`: room in this
    /// connection's limits (given back by its own releases), then in the server's memory
    /// (given back by any connection).
    pub fn acquire(&self, bytes: usize) {
        let mut waiting = false;
        loop {
            let mut budget = self.lock();
            while !budget.fits(bytes) {
                budget = self.wait(budget);
            }
            if budget.try_hold(bytes) {
                budget.accept();
                if waiting {
                    self.memory.stop_waiting();
                }
                return;
            }
            drop(budget);
            if !waiting {
                self.memory.start_waiting();
                waiting = true;
            }
            self.memory.wait();
        }
    }

    /// Whether `acquire(bytes)` would return without waiting.
    pub fn has_room(&self, bytes: usize) -> bool {
        self.lock().has_room(bytes)
    }

    /// Gives back what `acquire(bytes)` took.
    pub fn release(&self, bytes: usize) {
        let mut budget = self.lock();
        budget.retire(bytes);
        let waiters = budget.waiters;
        drop(budget);
        if waiters > 0 {
            self.changed.notify_all();
        }
    }

    /// Requests in flight now.
    pub fn requests(&self) -> usize {
        self.lock().inflight()
    }

    /// Whether nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.requests() == 0
    }

    /// Waits until nothing is in flight.
    pub fn wait_idle(&self) {
        let mut budget = self.lock();
        while budget.inflight() > 0 {
            budget = self.wait(budget);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn limits(requests: usize, bytes: usize) -> Limits {
        Limits {
            requests_inflight_max: requests,
            inflight_bytes_max: bytes,
            ..Limits::default()
        }
    }

    fn memory(limits: &Limits) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget::new(limits))
    }

    #[test]
    fn full_on_either_limit() {
        let l = limits(2, 100);
        let mut budget = Budget::new(&l, memory(&l));
        assert!(budget.has_room(0));
        budget.accept();
        budget.hold(100);
        assert!(budget.has_room(0), "exactly at the byte limit");
        assert!(!budget.has_room(1));
        budget.retire(100);
        budget.accept();
        budget.accept();
        assert!(!budget.has_room(0));
        budget.retire(0);
        assert_eq!(budget.inflight(), 1);
        assert!(budget.has_room(0));
    }

    #[test]
    fn an_oversized_request_is_taken_alone() {
        let l = limits(4, 100);
        let mut budget = Budget::new(&l, memory(&l));
        assert!(budget.has_room(1000));
        budget.accept();
        budget.hold(1000);
        assert!(!budget.has_room(0));
        budget.retire(1000);
        let shared = SharedBudget::new(&l, memory(&l));
        shared.acquire(1000);
        shared.release(1000);
        shared.wait_idle();
    }

    #[test]
    fn acquire_waits_at_the_request_limit_until_a_release() {
        let l = limits(1, 1 << 20);
        let shared = Arc::new(SharedBudget::new(&l, memory(&l)));
        shared.acquire(10);
        let other = Arc::clone(&shared);
        let t = std::thread::spawn(move || other.acquire(10));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!t.is_finished());
        shared.release(10);
        t.join().unwrap();
        shared.release(10);
        shared.wait_idle();
        assert!(shared.is_idle());
    }

    #[test]
    fn the_servers_memory_makes_a_reader_wait_until_any_connection_gives_back() {
        let l = Limits {
            buffers_bytes_max: 4 << 20,
            connections_max: 2,
            ..Limits::default()
        };
        let memory = memory(&l);
        let (stalled, good) = (
            Arc::new(SharedBudget::new(&l, Arc::clone(&memory))),
            SharedBudget::new(&l, Arc::clone(&memory)),
        );
        // The stalled client holds its reserve and all that is shared.
        stalled.acquire(3 << 20);
        assert!(!stalled.has_room(1));
        // A well-behaved one still has its reserve.
        good.acquire(1 << 20);
        good.release(1 << 20);
        let other = Arc::clone(&stalled);
        let t = std::thread::spawn(move || other.acquire(2 << 20));
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert!(!t.is_finished(), "took memory that was not there");
        stalled.release(3 << 20);
        t.join().unwrap();
        assert_eq!(memory.waits(), 1);
    }
}
