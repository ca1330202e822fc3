//! The callback submit API against an in-process memory server: every kind of operation,
//! many more operations than request slots (the backlog), a full backlog, and a server that
//! leaves with operations in flight and waiting.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use zcnbd_client::{Client, ClientOptions, Error, Extent, WriteFlags, ZeroFlags};
use zcnbd_proto::consts::{transmission_flags as tf, BASE_ALLOCATION};
use zcnbd_proto::{BlockSize, Command, ExportInfo, Negotiated, ReplyTo, RequestHeader};

const SIZE: u64 = 1 << 20;
const DEPTH: &str = "qemu:allocation-depth";
/// The extent flags the server answers for its `DEPTH` context.
const DEPTH_FLAGS: u32 = 1;

/// What the memory server does after `requests` requests.
#[derive(Clone, Copy)]
enum Script {
    /// Serves until the client leaves.
    Serve,
    /// Hangs up after answering this many requests.
    LeaveAfter(usize),
}

/// A one-connection memory server: the real handshake, then requests answered from an
/// in-memory disk, one at a time.
fn memory_server(script: Script) -> (String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path: PathBuf = dir.path().join("memory.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let negotiated = handshake(&mut stream);
        serve(stream, &negotiated, script);
    });
    (format!("nbd+unix:///?socket={}", path.display()), dir)
}

fn handshake(stream: &mut UnixStream) -> Negotiated {
    let flags = tf::HAS_FLAGS
        | tf::SEND_FLUSH
        | tf::SEND_FUA
        | tf::SEND_TRIM
        | tf::SEND_WRITE_ZEROES
        | tf::SEND_CACHE;
    let exports = [ExportInfo {
        name: String::new(),
        description: String::new(),
        size: SIZE,
        flags,
        block_size: BlockSize::default(),
        tls_only: false,
        meta_contexts: vec![DEPTH.to_owned()],
    }];
    common::fake::handshake(stream, &exports)
}

fn serve(mut s: UnixStream, n: &Negotiated, script: Script) {
    let mut disk = vec![0u8; SIZE as usize];
    let mut answered = 0;
    loop {
        if matches!(script, Script::LeaveAfter(k) if answered == k) {
            return;
        }
        let mut buf = vec![0u8; n.mode.request_header_bytes()];
        if s.read_exact(&mut buf).is_err() {
            return;
        }
        let Ok(Some(h)) = RequestHeader::decode(&buf, n.mode) else {
            return;
        };
        let to = ReplyTo {
            mode: n.mode,
            cookie: h.cookie,
            offset: h.offset,
        };
        let range = h.offset as usize..(h.offset + h.length) as usize;
        let mut out = Vec::new();
        match Command::from_wire(h.kind) {
            Some(Command::Read) => {
                to.encode_data_header(h.offset, h.length, true, &mut out);
                out.extend_from_slice(&disk[range]);
            }
            Some(Command::Write) => {
                s.read_exact(&mut disk[range]).expect("payload");
                to.encode_ok(&mut out);
            }
            Some(Command::WriteZeroes | Command::Trim) => {
                disk[range].fill(0);
                to.encode_ok(&mut out);
            }
            Some(Command::BlockStatus) => {
                let ids: Vec<(u32, usize)> = n.meta.ids().collect();
                for (i, &(id, number)) in ids.iter().enumerate() {
                    let flags = if number == 0 { 0 } else { DEPTH_FLAGS };
                    let extent = Extent {
                        length: h.length,
                        flags,
                    };
                    to.encode_block_status_chunk(id, &[extent], i + 1 == ids.len(), &mut out);
                }
            }
            Some(Command::Disc) | None => return,
            Some(_) => to.encode_ok(&mut out),
        }
        if s.write_all(&out).is_err() {
            return;
        }
        answered += 1;
    }
}

fn options(slots: u32, queued: usize) -> ClientOptions {
    ClientOptions {
        requests_in_flight_max: slots,
        operations_queued_max: queued,
        meta_contexts: vec![DEPTH.to_owned()],
        ..ClientOptions::default()
    }
}

/// Drives `client` until `rx` has `n` results, or panics after a few seconds.
fn collect<T>(client: &Client, rx: &mpsc::Receiver<T>, n: usize) -> Vec<T> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n {
        client.drive(Duration::from_millis(50));
        got.extend(rx.try_iter());
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "hang: {} of {n}",
            got.len()
        );
    }
    got
}

#[test]
fn every_operation_completes_through_its_callback() {
    let (uri, _dir) = memory_server(Script::Serve);
    let client = Client::connect_with(&uri, &options(64, 64)).expect("connect");
    let (tx, rx) = mpsc::channel::<(&str, Result<Option<Vec<u8>>, Error>)>();
    let t = tx.clone();
    let fua = WriteFlags { fua: true };
    client.start_write(vec![7u8; 8192], 4096, fua, move |b, r| {
        let _ = t.send(("write", r.map(|()| Some(b))));
    });
    let done = collect(&client, &rx, 1);
    assert!(done[0].1.is_ok(), "{:?}", done[0].1);
    let t = tx.clone();
    client.start_read(vec![0u8; 16384], 0, move |b, r| {
        let _ = t.send(("read", r.map(|()| Some(b))));
    });
    let read = collect(&client, &rx, 1)
        .remove(0)
        .1
        .expect("read")
        .expect("data");
    assert_eq!(&read[..4096], &[0u8; 4096][..]);
    assert_eq!(&read[4096..12288], &[7u8; 8192][..]);
    let sender = |what: &'static str| {
        let t = tx.clone();
        move |r: Result<(), Error>| drop(t.send((what, r.map(|()| None))))
    };
    client.start_flush(sender("flush"));
    client.start_trim(0, 4096, fua, sender("trim"));
    let no_hole = ZeroFlags {
        no_hole: true,
        ..ZeroFlags::default()
    };
    client.start_write_zeroes(8192, 4096, no_hole, sender("zero"));
    client.start_cache(0, SIZE, sender("cache"));
    for (what, result) in collect(&client, &rx, 4) {
        assert!(result.is_ok(), "{what}: {result:?}");
    }
    // The zeroes landed: 4096..8192 still 7, 8192..12288 now 0.
    let (t2, rx2) = mpsc::channel();
    client.start_read(vec![1u8; 8192], 4096, move |b, r| {
        drop(t2.send(r.map(|()| b)))
    });
    let read = collect(&client, &rx2, 1).remove(0).expect("read");
    assert_eq!(&read[..4096], &[7u8; 4096][..]);
    assert_eq!(&read[4096..], &[0u8; 4096][..]);
}

#[test]
fn block_status_answers_each_context_by_name() {
    let (uri, _dir) = memory_server(Script::Serve);
    let client = Client::connect_with(&uri, &options(64, 64)).expect("connect");
    assert!(client.has_meta_context(DEPTH));
    let (tx, rx) = mpsc::channel();
    let t = tx.clone();
    client.start_block_status(0, 65536, move |r| drop(t.send((0, r))));
    let t = tx.clone();
    client.start_block_status_of(DEPTH, 4096, 8192, move |r| drop(t.send((1, r))));
    let t = tx.clone();
    client.start_block_status_of("qemu:dirty-bitmap:none", 0, 4096, move |r| {
        drop(t.send((2, r)))
    });
    let t = tx.clone();
    client.start_block_status_of(BASE_ALLOCATION, 0, 0, move |r| drop(t.send((3, r))));
    let mut done = collect(&client, &rx, 4);
    done.sort_by_key(|(k, _)| *k);
    let e = |length, flags| Extent { length, flags };
    assert_eq!(done[0].1.as_ref().expect("base"), &[e(65536, 0)]);
    assert_eq!(done[1].1.as_ref().expect("depth"), &[e(8192, DEPTH_FLAGS)]);
    assert!(
        matches!(done[2].1, Err(Error::Unsupported(_))),
        "{:?}",
        done[2].1
    );
    assert_eq!(done[3].1.as_ref().expect("empty"), &[]);
}

#[test]
fn operations_beyond_the_request_slots_wait_and_go_in_order() {
    let (uri, _dir) = memory_server(Script::Serve);
    // Two slots, 64 operations: 62 wait in the backlog at first.
    let client = Client::connect_with(&uri, &options(2, 64)).expect("connect");
    let (tx, rx) = mpsc::channel();
    for k in 0..64u64 {
        let t = tx.clone();
        let flags = WriteFlags::default();
        // Every write covers the same block: only the order they went in leaves the last.
        client.start_write(vec![k as u8; 4096], 0, flags, move |_, r| {
            drop(t.send((k, r)))
        });
    }
    let done = collect(&client, &rx, 64);
    assert!(done.iter().all(|(_, r)| r.is_ok()));
    let order: Vec<u64> = done.iter().map(|(k, _)| *k).collect();
    assert_eq!(order, (0..64).collect::<Vec<_>>(), "completed out of order");
    let mut buf = [0u8; 4096];
    client.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, [63u8; 4096]);
}

#[test]
fn a_full_backlog_fails_at_once_with_busy() {
    let (uri, _dir) = memory_server(Script::Serve);
    let client = Client::connect_with(&uri, &options(1, 2)).expect("connect");
    let (tx, rx) = mpsc::channel();
    for k in 0..4u64 {
        let t = tx.clone();
        client.start_read(vec![0u8; 512], 0, move |_, r| drop(t.send((k, r))));
    }
    // One on the wire, two waiting, the fourth refused before `start_read` returned.
    let refused: Vec<_> = rx.try_iter().collect();
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].0, 3);
    assert!(matches!(refused[0].1, Err(Error::Busy)));
    let done = collect(&client, &rx, 3);
    assert!(done.iter().all(|(_, r)| r.is_ok()));
}

#[test]
fn a_server_that_leaves_fails_what_flies_and_what_waits() {
    let (uri, _dir) = memory_server(Script::LeaveAfter(2));
    let client = Client::connect_with(&uri, &options(2, 16)).expect("connect");
    let (tx, rx) = mpsc::channel();
    for k in 0..8u64 {
        let t = tx.clone();
        client.start_read(vec![0u8; 4096], 0, move |b, r| {
            drop(t.send((k, b.len(), r)))
        });
    }
    let mut done = collect(&client, &rx, 8);
    done.sort_by_key(|(k, _, _)| *k);
    assert!(done[..2].iter().all(|(_, _, r)| r.is_ok()));
    for (k, len, r) in &done[2..] {
        assert_eq!(*len, 4096, "the buffer came back");
        assert!(
            matches!(r, Err(Error::Disconnected(_) | Error::Io { .. })),
            "{k}: {r:?}"
        );
    }
    // A later operation fails on the caller's thread, at once.
    let t = tx.clone();
    client.start_flush(move |r| drop(t.send((99, 0, r))));
    let late = rx.try_recv().expect("failed before returning");
    assert!(late.2.is_err());
}

#[test]
fn drive_returns_when_woken() {
    let (uri, _dir) = memory_server(Script::Serve);
    let client = std::sync::Arc::new(Client::connect_with(&uri, &options(4, 4)).expect("connect"));
    let waker = std::sync::Arc::clone(&client);
    let start = Instant::now();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        waker.wake();
    });
    assert_eq!(client.drive(Duration::from_secs(10)), 0);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "wake did not end the drive"
    );
    t.join().expect("waker");
}
