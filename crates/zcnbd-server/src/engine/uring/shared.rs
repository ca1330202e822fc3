//! What every ring of the io_uring engine shares with the server, and how busy the engine is.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::buffer_pool::BufferPool;
use crate::engine::memory::MemoryBudget;
use crate::engine::options::EngineOptions;
use crate::limits::Limits;
use crate::stats::Stats;

/// What every ring shares with the server.
#[derive(Debug, Clone)]
pub struct EngineShared {
    pub options: EngineOptions,
    pub limits: Limits,
    pub pool: Arc<BufferPool>,
    pub stats: Arc<Stats>,
    pub load: Arc<EngineLoad>,
    /// The buffer memory all connections together may hold.
    pub memory: Arc<MemoryBudget>,
}

/// How busy the engine is, for choices that depend on whether the CPUs are the bound.
#[derive(Debug, Default)]
pub struct EngineLoad {
    /// Connections in their transmission phase.
    pub(super) connections: AtomicUsize,
    /// Ring threads.
    pub(super) rings: AtomicUsize,
}

impl EngineLoad {
    /// Whether every ring likely has a connection to serve (at least as many connections
    /// as rings), so that CPU time, not latency, bounds the server.
    pub fn cpu_bound(&self) -> bool {
        let rings = self.rings.load(Ordering::Relaxed);
        rings > 0 && self.connections.load(Ordering::Relaxed) >= rings
    }
}
