//! A connection's in-flight budget, one rule for both engines: the requests it has accepted
//! and not yet answered, and the buffer bytes they hold, against `requests_inflight_max` and
//! `inflight_bytes_max`. While there is no room an engine reads no further request from that
//! client, so a client that stops reading its replies stops only itself.
//!
//! The rule ([`Budget::has_room`]): a request holding `bytes` is taken while fewer than
//! `requests_inflight_max` are in flight and the bytes held stay within `inflight_bytes_max`;
//! a request larger than the byte limit is still taken when nothing else is in flight.
//!
//! Invariant: `held` is the sum of what the requests counted in `inflight` hold.

use std::sync::{Condvar, Mutex, MutexGuard};

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
}

impl Budget {
    /// An empty budget with the limits of `limits`.
    pub fn new(limits: &Limits) -> Budget {
        Budget {
            inflight: 0,
            held: 0,
            requests_max: limits.requests_inflight_max,
            bytes_max: limits.inflight_bytes_max,
        }
    }

    /// Whether a request holding `bytes` may be taken now (0 when its size is not known yet:
    /// before its header is read).
    pub fn has_room(&self, bytes: usize) -> bool {
        self.inflight < self.requests_max
            && (self.inflight == 0 || self.held.saturating_add(bytes) <= self.bytes_max)
    }

    /// Requests accepted and not yet answered.
    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// One more request is accepted (it holds nothing yet).
    pub fn accept(&mut self) {
        self.inflight += 1;
    }

    /// A request in flight takes `bytes` more of buffer.
    pub fn hold(&mut self, bytes: usize) {
        self.held += bytes;
    }

    /// A request is answered or dropped, giving back the `held` bytes it held.
    pub fn retire(&mut self, held: usize) {
        self.inflight -= 1;
        self.held -= held;
    }
}

/// A [`Budget`] shared by a connection's threads (the portable engine's reader, the workers
/// and the writer): the reader waits in [`SharedBudget::acquire`] while there is no room.
#[derive(Debug)]
pub struct SharedBudget {
    budget: Mutex<Budget>,
    changed: Condvar,
}

impl SharedBudget {
    /// An empty budget with the limits of `limits`.
    pub fn new(limits: &Limits) -> SharedBudget {
        SharedBudget {
            budget: Mutex::new(Budget::new(limits)),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Budget> {
        self.budget.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for room, then takes one more request holding `bytes`.
    pub fn acquire(&self, bytes: usize) {
        let mut budget = self.lock();
        while !budget.has_room(bytes) {
            budget = self.changed.wait(budget).unwrap_or_else(|e| e.into_inner());
        }
        budget.accept();
        budget.hold(bytes);
    }

    /// Whether `acquire(bytes)` would return without waiting.
    pub fn has_room(&self, bytes: usize) -> bool {
        self.lock().has_room(bytes)
    }

    /// Gives back what `acquire(bytes)` took.
    pub fn release(&self, bytes: usize) {
        self.lock().retire(bytes);
        self.changed.notify_all();
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
            budget = self.changed.wait(budget).unwrap_or_else(|e| e.into_inner());
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

    #[test]
    fn full_on_either_limit() {
        let mut budget = Budget::new(&limits(2, 100));
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
        let mut budget = Budget::new(&limits(4, 100));
        assert!(budget.has_room(1000));
        budget.accept();
        budget.hold(1000);
        assert!(!budget.has_room(0));
        budget.retire(1000);
        let shared = SharedBudget::new(&limits(4, 100));
        shared.acquire(1000);
        shared.release(1000);
        shared.wait_idle();
    }

    #[test]
    fn acquire_waits_at_the_request_limit_until_a_release() {
        let shared = Arc::new(SharedBudget::new(&limits(1, 1 << 20)));
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
}
