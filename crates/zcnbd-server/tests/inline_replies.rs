//! The portable engine's reader sends the replies itself when every request runs on it (a
//! memory export): replies wait until a read would wait, then go out together. Here the
//! per-connection in-flight limits are far below what the client pipelines, so the reader
//! reaches them with replies still queued on its own thread: it must send them to make room,
//! never wait for a writer that is not there. Every reply must come back, with the right
//! data, and the connection and server must end cleanly.

mod one_client;
mod pipelined;

use std::sync::Arc;
use std::time::Duration;

use one_client::{with_client, within};
use pipelined::all_at_once;
use zcnbd_client::WriteFlags;
use zcnbd_server::export::{memory_backend, Export, Stack};
use zcnbd_server::{DataPath, EngineKind, EngineOptions, Limits, Server};

const BLOCK: usize = 4096;
/// Requests the client submits before it collects any reply.
const PIPELINED: usize = 96;
/// Reads larger than the in-flight byte budget (each is admitted alone).
const LARGE: usize = 256 << 10;

fn server(limits: Limits) -> Arc<Server> {
    let export = Export::new(
        "",
        Stack::of(
            Arc::new(memory_backend(8 << 20).expect("memory backend")),
            false,
        ),
    );
    let options = EngineOptions {
        engine: EngineKind::Portable,
        data_path: DataPath::Auto,
        ring_threads: 1,
        ..EngineOptions::default()
    };
    Server::with_engine(vec![export], limits, options).expect("server")
}

fn block(i: usize) -> Vec<u8> {
    (0..BLOCK).map(|k| (i * 13 + k % 241) as u8).collect()
}

fn pipelined_past(limits: Limits) {
    within(Duration::from_secs(60), "pipelined requests", move || {
        with_client(EngineKind::Portable, server(limits), |client| {
            all_at_once(client, PIPELINED, |i| {
                let at = (i * BLOCK) as u64;
                let flags = WriteFlags::default();
                client.submit_write(block(i), at, flags, i as u64).unwrap();
            });
            let read = all_at_once(client, PIPELINED, |i| {
                let at = (i * BLOCK) as u64;
                client.submit_read(vec![0; BLOCK], at, i as u64).unwrap();
            });
            for (i, data) in read.iter().enumerate() {
                assert_eq!(*data, block(i), "block {i}");
            }
            let large = all_at_once(client, PIPELINED, |i| {
                let at = ((i % 4) * LARGE) as u64;
                client.submit_read(vec![0; LARGE], at, i as u64).unwrap();
            });
            let first: Vec<u8> = (0..LARGE / BLOCK).flat_map(block).collect();
            assert_eq!(large[0], first, "the first large read");
        });
    });
}

#[test]
fn replies_sent_by_the_reader_make_room_at_the_request_limit() {
    pipelined_past(Limits {
        requests_inflight_max: 2,
        ..Limits::default()
    });
}

#[test]
fn replies_sent_by_the_reader_make_room_at_the_byte_limit() {
    pipelined_past(Limits {
        inflight_bytes_max: 3 * BLOCK,
        ..Limits::default()
    });
}
