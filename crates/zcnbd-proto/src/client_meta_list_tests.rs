//! `NBD_OPT_LIST_META_CONTEXT` on the client side: what a listing selects next, a refused
//! listing, and hostile listings (names that cannot be selected, too many names, too many
//! replies, names too long) - each bounded, none growing memory with what the server sends.

use crate::client_handshake::*;
use crate::client_handshake_tests::*;
use crate::client_meta::{MetaQueries, META_CONTEXT_LIST_REPLIES_MAX, META_CONTEXT_QUERIES_MAX};
use crate::client_pair::{Pair, Reads};
use crate::consts::{opt, rep, STRING_BYTES_MAX};
use crate::cursor::Reader;
use crate::meta::ALLOCATION_DEPTH;

const BITMAP: &str = "qemu:dirty-bitmap:b0";

fn queries(names: &[&str]) -> MetaQueries {
    MetaQueries::new(names.iter().copied()).expect("valid names")
}

/// A client naming `named`, listing `listed`, that has agreed on extended headers.
fn at_list(named: &[&str], listed: &[&str]) -> Script {
    let opts = ClientHandshakeOptions {
        export_name: "disk".into(),
        ..ClientHandshakeOptions::default()
    };
    let c = ClientHandshake::new(opts)
        .with_meta_contexts(queries(named))
        .with_meta_list(queries(listed));
    let mut s = Script {
        c,
        sent: Vec::new(),
    };
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ACK, &[]))
        .unwrap();
    s
}

/// The queries of the last option `s` sent, which must be `option`.
fn sent_queries(s: &Script, option: u32) -> Vec<String> {
    let (sent, data) = s.last_option();
    assert_eq!(sent, option);
    let mut r = Reader::new(&data);
    let export_len = r.u32().unwrap() as usize;
    assert_eq!(r.take(export_len), Some(&b"disk"[..]));
    let count = r.u32().unwrap();
    let names = (0..count)
        .map(|_| {
            let len = r.u32().unwrap() as usize;
            String::from_utf8(r.take(len).unwrap().to_vec()).unwrap()
        })
        .collect();
    assert!(r.is_empty());
    names
}

/// One listed context (ids of a listing mean nothing; servers send 0).
fn listed(name: &[u8]) -> Vec<u8> {
    let data = [&0u32.to_be_bytes()[..], name].concat();
    reply(opt::LIST_META_CONTEXT, rep::META_CONTEXT, &data)
}

fn list_ack() -> Vec<u8> {
    reply(opt::LIST_META_CONTEXT, rep::ACK, &[])
}

/// Selects what the last SET asked for (ids from 1) and enters transmission.
fn select_all_and_go(s: &mut Script) -> ClientNegotiated {
    for (i, name) in sent_queries(s, opt::SET_META_CONTEXT).iter().enumerate() {
        s.feed(&meta_context(i as u32 + 1, name)).unwrap();
    }
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ACK, &[]))
        .unwrap();
    s.feed(&info_export(1 << 20, FLAGS)).unwrap();
    s.feed(&reply(opt::GO, rep::ACK, &[])).unwrap();
    s.negotiated()
}

fn names(n: &ClientNegotiated) -> Vec<&str> {
    n.meta_contexts.iter().map(|c| c.name.as_str()).collect()
}

#[test]
fn what_a_listing_finds_is_selected_by_name() {
    let mut s = at_list(&[], &["qemu:", "base:"]);
    assert_eq!(sent_queries(&s, opt::LIST_META_CONTEXT), ["qemu:", "base:"]);
    // As qemu-nbd 10 answers: base:allocation first, then the qemu: namespace.
    for name in [
        "base:allocation",
        ALLOCATION_DEPTH,
        "qemu:dirty-bitmap:b1",
        BITMAP,
    ] {
        s.feed(&listed(name.as_bytes())).unwrap();
    }
    s.feed(&list_ack()).unwrap();
    let expected = [
        "base:allocation",
        ALLOCATION_DEPTH,
        "qemu:dirty-bitmap:b1",
        BITMAP,
    ];
    assert_eq!(sent_queries(&s, opt::SET_META_CONTEXT), expected);
    let n = select_all_and_go(&mut s);
    assert_eq!(names(&n), expected);
    assert_eq!(n.meta_left_out, 0);
    assert_eq!(n.base_allocation_id, Some(1));
}

#[test]
fn named_contexts_come_first_and_nothing_is_asked_twice() {
    let mut s = at_list(&[BITMAP], &["qemu:"]);
    for name in [
        ALLOCATION_DEPTH,
        BITMAP,
        ALLOCATION_DEPTH,
        "base:allocation",
    ] {
        s.feed(&listed(name.as_bytes())).unwrap();
    }
    s.feed(&list_ack()).unwrap();
    assert_eq!(
        sent_queries(&s, opt::SET_META_CONTEXT),
        ["base:allocation", BITMAP, ALLOCATION_DEPTH]
    );
    assert_eq!(select_all_and_go(&mut s).meta_left_out, 0);
}

#[test]
fn a_refused_listing_selects_the_named_contexts_alone() {
    for refusal in [rep::ERR_UNSUP, rep::ERR_INVALID, rep::ERR_POLICY] {
        let mut s = at_list(&[BITMAP], &["qemu:"]);
        // Contexts before an error are disregarded.
        s.feed(&listed(ALLOCATION_DEPTH.as_bytes())).unwrap();
        s.feed(&reply(opt::LIST_META_CONTEXT, refusal, b"no"))
            .unwrap();
        assert_eq!(
            sent_queries(&s, opt::SET_META_CONTEXT),
            ["base:allocation", BITMAP]
        );
        let n = select_all_and_go(&mut s);
        assert_eq!(names(&n), ["base:allocation", BITMAP]);
    }
    // A reply type that makes no sense for a listing ends the handshake.
    let mut s = at_list(&[], &["qemu:"]);
    let result = s.feed(&reply(opt::LIST_META_CONTEXT, rep::SERVER, &[]));
    let err = E::UnexpectedReply {
        option: opt::LIST_META_CONTEXT,
        reply: rep::SERVER,
    };
    s.assert_failed(result, err, false);
}

#[test]
fn without_structured_replies_nothing_is_listed() {
    let opts = ClientHandshakeOptions {
        extended_headers: false,
        structured_replies: false,
        ..ClientHandshakeOptions::default()
    };
    let c = ClientHandshake::new(opts).with_meta_list(queries(&["qemu:"]));
    let mut s = Script {
        c,
        sent: Vec::new(),
    };
    s.feed(&greeting(BOTH)).unwrap();
    assert_eq!(s.last_option().0, opt::GO);
    // Listing alone, without base:allocation, is still a reason to list.
    let opts = ClientHandshakeOptions {
        export_name: "disk".into(),
        base_allocation: false,
        ..ClientHandshakeOptions::default()
    };
    let c = ClientHandshake::new(opts).with_meta_list(queries(&["qemu:"]));
    let mut s = Script {
        c,
        sent: Vec::new(),
    };
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ACK, &[]))
        .unwrap();
    assert_eq!(s.last_option().0, opt::LIST_META_CONTEXT);
    s.feed(&list_ack()).unwrap();
    // Nothing listed, nothing named: an empty selection, which the server answers with ACK.
    assert!(sent_queries(&s, opt::SET_META_CONTEXT).is_empty());
}

#[test]
fn names_that_cannot_be_selected_are_left_out() {
    let mut s = at_list(&[], &["qemu:"]);
    let junk: [&[u8]; 7] = [
        b"qemu:dirty-bitmap:", // a wildcard to list further
        b"qemu:",
        b"no-colon",
        b":leaf",
        b"qemu:bad\0name",
        b"qemu:\xff\xfe",
        b"",
    ];
    for name in junk {
        s.feed(&listed(name)).unwrap();
    }
    s.feed(&listed(BITMAP.as_bytes())).unwrap();
    s.feed(&list_ack()).unwrap();
    assert_eq!(
        sent_queries(&s, opt::SET_META_CONTEXT),
        ["base:allocation", BITMAP]
    );
    assert_eq!(select_all_and_go(&mut s).meta_left_out, junk.len() as u32);
}

#[test]
fn a_listing_keeps_one_selections_worth_and_counts_the_rest() {
    let mut s = at_list(&[ALLOCATION_DEPTH], &["qemu:"]);
    let many = META_CONTEXT_QUERIES_MAX + 9;
    for i in 0..many {
        s.feed(&listed(format!("qemu:dirty-bitmap:{i}").as_bytes()))
            .unwrap();
    }
    // base:allocation does not count against the room, even last.
    s.feed(&listed(b"base:allocation")).unwrap();
    s.feed(&list_ack()).unwrap();
    let asked = sent_queries(&s, opt::SET_META_CONTEXT);
    // base:allocation, the named one, and as many listed as fit beside it.
    assert_eq!(asked.len(), 1 + META_CONTEXT_QUERIES_MAX);
    assert_eq!(asked[..2], ["base:allocation", ALLOCATION_DEPTH]);
    assert_eq!(asked.last().unwrap(), "qemu:dirty-bitmap:30");
    // Selected as asked: within the selection's own bound.
    let n = select_all_and_go(&mut s);
    assert_eq!(n.meta_contexts.len(), asked.len());
    assert_eq!(
        n.meta_left_out,
        (many - (META_CONTEXT_QUERIES_MAX - 1)) as u32
    );
}

#[test]
fn a_listing_that_never_ends_is_refused() {
    let mut s = at_list(&[], &["qemu:"]);
    // Fed whole (one byte at a time would only be slower): every reply is consumed, no
    // name past the room is kept, and reply number META_CONTEXT_LIST_REPLIES_MAX + 1 ends it.
    let mut wire = Vec::new();
    for i in 0..META_CONTEXT_LIST_REPLIES_MAX {
        wire.extend(listed(format!("qemu:dirty-bitmap:{i}").as_bytes()));
    }
    let mut at = 0;
    while at < wire.len() {
        at += s.c.handle_input(&wire[at..]).expect("within the bound");
    }
    let result = s.c.handle_input(&listed(b"qemu:dirty-bitmap:one-more"));
    let err = E::TooManyReplies {
        option: opt::LIST_META_CONTEXT,
        max: META_CONTEXT_LIST_REPLIES_MAX,
    };
    assert_eq!(result, Err(err));
    assert_eq!(s.c.status(), ClientHandshakeStatus::Failed);
}

#[test]
fn a_name_over_the_string_limit_ends_the_handshake() {
    let mut s = at_list(&[], &["qemu:"]);
    let long = format!("qemu:{}", "x".repeat(STRING_BYTES_MAX));
    let result = s.feed(&listed(long.as_bytes()));
    let err = E::Malformed("metadata context name over 4096 bytes");
    s.assert_failed(result, err, false);
    // A reply too long for the receive buffer is refused from its header.
    let mut s = at_list(&[], &["qemu:"]);
    let huge = reply(opt::LIST_META_CONTEXT, rep::META_CONTEXT, &vec![0; 1 << 17]);
    let result = s.feed(&huge[..20]);
    let err = E::ReplyTooLong {
        option: opt::LIST_META_CONTEXT,
        len: 1 << 17,
        max: 64 * 1024,
    };
    s.assert_failed(result, err, false);
    // A listed context shorter than its id.
    let mut s = at_list(&[], &["qemu:"]);
    let result = s.feed(&reply(opt::LIST_META_CONTEXT, rep::META_CONTEXT, &[0, 0]));
    let err = E::Malformed("NBD_REP_META_CONTEXT shorter than its id");
    s.assert_failed(result, err, false);
}

#[test]
fn against_the_server_a_namespace_lists_and_selects_every_context() {
    for reads in [Reads::OneByte, Reads::Random(7), Reads::Whole] {
        let opts = ClientHandshakeOptions::default();
        let mut pair = Pair::new(opts.clone());
        pair.client = ClientHandshake::new(opts).with_meta_list(queries(&["qemu:", "base:"]));
        pair.exports[0].meta_contexts = vec![ALLOCATION_DEPTH.into(), BITMAP.into()];
        pair.run(reads).unwrap();
        let (client, server) = pair.outcomes();
        assert_eq!(server.meta.count(), 3, "{reads:?}");
        let mut selected = names(&client);
        selected.sort();
        assert_eq!(selected, ["base:allocation", ALLOCATION_DEPTH, BITMAP]);
        assert_eq!(client.meta_left_out, 0);
    }
}
