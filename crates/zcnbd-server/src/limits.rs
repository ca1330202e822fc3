//! Limits on everything a client can make the server hold, named with unit and kind last.

use zcnbd_proto::HandshakeLimits;

/// Limits on everything a client can make the server hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A client must finish the handshake within this time.
    pub handshake_timeout_ms: u64,
    /// Clients attached to an export at once; more are refused when they ask to attach.
    pub connections_max: usize,
    /// Connections in their handshake at once; when full, a new connection closes the
    /// handshake that has been silent longest (so idle connections cannot lock clients out).
    pub handshakes_max: usize,
    /// A client that takes no reply bytes for this long while replies wait is disconnected.
    pub write_timeout_ms: u64,
    /// A client that sends nothing for this long while none of its requests is in flight is
    /// disconnected (`None`: never).
    pub idle_timeout_ms: Option<u64>,
    /// A client that sends nothing for this long in the middle of a write's payload is
    /// disconnected (io_uring engine: the payload may hold its place in the export, which
    /// other clients' writes, trims and zeroes of those clusters wait for; see
    /// `export/lease.rs`).
    pub payload_timeout_ms: u64,
    /// TCP keepalive: probe a silent client after this long (`None`: off).
    pub keepalive_idle_ms: Option<u64>,
    /// Worker threads running blocking backends' operations (an asynchronous backend runs
    /// its operations on its own threads).
    pub worker_threads: usize,
    /// Requests in flight per connection.
    pub requests_inflight_max: usize,
    /// Payload bytes in flight per connection.
    pub inflight_bytes_max: usize,
    /// Buffer bytes (read replies waiting to be sent, write payloads waiting to be written)
    /// all connections together may hold (`engine/memory.rs`).
    pub buffers_bytes_max: usize,
    /// Idle payload buffers kept for reuse.
    pub pooled_bytes_max: usize,
    /// Handshake limits (option sizes and counts).
    pub handshake: HandshakeLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout_ms: 10_000,
            connections_max: 256,
            handshakes_max: 64,
            write_timeout_ms: 60_000,
            idle_timeout_ms: None,
            payload_timeout_ms: 30_000,
            keepalive_idle_ms: None,
            worker_threads: 16,
            requests_inflight_max: 64,
            inflight_bytes_max: 64 << 20,
            buffers_bytes_max: 512 << 20,
            pooled_bytes_max: 256 << 20,
            handshake: HandshakeLimits::default(),
        }
    }
}
