//! A `ClientSession` and a `ServerSession` talking over in-memory pipes (quinn's `Pair`), in
//! every reply mode: both sides read in short random pieces, the server answers out of
//! order, and the connection may be cut at any byte in either direction. Every read must
//! return the reference model's bytes, every refusal the errno the spec names, every cookie
//! exactly one reply or a place in the client's drain, and both sides must end.

use std::collections::HashSet;

use crate::request::RequestHeader;
use crate::server_session::{CutShort, EndReason};
use crate::test_rng::XorShift;
use crate::transmission_pair_client::{Client, Sent};
use crate::transmission_pair_server::{Pipe, Server, PAYLOAD_MAX};
use crate::types::{Command, ReplyMode};

const MODES: [ReplyMode; 3] = [
    ReplyMode::Simple,
    ReplyMode::Structured,
    ReplyMode::Extended,
];
/// Requests per run, before the finale.
const REQUESTS: usize = 40;
/// Most requests the client keeps in flight.
const IN_FLIGHT_MAX: usize = 12;
/// Steps after which a run that has not settled is a bug (a loop).
const STEPS_MAX: usize = 2_000_000;

/// What the client sends after its requests.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Finale {
    /// `NBD_CMD_DISC`: a soft disconnect.
    Disc,
    /// A write over the advertised maximum payload: the server hangs up.
    Oversized,
    /// A header with a bad magic: the server hangs up.
    BadMagic,
}

/// Where the connection is cut: the byte of one direction's stream it stops at.
#[derive(Debug, Clone, Copy)]
enum Cut {
    ToServer(usize),
    ToClient(usize),
}

struct Pair {
    mode: ReplyMode,
    rng: XorShift,
    piece_max: usize,
    finale: Finale,
    client: Client,
    server: Server,
    to_server: Pipe,
    to_client: Pipe,
    started: usize,
    finale_sent: bool,
    oversized: Option<u64>,
}

impl Pair {
    fn new(mode: ReplyMode, seed: u64, finale: Finale, cut: Option<Cut>) -> Self {
        let mut rng = XorShift::new(seed);
        let piece_max = [1, 7, 64, 1500][rng.below(4)];
        let mut pair = Pair {
            mode,
            rng,
            piece_max,
            finale,
            client: Client::new(mode),
            server: Server::new(mode),
            to_server: Pipe::default(),
            to_client: Pipe::default(),
            started: 0,
            finale_sent: false,
            oversized: None,
        };
        match cut {
            Some(Cut::ToServer(at)) => pair.to_server.end = Some(at),
            Some(Cut::ToClient(at)) => pair.to_client.end = Some(at),
            None => {}
        }
        pair
    }

    /// Runs both sides until the client has seen the end and the server has closed.
    fn run(mut self) -> Self {
        for _ in 0..STEPS_MAX {
            if self.client.drained.is_some() && self.server.closed {
                return self;
            }
            self.client_step();
            let piece = self.rng.piece(self.piece_max);
            if !self.server.closed {
                self.server.receive(piece, &mut self.to_server);
                self.server.send(&mut self.rng, &mut self.to_client);
            }
        }
        panic!("{:?}: the pair did not settle", self.mode);
    }

    fn client_step(&mut self) {
        if self.client.drained.is_some() {
            return;
        }
        let room = self.client.in_flight() < IN_FLIGHT_MAX;
        if self.started < REQUESTS && room && self.rng.one_in(3) {
            self.client.start_random(&mut self.rng, &mut self.to_server);
            self.started += 1;
        } else if self.started == REQUESTS && !self.finale_sent {
            self.send_finale();
        }
        let piece = self.rng.piece(self.piece_max);
        self.client
            .receive(piece, &mut self.to_client, &mut self.to_server);
    }

    /// Sends the finale right after the last request, so that requests are still in flight
    /// when the server's request stream ends: they must be answered all the same.
    fn send_finale(&mut self) {
        self.finale_sent = true;
        let mut wire = Vec::new();
        match self.finale {
            Finale::Disc => RequestHeader {
                flags: 0,
                kind: Command::Disc.to_wire(),
                cookie: 0,
                offset: 0,
                length: 0,
            }
            .encode(self.mode, &mut wire),
            Finale::Oversized => {
                self.oversized = Some(self.client.start_oversized(&mut self.to_server));
            }
            Finale::BadMagic => wire.resize(self.mode.request_header_bytes(), 0xff),
        }
        if !wire.is_empty() {
            self.client.send_unanswered(&wire, &mut self.to_server);
        }
    }

    /// Every cookie started was answered exactly once or drained, never both; returns the
    /// drained ones.
    fn drained(&self) -> HashSet<u64> {
        let list = self.client.drained.clone().expect("client ended");
        let drained: HashSet<u64> = list.iter().copied().collect();
        assert_eq!(drained.len(), list.len(), "a cookie drained twice");
        let started: HashSet<u64> = self.client.sent.iter().filter_map(|s| s.cookie).collect();
        assert!(
            self.client.answered.is_disjoint(&drained),
            "{:?}",
            self.mode
        );
        let all: HashSet<u64> = self.client.answered.union(&drained).copied().collect();
        assert_eq!(all, started, "{:?}", self.mode);
        drained
    }

    /// What the server's `close()` must say for a cut of its stream at `at`; `None` if it
    /// ends before reading that far (the finale was whole before the cut).
    fn expected_cut(&self, at: usize) -> Option<Option<CutShort>> {
        let size = self.mode.request_header_bytes();
        for s in &self.client.sent {
            // `NBD_CMD_DISC` arrived whole: the server stopped reading before the cut.
            if s.end <= at && s.cookie.is_none() {
                return None;
            }
            if s.start < at && at < s.end {
                return Some(Some(self.cut_inside(s, at, size)));
            }
        }
        Some(None)
    }

    fn cut_inside(&self, s: &Sent, at: usize, size: usize) -> CutShort {
        let into = at - s.start;
        if into < size {
            return CutShort::Header { received: into };
        }
        let wire = &self.to_server.bytes[s.start..];
        let header = RequestHeader::decode(wire, self.mode).unwrap().unwrap();
        if s.refused {
            let remaining = s.end - at;
            return CutShort::Discard { header, remaining };
        }
        CutShort::Payload {
            header,
            received: into - size,
            payload_bytes: s.end - s.start - size,
        }
    }
}

#[test]
fn requests_and_shuffled_replies_agree_in_every_mode() {
    // Reads checked, refusals checked, runs with replies out of order.
    let mut tally = [0; 3];
    for mode in MODES {
        for seed in 0..16 {
            let pair = Pair::new(mode, seed, Finale::Disc, None).run();
            tally[0] += pair.client.reads_checked;
            tally[1] += pair.client.refusals_checked;
            tally[2] += usize::from(pair.client.out_of_order);
            assert!(pair.drained().is_empty(), "{mode:?} seed {seed}");
            assert_eq!(pair.server.ended, Some(EndReason::Disconnect));
            assert_eq!(pair.server.cut_short, None);
            assert!(pair.to_server.all_read() && pair.to_client.all_read());
            assert!(
                pair.server.disk == pair.client.model,
                "{mode:?} seed {seed}"
            );
        }
    }
    assert!(
        tally[0] > 400 && tally[1] > 100 && tally[2] > 40,
        "{tally:?}"
    );
}

#[test]
fn hard_ends_answer_every_request_before_them() {
    for mode in MODES {
        for seed in 100..108 {
            for finale in [Finale::Oversized, Finale::BadMagic] {
                let pair = Pair::new(mode, seed, finale, None).run();
                let drained = pair.drained();
                let expected: HashSet<u64> = pair.oversized.into_iter().collect();
                assert_eq!(drained, expected, "{mode:?} seed {seed} {finale:?}");
                let reason = match finale {
                    Finale::BadMagic => EndReason::BadMagic(u32::MAX),
                    _ => EndReason::PayloadTooLarge {
                        payload: u64::from(PAYLOAD_MAX) + 512,
                        max: PAYLOAD_MAX,
                    },
                };
                assert_eq!(pair.server.ended, Some(reason));
                assert!(pair.server.disk == pair.client.model);
            }
        }
    }
}

/// A cut of the client's stream: the server answers exactly the requests whole before the
/// cut, and its `close()` names the one the cut went through.
fn check_cut_to_server(mode: ReplyMode, seed: u64, at: usize) -> Option<Option<CutShort>> {
    let pair = Pair::new(mode, seed, Finale::Disc, Some(Cut::ToServer(at))).run();
    let context = format!("{mode:?} seed {seed} cut to server at {at}");
    let drained = pair.drained();
    for s in pair.client.sent.iter().filter(|s| s.cookie.is_some()) {
        let answered = pair.client.answered.contains(&s.cookie.unwrap());
        assert_eq!(answered, s.end <= at, "{context}: {s:?}");
    }
    assert_eq!(pair.server.cut_short, pair.expected_cut(at), "{context}");
    // A write cut short in its payload was reported, but never answered: drained.
    if let Some(Some(cut @ CutShort::Payload { .. })) = pair.server.cut_short {
        assert!(drained.contains(&cut.cookie().unwrap()), "{context}");
    }
    pair.server.cut_short
}

/// A cut of the server's stream: the client drains what it never saw answered, hangs up,
/// and the server reads the whole requests left and ends with nothing cut short.
fn check_cut_to_client(mode: ReplyMode, seed: u64, at: usize) {
    let pair = Pair::new(mode, seed, Finale::Disc, Some(Cut::ToClient(at))).run();
    let context = format!("{mode:?} seed {seed} cut to client at {at}");
    pair.drained();
    assert!(!matches!(pair.server.cut_short, Some(Some(_))), "{context}");
    assert!(
        pair.to_server.all_read() || pair.server.ended.is_some(),
        "{context}"
    );
}

#[test]
fn cuts_in_either_direction_end_both_sides_cleanly() {
    // Cuts through a header, a write's payload, a refused payload, between requests.
    let mut tally = [0; 4];
    for mode in MODES {
        for seed in 200..210 {
            let whole = Pair::new(mode, seed, Finale::Disc, None).run();
            let (to_server, to_client) = (whole.to_server.bytes.len(), whole.to_client.bytes.len());
            let mut rng = XorShift::new(seed);
            for _ in 0..4 {
                let cut = check_cut_to_server(mode, seed, rng.below(to_server));
                tally[match cut {
                    Some(Some(CutShort::Header { .. })) => 0,
                    Some(Some(CutShort::Payload { .. })) => 1,
                    Some(Some(CutShort::Discard { .. })) => 2,
                    _ => 3,
                }] += 1;
                check_cut_to_client(mode, seed, rng.below(to_client));
            }
            // At the very start, and in the first header.
            check_cut_to_server(mode, seed, 0);
            check_cut_to_server(mode, seed, 5);
            check_cut_to_client(mode, seed, 0);
        }
    }
    assert!(tally[..3].iter().all(|&n| n > 0), "{tally:?}");
}
