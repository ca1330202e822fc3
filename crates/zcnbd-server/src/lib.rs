//! zcnbd's NBD server. From the bottom up: exports (`export/`: each a stack of a base
//! backend, layers and one checked top), the dispatcher that runs a request through an
//! export's stack and lays out its reply (`dispatch`), the two transmission engines
//! (`engine/`: portable and io_uring, behind one interface), the session before them
//! (`session/`: handshake and admission), and the server that ties them together
//! (`server/`), with its listeners, lifecycle and reloads. The protocol itself lives in the
//! sans-IO `zcnbd-proto` crate. `unsafe` is allowed only in `sys` (mappings, the io_uring
//! driver, librbd); the engines themselves are safe code.
#![deny(unsafe_code)]

pub mod activation;
pub mod attach;
pub mod buffer_pool;
pub mod config;
pub mod control;
pub mod dispatch;
mod engine;
pub mod export;
mod export_set;
mod lifecycle;
mod limits;
mod listen_addr;
mod listener;
mod metrics;
pub mod pipe;
mod reload;
mod server;
mod session;
pub mod stats;
pub mod stream;
mod sys;
pub mod tls;
mod unix_socket;
pub mod vsock;
mod worker_pool;

pub use config::ReloadSource;
pub use config::{
    is_http_url, is_nbd_uri, load_config, parse_payload_max, parse_size, BackendSpec,
    BitmapSettings, Config, ConfigError, ExportDefaults, ExportSpec, HttpHeader, HttpSpec,
    ImageSettings, RbdSpec, PAYLOAD_BYTES_MAX_DEFAULT,
};
pub use engine::poll::{POLL_MAX_US_DEFAULT, POLL_MAX_US_LIMIT};
pub use engine::wait_trial::{COALESCE_MAX_US_DEFAULT, COALESCE_MAX_US_LIMIT};
pub use export::ImageFormat;
pub use lifecycle::{catch_stop_signals, serve, serve_on, Ready, StopHandle};
pub use listen_addr::ListenAddr;
pub use listener::Listeners;
pub use server::{DataPath, EngineKind, EngineOptions, Limits, Server, ServerConfig, ServerError};
pub use sys::process::{fork_single_threaded, Forked};
