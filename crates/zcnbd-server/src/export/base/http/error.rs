//! Why an HTTP request or the start-up probe failed. Messages name the URL only in its
//! redacted form and never a header field's value.

use std::io;
use std::time::Duration;

use super::response::ResponseError;
use super::spec::HttpSpecError;
use super::url::UrlError;
use super::{HTTP_SIZE_BYTES_MAX, REDIRECTS_MAX};

/// An HTTP source's failure: a request's (its read fails `EIO`) or the probe's (the export
/// is refused at start).
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The settings are refused.
    #[error(transparent)]
    Spec(#[from] HttpSpecError),
    /// A redirect's `Location` is not a URL zcnbd follows.
    #[error("a redirect to a bad URL: {0}")]
    Redirect(UrlError),
    /// A redirect without a `Location`.
    #[error("a redirect ({0}) without a Location")]
    NoLocation(u16),
    /// A redirect from `https` to `http`.
    #[error("a redirect from https to http, refused")]
    Downgrade,
    /// More redirects than `REDIRECTS_MAX` in a row.
    #[error("more than {REDIRECTS_MAX} redirects in a row (REDIRECTS_MAX)")]
    Redirects,
    /// The host name did not resolve.
    #[error("cannot resolve {host}: {source}")]
    Resolve { host: String, source: io::Error },
    /// No address of the host took the connection in time.
    #[error("cannot connect to {origin}: {source}")]
    Connect { origin: String, source: io::Error },
    /// The TLS context could not be made (a CA file that does not load, say).
    #[error("TLS settings: {0}")]
    TlsSetup(String),
    /// The TLS handshake failed (an unverified certificate, a wrong name, ...).
    #[error("TLS with {host}: {detail}")]
    Tls { host: String, detail: String },
    /// Sending the request failed.
    #[error("sending the request: {0}")]
    Send(io::Error),
    /// Receiving the response failed.
    #[error("receiving the response: {0}")]
    Receive(io::Error),
    /// The server sent nothing for `--http-timeout`, or not a whole head within it.
    #[error("no answer within {0:?} (--http-timeout)")]
    TimedOut(Duration),
    /// The connection ended before any byte of a response: on a kept-alive connection, the
    /// server closed it while it was idle (the request is sent again on a new one).
    #[error("the server closed the connection without answering")]
    Closed,
    /// The connection ended inside a response's head.
    #[error("the server closed the connection inside a response's head")]
    ShortHead,
    /// The connection ended inside the body.
    #[error("a short body: the connection ended after {got} of {want} bytes")]
    ShortBody { got: usize, want: usize },
    /// The head is refused (malformed, over a limit, another range, another size...).
    #[error(transparent)]
    Response(#[from] ResponseError),
    /// A status that is neither the range nor a redirect.
    #[error("HTTP {status} {reason}")]
    Status { status: u16, reason: String },
    /// The server answered a ranged GET with the whole file.
    #[error("the server ignores Range requests (it answered {0} with the whole file): zcnbd serves only from servers that send byte ranges")]
    RangeIgnored(u16),
    /// The file is empty.
    #[error("the file is empty")]
    Empty,
    /// A size over `HTTP_SIZE_BYTES_MAX`.
    #[error("a size of {0} bytes, over {HTTP_SIZE_BYTES_MAX} (HTTP_SIZE_BYTES_MAX)")]
    TooLarge(u64),
    /// HEAD's `Content-Length` and the ranged GET's total differ.
    #[error("HEAD says {head} bytes, a ranged GET {get}")]
    SizesDiffer { head: u64, get: u64 },
}

impl HttpError {
    /// A receive error, with a socket timeout (`WouldBlock` on a socket with a receive
    /// timeout) told apart.
    pub(super) fn receiving(e: io::Error, timeout: Duration) -> HttpError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HttpError::TimedOut(timeout),
            _ => HttpError::Receive(e),
        }
    }

    /// Whether it says a kept-alive connection was found closed before it answered: what a
    /// request is sent again on a new connection for, once.
    pub(super) fn closed_before_answer(&self) -> bool {
        match self {
            HttpError::Closed => true,
            HttpError::Send(e) => is_reset(e),
            _ => false,
        }
    }
}

/// Whether `e` says the peer closed or reset the connection.
pub(super) fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}
