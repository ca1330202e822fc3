//! The layers an export's stack can have (`--filter NAME`, TOML `filters = [...]`), by name.

mod passthrough;

use std::sync::Arc;

pub use passthrough::PassThrough;

use super::Layer;

/// Every layer's name, for the command line's help and errors.
pub const LAYER_NAMES: &[&str] = &["passthrough"];

/// The layer called `name`, or `None` if there is none.
pub fn layer_named(name: &str) -> Option<Arc<dyn Layer>> {
    match name {
        "passthrough" => Some(Arc::new(PassThrough)),
        _ => None,
    }
}
