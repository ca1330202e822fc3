//! What every ring of the io_uring engine shares with the server.

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
    /// The buffer memory all connections together may hold.
    pub memory: Arc<MemoryBudget>,
}
