//! The in-memory pair for the handshake tests (quinn's `Pair`): a `ClientHandshake` and a
//! `ServerHandshake` joined by two wires that deliver in reads of a chosen shape.
//!
//! STARTTLS runs through a toy TLS: once a side has called `tls_established`, what it sends
//! is XORed with [`TOY_TLS_KEY`] and what it receives (including bytes it already held, which
//! belong to the TLS layer) is XORed back, so a byte taken on the wrong side of the switch
//! garbles the handshake.

use crate::client_handshake::*;
use crate::consts::transmission_flags as tf;
use crate::handshake::{
    HandshakeLimits, HandshakeStatus, Negotiated, ServerHandshake, TlsPolicy, BASE_ALLOCATION_ID,
};
use crate::types::{BlockSize, ExportInfo, ReplyMode};
/// What the toy TLS XORs every byte with.
const TOY_TLS_KEY: u8 = 0xa5;

pub(crate) fn exports() -> Vec<ExportInfo> {
    vec![
        ExportInfo {
            name: String::new(),
            description: "default disk".into(),
            size: 1 << 30,
            flags: tf::HAS_FLAGS | tf::SEND_FLUSH | tf::SEND_DF,
            block_size: BlockSize::default(),
            tls_only: false,
            meta_contexts: Vec::new(),
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size: 4096,
            flags: tf::HAS_FLAGS | tf::READ_ONLY,
            block_size: BlockSize::with_minimum(512),
            tls_only: false,
            meta_contexts: Vec::new(),
        },
        ExportInfo {
            name: "secret".into(),
            description: "needs TLS".into(),
            size: 1 << 20,
            flags: tf::HAS_FLAGS | tf::SEND_DF,
            block_size: BlockSize::default(),
            tls_only: true,
            meta_contexts: Vec::new(),
        },
    ]
}

/// A deterministic pseudo-random sequence (Knuth's MMIX LCG), so failures reproduce.
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }

    pub(crate) fn below(&mut self, n: u32) -> u32 {
        self.next() % n
    }
}

/// How many bytes each delivery carries: the shape of the reads each side sees.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Reads {
    OneByte,
    Random(u64),
    Whole,
}

/// One direction of the connection: bytes sent but not yet delivered, and bytes delivered
/// but not yet consumed by the receiver.
#[derive(Default)]
struct Wire {
    in_flight: Vec<u8>,
    received: Vec<u8>,
}

impl Wire {
    /// Sends `bytes`, through the toy TLS if the sender runs it.
    fn send(&mut self, bytes: &[u8], tls: bool) {
        let key = if tls { TOY_TLS_KEY } else { 0 };
        self.in_flight.extend(bytes.iter().map(|b| b ^ key));
    }

    /// Delivers one read's worth, through the toy TLS if the receiver runs it.
    fn deliver(&mut self, reads: Reads, lcg: &mut Lcg, tls: bool) {
        let n = match reads {
            Reads::OneByte => 1,
            Reads::Random(_) => 1 + lcg.below(23) as usize,
            Reads::Whole => self.in_flight.len(),
        }
        .min(self.in_flight.len());
        let key = if tls { TOY_TLS_KEY } else { 0 };
        self.received
            .extend(self.in_flight.drain(..n).map(|b| b ^ key));
    }

    /// The receiver starts the toy TLS: bytes it holds are the TLS layer's from now on.
    fn start_tls(&mut self) {
        self.received.iter_mut().for_each(|b| *b ^= TOY_TLS_KEY);
    }
}

pub(crate) struct Pair {
    pub(crate) client: ClientHandshake,
    pub(crate) server: ServerHandshake,
    pub(crate) exports: Vec<ExportInfo>,
    to_server: Wire,
    to_client: Wire,
}

impl Pair {
    pub(crate) fn new(opts: ClientHandshakeOptions) -> Self {
        Self::with_tls(opts, ClientTls::Off, TlsPolicy::Unsupported)
    }

    pub(crate) fn with_tls(
        opts: ClientHandshakeOptions,
        tls: ClientTls,
        policy: TlsPolicy,
    ) -> Self {
        Pair {
            client: ClientHandshake::with_tls(opts, tls),
            server: ServerHandshake::with_tls(HandshakeLimits::default(), policy),
            exports: exports(),
            to_server: Wire::default(),
            to_client: Wire::default(),
        }
    }

    /// Runs both sides until neither can move; returns the client's error, if any.
    pub(crate) fn run(&mut self, reads: Reads) -> Result<(), ClientHandshakeError> {
        let mut lcg = Lcg(match reads {
            Reads::Random(seed) => seed,
            _ => 1,
        });
        for _ in 0..100_000 {
            let out = self.server.pending_output().to_vec();
            self.server.consume_output(out.len());
            self.to_client.send(&out, self.server.is_tls());
            let out = self.client.pending_output().to_vec();
            self.client.consume_output(out.len());
            self.to_server.send(&out, self.client.is_tls());
            if self.to_client.in_flight.is_empty() && self.to_server.in_flight.is_empty() {
                return Ok(());
            }
            self.to_server
                .deliver(reads, &mut lcg, self.server.is_tls());
            self.to_client
                .deliver(reads, &mut lcg, self.client.is_tls());
            self.feed_server();
            self.feed_client()?;
        }
        panic!("handshake did not settle");
    }

    fn feed_server(&mut self) {
        loop {
            // The ACK goes out in plain text before the (toy) TLS handshake.
            let status = self.server.status();
            if status == HandshakeStatus::StartTls && self.server.pending_output().is_empty() {
                self.to_server.start_tls();
                self.server.tls_established().unwrap();
            } else if status != HandshakeStatus::Negotiating {
                return;
            }
            let input = &self.to_server.received;
            let used = self.server.handle_input(input, &self.exports).unwrap();
            if used == 0 {
                return;
            }
            self.to_server.received.drain(..used);
        }
    }

    fn feed_client(&mut self) -> Result<(), ClientHandshakeError> {
        loop {
            match self.client.status() {
                ClientHandshakeStatus::NeedIo => {}
                ClientHandshakeStatus::StartTls => {
                    self.to_client.start_tls();
                    self.client.tls_established().unwrap();
                }
                _ => return Ok(()),
            }
            let used = self.client.handle_input(&self.to_client.received)?;
            if used == 0 {
                assert!(self.to_client.received.len() < self.client.input_bytes_max());
                return Ok(());
            }
            self.to_client.received.drain(..used);
        }
    }

    pub(crate) fn outcomes(&self) -> (ClientNegotiated, Negotiated) {
        assert!(self.to_client.received.is_empty() && self.to_server.received.is_empty());
        let ClientHandshakeStatus::Done(client) = self.client.status() else {
            panic!("client not done: {:?}", self.client.status());
        };
        let HandshakeStatus::Done(server) = self.server.status() else {
            panic!("server not done: {:?}", self.server.status());
        };
        (client, server)
    }
}

/// Runs `pair` (built with `opts`) and checks both sides agree on what the client asked for;
/// returns whether they run under TLS.
pub(crate) fn check_agreement_over(
    mut pair: Pair,
    opts: &ClientHandshakeOptions,
    reads: Reads,
) -> bool {
    let context = format!("{opts:?} {reads:?}");
    pair.run(reads).expect(&context);
    let (client, server) = pair.outcomes();
    let export = &pair.exports[server.export];
    let mode = if opts.extended_headers {
        ReplyMode::Extended
    } else if opts.structured_replies {
        ReplyMode::Structured
    } else {
        ReplyMode::Simple
    };
    let base_allocation =
        (opts.base_allocation && mode != ReplyMode::Simple).then_some(BASE_ALLOCATION_ID);
    let description = (!export.description.is_empty()).then(|| export.description.clone());
    assert_eq!(export.name, opts.export_name, "{context}");
    assert_eq!((client.mode, server.mode), (mode, mode), "{context}");
    assert_eq!(client.size, export.size, "{context}");
    assert_eq!(client.flags, server.flags, "{context}");
    assert_eq!(client.block_size, Some(export.block_size), "{context}");
    assert!(server.block_size_requested, "{context}");
    assert_eq!(client.base_allocation_id, base_allocation, "{context}");
    let selected = server.meta.ids().next().map(|(id, _)| id);
    assert_eq!(selected, base_allocation, "{context}");
    assert!(server.meta.count() <= 1, "{context}");
    assert_eq!(client.description, description, "{context}");
    assert_eq!(client.tls, server.tls, "{context}");
    assert_eq!(client.tls, pair.client.is_tls(), "{context}");
    assert_eq!(server.tls, pair.server.is_tls(), "{context}");
    client.tls
}
