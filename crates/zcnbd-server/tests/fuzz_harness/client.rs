//! The client's sans-IO halves on arbitrary server bytes: `client_session` starts requests
//! chosen by the input, then feeds the rest as replies in pieces of an input-chosen size;
//! `client_handshake` feeds the input as a server's side of the handshake. Either may refuse
//! the bytes (that is its job); neither may panic, lose track of a request, hand out data
//! outside a request, or stall with a full input buffer.

use std::collections::HashMap;

use zcnbd_proto::consts::cmd_flags;
use zcnbd_proto::{
    ClientHandshake, ClientHandshakeOptions, ClientHandshakeStatus, ClientSession, Command,
    ReplyEvent, Request, SessionLimits, Want,
};

use super::request::MODES;
use super::Bytes;

const COMMANDS: [Command; 7] = [
    Command::Read,
    Command::Write,
    Command::Flush,
    Command::Trim,
    Command::BlockStatus,
    Command::Cache,
    Command::WriteZeroes,
];

/// Runs the `client_session` target.
pub fn run_session(data: &[u8]) {
    let mut b = Bytes::new(data);
    let mode = MODES[usize::from(b.u8()) % MODES.len()];
    let base_allocation = (b.u8() & 1 == 1).then_some(1);
    let limits = SessionLimits {
        requests_in_flight_max: 8,
        chunk_payload_bytes_max: 4096,
        chunks_per_reply_max: 64,
    };
    let mut session = ClientSession::new(mode, base_allocation, limits);
    let mut requests: HashMap<u64, Request> = HashMap::new();
    for _ in 0..1 + b.u8() % 8 {
        let request = Request {
            command: COMMANDS[usize::from(b.u8()) % COMMANDS.len()],
            flags: u16::from(b.u8()) & (cmd_flags::FUA | cmd_flags::DF | cmd_flags::REQ_ONE),
            offset: u64::from(b.u32()),
            length: u64::from(b.u32() % 65536),
        };
        let mut wire = Vec::new();
        if let Ok(cookie) = session.start(request, &mut wire) {
            assert!(requests.insert(cookie, request).is_none(), "cookie reused");
        }
    }
    let step = 1 + usize::from(b.u8() % 64);
    feed(&mut session, &mut requests, b.rest(), step);
    assert_eq!(
        session.in_flight(),
        requests.len(),
        "requests lost track of"
    );
}

/// Feeds `stream` as replies; returns at its end or at the first violation.
fn feed(
    session: &mut ClientSession,
    requests: &mut HashMap<u64, Request>,
    stream: &[u8],
    step: usize,
) {
    let mut pos = 0;
    loop {
        let left = stream.len() - pos;
        let event = match session.want() {
            Want::Payload { cookie, at, bytes } => {
                let r = requests.get(&cookie).expect("payload for a known request");
                // Zero bytes is the step that ends a reply whose last chunk was buffered.
                assert!(
                    bytes == 0 || r.command == Command::Read,
                    "payload for a {:?}",
                    r.command
                );
                assert!(at + bytes <= r.length, "payload outside the request");
                let n = (bytes as usize).min(step).min(left);
                if n == 0 && bytes > 0 {
                    return;
                }
                pos += n;
                session.payload_received(n as u64)
            }
            Want::Header(need) => {
                let hint = session.header_read_hint();
                assert!(hint >= need, "the hint is below the need");
                let n = hint.min(step).min(left);
                if n == 0 {
                    return;
                }
                match session.handle_input(&stream[pos..pos + n]) {
                    Ok((used, event)) => {
                        assert!(used > 0 && used <= n, "used {used} of {n}");
                        pos += used;
                        event
                    }
                    Err(_) => return,
                }
            }
        };
        check(event, requests);
    }
}

fn check(event: Option<ReplyEvent>, requests: &mut HashMap<u64, Request>) {
    match event {
        None => {}
        Some(ReplyEvent::Data { cookie, at, bytes } | ReplyEvent::Hole { cookie, at, bytes }) => {
            let r = requests.get(&cookie).expect("content for a known request");
            assert_eq!(r.command, Command::Read, "content for a {:?}", r.command);
            assert!(
                bytes > 0 && at + bytes <= r.length,
                "content outside the request"
            );
        }
        Some(ReplyEvent::Extents {
            cookie, extents, ..
        }) => {
            let r = requests.get(&cookie).expect("extents for a known request");
            assert_eq!(r.command, Command::BlockStatus);
            assert!(!extents.is_empty() && extents.iter().all(|e| e.length > 0));
        }
        Some(ReplyEvent::Done { cookie, .. }) => {
            assert!(requests.remove(&cookie).is_some(), "a request ended twice");
        }
    }
}

/// Runs the `client_handshake` target.
pub fn run_handshake(data: &[u8]) {
    let mut b = Bytes::new(data);
    let bits = b.u8();
    let options = ClientHandshakeOptions {
        export_name: "e".repeat(usize::from(b.u8() % 4)),
        structured_replies: bits & 1 != 0,
        extended_headers: bits & 2 != 0,
        base_allocation: bits & 4 != 0,
        option_reply_bytes_max: 256,
        option_replies_max: 8,
    };
    let mut hs = ClientHandshake::new(options);
    if bits & 8 != 0 {
        // A listing first: what the server lists is selected next (bounded however many).
        let queries = zcnbd_proto::MetaQueries::new(["qemu:", "base:"]).expect("valid");
        hs = hs.with_meta_list(queries);
    }
    let step = 1 + usize::from(b.u8() % 32);
    let stream = b.rest();
    let mut buffered: Vec<u8> = Vec::new();
    let mut pos = 0;
    loop {
        let n = hs.pending_output().len();
        hs.consume_output(n);
        if !matches!(hs.status(), ClientHandshakeStatus::NeedIo) {
            return;
        }
        match hs.handle_input(&buffered) {
            Err(_) => return,
            Ok(0) => {
                assert!(
                    buffered.len() < hs.input_bytes_max(),
                    "stalled with a full buffer"
                );
                if pos == stream.len() {
                    return;
                }
                let take = step
                    .min(stream.len() - pos)
                    .min(hs.input_bytes_max() - buffered.len());
                buffered.extend_from_slice(&stream[pos..pos + take]);
                pos += take;
            }
            Ok(used) => {
                assert!(used <= buffered.len());
                buffered.drain(..used);
            }
        }
    }
}
