//! Why TLS credentials could not be loaded, and what loading noticed but let pass. Nothing
//! here ever carries key material: a bad PSK line is reported by its number and the kind of
//! fault, never its text.

use std::fmt;
use std::path::PathBuf;

use openssl::error::ErrorStack;

/// Why the TLS configuration cannot be used; the server refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum TlsLoadError {
    /// TLS is on but neither certificates nor a PSK file were given.
    #[error("TLS needs credentials: --tls-certificates DIR or --tls-psk FILE")]
    NoCredentials,
    /// Both kinds of credentials were given; a server uses one.
    #[error("--tls-certificates and --tls-psk cannot be used together")]
    BothCredentials,
    /// `--tls-authz` names certificate subjects, but no client certificate is asked for.
    #[error(
        "--tls-authz with certificates needs --tls-verify-peer (no client certificate, no name)"
    )]
    AuthzWithoutVerify,
    /// `--tls-authz` or `--tls-verify-peer` restrict who may connect, but the mode lets
    /// clients go on in plain text (or there is no TLS at all), around the restriction.
    #[error(
        "--tls-authz and --tls-verify-peer restrict who may connect, but --tls={0} lets clients \
         in without TLS: use --tls=require (the default once either is given)"
    )]
    RestrictionBypassed(crate::config::TlsMode),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file is larger than any credential file should be.
    #[error("{path} is larger than {max_bytes} bytes")]
    TooLarge { path: PathBuf, max_bytes: u64 },
    /// A certificate file holds no parsable PEM certificate.
    #[error("{path}: no usable PEM certificate: {reason}")]
    BadCertificate { path: PathBuf, reason: String },
    /// A private key file holds no parsable, unencrypted PEM key.
    #[error("{path}: no usable unencrypted PEM private key: {reason}")]
    BadKey { path: PathBuf, reason: String },
    /// The private key is not the key of the certificate.
    #[error("the private key {key} does not match the certificate {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    /// A PSK file line is malformed (the line's text is never shown: it holds a key).
    #[error("{path}: line {line}: {problem}")]
    PskLine {
        path: PathBuf,
        line: usize,
        problem: PskLineProblem,
    },
    /// A PSK file has no key at all.
    #[error("{path}: no keys (expected lines of username:hexkey, as psktool writes)")]
    PskEmpty { path: PathBuf },
    /// A PSK file has no key for the username a client is to use.
    #[error("{path}: no key for the username {username:?}")]
    PskNoUser { path: PathBuf, username: String },
    /// OpenSSL refused a setting (a cipher list, a protocol version).
    #[error("OpenSSL refused the TLS configuration: {0}")]
    OpenSsl(#[from] ErrorStack),
}

/// What is wrong with one line of a PSK file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PskLineProblem {
    /// No `:` between username and key.
    NoColon,
    /// Nothing before the `:`.
    EmptyUsername,
    /// A `#`-prefixed (hex-encoded) username that is not hex.
    BadHexUsername,
    /// The username is longer than TLS allows.
    UsernameTooLong { max_bytes: usize },
    /// Nothing after the `:`.
    EmptyKey,
    /// The key is not an even number of hex digits.
    BadHexKey,
    /// The key is longer than OpenSSL accepts.
    KeyTooLong { max_bytes: usize },
    /// The username already had a key on an earlier line.
    DuplicateUsername { first_line: usize },
}

impl fmt::Display for PskLineProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoColon => write!(f, "expected username:hexkey"),
            Self::EmptyUsername => write!(f, "empty username"),
            Self::BadHexUsername => write!(f, "a username starting with # must be hex"),
            Self::UsernameTooLong { max_bytes } => {
                write!(f, "username longer than {max_bytes} bytes")
            }
            Self::EmptyKey => write!(f, "empty key"),
            Self::BadHexKey => write!(f, "the key is not an even number of hex digits"),
            Self::KeyTooLong { max_bytes } => write!(f, "key longer than {max_bytes} bytes"),
            Self::DuplicateUsername { first_line } => {
                write!(f, "username already has a key on line {first_line}")
            }
        }
    }
}

/// Something loading noticed that does not stop the server; each is also logged (`warn`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadWarning {
    /// A private key or PSK file can be read by group or others.
    SecretReadableByOthers { path: PathBuf, mode: u32 },
    /// Our own certificate is past its end date: clients will refuse it.
    CertificateExpired { path: PathBuf, not_after: String },
    /// Our own certificate's start date is in the future: clients will refuse it.
    CertificateNotYetValid { path: PathBuf, not_before: String },
}

impl fmt::Display for LoadWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SecretReadableByOthers { path, mode } => write!(
                f,
                "{} holds secrets but has mode {:o} (group/others may read it; chmod 600)",
                path.display(),
                mode & 0o7777
            ),
            Self::CertificateExpired { path, not_after } => {
                write!(f, "{} expired ({not_after})", path.display())
            }
            Self::CertificateNotYetValid { path, not_before } => {
                write!(f, "{} is not valid before {not_before}", path.display())
            }
        }
    }
}
