//! STARTTLS in the server handshake: each TLS policy, TLS-only exports, and the stop between
//! `NBD_REP_ACK` and `tls_established`.

use crate::consts::{client_flags, info, opt, rep, transmission_flags as tf, IHAVEOPT};
use crate::cursor::{PutBe, Reader};
use crate::handshake::*;
use crate::handshake_harness::*;
use crate::meta::MetaSelected;
use crate::types::{BlockSize, ExportInfo, ReplyMode};

/// The harness's exports plus "secret", which is TLS-only.
fn with_secret(mut h: Harness) -> Harness {
    h.exports.push(ExportInfo {
        name: "secret".into(),
        description: "needs TLS".into(),
        size: 8192,
        flags: tf::HAS_FLAGS,
        block_size: BlockSize::default(),
        tls_only: true,
        meta_contexts: Vec::new(),
    });
    h
}

/// A handshake under `policy` that has acknowledged `NBD_OPT_STARTTLS` and been told the
/// TLS handshake succeeded.
fn under_tls(policy: TlsPolicy) -> Harness {
    let mut h = with_secret(Harness::with_tls(FIXED, policy));
    h.option(opt::STARTTLS, &[]).unwrap();
    assert_eq!(kinds(&mut h), [rep::ACK]);
    assert_eq!(h.hs.status(), HandshakeStatus::StartTls);
    h.hs.tls_established().unwrap();
    assert!(h.hs.is_tls());
    assert_eq!(h.hs.status(), HandshakeStatus::Negotiating);
    h
}

fn kinds(h: &mut Harness) -> Vec<u32> {
    h.replies().iter().map(|r| r.kind).collect()
}

/// The export names an `NBD_OPT_LIST` reply names.
fn listed(h: &mut Harness) -> Vec<String> {
    h.option(opt::LIST, &[]).unwrap();
    let replies = h.replies();
    assert_eq!(replies.last().map(|r| r.kind), Some(rep::ACK));
    let servers = replies.iter().filter(|r| r.kind == rep::SERVER);
    let names = servers.map(|r| {
        let mut d = Reader::new(&r.data);
        let name = d.string_u32(4096).unwrap();
        String::from_utf8(name.to_vec()).unwrap()
    });
    names.collect()
}

/// One valid payload for every option a FORCEDTLS server must refuse before TLS.
fn every_option_but_starttls_and_abort() -> Vec<(u32, Vec<u8>)> {
    vec![
        (opt::LIST, vec![]),
        (4, vec![]), // NBD_OPT_PEEK_EXPORT, withdrawn
        (opt::INFO, info_request("", &[])),
        (opt::GO, info_request("", &[info::BLOCK_SIZE])),
        (opt::STRUCTURED_REPLY, vec![]),
        (opt::EXTENDED_HEADERS, vec![]),
        (opt::LIST_META_CONTEXT, meta_request("", &["base:"])),
        (
            opt::SET_META_CONTEXT,
            meta_request("", &["base:allocation"]),
        ),
        (99, vec![1, 2, 3]),
    ]
}

#[test]
fn require_refuses_every_option_but_starttls_and_abort_before_tls() {
    let mut h = Harness::with_tls(FIXED, TlsPolicy::Require);
    for (option, data) in every_option_but_starttls_and_abort() {
        h.option(option, &data).unwrap();
        let replies = h.replies();
        assert_eq!(replies.len(), 1, "option {option}");
        assert_eq!(
            (replies[0].option, replies[0].kind),
            (option, rep::ERR_TLS_REQD)
        );
        assert_eq!(h.hs.status(), HandshakeStatus::Negotiating);
    }
    assert!(h.admissions_asked.is_empty());
    h.option(opt::ABORT, &[]).unwrap();
    assert_eq!(kinds(&mut h), [rep::ACK]);
    assert_eq!(h.hs.status(), HandshakeStatus::Aborted);
}

#[test]
fn require_closes_on_export_name_before_tls() {
    let mut h = Harness::with_tls(FIXED, TlsPolicy::Require);
    let err = h.option(opt::EXPORT_NAME, b"").unwrap_err();
    assert_eq!(err, HandshakeError::ExportNameWithoutTls(String::new()));
    assert!(h.hs.pending_output().is_empty() && h.admissions_asked.is_empty());
}

#[test]
fn require_serves_everything_under_tls_and_never_says_tls_reqd() {
    let mut h = under_tls(TlsPolicy::Require);
    assert_eq!(listed(&mut h), ["", "ro", "secret"]);
    for (option, data) in every_option_but_starttls_and_abort() {
        if option == opt::GO {
            continue;
        }
        h.option(option, &data).unwrap();
        assert!(h.replies().iter().all(|r| r.kind != rep::ERR_TLS_REQD));
    }
    h.option(opt::GO, &info_request("secret", &[])).unwrap();
    let HandshakeStatus::Done(negotiated) = h.hs.status() else {
        panic!("not done: {:?}", h.hs.status());
    };
    assert_eq!((negotiated.export, negotiated.tls), (2, true));
}

#[test]
fn starttls_with_data_is_invalid_under_every_policy() {
    let policies = [
        TlsPolicy::Unsupported,
        TlsPolicy::Off,
        TlsPolicy::On,
        TlsPolicy::Require,
    ];
    for policy in policies {
        let mut h = Harness::with_tls(FIXED, policy);
        h.option(opt::STARTTLS, &[0]).unwrap();
        assert_eq!(kinds(&mut h), [rep::ERR_INVALID], "{policy:?}");
        assert_eq!(h.hs.status(), HandshakeStatus::Negotiating);
        assert!(!h.hs.is_tls());
    }
}

#[test]
fn notls_refuses_starttls_with_unsup_or_policy() {
    for (policy, reply) in [
        (TlsPolicy::Unsupported, rep::ERR_UNSUP),
        (TlsPolicy::Off, rep::ERR_POLICY),
    ] {
        let mut h = Harness::with_tls(FIXED, policy);
        h.option(opt::STARTTLS, &[]).unwrap();
        assert_eq!(kinds(&mut h), [reply], "{policy:?}");
        assert_eq!(h.hs.tls_established(), Err(HandshakeError::TlsNotDue));
        assert!(!h.hs.is_tls());
        assert_eq!(h.hs.tls_policy(), policy);
    }
}

#[test]
fn second_starttls_is_invalid() {
    for policy in [TlsPolicy::On, TlsPolicy::Require] {
        let mut h = under_tls(policy);
        h.option(opt::STARTTLS, &[]).unwrap();
        assert_eq!(kinds(&mut h), [rep::ERR_INVALID], "{policy:?}");
        assert_eq!(h.hs.status(), HandshakeStatus::Negotiating);
        assert!(h.hs.is_tls());
    }
}

#[test]
fn bytes_after_starttls_are_left_to_the_tls_layer() {
    let mut hs = ServerHandshake::with_tls(HandshakeLimits::default(), TlsPolicy::On);
    let exports = crate::handshake_harness::exports();
    hs.consume_output(usize::MAX);
    assert_eq!(hs.handle_input(&FIXED.to_be_bytes(), &exports), Ok(4));
    // STARTTLS, then what a client that did not wait for the ACK would send: a TLS record.
    let mut input = Vec::new();
    input.put_u64(IHAVEOPT);
    input.put_u32(opt::STARTTLS);
    input.put_u32(0);
    input.extend_from_slice(&[0x16, 0x03, 0x01, 0x00, 0x05]);
    assert_eq!(hs.handle_input(&input, &exports), Ok(16));
    assert_eq!(hs.status(), HandshakeStatus::StartTls);
    // Nothing past the option is taken as plain text, however it is offered.
    assert_eq!(
        hs.handle_input(&input[16..], &exports),
        Err(HandshakeError::TlsPending)
    );
    assert_eq!(
        hs.handle_input(&[], &exports),
        Err(HandshakeError::TlsPending)
    );
    // The ACK must go out in plain text before TLS starts.
    assert_eq!(hs.tls_established(), Err(HandshakeError::TlsNotDue));
    assert!(!hs.is_tls());
    assert_eq!(hs.pending_output().len(), 20);
    hs.consume_output(20);
    assert_eq!(hs.tls_established(), Ok(()));
    assert!(hs.is_tls());
    assert_eq!(hs.tls_established(), Err(HandshakeError::TlsNotDue));
}

#[test]
fn tls_established_without_starttls_is_refused() {
    let mut h = Harness::with_tls(FIXED, TlsPolicy::On);
    assert_eq!(h.hs.tls_established(), Err(HandshakeError::TlsNotDue));
    assert!(!h.hs.is_tls());
}

#[test]
fn tls_only_exports_are_hidden_from_list_until_tls() {
    let mut h = with_secret(Harness::with_tls(FIXED, TlsPolicy::On));
    assert_eq!(listed(&mut h), ["", "ro"]);
    let mut h = under_tls(TlsPolicy::On);
    assert_eq!(listed(&mut h), ["", "ro", "secret"]);
}

#[test]
fn tls_only_export_gets_tls_reqd_to_info_and_go_before_tls() {
    let mut h = with_secret(Harness::with_tls(FIXED, TlsPolicy::On));
    for option in [opt::INFO, opt::GO] {
        h.option(option, &info_request("secret", &[info::NAME]))
            .unwrap();
        // No NBD_REP_INFO before the error: nothing about the export leaks.
        assert_eq!(kinds(&mut h), [rep::ERR_TLS_REQD]);
    }
    assert!(h.admissions_asked.is_empty());
    // Other exports work in plain text.
    h.option(opt::GO, &info_request("ro", &[])).unwrap();
    let HandshakeStatus::Done(negotiated) = h.hs.status() else {
        panic!("not done");
    };
    assert_eq!((negotiated.export, negotiated.tls), (1, false));
}

#[test]
fn tls_only_export_name_before_tls_closes() {
    let mut h = with_secret(Harness::with_tls(FIXED, TlsPolicy::On));
    let err = h.option(opt::EXPORT_NAME, b"secret").unwrap_err();
    assert_eq!(err, HandshakeError::ExportNameWithoutTls("secret".into()));
    assert!(h.hs.pending_output().is_empty() && h.admissions_asked.is_empty());
    let mut h = under_tls(TlsPolicy::On);
    h.option(opt::EXPORT_NAME, b"secret").unwrap();
    assert!(matches!(h.hs.status(), HandshakeStatus::Done(n) if n.export == 2 && n.tls));
}

#[test]
fn tls_only_export_refuses_meta_contexts_by_policy_before_tls() {
    let mut h = with_secret(Harness::with_tls(FIXED, TlsPolicy::On));
    h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
    for option in [opt::LIST_META_CONTEXT, opt::SET_META_CONTEXT] {
        h.option(option, &meta_request("secret", &["base:allocation"]))
            .unwrap();
    }
    assert_eq!(kinds(&mut h), [rep::ACK, rep::ERR_POLICY, rep::ERR_POLICY]);
}

#[test]
fn tls_only_export_under_notls_is_refused_by_policy() {
    let mut h = with_secret(Harness::with_tls(FIXED, TlsPolicy::Off));
    assert_eq!(listed(&mut h), ["", "ro"]);
    h.option(opt::GO, &info_request("secret", &[])).unwrap();
    assert_eq!(kinds(&mut h), [rep::ERR_POLICY]);
}

#[test]
fn starttls_forgets_what_was_negotiated_before() {
    let mut h = with_secret(Harness::with_tls(FIXED, TlsPolicy::On));
    h.option(opt::EXTENDED_HEADERS, &[]).unwrap();
    h.option(
        opt::SET_META_CONTEXT,
        &meta_request("", &["base:allocation"]),
    )
    .unwrap();
    h.option(opt::STARTTLS, &[]).unwrap();
    assert_eq!(
        kinds(&mut h),
        [rep::ACK, rep::META_CONTEXT, rep::ACK, rep::ACK]
    );
    h.hs.tls_established().unwrap();
    // Structured replies after extended headers would be refused, had they survived.
    h.option(opt::STRUCTURED_REPLY, &[]).unwrap();
    assert_eq!(kinds(&mut h), [rep::ACK]);
    h.option(opt::GO, &info_request("", &[])).unwrap();
    let HandshakeStatus::Done(negotiated) = h.hs.status() else {
        panic!("not done");
    };
    assert_eq!(negotiated.mode, ReplyMode::Structured);
    assert_eq!(
        (negotiated.meta, negotiated.tls),
        (MetaSelected::NONE, true)
    );
}

#[test]
fn no_tls_without_fixed_newstyle() {
    // Only NBD_FLAG_C_NO_ZEROES: the server "MUST operate in NOTLS mode".
    let flags = client_flags::NO_ZEROES;
    let mut h = with_secret(Harness::with_tls(flags, TlsPolicy::On));
    h.option(opt::STARTTLS, &[]).unwrap();
    assert_eq!(kinds(&mut h), [rep::ERR_POLICY]);
    // What TLS would protect stays out of reach, without NBD_REP_ERR_TLS_REQD.
    assert_eq!(listed(&mut h), ["", "ro"]);
    h.option(opt::GO, &info_request("secret", &[])).unwrap();
    assert_eq!(kinds(&mut h), [rep::ERR_POLICY]);
    let err = h.option(opt::EXPORT_NAME, b"secret").unwrap_err();
    assert_eq!(err, HandshakeError::ExportNameWithoutTls("secret".into()));
}

#[test]
fn require_closes_a_client_that_cannot_do_tls_before_any_option() {
    // Its options would otherwise be answered: NBD_REP_ERR_UNKNOWN for a name that does not
    // exist, NBD_REP_ERR_POLICY for one that does, telling the names apart before TLS.
    for flags in [0, client_flags::NO_ZEROES] {
        let mut hs = ServerHandshake::with_tls(HandshakeLimits::default(), TlsPolicy::Require);
        let greeting = hs.pending_output().len();
        hs.consume_output(greeting);
        let exports = crate::handshake_harness::exports();
        let err = hs.handle_input(&flags.to_be_bytes(), &exports).unwrap_err();
        assert_eq!(err, HandshakeError::TlsRequiredWithoutFixedNewstyle);
        assert!(hs.pending_output().is_empty(), "nothing is answered");
    }
}
