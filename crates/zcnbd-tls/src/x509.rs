//! X.509 credentials from a directory laid out as nbdkit, qemu and libnbd expect:
//! `ca-cert.pem`, and `server-cert.pem` + `server-key.pem` (a server) or `client-cert.pem` +
//! `client-key.pem` (a client). Every fault is found at load: an unreadable or unparsable
//! file, a key that is not the certificate's; an own certificate outside its validity period
//! only warns (the peer will refuse it, but the operator may be about to replace it).

use std::cmp::Ordering;
use std::path::{Path, PathBuf};

use openssl::asn1::{Asn1Time, Asn1TimeRef};
use openssl::pkey::{PKey, Private};
use openssl::x509::{X509Crl, X509};

use crate::error::{LoadWarning, TlsLoadError};
use crate::files;

/// The CA file of a certificates directory.
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// The optional revocation list of a certificates directory (nbdkit's and QEMU's name).
pub const CA_CRL_FILE: &str = "ca-crl.pem";

/// A certificate chain (leaf first) and its private key.
pub struct Identity {
    pub chain: Vec<X509>,
    pub key: PKey<Private>,
}

/// Which side's files to read from a certificates directory.
#[derive(Debug, Clone, Copy)]
pub enum Side {
    Server,
    Client,
}

impl Side {
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Side::Server => ("server-cert.pem", "server-key.pem"),
            Side::Client => ("client-cert.pem", "client-key.pem"),
        }
    }
}

/// The certificate and key files of `side` in `dir`.
pub fn identity_paths(dir: &Path, side: Side) -> (PathBuf, PathBuf) {
    let (cert, key) = side.files();
    (dir.join(cert), dir.join(key))
}

/// Loads `side`'s certificate chain and key from `dir` and checks that they belong together.
pub fn load_identity(
    dir: &Path,
    side: Side,
    warnings: &mut Vec<LoadWarning>,
) -> Result<Identity, TlsLoadError> {
    let (cert_path, key_path) = identity_paths(dir, side);
    let chain = load_certificates(&cert_path)?;
    let key = load_private_key(&key_path, warnings)?;
    let leaf_key = chain[0]
        .public_key()
        .map_err(|e| bad_certificate(&cert_path, e.to_string()))?;
    if !leaf_key.public_eq(&key) {
        return Err(TlsLoadError::KeyMismatch {
            cert: cert_path,
            key: key_path,
        });
    }
    validity_warnings(&chain[0], &cert_path, warnings);
    Ok(Identity { chain, key })
}

/// The revocation list of `dir` (`ca-crl.pem`), checked to hold at least one PEM CRL, or
/// `None` if the directory has none.
pub fn crl_path(dir: &Path) -> Result<Option<PathBuf>, TlsLoadError> {
    let path = dir.join(CA_CRL_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let pem = files::read_public(&path)?;
    X509Crl::from_pem(&pem).map_err(|e| bad_certificate(&path, format!("no usable CRL: {e}")))?;
    // OpenSSL's loader takes the path as text.
    if path.to_str().is_none() {
        return Err(bad_certificate(&path, "the path is not UTF-8".into()));
    }
    Ok(Some(path))
}

/// Loads the CA certificates of `dir` (`ca-cert.pem`).
pub fn load_ca(dir: &Path) -> Result<Vec<X509>, TlsLoadError> {
    load_certificates(&dir.join(CA_CERT_FILE))
}

/// Every PEM certificate in `path`, at least one.
pub fn load_certificates(path: &Path) -> Result<Vec<X509>, TlsLoadError> {
    let pem = files::read_public(path)?;
    let certs = X509::stack_from_pem(&pem).map_err(|e| bad_certificate(path, e.to_string()))?;
    if certs.is_empty() {
        return Err(bad_certificate(path, "no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The unencrypted PEM private key in `path`; loose permissions add a warning.
pub fn load_private_key(
    path: &Path,
    warnings: &mut Vec<LoadWarning>,
) -> Result<PKey<Private>, TlsLoadError> {
    let pem = files::read_secret(path, warnings)?;
    // An encrypted key would ask for a passphrase on the terminal; refuse it instead.
    PKey::private_key_from_pem_callback(&pem, |_| Ok(0)).map_err(|e| TlsLoadError::BadKey {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn validity_warnings(cert: &X509, path: &Path, warnings: &mut Vec<LoadWarning>) {
    let Ok(now) = Asn1Time::days_from_now(0) else {
        return;
    };
    let is = |t: &Asn1TimeRef, o| t.compare(&now).is_ok_and(|c| c == o);
    if is(cert.not_after(), Ordering::Less) {
        warnings.push(LoadWarning::CertificateExpired {
            path: path.to_path_buf(),
            not_after: cert.not_after().to_string(),
        });
    }
    if is(cert.not_before(), Ordering::Greater) {
        warnings.push(LoadWarning::CertificateNotYetValid {
            path: path.to_path_buf(),
            not_before: cert.not_before().to_string(),
        });
    }
}

fn bad_certificate(path: &Path, reason: String) -> TlsLoadError {
    TlsLoadError::BadCertificate {
        path: path.to_path_buf(),
        reason,
    }
}
