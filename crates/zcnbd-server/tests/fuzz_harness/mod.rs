//! Fuzz harness bodies shared by the cargo-fuzz targets in `fuzz/` and by the regression test
//! `tests/fuzz_regressions.rs`, so every crashing input the fuzzer finds is replayed by
//! `cargo test` through exactly the code that found it.
//!
//! Each entry point takes arbitrary bytes and panics if, and only if, an invariant breaks:
//! a panic in the code under test, or a check here (round trips, output framing, one reply
//! per request). Hangs are caught by the caller: libFuzzer's `-timeout`, or the regression
//! test's deadline.

pub mod answer;
pub mod client;
pub mod fixture;
pub mod handshake;
pub mod image;
pub mod reply;
pub mod request;
pub mod session;
pub mod transcript;

/// A fuzz target: its directory name under `fuzz/regressions/` and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, by the name cargo-fuzz knows it by.
pub const TARGETS: [Target; 8] = [
    ("handshake", handshake::run),
    ("handshake_tls", handshake::run_tls),
    ("request", request::run),
    ("reply", reply::run),
    ("session", session::run),
    ("client_session", client::run_session),
    ("client_handshake", client::run_handshake),
    ("image", image::run),
];

/// Reads fuzz bytes as parameters: big-endian integers that run out as zeroes, so every input,
/// however short, means something.
#[derive(Debug, Clone)]
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    /// Parameters drawn from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data }
    }

    /// The next `n` bytes (fewer if the input ends).
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.data.split_at(n.min(self.data.len()));
        self.data = tail;
        head
    }

    /// The next byte, or 0.
    pub fn u8(&mut self) -> u8 {
        self.take(1).first().copied().unwrap_or(0)
    }

    /// The next big-endian u32, zero-padded.
    pub fn u32(&mut self) -> u32 {
        self.uint(4) as u32
    }

    /// The next big-endian u64, zero-padded.
    pub fn u64(&mut self) -> u64 {
        self.uint(8)
    }

    fn uint(&mut self, n: usize) -> u64 {
        let mut v = 0u64;
        for (i, b) in self.take(n).iter().enumerate() {
            v |= u64::from(*b) << (8 * (n - 1 - i));
        }
        v
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.take(self.data.len())
    }
}
