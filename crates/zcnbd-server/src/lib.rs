//! zcnbd's NBD server: exports and their backends, the portable I/O engine (blocking reader
//! per connection, worker threads for backend operations), listeners and orderly shutdown.
//! The protocol itself lives in the sans-IO `zcnbd-proto` crate. `unsafe` is allowed only in
//! `sys` (mappings, the io_uring driver); the io_uring engine itself (`uring`) is safe code.
#![deny(unsafe_code)]

pub mod activation;
mod admission;
pub mod buffer_pool;
mod channel;
pub mod config;
mod connection;
pub mod dispatch;
pub mod export;
mod export_set;
mod inflight;
mod lifecycle;
mod limits;
mod listener;
mod metrics;
mod negotiation;
pub mod policy;
mod reload;
mod reply_writer;
mod server;
pub mod stats;
pub mod stream;
mod sys;
pub mod tls;
mod tls_feed;
mod uring;
pub mod vsock;
mod worker_pool;

pub use config::{load_config, parse_size, BackendSpec, Config, ConfigError, ExportSpec, RbdSpec};
pub use lifecycle::{catch_stop_signals, serve, serve_on, Ready, StopHandle};
pub use listener::Listeners;
pub use server::{
    DataPath, EngineKind, EngineOptions, Limits, ListenAddr, ReloadSource, Server, ServerConfig,
    ServerError,
};
pub use sys::process::{fork_single_threaded, Forked};
