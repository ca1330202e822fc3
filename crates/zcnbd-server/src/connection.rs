//! One client connection: the handshake, then the transmission phase on the io_uring engine
//! or, here, on the portable engine: a reader that decodes and validates requests, receives
//! each write payload straight into the buffer the backend writes from, and hands the request
//! to the dispatcher, which runs it (on a worker, or on an asynchronous backend) and hands
//! the reply back; it is queued for the connection's writer (`reply_writer`), which sends
//! it. No worker ever waits on a client's socket. When every request runs on the reader (a
//! backend that never waits), the reader sends the queued replies itself whenever its next
//! read would wait, and there is no writer thread.

use std::io::{self, Read};
use std::net::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};
use zcnbd_proto::{
    Command, Negotiated, RequestHeader, ServerEvent, ServerSession, ServerWant, TransmissionContext,
};

use crate::admission::{AttachTicket, HandshakeTicket};
use crate::channel::{Channel, Inbound, Outbound};
use crate::dispatch::{error_reply, Dispatcher, Landed, Reply, Request};
use crate::export::Map;
use crate::export_set::Offered;
use crate::inflight::Inflight;
use crate::negotiation::{handshake, Attached};
use crate::reply_writer::{ReplyQueue, Writer};
use crate::server::{Closed, Server};
use crate::stream::Stream;
use crate::sys::mapping::MappedRange;
use crate::tls_feed;

/// Serves one client from handshake to close: here, or on the io_uring engine (then this
/// returns once the connection is handed over). `closed` goes when the connection does.
pub fn serve_client(
    shared: Arc<Server>,
    stream: Stream,
    peer: &str,
    ticket: HandshakeTicket,
    closed: Closed,
) {
    if let Err(e) = stream.set_blocking() {
        warn!(%peer, "cannot configure socket: {e}");
        return;
    }
    let attached = handshake(&shared, stream, peer, &ticket);
    drop(ticket);
    let Attached {
        negotiated,
        export,
        leftover,
        ticket,
        channel,
    } = match attached {
        Ok(Some(attached)) => attached,
        Ok(None) => return debug!(%peer, "handshake ended without transmission"),
        Err(e) => return debug!(%peer, "handshake failed: {e}"),
    };
    let clients = shared.admission.attached();
    let tls = channel.is_tls();
    let name = export.name();
    info!(%peer, export = %name, mode = ?negotiated.mode, tls, clients, "client attached");
    let ctx = transmission_context(&export, &negotiated);
    let dispatcher = dispatcher(&shared, &export, ctx);
    let detach = Detach {
        peer: peer.to_owned(),
        _ticket: ticket,
        _closed: closed,
        _export: export,
    };
    // The io_uring engine sends plain bytes only: a TLS session whose records are made in
    // user space stays on the portable engine; under kTLS (the kernel encrypts what is
    // sent) a feed thread decrypts the requests for the ring.
    match (&shared.engine, channel) {
        (Some(engine), Channel::Plain(stream)) => {
            engine.attach(stream, ctx, dispatcher, leftover, Box::new(detach))
        }
        (Some(engine), Channel::Tls(halves)) if halves.kernel_sends() => {
            let (stream, reader, tally) = halves.into_kernel_parts();
            let feed = match tls_feed::start(reader, tally, peer) {
                Ok(feed) => feed,
                Err(e) => return warn!(%peer, "cannot start the TLS feed thread: {e}"),
            };
            engine.attach_fed(
                stream,
                Some(feed),
                ctx,
                dispatcher,
                leftover,
                Box::new(detach),
            )
        }
        (_, channel) => {
            if let Err(e) = transmission(&shared, channel, dispatcher, leftover) {
                debug!(%peer, "connection ended: {e}");
            }
            drop(detach);
        }
    }
}

/// What an attached client holds until its connection is closed: its place among the
/// attached (admission) and among the live sockets, and its export (which a reload may have
/// removed: the last client's `Detach` closes it). Dropping it logs the detach.
struct Detach {
    peer: String,
    _ticket: AttachTicket,
    _closed: Closed,
    _export: Arc<Offered>,
}

impl Drop for Detach {
    fn drop(&mut self) {
        info!(peer = %self.peer, "client detached");
    }
}

/// State the reader shares with the workers and the writer of this connection.
struct ConnState {
    replies: ReplyQueue,
    inflight: Inflight,
    dispatcher: Arc<Dispatcher>,
}

impl ConnState {
    /// What sends this connection's replies.
    fn writer(&self, write_timeout_ms: u64) -> Writer<'_> {
        Writer {
            queue: &self.replies,
            inflight: &self.inflight,
            stats: &self.dispatcher.stats,
            write_timeout_ms,
        }
    }

    /// Hands a reply to the writer; if the connection already failed, the request's place
    /// is given back at once.
    fn answer(&self, reply: Reply, held: usize) {
        if !self.replies.push(reply, held) {
            self.inflight.release(held);
        }
    }
}

/// Why reading requests stopped early.
const IDLE: &str = "idle timeout";
/// Scratch space for dropping the payload of a refused request.
const DISCARD_BYTES: usize = 16 * 1024;

/// The request stream: bytes left over from the handshake, then the socket.
struct RequestReader<'a> {
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
struct Direct<'a> {
    writer: Writer<'a>,
    out: Outbound,
}

impl Direct<'_> {
    /// Sends every reply queued now.
    fn send_queued(&mut self) -> io::Result<()> {
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

impl RequestReader<'_> {
    /// One read into `target` from `at`. Replies this thread owes are sent first if the
    /// read would wait: they go out in one send per burst of requests, and never wait on a
    /// client that is itself waiting for them.
    fn read_step(&mut self, target: &mut Target<'_>, at: usize) -> io::Result<usize> {
        if let Some(direct) = &mut self.direct {
            if direct.writer.queue.has_pending() {
                match target.read_nowait(&mut self.stream, at) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => direct.send_queued()?,
                    other => return other,
                }
            }
        }
        target.read(&mut self.stream, at)
    }

    /// Makes room for a request holding `bytes` in the in-flight budget: when this thread
    /// sends the replies, by sending them now if `acquire` would otherwise wait for them.
    fn make_room(&mut self, inflight: &Inflight, bytes: usize) -> io::Result<()> {
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

/// What a connection's requests are validated against.
fn transmission_context(export: &Offered, negotiated: &Negotiated) -> TransmissionContext {
    let info = &export.info;
    TransmissionContext {
        mode: negotiated.mode,
        size: info.size,
        flags: negotiated.flags,
        block_size: info.block_size,
        base_allocation: negotiated.base_allocation,
    }
}

/// Runs a connection's requests against its export.
fn dispatcher(shared: &Server, export: &Offered, ctx: TransmissionContext) -> Dispatcher {
    Dispatcher::new(
        Arc::clone(&export.export.stack),
        ctx,
        Arc::clone(&shared.pool),
        Arc::clone(&shared.stats),
        &shared.workers,
    )
}

/// The portable engine's transmission phase.
fn transmission(
    shared: &Arc<Server>,
    channel: Channel,
    dispatcher: Dispatcher,
    leftover: Vec<u8>,
) -> io::Result<()> {
    let limits = &shared.limits;
    let idle = limits
        .idle_timeout_ms
        .map(|ms| Duration::from_millis(ms.max(1)));
    channel.socket().set_read_timeout(idle)?;
    // The writer sends a memory export's reads from its pages: all of them in plain text;
    // under user-space TLS those of a record or more (shorter ones share records, copied);
    // none under kTLS, where the socket is written plain bytes.
    let mapped_min = match &channel {
        Channel::Plain(_) => Some(0),
        Channel::Tls(t) if t.kernel_sends() => None,
        Channel::Tls(_) => Some(crate::tls::RECORD_PLAINTEXT_BYTES),
    };
    let dispatcher = dispatcher.portable(mapped_min);
    let conn = Arc::new(ConnState {
        replies: ReplyQueue::default(),
        inflight: Inflight::new(limits.requests_inflight_max, limits.inflight_bytes_max),
        dispatcher: Arc::new(dispatcher),
    });
    let (inbound, outbound) = channel.split()?;
    let write_timeout_ms = limits.write_timeout_ms;
    // When every request runs on the reader (a backend that never waits), the reader sends
    // the replies too: no hand-off to a writer thread and back, and under TLS no contention
    // with one for the session. Otherwise a writer thread sends them, so no worker or
    // backend completion ever waits on the client's socket.
    let (direct, writer) = if conn.dispatcher.runs_inline() {
        let writer = conn.writer(write_timeout_ms);
        writer.prepare(&outbound);
        let direct = Direct {
            writer,
            out: outbound,
        };
        (Some(direct), None)
    } else {
        let writer_conn = Arc::clone(&conn);
        let thread = std::thread::Builder::new()
            .name("conn-writer".into())
            .spawn(move || writer_conn.writer(write_timeout_ms).run(outbound))?;
        (None, Some(thread))
    };
    let mut reader = RequestReader {
        stream: inbound,
        map: Map::default(),
        leftover,
        used: 0,
        direct,
    };
    let result = read_requests(shared, &conn, &mut reader);
    if let Err(e) = &result {
        if e.to_string() == IDLE {
            info!(
                idle_timeout_ms = limits.idle_timeout_ms,
                "client idle: disconnecting"
            );
        }
    }
    // "The server MUST handle all outstanding requests" before closing.
    if let Some(direct) = &mut reader.direct {
        let _ = direct.send_queued();
        direct.writer.finish(&mut direct.out);
    }
    conn.inflight.wait_idle();
    conn.replies.close();
    if let Some(writer) = writer {
        let _ = writer.join();
    }
    let _ = reader.stream.socket().shutdown(Shutdown::Both);
    result
}

/// Reads requests through the sans-IO session until the client is done, the connection
/// fails or the server shuts down.
fn read_requests(
    shared: &Arc<Server>,
    conn: &Arc<ConnState>,
    reader: &mut RequestReader<'_>,
) -> io::Result<()> {
    let mut session = ServerSession::new(conn.dispatcher.ctx);
    let busy = || !conn.inflight.is_idle();
    let mut raw = [0u8; 32];
    let mut scratch = [0u8; DISCARD_BYTES];
    while !shared.is_shutting_down() && !conn.replies.failed() {
        let (used, event) = match session.want() {
            ServerWant::Header(missing) => {
                conn.dispatcher.stats.syscall();
                // A clean end of stream can only come between requests.
                if !reader.fill(&mut raw[..missing], &busy)? {
                    return Ok(());
                }
                session.handle_input(&raw[..missing])
            }
            ServerWant::Discard { remaining } => {
                let n = remaining.min(scratch.len());
                reader.read_exact(&mut scratch[..n], &busy)?;
                session.handle_input(&scratch[..n])
            }
            // Payloads are received by `submit`, right after their request's event.
            ServerWant::Payload { .. } | ServerWant::Ended => return Ok(()),
        };
        debug_assert!(used > 0, "the session consumed nothing it asked for");
        match event {
            None => {}
            Some(ServerEvent::Request {
                header,
                command,
                payload_bytes,
            }) => {
                submit(shared, conn, reader, header, command, payload_bytes)?;
                session.payload_received(payload_bytes);
            }
            Some(ServerEvent::Rejected {
                header, rejection, ..
            }) => {
                debug!(
                    cookie = header.cookie,
                    kind = header.kind,
                    "refused: {}",
                    rejection.reason
                );
                reader.make_room(&conn.inflight, 0)?;
                conn.inflight.acquire(0);
                let mode = conn.dispatcher.ctx.mode;
                let reply = error_reply(mode, &header, rejection.errno, rejection.reason);
                conn.answer(reply, 0);
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
    shared: &Arc<Server>,
    conn: &Arc<ConnState>,
    reader: &mut RequestReader<'_>,
    header: RequestHeader,
    command: Command,
    payload: usize,
) -> io::Result<()> {
    // Reads hold a buffer of their length while in flight; writes hold their payload.
    let held = if command == Command::Read {
        header.length as usize
    } else {
        payload
    };
    reader.make_room(&conn.inflight, held)?;
    conn.inflight.acquire(held);
    // This request is counted in flight already: the client is idle unless others are.
    let others_busy = || conn.inflight.requests() > 1;
    let mut buffer = None;
    let mut landed = None;
    if let Some(range) = conn.dispatcher.landing(&header, payload, &mut reader.map) {
        shared.stats.syscall();
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
        let mut buf = shared.pool.get(payload);
        shared.stats.syscall();
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
    let answering = Arc::clone(conn);
    conn.dispatcher
        .start(request, move |reply| answering.answer(reply, held));
    Ok(())
}
