//! X.509 handshakes between zcnbd's TLS server and client over loopback TCP: data both ways
//! with the reader and writer halves on their own threads, and each refusal classified.

mod tls_support;

use std::io::{IoSlice, Read, Write};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use tls_support::*;
use zcnbd_tls::{
    HandshakeError, Refusal, TlsClientConfig, TlsConfig, TlsConnector, TlsMode, TlsPeer, TlsServer,
    TlsVersion, TlsWriter,
};

fn server(dir: &std::path::Path, verify_peer: bool, authz: &[&str]) -> TlsServer {
    TlsConfig {
        mode: TlsMode::Require,
        certificates: Some(dir.to_path_buf()),
        verify_peer,
        authz: authz.iter().map(|s| s.to_string()).collect(),
        psk: None,
        ..TlsConfig::default()
    }
    .load()
    .unwrap()
    .unwrap()
}

fn client(dir: &std::path::Path, version_max: Option<TlsVersion>) -> TlsConnector {
    TlsClientConfig {
        certificates: Some(dir.to_path_buf()),
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

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn mutual_authentication_reports_both_peers() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, Some(&pki.client));
    for version in [None, Some(TlsVersion::Tls12)] {
        let (s, c) = handshake(
            &server(sdir.path(), true, &[CLIENT_DN]),
            &client(cdir.path(), version),
        );
        let (s, c) = (s.unwrap(), c.unwrap());
        let expected = if version.is_some() {
            "TLSv1.2"
        } else {
            "TLSv1.3"
        };
        assert_eq!(s.info().version, expected);
        assert_eq!(
            s.info().peer,
            TlsPeer::Certificate {
                subject: CLIENT_DN.into()
            }
        );
        assert_eq!(
            c.info().peer,
            TlsPeer::Certificate {
                subject: "CN=localhost,O=Example".into()
            }
        );
    }
}

/// Four threads at once: each side's reader and writer move `len` bytes, the writers in
/// mixed slices (a 16-byte header, then data) as reply writers send them.
#[test]
fn both_halves_transfer_concurrently_in_both_directions() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, Some(&pki.client));
    for version in [None, Some(TlsVersion::Tls12)] {
        let (s, c) = handshake(
            &server(sdir.path(), true, &[]),
            &client(cdir.path(), version),
        );
        let (s, c) = (s.unwrap(), c.unwrap());
        let (s_counters, c_counters) = (s.counters(), c.counters());
        let len = 8 << 20;
        let up = pattern(1, len);
        let down = pattern(2, len);
        let ((mut sr, mut sw), (mut cr, mut cw)) = (s.split(), c.split());
        thread::scope(|scope| {
            scope.spawn(|| send_as_replies(&mut cw, &up));
            scope.spawn(|| send_as_replies(&mut sw, &down));
            let got_up = scope.spawn(|| {
                let mut buf = vec![0; len];
                sr.read_exact(&mut buf).unwrap();
                buf
            });
            let mut got_down = vec![0; len];
            cr.read_exact(&mut got_down).unwrap();
            assert!(got_down == down, "server to client bytes differ");
            assert!(
                got_up.join().unwrap() == up,
                "client to server bytes differ"
            );
        });
        assert_eq!(s_counters.decrypted_bytes(), len as u64);
        assert_eq!(s_counters.encrypted_bytes(), len as u64);
        assert_eq!(c_counters.decrypted_bytes(), len as u64);
        sw.close().unwrap();
        let mut rest = [0u8; 1];
        assert_eq!(
            cr.read(&mut rest).unwrap(),
            0,
            "close_notify reads as the end"
        );
    }
}

/// Sends `data` as a reply writer would: a 16-byte header slice, then a data slice.
fn send_as_replies(w: &mut TlsWriter<std::net::TcpStream>, data: &[u8]) {
    for chunk in data.chunks(300_017) {
        let (head, body) = chunk.split_at(16.min(chunk.len()));
        w.write_all_vectored(&[IoSlice::new(head), IoSlice::new(body)])
            .unwrap();
    }
}

/// The server echoes through its writer whatever its reader gets, one thread each, while
/// the client sends and receives at once: every byte crosses both halves concurrently.
#[test]
fn echo_through_reader_and_writer_threads() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, Some(&pki.client));
    let (s, c) = handshake(&server(sdir.path(), false, &[]), &client(cdir.path(), None));
    let ((mut sr, mut sw), (mut cr, mut cw)) = (s.unwrap().split(), c.unwrap().split());
    let data = pattern(7, 4 << 20);
    thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(4);
        scope.spawn(move || loop {
            let mut buf = vec![0; 70_000];
            match sr.read(&mut buf).unwrap() {
                0 => break,
                n => tx.send(buf[..n].to_vec()).unwrap(),
            }
        });
        scope.spawn(move || {
            for chunk in rx {
                sw.write_all(&chunk).unwrap();
            }
            sw.close().unwrap();
        });
        scope.spawn(|| {
            for chunk in data.chunks(5_000) {
                cw.write_all(chunk).unwrap();
            }
            cw.close().unwrap();
        });
        let mut echoed = Vec::new();
        cr.read_to_end(&mut echoed).unwrap();
        assert!(echoed == data, "echo differs");
    });
}

#[test]
fn leftover_bytes_from_the_plaintext_phase_start_the_handshake() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, Some(&pki.client));
    let (srv, cli) = (server(sdir.path(), true, &[]), client(cdir.path(), None));
    let (c, mut s) = loopback_pair();
    thread::scope(|scope| {
        let client = scope.spawn(|| {
            let session = cli.connect(c, "localhost", TIMEOUT).unwrap();
            session.split().1.write_all(b"after").unwrap();
        });
        // The plaintext phase read a little too far: the first 7 bytes of the ClientHello.
        let mut early = [0u8; 7];
        s.read_exact(&mut early).unwrap();
        let session = srv.accept(s, &early, TIMEOUT).unwrap();
        let mut got = [0u8; 5];
        session.split().0.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"after");
        client.join().unwrap();
    });
}

#[test]
fn a_silent_client_times_out() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let srv = server(sdir.path(), false, &[]);
    let (_c, s) = loopback_pair();
    let start = Instant::now();
    let err = srv
        .accept(s, &[], Duration::from_millis(200))
        .err()
        .unwrap();
    assert!(matches!(err, HandshakeError::Timeout(_)), "{err}");
    assert_eq!(err.reason(), "timeout");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn server_refusals_are_classified() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let verifying = server(sdir.path(), true, &[]);
    let cases = [
        (&pki.expired_client, "certificate-expired"),
        (&pki.foreign_client, "unknown-ca"),
    ];
    for (cert, reason) in cases {
        let cdir = pki.client_dir(&pki.ca, Some(cert));
        for version in [None, Some(TlsVersion::Tls12)] {
            let (s, _) = handshake(&verifying, &client(cdir.path(), version));
            let r = refusal(s);
            assert_eq!(r.reason(), reason, "{r} ({version:?})");
        }
    }
    let bare = pki.client_dir(&pki.ca, None);
    for version in [None, Some(TlsVersion::Tls12)] {
        let (s, _) = handshake(&verifying, &client(bare.path(), version));
        assert_eq!(refusal(s), Refusal::NoClientCertificate, "{version:?}");
    }
}

#[test]
fn authz_refuses_other_subjects() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let srv = server(sdir.path(), true, &[CLIENT_DN]);
    let cdir = pki.client_dir(&pki.ca, Some(&pki.other_client));
    let (s, _) = handshake(&srv, &client(cdir.path(), None));
    let r = refusal(s);
    assert_eq!(
        r,
        Refusal::NotAuthorized {
            peer: "CN=intruder,O=Example".into()
        }
    );
    assert_eq!(r.reason(), "not-authorized");
}

#[test]
fn client_refusals_are_classified() {
    let pki = Pki::new();
    // The server presents a certificate from a CA the client does not trust.
    let foreign = pki.server_dir(&pki.foreign_server);
    let srv = server(foreign.path(), false, &[]);
    let cdir = pki.client_dir(&pki.ca, None);
    let (s, c) = handshake(&srv, &client(cdir.path(), None));
    assert_eq!(refusal(c).reason(), "unknown-ca");
    assert_eq!(
        refusal(s).reason(),
        "peer-alert",
        "the server hears the client's alert"
    );
    // The right CA, but the wrong name.
    let sdir = pki.server_dir(&pki.server);
    let srv = server(sdir.path(), false, &[]);
    let named = TlsClientConfig {
        certificates: Some(cdir.path().to_path_buf()),
        hostname: Some("nbd.example.com".into()),
        ..TlsClientConfig::default()
    }
    .load()
    .unwrap();
    let (_, c) = handshake(&srv, &named);
    assert_eq!(refusal(c), Refusal::HostnameMismatch);
}

/// qemu and nbdkit clients often close the socket after NBD_CMD_DISC without close_notify:
/// the reader sees a plain end, not an error.
#[test]
fn a_close_without_close_notify_reads_as_the_end() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, None);
    for version in [None, Some(TlsVersion::Tls12)] {
        let (s, c) = handshake(
            &server(sdir.path(), false, &[]),
            &client(cdir.path(), version),
        );
        let (mut sr, _sw) = s.unwrap().split();
        let (_cr, mut cw) = c.unwrap().split();
        cw.write_all(b"bye").unwrap();
        drop(cw);
        drop(_cr);
        let mut got = Vec::new();
        sr.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"bye");
    }
}
