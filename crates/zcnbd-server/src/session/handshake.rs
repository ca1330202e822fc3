//! One client's handshake, on a blocking thread: drives the sans-IO `ServerHandshake` over
//! the socket within the handshake deadline, switches to TLS when the client asks
//! (`NBD_OPT_STARTTLS`; the TLS handshake counts against the same deadline), keeps the
//! connection's place in the handshake budget fresh while the client talks, and asks
//! admission before the client attaches. Each batch of options is answered from one snapshot
//! of the exports (`export_set.rs`), and the client that attaches keeps the export it chose
//! whatever a reload does later.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};
use zcnbd_proto::{HandshakeError, HandshakeStatus, Negotiated, ServerHandshake};

use super::admission::{AttachTicket, HandshakeTicket};
use super::channel::Channel;
use super::SessionContext;
use crate::export_set::Offered;
use crate::stream::Stream;
use crate::tls::{KernelSend, KtlsMode};

/// A finished handshake: what was agreed, the export chosen, bytes already read past it (the
/// first requests), the client's place among the attached, and its bytes (plain or under
/// TLS).
pub struct Attached {
    pub negotiated: Negotiated,
    /// The export `negotiated.export` named in the set the handshake chose it from.
    pub export: Arc<Offered>,
    pub leftover: Vec<u8>,
    pub ticket: AttachTicket,
    pub channel: Channel,
}

/// A client's place among the attached, and the export it holds.
type Admitted = (AttachTicket, Arc<Offered>);

/// Runs the handshake; `Some` once the client enters transmission.
pub fn handshake(
    shared: &SessionContext<'_>,
    stream: Stream,
    peer: &str,
    ticket: &HandshakeTicket,
) -> io::Result<Option<Attached>> {
    let limits = shared.limits;
    let deadline = Instant::now() + Duration::from_millis(limits.handshake_timeout_ms);
    // One TLS context for the whole handshake (the context's, taken when it began), whatever
    // a reload offers meanwhile.
    let mut hs = ServerHandshake::with_tls(limits.handshake, shared.tls_policy());
    let mut input = vec![0u8; hs.input_bytes_max()];
    let mut filled = 0;
    let mut attached = None;
    let mut channel = Channel::Plain(stream);
    loop {
        if let Err(e) = consume_input(
            shared,
            peer,
            &mut hs,
            &mut input,
            &mut filled,
            &mut attached,
        ) {
            warn!(%peer, "handshake refused: {e}");
            let _ = channel.write_all(hs.pending_output());
            return Ok(None);
        }
        let out = hs.pending_output();
        let sent = out.len();
        channel.write_all(out)?;
        hs.consume_output(sent);
        match hs.status() {
            HandshakeStatus::Done(negotiated) => {
                let leftover = input[..filled].to_vec();
                return Ok(attached.map(|(ticket, export)| Attached {
                    negotiated,
                    export,
                    leftover,
                    ticket,
                    channel,
                }));
            }
            HandshakeStatus::StartTls => {
                // Bytes read past STARTTLS are the client's first TLS bytes.
                let early = &input[..filled];
                let Some(secured) =
                    start_tls(shared, peer, ticket, channel, &mut hs, early, deadline)?
                else {
                    return Ok(None);
                };
                channel = secured;
                filled = 0;
                continue;
            }
            HandshakeStatus::Aborted => return Ok(None),
            HandshakeStatus::Negotiating => {}
        }
        if !read_more(
            shared,
            peer,
            &mut channel,
            &mut input,
            &mut filled,
            ticket,
            deadline,
        )? {
            return Ok(None);
        }
    }
}

/// Reads what the client sends next into `input[*filled..]`; `false` when the handshake
/// ends instead: the server stops, the input is full, the client left or let the deadline
/// pass.
fn read_more(
    shared: &SessionContext<'_>,
    peer: &str,
    channel: &mut Channel,
    input: &mut [u8],
    filled: &mut usize,
    ticket: &HandshakeTicket,
    deadline: Instant,
) -> io::Result<bool> {
    if shared.is_stopping() || *filled == input.len() {
        return Ok(false);
    }
    match read_until(channel, &mut input[*filled..], deadline)? {
        Some(0) => Ok(false),
        Some(n) => {
            *filled += n;
            ticket.touch();
            Ok(true)
        }
        None => {
            warn!(%peer, "handshake timed out");
            Ok(false)
        }
    }
}

/// One read that ends by `deadline`: `Ok(None)` once it has passed.
fn read_until(
    channel: &mut Channel,
    buf: &mut [u8],
    deadline: Instant,
) -> io::Result<Option<usize>> {
    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
        return Ok(None);
    };
    channel
        .socket()
        .set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    read_some(channel, buf)
}

/// One read within the handshake deadline (interrupted reads are retried): `Ok(None)` when
/// it timed out.
fn read_some(channel: &mut Channel, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match channel.read(buf) {
            Ok(n) => return Ok(Some(n)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Feeds buffered input to the handshake until it needs more or finishes, against one
/// snapshot of the exports; a client that asks to attach gets a place from admission (kept
/// in `attached` with the export) or a refusal, logged here.
fn consume_input(
    shared: &SessionContext<'_>,
    peer: &str,
    hs: &mut ServerHandshake,
    input: &mut [u8],
    filled: &mut usize,
    attached: &mut Option<Admitted>,
) -> Result<(), HandshakeError> {
    let exports = shared.exports.load();
    let mut admit = |index: usize| {
        // The handshake only names exports of the slice it was given.
        let Some(export) = exports.get(index) else {
            return false;
        };
        let limit = export.export.clients_max;
        match shared.admission.attach(&export.attached, limit) {
            Ok(ticket) => {
                *attached = Some((ticket, Arc::clone(export)));
                true
            }
            Err(refusal) => {
                warn!(%peer, export = %export.name(), "client refused: {refusal}");
                false
            }
        }
    };
    while hs.status() == HandshakeStatus::Negotiating {
        let used = hs.handle_input_admitting(&input[..*filled], exports.infos(), &mut admit)?;
        if used == 0 {
            break;
        }
        input.copy_within(used..*filled, 0);
        *filled -= used;
    }
    Ok(())
}

/// The TLS handshake the client asked for, within what is left of the handshake deadline;
/// `None` (logged with the reason) when it fails. `early` holds bytes already read past
/// `NBD_OPT_STARTTLS`. Every byte the client sends meanwhile keeps its place in the handshake
/// budget fresh (`ticket`), so a client in the middle of a TLS handshake is never taken for
/// the longest-silent one.
fn start_tls(
    shared: &SessionContext<'_>,
    peer: &str,
    ticket: &HandshakeTicket,
    channel: Channel,
    hs: &mut ServerHandshake,
    early: &[u8],
    deadline: Instant,
) -> io::Result<Option<Channel>> {
    // The handshake acknowledges STARTTLS only with a TLS context (the one it was built
    // with, the context's), and only once.
    let (Channel::Plain(stream), Some(tls)) = (channel, shared.tls.as_deref()) else {
        return Ok(None);
    };
    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
        warn!(%peer, "handshake timed out");
        return Ok(None);
    };
    let socket = stream.try_clone()?;
    // The kernel sends the records where it can and the context's `--tls-ktls` is `auto`.
    let kernel = shared.kernel_tls.filter(|_| tls.ktls() == KtlsMode::Auto);
    let kernel = kernel.as_ref().map(|k| k as &dyn KernelSend);
    let touch = || ticket.touch();
    let session = match tls.accept_observed(stream, early, left, kernel, &touch) {
        Ok(session) => session,
        Err(e) => {
            warn!(%peer, reason = e.reason(), "{e}: closing");
            return Ok(None);
        }
    };
    let info = session.info();
    let who = info.peer.name().unwrap_or("anonymous");
    let kernel = info.kernel_sends;
    info!(%peer, version = %info.version, cipher = %info.cipher, client = %who, kernel, "TLS established");
    if hs.tls_established().is_err() {
        return Ok(None);
    }
    Ok(Some(Channel::tls(session, socket, shared.stats)))
}
