//! The transmission engines: what a connection does once its handshake has attached it to an
//! export. Two engines of the same shape behind one small interface ([`Engine`]: take a
//! negotiated connection; stop): `portable/` (a blocking reader per connection, the worker
//! pool, a writer thread where replies come from other threads) and `uring/` (thread-per-core
//! io_uring rings). Both run every request through its export's stack, by the dispatcher
//! (`crate::dispatch`) or by a map of where its bytes live, under one in-flight budget
//! (`budget.rs`); `options.rs` holds what chooses between them and their mechanisms.

pub mod budget;
pub mod memory;
pub mod options;
pub mod poll;
pub mod portable;
pub mod uring;
pub mod wait_trial;

use std::any::Any;

use tracing::{info, warn};
use zcnbd_proto::TransmissionContext;

use crate::dispatch::Dispatcher;
use crate::session::channel::Channel;

/// Scratch space for dropping the payload of a refused request.
pub const DISCARD_BYTES: usize = 16 * 1024;

/// A connection whose handshake attached it to an export: what an engine takes.
pub struct Attachment {
    /// Who the client is, for the log.
    pub peer: String,
    /// Its bytes: the socket, or a TLS session over it.
    pub channel: Channel,
    /// What its requests are validated against.
    pub ctx: TransmissionContext,
    /// Runs its requests against the export's stack.
    pub dispatcher: Dispatcher,
    /// Request bytes that arrived with the handshake's last option: the first requests.
    pub leftover: Vec<u8>,
    /// What the server keeps for the attached client (its admission ticket, its entry among
    /// the live sockets, its export), given back by dropping it once the connection is closed.
    pub detach: Box<dyn Any + Send>,
}

/// A transmission engine.
pub trait Engine: Send + Sync {
    /// Takes `conn`'s transmission phase. Returns once the engine has it (the portable engine
    /// runs it on the calling thread, so: once it is closed), or gives it back when this engine
    /// cannot serve it (the io_uring engine sends plain bytes only: a TLS session whose records
    /// are made in user space).
    fn attach(&self, conn: Attachment) -> Result<(), Box<Attachment>>;
    /// Stops: returns once every connection it serves is closed.
    fn stop(&self);
}

/// Logs a client cut off for taking no reply bytes for `write_timeout_ms`.
pub fn log_write_timeout(write_timeout_ms: u64) {
    warn!(
        write_timeout_ms,
        "client read no reply bytes within the write timeout: disconnecting"
    );
}

/// Logs a client cut off for sending nothing for `payload_timeout_ms` inside a payload.
pub fn log_payload_timeout(payload_timeout_ms: u64) {
    warn!(
        payload_timeout_ms,
        "client stopped in the middle of a write's payload: disconnecting"
    );
}

/// Logs a client cut off for sending nothing for `idle_timeout_ms` with nothing in flight.
pub fn log_idle_timeout(idle_timeout_ms: u64) {
    info!(idle_timeout_ms, "client idle: disconnecting");
}
