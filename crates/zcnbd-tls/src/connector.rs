//! The client side, for the zcnbd client library: the settings of libnbd's `nbds://` and
//! `nbds+unix://` URIs (`tls-certificates=DIR`, `tls-psk-file=FILE` with the URI's user as
//! username, `tls-verify-peer`, `tls-hostname`) and a connector that runs the handshake.
//!
//! With certificates, `DIR/ca-cert.pem` (or, without a directory or that file, the system's
//! CA store) verifies the server, and `DIR/client-cert.pem` + `client-key.pem`, if present,
//! are offered as the client's certificate. The server's certificate must name the host
//! (`tls-hostname`, else the URI's host), as libnbd and qemu check it.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslConnector, SslContext, SslContextBuilder, SslMethod, SslOptions, SslVerifyMode,
    SslVersion,
};

use crate::acceptor::{classifier, CredentialKind, PSK_TLS12_CIPHERS, PSK_TLS13_SUITES};
use crate::error::{LoadWarning, TlsLoadError};
use crate::handshake;
use crate::psk::{PskFile, PskKey};
use crate::refusal::{Classifier, HandshakeError, PskIdentity, Refusal};
use crate::session::TlsSession;
use crate::stream::TlsStream;
use crate::transport::Transport;
use crate::x509::{self, Side, CA_CERT_FILE};

/// A TLS protocol version, to cap what a client offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVersion {
    Tls12,
    Tls13,
}

/// A client's TLS settings (libnbd's URI query keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsClientConfig {
    /// `tls-certificates=DIR`.
    pub certificates: Option<PathBuf>,
    /// `tls-psk-file=FILE`; selects PSK instead of certificates.
    pub psk_file: Option<PathBuf>,
    /// The PSK username (the URI's user part).
    pub username: Option<String>,
    /// `tls-verify-peer` (default true): check the server's certificate and name.
    pub verify_peer: bool,
    /// `tls-hostname`: the name the server's certificate must have, if not the URI's host.
    pub hostname: Option<String>,
    /// The highest version offered (`None`: TLS 1.3).
    pub version_max: Option<TlsVersion>,
}

impl Default for TlsClientConfig {
    fn default() -> Self {
        TlsClientConfig {
            certificates: None,
            psk_file: None,
            username: None,
            verify_peer: true,
            hostname: None,
            version_max: None,
        }
    }
}

/// A loaded client context.
pub struct TlsConnector {
    ctx: SslContext,
    hostname: Option<String>,
    verify_peer: bool,
    credentials: CredentialKind,
    warnings: Vec<LoadWarning>,
}

impl TlsClientConfig {
    /// Reads and checks the credentials and builds the client context.
    pub fn load(&self) -> Result<TlsConnector, TlsLoadError> {
        let mut warnings = Vec::new();
        let mut b = SslConnector::builder(SslMethod::tls_client())?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        b.set_max_proto_version(self.version_max.map(|v| match v {
            TlsVersion::Tls12 => SslVersion::TLS1_2,
            TlsVersion::Tls13 => SslVersion::TLS1_3,
        }))?;
        b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::IGNORE_UNEXPECTED_EOF);
        let credentials = match &self.psk_file {
            Some(file) => {
                let keys = PskFile::load(file, &mut warnings)?;
                let username = self.username.clone().unwrap_or_default();
                let key = keys.key_for_user(&username)?.clone();
                client_psk(&mut b, username, key, classifier(true)?.identity)?;
                CredentialKind::Psk
            }
            None => {
                self.client_x509(&mut b, &mut warnings)?;
                CredentialKind::X509
            }
        };
        for warning in &warnings {
            tracing::warn!("TLS: {warning}");
        }
        Ok(TlsConnector {
            ctx: b.build().into_context(),
            hostname: self.hostname.clone(),
            verify_peer: self.verify_peer,
            credentials,
            warnings,
        })
    }

    fn client_x509(
        &self,
        b: &mut SslContextBuilder,
        warnings: &mut Vec<LoadWarning>,
    ) -> Result<(), TlsLoadError> {
        let dir = self.certificates.as_deref();
        match dir.filter(|d| d.join(CA_CERT_FILE).exists()) {
            Some(d) => b.set_ca_file(d.join(CA_CERT_FILE))?,
            None => b.set_default_verify_paths()?,
        }
        if let Some(d) = dir {
            let (cert, _) = x509::identity_paths(d, Side::Client);
            if cert.exists() {
                let identity = x509::load_identity(d, Side::Client, warnings)?;
                b.set_certificate(&identity.chain[0])?;
                for extra in &identity.chain[1..] {
                    b.add_extra_chain_cert(extra.clone())?;
                }
                b.set_private_key(&identity.key)?;
            }
        }
        b.set_verify(if self.verify_peer {
            SslVerifyMode::PEER
        } else {
            SslVerifyMode::NONE
        });
        Ok(())
    }
}

fn client_psk(
    b: &mut SslContextBuilder,
    username: String,
    key: PskKey,
    slot: Index<Ssl, PskIdentity>,
) -> Result<(), TlsLoadError> {
    b.set_ciphersuites(PSK_TLS13_SUITES)?;
    b.set_cipher_list(PSK_TLS12_CIPHERS)?;
    b.set_psk_client_callback(move |ssl, _hint, identity_out, key_out| {
        let id = username.as_bytes();
        let key = key.as_bytes();
        // The identity is a C string: it needs room for its terminating NUL.
        if id.len() >= identity_out.len() || key.len() > key_out.len() {
            return Ok(0);
        }
        identity_out[..id.len()].copy_from_slice(id);
        identity_out[id.len()] = 0;
        key_out[..key.len()].copy_from_slice(key);
        ssl.set_ex_data(slot, PskIdentity(username.clone()));
        Ok(key.len())
    });
    Ok(())
}

impl TlsConnector {
    /// What loading noticed (each was logged as a warning).
    pub fn warnings(&self) -> &[LoadWarning] {
        &self.warnings
    }

    /// Runs the client side of a handshake over `sock` within `timeout`. `host` is the
    /// URI's host (`localhost` for a Unix socket), checked unless `tls-hostname` overrides
    /// it or `tls-verify-peer` is off.
    pub fn connect<S: Transport>(
        &self,
        sock: S,
        host: &str,
        timeout: Duration,
    ) -> Result<TlsSession<S>, HandshakeError> {
        let (ssl, classifier) = self.client_ssl(host)?;
        handshake::establish(ssl, sock, &[], timeout, classifier, None, &|| {})
    }

    /// Like [`TlsConnector::connect`], for a connection one thread drives.
    pub fn connect_stream<S: Transport>(
        &self,
        sock: S,
        host: &str,
        timeout: Duration,
    ) -> Result<TlsStream<S>, HandshakeError> {
        let (ssl, classifier) = self.client_ssl(host)?;
        handshake::establish_stream(ssl, sock, &[], timeout, classifier)
    }

    /// A connection's `Ssl`, in connect state, with the name to check set.
    fn client_ssl(&self, host: &str) -> Result<(Ssl, Classifier), HandshakeError> {
        let other = |e: openssl::error::ErrorStack| {
            HandshakeError::Refused(Refusal::Other {
                detail: e.to_string(),
            })
        };
        let mut ssl = Ssl::new(&self.ctx).map_err(other)?;
        ssl.set_connect_state();
        let name = self.hostname.as_deref().unwrap_or(host);
        let ip = name.parse::<IpAddr>().ok();
        if ip.is_none() && self.credentials == CredentialKind::X509 {
            ssl.set_hostname(name).map_err(other)?;
        }
        if self.verify_peer && self.credentials == CredentialKind::X509 {
            let param = ssl.param_mut();
            match ip {
                Some(ip) => param.set_ip(ip),
                None => param.set_host(name),
            }
            .map_err(other)?;
        }
        let classifier = classifier(self.credentials == CredentialKind::Psk).map_err(other)?;
        Ok((ssl, classifier))
    }
}
