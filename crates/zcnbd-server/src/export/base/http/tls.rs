//! HTTPS: OpenSSL's client through the `openssl` crate's blocking `SslStream` (one thread
//! drives a connection, so none of zcnbd-tls's shared-session machinery is needed, and an
//! HTTP source takes a CA *file*, not NBD's certificate directory). The server is verified
//! against the system's CA store, or only the certificates of `--http-cafile`; its name
//! (or IP address) is checked; `--http-insecure` turns both off. No cryptography here.

use std::net::TcpStream;
use std::path::Path;

use openssl::ssl::{SslConnector, SslMethod, SslOptions, SslStream, SslVerifyMode, SslVersion};
use openssl::x509::store::X509StoreBuilder;
use openssl::x509::X509;

use super::error::HttpError;

/// A loaded client context.
pub struct TlsClient {
    connector: SslConnector,
    insecure: bool,
}

impl TlsClient {
    /// The context: the system's CA store, or `ca_file`'s certificates only; nothing verified
    /// if `insecure`.
    pub fn new(ca_file: Option<&Path>, insecure: bool) -> Result<TlsClient, HttpError> {
        let setup = |e: openssl::error::ErrorStack| HttpError::TlsSetup(e.to_string());
        // The builder starts with the system's store and peer verification on.
        let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(setup)?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(setup)?;
        // A body that ends with the connection (no Content-Length) may end without
        // close_notify; its length is checked against the Content-Range all the same.
        b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::IGNORE_UNEXPECTED_EOF);
        b.set_alpn_protos(b"\x08http/1.1").map_err(setup)?;
        // Records are read as much at a time as the socket holds (not header then body:
        // half the system calls for a body of many records). Nothing is pipelined, so
        // what is read ahead is always the current response's.
        b.set_read_ahead(true);
        if let Some(path) = ca_file {
            b.set_cert_store(ca_store(path)?);
        }
        if insecure {
            b.set_verify(SslVerifyMode::NONE);
        }
        Ok(TlsClient {
            connector: b.build(),
            insecure,
        })
    }

    /// The handshake over `tcp` (whose timeouts bound it), checking that the certificate
    /// names `host` (a name, or an IP address) unless insecure.
    pub fn connect(&self, host: &str, tcp: TcpStream) -> Result<SslStream<TcpStream>, HttpError> {
        let failed = |detail: String| HttpError::Tls {
            host: host.to_owned(),
            detail,
        };
        let mut config = self
            .connector
            .configure()
            .map_err(|e| failed(e.to_string()))?;
        if self.insecure {
            config.set_verify_hostname(false);
        }
        // `connect` sends the name (SNI, unless it is an address) and checks it.
        config.connect(host, tcp).map_err(|e| {
            failed(match &e {
                openssl::ssl::HandshakeError::Failure(mid) => {
                    let verify = mid.ssl().verify_result();
                    match verify == openssl::x509::X509VerifyResult::OK {
                        true => mid.error().to_string(),
                        false => format!("certificate not verified: {verify}"),
                    }
                }
                other => other.to_string(),
            })
        })
    }
}

/// A store of the PEM certificates in `path`, and only those.
fn ca_store(path: &Path) -> Result<openssl::x509::store::X509Store, HttpError> {
    let named = |why: String| HttpError::TlsSetup(format!("{}: {why}", path.display()));
    let pem = std::fs::read(path).map_err(|e| named(e.to_string()))?;
    let certificates = X509::stack_from_pem(&pem).map_err(|e| named(e.to_string()))?;
    if certificates.is_empty() {
        return Err(named("no PEM certificate in it".into()));
    }
    let mut store = X509StoreBuilder::new().map_err(|e| named(e.to_string()))?;
    for certificate in certificates {
        store
            .add_cert(certificate)
            .map_err(|e| named(e.to_string()))?;
    }
    Ok(store.build())
}
