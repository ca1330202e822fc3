//! The server session's batch helper, and a sweep of pseudo-random and plausible request
//! streams, fed in random pieces, that must never panic or stall.

use crate::consts::cmd_flags as cf;
use crate::request::RequestHeader;
use crate::server_session::{ServerEvent, ServerSession, ServerWant};
use crate::server_session_tests::{ctx, put, req, request, MODES, PAYLOAD_MAX};
use crate::test_rng::XorShift;
use crate::types::{Command, ReplyMode};

#[test]
fn a_batch_stops_when_asked_and_at_a_payload() {
    let mode = ReplyMode::Structured;
    let size = mode.request_header_bytes();
    let read = req(Command::Read, 0, 0, 512);
    let write = req(Command::Write, 0, 0, 512);
    let mut stream = Vec::new();
    for _ in 0..3 {
        put(&mut stream, mode, &read, 0);
    }
    put(&mut stream, mode, &write, 512);
    put(&mut stream, mode, &read, 0);
    let mut session = ServerSession::new(ctx(mode));
    let mut events = Vec::new();
    let used = session.handle_batch(&stream, |e| {
        events.push(e);
        false
    });
    assert_eq!((used, events.len()), (size, 1));
    let used = session.handle_batch(&stream[size..], |e| {
        events.push(e);
        true
    });
    assert_eq!(used, 3 * size);
    assert_eq!(events.last(), Some(&request(write, 512)));
    assert_eq!(session.handle_batch(&stream[4 * size..], |_| true), 0);
    assert!(session.payload_received(512));
    assert_eq!(
        session.handle_batch(&stream[4 * size + 512..], |_| true),
        size
    );
}

/// A plausible request: a valid magic with random fields, often followed by some payload.
fn plausible(rng: &mut XorShift, mode: ReplyMode, stream: &mut Vec<u8>) {
    let header = RequestHeader {
        flags: [0, cf::FUA, cf::PAYLOAD_LEN, rng.next() as u16][rng.below(4)],
        kind: rng.below(10) as u16,
        cookie: rng.next(),
        offset: [0, 512 * rng.below(4096) as u64, rng.next()][rng.below(3)],
        length: [0, 512 * rng.below(300) as u64, rng.next()][rng.below(3)],
    };
    header.encode(mode, stream);
    let payload = header.payload_bytes(mode).min(rng.below(70_000) as u64);
    stream.extend(rng.bytes(payload as usize));
}

/// Feeds pseudo-random and plausible bytes in random pieces; tallies the outcomes.
fn sweep_once(rng: &mut XorShift, tally: &mut [usize; 4]) {
    let mode = MODES[rng.below(3)];
    let mut context = ctx(mode);
    context.block_size.payload_max = [512, 4096, PAYLOAD_MAX][rng.below(3)];
    let mut session = ServerSession::new(context);
    let mut stream = Vec::new();
    for _ in 0..rng.piece(6) {
        match rng.below(5) {
            0 => {
                let len = rng.below(100);
                stream.extend(rng.bytes(len));
            }
            _ => plausible(rng, mode, &mut stream),
        }
    }
    let mut at = 0;
    while at < stream.len() {
        let n = rng.piece(64).min(stream.len() - at);
        if let ServerWant::Payload { remaining, .. } = session.want() {
            let n = n.min(remaining);
            session.payload_received(n);
            at += n;
            continue;
        }
        let (used, event) = session.handle_input(&stream[at..at + n]);
        assert!(used <= n);
        at += used;
        match event {
            Some(ServerEvent::Request { .. }) => tally[0] += 1,
            Some(ServerEvent::Rejected { .. }) => tally[1] += 1,
            Some(ServerEvent::End(reason)) => {
                tally[2 + usize::from(reason.is_violation())] += 1;
                assert!(session.is_ended());
            }
            None if used == 0 => break,
            None => {}
        }
    }
    let ended = session.is_ended();
    assert!(ended || at == stream.len());
    let cut = session.close();
    assert!(!(ended && cut.is_some()));
}

#[test]
fn pseudo_random_bytes_never_panic() {
    let mut rng = XorShift::new(0x5e55_1011);
    // Requests, refusals, clean ends, hard ends.
    let mut tally = [0usize; 4];
    for _ in 0..4000 {
        sweep_once(&mut rng, &mut tally);
    }
    assert!(tally.iter().all(|&n| n > 100), "{tally:?}");
}
