//! How the server session's request stream ends: a payload over the maximum or a bad magic
//! (hard), `NBD_CMD_DISC` (soft), or a hang-up that cuts a request short.

use crate::consts::cmd_flags as cf;
use crate::consts::{EXTENDED_REQUEST_MAGIC, REQUEST_MAGIC};
use crate::server_session::{CutShort, EndReason, ServerEvent, ServerSession, ServerWant};
use crate::server_session_tests::{ctx, feed, put, req, request, EXPORT_BYTES, MODES, PAYLOAD_MAX};
use crate::types::{Command, ReplyMode};

#[test]
fn a_payload_over_the_maximum_ends_hard() {
    for mode in MODES {
        let max = u64::from(PAYLOAD_MAX);
        let mut stream = Vec::new();
        put(&mut stream, mode, &req(Command::Write, 0, 0, max + 512), 0);
        let mut session = ServerSession::new(ctx(mode));
        let (used, event) = session.handle_input(&stream);
        let reason = EndReason::PayloadTooLarge {
            payload: max + 512,
            max: PAYLOAD_MAX,
        };
        assert_eq!(
            (used, event),
            (stream.len(), Some(ServerEvent::End(reason)))
        );
        assert!(reason.is_violation() && session.is_ended());
        assert_eq!(session.want(), ServerWant::Ended);
        assert_eq!(session.handle_input(&stream), (0, None));
        assert_eq!(session.close(), None);
    }
    // A 64-bit payload length never reaches an allocation or a cast.
    let mode = ReplyMode::Extended;
    let mut wire = Vec::new();
    put(
        &mut wire,
        mode,
        &req(Command::Read, cf::PAYLOAD_LEN, 0, u64::MAX),
        0,
    );
    let event = ServerSession::new(ctx(mode)).handle_input(&wire).1;
    let reason = EndReason::PayloadTooLarge {
        payload: u64::MAX,
        max: PAYLOAD_MAX,
    };
    assert_eq!(event, Some(ServerEvent::End(reason)));
}

#[test]
fn a_bad_magic_ends_hard() {
    let read = req(Command::Read, 0, 0, 512);
    for (mode, other, magic) in [
        (
            ReplyMode::Simple,
            ReplyMode::Extended,
            EXTENDED_REQUEST_MAGIC,
        ),
        (
            ReplyMode::Structured,
            ReplyMode::Extended,
            EXTENDED_REQUEST_MAGIC,
        ),
        (ReplyMode::Extended, ReplyMode::Structured, REQUEST_MAGIC),
    ] {
        let mut wire = Vec::new();
        put(&mut wire, other, &read, 0);
        put(&mut wire, other, &read, 0);
        let mut session = ServerSession::new(ctx(mode));
        let fed = feed(&mut session, &wire, 5);
        let end = ServerEvent::End(EndReason::BadMagic(magic));
        assert_eq!(fed.events, [end], "{mode:?}");
        assert_eq!(fed.used, mode.request_header_bytes());
        assert!(session.is_ended());
    }
    let text = EndReason::BadMagic(0x1234_5678).to_string();
    assert!(text.contains("0x12345678"), "{text}");
}

#[test]
fn disconnect_ends_cleanly_and_reads_no_further() {
    for mode in MODES {
        let read = req(Command::Read, 0, 0, 512);
        let mut stream = Vec::new();
        put(&mut stream, mode, &read, 0);
        put(&mut stream, mode, &req(Command::Disc, 0, 0, 0), 0);
        put(&mut stream, mode, &read, 0);
        let mut session = ServerSession::new(ctx(mode));
        let fed = feed(&mut session, &stream, usize::MAX);
        let end = ServerEvent::End(EndReason::Disconnect);
        assert_eq!(fed.events, [request(read, 0), end]);
        assert_eq!(fed.used, 2 * mode.request_header_bytes());
        assert!(!EndReason::Disconnect.is_violation());
        assert_eq!(session.close(), None);
    }
}

#[test]
fn close_reports_what_was_cut_short() {
    for mode in MODES {
        let size = mode.request_header_bytes();
        let mut session = ServerSession::new(ctx(mode));
        assert_eq!(session.close(), None);
        assert_eq!((session.want(), session.close()), (ServerWant::Ended, None));

        let write = req(Command::Write, 0, 0, 4096);
        let mut wire = Vec::new();
        put(&mut wire, mode, &write, 0);
        let mut session = ServerSession::new(ctx(mode));
        assert_eq!(session.handle_input(&wire[..10]), (10, None));
        assert_eq!(session.close(), Some(CutShort::Header { received: 10 }));
        assert!(session.is_ended() && session.close().is_none());

        let mut session = ServerSession::new(ctx(mode));
        assert_eq!(
            session.handle_input(&wire),
            (size, Some(request(write, 4096)))
        );
        assert!(!session.payload_received(100));
        let cut = session.close().unwrap();
        let payload = CutShort::Payload {
            header: write,
            received: 100,
            payload_bytes: 4096,
        };
        assert_eq!((cut, cut.cookie()), (payload, Some(write.cookie)));
        assert!(!session.payload_received(0));

        let refused = req(Command::Write, 0, EXPORT_BYTES, 4096);
        let mut wire = Vec::new();
        put(&mut wire, mode, &refused, 300);
        let mut session = ServerSession::new(ctx(mode));
        assert_eq!(feed(&mut session, &wire, 64).events, []);
        let discard = CutShort::Discard {
            header: refused,
            remaining: 3796,
        };
        assert_eq!(session.close(), Some(discard));
    }
}
