//! The NBD upstream backend is asynchronous: a proxy with one worker thread in front of an
//! upstream whose operations take a while keeps 64 requests in flight at the upstream at
//! once (a blocking proxy would have one per worker), on both engines; and when the
//! connection to the upstream is cut with 64 reads in flight, the proxy reconnects and sends
//! them again, so every read succeeds with the right data. An event loop that polls the
//! upstream's completion descriptor runs every completion on its own thread.

// Which threads submitted is `async_backend.rs`'s question, not this file's.
#[allow(dead_code)]
mod delayed_export;
mod one_client;
mod pipelined;
mod spread;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use delayed_export::{Delayed, Faults};
use one_client::{with_client, within};
use spread::{at, block, read_all_back, write_all, BLOCK};
use zcnbd_client::Client;
use zcnbd_server::buffer_pool::BufferPool;
use zcnbd_server::export::{memory_backend, AsyncOp, Completion, Export, NbdBackend, Stack};
use zcnbd_server::stream::Stream;
use zcnbd_server::{DataPath, EngineKind, EngineOptions, Limits, Server};

/// Requests in flight at once: the server's default limit per connection.
const REQUESTS: usize = 64;
/// How long a lost upstream is retried.
const RECONNECT: Duration = Duration::from_secs(20);

fn server(engine: EngineKind, stack: Stack, worker_threads: usize) -> Option<Arc<Server>> {
    let options = EngineOptions {
        engine,
        data_path: DataPath::Auto,
        ring_threads: 1,
        ..EngineOptions::default()
    };
    let limits = Limits {
        worker_threads,
        requests_inflight_max: REQUESTS,
        ..Limits::default()
    };
    match Server::with_engine(vec![Export::new("", stack)], limits, options) {
        Ok(server) => Some(server),
        Err(e) => {
            let ci = std::env::var("CI").as_deref() == Ok("true");
            assert!(!ci, "{engine:?} cannot start under CI=true: {e}");
            eprintln!("SKIP {engine:?}: {e}");
            None
        }
    }
}

/// The upstream: a delayed memory disk served on `path`, every connection it accepts.
fn upstream(path: &Path, delay: Duration) -> Arc<Delayed> {
    let memory = Arc::new(memory_backend(4 << 20).expect("memory backend"));
    let backend = Delayed::new(memory, delay, Faults::default());
    let stack = Stack::of(Arc::clone(&backend) as _, false);
    let server = server(EngineKind::Portable, stack, 4).expect("the portable engine starts");
    let listener = UnixListener::bind(path).expect("bind the upstream");
    std::thread::spawn(move || {
        for socket in listener.incoming().map_while(Result::ok) {
            let serving = Arc::clone(&server);
            std::thread::spawn(move || serving.serve_stream(Stream::Unix(socket), "upstream"));
        }
    });
    backend
}

/// Byte relays between the proxy and the upstream, each connection its own; `cut` hangs up
/// every one open (the proxy's next connection gets a new relay).
#[derive(Clone, Default)]
struct Relay {
    open: Arc<Mutex<Vec<UnixStream>>>,
}

impl Relay {
    fn start(listen: &Path, upstream: PathBuf) -> Relay {
        let relay = Relay::default();
        let listener = UnixListener::bind(listen).expect("bind the relay");
        let open = Arc::clone(&relay.open);
        std::thread::spawn(move || {
            for down in listener.incoming().map_while(Result::ok) {
                let up = UnixStream::connect(&upstream).expect("reach the upstream");
                let pipe = |mut from: UnixStream, mut to: UnixStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                };
                let mut open = open.lock().unwrap();
                open.extend([down.try_clone().unwrap(), up.try_clone().unwrap()]);
                pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
                pipe(up, down);
            }
        });
        relay
    }

    fn cut(&self) {
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A proxy of `uri` with one worker thread.
fn proxy(engine: EngineKind, uri: &str) -> Option<Arc<Server>> {
    let backend = NbdBackend::connect(uri, 1, RECONNECT).expect("connect to the upstream");
    server(engine, Stack::of(Arc::new(backend), false), 1)
}

fn many_in_flight(engine: EngineKind) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("upstream.sock");
    let backend = upstream(&path, Duration::from_millis(20));
    let counters = backend.counters();
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let Some(server) = proxy(engine, &uri) else {
        return;
    };
    with_client(engine, server, |client| {
        backend.gather(REQUESTS);
        write_all(client, REQUESTS);
        assert_eq!(counters.take_pending_max(), REQUESTS, "{engine:?}: writes");
        read_all_back(client, REQUESTS, &format!("{engine:?}"));
        assert_eq!(counters.take_pending_max(), REQUESTS, "{engine:?}: reads");
        backend.gather(1);
        client.flush().unwrap();
        let extents = client.block_status(0, at(1)).unwrap();
        assert_eq!(extents[0].length, BLOCK as u64, "{engine:?}: {extents:?}");
    });
}

#[test]
fn upstream_keeps_many_in_flight_with_one_worker_portable() {
    within(Duration::from_secs(60), "portable engine", || {
        many_in_flight(EngineKind::Portable)
    });
}

#[test]
fn upstream_keeps_many_in_flight_with_one_worker_uring() {
    within(Duration::from_secs(60), "io_uring engine", || {
        many_in_flight(EngineKind::Uring)
    });
}

/// Waits until the upstream has had `n` operations pending at once.
fn until_pending(backend: &Delayed, n: usize) {
    let counters = backend.counters();
    let start = Instant::now();
    while counters.take_pending_max() < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never {n} pending"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// An upstream whose operations take `delay`, reached through a relay that can cut every
/// connection: the directory holding their sockets, the upstream, the relay, the URI.
fn relayed_upstream(delay: Duration) -> (tempfile::TempDir, Arc<Delayed>, Relay, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("upstream.sock");
    let backend = upstream(&path, delay);
    let relayed = dir.path().join("relay.sock");
    let relay = Relay::start(&relayed, path);
    let uri = format!("nbd+unix:///?socket={}", relayed.display());
    (dir, backend, relay, uri)
}

/// A thread that cuts the relay's connections once the upstream has had every request
/// pending at once (counted from now).
fn cut_when_all_pending(relay: &Relay, backend: &Arc<Delayed>) -> std::thread::JoinHandle<()> {
    backend.counters().take_pending_max();
    let (relay, backend) = (relay.clone(), Arc::clone(backend));
    std::thread::spawn(move || {
        until_pending(&backend, REQUESTS);
        relay.cut();
    })
}

#[test]
fn reads_in_flight_when_the_upstream_connection_is_cut_are_sent_again() {
    within(Duration::from_secs(60), "reconnection", || {
        // Long enough for the cut to come while every read waits at the upstream.
        let (_dir, backend, relay, uri) = relayed_upstream(Duration::from_millis(500));
        let engine = EngineKind::Portable;
        let server = proxy(engine, &uri).expect("the portable engine starts");
        with_client(engine, server, |client: &Client| {
            write_all(client, REQUESTS);
            let cutter = cut_when_all_pending(&relay, &backend);
            read_all_back(client, REQUESTS, "after the cut");
            cutter.join().unwrap();
        });
    });
}

/// What a polled completion handed back: the request's index, the thread it ran on, its
/// result and (a read's) bytes.
type Done = (usize, ThreadId, std::io::Result<()>, Option<Vec<u8>>);

/// Runs the upstream's completions on this thread as an event loop would - waiting on the
/// descriptor `Stack::poll_completions` gave - until `n` requests are done.
fn run_polled(stack: &Stack, events: &OwnedFd, done: &mpsc::Receiver<Done>, n: usize) -> Vec<Done> {
    let mut out = Vec::with_capacity(n);
    let deadline = Instant::now() + Duration::from_secs(40);
    while out.len() < n {
        assert!(Instant::now() < deadline, "{} of {n} done", out.len());
        let mut fd = libc::pollfd {
            fd: events.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call.
        unsafe { libc::poll(&mut fd, 1, 100) };
        stack.run_completions();
        out.extend(done.try_iter());
    }
    out.sort_by_key(|d| d.0);
    out
}

/// An event loop that polls the NBD upstream's completion descriptor runs every
/// completion on its own thread (the upstream's driver thread runs none): 64 writes and 64
/// reads in flight at once, the reads across a cut connection, sent again on the new one
/// (whose descriptor the same poll then watches) and answered with the right data.
#[test]
fn an_event_loop_runs_the_upstream_completions_on_its_own_thread() {
    within(Duration::from_secs(90), "polled completions", || {
        let (_dir, backend, relay, uri) = relayed_upstream(Duration::from_millis(200));
        let proxy = NbdBackend::connect(&uri, 2, RECONNECT).expect("connect to the upstream");
        let stack = Stack::of(Arc::new(proxy), false);
        let events = stack
            .poll_completions()
            .expect("an NBD upstream's completions can be polled");
        let pool = BufferPool::new(16 << 20);
        let here = std::thread::current().id();
        let (tx, rx) = mpsc::channel::<Done>();
        let finish = |i: usize| {
            let tx = tx.clone();
            Completion::new(move |op, result| {
                let data = match op {
                    Some(AsyncOp::Read { buf, .. }) => Some(buf.to_vec()),
                    _ => None,
                };
                let _ = tx.send((i, std::thread::current().id(), result, data));
            })
        };
        for i in 0..REQUESTS {
            let mut buf = pool.get(BLOCK);
            buf.copy_from_slice(&block(i));
            let op = AsyncOp::Write {
                buf,
                offset: at(i),
                fua: false,
            };
            stack.submit(op, finish(i));
        }
        for (i, thread, result, _) in run_polled(&stack, &events, &rx, REQUESTS) {
            result.unwrap_or_else(|e| panic!("write {i}: {e}"));
            assert_eq!(thread, here, "write {i}'s completion ran on another thread");
        }
        let cutter = cut_when_all_pending(&relay, &backend);
        for i in 0..REQUESTS {
            let op = AsyncOp::Read {
                buf: pool.get(BLOCK),
                offset: at(i),
            };
            stack.submit(op, finish(i));
        }
        for (i, thread, result, data) in run_polled(&stack, &events, &rx, REQUESTS) {
            result.unwrap_or_else(|e| panic!("read {i} after the cut: {e}"));
            assert_eq!(
                data.as_deref(),
                Some(&block(i)[..]),
                "read {i} after the cut"
            );
            assert_eq!(thread, here, "read {i}'s completion ran on another thread");
        }
        cutter.join().unwrap();
    });
}
