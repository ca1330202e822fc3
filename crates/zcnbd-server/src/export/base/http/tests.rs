//! The HTTP source against in-process web servers on 127.0.0.1 (a thread per connection,
//! std's `TcpListener`): a well-behaved one with `Range`, and hostile ones, one way of
//! misbehaving each. Every case runs under a watchdog, so a hang fails the test instead of
//! blocking it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::Duration;

use super::*;
use crate::export::Backend;

/// How long one case may take before the watchdog fails it.
const CASE_TIME_MAX: Duration = Duration::from_secs(20);
/// The client's timeout in these tests (the stalls last longer).
const TEST_TIMEOUT: Duration = Duration::from_secs(1);

/// A request as the test server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    range: Option<(u64, u64)>,
    authorization: Option<String>,
}

/// How the server answers a request (and whether the connection goes on).
type Handler = dyn Fn(&Seen, &mut TcpStream) -> bool + Send + Sync;

/// A web server until dropped.
struct Server {
    port: u16,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    fn start(handler: impl Fn(&Seen, &mut TcpStream) -> bool + Send + Sync + 'static) -> Server {
        Server::on(TcpListener::bind("127.0.0.1:0").unwrap(), handler)
    }

    fn on(
        listener: TcpListener,
        handler: impl Fn(&Seen, &mut TcpStream) -> bool + Send + Sync + 'static,
    ) -> Server {
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let (stop2, accepted2, seen2) = (stop.clone(), accepted.clone(), seen.clone());
        thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        accepted2.fetch_add(1, Ordering::Relaxed);
                        let (handler, seen, stop) = (handler.clone(), seen2.clone(), stop2.clone());
                        thread::spawn(move || connection(stream, &*handler, &seen, &stop));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Server {
            port,
            stop,
            accepted,
            seen,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn spec(&self, path: &str) -> HttpSpec {
        HttpSpec {
            timeout: TEST_TIMEOUT,
            ..HttpSpec::new(&self.url(path))
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Serves requests on one connection while the handler keeps it and the client sends.
fn connection(
    mut stream: TcpStream,
    handler: &Handler,
    seen: &Mutex<Vec<Seen>>,
    stop: &AtomicBool,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut buf = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let Some(request) = read_request(&mut stream, &mut buf) else {
            return;
        };
        seen.lock().unwrap().push(request.clone());
        if !handler(&request, &mut stream) {
            return;
        }
    }
}

fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Seen> {
    let mut byte = [0u8; 1];
    buf.clear();
    while !buf.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) if buf.len() < 16384 => buf.push(byte[0]),
            _ => return None,
        }
    }
    let text = String::from_utf8_lossy(buf).into_owned();
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, path) = (first.next()?.to_owned(), first.next()?.to_owned());
    let mut seen = Seen {
        method,
        path,
        range: None,
        authorization: None,
    };
    for line in lines {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        if name.eq_ignore_ascii_case("range") {
            let (a, b) = value.strip_prefix("bytes=")?.split_once('-')?;
            seen.range = Some((a.parse().ok()?, b.parse().ok()?));
        } else if name.eq_ignore_ascii_case("authorization") {
            seen.authorization = Some(value.to_owned());
        }
    }
    Some(seen)
}

/// The file the servers serve: 1 MiB of a pattern.
fn file() -> Arc<Vec<u8>> {
    Arc::new(
        (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect(),
    )
}

/// A correct answer: HEAD with the length, GET of a range as 206, keep-alive.
fn answer(data: &[u8], request: &Seen, stream: &mut TcpStream) -> bool {
    let size = data.len() as u64;
    match (request.method.as_str(), request.range) {
        ("HEAD", _) => write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nAccept-Ranges: bytes\r\n\r\n").is_ok(),
        (_, Some((a, b))) if a <= b && b < size => {
            let body = &data[a as usize..=b as usize];
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            stream.write_all(head.as_bytes()).is_ok() && stream.write_all(body).is_ok()
        }
        _ => write!(stream, "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{size}\r\nContent-Length: 0\r\n\r\n").is_ok(),
    }
}

/// A 206 head for bytes `a..=b` of `data`, and those bytes.
fn partial(data: &[u8], a: u64, b: u64) -> (String, &[u8]) {
    let body = &data[a as usize..=b as usize];
    let head = format!(
        "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{}\r\nContent-Length: {}\r\n\r\n",
        data.len(),
        body.len()
    );
    (head, body)
}

/// A server that answers the start's requests (HEAD, the first byte) correctly and every
/// other one with `hostile`.
fn hostile(
    hostile: impl Fn(&[u8], (u64, u64), &mut TcpStream) -> bool + Send + Sync + 'static,
) -> Server {
    let data = file();
    Server::start(move |request, stream| match request.range {
        Some(range) if range != (0, 0) => hostile(&data, range, stream),
        _ => answer(&data, request, stream),
    })
}

/// Runs `case` on a thread; fails if it takes longer than `CASE_TIME_MAX`.
fn within_limit<T: Send + 'static>(case: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(case());
    });
    rx.recv_timeout(CASE_TIME_MAX)
        .expect("the case hung (or panicked: see above)")
}

/// Opens `spec` and reads 64 KiB at 4096: the error, which must be `EIO` from the backend.
fn read_fails(server: Server, spec: HttpSpec) -> HttpError {
    within_limit(move || {
        let backend = HttpBackend::open(&spec).expect("the start is well answered");
        let mut buf = vec![0u8; 64 << 10];
        let errno = backend
            .pread(&mut buf, 4096)
            .expect_err("a hostile answer")
            .raw_os_error();
        assert_eq!(errno, Some(libc::EIO));
        // The same through a pipe (the io_uring engine's path for a plain-HTTP source), one
        // that fills at once, so the body goes on into more pipes.
        let pipe = crate::pipe::Pipe::with_capacity(4096).unwrap();
        let errno = backend
            .read_to_pipe(&pipe, 4096, buf.len())
            .expect_err("a hostile answer, piped")
            .raw_os_error();
        assert_eq!(errno, Some(libc::EIO));
        let e = backend.read(&mut buf, 4096).expect_err("a hostile answer");
        drop(server);
        e
    })
}

/// What a piped read brought: the pipe's bytes, the more pipes' in order, then the tail.
fn drain(pipe: &crate::pipe::Pipe, read: crate::export::PipedRead, len: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let first = len - read.tail.len() - read.more_bytes();
    pipe.read_exact_into(first, &mut got).unwrap();
    for (more, n) in &read.more {
        more.read_exact_into(*n, &mut got).unwrap();
    }
    got.extend_from_slice(&read.tail);
    got
}

#[test]
fn piped_reads_bring_the_file_and_a_pipe_that_fills_early_is_followed_by_more() {
    let data = file();
    let served = data.clone();
    let server = Server::start(move |request, stream| answer(&served, request, stream));
    let spec = server.spec("/disk.img");
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        assert!(backend.pipes_reads());
        for (offset, len) in [(0u64, 1usize), (12_345, 70_000), (4096, (1 << 20) - 8192)] {
            let pipe = crate::pipe::Pipe::new().unwrap();
            let read = backend.read_to_pipe(&pipe, offset, len).unwrap();
            let got = drain(&pipe, read, len);
            assert!(
                got == data[offset as usize..offset as usize + len],
                "{offset}+{len}"
            );
        }
        // A pipe of one buffer fills at once: the rest of the body goes into more pipes.
        let pipe = crate::pipe::Pipe::with_capacity(4096).unwrap();
        assert_eq!(pipe.capacity, 4096);
        let read = backend.read_to_pipe(&pipe, 4096, 64 << 10).unwrap();
        assert!(!read.more.is_empty() && read.more.len() <= crate::export::MORE_PIPES_MAX);
        assert!(read.more_bytes() >= (60 << 10), "{}", read.more_bytes());
        assert!(read.tail.is_empty(), "{}", read.tail.len());
        let got = drain(&pipe, read, 64 << 10);
        assert!(got == data[4096..4096 + (64 << 10)]);
        drop(server);
    });
}

fn open_fails(server: Server, spec: HttpSpec) -> HttpError {
    within_limit(move || {
        let e = HttpBackend::open(&spec).expect_err("refused at start");
        drop(server);
        e
    })
}

#[test]
fn reads_come_back_as_the_file_over_kept_alive_connections() {
    let data = file();
    let served = data.clone();
    let server = Server::start(move |request, stream| answer(&served, request, stream));
    let spec = HttpSpec {
        connections: 2,
        ..server.spec("/disk.img")
    };
    let accepted = server.accepted.clone();
    within_limit(move || {
        let backend = Arc::new(HttpBackend::open(&spec).unwrap());
        assert_eq!(backend.size(), data.len() as u64);
        assert!(!backend.capabilities().write);
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (backend, data) = (backend.clone(), data.clone());
                thread::spawn(move || {
                    for i in 0..32u64 {
                        let offset = (t * 7919 + i * 104_729) % (data.len() as u64 - 70_000);
                        let len = 1 + ((i * 4099 + t) % 65_536) as usize;
                        let mut buf = vec![0u8; len];
                        backend.pread(&mut buf, offset).unwrap();
                        assert!(
                            buf == data[offset as usize..offset as usize + len],
                            "{offset}+{len}"
                        );
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let mut last = [0u8; 1];
        backend.pread(&mut last, data.len() as u64 - 1).unwrap();
        assert_eq!(last[0], data[data.len() - 1]);
        // 4 threads, 2 connections: taken in turn, never more than 2 opened.
        assert!(accepted.load(Ordering::Relaxed) <= 2, "{accepted:?}");
        assert_eq!(backend.client.pool.idle(), 2);
        drop(server);
    });
}

#[test]
fn ipv6_literal_urls_reach_the_server() {
    // A host without IPv6 loopback has nothing to test here.
    let Ok(listener) = TcpListener::bind("[::1]:0") else {
        eprintln!("skipped: no IPv6 loopback");
        return;
    };
    let data = file();
    let served = data.clone();
    let server = Server::on(listener, move |request, stream| {
        answer(&served, request, stream)
    });
    let spec = HttpSpec {
        timeout: TEST_TIMEOUT,
        ..HttpSpec::new(&format!("http://[::1]:{}/disk.img", server.port))
    };
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        let mut buf = vec![0u8; 4096];
        backend.pread(&mut buf, 8192).unwrap();
        assert!(buf == data[8192..8192 + 4096]);
        drop(server);
    });
}

#[test]
fn a_server_that_closes_kept_alive_connections_is_retried_transparently() {
    let data = file();
    let served = data.clone();
    // Answers one request per connection, then closes without saying so.
    let server = Server::start(move |request, stream| {
        answer(&served, request, stream);
        false
    });
    let spec = server.spec("/disk.img");
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        for offset in [0u64, 1 << 19, 12345] {
            let mut buf = vec![0u8; 4096];
            backend.pread(&mut buf, offset).unwrap();
            assert!(buf == data[offset as usize..offset as usize + 4096]);
        }
        drop(server);
    });
}

#[test]
fn headers_go_to_the_server_and_redirects_are_followed() {
    let data = file();
    let served = data.clone();
    let server = Server::start(move |request, stream| match request.path.as_str() {
        "/start" => write!(
            stream,
            "HTTP/1.1 302 Found\r\nLocation: /a/../real?sig=1\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok(),
        "/real?sig=1" => answer(&served, request, stream),
        _ => write!(
            stream,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok(),
    });
    let mut spec = server.spec("/start");
    spec.headers
        .push(HttpHeader::parse("Authorization: Bearer t0ken").unwrap());
    let seen = server.seen.clone();
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        assert_eq!(backend.url.target, "/real?sig=1");
        let mut buf = vec![0u8; 1000];
        backend.pread(&mut buf, 5000).unwrap();
        assert!(buf == data[5000..6000]);
        let seen = seen.lock().unwrap();
        assert!(
            seen.iter()
                .all(|s| s.authorization.as_deref() == Some("Bearer t0ken")),
            "{seen:?}"
        );
        assert!(seen.iter().any(|s| s.method == "HEAD"));
        drop(server);
    });
}

#[test]
fn a_refused_head_leaves_the_size_to_a_ranged_get() {
    let data = file();
    let served = data.clone();
    let server = Server::start(move |request, stream| match request.method.as_str() {
        "HEAD" => write!(
            stream,
            "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok(),
        _ => answer(&served, request, stream),
    });
    let spec = server.spec("/disk.img");
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        assert_eq!(backend.size(), data.len() as u64);
        drop(server);
    });
}

#[test]
fn servers_without_ranges_are_refused_at_start() {
    let data = file();
    let whole = Server::start(move |request, stream| {
        let size = data.len();
        let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n");
        request.method == "HEAD" || stream.write_all(&data).is_ok()
    });
    let spec = whole.spec("/d");
    let e = open_fails(whole, spec);
    assert!(matches!(e, HttpError::RangeIgnored(200)), "{e}");
    assert!(e.to_string().contains("ignores Range"), "{e}");
    let no_range = Server::start(|_, stream| {
        write!(
            stream,
            "HTTP/1.1 206 Partial Content\r\nContent-Length: 1\r\n\r\nx"
        )
        .is_ok()
    });
    let spec = no_range.spec("/d");
    let e = open_fails(no_range, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::NoContentRange)),
        "{e}"
    );
}

#[test]
fn bad_starts_are_refused_with_the_reason() {
    let looping = Server::start(|_, stream| {
        write!(
            stream,
            "HTTP/1.1 301 Moved\r\nLocation: /again\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok()
    });
    let spec = looping.spec("/d");
    assert!(matches!(open_fails(looping, spec), HttpError::Redirects));
    let missing = Server::start(|_, stream| {
        write!(
            stream,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok()
    });
    let spec = missing.spec("/d");
    let e = open_fails(missing, spec);
    assert!(matches!(e, HttpError::Status { status: 404, .. }), "{e}");
    let huge = Server::start(|_, stream| {
        write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551616\r\n\r\n"
        )
        .is_ok()
    });
    let spec = huge.spec("/d");
    let e = open_fails(huge, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::ContentLength)),
        "{e}"
    );
    let too_big = Server::start(|request, stream| {
        match request.method.as_str() {
        "HEAD" => write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551615\r\n\r\n").is_ok(),
        _ => write!(stream, "HTTP/1.1 206 x\r\nContent-Range: bytes 0-0/18446744073709551615\r\nContent-Length: 1\r\n\r\nx").is_ok(),
    }
    });
    let spec = too_big.spec("/d");
    assert!(matches!(open_fails(too_big, spec), HttpError::TooLarge(_)));
    let empty = Server::start(|_, stream| {
        write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").is_ok()
    });
    let spec = empty.spec("/d");
    assert!(matches!(open_fails(empty, spec), HttpError::Empty));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let nobody = HttpSpec {
        timeout: TEST_TIMEOUT,
        ..HttpSpec::new(&format!("http://127.0.0.1:{port}/d"))
    };
    assert!(matches!(
        HttpBackend::open(&nobody),
        Err(HttpError::Connect { .. })
    ));
}

#[test]
fn another_range_or_size_is_eio() {
    let other = hostile(|data, (a, b), s| {
        let (a, b) = (a + 1, b + 1);
        let size = data.len();
        write!(
            s,
            "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {}\r\n\r\n",
            b - a + 1
        )
        .is_ok()
            && s.write_all(&data[a as usize..=b as usize]).is_ok()
    });
    let spec = other.spec("/d");
    let e = read_fails(other, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::OtherRange { .. })),
        "{e}"
    );
    let resized = hostile(|data, (a, b), s| {
        let size = data.len() + 512;
        write!(
            s,
            "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {}\r\n\r\n",
            b - a + 1
        )
        .is_ok()
            && s.write_all(&data[a as usize..=b as usize]).is_ok()
    });
    let spec = resized.spec("/d");
    let e = read_fails(resized, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::SizeChanged { .. })),
        "{e}"
    );
}

#[test]
fn short_long_and_chunked_bodies_are_eio() {
    let short = hostile(|data, (a, b), s| {
        let size = data.len();
        let _ = write!(
            s,
            "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {}\r\n\r\n",
            b - a + 1
        );
        let _ = s.write_all(&data[a as usize..(a + (b - a) / 2) as usize]);
        false
    });
    let spec = short.spec("/d");
    let e = read_fails(short, spec);
    assert!(matches!(e, HttpError::ShortBody { .. }), "{e}");
    let long = hostile(|data, (a, b), s| {
        let size = data.len();
        let _ = write!(
            s,
            "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {}\r\n\r\n",
            b - a + 101
        );
        let _ = s.write_all(&data[a as usize..(b + 101) as usize]);
        false
    });
    let spec = long.spec("/d");
    let e = read_fails(long, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::BodyLength { .. })),
        "{e}"
    );
    let chunked = hostile(|data, (a, b), s| {
        let size = data.len();
        let _ = write!(s, "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n", b - a + 1);
        let _ = s.write_all(&data[a as usize..=b as usize]);
        let _ = s.write_all(b"\r\n0\r\n\r\n");
        false
    });
    let spec = chunked.spec("/d");
    let e = read_fails(chunked, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::TransferCoded)),
        "{e}"
    );
}

#[test]
fn garbage_huge_heads_and_huge_lengths_are_eio() {
    let garbage = hostile(|_, _, s| {
        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n\r\n");
        false
    });
    let spec = garbage.spec("/d");
    let e = read_fails(garbage, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::Malformed(_))),
        "{e}"
    );
    let huge_head = hostile(|_, _, s| {
        let _ = write!(
            s,
            "HTTP/1.1 206 x\r\nX-Filler: {}\r\n\r\n",
            "a".repeat(100 << 10)
        );
        false
    });
    let spec = huge_head.spec("/d");
    let e = read_fails(huge_head, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::HeadTooLarge)),
        "{e}"
    );
    let huge_length = hostile(|data, (a, b), s| {
        let size = data.len();
        let _ = write!(s, "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: 18446744073709551616\r\n\r\n");
        false
    });
    let spec = huge_length.spec("/d");
    let e = read_fails(huge_length, spec);
    assert!(
        matches!(e, HttpError::Response(ResponseError::ContentLength)),
        "{e}"
    );
    let whole = hostile(|data, _, s| {
        let _ = write!(
            s,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
            data.len()
        );
        let _ = s.write_all(data);
        false
    });
    let spec = whole.spec("/d");
    assert!(matches!(
        read_fails(whole, spec),
        HttpError::RangeIgnored(200)
    ));
}

#[test]
fn redirects_of_reads_are_followed_and_bounded() {
    let data = file();
    let served = data.clone();
    // Every read is sent elsewhere first (the start is answered where it asks).
    let moved =
        Server::start(
            move |request, stream| match (request.path.as_str(), request.range) {
                ("/d", Some(range)) if range != (0, 0) => write!(
            stream,
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
        )
                .is_ok(),
                _ => answer(&served, request, stream),
            },
        );
    let spec = moved.spec("/d");
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        let mut buf = vec![0u8; 3000];
        backend.pread(&mut buf, 70_000).unwrap();
        assert!(buf == data[70_000..73_000]);
        drop(moved);
    });
    let looping = hostile(|_, _, s| {
        write!(
            s,
            "HTTP/1.1 302 Found\r\nLocation: /d\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok()
    });
    let spec = looping.spec("/d");
    assert!(matches!(read_fails(looping, spec), HttpError::Redirects));
}

#[test]
fn stalls_time_out() {
    let silent = hostile(|_, _, _| {
        thread::sleep(TEST_TIMEOUT * 4);
        false
    });
    let spec = silent.spec("/d");
    assert!(matches!(read_fails(silent, spec), HttpError::TimedOut(_)));
    // A head one byte at a time, each just inside the timeout: the head's deadline ends it.
    let trickle = hostile(|_, _, s| {
        for byte in b"HTTP/1.1 206 Partial Content\r\nX: y\r\n".iter() {
            thread::sleep(TEST_TIMEOUT / 3);
            if s.write_all(&[*byte]).is_err() {
                return false;
            }
        }
        false
    });
    let spec = trickle.spec("/d");
    assert!(matches!(read_fails(trickle, spec), HttpError::TimedOut(_)));
    let body_stall = hostile(|data, (a, b), s| {
        let size = data.len();
        let _ = write!(
            s,
            "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {}\r\n\r\nab",
            b - a + 1
        );
        thread::sleep(TEST_TIMEOUT * 4);
        false
    });
    let spec = body_stall.spec("/d");
    assert!(matches!(
        read_fails(body_stall, spec),
        HttpError::TimedOut(_)
    ));
    // The head, then nothing for longer than two waits, then half the body and a hang-up:
    // the wait that timed out is a timeout, not a wait of one more timeout for what comes.
    let late = hostile(|data, (a, b), s| {
        let size = data.len();
        let len = (b - a + 1) as usize;
        let _ = write!(
            s,
            "HTTP/1.1 206 x\r\nContent-Range: bytes {a}-{b}/{size}\r\nContent-Length: {len}\r\n\r\n"
        );
        thread::sleep(TEST_TIMEOUT * 5 / 2);
        let _ = s.write_all(&data[a as usize..a as usize + len / 2]);
        false
    });
    let spec = late.spec("/d");
    within_limit(move || {
        let backend = HttpBackend::open(&spec).expect("the start is well answered");
        let pipe = crate::pipe::Pipe::new().unwrap();
        let body = client::Body::Pipe(&pipe, 64 << 10);
        let piped = backend
            .client
            .read_range(&backend.url, Some(backend.size), 4096, body)
            .map(drop);
        assert!(matches!(piped, Err(HttpError::TimedOut(_))), "{piped:?}");
        let mut buf = vec![0u8; 64 << 10];
        let read = backend.read(&mut buf, 4096);
        assert!(matches!(read, Err(HttpError::TimedOut(_))), "{read:?}");
        drop(late);
    });
}

#[test]
fn headers_are_not_sent_to_another_host_and_https_is_not_downgraded() {
    let data = file();
    let served = data.clone();
    let other = Server::start(move |request, stream| answer(&served, request, stream));
    let target = other.url("/disk.img");
    // "localhost" and 127.0.0.1 are two origins.
    let first = Server::start(move |_, stream| {
        write!(
            stream,
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: {target}\r\nContent-Length: 0\r\n\r\n"
        )
        .is_ok()
    });
    let mut spec = HttpSpec {
        timeout: TEST_TIMEOUT,
        ..HttpSpec::new(&format!("http://localhost:{}/d", first.port))
    };
    spec.headers
        .push(HttpHeader::parse("Authorization: Bearer t0ken").unwrap());
    let seen = other.seen.clone();
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        let mut buf = vec![0u8; 100];
        backend.pread(&mut buf, 0).unwrap();
        assert!(buf == data[..100]);
        assert!(seen
            .lock()
            .unwrap()
            .iter()
            .all(|s| s.authorization.is_none()));
        drop((first, other));
    });
    let from = url::Url::parse("https://a/x").unwrap();
    let head = response::parse_head(b"HTTP/1.1 302 Found\r\nLocation: http://a/y\r\n\r\n")
        .unwrap()
        .unwrap();
    assert!(matches!(
        client_follow(&from, &head),
        Err(HttpError::Downgrade)
    ));
}

fn client_follow(from: &url::Url, head: &response::Head) -> Result<url::Url, HttpError> {
    client::follow(from, head)
}

use response::ResponseError;

#[test]
fn a_long_body_that_comes_slowly_is_not_a_stall_and_the_next_head_is_not_held_back() {
    // 192 KiB in 4 KiB pieces a quarter of the timeout apart: every wait sees bytes within
    // the timeout, but fewer than the body's low-water mark (all of it) or the receive
    // window in any one.
    const PIECE: usize = 4 << 10;
    const TIMEOUT: Duration = Duration::from_millis(200);
    let data = file();
    let served = data.clone();
    let server = Server::start(move |request, stream| match request.range {
        Some((a, b)) if b - a + 1 == 192 << 10 => {
            let (head, body) = partial(&served, a, b);
            if stream.write_all(head.as_bytes()).is_err() {
                return false;
            }
            body.chunks(PIECE).all(|piece| {
                thread::sleep(TIMEOUT / 4);
                stream.write_all(piece).is_ok()
            })
        }
        _ => answer(&served, request, stream),
    });
    let mut spec = server.spec("/disk.img");
    spec.connections = 1;
    spec.timeout = TIMEOUT;
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        let len = 192 << 10;
        let mut buf = vec![0u8; len];
        backend.pread(&mut buf, 8192).unwrap();
        assert!(buf == data[8192..8192 + len]);
        // A small read on the same kept-alive connection: its head is not held back by
        // the last body's mark (a wait for the mark would end only with the timeout).
        let started = std::time::Instant::now();
        let mut small = vec![0u8; 100];
        backend.pread(&mut small, 7).unwrap();
        assert!(small == data[7..107]);
        assert!(started.elapsed() < TIMEOUT, "{:?}", started.elapsed());
        let pipe = crate::pipe::Pipe::new().unwrap();
        let read = backend.read_to_pipe(&pipe, 4096, len).unwrap();
        assert!(drain(&pipe, read, len) == data[4096..4096 + len]);
        let started = std::time::Instant::now();
        let read = backend.read_to_pipe(&pipe, 3, 100).unwrap();
        assert!(drain(&pipe, read, 100) == data[3..103]);
        assert!(started.elapsed() < TIMEOUT, "{:?}", started.elapsed());
        assert_eq!(
            server.accepted.load(Ordering::Relaxed),
            1,
            "one connection kept alive"
        );
        drop(server);
    });
}

#[test]
fn the_rest_of_a_body_below_its_mark_is_not_waited_out() {
    // 192 KiB: 150 KiB at once, the rest a moment later. A blocking read that took the first
    // part would wait for the mark's worth of new bytes (more than will come) until the
    // timeout.
    const FIRST: usize = 150 << 10;
    let data = file();
    let served = data.clone();
    let server = Server::start(move |request, stream| match request.range {
        Some((a, b)) if b - a + 1 == 192 << 10 => {
            let (head, body) = partial(&served, a, b);
            let first = stream.write_all(head.as_bytes()).is_ok()
                && stream.write_all(&body[..FIRST]).is_ok();
            thread::sleep(Duration::from_millis(100));
            first && stream.write_all(&body[FIRST..]).is_ok()
        }
        _ => answer(&served, request, stream),
    });
    let mut spec = server.spec("/disk.img");
    spec.connections = 1;
    within_limit(move || {
        let backend = HttpBackend::open(&spec).unwrap();
        for _ in 0..3 {
            let started = std::time::Instant::now();
            let mut buf = vec![0u8; 192 << 10];
            backend.pread(&mut buf, 4096).unwrap();
            assert!(buf == data[4096..4096 + (192 << 10)]);
            assert!(
                started.elapsed() < TEST_TIMEOUT / 2,
                "{:?}",
                started.elapsed()
            );
            let pipe = crate::pipe::Pipe::new().unwrap();
            let started = std::time::Instant::now();
            let read = backend.read_to_pipe(&pipe, 4096, 192 << 10).unwrap();
            assert!(drain(&pipe, read, 192 << 10) == data[4096..4096 + (192 << 10)]);
            assert!(
                started.elapsed() < TEST_TIMEOUT / 2,
                "{:?}",
                started.elapsed()
            );
        }
        drop(server);
    });
}
