//! The portable engine's request reader: the request stream (bytes left over from the
//! handshake, then the socket), decoded by the sans-IO session; each request's payload
//! received straight where it goes; each request started (here, when the stack never waits,
//! else by the dispatcher).

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;
use zcnbd_proto::{Command, RequestHeader, ServerEvent, ServerSession, ServerWant};

use super::conn::ConnState;
use super::mapped;
use super::writer::Writer;
use crate::dispatch::{Landed, Request};
use crate::engine::budget::SharedBudget;
use crate::engine::poll::{holds_for_payload, PollWindow, Waited};
use crate::engine::wait_trial::{Wait, WaitTrial, COALESCE_COMPLETIONS, OVERLAP_REPLIES};
use crate::engine::DISCARD_BYTES;
use crate::export::Map;
use crate::session::channel::{Inbound, Outbound};
use crate::stats::Stats;
use crate::stream::Stream;
use crate::sys::mapping::MappedRange;
use crate::sys::process::thread_cpu_time;

/// Waits inside a payload longer than this never poll (see [`Direct::polls_here`]): a
/// small write's payload may come in a TLS record of its own just after its header (libnbd
/// sends them so), a long one streams.
pub(super) const POLL_PAYLOAD_MAX_BYTES: usize = 64 * 1024;

/// Why reading requests stopped early.
pub(super) const IDLE: &str = "idle timeout";

/// The request stream: bytes left over from the handshake, then the socket.
pub(super) struct RequestReader<'a> {
    stream: Inbound,
    /// Where a write's payload lands (reused for every write).
    map: Map,
    leftover: Vec<u8>,
    used: usize,
    /// Where replies go when this thread sends them itself (every request runs on it):
    /// they are queued as requests finish and sent before a read waits.
    direct: Option<Direct<'a>>,
}

/// The sending half of a connection whose reader also sends its replies.
pub(super) struct Direct<'a> {
    pub writer: Writer<'a>,
    pub out: Outbound,
    /// How long a read that would wait polls first.
    pub poll: PollWindow,
    pub stats: Arc<Stats>,
    /// Requests started since the reader last waited.
    pub started: u64,
    /// The next read is of a request header or of a payload of at most
    /// [`POLL_PAYLOAD_MAX_BYTES`]: only such a wait polls (inside a long payload the client
    /// is streaming, and polling between its pieces only costs CPU).
    pub polls_here: bool,
    /// The next read is of a short payload (at most
    /// [`crate::engine::poll::PAYLOAD_HOLD_MAX_BYTES`]) whose request header has arrived (see
    /// [`crate::engine::poll::PAYLOAD_HOLD`]).
    pub in_short_payload: bool,
    /// How waits for a pipelining client go (`engine/wait_trial.rs`): here, coalescing
    /// holds queued replies for more requests, overlapping polls and sends them in fours.
    pub trial: WaitTrial,
    /// What the trials said at the last wait.
    pub wait: Wait,
    /// Since when queued replies have been held for more requests to answer with them.
    pub holding: Option<Instant>,
    /// How long they are held at most (`--coalesce-max-us`).
    pub coalesce_max: Duration,
}

impl Direct<'_> {
    /// Holds the queued replies for more requests while fewer than [`COALESCE_COMPLETIONS`]
    /// are queued, up to `coalesce_max` since the first was held: the read of the next
    /// request's bytes if they came in time (`Ok(None)`: send now).
    fn hold_for_requests(
        &mut self,
        now: Instant,
        stream: &mut Inbound,
        target: &mut Target<'_>,
        at: usize,
    ) -> io::Result<Option<io::Result<usize>>> {
        if self.writer.queue.pending() >= COALESCE_COMPLETIONS {
            return Ok(None);
        }
        let since = *self.holding.get_or_insert(now);
        let held = now.saturating_duration_since(since);
        let Some(left) = self.coalesce_max.checked_sub(held) else {
            return Ok(None);
        };
        self.stats.waited_coalesced();
        if !stream.socket().wait_readable(Some(left))? {
            return Ok(None);
        }
        match target.read_nowait(stream, at) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            other => Ok(Some(other)),
        }
    }

    /// Sends every reply queued now.
    fn send_queued(&mut self) -> io::Result<()> {
        self.holding = None;
        match self.writer.send_queued(&mut self.out) {
            true => Ok(()),
            false => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "replies could not be sent",
            )),
        }
    }
}

/// Where a read puts bytes: a buffer of ours, or a range of the export's mapping (a write
/// payload received in place, never touched through a Rust reference).
enum Target<'a> {
    Buf(&'a mut [u8]),
    Mapped(&'a MappedRange),
}

impl Target<'_> {
    fn len(&self) -> usize {
        match self {
            Target::Buf(b) => b.len(),
            Target::Mapped(m) => m.len(),
        }
    }

    /// Copies `bytes` (left over from the handshake) in at `at`.
    fn put(&mut self, at: usize, bytes: &[u8]) {
        match self {
            Target::Buf(b) => b[at..at + bytes.len()].copy_from_slice(bytes),
            Target::Mapped(m) => {
                // In range: `at + bytes.len() <= self.len()` (see `fill_target`).
                m.copy_in(at, bytes);
            }
        }
    }

    /// One read from `stream` into the target from `at`.
    fn read(&mut self, stream: &mut Inbound, at: usize) -> io::Result<usize> {
        match self {
            Target::Buf(b) => stream.read(&mut b[at..]),
            Target::Mapped(m) => stream.read_into(m, at, m.len() - at),
        }
    }

    /// Like `read`, but `WouldBlock` instead of waiting.
    fn read_nowait(&mut self, stream: &mut Inbound, at: usize) -> io::Result<usize> {
        match self {
            Target::Buf(b) => stream.read_nowait(&mut b[at..]),
            Target::Mapped(m) => stream.read_into_nowait(m, at, m.len() - at),
        }
    }
}

impl<'a> RequestReader<'a> {
    /// Reads `stream`, after `leftover`; sends its replies itself if `direct`.
    pub fn new(stream: Inbound, leftover: Vec<u8>, direct: Option<Direct<'a>>) -> Self {
        RequestReader {
            stream,
            map: Map::default(),
            leftover,
            used: 0,
            direct,
        }
    }

    /// The socket (for shutdown).
    pub fn socket(&self) -> &Stream {
        self.stream.socket()
    }

    /// Sends whatever replies this thread still owes, then ends the session's sending side
    /// (under TLS, a close_notify).
    pub fn finish(&mut self) {
        if let Some(direct) = &mut self.direct {
            let _ = direct.send_queued();
            direct.writer.finish(&mut direct.out);
        }
    }

    /// One read into `target` from `at`. When this thread sends its replies, a read that
    /// would wait sends the queued ones first (one send per burst of requests, never waiting
    /// on a client that is itself waiting for them; overlapping sends them sooner), then
    /// polls for the next bytes for a while (`engine/poll.rs`) before it sleeps.
    fn read_step(&mut self, target: &mut Target<'_>, at: usize) -> io::Result<usize> {
        let Some(direct) = &mut self.direct else {
            return target.read(&mut self.stream, at);
        };
        match target.read_nowait(&mut self.stream, at) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            other => return other,
        }
        let started = Instant::now();
        let requests = std::mem::take(&mut direct.started);
        let (ordinary, wait) = match direct.polls_here {
            true => {
                let ordinary = direct.poll.polls_after(requests);
                direct.trial.count(requests);
                let pipelined = direct.poll.pipelined();
                direct.wait = direct.trial.next(started, pipelined, thread_cpu_time);
                (ordinary, direct.wait)
            }
            false => {
                direct.trial.busy(started);
                (false, Wait::Sleep)
            }
        };
        let stream = &mut self.stream;
        if direct.writer.queue.has_pending() {
            // The rest of a short request already on its way comes first, briefly, so its
            // reply can leave with the queued ones.
            if direct.in_short_payload && direct.polls_here {
                let found = direct.poll.hold_for_payload(started, || {
                    match target.read_nowait(stream, at) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                        other => Some(other),
                    }
                });
                if let Some(read) = found {
                    return read;
                }
            }
            if wait == Wait::Coalesce {
                if let Some(read) = direct.hold_for_requests(started, stream, target, at)? {
                    return read;
                }
            }
            direct.send_queued()?;
        }
        // As on a ring: the ordinary rule polls only while the trials say sleep; polling
        // and overlapping poll whatever it says.
        let polls = (ordinary && wait == Wait::Sleep) || matches!(wait, Wait::Poll | Wait::Overlap);
        let polled = match polls {
            true => direct
                .poll
                .poll(started, || match target.read_nowait(stream, at) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                    other => Some(other),
                }),
            false => None,
        };
        direct.stats.waited(polled.is_some());
        if let Some(read) = polled {
            direct.poll.learn(Waited::Polled);
            return read;
        }
        let read = target.read(stream, at);
        direct.poll.learn(Waited::Slept(started.elapsed()));
        read
    }

    /// Says whether waits for the next reads may poll (see [`Direct::polls_here`]).
    fn polls_here(&mut self, polls: bool) {
        if let Some(direct) = &mut self.direct {
            direct.polls_here = polls;
        }
    }

    /// Says whether the next reads are of a short payload (see [`Direct::in_short_payload`]).
    fn in_short_payload(&mut self, short: bool) {
        if let Some(direct) = &mut self.direct {
            direct.in_short_payload = short;
        }
    }

    /// Counts a request started (polling watches how many come per wake).
    fn started(&mut self) {
        if let Some(direct) = &mut self.direct {
            direct.started += 1;
        }
    }

    /// While overlapping, sends the queued replies once [`OVERLAP_REPLIES`] are queued,
    /// before reading the rest of the client's burst.
    fn overlap(&mut self) -> io::Result<()> {
        match &mut self.direct {
            Some(direct)
                if direct.wait == Wait::Overlap
                    && direct.writer.queue.pending() >= OVERLAP_REPLIES =>
            {
                // Busy, however long it goes without waiting for the client: a turn longer
                // than the trials allow would void them.
                direct.trial.busy(Instant::now());
                direct.stats.sent_overlapped();
                direct.send_queued()
            }
            _ => Ok(()),
        }
    }

    /// Makes room for a request holding `bytes` in the in-flight budget: when this thread
    /// sends the replies, by sending them now if `acquire` would otherwise wait for them.
    fn make_room(&mut self, inflight: &SharedBudget, bytes: usize) -> io::Result<()> {
        match &mut self.direct {
            Some(direct) if !inflight.has_room(bytes) => direct.send_queued(),
            _ => Ok(()),
        }
    }

    /// Fills `buf`; `Ok(false)` on a clean end of stream before its first byte. A read that
    /// times out (`--idle-timeout`) ends the stream while `busy` says nothing is in flight.
    fn fill(&mut self, buf: &mut [u8], busy: &dyn Fn() -> bool) -> io::Result<bool> {
        Ok(self.fill_target(Target::Buf(buf), busy)?.is_some())
    }

    /// Fills `target`: `Ok(None)` on a clean end of stream before its first byte, else how
    /// many of its bytes were left over from the handshake (copied, not received).
    fn fill_target(
        &mut self,
        mut target: Target<'_>,
        busy: &dyn Fn() -> bool,
    ) -> io::Result<Option<usize>> {
        let len = target.len();
        let staged = (self.leftover.len() - self.used).min(len);
        if staged > 0 {
            target.put(0, &self.leftover[self.used..self.used + staged]);
            self.used += staged;
        }
        let mut done = staged;
        while done < len {
            match self.read_step(&mut target, done) {
                Ok(0) if done == 0 => return Ok(None),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if !busy() {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, IDLE));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Some(staged))
    }

    fn read_exact(&mut self, buf: &mut [u8], busy: &dyn Fn() -> bool) -> io::Result<()> {
        match self.fill(buf, busy)? {
            true => Ok(()),
            false if buf.is_empty() => Ok(()),
            false => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }

    /// Receives all of `range` (a write payload landing in the export): how many bytes were
    /// left over from the handshake.
    fn read_into(&mut self, range: &MappedRange, busy: &dyn Fn() -> bool) -> io::Result<usize> {
        self.fill_target(Target::Mapped(range), busy)?
            .ok_or_else(|| io::ErrorKind::UnexpectedEof.into())
    }
}

/// Reads requests through the sans-IO session until the client is done, the connection
/// fails or the server shuts down.
pub(super) fn read_requests(
    stopping: &AtomicBool,
    conn: &Arc<ConnState>,
    reader: &mut RequestReader<'_>,
) -> io::Result<()> {
    let mut session = ServerSession::new(conn.dispatcher.ctx);
    let busy = || !conn.inflight.is_idle();
    let mut raw = [0u8; 32];
    let mut scratch = [0u8; DISCARD_BYTES];
    while !stopping.load(Ordering::Relaxed) && !conn.replies.failed() {
        let (used, event) = match session.want() {
            ServerWant::Header(missing) => {
                conn.dispatcher.stats.syscall();
                // A clean end of stream can only come between requests.
                reader.polls_here(true);
                reader.in_short_payload(false);
                let filled = reader.fill(&mut raw[..missing], &busy);
                if !filled? {
                    return Ok(());
                }
                session.handle_input(&raw[..missing])
            }
            ServerWant::Discard { remaining } => {
                let n = remaining.min(scratch.len());
                reader.polls_here(false);
                reader.read_exact(&mut scratch[..n], &busy)?;
                session.handle_input(&scratch[..n])
            }
            // Payloads are received by `submit`, right after their request's event.
            ServerWant::Payload { .. } | ServerWant::Ended => return Ok(()),
        };
        debug_assert!(used > 0, "the session consumed nothing it asked for");
        if matches!(
            event,
            Some(ServerEvent::Request { .. } | ServerEvent::Rejected { .. })
        ) {
            reader.started();
        }
        match event {
            None => {}
            Some(ServerEvent::Request {
                header,
                command,
                payload_bytes,
            }) => {
                submit(conn, reader, header, command, payload_bytes)?;
                session.payload_received(payload_bytes);
                reader.overlap()?;
            }
            Some(ServerEvent::Rejected {
                header, rejection, ..
            }) => {
                reader.make_room(&conn.inflight, 0)?;
                conn.inflight.acquire(0);
                conn.answer(conn.dispatcher.refused(&header, &rejection), 0);
            }
            Some(ServerEvent::End(reason)) => {
                if reason.is_violation() {
                    warn!("{reason}: disconnecting client");
                }
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Receives the payload (if any) and starts the request (on a worker, or on an asynchronous
/// backend); its reply is queued for the writer.
fn submit(
    conn: &Arc<ConnState>,
    reader: &mut RequestReader<'_>,
    header: RequestHeader,
    command: Command,
    payload: usize,
) -> io::Result<()> {
    reader.polls_here(payload <= POLL_PAYLOAD_MAX_BYTES);
    reader.in_short_payload(holds_for_payload(payload));
    // Reads hold a buffer of their length while in flight; writes hold their payload.
    let held = if command == Command::Read {
        header.length as usize
    } else {
        payload
    };
    reader.make_room(&conn.inflight, held)?;
    conn.inflight.acquire(held);
    let dispatcher = &conn.dispatcher;
    if let (Command::Read, Some(min_len)) = (command, conn.mapped_min) {
        if let Some(reply) = mapped::read(dispatcher, &header, min_len, &mut reader.map) {
            conn.answer(reply, held);
            return Ok(());
        }
    }
    // This request is counted in flight already: the client is idle unless others are.
    let others_busy = || conn.inflight.requests() > 1;
    let mut buffer = None;
    let mut landed = None;
    let landing = match conn.in_place {
        true => mapped::landing(&dispatcher.stack, &header, payload, &mut reader.map),
        false => None,
    };
    // The lease lives until the request is started: a payload cut short ends it on the way
    // out, and the layers are told of the bytes that landed all the same.
    if let Some((range, _lease)) = landing {
        dispatcher.stats.syscall();
        match reader.read_into(&range, &others_busy) {
            Ok(staged) => {
                landed = Some(Landed {
                    len: payload,
                    staged,
                })
            }
            Err(e) => {
                conn.inflight.release(held);
                return Err(e);
            }
        }
    } else if payload > 0 {
        let mut buf = dispatcher.pool.get(payload);
        dispatcher.stats.syscall();
        if let Err(e) = reader.read_exact(&mut buf, &others_busy) {
            conn.inflight.release(held);
            return Err(e);
        }
        buffer = Some(buf);
    }
    let request = Request {
        header,
        command,
        payload: buffer,
        landed,
    };
    if conn.inline {
        conn.answer(dispatcher.execute_guarded(request), held);
        return Ok(());
    }
    let answering = Arc::clone(conn);
    dispatcher.start(request, move |reply| answering.answer(reply, held));
    Ok(())
}
