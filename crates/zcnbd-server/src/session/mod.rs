//! A client's session before transmission: the handshake (`handshake.rs`, over the socket or
//! a TLS session, `channel.rs`) and admission (`admission.rs`: places in the handshake budget
//! and among the attached clients). It takes a narrow [`SessionContext`], not the server: the
//! limits, the exports offered now, admission, the TLS context for this handshake, and the
//! counters.

pub mod admission;
pub mod channel;
mod handshake;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use zcnbd_proto::{Negotiated, TlsPolicy, TransmissionContext};

pub use handshake::{handshake, Attached};

use crate::export_set::{ExportCell, Offered};
use crate::limits::Limits;
use crate::stats::Stats;
use crate::tls::ktls::KernelTls;
use crate::tls::{TlsMode, TlsServer};
use admission::Admission;

/// What a handshake needs of the server.
pub struct SessionContext<'a> {
    /// The handshake's deadline and option limits.
    pub limits: &'a Limits,
    /// The exports offered now (each batch of options reads one snapshot).
    pub exports: &'a ExportCell,
    /// Places among the attached clients.
    pub admission: &'a Arc<Admission>,
    /// The TLS context offered, taken once for the whole handshake (`None`: TLS off).
    pub tls: Option<Arc<TlsServer>>,
    /// Whether the kernel takes over sending TLS records, where the context allows it.
    pub kernel_tls: Option<KernelTls>,
    /// The counters (TLS sessions and their bytes).
    pub stats: &'a Arc<Stats>,
    /// Set when the server shuts down: no handshake goes on.
    pub stopping: &'a AtomicBool,
}

impl SessionContext<'_> {
    /// Whether the server is shutting down.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// How the handshake offers TLS.
    pub fn tls_policy(&self) -> TlsPolicy {
        match self.tls.as_deref().map(TlsServer::mode) {
            Some(TlsMode::Require) => TlsPolicy::Require,
            Some(TlsMode::On) => TlsPolicy::On,
            Some(TlsMode::Off) | None => TlsPolicy::Off,
        }
    }
}

/// What an attached connection's requests are validated against.
pub fn transmission_context(export: &Offered, negotiated: &Negotiated) -> TransmissionContext {
    let info = &export.info;
    TransmissionContext {
        mode: negotiated.mode,
        size: info.size,
        flags: negotiated.flags,
        block_size: info.block_size,
        meta: negotiated.meta,
    }
}
