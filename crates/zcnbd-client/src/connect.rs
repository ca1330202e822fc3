//! Opening a connection: the socket, then the fixed-newstyle handshake driven by the sans-IO
//! `ClientHandshake` over blocking I/O with a timeout. For an `nbds` URI the handshake asks
//! for TLS first (`ClientTls::Require`: a server that refuses it fails the connect), runs
//! the TLS handshake when the server acknowledges `NBD_OPT_STARTTLS`, and goes on encrypted.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use zcnbd_proto::consts::BASE_ALLOCATION;
use zcnbd_proto::{
    ClientHandshake, ClientHandshakeError, ClientHandshakeOptions, ClientHandshakeStatus,
    ClientNegotiated, ClientTls, MetaContext, MetaQueries,
};
use zcnbd_tls::{TlsConnector, TlsStream};

use crate::error::{Error, Result};
use crate::link::{tls_error, Link};
use crate::sock::Sock;
use crate::tls;
use crate::uri::{Address, NbdUri};

/// The handshake's byte stream: the socket, then maybe TLS over it.
enum Stream {
    Plain(Sock),
    Tls(Box<TlsStream<Sock>>),
}

impl Stream {
    fn open(address: &Address, timeout: Duration) -> Result<Stream> {
        let fd: OwnedFd = match address {
            Address::Tcp { host, port } => {
                let s = TcpStream::connect((host.as_str(), *port))
                    .map_err(|e| Error::io("connect", e))?;
                s.set_nodelay(true)
                    .map_err(|e| Error::io("TCP_NODELAY", e))?;
                s.into()
            }
            Address::Unix(path) => UnixStream::connect(path)
                .map_err(|e| Error::io("connect", e))?
                .into(),
            Address::Vsock { cid, port } => {
                crate::sock::connect_vsock(*cid, *port).map_err(|e| Error::io("connect", e))?
            }
        };
        let sock = Sock::new(fd);
        sock.set_timeouts(Some(timeout))
            .map_err(|e| Error::io("socket timeout", e))?;
        Ok(Stream::Plain(sock))
    }

    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => &mut **t,
        }
    }

    /// Runs the TLS handshake over the plain socket.
    fn start_tls(self, connector: &TlsConnector, host: &str, timeout: Duration) -> Result<Self> {
        match self {
            Stream::Plain(sock) => {
                let stream = tls::handshake(connector, sock, host, timeout)?;
                Ok(Stream::Tls(Box::new(stream)))
            }
            Stream::Tls(_) => Err(Error::Handshake("STARTTLS under TLS".into())),
        }
    }

    /// The server hung up in the middle of the handshake (`reset`: with a reset).
    fn closed(&self, reset: Option<std::io::Error>) -> Error {
        let how = match reset {
            Some(e) => format!("the server dropped the connection ({e})"),
            None => "the server closed the connection".to_string(),
        };
        match self {
            Stream::Plain(_) => Error::Handshake(how),
            // GnuTLS servers (qemu-nbd, nbdkit) hang up without an alert; under TLS 1.3 a
            // client certificate is judged only after our side of the TLS handshake.
            Stream::Tls(_) => Error::Handshake(format!(
                "{how} after the TLS handshake: it may have refused our client certificate"
            )),
        }
    }

    /// A read or write of the handshake failed: a refusal (an alert, also one found after a
    /// write met the closed socket), a hang-up (reset or broken pipe) with what is likely, or
    /// the socket's error.
    fn failed(&self, e: std::io::Error, context: &'static str) -> Error {
        use std::io::ErrorKind::{BrokenPipe, ConnectionReset};
        if zcnbd_tls::refusal_of(&e).is_none() && matches!(e.kind(), BrokenPipe | ConnectionReset) {
            return self.closed(Some(e));
        }
        tls_error(e, context)
    }

    /// The transmission phase's link; the socket blocks no more on timeouts.
    fn into_link(mut self) -> Result<Link> {
        if let Stream::Tls(stream) = &mut self {
            if let Err(e) = stream.flush() {
                return Err(self.failed(e, "handshake send"));
            }
        }
        let clear = |s: &Sock| {
            s.set_timeouts(None)
                .map_err(|e| Error::io("socket timeout", e))
        };
        match self {
            Stream::Plain(sock) => {
                clear(&sock)?;
                Ok(Link::Plain(sock.into_fd()))
            }
            Stream::Tls(stream) => {
                clear(stream.get_ref())?;
                Ok(Link::Tls(stream))
            }
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// Connects to `uri`'s server and negotiates (over TLS when `tls` is given, which an `nbds`
/// URI requires), asking for the metadata contexts `meta.0` names besides those `options`
/// does, and those the queries `meta.1` list; the link is ready for transmission.
pub fn open(
    uri: &NbdUri,
    options: ClientHandshakeOptions,
    meta: (&MetaQueries, &MetaQueries),
    tls: Option<&TlsConnector>,
    timeout: Duration,
) -> Result<(Link, ClientNegotiated)> {
    let mut stream = Stream::open(&uri.address, timeout)?;
    let level = match tls {
        Some(_) => ClientTls::Require,
        None => ClientTls::Off,
    };
    let mut handshake = ClientHandshake::with_tls(options, level)
        .with_meta_contexts(meta.0.clone())
        .with_meta_list(meta.1.clone());
    let mut input = vec![0u8; handshake.input_bytes_max()];
    let mut have = 0;
    loop {
        if let Err(e) = send_pending(&mut handshake, stream.io()) {
            return Err(stream.failed(e, "handshake send"));
        }
        match handshake.status() {
            ClientHandshakeStatus::Done(negotiated) => {
                return Ok((stream.into_link()?, negotiated))
            }
            ClientHandshakeStatus::Failed => {
                return Err(Error::Handshake("the handshake failed".into()))
            }
            ClientHandshakeStatus::StartTls => {
                // The server speaks TLS only after our ClientHello: nothing may follow the ACK.
                let (Some(connector), 0) = (tls, have) else {
                    return Err(Error::Handshake(
                        "unexpected bytes behind the reply to STARTTLS".into(),
                    ));
                };
                stream = stream.start_tls(connector, uri.tls_hostname(), timeout)?;
                handshake
                    .tls_established()
                    .map_err(|e| Error::Handshake(e.to_string()))?;
                continue;
            }
            ClientHandshakeStatus::NeedIo => {}
        }
        // Everything buffered is fed before reading more; the server sends nothing of the
        // transmission phase unasked, so reading ahead cannot take a reply's bytes.
        let used = match handshake.handle_input(&input[..have]) {
            Ok(used) => used,
            Err(e) => {
                let _ = stream.io().write_all(handshake.pending_output());
                let _ = stream.io().flush();
                return Err(refused(e));
            }
        };
        if used > 0 {
            input.copy_within(used..have, 0);
            have -= used;
            continue;
        }
        have += read_more(&mut stream, &mut input[have..])?;
    }
}

/// Reads the server's next bytes into `free` (the rest of the input buffer): how many came
/// (0 after a signal: read again).
fn read_more(stream: &mut Stream, free: &mut [u8]) -> Result<usize> {
    if free.is_empty() {
        return Err(Error::Handshake(
            "server message larger than allowed".into(),
        ));
    }
    match stream.io().read(free) {
        Ok(0) => Err(stream.closed(None)),
        Ok(n) => Ok(n),
        // A signal (a child exiting, a timer) is not the server's doing: read again.
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(stream.failed(e, "handshake receive")),
    }
}

/// Sends what the handshake has to say; a TLS stream that finds the server gone answers
/// with the alert it left, if any (see `TlsStream::send_pending`).
fn send_pending(handshake: &mut ClientHandshake, io: &mut dyn ReadWrite) -> std::io::Result<()> {
    while !handshake.pending_output().is_empty() {
        let n = match io.write(handshake.pending_output()) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            sent => sent?,
        };
        handshake.consume_output(n);
    }
    io.flush()
}

/// Why the server's refusal ends the handshake, typed where TLS is the reason.
fn refused(e: ClientHandshakeError) -> Error {
    match e {
        ClientHandshakeError::TlsRequired { message } => Error::TlsRequired(message),
        ClientHandshakeError::TlsRefused { code, message } => {
            let said = if message.is_empty() {
                "no message"
            } else {
                &message
            };
            Error::TlsUnavailable(format!("NBD_OPT_STARTTLS answered {code:#x} ({said})"))
        }
        e => Error::Handshake(e.to_string()),
    }
}

/// How a further connection asks for exactly `selected` (the first connection's contexts),
/// by name and without listing: `base:allocation` through `options`, the others as names.
pub(crate) fn by_name(
    mut options: ClientHandshakeOptions,
    selected: &[MetaContext],
) -> Result<(ClientHandshakeOptions, MetaQueries)> {
    options.base_allocation = selected.iter().any(|c| c.name == BASE_ALLOCATION);
    let names = selected.iter().map(|c| c.name.clone());
    let meta = MetaQueries::new(names.filter(|n| n != BASE_ALLOCATION))?;
    Ok((options, meta))
}

/// The id `other` (a further connection) gave each of `contexts`, in their order; an error
/// if it did not select exactly the same names.
pub(crate) fn ids_on(contexts: &[MetaContext], other: &ClientNegotiated) -> Result<Vec<u32>> {
    let disagree =
        || Error::Handshake("connections to one export disagree on its metadata contexts".into());
    if other.meta_contexts.len() != contexts.len() {
        return Err(disagree());
    }
    contexts
        .iter()
        .map(|c| other.meta_context_id(&c.name).ok_or_else(disagree))
        .collect()
}
