//! The connection's request budget: requests accepted and not yet answered, and the buffer
//! bytes they hold, against `requests_inflight_max` and `inflight_bytes_max`. While it is
//! full the receive side reads no further request.
//!
//! Invariant: `held` is the sum of what the requests counted in `inflight` hold.

use crate::server::Limits;

/// Requests in flight and the bytes they hold.
#[derive(Debug, Default)]
pub(super) struct Budget {
    /// Requests accepted and not yet answered (sent, or dropped because broken).
    inflight: usize,
    /// Buffer bytes those requests hold.
    held: usize,
}

impl Budget {
    /// Whether another request may be read.
    pub fn has_room(&self, limits: &Limits) -> bool {
        self.inflight < limits.requests_inflight_max && self.held < limits.inflight_bytes_max
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_on_either_limit() {
        let limits = Limits {
            requests_inflight_max: 2,
            inflight_bytes_max: 100,
            ..Limits::default()
        };
        let mut budget = Budget::default();
        assert!(budget.has_room(&limits));
        budget.accept();
        budget.hold(100);
        assert!(!budget.has_room(&limits));
        budget.retire(100);
        budget.accept();
        budget.accept();
        assert!(!budget.has_room(&limits));
        budget.retire(0);
        assert_eq!(budget.inflight(), 1);
        assert!(budget.has_room(&limits));
    }
}
