//! Why a TLS handshake failed, sorted into reasons an operator can act on, each with a short
//! tag for logs and stats (`reason()`). Built from what the PSK callback recorded on the
//! connection, OpenSSL's certificate verification result and the error reasons OpenSSL
//! queued; never from key material.

use std::io;
use std::time::Duration;

use openssl::ex_data::Index;
use openssl::ssl::{self, Ssl, SslRef};
use openssl::x509::X509VerifyResult;

/// Why a handshake did not complete.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The handshake took longer than its limit.
    #[error("TLS handshake timed out after {0:?}")]
    Timeout(Duration),
    /// The peer closed the connection before the handshake completed.
    #[error("the peer closed the connection during the TLS handshake")]
    PeerClosed,
    /// Reading or writing the socket failed.
    #[error("socket error during the TLS handshake: {0}")]
    Io(#[source] io::Error),
    /// TLS itself refused the peer (or the peer refused us).
    #[error("TLS handshake refused: {0}")]
    Refused(#[from] Refusal),
}

impl HandshakeError {
    /// A short tag for logs and stats: `timeout`, `peer-closed`, `io`, or the refusal's.
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Timeout(_) => "timeout",
            HandshakeError::PeerClosed => "peer-closed",
            HandshakeError::Io(_) => "io",
            HandshakeError::Refused(r) => r.reason(),
        }
    }
}

/// What TLS refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The client's PSK username is not in the PSK file.
    #[error("unknown PSK username {identity:?}")]
    UnknownPskIdentity { identity: String },
    /// The PSK username is known but the peers' keys differ.
    #[error("the pre-shared keys differ")]
    PskMismatch,
    /// The peer's certificate is not signed by a CA we trust.
    #[error("certificate from an unknown CA ({detail})")]
    UnknownCa { detail: String },
    /// The peer's certificate is past its end date.
    #[error("the certificate has expired")]
    CertificateExpired,
    /// The peer's certificate is on the CA's revocation list (`ca-crl.pem`).
    #[error("the certificate has been revoked")]
    CertificateRevoked,
    /// The peer's certificate's start date is in the future.
    #[error("the certificate is not yet valid")]
    CertificateNotYetValid,
    /// The peer's certificate failed verification for another reason.
    #[error("the certificate was rejected ({detail})")]
    BadCertificate { detail: String },
    /// The server's certificate does not name the host we connected to.
    #[error("the certificate does not match the host name")]
    HostnameMismatch,
    /// A client certificate was required and none was sent.
    #[error("no client certificate (one is required)")]
    NoClientCertificate,
    /// The peer authenticated but its name is not in `--tls-authz`.
    #[error("{peer:?} is not in --tls-authz")]
    NotAuthorized { peer: String },
    /// No protocol version or cipher suite both sides accept.
    #[error("no TLS version or cipher in common ({detail})")]
    NoCommonParameters { detail: String },
    /// The peer ended the handshake with an alert (it refused us).
    #[error("the peer refused us: {alert}")]
    PeerAlert { alert: String },
    /// What arrived is not TLS.
    #[error("not a TLS handshake ({detail})")]
    NotTls { detail: String },
    /// Anything else OpenSSL reported.
    #[error("{detail}")]
    Other { detail: String },
}

impl Refusal {
    /// A short, stable tag for logs and stats.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::UnknownPskIdentity { .. } => "unknown-psk-identity",
            Refusal::PskMismatch => "psk-mismatch",
            Refusal::UnknownCa { .. } => "unknown-ca",
            Refusal::CertificateExpired => "certificate-expired",
            Refusal::CertificateRevoked => "certificate-revoked",
            Refusal::CertificateNotYetValid => "certificate-not-yet-valid",
            Refusal::BadCertificate { .. } => "bad-certificate",
            Refusal::HostnameMismatch => "hostname-mismatch",
            Refusal::NoClientCertificate => "no-client-certificate",
            Refusal::NotAuthorized { .. } => "not-authorized",
            Refusal::NoCommonParameters { .. } => "no-common-parameters",
            Refusal::PeerAlert { .. } => "peer-alert",
            Refusal::NotTls { .. } => "not-tls",
            Refusal::Other { .. } => "other",
        }
    }
}

/// The refusal inside an I/O error from a session or stream: TLS failed after the handshake
/// (under TLS 1.3 a server refuses a client's certificate with an alert the client reads
/// only then, and a peer may end a session with an alert at any time).
pub fn refusal_of(e: &io::Error) -> Option<&Refusal> {
    e.get_ref()?.downcast_ref::<Refusal>()
}

/// The PSK username a connection uses, as its callback saw it.
#[derive(Debug, Clone)]
pub struct PskIdentity(pub String);

/// Sorts one connection's handshake failure; knows where callbacks record a refusal.
#[derive(Clone, Copy)]
pub struct Classifier {
    /// Where the PSK callback records an unknown username on the `Ssl`.
    pub index: Index<Ssl, Refusal>,
    /// Where the PSK callbacks record the username in use (OpenSSL 3.0 does not keep it
    /// for TLS 1.3: `SSL_get_psk_identity` answers NULL there).
    pub identity: Index<Ssl, PskIdentity>,
    /// Whether the credentials are a PSK (a decryption failure then means the keys differ).
    pub psk: bool,
}

impl Classifier {
    /// Why `err` ended the handshake on `ssl`.
    pub fn classify(&self, err: &ssl::Error, ssl: &SslRef) -> Refusal {
        if let Some(recorded) = ssl.ex_data(self.index) {
            return recorded.clone();
        }
        let verify = ssl.verify_result();
        if verify != X509VerifyResult::OK {
            return from_verify_result(verify);
        }
        let reasons: Vec<&str> = err
            .ssl_error()
            .map(|s| s.errors().iter().filter_map(|e| e.reason()).collect())
            .unwrap_or_default();
        reasons
            .iter()
            .find_map(|r| from_reason(r, self.psk))
            .unwrap_or_else(|| Refusal::Other {
                detail: if reasons.is_empty() {
                    err.to_string()
                } else {
                    reasons.join("; ")
                },
            })
    }
}

/// X509_V_ERR_* codes (openssl/x509_vfy.h) that mean the issuer is not trusted.
const UNKNOWN_CA_CODES: [i32; 5] = [2, 18, 19, 20, 21];
const CERT_NOT_YET_VALID: i32 = 9;
const CERT_HAS_EXPIRED: i32 = 10;
const CERT_REVOKED: i32 = 23;
const HOSTNAME_MISMATCH: i32 = 62;
const IP_ADDRESS_MISMATCH: i32 = 64;

fn from_verify_result(v: X509VerifyResult) -> Refusal {
    match v.as_raw() {
        CERT_HAS_EXPIRED => Refusal::CertificateExpired,
        CERT_REVOKED => Refusal::CertificateRevoked,
        CERT_NOT_YET_VALID => Refusal::CertificateNotYetValid,
        HOSTNAME_MISMATCH | IP_ADDRESS_MISMATCH => Refusal::HostnameMismatch,
        code if UNKNOWN_CA_CODES.contains(&code) => Refusal::UnknownCa {
            detail: v.error_string().to_string(),
        },
        _ => Refusal::BadCertificate {
            detail: v.error_string().to_string(),
        },
    }
}

/// One OpenSSL error reason string (ssl/ssl_err.c) to a refusal, if it says enough.
fn from_reason(reason: &str, psk: bool) -> Option<Refusal> {
    let detail = || reason.to_string();
    // With a PSK, a failed binder (TLS 1.3) or Finished (TLS 1.2) means the keys differ;
    // OpenSSL 3.0's server answers a bad binder with illegal_parameter.
    let key_fault = [
        "binder does not verify",
        "decrypt error",
        "bad record mac",
        "alert illegal parameter",
    ];
    if psk && key_fault.iter().any(|k| reason.contains(k)) {
        return Some(Refusal::PskMismatch);
    }
    if reason.contains("peer did not return a certificate")
        || reason.contains("alert certificate required")
    {
        return Some(Refusal::NoClientCertificate);
    }
    if reason.contains("alert unknown ca") {
        return Some(Refusal::PeerAlert { alert: detail() });
    }
    if reason.contains("alert protocol version")
        || reason.contains("alert handshake failure")
        || reason.contains("no shared cipher")
        || reason.contains("unsupported protocol")
        || reason.contains("no protocols available")
        || reason.contains("no suitable signature algorithm")
    {
        return Some(Refusal::NoCommonParameters { detail: detail() });
    }
    if reason.contains("wrong version number") || reason.contains("http request") {
        return Some(Refusal::NotTls { detail: detail() });
    }
    reason
        .contains(" alert ")
        .then(|| Refusal::PeerAlert { alert: detail() })
}
