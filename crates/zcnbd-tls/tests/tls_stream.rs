//! `TlsStream`, the one-thread connection the client uses: over a non-blocking socket it
//! moves bytes both ways in odd slices while the server echoes them, a refusal that arrives
//! after the handshake (TLS 1.3 client certificates) reads as a typed `Refusal` (also when a
//! write meets the closed socket first), and a close reads as the end.

mod tls_support;

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

use tls_support::*;
use zcnbd_tls::{
    refusal_of, Refusal, TlsClientConfig, TlsConfig, TlsConnector, TlsMode, TlsServer, TlsStream,
    TlsVersion, Transport,
};

fn server(dir: &std::path::Path, verify_peer: bool) -> TlsServer {
    TlsConfig {
        mode: TlsMode::Require,
        certificates: Some(dir.to_path_buf()),
        verify_peer,
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

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

/// The server side echoes everything back until the client closes.
fn echo_server(server: TlsServer, sock: TcpStream) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let session = server.accept(sock, &[], TIMEOUT).expect("server handshake");
        let (mut reader, mut writer) = session.split();
        let mut buf = vec![0u8; 100_000];
        let mut total = 0;
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => return total,
                Ok(n) => {
                    writer.write_all(&buf[..n]).expect("echo");
                    total += n as u64;
                }
            }
        }
    })
}

/// Slices of `data[from..]` cut like a client's requests: a 32-byte header, then pieces.
fn request_slices(data: &[u8], from: usize) -> Vec<IoSlice<'_>> {
    let sizes = [32, 1, 4096, 7, 65536, 32, 300_000, 32, 16384];
    let mut out = Vec::new();
    let mut at = from;
    for size in sizes.iter().cycle() {
        if at >= data.len() || out.len() >= 64 {
            break;
        }
        let end = (at + size).min(data.len());
        out.push(IoSlice::new(&data[at..end]));
        at = end;
    }
    out
}

fn would_block<T>(r: io::Result<T>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        Err(e) => panic!("stream error: {e}"),
    }
}

#[test]
fn non_blocking_stream_moves_bytes_both_ways_in_odd_slices() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, None);
    for version in [None, Some(TlsVersion::Tls12)] {
        let (c, s) = loopback_pair();
        let echo = echo_server(server(sdir.path(), false), s);
        let stream = client(cdir.path(), version)
            .connect_stream(c, "localhost", TIMEOUT)
            .expect("client handshake");
        let mut stream: TlsStream<TcpStream> = stream
            .map_socket(|s| s.set_nonblocking(true).map(|()| s))
            .unwrap();
        let data = pattern(7, 6 << 20);
        let mut back = vec![0u8; data.len()];
        let (mut sent, mut got) = (0, 0);
        let deadline = Instant::now() + Duration::from_secs(30);
        while got < data.len() {
            assert!(
                Instant::now() < deadline,
                "stalled at sent {sent} got {got}"
            );
            let mut moved = false;
            if sent < data.len() {
                if let Some(n) = would_block(stream.write_from(&request_slices(&data, sent))) {
                    sent += n;
                    moved |= n > 0;
                }
            } else if stream.wants_write() {
                moved |= would_block(stream.send_pending()).is_some();
            }
            // Three uneven destination slices per read, as a vectored read reply.
            let (a, rest) = back[got..].split_at_mut(((got % 5) + 1).min(data.len() - got));
            let (b, c) = rest.split_at_mut(rest.len().min(20_000));
            let mut bufs = [IoSliceMut::new(a), IoSliceMut::new(b), IoSliceMut::new(c)];
            if let Some(n) = would_block(stream.read_into(&mut bufs)) {
                assert!(n > 0, "the server closed early");
                got += n;
                moved = true;
            }
            if !moved {
                thread::sleep(Duration::from_micros(200));
            }
        }
        assert!(back == data, "echoed bytes differ ({version:?})");
        assert_eq!(stream.counters().encrypted_bytes(), data.len() as u64);
        assert_eq!(stream.counters().decrypted_bytes(), data.len() as u64);
        stream.close_notify();
        drop(stream);
        assert_eq!(echo.join().unwrap(), data.len() as u64);
    }
}

/// Under TLS 1.3 the client finishes its handshake before the server checks the client's
/// certificate; the server's alert is then what the first read meets.
#[test]
fn a_refusal_after_the_handshake_reads_as_a_typed_refusal() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, None);
    let (c, s) = loopback_pair();
    let srv = server(sdir.path(), true);
    let refused = thread::spawn(move || srv.accept(s, &[], TIMEOUT).err());
    let mut stream = client(cdir.path(), None)
        .connect_stream(c, "localhost", TIMEOUT)
        .expect("the client's side of a TLS 1.3 handshake completes");
    stream.write_all(b"an NBD option").unwrap();
    let mut buf = [0u8; 16];
    let err = stream.read(&mut buf).expect_err("the server refused");
    assert_eq!(
        refusal_of(&err),
        Some(&Refusal::NoClientCertificate),
        "{err}"
    );
    assert!(refused.join().unwrap().is_some());
}

/// The same refusal when the client writes only after the server has sent its alert and
/// closed: the write meets a closed socket (EPIPE, or ECONNRESET over TCP), and the alert
/// the server left behind is still what the client reports.
#[test]
fn a_refusal_that_a_write_meets_first_still_reads_as_a_typed_refusal() {
    let (c, s) = UnixStream::pair().unwrap();
    refusal_met_by_a_write(c, s);
    let (c, s) = loopback_pair();
    refusal_met_by_a_write(c, s);
}

fn refusal_met_by_a_write<S: Transport>(c: S, s: S) {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, None);
    let srv = server(sdir.path(), true);
    let refused = thread::spawn(move || srv.accept(s, &[], TIMEOUT).err());
    let mut stream = client(cdir.path(), None)
        .connect_stream(c, "localhost", TIMEOUT)
        .expect("the client's side of a TLS 1.3 handshake completes");
    // The server has refused and dropped its socket before the client writes.
    assert!(refused.join().unwrap().is_some());
    // Over TCP the first write may still be taken (the peer answers it with a reset).
    let err = (0..100)
        .find_map(|_| {
            stream
                .write_all(b"an NBD option")
                .and_then(|()| stream.flush())
                .err()
        })
        .expect("a write fails once the server is gone");
    assert_eq!(
        refusal_of(&err),
        Some(&Refusal::NoClientCertificate),
        "{err}"
    );
}

#[test]
fn close_notify_reads_as_the_end() {
    let pki = Pki::new();
    let sdir = pki.server_dir(&pki.server);
    let cdir = pki.client_dir(&pki.ca, None);
    let (c, s) = loopback_pair();
    let srv = server(sdir.path(), false);
    let closer = thread::spawn(move || {
        let session = srv.accept(s, &[], TIMEOUT).unwrap();
        let (_reader, mut writer) = session.split();
        writer.write_all(b"bye").unwrap();
        writer.close().unwrap();
    });
    let mut stream = client(cdir.path(), None)
        .connect_stream(c, "localhost", TIMEOUT)
        .unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(stream.read(&mut buf).unwrap(), 3);
    assert_eq!(&buf[..3], b"bye");
    assert_eq!(stream.read(&mut buf).unwrap(), 0);
    closer.join().unwrap();
}
