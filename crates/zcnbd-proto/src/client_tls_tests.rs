//! STARTTLS in the client handshake against scripted servers: the option goes first, the
//! machine stops on its ACK, and refusals end or pass as the user asked.

use crate::client_handshake::*;
use crate::client_handshake_tests::*;
use crate::consts::{opt, rep};

/// A client asking for TLS as `tls` says, which has sent `NBD_OPT_STARTTLS` after the greeting.
fn at_starttls(tls: ClientTls) -> Script {
    let mut s = Script {
        c: ClientHandshake::with_tls(
            ClientHandshakeOptions {
                extended_headers: false,
                ..ClientHandshakeOptions::default()
            },
            tls,
        ),
        sent: Vec::new(),
    };
    assert_eq!(s.c.tls_established(), Err(E::TlsNotDue));
    s.feed(&greeting(BOTH)).unwrap();
    // "SHOULD send NBD_OPT_STARTTLS as the first option", with no data.
    assert_eq!(s.options(), [(opt::STARTTLS, vec![])]);
    assert_eq!(s.c.tls_established(), Err(E::TlsNotDue));
    s
}

/// A client that has been told its TLS handshake succeeded.
fn under_tls(tls: ClientTls) -> Script {
    let mut s = at_starttls(tls);
    s.feed(&reply(opt::STARTTLS, rep::ACK, &[])).unwrap();
    assert_eq!(s.c.status(), ClientHandshakeStatus::StartTls);
    assert_eq!(s.options().len(), 1, "nothing is sent before TLS");
    s.c.tls_established().unwrap();
    assert!(s.c.is_tls());
    s
}

/// Answers the structured-reply and metadata options with ACKs and `NBD_OPT_GO` with an
/// export, as far as `Done`.
fn finish(s: &mut Script) -> ClientNegotiated {
    s.feed(&reply(opt::STRUCTURED_REPLY, rep::ACK, &[]))
        .unwrap();
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ACK, &[]))
        .unwrap();
    s.feed(&info_export(1 << 20, FLAGS)).unwrap();
    s.feed(&reply(opt::GO, rep::ACK, &[])).unwrap();
    s.negotiated()
}

#[test]
fn acknowledged_starttls_stops_for_tls_then_negotiates_under_it() {
    for tls in [ClientTls::Allow, ClientTls::Require] {
        let mut s = under_tls(tls);
        // The next option is pending output now, to go out under TLS.
        let pending = s.c.pending_output().to_vec();
        assert_eq!(s.c.tls_established(), Err(E::TlsNotDue));
        s.c.consume_output(pending.len());
        s.sent.extend(pending);
        assert_eq!(s.last_option().0, opt::STRUCTURED_REPLY);
        let negotiated = finish(&mut s);
        assert!(negotiated.tls, "{tls:?}");
        let options: Vec<u32> = s.options().iter().map(|o| o.0).collect();
        assert_eq!(
            options,
            [
                opt::STARTTLS,
                opt::STRUCTURED_REPLY,
                opt::SET_META_CONTEXT,
                opt::GO
            ]
        );
    }
}

#[test]
fn bytes_after_the_ack_are_left_to_the_tls_layer() {
    let mut s = at_starttls(ClientTls::Require);
    let mut input = reply(opt::STARTTLS, rep::ACK, &[]);
    // A server that starts the TLS handshake itself: a TLS record right after the ACK.
    input.extend_from_slice(&[0x16, 0x03, 0x03, 0x00, 0x02]);
    assert_eq!(s.c.handle_input(&input), Ok(20));
    assert_eq!(s.c.status(), ClientHandshakeStatus::StartTls);
    // Offered as plain text, they end the handshake rather than pass for a reply.
    assert_eq!(s.c.handle_input(&input[20..]), Err(E::TlsPending));
    assert_eq!(s.c.status(), ClientHandshakeStatus::Failed);
    assert!(s.c.pending_output().is_empty());
}

#[test]
fn refused_starttls_ends_the_handshake_when_tls_is_required() {
    for code in [rep::ERR_UNSUP, rep::ERR_POLICY, rep::ERR_INVALID] {
        let mut s = at_starttls(ClientTls::Require);
        let result = s.feed(&reply(opt::STARTTLS, code, b"no TLS here"));
        let message = "no TLS here".into();
        s.assert_failed(result, E::TlsRefused { code, message }, true);
        assert!(!s.c.is_tls());
    }
}

#[test]
fn refused_starttls_goes_on_in_plain_text_when_tls_is_allowed() {
    for code in [rep::ERR_UNSUP, rep::ERR_POLICY] {
        let mut s = at_starttls(ClientTls::Allow);
        s.feed(&reply(opt::STARTTLS, code, &[])).unwrap();
        assert_eq!(s.last_option().0, opt::STRUCTURED_REPLY);
        let negotiated = finish(&mut s);
        assert!(!negotiated.tls && !s.c.is_tls());
    }
}

#[test]
fn plain_text_client_told_tls_is_required_gets_a_typed_error() {
    let mut s = Script::new(ClientHandshakeOptions::default());
    s.feed(&greeting(BOTH)).unwrap();
    let result = s.feed(&reply(
        opt::EXTENDED_HEADERS,
        rep::ERR_TLS_REQD,
        b"TLS required",
    ));
    let message = "TLS required".into();
    s.assert_failed(result, E::TlsRequired { message }, true);
}

#[test]
fn tls_reqd_under_tls_breaks_the_protocol() {
    let mut s = under_tls(ClientTls::Require);
    let result = s.feed(&reply(opt::STRUCTURED_REPLY, rep::ERR_TLS_REQD, &[]));
    let err = E::UnexpectedReply {
        option: opt::STRUCTURED_REPLY,
        reply: rep::ERR_TLS_REQD,
    };
    s.assert_failed(result, err, false);
}

#[test]
fn malformed_or_unexpected_answers_to_starttls_end_the_handshake() {
    let mut s = at_starttls(ClientTls::Allow);
    let result = s.feed(&reply(opt::STARTTLS, rep::ACK, &[0]));
    s.assert_failed(result, E::Malformed("NBD_REP_ACK carries data"), false);
    let mut s = at_starttls(ClientTls::Allow);
    let result = s.feed(&reply(opt::STARTTLS, rep::SERVER, &[]));
    let err = E::UnexpectedReply {
        option: opt::STARTTLS,
        reply: rep::SERVER,
    };
    s.assert_failed(result, err, false);
}
