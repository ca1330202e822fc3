//! zcnbd's NBD client: connect with an NBD URI, then read and write at offsets. Read data is
//! received by the socket call straight into the caller's buffers (every structured
//! `OFFSET_DATA` chunk at its offset, across iovec boundaries; holes zero-filled in place),
//! and writes go out as header plus the caller's buffers in one vectored send. Over TLS
//! (`nbds://`, `nbds+unix://`) read data is decrypted into the caller's buffers and writes
//! are encrypted from them (`link.rs`).
//!
//! Three ways to call it: blocking positional I/O (`read_at`, `write_at`, ...), the submit
//! API whose completions queue up for [`Client::complete`] (`submit.rs`), and the callback
//! API (`start_read`, `start_write`, ... in `callback.rs`) whose operations own any
//! [`StableBuffer`] and end in a callback on the thread that drives the client, waiting in a
//! per-connection backlog when every request slot is taken (`backlog.rs`).
//!
//! The protocol (handshake, request cookies, reply checks) is the sans-IO `zcnbd-proto`
//! crate; `unsafe` is allowed only in `sys`, which holds caller memory while requests fly.
#![deny(unsafe_code)]

mod backlog;
mod callback;
mod client;
mod conn;
mod connect;
pub mod error;
mod link;
mod meta;
mod piped;
mod plan;
mod plug;
mod raw;
mod sock;
mod stats;
mod submit;
#[allow(unsafe_code)]
mod sys;
mod tls;
pub mod uri;
mod wait;

pub use backlog::OPERATIONS_QUEUED_MAX_DEFAULT;
pub use client::{Client, ClientOptions, WriteFlags, ZeroFlags};
pub use conn::{Completed, Completer, ContextRun};
pub use error::{Error, Result};
pub use plan::Geometry;
pub use plug::Plug;
pub use raw::{open_raw, RawConnection};
pub use stats::StatsSnapshot;
pub use submit::Completion;
pub use sys::low_water::set_receive_low_water;
pub use sys::StableBuffer;
pub use uri::{Address, NbdUri};
pub use zcnbd_proto::client_meta::META_CONTEXT_QUERIES_MAX;
pub use zcnbd_proto::{Extent, MetaContext, MetaQueryError};
pub use zcnbd_tls::{Refusal, TlsClientConfig, TlsLoadError};
