//! Test credentials made at run time with OpenSSL: a CA, a server certificate for
//! localhost/127.0.0.1, a client certificate, an expired one, one from another CA, and a
//! psktool-style key file; plus a loopback pair and a handshake runner.
#![allow(dead_code)]

use std::fs;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use openssl::asn1::{Asn1Integer, Asn1Time};
use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{BasicConstraints, SubjectAlternativeName};
use openssl::x509::{X509Name, X509};
use tempfile::TempDir;
use zcnbd_tls::{HandshakeError, TlsConnector, TlsServer, TlsSession};

pub const TIMEOUT: Duration = Duration::from_secs(10);
pub const PSK_ALICE: &str = "7682841d058dc2bf74f0ba3589703d86c13e819fa6f50dd3407e4634bb8744f9";
pub const PSK_BOB: &str = "f2119de35b7110839ff89292c2550d90";
/// The client certificate's subject as GnuTLS prints it (and `--tls-authz` takes it).
pub const CLIENT_DN: &str = "CN=client,O=Example";

pub struct Cert {
    pub cert: X509,
    pub key: PKey<Private>,
}

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap()
}

fn name(entries: &[(&str, &str)]) -> X509Name {
    let mut b = X509Name::builder().unwrap();
    for (k, v) in entries {
        b.append_entry_by_text(k, v).unwrap();
    }
    b.build()
}

/// Days relative to now for the validity period.
fn issue(subject: &[(&str, &str)], issuer: Option<&Cert>, days: (i64, i64), leaf: bool) -> Cert {
    let key = key();
    let mut b = X509::builder().unwrap();
    b.set_version(2).unwrap();
    let serial = BigNum::from_u32(rand_serial()).unwrap();
    b.set_serial_number(&Asn1Integer::from_bn(&serial).unwrap())
        .unwrap();
    let subject = name(subject);
    b.set_subject_name(&subject).unwrap();
    b.set_issuer_name(issuer.map_or(&subject, |i| i.cert.subject_name()))
        .unwrap();
    b.set_pubkey(&key).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    b.set_not_before(&Asn1Time::from_unix(now + days.0 * 86400).unwrap())
        .unwrap();
    b.set_not_after(&Asn1Time::from_unix(now + days.1 * 86400).unwrap())
        .unwrap();
    if leaf {
        let san = SubjectAlternativeName::new()
            .dns("localhost")
            .ip("127.0.0.1")
            .build(&b.x509v3_context(issuer.map(|i| i.cert.as_ref()), None))
            .unwrap();
        b.append_extension(san).unwrap();
    } else {
        b.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
    }
    let signer = issuer.map_or(&key, |i| &i.key);
    b.sign(signer, MessageDigest::sha256()).unwrap();
    Cert {
        cert: b.build(),
        key,
    }
}

fn rand_serial() -> u32 {
    let mut b = [0u8; 4];
    openssl::rand::rand_bytes(&mut b).unwrap();
    u32::from_be_bytes(b) >> 1
}

/// Every credential the tests use.
pub struct Pki {
    pub ca: Cert,
    pub server: Cert,
    pub client: Cert,
    pub expired_client: Cert,
    pub other_ca: Cert,
    pub foreign_client: Cert,
    pub foreign_server: Cert,
    pub other_client: Cert,
}

impl Pki {
    pub fn new() -> Pki {
        let ca = issue(
            &[("O", "Example"), ("CN", "Test CA")],
            None,
            (-1, 30),
            false,
        );
        let other_ca = issue(&[("O", "Other"), ("CN", "Other CA")], None, (-1, 30), false);
        let leaf = |cn: &str, issuer: &Cert, days| {
            issue(&[("O", "Example"), ("CN", cn)], Some(issuer), days, true)
        };
        Pki {
            server: leaf("localhost", &ca, (-1, 30)),
            client: leaf("client", &ca, (-1, 30)),
            expired_client: leaf("client", &ca, (-30, -1)),
            foreign_client: leaf("client", &other_ca, (-1, 30)),
            foreign_server: leaf("localhost", &other_ca, (-1, 30)),
            other_client: leaf("intruder", &ca, (-1, 30)),
            ca,
            other_ca,
        }
    }

    /// A server directory: ca-cert.pem, server-cert.pem, server-key.pem (mode 0600).
    pub fn server_dir(&self, server: &Cert) -> TempDir {
        let dir = TempDir::new().unwrap();
        write_pem(
            dir.path(),
            "ca-cert.pem",
            &self.ca.cert.to_pem().unwrap(),
            0o644,
        );
        write_pem(
            dir.path(),
            "server-cert.pem",
            &server.cert.to_pem().unwrap(),
            0o644,
        );
        let key = server.key.private_key_to_pem_pkcs8().unwrap();
        write_pem(dir.path(), "server-key.pem", &key, 0o600);
        dir
    }

    /// A client directory: `ca` as ca-cert.pem, and `client` if given.
    pub fn client_dir(&self, ca: &Cert, client: Option<&Cert>) -> TempDir {
        let dir = TempDir::new().unwrap();
        write_pem(dir.path(), "ca-cert.pem", &ca.cert.to_pem().unwrap(), 0o644);
        if let Some(c) = client {
            write_pem(
                dir.path(),
                "client-cert.pem",
                &c.cert.to_pem().unwrap(),
                0o644,
            );
            let key = c.key.private_key_to_pem_pkcs8().unwrap();
            write_pem(dir.path(), "client-key.pem", &key, 0o600);
        }
        dir
    }
}

pub fn write_pem(dir: &Path, file: &str, bytes: &[u8], mode: u32) -> PathBuf {
    let path = dir.join(file);
    fs::write(&path, bytes).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    path
}

/// A psktool-style file with alice and bob, mode 0600.
pub fn psk_file(dir: &Path) -> PathBuf {
    let text = format!("alice:{PSK_ALICE}\nbob:{PSK_BOB}\n");
    write_pem(dir, "keys.psk", text.as_bytes(), 0o600)
}

pub fn loopback_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    (client, server)
}

pub type Outcome = Result<TlsSession<TcpStream>, HandshakeError>;

/// Runs both sides of a handshake over loopback TCP at once: (server's, client's).
pub fn handshake(server: &TlsServer, client: &TlsConnector) -> (Outcome, Outcome) {
    let (c, s) = loopback_pair();
    thread::scope(|scope| {
        // A side that refuses drops its socket, so the other sees the end too.
        let srv = scope.spawn(move || server.accept(s, &[], TIMEOUT));
        let cli = client.connect(c, "localhost", TIMEOUT);
        (srv.join().unwrap(), cli)
    })
}
