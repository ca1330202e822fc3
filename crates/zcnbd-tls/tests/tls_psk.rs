//! PSK handshakes (psktool file) between zcnbd's TLS server and client, TLS 1.3 and 1.2.

mod tls_support;

use std::io::{Read, Write};
use std::path::Path;
use std::thread;

use tempfile::TempDir;
use tls_support::*;
use zcnbd_tls::{
    HandshakeError, Refusal, TlsClientConfig, TlsConfig, TlsConnector, TlsMode, TlsPeer, TlsServer,
    TlsVersion,
};

fn server(psk: &Path, authz: &[&str]) -> TlsServer {
    TlsConfig {
        mode: TlsMode::Require,
        psk: Some(psk.to_path_buf()),
        authz: authz.iter().map(|s| s.to_string()).collect(),
        ..TlsConfig::default()
    }
    .load()
    .unwrap()
    .unwrap()
}

fn client(psk: &Path, user: &str, version_max: Option<TlsVersion>) -> TlsConnector {
    TlsClientConfig {
        psk_file: Some(psk.to_path_buf()),
        username: Some(user.into()),
        version_max,
        ..TlsClientConfig::default()
    }
    .load()
    .unwrap()
}

fn refusal(outcome: Outcome) -> Refusal {
    match outcome {
        Err(HandshakeError::Refused(r)) => r,
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("expected a refusal, the handshake succeeded"),
    }
}

/// A client-side key file that gives `user` a key the server does not have.
fn wrong_keys(dir: &Path, user: &str) -> std::path::PathBuf {
    let text = format!("{user}:{}\n", "ab".repeat(32));
    write_pem(dir, &format!("{user}.psk"), text.as_bytes(), 0o600)
}

#[test]
fn psk_handshake_and_data_in_tls13_and_tls12() {
    let dir = TempDir::new().unwrap();
    let keys = psk_file(dir.path());
    let srv = server(&keys, &[]);
    for (version, name) in [(None, "TLSv1.3"), (Some(TlsVersion::Tls12), "TLSv1.2")] {
        for user in ["alice", "bob"] {
            let (s, c) = handshake(&srv, &client(&keys, user, version));
            let (s, c) = (s.unwrap(), c.unwrap());
            assert_eq!(s.info().version, name);
            assert_eq!(
                s.info().peer,
                TlsPeer::Psk {
                    identity: user.into()
                }
            );
            let ((mut sr, mut sw), (mut cr, mut cw)) = (s.split(), c.split());
            thread::scope(|scope| {
                scope.spawn(|| cw.write_all(&[3; 100_000]).unwrap());
                scope.spawn(|| sw.write_all(&[4; 100_000]).unwrap());
                let mut up = vec![0; 100_000];
                sr.read_exact(&mut up).unwrap();
                let mut down = vec![0; 100_000];
                cr.read_exact(&mut down).unwrap();
                assert!(up.iter().all(|&b| b == 3) && down.iter().all(|&b| b == 4));
            });
        }
    }
}

#[test]
fn psk_refusals_are_classified() {
    let dir = TempDir::new().unwrap();
    let keys = psk_file(dir.path());
    let srv = server(&keys, &[]);
    let wrong = wrong_keys(dir.path(), "alice");
    let stranger = wrong_keys(dir.path(), "mallory");
    for version in [None, Some(TlsVersion::Tls12)] {
        let (s, c) = handshake(&srv, &client(&wrong, "alice", version));
        assert_eq!(refusal(s), Refusal::PskMismatch, "{version:?}");
        let r = refusal(c);
        assert_eq!(r.reason(), "psk-mismatch", "{r} {version:?}");
        // The server names the unknown user in its log; the client cannot tell it from a
        // wrong key (the server answers with a random key, as GnuTLS does).
        let (s, c) = handshake(&srv, &client(&stranger, "mallory", version));
        assert_eq!(
            refusal(s),
            Refusal::UnknownPskIdentity {
                identity: "mallory".into()
            },
            "{version:?}"
        );
        let r = refusal(c);
        assert_eq!(r.reason(), "psk-mismatch", "{r} {version:?}");
    }
}

#[test]
fn authz_with_psk_lists_usernames() {
    let dir = TempDir::new().unwrap();
    let keys = psk_file(dir.path());
    let srv = server(&keys, &["alice"]);
    let (s, _) = handshake(&srv, &client(&keys, "alice", None));
    assert!(s.is_ok());
    let (s, _) = handshake(&srv, &client(&keys, "bob", None));
    assert_eq!(refusal(s), Refusal::NotAuthorized { peer: "bob".into() });
}

#[test]
fn a_client_without_a_key_for_its_user_fails_at_load() {
    let dir = TempDir::new().unwrap();
    let keys = psk_file(dir.path());
    let err = TlsClientConfig {
        psk_file: Some(keys),
        username: Some("carol".into()),
        ..TlsClientConfig::default()
    }
    .load()
    .err()
    .unwrap();
    assert!(err.to_string().contains("carol"), "{err}");
}
