//! Base backends: the bottom of an export's stack, where the bytes are.

mod file;
mod known_data;
mod memory;
mod null;
mod rbd;
mod rbd_spec;

pub use file::{FileBackend, FileMode, DIRECT_ALIGN_BYTES};
pub use memory::{memory_backend, MemoryBackend};
pub use null::NullBackend;
pub use rbd::RbdBackend;
pub use rbd_spec::{RbdSpec, RbdSpecError};
