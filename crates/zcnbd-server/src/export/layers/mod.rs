//! The layers an export's stack can have (`--filter NAME`, TOML `filters = [...]`), by name,
//! each with its options (`NAME:KEY=VALUE,...`, see `options.rs`).

mod blocksize;
mod cache;
mod cache_blocks;
mod cache_file;
mod delay;
mod error;
mod log;
pub mod options;
mod partition;
pub mod partition_fuzz;
pub mod partition_table;
mod passthrough;
mod rate;
mod readahead;
mod retry;
#[cfg(test)]
mod test_disk;

use std::sync::Arc;

pub use blocksize::Blocksize;
pub use cache::Cache;
pub use cache_file::set_default_dir as set_cache_dir;
pub use delay::Delay;
pub use error::ErrorInjection;
pub use log::Log;
pub use partition::Partition;
pub use passthrough::PassThrough;
pub use rate::Rate;
pub use readahead::Readahead;
pub use retry::Retry;

use super::Layer;

/// Every layer's name, for the command line's help and errors.
pub const LAYER_NAMES: &[&str] = &[
    "blocksize",
    "cache",
    "delay",
    "error",
    "log",
    "partition",
    "passthrough",
    "rate",
    "readahead",
    "retry",
];

/// Why a filter entry makes no layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerError {
    /// No layer has the name.
    Unknown(String),
    /// The layer refused its options (the reason).
    Options(String),
}

/// The layer a filter entry (`NAME` or `NAME:KEY=VALUE,...`) names, with its options.
pub fn layer_named(entry: &str) -> Result<Arc<dyn Layer>, LayerError> {
    let (name, options) = options::split(entry).map_err(LayerError::Options)?;
    match name {
        "passthrough" => options
            .finish()
            .map(|()| Arc::new(PassThrough) as Arc<dyn Layer>),
        "blocksize" => Blocksize::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "cache" => Cache::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "delay" => Delay::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "error" => ErrorInjection::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "log" => Log::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "partition" => Partition::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "rate" => Rate::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "readahead" => Readahead::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        "retry" => Retry::from_options(options).map(|l| Arc::new(l) as Arc<dyn Layer>),
        _ => return Err(LayerError::Unknown(name.to_owned())),
    }
    .map_err(LayerError::Options)
}
