//! An asynchronous backend (`delayed_export`: completions from one background thread, after a
//! delay), on both engines, with a single worker thread:
//!
//! - 64 requests are in flight at the backend at once - so none holds a thread - and the data
//!   comes back right; holes, block status and the commands without data are laid out by the
//!   dispatcher as for a blocking backend;
//! - a completion the backend drops, or a panic in its `submit`, is answered `EIO`, and the
//!   connection goes on serving, ends, and the server shuts down.

mod delayed_export;
mod one_client;
mod pipelined;
mod spread;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use delayed_export::{Delayed, Faults};
use one_client::{with_client, within};
use spread::{at, block, read_all_back, write_all, BLOCK};
use zcnbd_client::{Client, WriteFlags};
use zcnbd_proto::consts::state;
use zcnbd_server::export::{memory_backend, Export, Stack};
use zcnbd_server::{DataPath, EngineKind, EngineOptions, Limits, Server};

/// Requests in flight at once: the server's default limit per connection.
const REQUESTS: usize = 64;
/// Each operation's time at the backend.
const DELAY: Duration = Duration::from_millis(20);
/// Operations at these offsets go wrong (see [`Faults`]).
const DROP_OFFSET: u64 = 1 << 20;
const PANIC_OFFSET: u64 = 2 << 20;

fn server(engine: EngineKind, backend: Arc<Delayed>) -> Option<Arc<Server>> {
    let export = Export::new("", Stack::of(backend, false));
    let options = EngineOptions {
        engine,
        data_path: DataPath::Auto,
        ring_threads: 1,
        ..EngineOptions::default()
    };
    // One worker: with a thread per request in flight, 64 could never be in flight.
    let limits = Limits {
        worker_threads: 1,
        requests_inflight_max: REQUESTS,
        ..Limits::default()
    };
    match Server::with_engine(vec![export], limits, options) {
        Ok(server) => Some(server),
        Err(e) => {
            // The io_uring engine cannot start on this kernel: skipped with the reason,
            // except under CI (`CI=true`), whose machines have io_uring.
            let ci = std::env::var("CI").as_deref() == Ok("true");
            assert!(!ci, "{engine:?} cannot start under CI=true: {e}");
            eprintln!("SKIP {engine:?}: {e}");
            None
        }
    }
}

/// A delayed memory disk of 4 MiB.
fn delayed_disk(faults: Faults) -> Arc<Delayed> {
    let memory = Arc::new(memory_backend(4 << 20).expect("memory backend"));
    Delayed::new(memory, DELAY, faults)
}

fn many_in_flight(engine: EngineKind) {
    let backend = delayed_disk(Faults::default());
    let counters = backend.counters();
    let Some(server) = server(engine, Arc::clone(&backend)) else {
        return;
    };
    with_client(engine, server, |client| {
        backend.gather(REQUESTS);
        write_all(client, REQUESTS);
        assert_eq!(counters.take_pending_max(), REQUESTS, "{engine:?}: writes");
        read_all_back(client, REQUESTS, &format!("{engine:?}"));
        assert_eq!(counters.take_pending_max(), REQUESTS, "{engine:?}: reads");
        backend.gather(1);
        check_sparse(engine, client);
        check_commands(engine, client);
    });
    let submitters = counters.submitters();
    assert!(
        submitters.iter().all(|name| !name.starts_with("worker")),
        "{engine:?}: a worker submitted: {submitters:?}"
    );
}

/// Holes read as zeroes and block status shows them (the dispatcher's extents and layout).
fn check_sparse(engine: EngineKind, client: &Client) {
    let extents = client.block_status(0, at(2)).unwrap();
    assert!(extents.len() >= 2, "{engine:?}: {extents:?}");
    assert_eq!(extents[0].flags & state::ZERO, 0, "{engine:?}: {extents:?}");
    assert_eq!(extents[0].length, BLOCK as u64, "{engine:?}: {extents:?}");
    assert_ne!(extents[1].flags & state::ZERO, 0, "{engine:?}: {extents:?}");
    let mut buf = vec![0xff; 4 * BLOCK];
    client.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf[..BLOCK], block(0), "{engine:?}");
    assert!(buf[BLOCK..2 * BLOCK].iter().all(|&b| b == 0), "{engine:?}");
    assert_eq!(buf[2 * BLOCK..3 * BLOCK], block(1), "{engine:?}");
    assert!(buf[3 * BLOCK..].iter().all(|&b| b == 0), "{engine:?}");
}

/// Flush, zeroing, trim and cache go through `submit` too.
fn check_commands(engine: EngineKind, client: &Client) {
    client.flush().unwrap();
    let flags = zcnbd_client::ZeroFlags::default();
    client.write_zeroes(at(0), BLOCK as u64, flags).unwrap();
    client
        .trim(at(1), BLOCK as u64, WriteFlags::default())
        .unwrap();
    client.cache(at(2), BLOCK as u64).unwrap();
    let mut buf = vec![0xff; BLOCK];
    client.read_at(&mut buf, at(0)).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "{engine:?}: zeroed");
    client.read_at(&mut buf, at(2)).unwrap();
    assert_eq!(buf, block(2), "{engine:?}");
}

fn lost_completions(engine: EngineKind) {
    let faults = Faults {
        drop_at: Some(DROP_OFFSET),
        panic_at: Some(PANIC_OFFSET),
    };
    let backend = delayed_disk(faults);
    let counters = backend.counters();
    let Some(server) = server(engine, Arc::clone(&backend)) else {
        return;
    };
    with_client(engine, server, |client| {
        let data = block(0);
        client.write_at(&data, 0).unwrap();
        let mut buf = vec![0; BLOCK];
        for _ in 0..3 {
            for offset in [DROP_OFFSET, PANIC_OFFSET] {
                let err = client.read_at(&mut buf, offset).unwrap_err();
                assert_eq!(err.errno(), libc::EIO, "{engine:?} at {offset}: {err}");
                client.read_at(&mut buf, 0).unwrap();
                assert_eq!(buf, data, "{engine:?}: served after the lost reply");
            }
        }
    });
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 3, "{engine:?}");
}

#[test]
fn async_backend_keeps_many_in_flight_portable() {
    within(Duration::from_secs(60), "portable engine", || {
        many_in_flight(EngineKind::Portable)
    });
}

#[test]
fn async_backend_keeps_many_in_flight_uring() {
    within(Duration::from_secs(60), "io_uring engine", || {
        many_in_flight(EngineKind::Uring)
    });
}

#[test]
fn async_backend_lost_completion_is_eio_portable() {
    within(Duration::from_secs(60), "portable engine", || {
        lost_completions(EngineKind::Portable)
    });
}

#[test]
fn async_backend_lost_completion_is_eio_uring() {
    within(Duration::from_secs(60), "io_uring engine", || {
        lost_completions(EngineKind::Uring)
    });
}
