//! Counters of what the client did, to prove the data path: read data received straight
//! into callers' buffers versus anywhere else.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Live counters, shared by a client's connections.
#[derive(Debug, Default)]
pub struct Stats {
    requests: AtomicU64,
    received_in_place_bytes: AtomicU64,
    spliced_bytes: AtomicU64,
    zeroed_bytes: AtomicU64,
    written_bytes: AtomicU64,
    discarded_bytes: AtomicU64,
    copied_bytes: AtomicU64,
    syscalls: AtomicU64,
    tls_encrypted_bytes: AtomicU64,
    tls_decrypted_bytes: AtomicU64,
}

/// A snapshot of the client's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Operations submitted.
    pub requests: u64,
    /// Read data received by the socket call directly into the caller's buffer.
    pub received_in_place_bytes: u64,
    /// Read data spliced from the socket into a caller's pipe (never in user memory).
    pub spliced_bytes: u64,
    /// Bytes of holes filled with zeroes in the caller's buffer.
    pub zeroed_bytes: u64,
    /// Write payload sent from the caller's buffer.
    pub written_bytes: u64,
    /// Read data copied in userspace on its way to a caller: reads under 16 KiB whose
    /// replies came in one receive with others (while no larger read is in flight, a copy
    /// of a few KiB is cheaper than a socket call for each header and payload), or data a
    /// server sent where a header was expected.
    pub copied_bytes: u64,
    /// Read data dropped because its caller stopped waiting.
    pub discarded_bytes: u64,
    /// Socket calls made (sends and receives; waits not counted).
    pub syscalls: u64,
    /// Under TLS: plaintext encrypted from callers' buffers and request headers.
    pub tls_encrypted_bytes: u64,
    /// Under TLS: plaintext decrypted into callers' buffers and reply headers (read data
    /// counts here, not in `received_in_place_bytes`: OpenSSL copies it out of its record
    /// buffer).
    pub tls_decrypted_bytes: u64,
}

impl Stats {
    pub(crate) fn add_requests(&self, n: u64) {
        self.requests.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_received_in_place(&self, n: u64) {
        self.received_in_place_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_spliced(&self, n: u64) {
        self.spliced_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_zeroed(&self, n: u64) {
        self.zeroed_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_written(&self, n: u64) {
        self.written_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_discarded(&self, n: u64) {
        self.discarded_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_copied(&self, n: u64) {
        self.copied_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_syscalls(&self, n: u64) {
        self.syscalls.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_tls_encrypted(&self, n: u64) {
        self.tls_encrypted_bytes.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_tls_decrypted(&self, n: u64) {
        self.tls_decrypted_bytes.fetch_add(n, Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: self.requests.load(Relaxed),
            received_in_place_bytes: self.received_in_place_bytes.load(Relaxed),
            spliced_bytes: self.spliced_bytes.load(Relaxed),
            zeroed_bytes: self.zeroed_bytes.load(Relaxed),
            written_bytes: self.written_bytes.load(Relaxed),
            copied_bytes: self.copied_bytes.load(Relaxed),
            discarded_bytes: self.discarded_bytes.load(Relaxed),
            syscalls: self.syscalls.load(Relaxed),
            tls_encrypted_bytes: self.tls_encrypted_bytes.load(Relaxed),
            tls_decrypted_bytes: self.tls_decrypted_bytes.load(Relaxed),
        }
    }
}
