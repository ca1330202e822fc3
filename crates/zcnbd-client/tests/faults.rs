//! Servers that misbehave, scripted on top of the real server handshake: a malformed reply,
//! a hang-up in the middle of a request, a server shutting down. The client must fail what
//! is in flight promptly and never trust the bad bytes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod common;

use zcnbd_client::{Client, ClientOptions, Error};
use zcnbd_proto::consts::transmission_flags as tf;
use zcnbd_proto::{BlockSize, ExportInfo, Negotiated, ReplyMode, ReplyTo, RequestHeader};

const SIZE: u64 = 1 << 20;

/// A one-connection server: the real handshake, then `script` with the socket.
fn fake_server(
    script: impl FnOnce(UnixStream, Negotiated) + Send + 'static,
) -> (String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path: PathBuf = dir.path().join("fake.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let negotiated = handshake(&mut stream);
        script(stream, negotiated);
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    (uri, dir)
}

/// The same over TCP on the loopback: its URI.
fn fake_tcp_server(script: impl FnOnce(TcpStream, Negotiated) + Send + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let negotiated = handshake(&mut stream);
        script(stream, negotiated);
    });
    format!("nbd://127.0.0.1:{port}/")
}

/// The server's side of the handshake on `stream`, for one export of [`SIZE`] bytes.
fn handshake(stream: &mut (impl Read + Write)) -> Negotiated {
    let exports = [ExportInfo {
        name: String::new(),
        description: String::new(),
        size: SIZE,
        flags: tf::HAS_FLAGS | tf::SEND_FLUSH | tf::SEND_FUA,
        block_size: BlockSize::default(),
        tls_only: false,
        meta_contexts: Vec::new(),
    }];
    common::fake::handshake(stream, &exports)
}

/// Reads one request header (no payload expected).
fn read_request(stream: &mut impl Read, mode: ReplyMode) -> Option<RequestHeader> {
    let mut buf = vec![0u8; mode.request_header_bytes()];
    stream.read_exact(&mut buf).ok()?;
    RequestHeader::decode(&buf, mode).ok().flatten()
}

fn options(extended: bool) -> ClientOptions {
    ClientOptions {
        extended_headers: extended,
        ..ClientOptions::default()
    }
}

#[test]
fn a_malformed_reply_disconnects_and_fails_everything_in_flight() {
    for extended in [false, true] {
        let (uri, _dir) = fake_server(|mut s, n| {
            let first = read_request(&mut s, n.mode).expect("request");
            let _second = read_request(&mut s, n.mode);
            // A data chunk that reaches past the request: the spec says hang up.
            let mut out = Vec::new();
            let to = ReplyTo {
                mode: n.mode,
                cookie: first.cookie,
                offset: first.offset,
            };
            to.encode_data_header(first.offset + 4096, 4096, true, &mut out);
            out.extend_from_slice(&[7u8; 4096]);
            let _ = s.write_all(&out);
            std::thread::sleep(Duration::from_secs(5));
        });
        let c = Client::connect_with(&uri, &options(extended)).expect("connect");
        c.submit_read(vec![0u8; 4096], 0, 1).expect("submit");
        c.submit_read(vec![0u8; 4096], 8192, 2).expect("submit");
        let start = Instant::now();
        let mut done = Vec::new();
        while done.len() < 2 {
            c.complete(&mut done, Some(Duration::from_secs(1)));
            assert!(start.elapsed() < Duration::from_secs(3), "hang");
        }
        for d in &done {
            assert!(
                matches!(d.result, Err(Error::Protocol(_))),
                "{:?}",
                d.result
            );
            assert!(d.buffer.iter().all(|&b| b == 0), "bad data was written");
        }
        let mut buf = [0u8; 512];
        assert!(matches!(c.read_at(&mut buf, 0), Err(Error::Protocol(_))));
    }
}

#[test]
fn a_hang_up_mid_request_fails_it_promptly() {
    let (uri, _dir) = fake_server(|mut s, n| {
        let r = read_request(&mut s, n.mode).expect("request");
        // Half a reply, then gone.
        let mut out = Vec::new();
        let to = ReplyTo {
            mode: n.mode,
            cookie: r.cookie,
            offset: r.offset,
        };
        to.encode_data_header(r.offset, 65536, true, &mut out);
        out.extend_from_slice(&[1u8; 1000]);
        let _ = s.write_all(&out);
    });
    let c = Client::connect(&uri).expect("connect");
    let start = Instant::now();
    let mut buf = vec![0u8; 65536];
    let e = c.read_at(&mut buf, 0).expect_err("the server left");
    assert!(
        matches!(e, Error::Disconnected(_) | Error::Io { .. }),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    assert_eq!(e.errno(), libc::ENOTCONN);
}

#[test]
fn server_errors_come_back_per_request() {
    let (uri, _dir) = fake_server(|mut s, n| {
        let mut out = Vec::new();
        for k in 0..2 {
            let r = read_request(&mut s, n.mode).expect("request");
            let to = ReplyTo {
                mode: n.mode,
                cookie: r.cookie,
                offset: r.offset,
            };
            if k == 0 {
                to.encode_error(zcnbd_proto::Errno::Io, "media error", &mut out);
            } else {
                to.encode_ok(&mut out);
            }
        }
        s.write_all(&out).expect("send");
        // ESHUTDOWN makes the client disconnect softly: it sends NBD_CMD_DISC.
        let r = read_request(&mut s, n.mode).expect("request");
        out.clear();
        let to = ReplyTo {
            mode: n.mode,
            cookie: r.cookie,
            offset: r.offset,
        };
        to.encode_error(zcnbd_proto::Errno::Shutdown, "going away", &mut out);
        s.write_all(&out).expect("send");
        let disc = read_request(&mut s, n.mode).expect("a disconnect request");
        assert_eq!(disc.kind, zcnbd_proto::Command::Disc.to_wire());
    });
    let c = Client::connect(&uri).expect("connect");
    c.submit_flush(1).expect("submit");
    c.submit_flush(2).expect("submit");
    let mut done = Vec::new();
    while done.len() < 2 {
        c.complete(&mut done, Some(Duration::from_secs(3)));
    }
    done.sort_by_key(|d| d.user_data);
    match &done[0].result {
        Err(e @ Error::Server(f)) => {
            assert_eq!(f.message, "media error");
            assert_eq!(e.errno(), libc::EIO);
        }
        other => panic!("{other:?}"),
    }
    assert!(done[1].result.is_ok());
    let e = c.flush().expect_err("shutdown");
    assert_eq!(e.errno(), libc::ESHUTDOWN);
    // After ESHUTDOWN the connection drains and closes.
    assert!(c.flush().is_err());
}

/// A raw connection: negotiated here, then framed by the caller with `ClientSession` on a
/// socket left blocking (an io_uring of the caller's waits on it); the server's answer to a
/// read (a hole, then data at its offset) is what the session reports. TLS is refused.
#[test]
fn a_raw_connection_carries_the_callers_requests() {
    for extended in [false, true] {
        let (uri, _dir) = fake_server(|mut s, n| {
            let r = read_request(&mut s, n.mode).expect("request");
            assert_eq!(r.kind, zcnbd_proto::Command::Read.to_wire());
            let to = ReplyTo {
                mode: n.mode,
                cookie: r.cookie,
                offset: r.offset,
            };
            let mut out = Vec::new();
            to.encode_hole(r.offset, 4096, false, &mut out);
            to.encode_data_header(r.offset + 4096, 4096, true, &mut out);
            out.extend_from_slice(&[0xa5; 4096]);
            s.write_all(&out).expect("send");
        });
        let raw = zcnbd_client::open_raw(&uri, &options(extended)).expect("open");
        let flags = rustix::fs::fcntl_getfl(&raw.socket).expect("flags");
        assert!(!flags.contains(rustix::fs::OFlags::NONBLOCK));
        let mode = raw.mode();
        assert_eq!(mode == ReplyMode::Extended, extended);
        let mut session = zcnbd_proto::ClientSession::new(mode, None, Default::default());
        let mut out = Vec::new();
        let request = zcnbd_proto::Request {
            command: zcnbd_proto::Command::Read,
            flags: 0,
            offset: 65536,
            length: 8192,
        };
        let cookie = session.start(request, &mut out).expect("start");
        let mut stream = UnixStream::from(raw.socket);
        stream.write_all(&out).expect("send");
        let (mut events, mut buf) = (Vec::new(), vec![0u8; 8192]);
        while !events
            .iter()
            .any(|e| matches!(e, zcnbd_proto::ReplyEvent::Done { .. }))
        {
            match session.want() {
                zcnbd_proto::Want::Header(_) => {
                    let mut header = vec![0u8; session.header_read_hint()];
                    let n = stream.read(&mut header).expect("receive");
                    assert!(n > 0, "the server hung up");
                    let mut fed = 0;
                    while fed < n {
                        let (used, event) = session.handle_input(&header[fed..n]).expect("reply");
                        fed += used;
                        events.extend(event);
                    }
                }
                zcnbd_proto::Want::Payload { at, bytes, .. } => {
                    let part = &mut buf[at as usize..(at + bytes) as usize];
                    stream.read_exact(part).expect("payload");
                    events.extend(session.payload_received(bytes));
                }
            }
        }
        let done = zcnbd_proto::ReplyEvent::Done {
            cookie,
            result: Ok(()),
        };
        assert!(events.contains(&done), "{events:?}");
        assert!(events.iter().any(|e| matches!(
            e,
            zcnbd_proto::ReplyEvent::Hole {
                at: 0,
                bytes: 4096,
                ..
            }
        )));
        assert!(buf[4096..].iter().all(|&b| b == 0xa5));
    }
    let tls = zcnbd_client::open_raw("nbds://127.0.0.1:1/", &ClientOptions::default());
    assert!(matches!(tls, Err(Error::Unsupported(_))), "{tls:?}");
}

/// Over TCP the client waits for a long payload with a receive low-water mark: never more
/// than what is left of it (a payload whose rest comes later than its start, and is less
/// than the mark, still ends), and none for the next header (a short reply right after a
/// long one is not held back). Each would hang without the rule.
#[test]
fn long_payloads_over_tcp_end_and_do_not_hold_back_the_next_reply() {
    const LONG: usize = 512 << 10;
    let pattern = |i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    let uri = fake_tcp_server(move |mut s, n| {
        for (len, pause_at) in [(LONG, 300 << 10), (4096, 0), (LONG, 400 << 10), (100, 0)] {
            let r = read_request(&mut s, n.mode).expect("request");
            assert_eq!(r.length as usize, len);
            let to = ReplyTo {
                mode: n.mode,
                cookie: r.cookie,
                offset: r.offset,
            };
            let mut out = Vec::new();
            to.encode_data_header(r.offset, len as u64, true, &mut out);
            let payload: Vec<u8> = (0..len).map(|i| pattern(r.offset as usize + i)).collect();
            out.extend_from_slice(&payload[..pause_at]);
            s.write_all(&out).expect("send");
            std::thread::sleep(Duration::from_millis(100));
            s.write_all(&payload[pause_at..]).expect("send");
        }
    });
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let c = Client::connect(&uri).expect("connect");
        for (len, offset) in [(LONG, 4096usize), (4096, 7), (LONG, 0), (100, 3)] {
            let mut buf = vec![0u8; len];
            c.read_at(&mut buf, offset as u64).expect("read");
            assert!(buf
                .iter()
                .enumerate()
                .all(|(i, b)| *b == pattern(offset + i)));
        }
        let _ = done.send(());
    });
    finished
        .recv_timeout(Duration::from_secs(10))
        .expect("the reads ended (or one panicked: see above)");
}
