//! The client's one error type, and the `errno` each variant means to a C caller.

use std::sync::Arc;

use zcnbd_proto::{MetaQueryError, ReplyFailure, Violation};
use zcnbd_tls::{Refusal, TlsLoadError};

/// Everything a client operation can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The URI is not an NBD URI this client can use.
    #[error("bad NBD URI {uri:?}: {why}")]
    Uri { uri: String, why: String },
    /// TLS refused the connection, or ended it: the server's certificate, its name, our
    /// certificate or the pre-shared key was not accepted (the reason says which).
    #[error("TLS refused: {0}")]
    Tls(Refusal),
    /// The TLS credentials the URI names could not be loaded.
    #[error("TLS credentials: {0}")]
    TlsCredentials(Arc<TlsLoadError>),
    /// The URI requires TLS (`nbds://`) and the server does not offer it.
    #[error("the server does not offer TLS, which nbds:// requires: {0}")]
    TlsUnavailable(String),
    /// The server requires TLS and the URI did not ask for it.
    #[error("the server requires TLS (connect with nbds://): {0}")]
    TlsRequired(String),
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        source: std::sync::Arc<std::io::Error>,
    },
    /// The handshake failed.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The server failed the request.
    #[error("server error {}: {}", .0.errno, if .0.message.is_empty() { "(no message)" } else { &.0.message })]
    Server(ReplyFailure),
    /// The server sent a reply the spec forbids; the connection was dropped.
    #[error("protocol violation by the server, disconnected: {0}")]
    Protocol(Violation),
    /// The connection is gone (the server hung up or died).
    #[error("connection lost: {0}")]
    Disconnected(String),
    /// The handle was closed while the request was in flight.
    #[error("handle closed")]
    Closed,
    /// Offset or length is not a multiple of the server's minimum block size.
    #[error("offset {offset} length {length} not aligned to the minimum block size {minimum}")]
    Misaligned {
        offset: u64,
        length: u64,
        minimum: u32,
    },
    /// The request reaches past the end of the export.
    #[error("offset {offset} length {length} past the export's end {size}")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    /// The export or server does not allow this request (read-only, no trim, no FUA, ...).
    #[error("not supported by this export: {0}")]
    Unsupported(&'static str),
    /// Every request slot is taken; wait for completions and retry.
    #[error("too many requests in flight")]
    Busy,
    /// The metadata contexts asked for cannot be asked for (too many, a bad name).
    #[error("metadata contexts: {0}")]
    MetaContexts(#[from] MetaQueryError),
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            context,
            source: std::sync::Arc::new(source),
        }
    }

    /// The positive `errno` this error means to a C caller.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Uri { .. }
            | Error::Misaligned { .. }
            | Error::OutOfRange { .. }
            | Error::MetaContexts(_) => libc::EINVAL,
            Error::TlsUnavailable(_) | Error::Unsupported(_) => libc::EOPNOTSUPP,
            Error::Tls(_) => libc::EACCES,
            Error::TlsCredentials(e) => match &**e {
                TlsLoadError::Read { source, .. } => source.raw_os_error().unwrap_or(libc::EINVAL),
                _ => libc::EINVAL,
            },
            Error::TlsRequired(_) => libc::ECONNREFUSED,
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Handshake(_) => libc::ECONNREFUSED,
            Error::Server(f) => server_errno(f.errno),
            Error::Protocol(_) => libc::EPROTO,
            Error::Disconnected(_) => libc::ENOTCONN,
            Error::Closed => libc::ESHUTDOWN,
            Error::Busy => libc::EAGAIN,
        }
    }
}

/// Maps an `NBD_E*` value to the host errno (the spec's values are Linux's; unknown ones
/// become `EIO`, as the spec tells clients to treat them).
fn server_errno(nbd: u32) -> i32 {
    match nbd {
        1 | 5 | 12 | 22 | 28 | 75 | 95 | 108 => nbd as i32,
        _ => libc::EIO,
    }
}

/// The result of client operations.
pub type Result<T> = std::result::Result<T, Error>;
