//! The pass-through layer (`--filter passthrough`): forwards every call unchanged. It shows
//! what a layer costs and proves that nothing skips the stack: the interop suite runs once with
//! it over every export (`scripts/test.sh`), where every mechanism must still work through it.

use crate::export::Layer;

/// A layer that changes nothing.
#[derive(Debug, Default)]
pub struct PassThrough;

impl Layer for PassThrough {
    fn name(&self) -> &'static str {
        "passthrough"
    }
}
