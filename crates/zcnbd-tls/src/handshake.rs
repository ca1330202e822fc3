//! The blocking TLS handshake on a connection's socket, with a deadline. It starts from the
//! bytes the plaintext phase already read past NBD_OPT_STARTTLS (a client may send its
//! ClientHello right behind the option), and leaves any bytes that arrive after the
//! handshake inside the session for the reader.
//!
//! Given a [`KernelSend`], a TCP connection's sending half is routed to its socket before the
//! handshake, so OpenSSL can install kTLS when the keys change; afterwards the session either
//! sends in the kernel or is routed back to memory.

use std::io;
use std::time::{Duration, Instant};

use openssl::ssl::{ErrorCode, Ssl};

use crate::engine::Engine;
use crate::kernel::KernelSend;
use crate::refusal::{Classifier, HandshakeError};
use crate::session::{TlsSession, RECEIVE_BUFFER_BYTES};
use crate::stream::TlsStream;
use crate::transport::Transport;
use crate::TlsInfo;

/// Runs the handshake of `ssl` (accept or connect state set) over `sock` within `timeout`,
/// calling `progress` whenever the peer's bytes arrive (a server keeps the connection's place
/// in its handshake budget fresh with it). The socket's own timeouts are put back
/// afterwards, whatever the outcome. The flag says whether the kernel now encrypts what is
/// sent on the socket.
pub fn run<S: Transport>(
    ssl: Ssl,
    mut sock: S,
    leftover: &[u8],
    timeout: Duration,
    classifier: Classifier,
    kernel: Option<&dyn KernelSend>,
    progress: &dyn Fn(),
) -> Result<(Engine, S, bool), HandshakeError> {
    let saved = (sock.read_timeout(), sock.write_timeout());
    let result = drive(
        ssl, &mut sock, leftover, timeout, classifier, kernel, progress,
    );
    if let (Ok(read), Ok(write)) = saved {
        let _ = sock.set_read_timeout(read);
        let _ = sock.set_write_timeout(write);
    }
    result.map(|(engine, in_kernel)| (engine, sock, in_kernel))
}

/// Like [`run`], then wraps the engine as a session with what was negotiated.
pub fn establish<S: Transport>(
    ssl: Ssl,
    sock: S,
    leftover: &[u8],
    timeout: Duration,
    classifier: Classifier,
    kernel: Option<&dyn KernelSend>,
    progress: &dyn Fn(),
) -> Result<TlsSession<S>, HandshakeError> {
    let (engine, sock, in_kernel) =
        run(ssl, sock, leftover, timeout, classifier, kernel, progress)?;
    let info = TlsInfo::of(engine.ssl(), classifier, in_kernel);
    TlsSession::new(engine, sock, info).map_err(HandshakeError::Io)
}

/// Like [`run`], then wraps the engine as a stream for one thread.
pub fn establish_stream<S: Transport>(
    ssl: Ssl,
    sock: S,
    leftover: &[u8],
    timeout: Duration,
    classifier: Classifier,
) -> Result<TlsStream<S>, HandshakeError> {
    let (engine, sock, _) = run(ssl, sock, leftover, timeout, classifier, None, &|| {})?;
    let info = TlsInfo::of(engine.ssl(), classifier, false);
    Ok(TlsStream::new(engine, sock, info))
}

fn drive<S: Transport>(
    ssl: Ssl,
    sock: &mut S,
    leftover: &[u8],
    timeout: Duration,
    classifier: Classifier,
    kernel: Option<&dyn KernelSend>,
    progress: &dyn Fn(),
) -> Result<(Engine, bool), HandshakeError> {
    let deadline = Instant::now() + timeout;
    let mut engine = Engine::new(ssl, classifier).map_err(HandshakeError::Io)?;
    let kernel = route_to_socket(&engine, sock, kernel, timeout)?;
    engine.io().feed(leftover);
    let mut rx = vec![0u8; RECEIVE_BUFFER_BYTES];
    loop {
        let step = engine.handshake();
        // Send whatever this step produced (flights, or the alert that ends a refusal).
        let sent = send_all(&mut engine, sock, deadline, timeout);
        match step {
            Ok(()) => {
                sent?;
                return Ok(settle(engine, kernel));
            }
            // OpenSSL's own socket writes (routed to the socket) ran out of time.
            Err(e) if e.code() == ErrorCode::WANT_WRITE => {
                return Err(HandshakeError::Timeout(timeout))
            }
            Err(e) if e.code() == ErrorCode::WANT_READ && !engine.io().eof() => {
                sent?;
                let n = receive(sock, &mut rx, deadline, timeout)?;
                match n {
                    0 => engine.io().feed_eof(),
                    n => {
                        progress();
                        engine.io().feed(&rx[..n]);
                    }
                }
            }
            Err(_) if engine.io().eof() => return Err(HandshakeError::PeerClosed),
            Err(e) => return Err(classifier.classify(&e, engine.ssl()).into()),
        }
    }
}

/// Routes the sending half to the socket if there is a [`KernelSend`] and the transport is
/// a TCP socket; OpenSSL's writes then block on the socket, for at most `timeout` each.
fn route_to_socket<'k, S: Transport>(
    engine: &Engine,
    sock: &S,
    kernel: Option<&'k dyn KernelSend>,
    timeout: Duration,
) -> Result<Option<&'k dyn KernelSend>, HandshakeError> {
    let (Some(kernel), Some(fd)) = (kernel, sock.kernel_socket()) else {
        return Ok(None);
    };
    sock.set_write_timeout(Some(timeout))
        .map_err(HandshakeError::Io)?;
    kernel
        .route_to_socket(engine.ssl(), fd)
        .map_err(HandshakeError::Io)?;
    Ok(Some(kernel))
}

/// After a successful handshake: whether the kernel sends, else back to memory.
fn settle(engine: Engine, kernel: Option<&dyn KernelSend>) -> (Engine, bool) {
    let Some(kernel) = kernel else {
        return (engine, false);
    };
    if kernel.is_in_kernel(engine.ssl()) {
        return (engine, true);
    }
    kernel.route_to_memory(engine.ssl());
    (engine, false)
}

fn remaining(deadline: Instant, timeout: Duration) -> Result<Duration, HandshakeError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HandshakeError::Timeout(timeout));
    }
    Ok(left)
}

fn send_all<S: Transport>(
    engine: &mut Engine,
    sock: &mut S,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), HandshakeError> {
    let out = std::mem::take(engine.io().outgoing());
    if out.is_empty() {
        return Ok(());
    }
    sock.set_write_timeout(Some(remaining(deadline, timeout)?))
        .map_err(HandshakeError::Io)?;
    sock.write_all(&out).map_err(|e| io_error(e, timeout))
}

fn receive<S: Transport>(
    sock: &mut S,
    rx: &mut [u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<usize, HandshakeError> {
    loop {
        sock.set_read_timeout(Some(remaining(deadline, timeout)?))
            .map_err(HandshakeError::Io)?;
        match sock.read(rx) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(e, timeout)),
            Ok(n) => return Ok(n),
        }
    }
}

fn io_error(e: io::Error, timeout: Duration) -> HandshakeError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HandshakeError::Timeout(timeout),
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => HandshakeError::PeerClosed,
        _ => HandshakeError::Io(e),
    }
}
