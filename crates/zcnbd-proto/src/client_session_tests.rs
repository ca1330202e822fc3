//! The client session fed replies made by the server's own encoders, byte by byte and whole.

use std::collections::HashMap;

use crate::client_session::{
    ClientSession, ReplyEvent, ReplyFailure, Request, SessionError, SessionLimits, Violation, Want,
};
use crate::consts::{chunk, cmd_flags, reply_flags, EXTENDED_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC};
use crate::cursor::PutBe;
use crate::reply::ReplyTo;
use crate::types::{Command, Errno, Extent, ReplyMode};

/// A test I/O layer: one buffer per cookie, payload copied in as a socket read would.
struct Driver {
    session: ClientSession,
    buffers: HashMap<u64, Vec<u8>>,
    requests: HashMap<u64, Request>,
    events: Vec<ReplyEvent>,
}

impl Driver {
    fn new(mode: ReplyMode) -> Self {
        Driver {
            session: ClientSession::new(mode, Some(1), SessionLimits::default()),
            buffers: HashMap::new(),
            requests: HashMap::new(),
            events: Vec::new(),
        }
    }

    fn start(&mut self, command: Command, flags: u16, offset: u64, length: u64) -> u64 {
        let request = Request {
            command,
            flags,
            offset,
            length,
        };
        let mut wire = Vec::new();
        let cookie = self.session.start(request, &mut wire).expect("room");
        assert_eq!(wire.len(), self.session.mode().request_header_bytes());
        self.buffers.insert(cookie, vec![0xee; length as usize]);
        self.requests.insert(cookie, request);
        cookie
    }

    fn reply_to(&self, cookie: u64) -> ReplyTo {
        ReplyTo {
            mode: self.session.mode(),
            cookie,
            offset: self.requests[&cookie].offset,
        }
    }

    /// Feeds `stream` in pieces of at most `step` bytes; stops at its end.
    fn feed(&mut self, stream: &[u8], step: usize) -> Result<(), Violation> {
        let mut pos = 0;
        loop {
            let left = stream.len() - pos;
            match self.session.want() {
                Want::Payload { bytes: 0, .. } => {
                    let event = self.session.payload_received(0);
                    self.events.extend(event);
                }
                Want::Payload { cookie, at, bytes } => {
                    let n = (bytes as usize).min(step).min(left);
                    if n == 0 {
                        return Ok(());
                    }
                    let buf = self.buffers.get_mut(&cookie).expect("known cookie");
                    buf[at as usize..at as usize + n].copy_from_slice(&stream[pos..pos + n]);
                    pos += n;
                    let event = self.session.payload_received(n as u64);
                    self.events.extend(event);
                }
                Want::Header(need) => {
                    let n = need.min(step).min(left);
                    if n == 0 {
                        return Ok(());
                    }
                    let (used, event) = self.session.handle_input(&stream[pos..pos + n])?;
                    assert!(used > 0 && used <= n);
                    pos += used;
                    if let Some(ReplyEvent::Hole { cookie, at, bytes }) = &event {
                        let buf = self.buffers.get_mut(cookie).expect("known cookie");
                        buf[*at as usize..(*at + *bytes) as usize].fill(0);
                    }
                    self.events.extend(event);
                }
            }
        }
    }

    fn done(&self, cookie: u64) -> Option<&Result<(), ReplyFailure>> {
        self.events.iter().find_map(|e| match e {
            ReplyEvent::Done { cookie: c, result } if *c == cookie => Some(result),
            _ => None,
        })
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

const MODES: [ReplyMode; 3] = [
    ReplyMode::Simple,
    ReplyMode::Structured,
    ReplyMode::Extended,
];

#[test]
fn reads_and_writes_complete_in_every_mode_and_step() {
    for mode in MODES {
        for step in [1, 3, 7, 4096] {
            let mut d = Driver::new(mode);
            let read = d.start(Command::Read, 0, 4096, 1000);
            let write = d.start(Command::Write, cmd_flags::FUA, 0, 512);
            let data = pattern(1000, 3);
            let mut wire = Vec::new();
            // The write is answered first: replies come in any order.
            d.reply_to(write).encode_ok(&mut wire);
            d.reply_to(read)
                .encode_data_header(4096, 1000, true, &mut wire);
            wire.extend_from_slice(&data);
            d.feed(&wire, step).expect("valid replies");
            assert_eq!(d.done(write), Some(&Ok(())), "{mode:?} step {step}");
            assert_eq!(d.done(read), Some(&Ok(())), "{mode:?} step {step}");
            assert_eq!(d.buffers[&read], data);
            assert!(d.session.is_idle());
            assert_eq!(d.session.in_flight(), 0);
        }
    }
}

#[test]
fn structured_read_of_chunks_out_of_order_with_holes() {
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        for step in [1, 5, 1 << 20] {
            let mut d = Driver::new(mode);
            let read = d.start(Command::Read, 0, 8192, 3000);
            let other = d.start(Command::Read, 0, 0, 10);
            let to = d.reply_to(read);
            let mut wire = Vec::new();
            let tail = pattern(1000, 9);
            let head = pattern(1000, 1);
            to.encode_data_header(8192 + 2000, 1000, false, &mut wire);
            wire.extend_from_slice(&tail);
            // Another request's reply in between.
            d.reply_to(other).encode_data_header(0, 10, true, &mut wire);
            wire.extend_from_slice(&[5; 10]);
            to.encode_hole(8192 + 1000, 1000, false, &mut wire);
            to.encode_data_header(8192, 1000, false, &mut wire);
            wire.extend_from_slice(&head);
            to.encode_ok(&mut wire);
            d.feed(&wire, step).expect("valid");
            assert_eq!(d.done(read), Some(&Ok(())));
            assert_eq!(d.done(other), Some(&Ok(())));
            let buf = &d.buffers[&read];
            assert_eq!(&buf[..1000], &head[..]);
            assert!(buf[1000..2000].iter().all(|&b| b == 0));
            assert_eq!(&buf[2000..], &tail[..]);
            assert_eq!(d.buffers[&other], vec![5; 10]);
        }
    }
}

#[test]
fn a_final_hole_ends_the_reply() {
    let mut d = Driver::new(ReplyMode::Structured);
    let read = d.start(Command::Read, 0, 0, 4096);
    let mut wire = Vec::new();
    d.reply_to(read).encode_hole(0, 4096, true, &mut wire);
    d.feed(&wire, 100).expect("valid");
    assert_eq!(d.done(read), Some(&Ok(())));
    assert!(d.buffers[&read].iter().all(|&b| b == 0));
}

#[test]
fn error_chunks_and_simple_errors_fail_only_their_request() {
    for mode in MODES {
        let mut d = Driver::new(mode);
        let bad = d.start(Command::Write, 0, 0, 10);
        let good = d.start(Command::Flush, 0, 0, 0);
        let mut wire = Vec::new();
        d.reply_to(bad)
            .encode_error(Errno::NoSpc, "disk full", &mut wire);
        d.reply_to(good).encode_ok(&mut wire);
        d.feed(&wire, 2).expect("valid");
        let Some(Err(failure)) = d.done(bad) else {
            panic!("no failure in {mode:?}");
        };
        assert_eq!(failure.errno, 28);
        if mode != ReplyMode::Simple {
            assert_eq!(failure.message, "disk full");
        }
        assert_eq!(d.done(good), Some(&Ok(())));
    }
}

#[test]
fn a_read_that_is_not_covered_fails_with_eio() {
    let mut d = Driver::new(ReplyMode::Structured);
    let read = d.start(Command::Read, 0, 0, 100);
    let to = d.reply_to(read);
    let mut wire = Vec::new();
    to.encode_data_header(0, 50, false, &mut wire);
    wire.extend_from_slice(&[1; 50]);
    to.encode_ok(&mut wire);
    d.feed(&wire, 4096).expect("well formed");
    let Some(Err(failure)) = d.done(read) else {
        panic!("short read accepted");
    };
    assert_eq!(failure.errno, 5);
}

#[test]
fn block_status_compact_and_extended() {
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        let mut d = Driver::new(mode);
        let status = d.start(Command::BlockStatus, 0, 0, 1 << 20);
        let extents = [
            Extent {
                length: 4096,
                flags: 0,
            },
            Extent {
                length: 1 << 20,
                flags: 3,
            },
        ];
        let mut wire = Vec::new();
        d.reply_to(status)
            .encode_block_status(1, &extents, &mut wire);
        d.feed(&wire, 3).expect("valid");
        assert!(d.events.contains(&ReplyEvent::Extents {
            cookie: status,
            context_id: 1,
            extents: extents.to_vec(),
        }));
        assert_eq!(d.done(status), Some(&Ok(())));
    }
}

/// Feeds `wire` after starting one request of `command`, and returns the violation.
fn violation_of(
    mode: ReplyMode,
    command: Command,
    flags: u16,
    wire: impl Fn(u64) -> Vec<u8>,
) -> Violation {
    let mut d = Driver::new(mode);
    let cookie = d.start(command, flags, 4096, 4096);
    d.feed(&wire(cookie), 4096).expect_err("violation expected")
}

fn structured_chunk(cookie: u64, flags: u16, kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.put_u32(STRUCTURED_REPLY_MAGIC);
    out.put_u16(flags);
    out.put_u16(kind);
    out.put_u64(cookie);
    out.put_u32(payload.len() as u32);
    out.extend_from_slice(payload);
    out
}

fn to(mode: ReplyMode, cookie: u64) -> ReplyTo {
    ReplyTo {
        mode,
        cookie,
        offset: 4096,
    }
}

#[test]
fn violations_end_the_connection() {
    let s = ReplyMode::Structured;
    let unknown = violation_of(s, Command::Flush, 0, |c| {
        let mut w = Vec::new();
        to(s, c ^ 1).encode_ok(&mut w);
        w
    });
    assert!(matches!(unknown, Violation::UnknownCookie(_)));

    let simple_read = violation_of(s, Command::Read, 0, |c| {
        let mut w = Vec::new();
        to(ReplyMode::Simple, c).encode_ok(&mut w);
        w
    });
    assert!(matches!(simple_read, Violation::SimpleReply(_)));

    let outside = violation_of(s, Command::Read, 0, |c| {
        let mut w = Vec::new();
        to(s, c).encode_data_header(8000, 1000, true, &mut w);
        w
    });
    assert!(matches!(outside, Violation::OutOfRange { .. }));

    let overlap = violation_of(s, Command::Read, 0, |c| {
        let mut w = Vec::new();
        to(s, c).encode_hole(4096, 100, false, &mut w);
        to(s, c).encode_hole(4096 + 99, 100, false, &mut w);
        w
    });
    assert!(matches!(overlap, Violation::Overlap { .. }));

    let data_for_write = violation_of(s, Command::Write, 0, |c| {
        let mut w = Vec::new();
        to(s, c).encode_data_header(4096, 10, true, &mut w);
        w
    });
    assert!(matches!(data_for_write, Violation::UnexpectedChunk { .. }));

    let none_not_done = violation_of(s, Command::Flush, 0, |c| {
        structured_chunk(c, 0, chunk::NONE, &[])
    });
    assert!(matches!(none_not_done, Violation::BadChunk { .. }));

    let unknown_type = violation_of(s, Command::Flush, 0, |c| {
        structured_chunk(c, reply_flags::DONE, 77, &[0; 4])
    });
    assert!(matches!(unknown_type, Violation::UnexpectedChunk { .. }));

    let message_too_long = violation_of(s, Command::Flush, 0, |c| {
        let mut p = Vec::new();
        p.put_u32(5);
        p.put_u16(100);
        p.extend_from_slice(b"short");
        structured_chunk(c, reply_flags::DONE, chunk::ERROR, &p)
    });
    assert!(matches!(message_too_long, Violation::BadChunk { .. }));

    let wrong_context = violation_of(s, Command::BlockStatus, 0, |c| {
        let mut w = Vec::new();
        let e = [Extent {
            length: 4096,
            flags: 0,
        }];
        to(s, c).encode_block_status(9, &e, &mut w);
        w
    });
    assert!(matches!(wrong_context, Violation::UnknownContext(9)));

    let two_for_req_one = violation_of(s, Command::BlockStatus, cmd_flags::REQ_ONE, |c| {
        let mut w = Vec::new();
        let e = [
            Extent {
                length: 1,
                flags: 0,
            },
            Extent {
                length: 1,
                flags: 0,
            },
        ];
        to(s, c).encode_block_status(1, &e, &mut w);
        w
    });
    assert!(matches!(two_for_req_one, Violation::BadChunk { .. }));

    let bad_magic = violation_of(ReplyMode::Extended, Command::Flush, 0, |c| {
        let mut w = Vec::new();
        to(s, c).encode_ok(&mut w);
        w.extend_from_slice(&[0; 16]);
        w
    });
    assert!(matches!(bad_magic, Violation::Header(_)));

    let wrong_offset = violation_of(ReplyMode::Extended, Command::Flush, 0, |c| {
        let mut w = Vec::new();
        w.put_u32(EXTENDED_REPLY_MAGIC);
        w.put_u16(reply_flags::DONE);
        w.put_u16(chunk::NONE);
        w.put_u64(c);
        w.put_u64(1);
        w.put_u64(0);
        w
    });
    assert!(matches!(wrong_offset, Violation::OffsetMismatch { .. }));
}

#[test]
fn error_offset_chunks_are_checked_and_reported() {
    let s = ReplyMode::Structured;
    let mut d = Driver::new(s);
    let read = d.start(Command::Read, 0, 4096, 4096);
    let mut p = Vec::new();
    p.put_u32(5);
    p.put_u16(3);
    p.extend_from_slice(b"bad");
    p.put_u64(4096 + 512);
    let wire = structured_chunk(read, reply_flags::DONE, chunk::ERROR_OFFSET, &p);
    d.feed(&wire, 1).expect("valid");
    let Some(Err(failure)) = d.done(read) else {
        panic!("error chunk lost");
    };
    assert_eq!(failure.offset, Some(4096 + 512));
    assert_eq!(failure.message, "bad");

    let outside = violation_of(s, Command::Read, 0, |c| {
        let mut p = Vec::new();
        p.put_u32(5);
        p.put_u16(0);
        p.put_u64(1);
        structured_chunk(c, reply_flags::DONE, chunk::ERROR_OFFSET, &p)
    });
    assert!(matches!(outside, Violation::OutOfRange { .. }));
}

#[test]
fn cookies_are_bounded_and_never_reused_at_once() {
    let limits = SessionLimits {
        requests_in_flight_max: 2,
        ..SessionLimits::default()
    };
    let mut session = ClientSession::new(ReplyMode::Simple, None, limits);
    let req = Request {
        command: Command::Flush,
        flags: 0,
        offset: 0,
        length: 0,
    };
    let mut wire = Vec::new();
    let a = session.start(req, &mut wire).expect("room");
    let b = session.start(req, &mut wire).expect("room");
    assert_eq!(session.start(req, &mut wire), Err(SessionError::Full(2)));
    let mut reply = Vec::new();
    to(ReplyMode::Simple, a).encode_ok(&mut reply);
    let (_, event) = session.handle_input(&reply).expect("valid");
    assert!(matches!(event, Some(ReplyEvent::Done { cookie, .. }) if cookie == a));
    let c = session.start(req, &mut wire).expect("room again");
    assert!(c != a && c != b, "a reused slot gets a new cookie");
    // The old cookie is now unknown.
    let mut stale = Vec::new();
    to(ReplyMode::Simple, a).encode_ok(&mut stale);
    assert!(matches!(
        session.handle_input(&stale),
        Err(Violation::UnknownCookie(_))
    ));
    let mut drained = session.drain();
    drained.sort_unstable();
    let mut expected = vec![b, c];
    expected.sort_unstable();
    assert_eq!(drained, expected);
}

#[test]
fn compact_requests_refuse_long_lengths() {
    let mut session = ClientSession::new(ReplyMode::Structured, None, SessionLimits::default());
    let req = Request {
        command: Command::Trim,
        flags: 0,
        offset: 0,
        length: 1 << 32,
    };
    assert!(matches!(
        session.start(req, &mut Vec::new()),
        Err(SessionError::LengthTooLarge(_))
    ));
}

#[test]
fn random_replies_never_panic() {
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..3000 {
        let mode = MODES[round % 3];
        let mut d = Driver::new(mode);
        let cookies: Vec<u64> = (0..3)
            .map(|i| {
                d.start(
                    [Command::Read, Command::BlockStatus, Command::Write][i],
                    0,
                    0,
                    64,
                )
            })
            .collect();
        // Valid-looking headers with random fields, then random bytes.
        let mut wire = Vec::new();
        for _ in 0..4 {
            let r = next();
            let cookie = cookies[(r % 3) as usize];
            let kind =
                [0u16, 1, 2, 5, 6, chunk::ERROR, chunk::ERROR_OFFSET, 3][(r >> 8) as usize % 8];
            match mode {
                ReplyMode::Extended => {
                    wire.put_u32(EXTENDED_REPLY_MAGIC);
                    wire.put_u16((r >> 16) as u16 & 1);
                    wire.put_u16(kind);
                    wire.put_u64(cookie);
                    wire.put_u64(0);
                    wire.put_u64((r >> 24) % 80);
                }
                _ => {
                    let chunk = structured_chunk(cookie, (r >> 16) as u16 & 1, kind, &[]);
                    wire.extend_from_slice(&chunk[..16]);
                    wire.put_u32(((r >> 24) % 80) as u32);
                }
            }
            for _ in 0..(r >> 40) % 40 {
                wire.push(next() as u8);
            }
        }
        let _ = d.feed(&wire, 1 + (next() % 50) as usize);
    }
}

#[test]
fn reads_sized_by_the_hint_never_reach_into_read_data() {
    for mode in MODES {
        let mut d = Driver::new(mode);
        let read = d.start(Command::Read, 0, 0, 8192);
        let flush = d.start(Command::Flush, 0, 0, 0);
        let status = d.start(Command::BlockStatus, 0, 0, 4096);
        let mut wire = Vec::new();
        d.reply_to(flush).encode_ok(&mut wire);
        if mode != ReplyMode::Simple {
            let e = [Extent {
                length: 4096,
                flags: 0,
            }];
            d.reply_to(status).encode_block_status(1, &e, &mut wire);
            d.reply_to(read).encode_hole(4096, 4096, false, &mut wire);
            d.reply_to(read)
                .encode_data_header(0, 4096, true, &mut wire);
        } else {
            d.session.abandon(status);
            d.reply_to(read)
                .encode_data_header(0, 8192, true, &mut wire);
        }
        let data_at = wire.len();
        wire.extend_from_slice(&pattern(
            if mode == ReplyMode::Simple {
                8192
            } else {
                4096
            },
            1,
        ));
        // Read header bytes only as far as the hint allows; every byte read that way must
        // be consumed as header, never left over for the payload.
        let mut pos = 0;
        while pos < data_at {
            if let Want::Payload { bytes: 0, .. } = d.session.want() {
                let event = d.session.payload_received(0);
                d.events.extend(event);
                continue;
            }
            let hint = d.session.header_read_hint();
            assert!(hint > 0, "{mode:?}: the session wants payload at {pos}");
            let end = (pos + hint).min(wire.len());
            assert!(end <= data_at, "{mode:?}: the hint reaches into read data");
            let mut at = pos;
            while at < end {
                if let Want::Payload { bytes: 0, .. } = d.session.want() {
                    let event = d.session.payload_received(0);
                    d.events.extend(event);
                }
                let (used, event) = d.session.handle_input(&wire[at..end]).expect("valid");
                assert!(used > 0, "{mode:?}: bytes left over inside a header read");
                at += used;
                d.events.extend(event);
            }
            pos = end;
        }
        assert!(matches!(d.session.want(), Want::Payload { cookie, .. } if cookie == read));
        d.feed(&wire[data_at..], 1 << 20).expect("payload");
        assert_eq!(d.done(read), Some(&Ok(())), "{mode:?}");
        assert_eq!(d.done(flush), Some(&Ok(())));
    }
}
