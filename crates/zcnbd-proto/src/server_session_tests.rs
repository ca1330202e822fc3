//! The server session fed request streams made by the request encoder: every path, in every
//! reply mode, whole and in short pieces (how the request stream ends is in
//! `server_session_end_tests`; the batch helper and the pseudo-random sweep are in
//! `server_session_sweep_tests`).

use crate::consts::{cmd_flags as cf, transmission_flags as tf};
use crate::request::RequestHeader;
use crate::server_session::{EndReason, ServerEvent, ServerSession, ServerWant};
use crate::types::{BlockSize, Command, Errno, ReplyMode};
use crate::validate::TransmissionContext;

pub(crate) const MODES: [ReplyMode; 3] = [
    ReplyMode::Simple,
    ReplyMode::Structured,
    ReplyMode::Extended,
];
pub(crate) const PAYLOAD_MAX: u32 = 64 * 1024;
pub(crate) const EXPORT_BYTES: u64 = 1 << 20;

pub(crate) fn ctx(mode: ReplyMode) -> TransmissionContext {
    TransmissionContext {
        mode,
        size: EXPORT_BYTES,
        flags: tf::HAS_FLAGS
            | tf::SEND_FLUSH
            | tf::SEND_FUA
            | tf::SEND_TRIM
            | tf::SEND_WRITE_ZEROES,
        block_size: BlockSize {
            minimum: 512,
            preferred: 4096,
            payload_max: PAYLOAD_MAX,
        },
        meta: crate::meta::MetaSelected::NONE,
    }
}

pub(crate) fn req(command: Command, flags: u16, offset: u64, length: u64) -> RequestHeader {
    RequestHeader {
        flags,
        kind: command.to_wire(),
        cookie: 0x1000_u64.wrapping_add(offset).wrapping_add(length),
        offset,
        length,
    }
}

/// Appends `header`, and `payload` bytes of pattern after it.
pub(crate) fn put(stream: &mut Vec<u8>, mode: ReplyMode, header: &RequestHeader, payload: usize) {
    header.encode(mode, stream);
    stream.extend((0..payload).map(|i| (i * 7 + 3) as u8));
}

pub(crate) fn request(header: RequestHeader, payload_bytes: usize) -> ServerEvent {
    ServerEvent::Request {
        header,
        command: Command::from_wire(header.kind).unwrap(),
        payload_bytes,
    }
}

fn rejected(event: &ServerEvent) -> Option<(Errno, usize)> {
    match event {
        ServerEvent::Rejected {
            rejection,
            payload_bytes,
            ..
        } => Some((rejection.errno, *payload_bytes)),
        _ => None,
    }
}

/// What a test I/O layer saw.
#[derive(Default, Debug, PartialEq)]
pub(crate) struct Fed {
    pub(crate) events: Vec<ServerEvent>,
    pub(crate) payloads: Vec<Vec<u8>>,
    pub(crate) used: usize,
}

/// Feeds `stream` in pieces of at most `step` bytes, receiving each write's payload into a
/// buffer of its own as an I/O layer would; stops at the end of the stream or of requests.
pub(crate) fn feed(session: &mut ServerSession, stream: &[u8], step: usize) -> Fed {
    let mut fed = Fed::default();
    loop {
        let rest = &stream[fed.used..];
        match session.want() {
            ServerWant::Payload {
                received,
                remaining,
            } => {
                let n = remaining.min(step).min(rest.len());
                if n == 0 {
                    return fed;
                }
                if received == 0 {
                    fed.payloads.push(Vec::new());
                }
                fed.payloads
                    .last_mut()
                    .unwrap()
                    .extend_from_slice(&rest[..n]);
                fed.used += n;
                assert_eq!(session.payload_received(n), n == remaining);
            }
            ServerWant::Ended => return fed,
            ServerWant::Header(_) | ServerWant::Discard { .. } => {
                let n = step.min(rest.len());
                let (used, event) = session.handle_input(&rest[..n]);
                assert!(used <= n);
                fed.used += used;
                if used == 0 && event.is_none() {
                    return fed;
                }
                fed.events.extend(event);
            }
        }
    }
}

#[test]
fn requests_without_payload_in_every_mode() {
    for mode in MODES {
        let headers = [
            req(Command::Read, cf::FUA, 4096, 8192),
            req(Command::Flush, 0, 0, 0),
            req(Command::Trim, 0, 0, 512),
            req(Command::WriteZeroes, cf::NO_HOLE, 512, 1024),
        ];
        let mut stream = Vec::new();
        headers.iter().for_each(|h| put(&mut stream, mode, h, 0));
        let mut session = ServerSession::new(ctx(mode));
        let fed = feed(&mut session, &stream, usize::MAX);
        let expected: Vec<_> = headers.iter().map(|h| request(*h, 0)).collect();
        assert_eq!(fed.events, expected, "{mode:?}");
        assert_eq!(fed.used, stream.len());
        assert_eq!(
            session.want(),
            ServerWant::Header(mode.request_header_bytes())
        );
        assert!(session.is_idle());
        let to = session.reply_to(&headers[0]);
        assert_eq!(
            (to.mode, to.cookie, to.offset),
            (mode, headers[0].cookie, 4096)
        );
    }
}

#[test]
fn a_write_payload_is_left_to_the_caller() {
    for mode in MODES {
        let write = req(Command::Write, 0, 8192, 4096);
        let mut stream = Vec::new();
        put(&mut stream, mode, &write, 4096);
        let size = mode.request_header_bytes();
        let mut session = ServerSession::new(ctx(mode));
        assert_eq!(session.header_bytes(), size);
        assert_eq!(
            session.handle_input(&stream),
            (size, Some(request(write, 4096)))
        );
        let payload = ServerWant::Payload {
            received: 0,
            remaining: 4096,
        };
        assert_eq!(session.want(), payload);
        assert_eq!(session.handle_input(&stream[size..]), (0, None));
        assert!(!session.payload_received(0));
        assert!(!session.payload_received(100));
        let payload = ServerWant::Payload {
            received: 100,
            remaining: 3996,
        };
        assert_eq!(session.want(), payload);
        assert!(!session.is_idle());
        assert!(session.payload_received(3996));
        assert!(session.is_idle());
        // A zero-length write has no payload to wait for.
        let empty = req(Command::Write, 0, 0, 0);
        let mut wire = Vec::new();
        put(&mut wire, mode, &empty, 0);
        assert_eq!(session.handle_input(&wire), (size, Some(request(empty, 0))));
        assert_eq!(session.want(), ServerWant::Header(size));
    }
}

/// Read, write, refused write with payload, refused read, flush, exactly-maximum write,
/// disconnect, and a read the session must not reach.
fn mixed_stream(mode: ReplyMode) -> Vec<u8> {
    let mut stream = Vec::new();
    put(&mut stream, mode, &req(Command::Read, 0, 0, 512), 0);
    put(&mut stream, mode, &req(Command::Write, 0, 512, 1536), 1536);
    put(
        &mut stream,
        mode,
        &req(Command::Write, 0, EXPORT_BYTES, 1024),
        1024,
    );
    put(
        &mut stream,
        mode,
        &req(Command::Read, 0, EXPORT_BYTES, 512),
        0,
    );
    put(&mut stream, mode, &req(Command::Flush, 0, 0, 0), 0);
    let max = u64::from(PAYLOAD_MAX);
    put(
        &mut stream,
        mode,
        &req(Command::Write, 0, 0, max),
        PAYLOAD_MAX as usize,
    );
    put(&mut stream, mode, &req(Command::Disc, 0, 0, 0), 0);
    put(&mut stream, mode, &req(Command::Read, 0, 0, 512), 0);
    stream
}

#[test]
fn short_feeds_match_whole_feeds() {
    for mode in MODES {
        let stream = mixed_stream(mode);
        let whole = feed(&mut ServerSession::new(ctx(mode)), &stream, usize::MAX);
        assert_eq!(whole.events.len(), 7, "{mode:?}: {:?}", whole.events);
        assert_eq!(whole.events[6], ServerEvent::End(EndReason::Disconnect));
        assert_eq!(rejected(&whole.events[2]), Some((Errno::NoSpc, 1024)));
        assert_eq!(rejected(&whole.events[3]), Some((Errno::Inval, 0)));
        assert_eq!(whole.payloads.len(), 2);
        assert_eq!(whole.used, stream.len() - mode.request_header_bytes());
        for step in [1, 2, 3, 27, 28, 29, 31, 32, 33, 1000, 4096] {
            let short = feed(&mut ServerSession::new(ctx(mode)), &stream, step);
            assert_eq!(short, whole, "{mode:?} step {step}");
        }
    }
}

#[test]
fn a_header_split_across_feeds_is_kept_by_the_session() {
    for mode in MODES {
        let size = mode.request_header_bytes();
        let read = req(Command::Read, 0, 1024, 2048);
        let mut wire = Vec::new();
        put(&mut wire, mode, &read, 0);
        let mut session = ServerSession::new(ctx(mode));
        for (i, byte) in wire[..size - 1].iter().enumerate() {
            assert_eq!(session.want(), ServerWant::Header(size - i));
            assert_eq!(session.handle_input(std::slice::from_ref(byte)), (1, None));
        }
        assert_eq!(session.handle_input(&[]), (0, None));
        assert_eq!(session.want(), ServerWant::Header(1));
        // More than the header's last byte is offered: only that byte is taken.
        let offered = [wire[size - 1], 0xaa, 0xbb];
        assert_eq!(session.handle_input(&offered), (1, Some(request(read, 0))));
    }
}

#[test]
fn refusals_without_payload_are_reported_at_once() {
    let cases = [
        (
            req(Command::Read, 0, EXPORT_BYTES - 512, 1024),
            Errno::Inval,
        ),
        (req(Command::Trim, 0, EXPORT_BYTES, 512), Errno::Inval),
        (
            req(Command::WriteZeroes, 0, EXPORT_BYTES, 512),
            Errno::NoSpc,
        ),
        (req(Command::Flush, 0, 512, 0), Errno::Inval),
        (req(Command::Read, 0, 100, 512), Errno::Inval),
        (req(Command::BlockStatus, 0, 0, 512), Errno::Inval),
        (req(Command::Read, cf::NO_HOLE, 0, 512), Errno::Inval),
    ];
    for mode in MODES {
        for (header, errno) in cases {
            let mut session = ServerSession::new(ctx(mode));
            let mut wire = Vec::new();
            put(&mut wire, mode, &header, 0);
            let (used, event) = session.handle_input(&wire);
            assert_eq!(used, wire.len());
            assert_eq!(rejected(&event.unwrap()), Some((errno, 0)), "{header:?}");
            assert!(session.is_idle());
        }
    }
}

#[test]
fn a_refused_payload_is_dropped_across_feeds() {
    for mode in MODES {
        let size = mode.request_header_bytes();
        let write = req(Command::Write, 0, EXPORT_BYTES - 1024, 2048);
        let read = req(Command::Read, 0, 0, 512);
        let mut stream = Vec::new();
        put(&mut stream, mode, &write, 2048);
        put(&mut stream, mode, &read, 0);
        let mut session = ServerSession::new(ctx(mode));
        assert_eq!(session.handle_input(&stream), (size, None));
        assert_eq!(session.want(), ServerWant::Discard { remaining: 2048 });
        assert_eq!(session.handle_input(&stream[size..size + 500]), (500, None));
        assert_eq!(session.want(), ServerWant::Discard { remaining: 1548 });
        let (used, event) = session.handle_input(&stream[size + 500..]);
        assert_eq!(used, 1548);
        assert_eq!(rejected(&event.unwrap()), Some((Errno::NoSpc, 2048)));
        let (used, event) = session.handle_input(&stream[size + 2048..]);
        assert_eq!((used, event), (size, Some(request(read, 0))));
    }
    // Extended headers: a payload on a command that takes none is consumed, then refused.
    let mode = ReplyMode::Extended;
    let trim = req(Command::Trim, cf::PAYLOAD_LEN, 0, 512);
    let mut stream = Vec::new();
    put(&mut stream, mode, &trim, 512);
    let fed = feed(&mut ServerSession::new(ctx(mode)), &stream, 7);
    assert_eq!(fed.used, stream.len());
    assert_eq!(rejected(&fed.events[0]), Some((Errno::Inval, 512)));
}
