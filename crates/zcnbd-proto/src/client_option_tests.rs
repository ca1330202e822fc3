//! The client handshake against scripted servers that refuse, fall back to
//! `NBD_OPT_EXPORT_NAME`, or send replies that break the spec.

use crate::client_handshake::*;
use crate::client_handshake_tests::*;
use crate::client_meta::MetaContext;
use crate::consts::{handshake_flags as hf, info, opt, rep, OPTION_REPLY_MAGIC};
use crate::cursor::PutBe;
use crate::types::{BlockSize, ReplyMode};

#[test]
fn go_errors_carry_the_server_message_and_abort_softly() {
    let cases = [
        (
            rep::ERR_UNKNOWN,
            E::ExportUnknown {
                message: "no disk here".into(),
            },
        ),
        (
            rep::ERR_POLICY,
            E::GoRefused {
                code: rep::ERR_POLICY,
                message: "no disk here".into(),
            },
        ),
        (
            rep::ERR_UNSUP + 99,
            E::GoRefused {
                code: rep::ERR_UNSUP + 99,
                message: "no disk here".into(),
            },
        ),
        (
            rep::ERR_TLS_REQD,
            E::TlsRequired {
                message: "no disk here".into(),
            },
        ),
        (
            rep::ERR_SHUTDOWN,
            E::ServerShutdown {
                message: "no disk here".into(),
            },
        ),
    ];
    for (kind, err) in cases {
        let mut s = Script::at_go(BOTH);
        let result = s.feed(&reply(opt::GO, kind, b"no disk here"));
        s.assert_failed(result, err, true);
        assert_eq!(s.c.handle_input(&[0; 20]), Err(E::Finished));
    }
}

#[test]
fn tls_required_or_shutdown_end_the_handshake_at_any_option() {
    for (kind, err) in [
        (
            rep::ERR_TLS_REQD,
            E::TlsRequired {
                message: "\u{fffd}".into(),
            },
        ),
        (
            rep::ERR_SHUTDOWN,
            E::ServerShutdown {
                message: "\u{fffd}".into(),
            },
        ),
    ] {
        let mut s = Script::new(ClientHandshakeOptions::default());
        s.feed(&greeting(BOTH)).unwrap();
        let result = s.feed(&reply(opt::EXTENDED_HEADERS, kind, b"\xff"));
        s.assert_failed(result, err, true);
    }
}

#[test]
fn go_unsupported_falls_back_to_export_name() {
    let cases = [(BOTH, 3, 0), (hf::FIXED_NEWSTYLE, 1, 124)];
    for (greeting_flags, client_flags, zeroes) in cases {
        let mut s = Script::new(ClientHandshakeOptions {
            export_name: "disk".into(),
            extended_headers: false,
            ..ClientHandshakeOptions::default()
        });
        s.feed(&greeting(greeting_flags)).unwrap();
        assert_eq!(s.client_flags(), client_flags);
        s.feed(&reply(opt::STRUCTURED_REPLY, rep::ACK, &[]))
            .unwrap();
        s.feed(&meta_context(5, "base:allocation")).unwrap();
        s.feed(&reply(opt::SET_META_CONTEXT, rep::ACK, &[]))
            .unwrap();
        s.feed(&reply(opt::GO, rep::ERR_UNSUP, &[])).unwrap();
        assert_eq!(s.last_option(), (opt::EXPORT_NAME, b"disk".to_vec()));
        let mut answer = Vec::new();
        answer.put_u64(1 << 20);
        answer.put_u16(FLAGS);
        answer.extend(std::iter::repeat_n(0, zeroes));
        assert_eq!(s.c.handle_input(&answer[..answer.len() - 1]), Ok(0));
        s.feed(&answer).unwrap();
        // Structured replies and the context agreed before EXPORT_NAME still hold.
        let expected = ClientNegotiated {
            size: 1 << 20,
            flags: FLAGS,
            mode: ReplyMode::Structured,
            base_allocation_id: Some(5),
            meta_contexts: vec![MetaContext {
                name: "base:allocation".into(),
                id: 5,
            }],
            meta_left_out: 0,
            block_size: None,
            description: None,
            tls: false,
        };
        assert_eq!(s.negotiated(), expected);
    }
}

#[test]
fn go_unsupported_after_extended_headers_is_a_refusal() {
    let mut s = Script::new(ClientHandshakeOptions::default());
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ACK, &[]))
        .unwrap();
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ACK, &[]))
        .unwrap();
    let result = s.feed(&reply(opt::GO, rep::ERR_UNSUP, &[]));
    let err = E::GoRefused {
        code: rep::ERR_UNSUP,
        message: String::new(),
    };
    s.assert_failed(result, err, true);
    assert!(s.options().iter().all(|o| o.0 != opt::EXPORT_NAME));
}

#[test]
fn oversized_reply_is_refused_as_soon_as_its_header_is_in() {
    let mut s = Script::at_go(BOTH);
    assert_eq!(s.c.input_bytes_max(), 20 + 65536);
    let mut header = Vec::new();
    header.put_u64(OPTION_REPLY_MAGIC);
    header.put_u32(opt::GO);
    header.put_u32(rep::INFO);
    header.put_u32(65537);
    let result = s.feed(&header);
    let err = E::ReplyTooLong {
        option: opt::GO,
        len: 65537,
        max: 65536,
    };
    s.assert_failed(result, err, false);
}

#[test]
fn replies_with_wrong_magic_or_option_are_refused() {
    let mut s = Script::at_go(BOTH);
    let result = s.feed(&reply(opt::LIST, rep::ACK, &[]));
    let err = E::WrongOption {
        sent: opt::GO,
        got: opt::LIST,
    };
    s.assert_failed(result, err, false);

    let mut s = Script::at_go(BOTH);
    let mut bad = reply(opt::GO, rep::ACK, &[]);
    bad[0] = 0xff;
    let result = s.feed(&bad);
    s.assert_failed(
        result,
        E::BadReplyMagic(OPTION_REPLY_MAGIC | 0xff << 56),
        false,
    );
}

#[test]
fn ack_before_export_info_is_refused() {
    let mut s = Script::at_go(BOTH);
    s.feed(&info_block_size(1, 4096, 1 << 25)).unwrap();
    let result = s.feed(&reply(opt::GO, rep::ACK, &[]));
    s.assert_failed(result, E::MissingExportInfo, false);
}

#[test]
fn broken_info_items_and_acks_are_malformed() {
    let long_description = [&info::DESCRIPTION.to_be_bytes()[..], &[b'x'; 4097]].concat();
    let cases: [(Vec<u8>, E); 6] = [
        (
            reply(opt::GO, rep::INFO, &[0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
            E::Malformed("NBD_INFO_EXPORT length is not 12"),
        ),
        (
            reply(opt::GO, rep::INFO, &[0; 13]),
            E::Malformed("NBD_INFO_EXPORT length is not 12"),
        ),
        (
            reply(
                opt::GO,
                rep::INFO,
                &[0, 3, 0, 0, 2, 0, 0, 0, 16, 0, 0, 0, 16],
            ),
            E::Malformed("NBD_INFO_BLOCK_SIZE length is not 14"),
        ),
        (
            reply(opt::GO, rep::INFO, &[0]),
            E::Malformed("NBD_REP_INFO shorter than its type"),
        ),
        (
            reply(opt::GO, rep::INFO, &long_description),
            E::Malformed("NBD_INFO_DESCRIPTION over 4096 bytes"),
        ),
        (
            reply(opt::GO, rep::ACK, &[0]),
            E::Malformed("NBD_REP_ACK carries data"),
        ),
    ];
    for (bytes, err) in cases {
        let mut s = Script::at_go(BOTH);
        let result = s.feed(&bytes);
        s.assert_failed(result, err, false);
    }

    let mut s = Script::at_go(BOTH);
    let invalid = BlockSize {
        minimum: 3,
        preferred: 4096,
        payload_max: 1 << 25,
    };
    let result = s.feed(&info_block_size(3, 4096, 1 << 25));
    s.assert_failed(result, E::InvalidBlockSize(invalid), false);
}

#[test]
fn unexpected_reply_types_are_refused() {
    let mut s = Script::at_go(BOTH);
    let result = s.feed(&reply(opt::GO, rep::SERVER, &[0, 0, 0, 0]));
    let err = E::UnexpectedReply {
        option: opt::GO,
        reply: rep::SERVER,
    };
    s.assert_failed(result, err, false);

    let mut s = Script::new(ClientHandshakeOptions::default());
    s.feed(&greeting(BOTH)).unwrap();
    let result = s.feed(&reply(opt::EXTENDED_HEADERS, rep::META_CONTEXT, &[]));
    let err = E::UnexpectedReply {
        option: opt::EXTENDED_HEADERS,
        reply: rep::META_CONTEXT,
    };
    s.assert_failed(result, err, false);
}

#[test]
fn metadata_context_replies_are_checked() {
    let at_meta = || {
        let mut s = Script::new(ClientHandshakeOptions::default());
        s.feed(&greeting(BOTH)).unwrap();
        s.feed(&reply(opt::EXTENDED_HEADERS, rep::ACK, &[]))
            .unwrap();
        s
    };
    let mut s = at_meta();
    s.feed(&meta_context(1, "base:allocation")).unwrap();
    let result = s.feed(&meta_context(2, "base:allocation"));
    let twice = E::Malformed("metadata context id or name selected twice");
    s.assert_failed(result, twice.clone(), false);

    // "each with a unique metadata context ID".
    let mut s = at_meta();
    s.feed(&meta_context(1, "base:allocation")).unwrap();
    let result = s.feed(&meta_context(1, "qemu:allocation-depth"));
    s.assert_failed(result, twice, false);

    let mut s = at_meta();
    let result = s.feed(&reply(opt::SET_META_CONTEXT, rep::META_CONTEXT, &[0, 0, 1]));
    let err = E::Malformed("NBD_REP_META_CONTEXT shorter than its id");
    s.assert_failed(result, err, false);
}

#[test]
fn limits_on_reply_count_and_export_name() {
    let mut s = Script::new(ClientHandshakeOptions {
        extended_headers: false,
        structured_replies: false,
        option_replies_max: 3,
        ..ClientHandshakeOptions::default()
    });
    s.feed(&greeting(BOTH)).unwrap();
    for _ in 0..3 {
        s.feed(&info_export(1, FLAGS)).unwrap();
    }
    let result = s.feed(&info_export(1, FLAGS));
    let err = E::TooManyReplies {
        option: opt::GO,
        max: 3,
    };
    s.assert_failed(result, err, false);

    let mut s = Script::new(ClientHandshakeOptions {
        export_name: "x".repeat(4097),
        option_reply_bytes_max: 0,
        ..ClientHandshakeOptions::default()
    });
    assert_eq!(s.c.input_bytes_max(), 134);
    let result = s.feed(&greeting(BOTH));
    s.assert_failed(result, E::ExportNameTooLong(4097), false);
}
