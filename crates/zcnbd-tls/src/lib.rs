//! TLS for NBD with OpenSSL (issue 12), for zcnbd's server and client: the server's settings
//! and credentials, the client's (libnbd's URI keys), a session that a reader thread and a
//! writer thread share, the blocking handshake with a deadline, and why a handshake was refused. Design: docs/design/tls.md. No
//! cryptography of our own, and no `unsafe`: the kTLS probe, which needs a `setsockopt`,
//! lives in the server.
//!
//! - `config.rs`: [`TlsConfig`] (`--tls`, `--tls-certificates`, `--tls-verify-peer`,
//!   `--tls-authz`, `--tls-psk`, and the TOML `[tls]` table) and its loading.
//! - `acceptor.rs`: [`TlsServer`], the checked server context; `accept` runs a handshake.
//! - `connector.rs`: [`TlsClientConfig`] and [`TlsConnector`] (libnbd's `tls-*` URI keys).
//! - `x509.rs`, `psk.rs`, `files.rs`, `dn.rs`: credentials and subject names.
//! - `engine.rs`, `session.rs`, `handshake.rs`: OpenSSL over memory, the shared session.
//! - `kernel.rs`: [`KernelSend`], the hook that hands the sending half to kTLS.
//! - `stream.rs`: [`TlsStream`], a connection one thread drives, blocking or not (the
//!   client's).
//! - `refusal.rs`: [`HandshakeError`] and [`Refusal`].
#![forbid(unsafe_code)]

mod acceptor;
mod config;
mod connector;
mod dn;
mod engine;
mod error;
mod files;
mod handshake;
mod kernel;
mod psk;
mod raw;
mod refusal;
mod session;
mod stream;
mod transport;
mod x509;

pub use acceptor::{CredentialKind, TlsServer};
pub use config::{KtlsMode, TlsConfig, TlsMode};
pub use connector::{TlsClientConfig, TlsConnector, TlsVersion};
pub use dn::gnutls_dn;
pub use engine::TlsCounters;
pub use error::{LoadWarning, PskLineProblem, TlsLoadError};
pub use kernel::KernelSend;
pub use psk::{PskFile, PskKey, PSK_IDENTITY_BYTES_MAX, PSK_KEY_BYTES_MAX};
pub use raw::{Plaintext, RawDest, RawPlaintext, RawSslError};
pub use refusal::{refusal_of, HandshakeError, Refusal};
pub use session::{TlsReader, TlsSession, TlsWriter, RECORD_PLAINTEXT_BYTES};
pub use stream::TlsStream;
pub use transport::Transport;

use openssl::ssl::SslRef;

/// Who the peer proved to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsPeer {
    /// A verified certificate, by subject (GnuTLS's RFC 4514 form, as `--tls-authz` takes).
    Certificate { subject: String },
    /// A PSK username.
    Psk { identity: String },
    /// Nothing: no client certificate was asked for (or, for a client, none checked).
    Anonymous,
}

impl TlsPeer {
    /// The name `--tls-authz` compares, if there is one.
    pub fn name(&self) -> Option<&str> {
        match self {
            TlsPeer::Certificate { subject } => Some(subject),
            TlsPeer::Psk { identity } => Some(identity),
            TlsPeer::Anonymous => None,
        }
    }
}

/// What a handshake negotiated, for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsInfo {
    /// `TLSv1.3`, `TLSv1.2`.
    pub version: String,
    /// The cipher suite's OpenSSL name.
    pub cipher: String,
    pub peer: TlsPeer,
    /// The kernel encrypts what is sent (kTLS); records are still read in user space.
    pub kernel_sends: bool,
}

impl TlsInfo {
    fn of(ssl: &SslRef, slots: refusal::Classifier, kernel_sends: bool) -> TlsInfo {
        let peer = if slots.psk {
            let identity = ssl.ex_data(slots.identity).map(|i| i.0.clone());
            TlsPeer::Psk {
                identity: identity.unwrap_or_default(),
            }
        } else {
            match ssl
                .peer_certificate()
                .and_then(|c| gnutls_dn(c.subject_name()))
            {
                Some(subject) => TlsPeer::Certificate { subject },
                None => TlsPeer::Anonymous,
            }
        };
        TlsInfo {
            version: ssl.version_str().to_string(),
            cipher: ssl
                .current_cipher()
                .map_or("none", |c| c.name())
                .to_string(),
            peer,
            kernel_sends,
        }
    }
}
