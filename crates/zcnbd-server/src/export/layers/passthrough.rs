//! The pass-through layer (`--filter passthrough`): forwards every call unchanged. It shows
//! what a layer costs and proves that nothing skips the stack: the interop suite runs once with
//! it over every export (`scripts/test.sh`), where every mechanism must still work through it.

use crate::export::{Backend, Layer};

/// A layer that changes nothing.
#[derive(Debug, Default)]
pub struct PassThrough;

impl Layer for PassThrough {
    fn name(&self) -> &'static str {
        "passthrough"
    }

    /// Reads' bytes pass unchanged: piped reads may go around it.
    fn pipes_reads(&self, next: &dyn Backend) -> bool {
        next.pipes_reads()
    }
}
