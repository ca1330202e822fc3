//! STARTTLS through both handshake machines in memory, with the toy TLS of
//! `client_pair` and short reads both ways: every way a client's wish for TLS can meet a
//! server's policy.

use crate::client_handshake::*;
use crate::client_pair::{check_agreement_over, Pair, Reads};
use crate::consts::rep;
use crate::handshake::{HandshakeStatus, TlsPolicy};

const READS: [Reads; 4] = [
    Reads::OneByte,
    Reads::Random(7),
    Reads::Random(99),
    Reads::Whole,
];

fn opts(name: &str, bits: u8) -> ClientHandshakeOptions {
    ClientHandshakeOptions {
        export_name: name.into(),
        extended_headers: bits & 1 != 0,
        structured_replies: bits & 2 != 0,
        base_allocation: bits & 4 != 0,
        ..ClientHandshakeOptions::default()
    }
}

#[test]
fn starttls_then_every_option_combination_agrees_under_short_reads() {
    let mut runs = 0;
    for tls in [ClientTls::Allow, ClientTls::Require] {
        for policy in [TlsPolicy::On, TlsPolicy::Require] {
            for bits in 0..8u8 {
                for name in ["", "ro", "secret"] {
                    for reads in READS {
                        let opts = opts(name, bits);
                        let pair = Pair::with_tls(opts.clone(), tls, policy);
                        assert!(check_agreement_over(pair, &opts, reads));
                        runs += 1;
                    }
                }
            }
        }
    }
    assert_eq!(runs, 2 * 2 * 8 * 3 * 4);
}

#[test]
fn allowed_tls_falls_back_to_plain_text_on_a_server_without_it() {
    for policy in [TlsPolicy::Unsupported, TlsPolicy::Off] {
        for reads in READS {
            let opts = opts("ro", 7);
            let pair = Pair::with_tls(opts.clone(), ClientTls::Allow, policy);
            assert!(!check_agreement_over(pair, &opts, reads));
        }
    }
}

/// Runs pairs `new` builds, which must end with the client's `err`, then checks the client's
/// `NBD_OPT_ABORT` reached the server (a soft disconnect).
fn check_refusal(new: impl Fn() -> Pair, err: ClientHandshakeError) {
    for reads in READS {
        let mut pair = new();
        assert_eq!(pair.run(reads), Err(err.clone()), "{reads:?}");
        assert_eq!(pair.client.status(), ClientHandshakeStatus::Failed);
        pair.run(reads).unwrap();
        assert_eq!(pair.server.status(), HandshakeStatus::Aborted);
        assert!(!pair.client.is_tls() && !pair.server.is_tls());
    }
}

#[test]
fn required_tls_refused_by_the_server_is_a_typed_error() {
    for (policy, code, message) in [
        (TlsPolicy::Unsupported, rep::ERR_UNSUP, "TLS not supported"),
        (TlsPolicy::Off, rep::ERR_POLICY, "TLS not offered"),
    ] {
        let new = || Pair::with_tls(opts("", 7), ClientTls::Require, policy);
        let message = message.into();
        check_refusal(new, ClientHandshakeError::TlsRefused { code, message });
    }
}

#[test]
fn plain_text_client_meets_forced_tls_or_a_tls_only_export() {
    let message = "TLS required".to_string();
    let new = || Pair::with_tls(opts("", 7), ClientTls::Off, TlsPolicy::Require);
    check_refusal(new, ClientHandshakeError::TlsRequired { message });
    // SELECTIVETLS: the plain-text client reaches GO, which names a TLS-only export.
    let message = "export requires TLS".to_string();
    let new = || Pair::with_tls(opts("secret", 7), ClientTls::Off, TlsPolicy::On);
    check_refusal(new, ClientHandshakeError::TlsRequired { message });
}

#[test]
fn plain_text_client_uses_ordinary_exports_of_a_selective_server() {
    for reads in READS {
        let opts = opts("ro", 3);
        let pair = Pair::with_tls(opts.clone(), ClientTls::Off, TlsPolicy::On);
        assert!(!check_agreement_over(pair, &opts, reads));
    }
}
