//! The server's TLS context, built once at start from [`TlsConfig`], and the per-connection
//! handshake (`accept`), which also applies `--tls-authz`.
//!
//! Common to both kinds of credentials: TLS 1.2 at least, no renegotiation, no compression,
//! no session tickets or cache (NBD clients do not resume, and a ticket key would be one more
//! secret), and end-of-stream without close_notify treated as a close (qemu and nbdkit
//! clients often just close the socket after NBD_CMD_DISC).

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslOptions, SslRef,
    SslSessionCacheMode, SslVerifyMode, SslVersion,
};
use openssl::stack::Stack;
use openssl::x509::store::{X509Lookup, X509StoreBuilder};
use openssl::x509::verify::X509VerifyFlags;

use crate::config::{KtlsMode, TlsConfig, TlsMode};
use crate::error::{LoadWarning, TlsLoadError};
use crate::handshake;
use crate::kernel::KernelSend;
use crate::psk::PskFile;
use crate::refusal::{Classifier, HandshakeError, PskIdentity, Refusal};
use crate::session::TlsSession;
use crate::transport::Transport;
use crate::x509::{self, Side};

/// TLS 1.3 suites for PSK: a key from the TLS 1.2-style PSK callbacks has no hash of its
/// own, and "the handshake digest will default to SHA-256 for any returned PSK"
/// (SSL_CTX_use_psk_identity_hint(3ssl), OpenSSL 3.0), so only SHA-256 suites are offered;
/// GnuTLS, too, binds an external PSK to SHA-256.
pub(crate) const PSK_TLS13_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";
/// TLS 1.2 PSK suites, ECDHE first (forward secrecy); GnuTLS's `NORMAL:+ECDHE-PSK:+PSK`
/// (what qemu and nbdkit ask for) offers all of these.
pub(crate) const PSK_TLS12_CIPHERS: &str = "ECDHE-PSK-CHACHA20-POLY1305:\
    ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-GCM-SHA384:\
    PSK-AES128-GCM-SHA256:PSK-CHACHA20-POLY1305";

/// `SSL_OP_ENABLE_KTLS` (openssl/ssl.h, OpenSSL 3.0: `SSL_OP_BIT(3)`), which the `openssl`
/// crate does not name.
const SSL_OP_ENABLE_KTLS: u64 = 1 << 3;

/// Which credentials a server or client uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialKind {
    X509,
    Psk,
}

/// The loaded, checked TLS side of a server.
pub struct TlsServer {
    ctx: SslContext,
    mode: TlsMode,
    ktls: KtlsMode,
    credentials: CredentialKind,
    authz: Vec<String>,
    warnings: Vec<LoadWarning>,
    classifier: Classifier,
}

impl TlsServer {
    pub(crate) fn load(config: &TlsConfig) -> Result<TlsServer, TlsLoadError> {
        let mut warnings = Vec::new();
        let (ctx, credentials) = match (&config.certificates, &config.psk) {
            (None, None) => return Err(TlsLoadError::NoCredentials),
            (Some(_), Some(_)) => return Err(TlsLoadError::BothCredentials),
            (Some(dir), None) => {
                if !config.authz.is_empty() && !config.verify_peer {
                    return Err(TlsLoadError::AuthzWithoutVerify);
                }
                let ctx = x509_context(dir, config.verify_peer, &mut warnings)?;
                (ctx, CredentialKind::X509)
            }
            (None, Some(file)) => {
                let keys = PskFile::load(file, &mut warnings)?;
                (psk_context(keys, classifier(true)?)?, CredentialKind::Psk)
            }
        };
        Ok(TlsServer {
            ctx,
            mode: config.mode,
            ktls: config.ktls,
            credentials,
            authz: config.authz.clone(),
            warnings,
            classifier: classifier(credentials == CredentialKind::Psk)?,
        })
    }

    /// `--tls`: whether TLS is offered or required.
    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// `--tls-ktls`: whether the kernel may encrypt what is sent.
    pub fn ktls(&self) -> KtlsMode {
        self.ktls
    }

    /// Certificates or PSK.
    pub fn credentials(&self) -> CredentialKind {
        self.credentials
    }

    /// What loading noticed (each was logged as a warning).
    pub fn warnings(&self) -> &[LoadWarning] {
        &self.warnings
    }

    /// Runs the server side of a handshake over `sock` within `timeout`, starting with
    /// `leftover` (bytes already read after NBD_OPT_STARTTLS), then checks `--tls-authz`.
    pub fn accept<S: Transport>(
        &self,
        sock: S,
        leftover: &[u8],
        timeout: Duration,
    ) -> Result<TlsSession<S>, HandshakeError> {
        self.accept_with_kernel(sock, leftover, timeout, None)
    }

    /// Like [`accept`](Self::accept), and with `kernel`, on a TCP socket, the session's
    /// sending half goes to the kernel (kTLS) where OpenSSL and the kernel can
    /// ([`TlsSession::kernel_sends`] says whether they did).
    pub fn accept_with_kernel<S: Transport>(
        &self,
        sock: S,
        leftover: &[u8],
        timeout: Duration,
        kernel: Option<&dyn KernelSend>,
    ) -> Result<TlsSession<S>, HandshakeError> {
        self.accept_observed(sock, leftover, timeout, kernel, &|| {})
    }

    /// Like [`accept_with_kernel`](Self::accept_with_kernel), calling `progress` whenever
    /// the client's bytes arrive during the handshake: a server keeps the connection's place
    /// in its handshake budget fresh with it, so a client in the middle of a TLS handshake is
    /// not taken for a silent one.
    pub fn accept_observed<S: Transport>(
        &self,
        sock: S,
        leftover: &[u8],
        timeout: Duration,
        kernel: Option<&dyn KernelSend>,
        progress: &dyn Fn(),
    ) -> Result<TlsSession<S>, HandshakeError> {
        let mut ssl = Ssl::new(&self.ctx).map_err(|e| other(&e))?;
        ssl.set_accept_state();
        let classifier = self.classifier;
        let session =
            handshake::establish(ssl, sock, leftover, timeout, classifier, kernel, progress)?;
        self.check_authz(session)
    }

    /// qemu's authz-simple semantics: the peer's name (certificate subject or PSK username)
    /// must equal one listed, byte for byte.
    fn check_authz<S: Transport>(
        &self,
        session: TlsSession<S>,
    ) -> Result<TlsSession<S>, HandshakeError> {
        if self.authz.is_empty() {
            return Ok(session);
        }
        let name = session.info().peer.name().unwrap_or("");
        if self.authz.iter().any(|allowed| allowed == name) {
            return Ok(session);
        }
        Err(Refusal::NotAuthorized {
            peer: name.to_string(),
        }
        .into())
    }
}

/// The slots on each connection's `Ssl` where callbacks record what they saw, made once per
/// process (OpenSSL never frees an ex_data index).
pub(crate) fn classifier(psk: bool) -> Result<Classifier, ErrorStack> {
    static INDEXES: OnceLock<(Index<Ssl, Refusal>, Index<Ssl, PskIdentity>)> = OnceLock::new();
    let (index, identity) = match INDEXES.get() {
        Some(indexes) => *indexes,
        None => {
            let made = (Ssl::new_ex_index()?, Ssl::new_ex_index()?);
            *INDEXES.get_or_init(|| made)
        }
    };
    Ok(Classifier {
        index,
        identity,
        psk,
    })
}

fn server_builder() -> Result<SslContextBuilder, ErrorStack> {
    let mut b = SslContextBuilder::new(SslMethod::tls_server())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    b.set_options(
        SslOptions::NO_RENEGOTIATION
            | SslOptions::NO_COMPRESSION
            | SslOptions::IGNORE_UNEXPECTED_EOF
            | SslOptions::NO_TICKET
            | SslOptions::CIPHER_SERVER_PREFERENCE
            // Takes effect only where a connection's writes are routed to its socket
            // (`KernelSend`): OpenSSL installs kTLS on socket BIOs only.
            | SslOptions::from_bits_retain(SSL_OP_ENABLE_KTLS),
    );
    b.set_session_cache_mode(SslSessionCacheMode::OFF);
    b.set_num_tickets(0)?;
    Ok(b)
}

fn x509_context(
    dir: &Path,
    verify_peer: bool,
    warnings: &mut Vec<LoadWarning>,
) -> Result<SslContext, TlsLoadError> {
    let identity = x509::load_identity(dir, Side::Server, warnings)?;
    let mut b = server_builder()?;
    b.set_certificate(&identity.chain[0])?;
    for extra in &identity.chain[1..] {
        b.add_extra_chain_cert(extra.clone())?;
    }
    b.set_private_key(&identity.key)?;
    b.check_private_key()?;
    if verify_peer {
        let cas = x509::load_ca(dir)?;
        let mut store = X509StoreBuilder::new()?;
        let mut names = Stack::new()?;
        for ca in &cas {
            store.add_cert(ca.clone())?;
            names.push(ca.subject_name().to_owned()?)?;
        }
        // Revoked certificates are refused where the directory has a revocation list.
        if let Some(crl) = x509::crl_path(dir)? {
            let lookup = store.add_lookup(X509Lookup::file())?;
            let count = lookup.load_crl_file(&crl, SslFiletype::PEM)?;
            store.set_flags(X509VerifyFlags::CRL_CHECK)?;
            tracing::info!(path = %crl.display(), crls = count, "TLS: revocation list loaded");
        }
        b.set_verify_cert_store(store.build())?;
        // Tells the client which CAs we accept (GnuTLS picks its certificate by it).
        b.set_client_ca_list(names);
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(b.build())
}

fn psk_context(keys: PskFile, slots: Classifier) -> Result<SslContext, TlsLoadError> {
    let mut b = server_builder()?;
    b.set_ciphersuites(PSK_TLS13_SUITES)?;
    b.set_cipher_list(PSK_TLS12_CIPHERS)?;
    let keys = Arc::new(keys);
    b.set_psk_server_callback(move |ssl, identity, out| {
        Ok(psk_lookup(
            &keys,
            slots,
            ssl,
            identity.unwrap_or_default(),
            out,
        ))
    });
    Ok(b.build())
}

/// The PSK callback: copies the username's key into `out` and returns its length. For an
/// unknown username it records why on the connection and answers with a random key, as
/// GnuTLS does, so the client cannot tell an unknown username from a wrong key.
fn psk_lookup(
    keys: &PskFile,
    slots: Classifier,
    ssl: &mut SslRef,
    identity: &[u8],
    out: &mut [u8],
) -> usize {
    let shown = String::from_utf8_lossy(identity).into_owned();
    if let Some(key) = keys.key(identity) {
        let key = key.as_bytes();
        if key.len() <= out.len() {
            out[..key.len()].copy_from_slice(key);
            ssl.set_ex_data(slots.identity, PskIdentity(shown));
            return key.len();
        }
    }
    ssl.set_ex_data(slots.index, Refusal::UnknownPskIdentity { identity: shown });
    let decoy = out.len().min(32);
    match openssl::rand::rand_bytes(&mut out[..decoy]) {
        Ok(()) => decoy,
        Err(_) => 0,
    }
}

fn other(e: &ErrorStack) -> HandshakeError {
    HandshakeError::Refused(Refusal::Other {
        detail: e.to_string(),
    })
}
