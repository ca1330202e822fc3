//! One set of client checks, run against every real server: zcnbd (both engines), nbdkit,
//! qemu-nbd and nbd-server (libnbd's `interop/` does the same for libnbd).

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::time::{Duration, Instant};

use common::servers::{self, Kind, Running};
use zcnbd_client::{Client, ClientOptions, Completion, Error, WriteFlags, ZeroFlags};
use zcnbd_proto::consts::transmission_flags as tf;
use zcnbd_proto::ReplyMode;

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

fn connect(server: &Running) -> Client {
    Client::connect(&server.uri).unwrap_or_else(|e| panic!("{:?}: connect: {e}", server.kind))
}

fn round_trip(server: &Running) {
    let c = connect(server);
    assert_eq!(c.size(), servers::EXPORT_BYTES);
    // Every framing gets exercised: these servers' versions here negotiate these modes.
    let expected = match server.kind {
        Kind::Zcnbd | Kind::ZcnbdPortableFile | Kind::ZcnbdRbd | Kind::QemuNbd => {
            ReplyMode::Extended
        }
        Kind::Nbdkit => ReplyMode::Structured,
        Kind::NbdServer => ReplyMode::Simple,
    };
    eprintln!("{:?}: {:?}, {:?}", server.kind, c.mode(), c.geometry());
    assert_eq!(c.mode(), expected, "{:?}", server.kind);
    let data = pattern(1 << 20, 1);
    assert_eq!(c.write_at(&data, 1 << 20).expect("write"), data.len());
    let mut back = vec![0u8; data.len()];
    assert_eq!(c.read_at(&mut back, 1 << 20).expect("read"), data.len());
    assert!(back == data, "{:?}: read back differs", server.kind);
    if c.geometry().has(tf::SEND_FUA) {
        let fua = WriteFlags { fua: true };
        c.write_vectored_at(&[IoSlice::new(&data[..4096])], 0, fua)
            .expect("FUA write");
    }
    c.flush().expect("flush");
    let stats = c.stats();
    assert_eq!(stats.copied_bytes, 0);
    assert!(stats.received_in_place_bytes >= data.len() as u64);
}

fn odd_iovecs(server: &Running) {
    let c = connect(server);
    let data = pattern(16384, 2);
    let sizes = [1, 7, 504, 4096, 1000, 3072, 7704];
    let mut at = 0;
    let pieces: Vec<IoSlice<'_>> = sizes
        .iter()
        .map(|&n| {
            let s = IoSlice::new(&data[at..at + n]);
            at += n;
            s
        })
        .collect();
    c.write_vectored_at(&pieces, 3 << 20, WriteFlags::default())
        .expect("vectored write");
    let mut a = vec![0u8; 3];
    let mut b = vec![0u8; 5000];
    let mut d = vec![0u8; 16384 - 5003];
    let mut bufs = [
        IoSliceMut::new(&mut a),
        IoSliceMut::new(&mut b),
        IoSliceMut::new(&mut d),
    ];
    c.read_vectored_at(&mut bufs, 3 << 20)
        .expect("vectored read");
    let back: Vec<u8> = [a, b, d].concat();
    assert!(
        back == data,
        "{:?}: vectored read back differs",
        server.kind
    );
}

fn holes_between_data(server: &Running) {
    let c = connect(server);
    let base = 8 << 20;
    let one = pattern(4096, 3);
    let two = pattern(4096, 4);
    c.write_zeroes(base, 16384, ZeroFlags::default())
        .expect("zero");
    c.write_at(&one, base).expect("write one");
    c.write_at(&two, base + 8192).expect("write two");
    let mut back = vec![0xaa; 16384];
    c.read_at(&mut back, base).expect("read");
    assert!(back[..4096] == one[..]);
    assert!(
        back[4096..8192].iter().all(|&x| x == 0),
        "{:?}: hole not zero",
        server.kind
    );
    assert!(back[8192..12288] == two[..]);
    assert!(back[12288..].iter().all(|&x| x == 0));
    if server.kind == Kind::Zcnbd {
        // zcnbd answers sparse ranges of a memory export with OFFSET_HOLE chunks: this read
        // had four chunks, two of them holes filled in place.
        assert!(c.stats().zeroed_bytes >= 8192, "{:?}", c.stats());
    }
}

fn zero_and_trim(server: &Running) {
    let c = connect(server);
    let base = 12 << 20;
    c.write_at(&pattern(65536, 5), base).expect("write");
    c.write_zeroes(base + 4096, 8192, ZeroFlags::default())
        .expect("zero");
    let mut back = vec![1u8; 65536];
    c.read_at(&mut back, base).expect("read");
    assert!(back[4096..12288].iter().all(|&x| x == 0));
    assert!(back[..4096] == pattern(65536, 5)[..4096]);
    if c.geometry().has(tf::SEND_TRIM) {
        c.trim(base, 65536, WriteFlags::default()).expect("trim");
    } else {
        assert!(matches!(
            c.trim(base, 65536, WriteFlags::default()),
            Err(Error::Unsupported(_))
        ));
    }
}

fn bounds_and_splitting(server: &Running) {
    let c = connect(server);
    let size = c.size();
    let mut one = [0u8; 512];
    assert!(matches!(
        c.read_at(&mut one, size),
        Err(Error::OutOfRange { .. })
    ));
    if c.geometry().minimum > 1 {
        assert!(matches!(
            c.read_at(&mut one, 1),
            Err(Error::Misaligned { .. })
        ));
        assert!(matches!(
            c.read_at(&mut one[..100], 0),
            Err(Error::Misaligned { .. })
        ));
    }
    // Larger than any server's maximum payload: split into several requests.
    let big = pattern(40 << 20, 6);
    c.write_at(&big, 16 << 20).expect("big write");
    let mut back = vec![0u8; big.len()];
    c.read_at(&mut back, 16 << 20).expect("big read");
    assert!(back == big, "{:?}: split read back differs", server.kind);
    assert!(c.stats().requests >= 2);
}

fn block_status(server: &Running) {
    let c = connect(server);
    if !c.geometry().base_allocation {
        assert!(matches!(
            c.block_status(0, 4096),
            Err(Error::Unsupported(_))
        ));
        return;
    }
    let extents = c.block_status(0, c.size()).expect("block status");
    assert!(!extents.is_empty());
    assert!(extents.iter().all(|e| e.length > 0));
}

fn many_in_flight(server: &Running) {
    let options = ClientOptions {
        connections: 4,
        ..ClientOptions::default()
    };
    let c = Client::connect_with(&server.uri, &options).expect("connect");
    if c.geometry().has(tf::CAN_MULTI_CONN) {
        assert_eq!(c.connections(), 4, "{:?}", server.kind);
    } else {
        assert_eq!(c.connections(), 1);
    }
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
    c.flush().expect("flush");
    // Read back on a different client (another connection): what was flushed is visible.
    let other = connect(server);
    for i in 0..32u64 {
        other
            .submit_read(vec![0u8; block], base + i * block as u64, i)
            .expect("submit read");
    }
    let mut reads: Vec<Completion> = Vec::new();
    while reads.len() < 32 {
        other.complete(&mut reads, Some(Duration::from_secs(10)));
    }
    for r in &reads {
        assert!(r.result.is_ok());
        assert!(
            r.buffer == pattern(block, 100 + r.user_data),
            "{:?}",
            server.kind
        );
    }
    assert_eq!(other.stats().copied_bytes, 0);
    assert_eq!(other.stats().received_in_place_bytes, 32 * block as u64);
}

/// Requests submitted under a plug leave when it is dropped, in one send; a thread that
/// waits for completions under a plug sends them itself.
fn plugged(server: &Running) {
    let c = connect(server);
    let block = 4096usize;
    let base = 62u64 << 20;
    let before = c.stats().syscalls;
    let plug = c.plug();
    for i in 0..8u64 {
        let data = pattern(block, 200 + i);
        c.submit_write(data, base + i * block as u64, WriteFlags::default(), i)
            .expect("submit write");
    }
    assert_eq!(
        c.stats().syscalls,
        before,
        "{:?}: sent under a plug",
        server.kind
    );
    drop(plug);
    let sends = c.stats().syscalls - before;
    // One sendmsg for all eight; a second only if the socket took part of them.
    assert!((1..=2).contains(&sends), "{:?}: {sends} sends", server.kind);
    let mut done = Vec::new();
    while done.len() < 8 {
        c.complete(&mut done, Some(Duration::from_secs(10)));
    }
    assert!(done.iter().all(|d| d.result.is_ok()), "{:?}", server.kind);
    let plug = c.plug();
    for i in 0..8u64 {
        c.submit_read(vec![0u8; block], base + i * block as u64, i)
            .expect("submit read");
    }
    let mut reads = Vec::new();
    let start = Instant::now();
    while reads.len() < 8 {
        c.complete(&mut reads, Some(Duration::from_secs(1)));
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}: plugged requests never sent",
            server.kind
        );
    }
    drop(plug);
    for r in &reads {
        assert!(r.result.is_ok());
        assert!(
            r.buffer == pattern(block, 200 + r.user_data),
            "{:?}",
            server.kind
        );
    }
}

/// Small reads (under 16 KiB) in flight alone are received many replies per socket call and
/// their data copied out (counted); with a large read among them, every reply is received
/// exactly and the large read's data straight into its buffer. Either way every byte is
/// the one written, whatever framing the server uses.
fn small_reads_together(server: &Running) {
    let c = connect(server);
    let block = 4096usize;
    let base = 56u64 << 20;
    let blocks = 64u64;
    let data = pattern(blocks as usize * block, 300);
    c.write_at(&data, base).expect("write");
    let other = connect(server);
    let expect = |r: &Completion| {
        let at = r.user_data as usize * block;
        assert!(r.result.is_ok(), "{:?}: read {}", server.kind, r.user_data);
        assert!(
            r.buffer[..] == data[at..at + r.buffer.len()],
            "{:?}: read {} differs",
            server.kind,
            r.user_data
        );
    };
    let copied = other.stats().copied_bytes;
    let plug = other.plug();
    for i in 0..blocks {
        other
            .submit_read(vec![0u8; block], base + i * block as u64, i)
            .expect("submit read");
    }
    drop(plug);
    let mut reads = Vec::new();
    while reads.len() < blocks as usize {
        other.complete(&mut reads, Some(Duration::from_secs(10)));
    }
    reads.iter().for_each(expect);
    assert_eq!(
        other.stats().copied_bytes - copied,
        blocks * block as u64,
        "{:?}: small reads' data copied out of shared receives",
        server.kind
    );
    // A large read (the whole range) among small ones.
    let in_place = other.stats().received_in_place_bytes;
    let plug = other.plug();
    for i in 0..blocks {
        if i == blocks / 2 {
            other
                .submit_read(vec![0u8; data.len()], base, 0)
                .expect("submit large read");
        }
        other
            .submit_read(vec![0u8; block], base + i * block as u64, i)
            .expect("submit read");
    }
    drop(plug);
    let mut reads = Vec::new();
    while reads.len() < blocks as usize + 1 {
        other.complete(&mut reads, Some(Duration::from_secs(10)));
    }
    reads.iter().for_each(expect);
    assert!(
        other.stats().received_in_place_bytes - in_place >= data.len() as u64,
        "{:?}: the large read's data received in place",
        server.kind
    );
}

fn killed_mid_request(kind: Kind) {
    let Some(mut server) = servers::start(kind) else {
        return;
    };
    let c = connect(&server);
    c.write_at(&pattern(1 << 20, 9), 0).expect("write");
    for i in 0..64u64 {
        c.submit_read(vec![0u8; 1 << 20], (i % 32) << 20, i)
            .expect("submit");
    }
    server.kill();
    let start = Instant::now();
    let mut done = Vec::new();
    while done.len() < 64 {
        c.complete(&mut done, Some(Duration::from_secs(1)));
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{kind:?}: requests hang"
        );
    }
    let mut buf = [0u8; 4096];
    assert!(
        c.read_at(&mut buf, 0).is_err(),
        "{kind:?}: dead server still answers"
    );
}

/// A named check against a running server.
type Check = (&'static str, fn(&Running));

fn run_all(kind: Kind) {
    let Some(server) = servers::start(kind) else {
        return;
    };
    let checks: [Check; 10] = [
        ("round_trip", round_trip),
        ("odd_iovecs", odd_iovecs),
        ("holes_between_data", holes_between_data),
        ("zero_and_trim", zero_and_trim),
        ("bounds_and_splitting", bounds_and_splitting),
        ("block_status", block_status),
        ("many_in_flight", many_in_flight),
        ("plugged", plugged),
        ("small_reads_together", small_reads_together),
        ("round_trip again", round_trip),
    ];
    for (name, check) in checks {
        eprintln!("{kind:?}: {name}");
        check(&server);
    }
    drop(server);
    killed_mid_request(kind);
}

#[test]
fn zcnbd() {
    run_all(Kind::Zcnbd);
}

#[test]
fn zcnbd_portable_file() {
    run_all(Kind::ZcnbdPortableFile);
}

#[test]
fn zcnbd_rbd() {
    run_all(Kind::ZcnbdRbd);
}

#[test]
fn nbdkit() {
    run_all(Kind::Nbdkit);
}

#[test]
fn qemu_nbd() {
    run_all(Kind::QemuNbd);
}

#[test]
fn nbd_server() {
    run_all(Kind::NbdServer);
}
