//! The client over TLS (`nbds+unix://`, `nbds://`) against real servers that require it:
//! zcnbd (`--tls=require`, X.509 with and without a client certificate, PSK), nbdkit
//! (`--tls=require`, X.509 and PSK) and qemu-nbd (`--tls-creds`, X.509 and PSK): reads,
//! writes, holes, block status, splitting and many requests in flight; and every refusal
//! with its typed error, promptly (wrong PSK, unknown CA, host name mismatch, missing
//! client certificate, a server without TLS, TLS required but not asked for).

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::servers::{self, Kind, Running, Tls};
use common::tls_creds::{self, Creds, PSK_USER};
use zcnbd_client::{Client, Completion, Error, Refusal, WriteFlags, ZeroFlags};

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn connect(uri: &str) -> Client {
    Client::connect(uri).unwrap_or_else(|e| panic!("{uri}: connect: {e}"))
}

/// `uri`'s connect error, which must come within a few seconds (no hang).
fn refused(uri: &str) -> Error {
    let start = Instant::now();
    let e = match Client::connect(uri) {
        Ok(_) => panic!("{uri}: connected, expected a refusal"),
        Err(e) => e,
    };
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{uri}: slow refusal"
    );
    eprintln!("{uri}: refused as expected: {e}");
    e
}

fn socket_uri(server: &Running, user: &str, query: &str) -> String {
    let sock = server.socket.as_ref().expect("a Unix socket");
    format!("nbds+unix://{user}/?socket={}&{query}", sock.display())
}

fn x509_query(dir: &std::path::Path) -> String {
    format!("tls-certificates={}", dir.display())
}

fn psk_query(file: &std::path::Path) -> String {
    format!("tls-psk-file={}", file.display())
}

/// The same data-path checks as the plain interop suite, over TLS.
fn checks(server: &Running) {
    let c = connect(&server.uri);
    assert_eq!(c.size(), servers::EXPORT_BYTES);
    let data = pattern(1 << 20, 1);
    c.write_at(&data, 1 << 20).expect("write");
    let mut back = vec![0u8; data.len()];
    c.read_at(&mut back, 1 << 20).expect("read");
    assert!(back == data, "{:?}: read back differs", server.kind);

    // Odd slices both ways: headers and data share records, records span slices.
    let small = pattern(16384, 2);
    let (a, rest) = small.split_at(7);
    let (b, d) = rest.split_at(5001);
    let pieces = [IoSlice::new(a), IoSlice::new(b), IoSlice::new(d)];
    c.write_vectored_at(&pieces, 3 << 20, WriteFlags { fua: false })
        .expect("vectored write");
    let (mut x, mut y, mut z) = (vec![0u8; 3], vec![0u8; 9000], vec![0u8; 16384 - 9003]);
    let mut bufs = [
        IoSliceMut::new(&mut x),
        IoSliceMut::new(&mut y),
        IoSliceMut::new(&mut z),
    ];
    c.read_vectored_at(&mut bufs, 3 << 20)
        .expect("vectored read");
    assert!([x, y, z].concat() == small, "{:?}: vectored", server.kind);

    // Holes between data, zero-filled in the caller's buffer.
    let base = 8 << 20;
    c.write_zeroes(base, 16384, ZeroFlags::default())
        .expect("zero");
    c.write_at(&data[..4096], base).expect("write one");
    let mut holes = vec![0xaa; 16384];
    c.read_at(&mut holes, base).expect("read holes");
    assert!(holes[..4096] == data[..4096] && holes[4096..].iter().all(|&b| b == 0));

    // Larger than any server's maximum payload: split into several requests.
    let big = pattern(40 << 20, 3);
    c.write_at(&big, 16 << 20).expect("big write");
    let mut big_back = vec![0u8; big.len()];
    c.read_at(&mut big_back, 16 << 20).expect("big read");
    assert!(
        big_back == big,
        "{:?}: split read back differs",
        server.kind
    );

    if c.geometry().base_allocation {
        let extents = c.block_status(0, c.size()).expect("block status");
        assert!(!extents.is_empty() && extents.iter().all(|e| e.length > 0));
    }
    many_in_flight(&c, server);
    c.flush().expect("flush");

    let stats = c.stats();
    eprintln!("{:?}: {stats:?}", server.kind);
    assert_eq!(stats.copied_bytes, 0);
    assert_eq!(
        stats.received_in_place_bytes, 0,
        "TLS data is decrypted, not received"
    );
    assert!(stats.tls_encrypted_bytes >= (big.len() + data.len()) as u64);
    assert!(stats.tls_decrypted_bytes >= (big.len() + data.len()) as u64);
}

fn many_in_flight(c: &Client, server: &Running) {
    let block = 65536usize;
    let base = 60u64 << 20;
    for i in 0..32u64 {
        c.submit_write(
            pattern(block, 100 + i),
            base + i * block as u64,
            WriteFlags::default(),
            i,
        )
        .expect("submit write");
    }
    let mut done = Vec::new();
    while done.len() < 32 {
        c.complete(&mut done, Some(Duration::from_secs(10)));
    }
    assert!(done.iter().all(|d| d.result.is_ok()), "{:?}", server.kind);
    for i in 0..32u64 {
        c.submit_read(vec![0u8; block], base + i * block as u64, i)
            .expect("submit read");
    }
    let mut reads: Vec<Completion> = Vec::new();
    while reads.len() < 32 {
        c.complete(&mut reads, Some(Duration::from_secs(10)));
    }
    for r in &reads {
        assert!(r.result.is_ok() && r.buffer == pattern(block, 100 + r.user_data));
    }
}

fn creds() -> Option<&'static Creds> {
    tls_creds::get()
}

fn x509_server(kind: Kind, creds: &Creds, verify_peer: bool) -> Option<Running> {
    let tls = Tls::X509 {
        dir: &creds.server,
        verify_peer,
    };
    servers::start_tls(kind, tls, "", &x509_query(&creds.client))
}

fn psk_server(kind: Kind, creds: &Creds) -> Option<Running> {
    let user = format!("{PSK_USER}@");
    servers::start_tls(
        kind,
        Tls::Psk { file: &creds.psk },
        &user,
        &psk_query(&creds.psk),
    )
}

#[test]
fn zcnbd_x509() {
    let Some(creds) = creds() else { return };
    let Some(server) = x509_server(Kind::Zcnbd, creds, false) else {
        return;
    };
    checks(&server);
    // No client certificate is needed without --tls-verify-peer.
    connect(&socket_uri(&server, "", &x509_query(&creds.client_no_cert)));
}

#[test]
fn zcnbd_x509_with_a_client_certificate() {
    let Some(creds) = creds() else { return };
    let Some(server) = x509_server(Kind::Zcnbd, creds, true) else {
        return;
    };
    checks(&server);
    // Under TLS 1.3 the server refuses a missing certificate after our side of the
    // handshake is done: the alert arrives with the first option reply.
    let e = refused(&socket_uri(&server, "", &x509_query(&creds.client_no_cert)));
    assert!(matches!(e, Error::Tls(Refusal::NoClientCertificate)), "{e}");
    assert_eq!(e.errno(), libc::EACCES);
}

#[test]
fn zcnbd_psk() {
    let Some(creds) = creds() else { return };
    let Some(server) = psk_server(Kind::Zcnbd, creds) else {
        return;
    };
    checks(&server);
}

#[test]
fn nbdkit_x509() {
    let Some(creds) = creds() else { return };
    let Some(server) = x509_server(Kind::Nbdkit, creds, false) else {
        return;
    };
    checks(&server);
}

#[test]
fn nbdkit_psk() {
    let Some(creds) = creds() else { return };
    let Some(server) = psk_server(Kind::Nbdkit, creds) else {
        return;
    };
    checks(&server);
    // GnuTLS hangs up without an alert when the keys differ: the error says so.
    let wrong = socket_uri(&server, "alice@", &psk_query(&creds.psk_wrong));
    let e = refused(&wrong);
    assert!(
        matches!(&e, Error::Tls(Refusal::PskMismatch))
            || matches!(&e, Error::Handshake(m) if m.contains("pre-shared key")),
        "{e}"
    );
}

#[test]
fn qemu_nbd_x509() {
    let Some(creds) = creds() else { return };
    // QEMU's default for a server: verify-peer=on, so the client presents its certificate.
    let Some(server) = x509_server(Kind::QemuNbd, creds, true) else {
        return;
    };
    checks(&server);
    // GnuTLS resets the connection rather than send an alert; the error names the likely
    // cause.
    let e = refused(&socket_uri(&server, "", &x509_query(&creds.client_no_cert)));
    assert!(
        matches!(&e, Error::Tls(_))
            || matches!(&e, Error::Handshake(m) if m.contains("client certificate")),
        "{e}"
    );
}

#[test]
fn qemu_nbd_psk() {
    let Some(creds) = creds() else { return };
    let Some(server) = psk_server(Kind::QemuNbd, creds) else {
        return;
    };
    checks(&server);
}

#[test]
fn refusals_name_their_reason() {
    let Some(creds) = creds() else { return };
    let Some(x509) = x509_server(Kind::Zcnbd, creds, false) else {
        return;
    };
    let unknown_ca = refused(&socket_uri(&x509, "", &x509_query(&creds.client_other_ca)));
    assert!(
        matches!(unknown_ca, Error::Tls(Refusal::UnknownCa { .. })),
        "{unknown_ca}"
    );
    let query = format!("{}&tls-hostname=other.example", x509_query(&creds.client));
    let mismatch = refused(&socket_uri(&x509, "", &query));
    assert!(
        matches!(mismatch, Error::Tls(Refusal::HostnameMismatch)),
        "{mismatch}"
    );
    // tls-verify-peer=false checks neither the CA nor the name.
    let query = format!(
        "{}&tls-hostname=other.example&tls-verify-peer=false",
        x509_query(&creds.client_other_ca)
    );
    connect(&socket_uri(&x509, "", &query));
    // TLS required by the server, not asked for by the URI.
    let plain = format!(
        "nbd+unix:///?socket={}",
        x509.socket.as_ref().unwrap().display()
    );
    let required = refused(&plain);
    assert!(matches!(required, Error::TlsRequired(_)), "{required}");
    // Credentials that cannot be read: before any connection.
    let missing = refused(&socket_uri(
        &x509,
        "alice@",
        "tls-psk-file=/nonexistent/keys.psk",
    ));
    assert!(matches!(missing, Error::TlsCredentials(_)), "{missing}");
    assert_eq!(missing.errno(), libc::ENOENT);

    let Some(psk) = psk_server(Kind::Zcnbd, creds) else {
        return;
    };
    let wrong = refused(&socket_uri(&psk, "alice@", &psk_query(&creds.psk_wrong)));
    assert!(matches!(wrong, Error::Tls(Refusal::PskMismatch)), "{wrong}");
}

#[test]
fn nbds_to_a_server_without_tls_fails_clearly() {
    for kind in [Kind::Zcnbd, Kind::Nbdkit, Kind::QemuNbd] {
        let Some(server) = servers::start(kind) else {
            continue;
        };
        let e = refused(&socket_uri(&server, "", "tls-verify-peer=false"));
        assert!(matches!(e, Error::TlsUnavailable(_)), "{kind:?}: {e}");
        assert_eq!(e.errno(), libc::EOPNOTSUPP);
    }
}

/// `nbds://127.0.0.1:PORT/`: TCP, and the certificate checked against an IP address.
#[test]
fn zcnbd_over_tcp_checks_the_address() {
    let Some(creds) = creds() else { return };
    let Some(bin) = servers::zcnbd_bin() else {
        assert!(!servers::ci(), "the zcnbd binary is not built");
        return;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new(bin)
        .args(["serve", "-b", "127.0.0.1", "-p", &port.to_string()])
        .args(["--memory", "64M", "--tls=require"])
        .arg(format!("--tls-certificates={}", creds.server.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start zcnbd");
    let _guard = Kill(child);
    let uri = format!("nbds://127.0.0.1:{port}/?{}", x509_query(&creds.client));
    let deadline = Instant::now() + Duration::from_secs(10);
    let c = loop {
        match Client::connect(&uri) {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => panic!("{uri}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let data = pattern(1 << 20, 9);
    c.write_at(&data, 0).expect("write");
    let mut back = vec![0u8; data.len()];
    c.read_at(&mut back, 0).expect("read");
    assert!(back == data);
    let localhost = format!("nbds://localhost:{port}/?{}", x509_query(&creds.client));
    drop(connect(&localhost));
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
