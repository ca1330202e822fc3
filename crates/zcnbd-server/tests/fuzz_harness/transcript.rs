//! Checks what the server sent in a session, given what the client sent.
//!
//! The model is the sans-IO protocol crate itself. The handshake runs over the client's bytes
//! with no socket, and its output must be exactly what the server sent before transmission.
//! The rest of the input goes through a [`ServerSession`], the server's sans-IO request
//! reader, so the oracle's model of the request stream is the session itself: each request or
//! refusal it reports is a reply the server owes. The server's replies must frame correctly
//! and pay each of those debts exactly once (replies may come in any order, and cookies may
//! repeat, so replies are matched to requests as a bipartite matching).

use zcnbd_proto::consts::reply_flags;
use zcnbd_proto::{
    Command, Errno, ExportInfo, HandshakeStatus, Negotiated, ReplyHeader, ReplyMode, RequestHeader,
    ServerEvent, ServerSession, ServerWant, TransmissionContext,
};

use super::answer::answers;
use super::fixture::fixture;
use super::handshake;

/// Checks one session; `may_time_out` allows the handshake to have stopped early.
pub fn check(input: &[u8], output: &[u8], may_time_out: bool) {
    let infos = &fixture().infos;
    let model = handshake::drive(input, infos, input.len().max(1));
    let expected = &model.output[..];
    if may_time_out && output.len() < expected.len() && expected.starts_with(output) {
        return;
    }
    if !output.starts_with(expected) {
        let at = output
            .iter()
            .zip(expected)
            .take_while(|(a, b)| a == b)
            .count();
        panic!(
            "handshake output differs from the sans-IO model at byte {at} of {} (server sent {})",
            expected.len(),
            output.len()
        );
    }
    let HandshakeStatus::Done(negotiated) = &model.status else {
        assert_eq!(
            output.len(),
            expected.len(),
            "output after the handshake ended"
        );
        return;
    };
    let ctx = context(negotiated, &infos[negotiated.export]);
    let owed = owed_replies(&ctx, &input[model.consumed..]);
    let (replies, complete) = parse_replies(&ctx, &output[expected.len()..], &owed);
    match_replies(&ctx, &owed, &replies, complete);
}

fn context(n: &Negotiated, info: &ExportInfo) -> TransmissionContext {
    TransmissionContext {
        mode: n.mode,
        size: info.size,
        flags: n.flags,
        block_size: info.block_size,
        meta: n.meta,
    }
}

/// A request the server must answer, and what validation made of it.
#[derive(Debug)]
pub struct Owed {
    pub header: RequestHeader,
    pub verdict: Result<Command, Errno>,
}

/// The requests a server reading `requests` must answer, as a [`ServerSession`] reports them:
/// every request and refusal up to the end of the stream (a bad magic, an oversized payload,
/// `NBD_CMD_DISC`) or of the input, except a write whose payload the input cuts short.
fn owed_replies(ctx: &TransmissionContext, mut requests: &[u8]) -> Vec<Owed> {
    let mut session = ServerSession::new(*ctx);
    let mut owed = Vec::new();
    while let Some(event) = next_event(&mut session, &mut requests) {
        let (header, verdict) = match event {
            ServerEvent::Request {
                header, command, ..
            } => (header, Ok(command)),
            ServerEvent::Rejected {
                header, rejection, ..
            } => (header, Err(rejection.errno)),
            ServerEvent::End(_) => break,
        };
        // A write is owed a reply only once its payload is in; the session reports a refused
        // request only after its payload has been dropped, so a refusal is always owed.
        if skip_payload(&mut session, &mut requests) {
            owed.push(Owed { header, verdict });
        }
    }
    // The input ends as the client's half-close ends the server's reads. Whatever that cuts
    // short is owed nothing: a partial header, a refused payload never reported, or a write
    // whose payload never arrived, which the server drops unanswered.
    session.close();
    owed
}

/// Feeds `requests` to `session` up to its next event; `None` once the input is used up (or
/// a write's payload is next and the input ended inside it).
fn next_event(session: &mut ServerSession, requests: &mut &[u8]) -> Option<ServerEvent> {
    loop {
        let (used, event) = session.handle_input(requests);
        *requests = &requests[used..];
        if event.is_some() || used == 0 {
            return event;
        }
    }
}

/// Skips the current write's payload in `requests`, as the server receives it into the
/// export; whether it was all there. `true` when no payload is pending.
fn skip_payload(session: &mut ServerSession, requests: &mut &[u8]) -> bool {
    let ServerWant::Payload { remaining, .. } = session.want() else {
        return true;
    };
    let bytes = remaining.min(requests.len());
    *requests = &requests[bytes..];
    session.payload_received(bytes)
}

/// One chunk of a structured or extended reply.
#[derive(Debug)]
pub struct Chunk<'a> {
    pub kind: u16,
    pub offset: u64,
    pub payload: &'a [u8],
}

/// One whole reply: a simple reply, or chunks up to the one flagged `DONE`.
#[derive(Debug)]
pub enum Reply<'a> {
    Simple { cookie: u64, error: u32 },
    Chunks { cookie: u64, chunks: Vec<Chunk<'a>> },
}

impl Reply<'_> {
    fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } | Reply::Chunks { cookie, .. } => *cookie,
        }
    }
}

/// Splits the transmission output into replies. `false` if parsing had to stop early: a
/// simple reply whose data length depends on which of several requests it answers.
fn parse_replies<'a>(
    ctx: &TransmissionContext,
    mut out: &'a [u8],
    owed: &[Owed],
) -> (Vec<Reply<'a>>, bool) {
    let mut replies = Vec::new();
    while !out.is_empty() {
        let (header, size) = decode_header(out, ctx.mode);
        out = &out[size..];
        let reply = match header {
            ReplyHeader::Simple { error, cookie } => {
                let Some(data) = simple_data_bytes(owed, cookie, error) else {
                    return (replies, false);
                };
                assert!(
                    data <= out.len(),
                    "simple reply with {data} bytes of data cut short"
                );
                out = &out[data..];
                Reply::Simple { cookie, error }
            }
            ReplyHeader::Chunk { .. } => {
                let (cookie, chunks) = parse_chunks(ctx.mode, header, &mut out);
                Reply::Chunks { cookie, chunks }
            }
        };
        replies.push(reply);
    }
    (replies, true)
}

fn decode_header(out: &[u8], mode: ReplyMode) -> (ReplyHeader, usize) {
    match ReplyHeader::decode(out, mode) {
        Ok(Some(decoded)) => decoded,
        Ok(None) => panic!("reply header cut short: {out:02x?}"),
        Err(e) => panic!("undecodable reply in {mode:?}: {e}"),
    }
}

/// Data bytes after a simple reply: a successful read's length. `None` if requests sharing
/// the cookie disagree.
fn simple_data_bytes(owed: &[Owed], cookie: u64, error: u32) -> Option<usize> {
    let mut lengths =
        owed.iter()
            .filter(|o| o.header.cookie == cookie)
            .map(|o| match (o.verdict, error) {
                (Ok(Command::Read), 0) => o.header.length as usize,
                _ => 0,
            });
    let first = lengths.next().unwrap_or(0);
    lengths.all(|n| n == first).then_some(first)
}

/// Reads chunks from `first` up to the `DONE` one. The server sends each reply in one
/// write under the connection's writer lock, so one reply's chunks are never interleaved.
fn parse_chunks<'a>(
    mode: ReplyMode,
    first: ReplyHeader,
    out: &mut &'a [u8],
) -> (u64, Vec<Chunk<'a>>) {
    let mut chunks = Vec::new();
    let mut header = first;
    let mut reply_cookie = None;
    loop {
        let ReplyHeader::Chunk {
            flags,
            kind,
            cookie,
            offset,
            length,
        } = header
        else {
            panic!("simple reply inside a chunked reply");
        };
        assert_eq!(
            *reply_cookie.get_or_insert(cookie),
            cookie,
            "chunks interleaved"
        );
        assert_eq!(
            flags & !reply_flags::DONE,
            0,
            "unknown reply flags {flags:#x}"
        );
        let length = usize::try_from(length).expect("chunk length fits memory");
        assert!(length <= out.len(), "chunk payload of {length} cut short");
        let (payload, rest) = out.split_at(length);
        *out = rest;
        chunks.push(Chunk {
            kind,
            offset,
            payload,
        });
        if flags & reply_flags::DONE != 0 {
            return (cookie, chunks);
        }
        assert!(!out.is_empty(), "reply ends without a DONE chunk");
        let (next, size) = decode_header(out, mode);
        *out = &out[size..];
        header = next;
    }
}

/// Every reply must answer a distinct owed request with the same cookie, consistently; if
/// the output was parsed to the end, every owed request must be answered.
fn match_replies(ctx: &TransmissionContext, owed: &[Owed], replies: &[Reply<'_>], complete: bool) {
    let mut cookies: Vec<u64> = owed.iter().map(|o| o.header.cookie).collect();
    cookies.extend(replies.iter().map(Reply::cookie));
    cookies.sort_unstable();
    cookies.dedup();
    for cookie in cookies {
        let debts: Vec<&Owed> = owed.iter().filter(|o| o.header.cookie == cookie).collect();
        let paid: Vec<&Reply<'_>> = replies.iter().filter(|r| r.cookie() == cookie).collect();
        let fits = |r: usize, d: usize| answers(ctx, debts[d], paid[r]).is_ok();
        let matched = max_matching(paid.len(), debts.len(), fits);
        if matched < paid.len() {
            let why = debts.first().map(|d| answers(ctx, d, paid[0]));
            panic!("cookie {cookie:#x}: {} replies, {} requests, only {matched} fit ({why:?}); requests {debts:?}; replies {paid:?}", paid.len(), debts.len());
        }
        if complete {
            assert_eq!(
                matched,
                debts.len(),
                "cookie {cookie:#x}: requests never answered: {debts:?}"
            );
        }
    }
}

/// Size of a maximum matching of `left` to `right` items (Kuhn's augmenting paths).
fn max_matching(left: usize, right: usize, fits: impl Fn(usize, usize) -> bool) -> usize {
    fn augment(
        l: usize,
        right: usize,
        fits: &dyn Fn(usize, usize) -> bool,
        seen: &mut [bool],
        owner: &mut [Option<usize>],
    ) -> bool {
        for r in 0..right {
            if seen[r] || !fits(l, r) {
                continue;
            }
            seen[r] = true;
            if owner[r].is_none_or(|other| augment(other, right, fits, seen, owner)) {
                owner[r] = Some(l);
                return true;
            }
        }
        false
    }
    let mut owner = vec![None; right];
    (0..left)
        .filter(|&l| augment(l, right, &fits, &mut vec![false; right], &mut owner))
        .count()
}
