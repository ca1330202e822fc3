//! Per-connection limit on requests in flight and the payload bytes they hold.

use std::sync::{Condvar, Mutex};

/// Counts a connection's requests in flight; `acquire` blocks the reader at the limits.
#[derive(Debug)]
pub struct Inflight {
    state: Mutex<Used>,
    changed: Condvar,
    requests_max: usize,
    bytes_max: usize,
}

#[derive(Debug, Default)]
struct Used {
    requests: usize,
    bytes: usize,
}

impl Inflight {
    /// At most `requests_max` requests holding at most `bytes_max` bytes (a single request
    /// larger than `bytes_max` is still admitted when nothing else is in flight).
    pub fn new(requests_max: usize, bytes_max: usize) -> Self {
        Inflight {
            state: Mutex::default(),
            changed: Condvar::new(),
            requests_max,
            bytes_max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Used> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for room for one more request holding `bytes`.
    pub fn acquire(&self, bytes: usize) {
        let mut used = self.lock();
        while self.full(&used, bytes) {
            used = self.changed.wait(used).unwrap_or_else(|e| e.into_inner());
        }
        used.requests += 1;
        used.bytes += bytes;
    }

    /// Whether `acquire(bytes)` would return without waiting.
    pub fn has_room(&self, bytes: usize) -> bool {
        !self.full(&self.lock(), bytes)
    }

    /// Whether one more request holding `bytes` must wait.
    fn full(&self, used: &Used, bytes: usize) -> bool {
        used.requests >= self.requests_max
            || (used.requests > 0 && used.bytes + bytes > self.bytes_max)
    }

    /// Returns what `acquire(bytes)` took.
    pub fn release(&self, bytes: usize) {
        let mut used = self.lock();
        used.requests -= 1;
        used.bytes -= bytes;
        self.changed.notify_all();
    }

    /// Requests in flight now.
    pub fn requests(&self) -> usize {
        self.lock().requests
    }

    /// Whether nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.requests() == 0
    }

    /// Waits until nothing is in flight.
    pub fn wait_idle(&self) {
        let mut used = self.lock();
        while used.requests > 0 {
            used = self.changed.wait(used).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn blocks_at_the_request_limit_until_release() {
        let f = Arc::new(Inflight::new(1, 1 << 20));
        f.acquire(10);
        let g = Arc::clone(&f);
        let t = std::thread::spawn(move || g.acquire(10));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!t.is_finished());
        f.release(10);
        t.join().unwrap();
        f.release(10);
        f.wait_idle();
    }

    #[test]
    fn oversized_request_is_admitted_alone() {
        let f = Inflight::new(4, 100);
        f.acquire(1000);
        f.release(1000);
        f.wait_idle();
    }
}
