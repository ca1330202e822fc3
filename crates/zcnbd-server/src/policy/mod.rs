//! The engines' policy, in safe code: how the server is asked to move bytes
//! ([`options`]) and which mechanism moves each payload ([`mechanism`]). The io_uring engine
//! (`uring`, through its driver in `sys`) only carries out what is decided here.

pub mod mechanism;
pub mod options;

pub use options::{DataPath, EngineKind, EngineOptions};
