//! The `handshake` target: `ServerHandshake::handle_input` on arbitrary client bytes.
//!
//! The same input is fed twice, all at once and one byte at a time (the shortest reads a
//! socket can give); both runs must agree on everything, and what the server sends must
//! frame as a client would parse it.

use zcnbd_proto::consts::{
    opt, rep, transmission_flags as tf, IHAVEOPT, NBD_MAGIC, OPTION_REPLY_MAGIC,
};
use zcnbd_proto::cursor::Reader;
use zcnbd_proto::{
    ExportInfo, HandshakeError, HandshakeStatus, Negotiated, ReplyMode, ServerHandshake, TlsPolicy,
};

use super::fixture::{fixture, HANDSHAKE_LIMITS};

/// The most one client message may make the server send: a `NBD_OPT_LIST` or `NBD_OPT_GO`
/// reply over the fixture's few short-named exports is far below this.
const OUTPUT_PER_MESSAGE_BYTES_MAX: usize = 16 * 1024;

/// How a handshake over some input ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Everything the server sent, greeting included.
    pub output: Vec<u8>,
    /// Where the handshake stands after the last message.
    pub status: HandshakeStatus,
    /// The error that ended it, if one did.
    pub error: Option<HandshakeError>,
    /// Input bytes consumed; the rest belongs to the transmission phase (if `Done`).
    pub consumed: usize,
}

/// Runs the target.
pub fn run(data: &[u8]) {
    let infos = &fixture().infos;
    let whole = drive(data, infos, data.len().max(1));
    let bytewise = drive(data, infos, 1);
    assert_eq!(whole, bytewise, "the outcome depends on how input is split");
    check_outcome(&whole, infos);
}

/// Runs the `handshake_tls` target: the first byte picks the policy of a server that offers
/// TLS (`on` or `require`), the rest is the client's bytes, against the fixture's exports and
/// one TLS-only export. Besides what `run` checks, what TLS protects must stay out of reach:
/// the harness never completes a TLS handshake, so no client may attach to anything that
/// needs TLS, nothing may be answered after a STARTTLS acknowledgement (the bytes after it
/// belong to TLS), and under `require` nothing but STARTTLS and ABORT may get an answer other
/// than `NBD_REP_ERR_TLS_REQD`.
pub fn run_tls(data: &[u8]) {
    let (policy, input) = match data.split_first() {
        Some((b, rest)) if b & 1 == 1 => (TlsPolicy::Require, rest),
        Some((_, rest)) => (TlsPolicy::On, rest),
        None => (TlsPolicy::Require, data),
    };
    let mut infos = fixture().infos.clone();
    infos.push(ExportInfo {
        name: "secret".into(),
        tls_only: true,
        ..infos[0].clone()
    });
    let whole = drive_with(input, &infos, input.len().max(1), policy);
    let bytewise = drive_with(input, &infos, 1, policy);
    assert_eq!(whole, bytewise, "the outcome depends on how input is split");
    check_outcome(&whole, &infos);
    check_tls(&whole, &infos, policy, input);
}

/// What TLS protects stays out of reach before TLS (see [`run_tls`]); an oracle that does not
/// use the handshake's own state, only what went over the wire.
fn check_tls(outcome: &Outcome, infos: &[ExportInfo], policy: TlsPolicy, input: &[u8]) {
    let fixed = input.len() >= 4 && input[3] & 1 == 1;
    if policy == TlsPolicy::Require && input.len() >= 4 && !fixed {
        // Closed at its flags (for those, or for flags it does not know): nothing answered.
        assert!(
            outcome.error.is_some(),
            "a client that cannot do TLS was served"
        );
        assert_eq!(
            outcome.output.len(),
            18,
            "a client that cannot do TLS was answered"
        );
    }
    if let HandshakeStatus::Done(n) = &outcome.status {
        assert!(policy != TlsPolicy::Require, "attached without TLS");
        assert!(
            !infos[n.export].tls_only,
            "attached to a TLS-only export without TLS"
        );
    }
    // The greeting is 18 bytes; then option replies.
    let mut r = Reader::new(&outcome.output[18.min(outcome.output.len())..]);
    let mut acked_starttls = false;
    while r.clone().u64() == Some(OPTION_REPLY_MAGIC) {
        r.u64();
        let (option, kind, len) = (r.u32(), r.u32(), r.u32());
        let (Some(option), Some(kind), Some(len)) = (option, kind, len) else {
            break;
        };
        let data = r.take(len as usize).unwrap_or_default();
        assert!(
            !acked_starttls,
            "option {option} answered after STARTTLS's ACK"
        );
        if option == opt::STARTTLS && kind == rep::ACK {
            acked_starttls = true;
        }
        let free = matches!(option, opt::STARTTLS | opt::ABORT);
        if policy == TlsPolicy::Require && fixed && !free {
            // NBD_REP_ERR_TOO_BIG ends a handshake past its limits (option size and count)
            // before any option is looked at; it tells nothing.
            let refused = matches!(kind, rep::ERR_TLS_REQD | rep::ERR_TOO_BIG);
            assert!(refused, "option {option} answered {kind:#x} before TLS");
        }
        if kind == rep::SERVER {
            let mut d = Reader::new(data);
            let name = d.u32().and_then(|n| d.take(n as usize)).unwrap_or_default();
            assert!(
                !infos
                    .iter()
                    .any(|i| i.tls_only && i.name.as_bytes() == name),
                "a TLS-only export listed before TLS"
            );
        }
    }
    if acked_starttls {
        assert_eq!(outcome.status, HandshakeStatus::StartTls);
    }
}

/// Feeds `data` to a fresh handshake `chunk` bytes at a time, as a connection would, until it
/// finishes, fails, or the input runs out.
pub fn drive(data: &[u8], infos: &[ExportInfo], chunk: usize) -> Outcome {
    // A server without --tls refuses STARTTLS for policy reasons.
    drive_with(data, infos, chunk, TlsPolicy::Off)
}

/// [`drive`] under `policy`.
pub fn drive_with(data: &[u8], infos: &[ExportInfo], chunk: usize, policy: TlsPolicy) -> Outcome {
    let mut hs = ServerHandshake::with_tls(HANDSHAKE_LIMITS, policy);
    let mut output = drain(&mut hs);
    let (mut received, mut consumed) = (0, 0);
    while received < data.len() {
        received = (received + chunk).min(data.len());
        while hs.status() == HandshakeStatus::Negotiating {
            let pending = &data[consumed..received];
            let result = hs.handle_input(pending, infos);
            let sent = drain(&mut hs);
            assert!(
                sent.len() <= OUTPUT_PER_MESSAGE_BYTES_MAX,
                "one message sent too much"
            );
            output.extend_from_slice(&sent);
            match result {
                Ok(0) => break,
                Ok(used) => {
                    assert!(
                        used <= pending.len(),
                        "used {used} of {} bytes",
                        pending.len()
                    );
                    consumed += used;
                }
                Err(error) => return finish(hs, output, Some(error), consumed),
            }
        }
        if hs.status() != HandshakeStatus::Negotiating {
            break;
        }
    }
    finish(hs, output, None, consumed)
}

fn drain(hs: &mut ServerHandshake) -> Vec<u8> {
    let out = hs.pending_output().to_vec();
    hs.consume_output(out.len());
    assert!(hs.pending_output().is_empty());
    out
}

fn finish(
    mut hs: ServerHandshake,
    output: Vec<u8>,
    error: Option<HandshakeError>,
    consumed: usize,
) -> Outcome {
    let status = hs.status();
    if status != HandshakeStatus::Negotiating {
        // Once STARTTLS is acknowledged the next bytes are the TLS layer's, not options.
        let expected = match status {
            HandshakeStatus::StartTls => HandshakeError::TlsPending,
            _ => HandshakeError::Finished,
        };
        assert_eq!(hs.handle_input(&[0; 64], &[]), Err(expected));
        assert!(hs.pending_output().is_empty(), "output after the end");
    }
    Outcome {
        output,
        status,
        error,
        consumed,
    }
}

/// Checks what the server sent frames as a client parses it, and the outcome is coherent.
pub fn check_outcome(outcome: &Outcome, infos: &[ExportInfo]) {
    if let HandshakeStatus::Done(n) = &outcome.status {
        check_negotiated(n, infos);
    }
    let mut r = Reader::new(&outcome.output);
    assert_eq!(r.u64(), Some(NBD_MAGIC));
    assert_eq!(r.u64(), Some(IHAVEOPT));
    assert_eq!(r.u16(), Some(3), "greeting flags");
    while !r.is_empty() {
        if r.clone().u64() != Some(OPTION_REPLY_MAGIC) {
            return check_export_name_tail(r.rest(), outcome, infos);
        }
        r.u64();
        let (option, kind, len) = (r.u32(), r.u32(), r.u32());
        let (Some(option), Some(kind), Some(len)) = (option, kind, len) else {
            panic!("truncated option reply header");
        };
        let data = r.take(len as usize);
        assert!(
            data.is_some(),
            "option {option} reply shorter than its length {len}"
        );
        let known = matches!(kind, rep::ACK | rep::SERVER | rep::INFO | rep::META_CONTEXT);
        assert!(known || kind & (1 << 31) != 0, "reply type {kind:#x}");
    }
}

fn check_negotiated(n: &Negotiated, infos: &[ExportInfo]) {
    assert!(n.export < infos.len(), "export index {}", n.export);
    assert_eq!(n.flags, advertised_flags(&infos[n.export], n.mode));
    if n.mode == ReplyMode::Simple {
        assert_eq!(
            n.meta,
            zcnbd_proto::meta::MetaSelected::NONE,
            "metadata context without structured replies"
        );
    }
}

/// An export's transmission flags as a client in `mode` sees them: `NBD_FLAG_SEND_DF` "MUST
/// [be left] clear if neither structured replies nor extended headers have been negotiated".
pub fn advertised_flags(info: &ExportInfo, mode: ReplyMode) -> u16 {
    match mode {
        ReplyMode::Simple => info.flags & !tf::SEND_DF,
        _ => info.flags,
    }
}

/// `NBD_OPT_EXPORT_NAME`'s reply: size, flags and (without `NO_ZEROES`) 124 zero bytes.
fn check_export_name_tail(tail: &[u8], outcome: &Outcome, infos: &[ExportInfo]) {
    let HandshakeStatus::Done(n) = &outcome.status else {
        panic!("unframed output {tail:02x?} and no NBD_OPT_EXPORT_NAME");
    };
    assert_ne!(
        n.mode,
        ReplyMode::Extended,
        "NBD_OPT_EXPORT_NAME with extended headers"
    );
    let mut r = Reader::new(tail);
    let info = &infos[n.export];
    assert_eq!(r.u64(), Some(info.size));
    assert_eq!(
        r.u16(),
        Some(n.flags),
        "flags sent differ from those negotiated"
    );
    let zeroes = r.rest();
    assert!(
        zeroes.is_empty() || zeroes == [0; 124],
        "{} bytes of padding",
        zeroes.len()
    );
}
