//! The `session` target: a whole server session (`Server::serve_stream`) over a socket pair,
//! with the input as everything the client sends.
//!
//! The first input byte picks a [`Preamble`]: nothing (the fuzzer explores the handshake), or
//! a complete handshake into one export and mode (the fuzzer explores transmission without
//! first rediscovering `NBD_OPT_GO`). What the server sends is then checked by
//! [`super::transcript`] against a model built from the sans-IO protocol crate: its
//! `ServerHandshake` says what the handshake must send, and its `ServerSession` which
//! requests are owed a reply.

use std::io::Read;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

use rustix::net::{send, SendFlags};
use zcnbd_proto::consts::{client_flags, info, opt, BASE_ALLOCATION, IHAVEOPT};
use zcnbd_proto::cursor::PutBe;
use zcnbd_proto::ReplyMode;
use zcnbd_server::stream::Stream;

use super::fixture::{fixture_for, Engine, HANDSHAKE_TIMEOUT_MS};
use super::transcript;

/// A handshake a session input can start with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preamble {
    /// Nothing: the input starts with the client flags.
    Raw,
    /// The client flags only: the input starts with the first option.
    Flags,
    /// `NBD_OPT_EXPORT_NAME ""`: simple replies, no metadata context.
    ExportName,
    /// Structured replies, `base:allocation` and `NBD_OPT_GO ""` with block sizes.
    Structured,
    /// Extended headers, `base:allocation` and `NBD_OPT_GO ""`.
    Extended,
    /// Structured replies into the read-only export.
    ReadOnly,
    /// Extended headers and `base:allocation` on the huge null export.
    Null,
    /// Structured replies and `base:allocation` on the buffered-file export with 512-byte
    /// blocks.
    Block512,
}

impl Preamble {
    /// Every preamble, indexed by an input's first byte.
    pub const ALL: [Preamble; 8] = [
        Preamble::Raw,
        Preamble::Flags,
        Preamble::ExportName,
        Preamble::Structured,
        Preamble::Extended,
        Preamble::ReadOnly,
        Preamble::Null,
        Preamble::Block512,
    ];

    /// The preamble an input's first byte selects.
    pub fn of(selector: u8) -> Preamble {
        Self::ALL[usize::from(selector) % Self::ALL.len()]
    }

    /// The byte that selects this preamble.
    pub fn selector(self) -> u8 {
        Self::ALL.iter().position(|p| *p == self).unwrap_or(0) as u8
    }

    /// The reply mode this preamble negotiates, if it completes a handshake.
    pub fn mode(self) -> Option<ReplyMode> {
        match self {
            Preamble::Raw | Preamble::Flags => None,
            Preamble::ExportName => Some(ReplyMode::Simple),
            Preamble::Structured | Preamble::ReadOnly | Preamble::Block512 => {
                Some(ReplyMode::Structured)
            }
            Preamble::Extended | Preamble::Null => Some(ReplyMode::Extended),
        }
    }

    /// The client's bytes for this handshake.
    pub fn bytes(self) -> Vec<u8> {
        let mut out = Vec::new();
        if self == Preamble::Raw {
            return out;
        }
        out.put_u32(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES);
        let (export, first) = match self {
            Preamble::Raw | Preamble::Flags => return out,
            Preamble::ExportName => {
                option(&mut out, opt::EXPORT_NAME, b"");
                return out;
            }
            Preamble::Structured => ("", opt::STRUCTURED_REPLY),
            Preamble::Extended => ("", opt::EXTENDED_HEADERS),
            Preamble::ReadOnly => ("ro", opt::STRUCTURED_REPLY),
            Preamble::Null => ("null", opt::EXTENDED_HEADERS),
            Preamble::Block512 => ("b512", opt::STRUCTURED_REPLY),
        };
        option(&mut out, first, &[]);
        if self != Preamble::ReadOnly {
            option(&mut out, opt::SET_META_CONTEXT, &meta_request(export));
        }
        option(&mut out, opt::GO, &go_request(export));
        out
    }
}

/// Appends one option to `out`.
pub fn option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    out.put_u64(IHAVEOPT);
    out.put_u32(option);
    out.put_u32(data.len() as u32);
    out.extend_from_slice(data);
}

/// The data of `NBD_OPT_SET_META_CONTEXT` selecting `base:allocation` on `export`.
pub fn meta_request(export: &str) -> Vec<u8> {
    let mut d = Vec::new();
    d.put_u32(export.len() as u32);
    d.extend_from_slice(export.as_bytes());
    d.put_u32(1);
    d.put_u32(BASE_ALLOCATION.len() as u32);
    d.extend_from_slice(BASE_ALLOCATION.as_bytes());
    d
}

/// The data of `NBD_OPT_GO` for `export`, asking for every information type.
pub fn go_request(export: &str) -> Vec<u8> {
    let mut d = Vec::new();
    d.put_u32(export.len() as u32);
    d.extend_from_slice(export.as_bytes());
    let items = [info::NAME, info::DESCRIPTION, info::BLOCK_SIZE];
    d.put_u16(items.len() as u16);
    for item in items {
        d.put_u16(item);
    }
    d
}

/// What the client sends for a session input: the preamble, then the rest of the input.
pub fn client_input(data: &[u8]) -> Vec<u8> {
    let Some((&selector, rest)) = data.split_first() else {
        return Vec::new();
    };
    let mut input = Preamble::of(selector).bytes();
    input.extend_from_slice(rest);
    input
}

/// Runs the target on the portable engine.
pub fn run(data: &[u8]) {
    run_on(Engine::Portable, data);
}

/// Runs the target on the io_uring engine, `--data-path auto`.
pub fn run_uring(data: &[u8]) {
    run_on(Engine::UringAuto, data);
}

/// Runs the target on the io_uring engine, `--data-path zerocopy`.
pub fn run_uring_zerocopy(data: &[u8]) {
    run_on(Engine::UringZeroCopy, data);
}

fn run_on(engine: Engine, data: &[u8]) {
    let input = client_input(data);
    let (output, may_time_out) = serve_timed_on(engine, &input);
    transcript::check(&input, &output, may_time_out);
}

/// [`serve_on`], and whether the session took long enough that the server's handshake deadline
/// may have passed (a loaded machine can stall it; only then may the handshake end early).
pub fn serve_timed(input: &[u8]) -> (Vec<u8>, bool) {
    serve_timed_on(Engine::Portable, input)
}

fn serve_timed_on(engine: Engine, input: &[u8]) -> (Vec<u8>, bool) {
    let started = Instant::now();
    let output = serve_on(engine, input);
    let deadline = Duration::from_millis(HANDSHAKE_TIMEOUT_MS);
    (output, started.elapsed() >= deadline)
}

/// Serves one session whose client sends `input` and then half-closes; returns everything
/// the server sent. The client drains the socket throughout, so the server never blocks on
/// a full send buffer, and writes with `MSG_NOSIGNAL`, so a server that hangs up early
/// cannot kill the process with SIGPIPE (libFuzzer's `main` does not ignore it as Rust's does).
fn serve_on(engine: Engine, input: &[u8]) -> Vec<u8> {
    let (client, server_end) = UnixStream::pair().expect("socket pair");
    let writer_end = client.try_clone().expect("clone client socket");
    let input = input.to_vec();
    let writer = thread::spawn(move || {
        let mut rest = &input[..];
        while let Ok(n @ 1..) = send(&writer_end, rest, SendFlags::NOSIGNAL) {
            rest = &rest[n..];
        }
        let _ = writer_end.shutdown(Shutdown::Write);
    });
    let reader = thread::spawn(move || {
        let mut output = Vec::new();
        let _ = (&client).read_to_end(&mut output);
        output
    });
    fixture_for(engine)
        .server
        .serve_stream(Stream::Unix(server_end), "fuzz");
    writer.join().expect("client writer");
    reader.join().expect("client reader")
}
