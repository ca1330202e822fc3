//! The client's TLS settings: an `nbds` URI's keys, with libnbd's defaults for what it
//! leaves out, loaded once per client and used by each of its connections.
//!
//! libnbd's defaults: without `tls-certificates`, the directory `$HOME/.pki/libnbd`, else
//! `/etc/pki/libnbd`, else the system's CA store (so fio's nbd engine and this client find
//! the same files); without a user in the URI, the PSK username is the local user's.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use zcnbd_tls::{HandshakeError, TlsClientConfig, TlsConnector, TlsStream};

use crate::error::{Error, Result};
use crate::link::tls_error;
use crate::sock::Sock;

/// libnbd's system-wide certificates directory.
const SYSTEM_CERTIFICATES_DIR: &str = "/etc/pki/libnbd";

/// Loads the credentials `config` names (with libnbd's defaults filled in).
pub fn connector(config: &TlsClientConfig) -> Result<TlsConnector> {
    let mut config = config.clone();
    if config.psk_file.is_some() {
        config.username = config.username.or_else(local_username);
    } else if config.certificates.is_none() {
        config.certificates = default_certificates_dir();
    }
    config
        .load()
        .map_err(|e| Error::TlsCredentials(Arc::new(e)))
}

/// Runs the TLS handshake on a socket whose STARTTLS the server acknowledged.
pub fn handshake(
    connector: &TlsConnector,
    sock: Sock,
    hostname: &str,
    timeout: Duration,
) -> Result<TlsStream<Sock>> {
    connector
        .connect_stream(sock, hostname, timeout)
        .map_err(|e| match e {
            HandshakeError::Refused(refusal) => Error::Tls(refusal),
            HandshakeError::Timeout(_) => Error::io(
                "TLS handshake",
                std::io::Error::new(std::io::ErrorKind::TimedOut, e.to_string()),
            ),
            // GnuTLS servers refuse without an alert (a wrong PSK too).
            HandshakeError::PeerClosed => Error::Handshake(format!(
                "{e}: the server refused us without saying why (a wrong pre-shared key or \
                 username, or a certificate it does not accept?)"
            )),
            HandshakeError::Io(io) => tls_error(io, "TLS handshake"),
        })
}

fn default_certificates_dir() -> Option<PathBuf> {
    let home = std::env::var_os("HOME").map(|h| Path::new(&h).join(".pki/libnbd"));
    home.into_iter()
        .chain([PathBuf::from(SYSTEM_CERTIFICATES_DIR)])
        .find(|d| d.is_dir())
}

fn local_username() -> Option<String> {
    ["USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
}
