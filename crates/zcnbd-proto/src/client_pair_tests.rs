//! The client handshake driven against the server handshake in memory (quinn's `Pair`), with
//! short reads both ways, and a sweep of pseudo-random server bytes that must never panic.

use crate::client_handshake::*;
use crate::client_pair::*;
use crate::consts::{opt, rep, IHAVEOPT, NBD_MAGIC, OPTION_REPLY_MAGIC};
use crate::cursor::{PutBe, Reader};
use crate::handshake::HandshakeStatus;

#[test]
fn every_option_combination_agrees_with_the_server() {
    let reads = [
        Reads::OneByte,
        Reads::Random(7),
        Reads::Random(99),
        Reads::Whole,
    ];
    let mut runs = 0;
    for bits in 0..8u8 {
        for name in ["", "ro"] {
            for reads in reads {
                let opts = ClientHandshakeOptions {
                    export_name: name.into(),
                    extended_headers: bits & 1 != 0,
                    structured_replies: bits & 2 != 0,
                    base_allocation: bits & 4 != 0,
                    ..ClientHandshakeOptions::default()
                };
                check_agreement(&opts, reads);
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 64);
}

fn check_agreement(opts: &ClientHandshakeOptions, reads: Reads) {
    let tls = check_agreement_over(Pair::new(opts.clone()), opts, reads);
    assert!(!tls);
}

#[test]
fn unknown_export_ends_with_a_soft_disconnect() {
    for reads in [Reads::OneByte, Reads::Whole] {
        let mut pair = Pair::new(ClientHandshakeOptions {
            export_name: "nope".into(),
            ..ClientHandshakeOptions::default()
        });
        let err = pair.run(reads).unwrap_err();
        assert_eq!(
            err,
            ClientHandshakeError::ExportUnknown {
                message: "no such export".into()
            }
        );
        assert_eq!(pair.client.status(), ClientHandshakeStatus::Failed);
        // The client's NBD_OPT_ABORT reaches the server, which acknowledges it.
        pair.run(Reads::Whole).unwrap();
        assert_eq!(pair.server.status(), HandshakeStatus::Aborted);
    }
}

/// Builds a server message for `option`, the one in flight: usually a well-formed reply that
/// fits it, otherwise one with a random field spoiled, so the sweep reaches deep states.
fn plausible_message(lcg: &mut Lcg, option: u32) -> Vec<u8> {
    let (kind, data) = if lcg.below(4) == 0 {
        chaotic_reply(lcg)
    } else {
        fitting_reply(lcg, option)
    };
    let mut m = Vec::new();
    m.put_u64(match lcg.below(40) {
        0 => lcg.next().into(),
        _ => OPTION_REPLY_MAGIC,
    });
    m.put_u32(match lcg.below(40) {
        0 => lcg.below(12),
        _ => option,
    });
    m.put_u32(kind);
    m.put_u32(match lcg.below(40) {
        0 => lcg.next(),
        _ => data.len() as u32,
    });
    m.extend(data);
    m
}

fn fitting_reply(lcg: &mut Lcg, option: u32) -> (u32, Vec<u8>) {
    let mut data = Vec::new();
    let kind = match (option, lcg.below(4)) {
        (_, 0) => return (rep::ACK, data),
        (opt::GO, _) => {
            data.put_u16(lcg.below(5) as u16);
            match lcg.below(3) {
                0 => data.extend((0..10).map(|_| lcg.next() as u8)),
                1 => [512u32, 4096, 1 << 20]
                    .iter()
                    .for_each(|v| data.put_u32(*v)),
                _ => data.extend_from_slice(b"text"),
            }
            rep::INFO
        }
        (opt::SET_META_CONTEXT, _) => {
            data.put_u32(lcg.next());
            data.extend_from_slice(b"base:allocation");
            rep::META_CONTEXT
        }
        _ => rep::ERR_UNSUP,
    };
    (kind, data)
}

fn chaotic_reply(lcg: &mut Lcg) -> (u32, Vec<u8>) {
    let kinds = [
        rep::ACK,
        rep::INFO,
        rep::META_CONTEXT,
        rep::SERVER,
        rep::ERR_UNSUP,
        rep::ERR_UNKNOWN,
        rep::ERR_TLS_REQD,
        rep::ERR_SHUTDOWN,
        lcg.next(),
    ];
    let kind = kinds[lcg.below(kinds.len() as u32) as usize];
    let len = [0, 2, 4, 12, 14, lcg.below(70)][lcg.below(6) as usize];
    (kind, (0..len).map(|_| lcg.next() as u8).collect())
}

/// The last option in the client's output so far (after its 4-byte flags).
fn last_option(sent: &[u8]) -> u32 {
    let mut r = Reader::new(sent.get(4..).unwrap_or_default());
    let mut last = 0;
    while let (Some(_magic), Some(option), Some(len)) = (r.u64(), r.u32(), r.u32()) {
        last = option;
        r.take(len as usize).unwrap();
    }
    last
}

#[test]
fn pseudo_random_server_bytes_never_panic() {
    let mut lcg = Lcg(0x5eed);
    let mut outcomes = [0u32; 3];
    for round in 0..5000 {
        let opts = ClientHandshakeOptions {
            extended_headers: round % 2 == 0,
            structured_replies: round % 3 != 0,
            base_allocation: round % 5 != 0,
            option_reply_bytes_max: 64,
            option_replies_max: 8,
            ..ClientHandshakeOptions::default()
        };
        let mut client = ClientHandshake::new(opts);
        let mut greeting = Vec::new();
        greeting.put_u64(NBD_MAGIC);
        greeting.put_u64(IHAVEOPT);
        greeting.put_u16(lcg.below(4) as u16 | 1);
        let outcome = feed_plausibly(&mut client, greeting, &mut lcg);
        outcomes[outcome as usize] += 1;
    }
    // Each of error, success and running out of input must happen, or the sweep is too shallow.
    assert!(outcomes.iter().all(|&n| n > 50), "{outcomes:?}");
}

#[derive(Clone, Copy)]
enum Outcome {
    Failed,
    Done,
    OutOfInput,
}

/// Feeds `greeting` and then up to 11 plausible replies, each in random slices.
fn feed_plausibly(client: &mut ClientHandshake, greeting: Vec<u8>, lcg: &mut Lcg) -> Outcome {
    let mut received = Vec::new();
    let mut sent = Vec::new();
    let mut message = greeting;
    for _ in 0..1 + lcg.below(12) {
        let mut rest = &message[..];
        while !rest.is_empty() {
            let n = (1 + lcg.below(50) as usize).min(rest.len());
            received.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if let Some(outcome) = consume(client, &mut received) {
                return outcome;
            }
        }
        sent.extend_from_slice(client.pending_output());
        client.consume_output(usize::MAX);
        message = plausible_message(lcg, last_option(&sent));
    }
    Outcome::OutOfInput
}

fn consume(client: &mut ClientHandshake, received: &mut Vec<u8>) -> Option<Outcome> {
    loop {
        match client.handle_input(received) {
            Err(_) => {
                assert_eq!(client.status(), ClientHandshakeStatus::Failed);
                assert_eq!(
                    client.handle_input(received),
                    Err(ClientHandshakeError::Finished)
                );
                return Some(Outcome::Failed);
            }
            Ok(0) => {
                assert!(received.len() < client.input_bytes_max());
                return None;
            }
            Ok(used) => {
                assert!(used <= received.len());
                received.drain(..used);
            }
        }
        if matches!(client.status(), ClientHandshakeStatus::Done(_)) {
            return Some(Outcome::Done);
        }
    }
}
