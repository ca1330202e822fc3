//! The client end of the in-memory transmission pair (see `transmission_pair_tests`).
//!
//! The client picks random requests (in range or not), keeps a reference model of the disk
//! updated in the order it sends them (the order the server runs them in), and checks every
//! reply against what it expects.

use std::collections::{HashMap, HashSet};

use crate::client_session::{ClientSession, ReplyEvent, Request, SessionLimits, Want};
use crate::consts::cmd_flags as cf;
use crate::test_rng::XorShift;
use crate::transmission_pair_server::{Pipe, BLOCK, DISK_BYTES, PAYLOAD_MAX};
use crate::types::{Command, Errno, ReplyMode};

/// What the reply to a request must say.
#[derive(Debug)]
enum Expect {
    Done,
    Data(Vec<u8>),
    Error(Errno),
}

/// One request as the client wrote it to the server's pipe.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sent {
    /// `None` for `NBD_CMD_DISC` and junk, which get no reply.
    pub(crate) cookie: Option<u64>,
    /// Where its header starts and its payload ends in the stream.
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// Whether the server must refuse it.
    pub(crate) refused: bool,
}

/// The client's I/O layer and reference model.
pub(crate) struct Client {
    session: ClientSession,
    pub(crate) model: Vec<u8>,
    expect: HashMap<u64, Expect>,
    buffers: HashMap<u64, Vec<u8>>,
    pub(crate) answered: HashSet<u64>,
    /// How many replies were reads checked against the model, and refusals.
    pub(crate) reads_checked: usize,
    pub(crate) refusals_checked: usize,
    /// Whether a reply came before the reply to a request started earlier.
    pub(crate) out_of_order: bool,
    pub(crate) sent: Vec<Sent>,
    /// Set when the client saw the end of the server's stream: the cookies never answered.
    pub(crate) drained: Option<Vec<u64>>,
}

impl Client {
    pub(crate) fn new(mode: ReplyMode) -> Self {
        Client {
            session: ClientSession::new(mode, None, SessionLimits::default()),
            model: vec![0; DISK_BYTES],
            expect: HashMap::new(),
            buffers: HashMap::new(),
            answered: HashSet::new(),
            reads_checked: 0,
            refusals_checked: 0,
            out_of_order: false,
            sent: Vec::new(),
            drained: None,
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.session.in_flight()
    }

    /// Starts a random request; a write's payload follows its header at once.
    pub(crate) fn start_random(&mut self, rng: &mut XorShift, pipe: &mut Pipe) {
        let (request, payload, expect) = pick(rng, &mut self.model);
        let refused = matches!(expect, Expect::Error(_));
        let cookie = self.start(request, &payload, refused, pipe);
        if let Expect::Data(data) = &expect {
            self.buffers.insert(cookie, vec![0xee; data.len()]);
        }
        self.expect.insert(cookie, expect);
    }

    /// Starts a write larger than the server's maximum payload (header only: the server
    /// hangs up before any payload would be read).
    pub(crate) fn start_oversized(&mut self, pipe: &mut Pipe) -> u64 {
        let length = u64::from(PAYLOAD_MAX) + BLOCK as u64;
        let request = Request {
            command: Command::Write,
            flags: 0,
            offset: 0,
            length,
        };
        self.start(request, &[], false, pipe)
    }

    fn start(&mut self, request: Request, payload: &[u8], refused: bool, pipe: &mut Pipe) -> u64 {
        let start = pipe.bytes.len();
        let cookie = self.session.start(request, &mut pipe.bytes).expect("room");
        pipe.bytes.extend_from_slice(payload);
        self.sent.push(Sent {
            cookie: Some(cookie),
            start,
            end: pipe.bytes.len(),
            refused,
        });
        cookie
    }

    /// Writes bytes that get no reply (`NBD_CMD_DISC`, junk).
    pub(crate) fn send_unanswered(&mut self, wire: &[u8], pipe: &mut Pipe) {
        let start = pipe.bytes.len();
        pipe.bytes.extend_from_slice(wire);
        self.sent.push(Sent {
            cookie: None,
            start,
            end: pipe.bytes.len(),
            refused: false,
        });
    }

    /// Reads up to `piece` bytes of what the server sent; at its end, drains and hangs up.
    pub(crate) fn receive(&mut self, piece: usize, from: &mut Pipe, to: &mut Pipe) {
        let input = from.available();
        let event = match self.session.want() {
            Want::Payload { bytes: 0, .. } => self.session.payload_received(0),
            Want::Payload { cookie, at, bytes } => {
                let n = piece.min(input.len()).min(bytes as usize);
                if n == 0 {
                    return self.hang_up_at_eof(from, to);
                }
                let buffer = self.buffers.get_mut(&cookie).expect("a read's buffer");
                buffer[at as usize..at as usize + n].copy_from_slice(&input[..n]);
                from.read += n;
                self.session.payload_received(n as u64)
            }
            Want::Header(_) => {
                let n = piece.min(input.len());
                if n == 0 {
                    return self.hang_up_at_eof(from, to);
                }
                let fed = self.session.handle_input(&input[..n]);
                let (used, event) = fed.expect("the server keeps to the protocol");
                from.read += used;
                event
            }
        };
        if let Some(event) = event {
            self.on_reply(event);
        }
    }

    fn hang_up_at_eof(&mut self, from: &Pipe, to: &mut Pipe) {
        if from.at_eof() {
            self.drained = Some(self.session.drain());
            to.shut();
        }
    }

    fn on_reply(&mut self, event: ReplyEvent) {
        let ReplyEvent::Done { cookie, result } = event else {
            // Data: the bytes follow, announced by want().
            assert!(matches!(event, ReplyEvent::Data { .. }), "{event:?}");
            return;
        };
        assert!(self.answered.insert(cookie), "second reply for {cookie:#x}");
        let expect = self.expect.remove(&cookie).expect("a reply to a request");
        // Requests still waiting, started before this one: the replies came out of order.
        let earlier = self
            .sent
            .iter()
            .map_while(|s| s.cookie.filter(|&c| c != cookie));
        self.out_of_order |= earlier.into_iter().any(|c| self.expect.contains_key(&c));
        match (expect, result) {
            (Expect::Done, Ok(())) => {}
            (Expect::Data(data), Ok(())) => {
                let got = self.buffers.remove(&cookie).expect("a read's buffer");
                assert!(got == data, "read {cookie:#x} returned other bytes");
                self.reads_checked += 1;
            }
            (Expect::Error(errno), Err(failure)) => {
                assert_eq!(failure.errno, errno.to_wire());
                self.refusals_checked += 1;
            }
            (expect, result) => panic!("{cookie:#x}: expected {expect:?}, got {result:?}"),
        }
    }
}

/// A random request, its payload, and what its reply must say; the model sees valid writes.
fn pick(rng: &mut XorShift, model: &mut [u8]) -> (Request, Vec<u8>, Expect) {
    let blocks = 1 + rng.below(8);
    let length = blocks * BLOCK;
    let offset = BLOCK * rng.below(DISK_BYTES / BLOCK - blocks + 1);
    let range = offset..offset + length;
    let (command, flags, offset, expect) = match rng.below(14) {
        0..=3 => (
            Command::Read,
            0,
            offset,
            Expect::Data(model[range].to_vec()),
        ),
        4..=7 => (
            Command::Write,
            [0, cf::FUA][rng.below(2)],
            offset,
            Expect::Done,
        ),
        8 => (Command::Flush, 0, 0, Expect::Done),
        9 => (Command::Trim, 0, offset, Expect::Done),
        10 => {
            model[range].fill(0);
            (Command::WriteZeroes, cf::NO_HOLE, offset, Expect::Done)
        }
        11 => (Command::Cache, 0, offset, Expect::Done),
        _ => refused(rng, offset, length),
    };
    let length = if command == Command::Flush { 0 } else { length };
    let mut payload = Vec::new();
    if command == Command::Write {
        payload = rng.bytes(length);
        if matches!(expect, Expect::Done) {
            model[offset..offset + length].copy_from_slice(&payload);
        }
    }
    let request = Request {
        command,
        flags,
        offset: offset as u64,
        length: length as u64,
    };
    (request, payload, expect)
}

/// A request the server must refuse: command, flags, offset, and the errno the spec names.
fn refused(rng: &mut XorShift, offset: usize, length: usize) -> (Command, u16, usize, Expect) {
    // "The server SHOULD return NBD_ENOSPC if it receives a write request including one or
    // more sectors beyond the size of the device. ... It SHOULD return NBD_EINVAL if it
    // receives a read or trim request including one or more sectors beyond the size of the
    // device, or if a read or write request is not aligned to advertised minimum block
    // sizes." `beyond` is an offset whose range crosses the end of the export.
    let beyond = DISK_BYTES - BLOCK * rng.below(length / BLOCK);
    let (command, flags, offset, errno) = match rng.below(7) {
        0 => (Command::Read, 0, beyond, Errno::Inval),
        1 => (Command::Trim, 0, beyond, Errno::Inval),
        2 => (Command::WriteZeroes, 0, beyond, Errno::NoSpc),
        3 => (Command::Write, 0, beyond, Errno::NoSpc),
        // Misaligned, inside the export.
        4 => {
            let offset = offset.min(DISK_BYTES - length - BLOCK) + 100;
            (Command::Write, 0, offset, Errno::Inval)
        }
        // "For a flush request, length and offset are reserved, and MUST be set to all-zero."
        5 => (Command::Flush, 0, BLOCK + offset, Errno::Inval),
        // A flag not documented for reads.
        _ => (Command::Read, cf::NO_HOLE, offset, Errno::Inval),
    };
    (command, flags, offset, Expect::Error(errno))
}
