//! One client connection on the portable engine: the handshake, then a reader that decodes
//! and validates requests, receives each write payload straight into the buffer the backend
//! writes from, and hands the request to a worker, which runs it and sends the whole reply in
//! one vectored write.

use std::io::{self, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};
use zcnbd_proto::{
    validate_request, Command, HandshakeStatus, Negotiated, RequestHeader, ServerHandshake,
    TransmissionContext,
};

use crate::dispatch::{error_reply, Dispatcher, Reply, Request};
use crate::inflight::Inflight;
use crate::server::Server;
use crate::stream::Stream;

/// Serves one client from handshake to close.
pub fn serve_client(shared: Arc<Server>, mut stream: Stream, peer: &str) {
    if let Err(e) = stream.set_blocking() {
        warn!(%peer, "cannot configure socket: {e}");
        return;
    }
    match handshake(&shared, &mut stream, peer) {
        Ok(Some((negotiated, leftover))) => {
            let export = &shared.infos[negotiated.export];
            info!(%peer, export = %export.name, mode = ?negotiated.mode, "client attached");
            let result = match &shared.engine {
                Some(engine) if leftover.is_empty() => engine.serve(
                    stream,
                    transmission_context(&shared, &negotiated),
                    dispatcher(&shared, &negotiated),
                ),
                _ => transmission(&shared, stream, negotiated, leftover),
            };
            if let Err(e) = result {
                debug!(%peer, "connection ended: {e}");
            }
            info!(%peer, "client detached");
        }
        Ok(None) => debug!(%peer, "handshake ended without transmission"),
        Err(e) => debug!(%peer, "handshake failed: {e}"),
    }
}

/// Runs the handshake; `Some` with the outcome and any bytes already read past it.
fn handshake(
    shared: &Server,
    stream: &mut Stream,
    peer: &str,
) -> io::Result<Option<(Negotiated, Vec<u8>)>> {
    let limits = &shared.limits;
    let deadline = Instant::now() + Duration::from_millis(limits.handshake_timeout_ms);
    let mut hs = ServerHandshake::new(limits.handshake);
    let mut input = vec![0u8; hs.input_bytes_max()];
    let mut filled = 0;
    loop {
        if let Err(e) = consume_input(&mut hs, &mut input, &mut filled, &shared.infos) {
            warn!(%peer, "handshake refused: {e}");
            let _ = stream.write_all_vectored(&mut [io::IoSlice::new(hs.pending_output())]);
            return Ok(None);
        }
        let out = hs.pending_output();
        let sent = out.len();
        stream.write_all_vectored(&mut [io::IoSlice::new(out)])?;
        hs.consume_output(sent);
        match hs.status() {
            HandshakeStatus::Done(n) => return Ok(Some((n, input[..filled].to_vec()))),
            HandshakeStatus::Aborted => return Ok(None),
            HandshakeStatus::Negotiating => {}
        }
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            warn!(%peer, "handshake timed out");
            return Ok(None);
        };
        if shared.is_shutting_down() || filled == input.len() {
            return Ok(None);
        }
        stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match stream.read(&mut input[filled..]) {
            Ok(0) => return Ok(None),
            Ok(n) => filled += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                warn!(%peer, "handshake timed out");
                return Ok(None);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Feeds buffered input to the handshake until it needs more or finishes.
fn consume_input(
    hs: &mut ServerHandshake,
    input: &mut [u8],
    filled: &mut usize,
    exports: &[zcnbd_proto::ExportInfo],
) -> Result<(), zcnbd_proto::HandshakeError> {
    while hs.status() == HandshakeStatus::Negotiating {
        let used = hs.handle_input(&input[..*filled], exports)?;
        if used == 0 {
            break;
        }
        input.copy_within(used..*filled, 0);
        *filled -= used;
    }
    Ok(())
}

/// State the reader shares with the workers running this connection's requests.
struct ConnState {
    writer: Mutex<Stream>,
    inflight: Inflight,
    dispatcher: Dispatcher,
    failed: AtomicBool,
}

impl ConnState {
    /// Sends a whole reply; on failure the connection is torn down so the reader stops.
    fn send(&self, reply: &Reply) {
        let mut slices = reply.io_slices();
        let stats = &self.dispatcher.stats;
        stats.requests.add(1);
        stats.syscalls.add(1);
        stats.sent_plain_bytes.add(reply.data_bytes() as u64);
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = writer.write_all_vectored(&mut slices) {
            if !self.failed.swap(true, Ordering::Relaxed) {
                debug!("reply failed: {e}; disconnecting");
            }
            let _ = writer.shutdown(Shutdown::Both);
        }
    }
}

/// The request stream: bytes left over from the handshake, then the socket.
struct RequestReader {
    stream: Stream,
    leftover: Vec<u8>,
    used: usize,
}

impl RequestReader {
    fn read_exact_or_eof(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let n = (self.leftover.len() - self.used).min(buf.len());
        if n == 0 {
            return self.stream.read_exact_or_eof(buf);
        }
        buf[..n].copy_from_slice(&self.leftover[self.used..self.used + n]);
        self.used += n;
        if n < buf.len() && !self.stream.read_exact_or_eof(&mut buf[n..])? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(true)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self.read_exact_or_eof(buf)? {
            true => Ok(()),
            false if buf.is_empty() => Ok(()),
            false => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }

    /// Reads and drops `len` payload bytes of a refused request.
    fn discard(&mut self, mut len: usize) -> io::Result<()> {
        let mut scratch = [0u8; 16 * 1024];
        while len > 0 {
            let n = len.min(scratch.len());
            self.read_exact(&mut scratch[..n])?;
            len -= n;
        }
        Ok(())
    }
}

/// What a connection's requests are validated against.
fn transmission_context(shared: &Server, negotiated: &Negotiated) -> TransmissionContext {
    let info = &shared.infos[negotiated.export];
    TransmissionContext {
        mode: negotiated.mode,
        size: info.size,
        flags: negotiated.flags,
        block_size: info.block_size,
        base_allocation: negotiated.base_allocation,
    }
}

/// Runs a connection's requests against its export.
fn dispatcher(shared: &Server, negotiated: &Negotiated) -> Dispatcher {
    Dispatcher {
        backend: Arc::clone(&shared.exports[negotiated.export].backend),
        ctx: transmission_context(shared, negotiated),
        pool: Arc::clone(&shared.pool),
        stats: Arc::clone(&shared.stats),
    }
}

/// The portable engine's transmission phase.
fn transmission(
    shared: &Arc<Server>,
    stream: Stream,
    negotiated: Negotiated,
    leftover: Vec<u8>,
) -> io::Result<()> {
    stream.set_read_timeout(None)?;
    let limits = &shared.limits;
    let conn = Arc::new(ConnState {
        writer: Mutex::new(stream.try_clone()?),
        inflight: Inflight::new(limits.requests_inflight_max, limits.inflight_bytes_max),
        dispatcher: dispatcher(shared, &negotiated),
        failed: AtomicBool::new(false),
    });
    let mut reader = RequestReader {
        stream,
        leftover,
        used: 0,
    };
    let result = read_requests(shared, &conn, &mut reader);
    // "The server MUST handle all outstanding requests" before closing.
    conn.inflight.wait_idle();
    let _ = reader.stream.shutdown(Shutdown::Both);
    result
}

fn read_requests(
    shared: &Arc<Server>,
    conn: &Arc<ConnState>,
    reader: &mut RequestReader,
) -> io::Result<()> {
    let ctx = conn.dispatcher.ctx;
    let header_bytes = ctx.mode.request_header_bytes();
    let payload_max = u64::from(ctx.block_size.payload_max);
    let mut raw = [0u8; 32];
    while !shared.is_shutting_down() && !conn.failed.load(Ordering::Relaxed) {
        conn.dispatcher.stats.syscalls.add(1);
        if !reader.read_exact_or_eof(&mut raw[..header_bytes])? {
            return Ok(());
        }
        let header = match RequestHeader::decode(&raw[..header_bytes], ctx.mode) {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(()),
            Err(e) => {
                warn!("{e}: disconnecting client");
                return Ok(());
            }
        };
        let payload = header.payload_bytes(ctx.mode);
        // "A server SHOULD initiate hard disconnect if a client sets the
        // NBD_CMD_FLAG_PAYLOAD_LEN flag and uses a length larger than a server's advertised
        // ... maximum payload length"; a compact write that large gets the same treatment.
        if payload > payload_max {
            warn!(
                payload,
                payload_max, "payload over the advertised maximum: disconnecting"
            );
            return Ok(());
        }
        let payload = payload as usize;
        match validate_request(&header, &ctx) {
            Err(rejection) => {
                debug!(
                    cookie = header.cookie,
                    kind = header.kind,
                    "refused: {}",
                    rejection.reason
                );
                // "a server SHOULD gracefully consume length bytes of payload (even if it then
                // replies with an NBD_EINVAL failure ...), and proceed with the next command."
                reader.discard(payload)?;
                conn.send(&error_reply(
                    ctx.mode,
                    &header,
                    rejection.errno,
                    rejection.reason,
                ));
            }
            Ok(Command::Disc) => return Ok(()),
            Ok(command) => submit(shared, conn, reader, header, command, payload)?,
        }
    }
    Ok(())
}

/// Receives the payload (if any) and queues the request for a worker.
fn submit(
    shared: &Arc<Server>,
    conn: &Arc<ConnState>,
    reader: &mut RequestReader,
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
    conn.inflight.acquire(held);
    let buffer = if payload > 0 {
        let mut buf = shared.pool.get(payload);
        shared.stats.syscalls.add(1);
        if let Err(e) = reader.read_exact(&mut buf) {
            conn.inflight.release(held);
            return Err(e);
        }
        Some(buf)
    } else {
        None
    };
    let conn = Arc::clone(conn);
    shared.workers.submit(Box::new(move || {
        let reply = conn.dispatcher.execute(Request {
            header,
            command,
            payload: buffer,
        });
        conn.send(&reply);
        conn.inflight.release(held);
    }));
    Ok(())
}
