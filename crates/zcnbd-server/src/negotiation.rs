//! One client's handshake, on a blocking thread: drives the sans-IO `ServerHandshake` over
//! the socket within the handshake deadline, keeps the connection's place in the handshake
//! budget fresh while the client talks, and asks admission before the client attaches.

use std::io::{self, Read};
use std::time::{Duration, Instant};

use tracing::warn;
use zcnbd_proto::{HandshakeError, HandshakeStatus, Negotiated, ServerHandshake};

use crate::admission::{AttachTicket, HandshakeTicket};
use crate::server::Server;
use crate::stream::Stream;

/// A finished handshake: what was agreed, bytes already read past it (the first requests),
/// and the client's place among the attached.
pub struct Attached {
    pub negotiated: Negotiated,
    pub leftover: Vec<u8>,
    pub ticket: AttachTicket,
}

/// Runs the handshake; `Some` once the client enters transmission.
pub fn handshake(
    shared: &Server,
    stream: &mut Stream,
    peer: &str,
    ticket: &HandshakeTicket,
) -> io::Result<Option<Attached>> {
    let limits = &shared.limits;
    let deadline = Instant::now() + Duration::from_millis(limits.handshake_timeout_ms);
    let mut hs = ServerHandshake::new(limits.handshake);
    let mut input = vec![0u8; hs.input_bytes_max()];
    let mut filled = 0;
    let mut attached = None;
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
            let _ = stream.write_all_vectored(&mut [io::IoSlice::new(hs.pending_output())]);
            return Ok(None);
        }
        let out = hs.pending_output();
        let sent = out.len();
        stream.write_all_vectored(&mut [io::IoSlice::new(out)])?;
        hs.consume_output(sent);
        match hs.status() {
            HandshakeStatus::Done(negotiated) => {
                let Some(ticket) = attached else {
                    return Ok(None);
                };
                let leftover = input[..filled].to_vec();
                return Ok(Some(Attached {
                    negotiated,
                    leftover,
                    ticket,
                }));
            }
            HandshakeStatus::Aborted => return Ok(None),
            // Not reached: `ServerHandshake::new` offers no TLS (issue 12 will).
            HandshakeStatus::StartTls => return Ok(None),
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
        match read_some(stream, &mut input[filled..]) {
            Ok(Some(0)) => return Ok(None),
            Ok(Some(n)) => {
                filled += n;
                ticket.touch();
            }
            Ok(None) => {
                warn!(%peer, "handshake timed out");
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    }
}

/// One read within the handshake deadline (interrupted reads are retried): `Ok(None)` when
/// it timed out.
fn read_some(stream: &mut Stream, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match stream.read(buf) {
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

/// Feeds buffered input to the handshake until it needs more or finishes; a client that asks
/// to attach gets a place from admission (kept in `attached`) or a refusal, logged here.
fn consume_input(
    shared: &Server,
    peer: &str,
    hs: &mut ServerHandshake,
    input: &mut [u8],
    filled: &mut usize,
    attached: &mut Option<AttachTicket>,
) -> Result<(), HandshakeError> {
    let mut admit = |export: usize| match shared.admission.attach(export) {
        Ok(ticket) => {
            *attached = Some(ticket);
            true
        }
        Err(refusal) => {
            let name = &shared.infos[export].name;
            warn!(%peer, export = %name, "client refused: {refusal}");
            false
        }
    };
    while hs.status() == HandshakeStatus::Negotiating {
        let used = hs.handle_input_admitting(&input[..*filled], &shared.infos, &mut admit)?;
        if used == 0 {
            break;
        }
        input.copy_within(used..*filled, 0);
        *filled -= used;
    }
    Ok(())
}
