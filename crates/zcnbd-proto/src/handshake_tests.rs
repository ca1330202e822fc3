//! The server handshake driven byte by byte, as a client would, with no socket.

use crate::consts::{client_flags, info, opt, rep, transmission_flags as tf, IHAVEOPT};
use crate::cursor::PutBe;
use crate::handshake::*;
use crate::handshake_harness::*;
use crate::meta::MetaSelected;
use crate::types::ReplyMode;

#[test]
fn unknown_client_flags_close() {
    let mut hs = ServerHandshake::new(HandshakeLimits::default());
    assert_eq!(
        hs.handle_input(&[0, 0, 0, 4], &exports()),
        Err(HandshakeError::UnknownClientFlags(4))
    );
}

#[test]
fn go_with_all_info_enters_transmission() {
    let mut h = Harness::new(FIXED);
    h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
    h.option(
        opt::SET_META_CONTEXT,
        &meta_request("", &["base:allocation"]),
    )
    .unwrap();
    h.option(
        opt::GO,
        &info_request("", &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE]),
    )
    .unwrap();
    let replies = h.replies();
    let kinds: Vec<u32> = replies.iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [
            rep::ACK,
            rep::META_CONTEXT,
            rep::ACK,
            rep::INFO,
            rep::INFO,
            rep::INFO,
            rep::INFO,
            rep::ACK
        ]
    );
    assert_eq!(
        replies[1].data,
        [&1u32.to_be_bytes()[..], b"base:allocation"].concat()
    );
    let mut export = Vec::new();
    export.put_u16(info::EXPORT);
    export.put_u64(1 << 30);
    export.put_u16(tf::HAS_FLAGS | tf::SEND_FLUSH);
    assert_eq!(replies[3].data, export);
    assert_eq!(
        replies[5].data,
        [&info::DESCRIPTION.to_be_bytes()[..], b"default disk"].concat()
    );
    assert_eq!(&replies[6].data[..2], &info::BLOCK_SIZE.to_be_bytes());
    assert_eq!(
        h.hs.status(),
        HandshakeStatus::Done(Negotiated {
            export: 0,
            mode: ReplyMode::Structured,
            meta: MetaSelected::BASE_ALLOCATION,
            block_size_requested: true,
            flags: tf::HAS_FLAGS | tf::SEND_FLUSH,
            tls: false,
        })
    );
    assert_eq!(
        h.hs.handle_input(&[0; 28], &h.exports),
        Err(HandshakeError::Finished)
    );
}

#[test]
fn meta_context_for_another_export_is_not_active() {
    let mut h = Harness::new(FIXED);
    h.option(opt::EXTENDED_HEADERS, &[]).unwrap();
    h.option(
        opt::SET_META_CONTEXT,
        &meta_request("ro", &["base:allocation"]),
    )
    .unwrap();
    h.option(opt::GO, &info_request("", &[])).unwrap();
    let HandshakeStatus::Done(n) = h.hs.status() else {
        panic!("not done")
    };
    assert_eq!(
        (n.mode, n.meta, n.block_size_requested),
        (ReplyMode::Extended, MetaSelected::NONE, false)
    );
}

#[test]
fn info_unknown_export_and_malformed_data_keep_negotiating() {
    let mut h = Harness::new(FIXED);
    h.option(opt::INFO, &info_request("nope", &[])).unwrap();
    h.option(opt::GO, &[0, 0, 0, 9, b'x']).unwrap();
    h.option(opt::INFO, &info_request("ro", &[])).unwrap();
    let kinds: Vec<u32> = h.replies().iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [
            rep::ERR_UNKNOWN,
            rep::ERR_INVALID,
            rep::INFO,
            rep::INFO,
            rep::ACK
        ]
    );
    assert_eq!(h.hs.status(), HandshakeStatus::Negotiating);
}

#[test]
fn unknown_option_starttls_and_bad_lengths_are_refused() {
    let mut h = Harness::new(FIXED);
    h.option(999, b"whatever").unwrap();
    h.option(opt::STARTTLS, &[]).unwrap();
    h.option(opt::LIST, b"x").unwrap();
    h.option(opt::STRUCTURED_REPLY, b"x").unwrap();
    h.option(opt::EXTENDED_HEADERS, b"x").unwrap();
    h.option(
        opt::SET_META_CONTEXT,
        &meta_request("", &["base:allocation"]),
    )
    .unwrap();
    let got: Vec<(u32, u32)> = h.replies().iter().map(|r| (r.option, r.kind)).collect();
    assert_eq!(
        got,
        [
            (999, rep::ERR_UNSUP),
            (opt::STARTTLS, rep::ERR_UNSUP),
            (opt::LIST, rep::ERR_INVALID),
            (opt::STRUCTURED_REPLY, rep::ERR_INVALID),
            (opt::EXTENDED_HEADERS, rep::ERR_INVALID),
            (opt::SET_META_CONTEXT, rep::ERR_INVALID),
        ]
    );
}

#[test]
fn list_exports_then_abort() {
    let mut h = Harness::new(FIXED);
    h.option(opt::LIST, &[]).unwrap();
    h.option(opt::ABORT, &[]).unwrap();
    let replies = h.replies();
    assert_eq!(replies[0].kind, rep::SERVER);
    assert_eq!(
        replies[0].data,
        [&0u32.to_be_bytes()[..], b"default disk"].concat()
    );
    assert_eq!(replies[1].data, [&2u32.to_be_bytes()[..], b"ro"].concat());
    assert_eq!((replies[2].kind, replies[3].kind), (rep::ACK, rep::ACK));
    assert_eq!(h.hs.status(), HandshakeStatus::Aborted);
}

#[test]
fn list_meta_context_wildcards() {
    let mut h = Harness::new(FIXED);
    h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
    h.option(opt::LIST_META_CONTEXT, &meta_request("", &[]))
        .unwrap();
    h.option(opt::LIST_META_CONTEXT, &meta_request("", &["base:"]))
        .unwrap();
    h.option(
        opt::LIST_META_CONTEXT,
        &meta_request("", &["qemu:dirty-bitmap:x"]),
    )
    .unwrap();
    h.option(opt::LIST_META_CONTEXT, &meta_request("missing", &[]))
        .unwrap();
    let kinds: Vec<u32> = h.replies().iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [
            rep::ACK,
            rep::META_CONTEXT,
            rep::ACK,
            rep::META_CONTEXT,
            rep::ACK,
            rep::ACK,
            rep::ERR_UNKNOWN
        ]
    );
}

#[test]
fn export_contexts_are_listed_and_selected_with_their_own_ids() {
    let mut h = Harness::new(FIXED);
    h.exports[0].meta_contexts = vec![crate::meta::ALLOCATION_DEPTH.to_owned()];
    h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
    h.option(opt::LIST_META_CONTEXT, &meta_request("", &["qemu:"]))
        .unwrap();
    h.option(
        opt::SET_META_CONTEXT,
        &meta_request("", &["qemu:allocation-depth", "base:allocation", "qemu:"]),
    )
    .unwrap();
    h.option(opt::GO, &info_request("", &[])).unwrap();
    let replies = h.replies();
    // LIST: the one qemu: context, id 0; SET: both, with the ids block status will carry,
    // in the export's order; the namespace-only query selects nothing.
    assert_eq!(
        replies[1].data,
        [&0u32.to_be_bytes()[..], b"qemu:allocation-depth"].concat()
    );
    assert_eq!(replies[2].kind, rep::ACK);
    assert_eq!(
        replies[3].data,
        [&1u32.to_be_bytes()[..], b"base:allocation"].concat()
    );
    assert_eq!(
        replies[4].data,
        [&2u32.to_be_bytes()[..], b"qemu:allocation-depth"].concat()
    );
    assert_eq!(replies[5].kind, rep::ACK);
    let HandshakeStatus::Done(n) = h.hs.status() else {
        panic!("not done")
    };
    assert_eq!(n.meta.ids().collect::<Vec<_>>(), [(1, 0), (2, 1)]);
}

#[test]
fn structured_after_extended_is_refused() {
    let mut h = Harness::new(FIXED);
    h.option(opt::EXTENDED_HEADERS, &[]).unwrap();
    h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
    let kinds: Vec<u32> = h.replies().iter().map(|r| r.kind).collect();
    assert_eq!(kinds, [rep::ACK, rep::ERR_EXT_HEADER_REQD]);
    assert_eq!(
        h.option(opt::EXPORT_NAME, &[]),
        Err(HandshakeError::ExportNameWithExtendedHeaders)
    );
}

#[test]
fn admission_refuses_go_with_policy_and_export_name_with_a_close() {
    let mut h = Harness::new(FIXED);
    h.refused = vec![1];
    // INFO never asks admission; a refused GO keeps negotiating, and another export is fine.
    h.option(opt::INFO, &info_request("ro", &[])).unwrap();
    h.option(opt::GO, &info_request("ro", &[])).unwrap();
    let replies = h.replies();
    let last = replies.last().unwrap();
    assert_eq!((last.option, last.kind), (opt::GO, rep::ERR_POLICY));
    assert!(!String::from_utf8_lossy(&last.data).contains("limit"));
    assert_eq!(h.hs.status(), HandshakeStatus::Negotiating);
    h.option(opt::GO, &info_request("", &[])).unwrap();
    assert!(matches!(
        h.hs.status(),
        HandshakeStatus::Done(Negotiated { export: 0, .. })
    ));
    assert_eq!(h.admissions_asked, vec![1, 0]);
    let mut h = Harness::new(FIXED);
    h.refused = vec![1];
    assert_eq!(
        h.option(opt::EXPORT_NAME, b"ro"),
        Err(HandshakeError::Refused("ro".into()))
    );
    assert!(h.output.is_empty());
}

#[test]
fn export_name_sends_size_flags_and_zeroes_unless_no_zeroes() {
    for (flags, len) in [(client_flags::FIXED_NEWSTYLE, 8 + 2 + 124), (FIXED, 10)] {
        let mut h = Harness::new(flags);
        h.option(opt::EXPORT_NAME, b"ro").unwrap();
        assert_eq!(h.output.len(), len);
        assert_eq!(&h.output[..10], &[0, 0, 0, 0, 0, 0, 0x10, 0, 0, 3]);
        assert!(matches!(
            h.hs.status(),
            HandshakeStatus::Done(Negotiated {
                export: 1,
                mode: ReplyMode::Simple,
                ..
            })
        ));
    }
    let mut h = Harness::new(FIXED);
    assert_eq!(
        h.option(opt::EXPORT_NAME, b"zz"),
        Err(HandshakeError::UnknownExport("zz".into()))
    );
}

#[test]
fn send_df_only_with_structured_replies() {
    let mut exports = exports();
    exports[0].flags |= tf::SEND_DF;
    for structured in [false, true] {
        let mut h = Harness::new(FIXED);
        h.exports = exports.clone();
        if structured {
            h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
        }
        h.option(opt::GO, &info_request("", &[])).unwrap();
        let replies = h.replies();
        let info = replies.iter().find(|r| r.kind == rep::INFO).unwrap();
        let flags = u16::from_be_bytes([info.data[10], info.data[11]]);
        assert_eq!(flags & tf::SEND_DF != 0, structured);
        let HandshakeStatus::Done(n) = h.hs.status() else {
            panic!("not done")
        };
        assert_eq!(n.flags, flags);
    }
}

#[test]
fn limits_cut_off_oversized_options_and_option_floods() {
    let mut h = Harness::new(FIXED);
    let mut msg = Vec::new();
    msg.put_u64(IHAVEOPT);
    msg.put_u32(opt::GO);
    msg.put_u32(u32::MAX);
    let err = h.feed(&msg).unwrap_err();
    assert!(matches!(
        err,
        HandshakeError::OptionTooLong { len: u32::MAX, .. }
    ));
    // The error reply is pending for the caller to send before it hangs up.
    let pending = h.drain();
    h.output.extend(pending);
    assert_eq!(h.replies().last().map(|r| r.kind), Some(rep::ERR_TOO_BIG));

    let limits = HandshakeLimits {
        options_max: 3,
        ..HandshakeLimits::default()
    };
    let mut hs = ServerHandshake::new(limits);
    let exports = exports();
    hs.handle_input(&FIXED.to_be_bytes(), &exports).unwrap();
    let mut opt_msg = Vec::new();
    opt_msg.put_u64(IHAVEOPT);
    opt_msg.put_u32(opt::LIST);
    opt_msg.put_u32(0);
    for _ in 0..3 {
        assert_eq!(hs.handle_input(&opt_msg, &exports), Ok(16));
    }
    assert_eq!(
        hs.handle_input(&opt_msg, &exports),
        Err(HandshakeError::TooManyOptions(3))
    );
}

#[test]
fn bad_option_magic_closes() {
    let mut h = Harness::new(FIXED);
    let err = h.feed(&[0u8; 16]).unwrap_err();
    assert_eq!(err, HandshakeError::BadOptionMagic(0));
}
