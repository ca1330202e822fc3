//! One connection driven through a fake ring (`fake.rs`): what it submits for each request,
//! and how it reacts to what the kernel reports - short transfers, errors, a client that
//! hangs up or stops reading.

use std::io::Read;
use std::time::Duration;

use zcnbd_proto::Command;

use super::super::sendfile_trial::{LargeReads, SendfileTrial};
use super::fake::{request, simple_reply, Harness};
use super::intake::{BULK_PAYLOAD_MAX_BYTES, BULK_STAGE_BYTES, HOLD_TURNS_MAX};
use super::*;
use crate::export::Backend;
use crate::limits::Limits;
use crate::sys::uring::Prepared;

/// An engine that receives every memory-export write in place and sends reads from the
/// mapping.
fn harness(limits: Limits) -> Harness {
    let options = EngineOptions {
        receive_in_place_max_bytes: Some(usize::MAX),
        ..EngineOptions::default()
    };
    Harness::memory(options, limits)
}

/// `len` bytes that are not all alike.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// A harness whose export holds `data` at 4096, and a read of it received: its reply's send
/// is in flight, with the next header's receive.
fn read_in_flight(limits: Limits, data: &[u8]) -> Harness {
    let mut h = harness(limits);
    h.backend.pwrite(data, 4096, false).unwrap();
    let read = request(Command::Read, 7, 4096, data.len() as u64);
    assert_eq!(h.client_sends(&read), read.len());
    assert!(h.has_pending(Tag::Recv) && h.has_pending(Tag::Send));
    h
}

#[test]
fn a_read_from_memory_is_one_send_of_header_and_data() {
    let data = pattern(3000);
    let mut h = read_in_flight(Limits::default(), &data);
    let (send, bytes) = h.sent();
    assert_eq!(bytes, [simple_reply(7), data].concat());
    h.complete(send, bytes.len() as i32);
    assert_eq!(h.counter("requests"), 1);
    assert_eq!(h.counter("sent_plain_bytes"), 3000);
    assert_eq!(h.counter("copied_bytes"), 0);
    assert_eq!(h.conn.budget.inflight(), 0);
}

#[test]
fn a_short_send_resubmits_the_rest() {
    let data = pattern(3000);
    let mut h = read_in_flight(Limits::default(), &data);
    let (send, bytes) = h.sent();
    h.complete(send, 10);
    assert_eq!(h.counter("requests"), 0);
    let (send, rest) = h.sent();
    assert_eq!(rest, bytes[10..]);
    h.complete(send, rest.len() as i32);
    assert_eq!(h.counter("requests"), 1);
    assert!(!h.has_pending(Tag::Send));
}

#[test]
fn a_write_payload_received_in_two_short_receives_lands_in_place() {
    let mut h = harness(Limits::default());
    // Larger than a payload received together with the next header.
    let payload = pattern(100_000);
    let write = request(Command::Write, 9, 8192, payload.len() as u64);
    h.client_sends(&write);
    let (_, recv) = h.driver.pending[0];
    let mut map = crate::export::Map::default();
    let how = crate::export::MapFor::Write;
    h.backend
        .map(8192, payload.len() as u64, how, &mut map)
        .unwrap();
    let Some(crate::export::Place::Memory { range, .. }) = map.single().map(|s| &s.place) else {
        panic!("a memory export maps to its mapping");
    };
    let place = range.io_range(0..payload.len()).unwrap();
    assert!(matches!(recv, Prepared::Recv { ptr, .. } if ptr == place));
    assert_eq!(h.client_sends(&payload[..40_000]), 40_000);
    assert!(
        !h.has_pending(Tag::Send),
        "answered before the payload is in"
    );
    assert_eq!(h.client_sends(&payload[40_000..]), 60_000);
    let (send, reply) = h.sent();
    assert_eq!(reply, simple_reply(9));
    h.complete(send, reply.len() as i32);
    let mut stored = vec![0; payload.len()];
    h.backend.pread(&mut stored, 8192).unwrap();
    assert!(stored == payload);
    assert_eq!(h.counter("received_in_place_bytes"), 100_000);
    assert_eq!(h.counter("copied_bytes"), 0);
}

#[test]
fn a_short_write_and_the_next_header_share_one_receive() {
    let mut h = harness(Limits::default());
    let payload = pattern(100);
    h.client_sends(&request(Command::Write, 1, 0, 100));
    let next = request(Command::Read, 2, 0, 10);
    assert_eq!(h.client_sends(&[payload.clone(), next].concat()), 128);
    let (send, replies) = h.sent();
    let data = pattern(100)[..10].to_vec();
    assert_eq!(replies, [simple_reply(1), simple_reply(2), data].concat());
    h.complete(send, replies.len() as i32);
    assert_eq!(h.counter("requests"), 2);
}

#[test]
fn pipelined_small_writes_are_received_in_bulk_and_answered_in_one_send() {
    let mut h = harness(Limits::default());
    let writes: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i + 10; 4096]).collect();
    let mut stream = Vec::new();
    for (i, data) in writes.iter().enumerate() {
        stream.extend(request(Command::Write, i as u64, 8192 * i as u64, 4096));
        stream.extend(data);
    }
    let header = request(Command::Write, 0, 0, 0).len();
    // One exact header (the bytes left in the socket are its own payload's), then the
    // payload in place with the next header: the client has more than one request in flight.
    assert_eq!(h.client_sends(&stream), header);
    let mut at = header;
    at += h.client_sends(&stream[at..]);
    assert_eq!(at, 2 * header + 4096, "payload and the next header");
    // So the rest is received in bulk, a stage full at a time; while bytes wait in the
    // socket, the replies wait for the next receive, which takes those at once.
    at += h.client_sends(&stream[at..]);
    assert_eq!(at, 2 * header + 4096 + BULK_STAGE_BYTES);
    assert!(
        !h.has_pending(Tag::Send),
        "replies held for bytes already there"
    );
    at += h.client_sends(&stream[at..]);
    assert_eq!(at, stream.len());
    let (send, replies) = h.sent();
    let all: Vec<u8> = (0..20).flat_map(simple_reply).collect();
    assert_eq!(replies, all, "twenty replies in one send");
    h.complete(send, replies.len() as i32);
    for (i, data) in writes.iter().enumerate() {
        let mut back = vec![0u8; 4096];
        h.backend.pread(&mut back, 8192 * i as u64).unwrap();
        assert_eq!(&back, data, "write {i}");
    }
    assert_eq!(h.counter("requests"), 20);
    assert_eq!(h.counter("write_bytes"), 20 * 4096);
    // The first payload landed in place, the bulk's were copied from the stage.
    assert_eq!(h.counter("received_in_place_bytes"), 4096);
    assert_eq!(h.counter("copied_bytes"), 19 * 4096);
}

#[test]
fn replies_wait_for_bytes_in_the_socket_only_a_few_turns() {
    // A stream far longer than the held turns allow: replies leave every HOLD_TURNS_MAX+1
    // receives at the latest.
    let mut h = harness(Limits::default());
    let mut stream = Vec::new();
    for i in 0..200u64 {
        stream.extend(request(Command::Write, i, 4096 * (i % 64), 4096));
        stream.extend(vec![i as u8; 4096]);
    }
    let mut at = h.client_sends(&stream);
    let mut receives_without_send = 0;
    let mut replies = 0;
    while at < stream.len() {
        at += h.client_sends(&stream[at..]);
        if h.has_pending(Tag::Send) {
            let (send, bytes) = h.sent();
            replies += bytes.len() / simple_reply(0).len();
            h.complete(send, bytes.len() as i32);
            receives_without_send = 0;
        } else {
            receives_without_send += 1;
            assert!(
                receives_without_send <= HOLD_TURNS_MAX as usize,
                "held too long"
            );
        }
    }
    while h.has_pending(Tag::Send) {
        let (send, bytes) = h.sent();
        replies += bytes.len() / simple_reply(0).len();
        h.complete(send, bytes.len() as i32);
    }
    assert_eq!(replies, 200);
}

#[test]
fn after_a_small_write_the_next_header_and_its_payload_share_one_receive() {
    let mut h = harness(Limits::default());
    let whole = |i: u64| {
        [
            request(Command::Write, i, 4096 * i, 4096),
            vec![i as u8 + 1; 4096],
        ]
        .concat()
    };
    // The connection's first write: one exact header, then its payload lands in place.
    let first = whole(0);
    let header = h.client_sends(&first);
    assert_eq!(header, request(Command::Write, 0, 0, 0).len());
    assert_eq!(h.client_sends(&first[header..]), 4096);
    for i in 0..3u64 {
        if i > 0 {
            // One request in flight at a time, each a small write: its header and payload
            // arrive together and one receive takes both (the payload copied into place).
            let request = whole(i);
            assert_eq!(h.client_sends(&request), request.len(), "write {i}");
        }
        let (send, replies) = h.sent();
        assert_eq!(replies, simple_reply(i));
        h.complete(send, replies.len() as i32);
    }
    for i in 0..3u64 {
        let mut back = vec![0u8; 4096];
        h.backend.pread(&mut back, 4096 * i).unwrap();
        assert_eq!(back, vec![i as u8 + 1; 4096], "write {i}");
    }
    assert_eq!(h.counter("received_in_place_bytes"), 4096);
    assert_eq!(h.counter("copied_bytes"), 2 * 4096);
}

#[test]
fn a_large_write_after_a_small_one_has_at_most_16_kib_staged() {
    let mut h = harness(Limits::default());
    let small = [request(Command::Write, 0, 0, 4096), vec![7; 4096]].concat();
    let header = h.client_sends(&small);
    assert_eq!(h.client_sends(&small[header..]), 4096);
    let (send, replies) = h.sent();
    h.complete(send, replies.len() as i32);
    // The receive after a small write takes the next header and at most 16 KiB more.
    let payload = pattern(100_000);
    let large = [request(Command::Write, 1, 8192, 100_000), payload.clone()].concat();
    let mut at = h.client_sends(&large);
    assert_eq!(at, header + BULK_PAYLOAD_MAX_BYTES);
    while at < large.len() {
        at += h.client_sends(&large[at..]);
    }
    let (send, replies) = h.sent();
    assert_eq!(replies, simple_reply(1));
    h.complete(send, replies.len() as i32);
    let mut back = vec![0u8; 100_000];
    h.backend.pread(&mut back, 8192).unwrap();
    assert_eq!(back, payload);
    assert_eq!(h.counter("copied_bytes"), BULK_PAYLOAD_MAX_BYTES as u64);
    assert_eq!(
        h.counter("received_in_place_bytes"),
        (4096 + 100_000 - BULK_PAYLOAD_MAX_BYTES) as u64
    );
}

#[test]
fn a_client_that_hangs_up_is_freed_only_after_the_last_completion() {
    let mut h = read_in_flight(Limits::default(), &pattern(100));
    let (recv, _) = h.take(Tag::Recv);
    h.complete(recv, 0);
    assert!(!h.conn.is_finished(), "its reply is still being sent");
    // A result that says more is coming (as a zero-copy send's does) leaves the reply lent.
    let (send, bytes) = h.sent();
    let result = bytes.len() as i32;
    let cqe = |more, notification| Cqe {
        user_data: send,
        result,
        more,
        notification,
        sock_nonempty: false,
    };
    h.deliver(cqe(true, false));
    assert!(
        h.conn.tx.is_sending(),
        "the kernel may still read the reply"
    );
    assert_eq!(h.counter("requests"), 0);
    assert!(!h.conn.is_finished());
    h.deliver(cqe(false, true));
    assert_eq!(h.counter("requests"), 1);
    assert!(h.conn.is_finished());
    assert!(h.driver.pending.is_empty());
}

#[test]
fn a_client_that_reads_nothing_is_aborted_at_the_write_timeout() {
    let limits = Limits {
        write_timeout_ms: 1000,
        ..Limits::default()
    };
    let mut h = read_in_flight(limits, &pattern(100));
    h.now += Duration::from_millis(999);
    h.turn(|conn, cx| conn.on_tick(cx));
    assert!(!h.conn.broken);
    h.now += Duration::from_millis(1);
    h.turn(|conn, cx| conn.on_tick(cx));
    assert!(h.conn.broken);
    // The socket is hung up: the client sees the end of the stream.
    assert_eq!(h.client.read(&mut [0; 16]).unwrap(), 0);
    // The kernel fails what was in flight; only then is the connection freed.
    let (send, _) = h.sent();
    h.complete(send, -libc::EPIPE);
    assert!(!h.conn.is_finished());
    let (recv, _) = h.take(Tag::Recv);
    h.complete(recv, 0);
    assert!(h.conn.is_finished());
    assert_eq!(h.counter("requests"), 0);
}

#[test]
fn a_reset_connection_closes_cleanly() {
    let mut h = read_in_flight(Limits::default(), &pattern(100));
    let (send, _) = h.sent();
    h.complete(send, -libc::ECONNRESET);
    assert!(h.conn.broken);
    assert_eq!(h.conn.budget.inflight(), 0, "the unsent reply is dropped");
    assert!(!h.conn.is_finished(), "a receive is still posted");
    let (recv, _) = h.take(Tag::Recv);
    h.complete(recv, -libc::ECONNRESET);
    assert!(h.conn.is_finished());
    assert_eq!(h.counter("requests"), 0);
}

#[test]
fn a_connection_broken_while_a_payload_is_half_received_still_closes() {
    let mut h = read_in_flight(Limits::default(), &pattern(100));
    let payload = pattern(100_000);
    let (recv, header) = h.take(Tag::Recv);
    header.fill(&request(Command::Write, 8, 8192, payload.len() as u64));
    h.complete(recv, 28);
    assert!(h.has_pending(Tag::Recv), "the payload's receive");
    // The client goes away: the read's reply fails while the payload's receive is posted,
    // which then brings part of the payload (what the client sent before it left).
    let (send, _) = h.sent();
    h.complete(send, -libc::EPIPE);
    assert!(h.conn.broken);
    assert!(
        !h.conn.is_finished(),
        "the payload's receive is still posted"
    );
    assert_eq!(h.client_sends(&payload[..40_000]), 40_000);
    assert!(
        !h.has_pending(Tag::Recv),
        "a broken connection reads no more"
    );
    assert!(
        h.conn.is_finished(),
        "nothing is in flight: the half-received write must not keep it open"
    );
    assert_eq!(h.conn.budget.inflight(), 0);
    assert_eq!(h.counter("requests"), 0);
}

/// A pipe holding `bytes`.
fn pipe_with(bytes: &[u8]) -> Pipe {
    let pipe = Pipe::new().unwrap();
    assert_eq!(rustix::io::write(&pipe.write, bytes).unwrap(), bytes.len());
    pipe
}

#[test]
fn a_piped_reply_is_sent_from_each_of_its_pipes_in_turn_then_its_tail() {
    let data = pattern(600_000);
    let (a, b, c, tail) = (
        &data[..300_000],
        &data[300_000..301_000],
        &data[301_000..551_000],
        &data[551_000..],
    );
    let header = b"header--".to_vec();
    let item = Item {
        payload: Payload::Piped {
            header: header.clone(),
            pipe: pipe_with(a),
            len: a.len(),
            more: [(pipe_with(b), b.len()), (pipe_with(c), c.len())].into(),
            tail: tail.to_vec(),
        },
        held: 0,
    };
    assert_eq!(item.data_bytes(), data.len());
    let (server, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
    server.set_nonblocking(true).unwrap();
    let socket = OwnedFd::from(server);
    let mut send = InlineSend {
        item,
        header_sent: 0,
        sent: 0,
        tail_sent: 0,
    };
    let stats = crate::stats::Stats::default();
    let (mut got, mut resumed) = (Vec::new(), 0);
    // The socket takes part of it at a time: the send resumes where it stopped.
    while !send::send_inline_some(&socket, &mut send, &stats).unwrap() {
        resumed += 1;
        let mut chunk = vec![0; 50_000];
        let n = client.read(&mut chunk).unwrap();
        got.extend_from_slice(&chunk[..n]);
    }
    drop(socket);
    client.read_to_end(&mut got).unwrap();
    assert!(
        resumed > 0,
        "the socket took it all at once: nothing resumed"
    );
    assert!(got == [header, data.clone()].concat());
    assert_eq!(
        send.item.data_bytes(),
        data.len(),
        "the same data, all in one pipe's count"
    );
}

#[test]
fn pipes_after_the_first_fold_into_the_tail_in_order() {
    let more = vec![(pipe_with(b"abc"), 3), (pipe_with(b"defg"), 4)];
    assert_eq!(fold_into_tail(more, b"hi".to_vec()).unwrap(), b"abcdefghi");
    // A pipe that holds less than said, its writer gone, is an error, not a wait.
    let (read, write) = rustix::pipe::pipe().unwrap();
    rustix::io::write(&write, b"ab").unwrap();
    let (_, other_write) = rustix::pipe::pipe().unwrap();
    drop(write);
    let short = Pipe {
        read,
        write: other_write,
        capacity: 4096,
    };
    assert!(fold_into_tail(vec![(short, 3)], Vec::new()).is_err());
}

#[test]
fn a_refused_submission_fails_the_connection_and_takes_the_loan_back() {
    let mut h = harness(Limits::default());
    h.driver.refuse = true;
    let (recv, header) = h.take(Tag::Recv);
    header.fill(&request(Command::Read, 3, 0, 10));
    h.complete(recv, 28);
    assert!(h.conn.broken);
    assert!(
        !h.conn.rx.is_posted(),
        "the refused receive's memory is still lent"
    );
    assert!(h.conn.is_finished());
}

#[test]
fn a_connection_busy_only_with_its_replies_plain_send_may_be_waited_for_as_a_client() {
    let data = pattern(3000);
    let mut h = read_in_flight(Limits::default(), &data);
    assert!(!h.conn.awaits_client(), "a reply is on its way");
    assert!(h.conn.awaits_client_or_send());
    let (send, bytes) = h.sent();
    h.complete(send, bytes.len() as i32);
    assert!(h.conn.awaits_client() && h.conn.awaits_client_or_send());
    // A write whose payload is still to come is the client's business and the ring's.
    let write = request(Command::Write, 8, 4096, 4096);
    assert_eq!(h.client_sends(&write), write.len());
    assert!(!h.conn.awaits_client() && !h.conn.awaits_client_or_send());
}

/// Sixteen reads of `len` bytes, each answered before the next: after them the connection
/// receives request headers in batches, so a burst comes in one receive.
fn sixteen_reads(h: &mut Harness, len: u64) {
    for i in 0..16 {
        h.client_sends(&request(Command::Read, i, 0, len));
        let (send, bytes) = h.sent();
        h.complete(send, bytes.len() as i32);
    }
}

/// Sends `n` reads of 512 bytes in one burst (after the sixteen that turn on batched
/// header receives), on a ring that overlaps or not: the replies in each send, counted.
fn burst_of_reads(overlap: bool, n: u64) -> (Harness, Vec<usize>) {
    let mut h = harness(Limits::default());
    h.overlap = overlap;
    let reply = simple_reply(0).len() + 512;
    sixteen_reads(&mut h, 512);
    let burst: Vec<u8> = (0..n)
        .flat_map(|i| request(Command::Read, 100 + i, 512 * i, 512))
        .collect();
    assert_eq!(h.client_sends(&burst), burst.len());
    let mut sends = Vec::new();
    while h.has_pending(Tag::Send) {
        let (send, bytes) = h.sent();
        if overlap && sends.len() < 2 {
            assert!(
                !h.has_pending(Tag::Recv),
                "no receive while headers wait in the stage"
            );
        }
        sends.push(bytes.len() / reply);
        h.complete(send, bytes.len() as i32);
    }
    assert!(
        h.has_pending(Tag::Recv),
        "the next receive once all are started"
    );
    (h, sends)
}

#[test]
fn an_overlapping_ring_sends_a_bursts_replies_four_at_a_time() {
    let (h, sends) = burst_of_reads(true, 10);
    assert_eq!(sends, [4, 4, 2]);
    assert_eq!(h.counter("requests"), 26);
    assert_eq!(h.counter("sends_overlapped"), 2);
    assert_eq!(h.conn.budget.inflight(), 0);
    let (h, sends) = burst_of_reads(false, 10);
    assert_eq!(sends, [10], "otherwise the burst's replies share one send");
    assert_eq!(h.counter("sends_overlapped"), 0);
}

#[test]
fn an_overlapping_ring_starts_the_rest_of_a_burst_after_a_short_send() {
    let mut h = harness(Limits::default());
    h.overlap = true;
    sixteen_reads(&mut h, 8);
    let burst: Vec<u8> = (0..6)
        .flat_map(|i| request(Command::Read, 100 + i, 0, 8))
        .collect();
    h.client_sends(&burst);
    let (send, first) = h.sent();
    h.complete(send, 5);
    // The socket took part of the first four replies: the rest of them goes on (the last
    // two, started meanwhile, wait for it), then the last two.
    let (send, rest) = h.sent();
    assert_eq!(rest, first[5..]);
    h.complete(send, rest.len() as i32);
    let (send, last) = h.sent();
    assert_eq!(last.len(), 2 * (simple_reply(0).len() + 8));
    assert_eq!(last[..16], simple_reply(104)[..]);
    h.complete(send, last.len() as i32);
    assert_eq!(h.counter("requests"), 22);
    assert!(h.has_pending(Tag::Recv));
}

/// A read of 256 KiB on a connection whose large reads follow the ring's trials, which chose
/// `way`: the counters of plain and spliced bytes once its reply is sent.
fn large_read_chosen(way: LargeReads) -> (u64, u64) {
    let mut h = harness(Limits::default());
    h.sendfile_trial = SendfileTrial::kept(way);
    // As for a client on another host (the harness's is a Unix socket).
    assert!(
        h.conn.tx.sendfile_ok,
        "a memory export on a nonblocking socket"
    );
    h.conn.tx.sendfile_min = mechanism::SPLICE_MIN_BYTES_REMOTE;
    h.conn.tx.sendfile_tried = true;
    let len = mechanism::SPLICE_MIN_BYTES_REMOTE;
    // `sendfile` runs on the ring thread, into the real socket: the client reads it.
    let mut client = h.client.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut reply = vec![0u8; simple_reply(5).len() + len];
        client.read_exact(&mut reply).map(|()| reply)
    });
    h.client_sends(&request(Command::Read, 5, 0, len as u64));
    if h.has_pending(Tag::Send) {
        // From the mapping: one send, which the fake ring only hands back.
        let (send, bytes) = h.sent();
        assert_eq!(bytes.len(), simple_reply(5).len() + len);
        h.complete(send, bytes.len() as i32);
        h.client.shutdown(std::net::Shutdown::Both).unwrap();
    }
    while h.has_pending(Tag::Writable) {
        let (poll, _) = h.take(Tag::Writable);
        h.complete(poll, libc::POLLOUT as i32);
    }
    if way == LargeReads::Sendfile {
        let reply = reader.join().unwrap().expect("the whole reply");
        assert_eq!(reply[..16], simple_reply(5)[..]);
    }
    (
        h.counter("sent_plain_bytes"),
        h.counter("sent_splice_bytes"),
    )
}

#[test]
fn large_reads_to_another_host_go_the_way_the_rings_trials_chose() {
    let len = mechanism::SPLICE_MIN_BYTES_REMOTE as u64;
    assert_eq!(large_read_chosen(LargeReads::Sendfile), (0, len));
    assert_eq!(large_read_chosen(LargeReads::Mapped), (len, 0));
}

#[test]
fn an_overlapping_ring_answers_a_whole_burst_of_reads_it_sends_inline() {
    // `sendfile` replies leave on the ring thread with no completion to come: the rest of
    // the burst must still be started (fio's randrw verify hung on this).
    let mut h = harness(Limits::default());
    h.overlap = true;
    assert!(h.conn.tx.sendfile_ok);
    h.conn.tx.sendfile_min = 0;
    let mut client = h.client.try_clone().unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let reader = std::thread::spawn(move || {
        let mut replies = vec![0u8; 26 * (simple_reply(0).len() + 8)];
        client.read_exact(&mut replies).map(|()| replies)
    });
    for i in 0..16 {
        h.client_sends(&request(Command::Read, i, 0, 8));
    }
    let burst: Vec<u8> = (0..10)
        .flat_map(|i| request(Command::Read, 100 + i, 0, 8))
        .collect();
    h.client_sends(&burst);
    let replies = reader.join().unwrap().expect("every reply");
    let cookies: Vec<u64> = replies
        .chunks(simple_reply(0).len() + 8)
        .map(|r| u64::from_be_bytes(r[8..16].try_into().unwrap()))
        .collect();
    let expected: Vec<u64> = (0..16).chain(100..110).collect();
    assert_eq!(cookies, expected);
    assert_eq!(h.counter("requests"), 26);
    assert!(
        h.has_pending(Tag::Recv),
        "the next receive once all are started"
    );
}
