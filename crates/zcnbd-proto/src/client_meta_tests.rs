//! Metadata contexts beyond `base:allocation` on the client side: the list asked for, the
//! subset a server selects (scripted and against `ServerHandshake`), and block status replies
//! that carry one chunk per selected context, routed by id.

use crate::client_handshake::*;
use crate::client_handshake_tests::*;
use crate::client_meta::{MetaContext, MetaQueries, META_CONTEXTS_SELECTED_MAX};
use crate::client_pair::{Pair, Reads};
use crate::client_session::{ClientSession, ReplyEvent, Request, SessionLimits, Violation, Want};
use crate::consts::{opt, rep};
use crate::cursor::Reader;
use crate::meta::ALLOCATION_DEPTH;
use crate::reply::ReplyTo;
use crate::types::{Command, Extent, ReplyMode};

const BITMAP: &str = "qemu:dirty-bitmap:b0";

fn queries(names: &[&str]) -> MetaQueries {
    MetaQueries::new(names.iter().copied()).expect("valid names")
}

/// A client asking for `names` (and `base:allocation` if `base`) that has agreed on extended
/// headers and sent `NBD_OPT_SET_META_CONTEXT`.
fn at_meta(base: bool, names: &[&str]) -> Script {
    let opts = ClientHandshakeOptions {
        export_name: "disk".into(),
        base_allocation: base,
        option_replies_max: 128,
        ..ClientHandshakeOptions::default()
    };
    let mut s = Script {
        c: ClientHandshake::new(opts).with_meta_contexts(queries(names)),
        sent: Vec::new(),
    };
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ACK, &[]))
        .unwrap();
    s
}

/// The queries of the `NBD_OPT_SET_META_CONTEXT` `s` sent last.
fn sent_queries(s: &Script) -> Vec<String> {
    let (option, data) = s.last_option();
    assert_eq!(option, opt::SET_META_CONTEXT);
    let mut r = Reader::new(&data);
    let export_len = r.u32().unwrap() as usize;
    assert_eq!(r.take(export_len), Some(&b"disk"[..]));
    let count = r.u32().unwrap();
    let names: Vec<String> = (0..count)
        .map(|_| {
            let len = r.u32().unwrap() as usize;
            String::from_utf8(r.take(len).unwrap().to_vec()).unwrap()
        })
        .collect();
    assert!(r.is_empty());
    names
}

fn finish(s: &mut Script) -> ClientNegotiated {
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ACK, &[]))
        .unwrap();
    assert_eq!(s.last_option().0, opt::GO);
    s.feed(&info_export(1 << 20, FLAGS)).unwrap();
    s.feed(&reply(opt::GO, rep::ACK, &[])).unwrap();
    s.negotiated()
}

#[test]
fn every_context_goes_out_and_the_servers_subset_is_kept() {
    let mut s = at_meta(true, &[ALLOCATION_DEPTH, BITMAP]);
    assert_eq!(
        sent_queries(&s),
        ["base:allocation", ALLOCATION_DEPTH, BITMAP]
    );
    // The server has no allocation depth, and answers in an order of its own.
    s.feed(&meta_context(8, BITMAP)).unwrap();
    s.feed(&meta_context(3, "base:allocation")).unwrap();
    let n = finish(&mut s);
    assert_eq!(
        n.meta_contexts,
        [
            MetaContext {
                name: BITMAP.into(),
                id: 8
            },
            MetaContext {
                name: "base:allocation".into(),
                id: 3
            },
        ]
    );
    assert_eq!(n.base_allocation_id, Some(3));
    assert_eq!(n.meta_context_id(BITMAP), Some(8));
    assert_eq!(n.meta_context_id(ALLOCATION_DEPTH), None);
}

#[test]
fn only_the_names_given_are_asked_for() {
    // Without base:allocation, and with it named in the list: it goes out once.
    let mut s = at_meta(false, &[BITMAP]);
    assert_eq!(sent_queries(&s), [BITMAP]);
    let n = finish(&mut s);
    assert!(n.meta_contexts.is_empty());
    assert_eq!(n.base_allocation_id, None);

    let s = at_meta(true, &[BITMAP, "base:allocation"]);
    assert_eq!(sent_queries(&s), [BITMAP, "base:allocation"]);

    // Nothing wanted: no NBD_OPT_SET_META_CONTEXT at all.
    let s = at_meta(false, &[]);
    assert_eq!(s.last_option().0, opt::GO);
}

#[test]
fn an_error_reply_drops_every_context() {
    let mut s = at_meta(true, &[BITMAP]);
    s.feed(&meta_context(1, BITMAP)).unwrap();
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ERR_TOO_BIG, &[]))
        .unwrap();
    s.feed(&info_export(1 << 20, FLAGS)).unwrap();
    s.feed(&reply(opt::GO, rep::ACK, &[])).unwrap();
    assert!(s.negotiated().meta_contexts.is_empty());
}

#[test]
fn selected_contexts_are_bounded() {
    let mut s = at_meta(true, &[]);
    for id in 0..META_CONTEXTS_SELECTED_MAX as u32 {
        s.feed(&meta_context(id, &format!("x:{id}"))).unwrap();
    }
    let result = s.feed(&meta_context(999, "x:one-too-many"));
    let err = E::Malformed("more than 64 metadata contexts selected");
    s.assert_failed(result, err, false);
}

#[test]
fn against_the_server_a_missing_context_is_absent() {
    for reads in [Reads::OneByte, Reads::Random(5), Reads::Whole] {
        let opts = ClientHandshakeOptions::default();
        let mut pair = Pair::new(opts.clone());
        pair.client = ClientHandshake::new(opts).with_meta_contexts(queries(&[
            BITMAP,
            ALLOCATION_DEPTH,
            "qemu:dirty-bitmap:absent",
        ]));
        pair.exports[0].meta_contexts = vec![ALLOCATION_DEPTH.into(), BITMAP.into()];
        pair.run(reads).unwrap();
        let (client, server) = pair.outcomes();
        assert_eq!(server.meta.count(), 3, "{reads:?}");
        let selected: Vec<(u32, usize)> = server.meta.ids().collect();
        assert_eq!(client.meta_contexts.len(), 3);
        for context in &client.meta_contexts {
            let number = match context.name.as_str() {
                "base:allocation" => 0,
                ALLOCATION_DEPTH => 1,
                BITMAP => 2,
                other => panic!("unexpected context {other}"),
            };
            assert!(selected.contains(&(context.id, number)), "{reads:?}");
        }
        assert_eq!(client.meta_context_id("qemu:dirty-bitmap:absent"), None);
    }
}

/// A session with contexts 1 and 5 selected, and one block status request in flight.
fn status_session(mode: ReplyMode) -> (ClientSession, u64) {
    let session = ClientSession::new(mode, Some(1), SessionLimits::default());
    let mut session = session.with_context_ids([1, 5, 1]);
    assert_eq!(session.context_ids(), [1, 5]);
    let request = Request {
        command: Command::BlockStatus,
        flags: 0,
        offset: 0,
        length: 1 << 20,
    };
    let cookie = session.start(request, &mut Vec::new()).unwrap();
    (session, cookie)
}

/// Feeds `wire` in pieces of at most `step` bytes; the events, or the violation.
fn feed(
    session: &mut ClientSession,
    wire: &[u8],
    step: usize,
) -> Result<Vec<ReplyEvent>, Violation> {
    let mut events = Vec::new();
    let mut pos = 0;
    loop {
        match session.want() {
            Want::Payload { bytes: 0, .. } => events.extend(session.payload_received(0)),
            Want::Payload { .. } => panic!("block status has no payload"),
            Want::Header(need) => {
                let n = need.min(step).min(wire.len() - pos);
                if n == 0 {
                    return Ok(events);
                }
                let (used, event) = session.handle_input(&wire[pos..pos + n])?;
                pos += used;
                events.extend(event);
            }
        }
    }
}

fn extents(seed: u32) -> Vec<Extent> {
    vec![
        Extent {
            length: 65536,
            flags: seed,
        },
        Extent {
            length: 1 << 20,
            flags: seed + 1,
        },
    ]
}

/// One reply with a chunk per `(context id, flags seed)`, the last marked done.
fn status_reply(mode: ReplyMode, cookie: u64, chunks: &[(u32, u32)]) -> Vec<u8> {
    let to = ReplyTo {
        mode,
        cookie,
        offset: 0,
    };
    let mut wire = Vec::new();
    for (i, &(id, seed)) in chunks.iter().enumerate() {
        let done = i + 1 == chunks.len();
        to.encode_block_status_chunk(id, &extents(seed), done, &mut wire);
    }
    wire
}

#[test]
fn one_reply_with_a_chunk_per_context_is_routed_by_id() {
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        for step in [1, 5, 4096] {
            let (mut session, cookie) = status_session(mode);
            let wire = status_reply(mode, cookie, &[(5, 10), (1, 0)]);
            let events = feed(&mut session, &wire, step).expect("valid");
            assert_eq!(
                events,
                [
                    ReplyEvent::Extents {
                        cookie,
                        context_id: 5,
                        extents: extents(10),
                    },
                    ReplyEvent::Extents {
                        cookie,
                        context_id: 1,
                        extents: extents(0),
                    },
                    ReplyEvent::Done {
                        cookie,
                        result: Ok(())
                    },
                ],
                "{mode:?} {step}"
            );
        }
    }
}

#[test]
fn unknown_or_repeated_context_ids_are_violations() {
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        let (mut session, cookie) = status_session(mode);
        let wire = status_reply(mode, cookie, &[(5, 0), (7, 0)]);
        assert_eq!(
            feed(&mut session, &wire, 4096),
            Err(Violation::UnknownContext(7))
        );
        let (mut session, cookie) = status_session(mode);
        let wire = status_reply(mode, cookie, &[(5, 0), (5, 0)]);
        assert_eq!(
            feed(&mut session, &wire, 4096),
            Err(Violation::UnknownContext(5))
        );
        // No context selected at all: any block status chunk is unknown.
        let mut session = ClientSession::new(mode, None, SessionLimits::default());
        let request = Request {
            command: Command::BlockStatus,
            flags: 0,
            offset: 0,
            length: 4096,
        };
        let cookie = session.start(request, &mut Vec::new()).unwrap();
        let wire = status_reply(mode, cookie, &[(1, 0)]);
        assert_eq!(
            feed(&mut session, &wire, 4096),
            Err(Violation::UnknownContext(1))
        );
    }
}

#[test]
fn a_reply_missing_a_context_fails_with_eio() {
    let mode = ReplyMode::Extended;
    let (mut session, cookie) = status_session(mode);
    let wire = status_reply(mode, cookie, &[(5, 0)]);
    let events = feed(&mut session, &wire, 4096).expect("no violation");
    let Some(ReplyEvent::Done { result, .. }) = events.last() else {
        panic!("no end: {events:?}");
    };
    let failure = result.clone().expect_err("one context missing");
    assert_eq!(failure.errno, 5);
    assert!(failure.message.contains("1 of 2"), "{failure:?}");
}

#[test]
fn the_session_keeps_at_most_64_contexts_and_tracks_them_all() {
    let mode = ReplyMode::Structured;
    let session = ClientSession::new(mode, None, SessionLimits::default());
    let mut session = session.with_context_ids(0..100);
    assert_eq!(session.context_ids().len(), META_CONTEXTS_SELECTED_MAX);
    let request = Request {
        command: Command::BlockStatus,
        flags: 0,
        offset: 0,
        length: 1 << 20,
    };
    let cookie = session.start(request, &mut Vec::new()).unwrap();
    let chunks: Vec<(u32, u32)> = (0..META_CONTEXTS_SELECTED_MAX as u32)
        .rev()
        .map(|id| (id, id))
        .collect();
    let events = feed(&mut session, &status_reply(mode, cookie, &chunks), 4096).unwrap();
    assert_eq!(events.len(), META_CONTEXTS_SELECTED_MAX + 1);
    assert_eq!(
        events.last(),
        Some(&ReplyEvent::Done {
            cookie,
            result: Ok(())
        })
    );
}
