//! Interop with GnuTLS (the TLS library of qemu, nbdkit and libnbd): `gnutls-cli` as the
//! client of zcnbd's TLS server with PSK (TLS 1.3 and 1.2) and X.509 with a client
//! certificate checked by `--tls-authz`, and `certtool` confirming the subject format. Each
//! test is skipped, with the reason printed, when gnutls-bin is not installed (and fails
//! under `CI=true`).

mod tls_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use tempfile::TempDir;
use tls_support::*;
use zcnbd_tls::{gnutls_dn, TlsConfig, TlsMode, TlsPeer, TlsServer};

/// Whether `tool` is installed; without it the test is skipped with the reason printed, but
/// under CI (`CI=true`) a missing tool fails the test instead (scripts/install-deps.sh
/// installs it).
fn have(tool: &str) -> bool {
    let found = Command::new(tool).arg("--version").output().is_ok();
    if !found {
        let why = format!("{tool} not installed (Debian package gnutls-bin)");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{why}, and CI=true"
        );
        eprintln!("SKIPPED: {why}");
    }
    found
}

/// Serves one connection: handshake, answer one line with `pong <line>`, read to the end.
/// Returns what the handshake negotiated.
fn serve_one(server: TlsServer, listener: TcpListener) -> thread::JoinHandle<(String, TlsPeer)> {
    thread::spawn(move || {
        let (sock, _) = listener.accept().unwrap();
        let session = server.accept(sock, &[], TIMEOUT).unwrap();
        let info = session.info().clone();
        let (reader, mut writer) = session.split();
        let mut reader = BufReader::new(reader);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        writer.write_all(format!("pong {line}").as_bytes()).unwrap();
        let mut rest = Vec::new();
        let _ = reader.read_to_end(&mut rest);
        (info.version, info.peer)
    })
}

/// Runs gnutls-cli with `args` against `port`, sends `ping`, and waits for the answer.
fn gnutls_cli(port: u16, args: &[&str]) {
    let mut child = Command::new("gnutls-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    stdin.write_all(b"ping\n").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("pong ping") => break,
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = child.kill();
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("no answer from the server; stdout {seen:?}; stderr {err}");
            }
        }
    }
    drop(stdin);
    let _ = child.wait();
}

fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

fn psk_server(keys: &Path) -> TlsServer {
    TlsConfig {
        mode: TlsMode::Require,
        psk: Some(keys.to_path_buf()),
        ..TlsConfig::default()
    }
    .load()
    .unwrap()
    .unwrap()
}

#[test]
fn gnutls_cli_psk_tls13_and_tls12() {
    if !have("gnutls-cli") {
        return;
    }
    let dir = TempDir::new().unwrap();
    let keys = psk_file(dir.path());
    // TLS 1.3 with qemu's and nbdkit's priority string for PSK. For TLS 1.2, plain PSK key
    // exchange: gnutls-cli 3.7.9 itself crashes (SIGSEGV) after a TLS 1.2 ECDHE-PSK or
    // DHE-PSK handshake completes, against OpenSSL's s_server as well.
    for (priority, version) in [
        ("NORMAL:+ECDHE-PSK:+DHE-PSK:+PSK", "TLSv1.3"),
        ("NORMAL:-KX-ALL:+PSK:-VERS-TLS1.3", "TLSv1.2"),
    ] {
        let (l, port) = listener();
        let served = serve_one(psk_server(&keys), l);
        let prio = format!("--priority={priority}");
        let key = format!("--pskkey={PSK_ALICE}");
        gnutls_cli(port, &["--pskusername=alice", &key, &prio, "127.0.0.1"]);
        let (negotiated, peer) = served.join().unwrap();
        assert_eq!(negotiated, version);
        assert_eq!(
            peer,
            TlsPeer::Psk {
                identity: "alice".into()
            }
        );
    }
}

#[test]
fn gnutls_cli_x509_with_a_client_certificate_and_authz() {
    if !have("gnutls-cli") {
        return;
    }
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, Some(&pki.client));
    for (extra, version) in [("", "TLSv1.3"), (":-VERS-TLS1.3", "TLSv1.2")] {
        let server = TlsConfig {
            mode: TlsMode::Require,
            certificates: Some(sdir.path().to_path_buf()),
            verify_peer: true,
            authz: vec![CLIENT_DN.into()],
            psk: None,
            ..TlsConfig::default()
        }
        .load()
        .unwrap()
        .unwrap();
        let (l, port) = listener();
        let served = serve_one(server, l);
        let file = |name: &str| cdir.path().join(name).display().to_string();
        gnutls_cli(
            port,
            &[
                &format!("--x509cafile={}", file("ca-cert.pem")),
                &format!("--x509certfile={}", file("client-cert.pem")),
                &format!("--x509keyfile={}", file("client-key.pem")),
                &format!("--priority=NORMAL{extra}"),
                "localhost",
            ],
        );
        let (negotiated, peer) = served.join().unwrap();
        assert_eq!(negotiated, version);
        assert_eq!(
            peer,
            TlsPeer::Certificate {
                subject: CLIENT_DN.into()
            }
        );
    }
}

/// The subject string `--tls-authz` compares is the one GnuTLS prints (as qemu does).
#[test]
fn subject_names_match_certtool() {
    if !have("certtool") {
        return;
    }
    let pki = Pki::new();
    let dir = pki.client_dir(&pki.ca, Some(&pki.client));
    for cert in ["ca-cert.pem", "client-cert.pem"] {
        let out = Command::new("certtool")
            .args(["-i", "--infile"])
            .arg(dir.path().join(cert))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let theirs = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("Subject: "))
            .expect("certtool prints a Subject line");
        let pem = std::fs::read(dir.path().join(cert)).unwrap();
        let ours = gnutls_dn(openssl::x509::X509::from_pem(&pem).unwrap().subject_name());
        assert_eq!(ours.as_deref(), Some(theirs));
    }
}
