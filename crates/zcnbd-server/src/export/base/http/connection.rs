//! One HTTP/1.1 connection to a web server, plain or TLS, blocking with timeouts: a request
//! out, a response's head in (into a small buffer, bounded by `HEAD_BYTES_MAX`), and its body
//! straight into the caller's slice. Body bytes that arrived with the head are copied from the
//! head buffer once; the rest is read from the socket (or OpenSSL) into the slice itself.
//! Nothing is pipelined, so a connection carries another request only when a response ended
//! exactly where its framing said ([`Connection::finish`]).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use openssl::ssl::SslStream;

use super::error::{is_reset, HttpError};
use super::request::{write_request, Method};
use super::response::{parse_head, Head, HEAD_BYTES_MAX};
use super::spec::HttpHeader;
use super::tls::TlsClient;
use super::url::{Origin, Scheme, Url};
use crate::export::{PipedRead, MORE_PIPES_MAX};
use crate::pipe::Pipe;
use zcnbd_client::set_receive_low_water;

/// How much one read for a head asks: a head is a few hundred bytes, and whatever body comes
/// with it is copied once, so the first read stays small.
const HEAD_READ_BYTES: usize = 4 << 10;
/// How much of a TLS body is decrypted at a time on its way into a pipe.
const TLS_PIPE_BOUNCE_BYTES: usize = 64 << 10;
/// The most addresses of a host name tried.
const ADDRESSES_MAX: usize = 8;
/// A plain connection's body this long or longer is received with a low-water mark on the
/// socket (`zcnbd_client::set_receive_low_water`): its reader wakes once per [`BODY_LOW_WATER_BYTES`] that
/// came, not once per segment. Shorter bodies come in a segment or two.
const BODY_LOW_WATER_MIN: usize = 128 << 10;
/// The mark for a long body (less where less of it is left to come). Measured on the
/// 2-vCPU AMD EPYC machine, 1 MiB reads from nginx (docs/benchmarks/low-water.md): 64 KiB saved
/// little, 256 KiB and 512 KiB the most (1.2x the MiB/s at 0.83x the server's CPU per GiB),
/// 1 MiB less than those.
const BODY_LOW_WATER_BYTES: usize = 256 << 10;

/// How connections are made: the timeout and the TLS settings, shared by every connection.
pub struct Connector {
    timeout: Duration,
    /// CA certificates instead of the system's store (`--http-cafile`).
    ca_file: Option<PathBuf>,
    /// No verification (`--http-insecure`).
    insecure: bool,
    /// The TLS context, made at the first `https` connection: loading the system's CA store
    /// takes tens of milliseconds that a plain-HTTP source need not spend.
    tls: OnceLock<TlsClient>,
}

enum Stream {
    Plain(TcpStream),
    Tls(Box<SslStream<TcpStream>>),
}

impl Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }

    /// The TCP socket (for its timeouts; never for bytes, which are TLS records under TLS).
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref(),
        }
    }

    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.write_all(bytes),
            Stream::Tls(s) => s.write_all(bytes).and_then(|()| s.flush()),
        }
    }
}

/// A connection to one origin.
///
/// Invariant: `consumed <= filled <= head_buf.len()`; `head_buf[consumed..filled]` are bytes
/// received and not yet given to anyone (body bytes that came with the head).
pub struct Connection {
    stream: Stream,
    origin: Origin,
    head_buf: Vec<u8>,
    filled: usize,
    consumed: usize,
    /// The request being sent (reused).
    request: Vec<u8>,
    /// Responses finished on it: more than 0 means it was kept alive.
    answered: u64,
    timeout: Duration,
    /// The socket's receive timeout is less than `timeout` (a head coming in pieces).
    shortened: bool,
    /// Heads are taken from a plain socket without any of the body after them
    /// ([`Connection::set_exact_heads`]).
    exact_heads: bool,
    /// The plain socket's receive low-water mark now (1: the kernel's default, for heads).
    low_water: usize,
}

impl Connector {
    /// Settings for connections; nothing is loaded yet.
    pub fn new(timeout: Duration, ca_file: Option<PathBuf>, insecure: bool) -> Connector {
        Connector {
            timeout,
            ca_file,
            insecure,
            tls: OnceLock::new(),
        }
    }

    /// The TLS context, made (and its CA certificates loaded) the first time.
    pub fn tls(&self) -> Result<&TlsClient, HttpError> {
        if let Some(tls) = self.tls.get() {
            return Ok(tls);
        }
        // Two threads may both make one; the first kept is every later caller's.
        let made = TlsClient::new(self.ca_file.as_deref(), self.insecure)?;
        Ok(self.tls.get_or_init(|| made))
    }

    /// A new connection to `origin`: each resolved address tried within the timeout, then
    /// the TLS handshake for `https`.
    pub fn open(&self, origin: &Origin) -> Result<Connection, HttpError> {
        let tcp = self.tcp(origin)?;
        let stream = match origin.scheme {
            Scheme::Https => Stream::Tls(Box::new(self.tls()?.connect(&origin.host, tcp)?)),
            Scheme::Http => Stream::Plain(tcp),
        };
        Ok(Connection {
            stream,
            origin: origin.clone(),
            head_buf: Vec::with_capacity(HEAD_READ_BYTES),
            filled: 0,
            consumed: 0,
            request: Vec::new(),
            answered: 0,
            timeout: self.timeout,
            shortened: false,
            exact_heads: false,
            low_water: 1,
        })
    }

    fn tcp(&self, origin: &Origin) -> Result<TcpStream, HttpError> {
        let shown = format!("{}:{}", origin.host, origin.port);
        let addresses: Vec<SocketAddr> = (origin.host.as_str(), origin.port)
            .to_socket_addrs()
            .map_err(|source| HttpError::Resolve {
                host: origin.host.clone(),
                source,
            })?
            .take(ADDRESSES_MAX)
            .collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
        for address in addresses {
            match TcpStream::connect_timeout(&address, self.timeout) {
                Ok(tcp) => {
                    let set = |r: io::Result<()>| {
                        r.map_err(|source| HttpError::Connect {
                            origin: shown.clone(),
                            source,
                        })
                    };
                    set(tcp.set_nodelay(true))?;
                    set(tcp.set_read_timeout(Some(self.timeout)))?;
                    set(tcp.set_write_timeout(Some(self.timeout)))?;
                    return Ok(tcp);
                }
                Err(e) => last = e,
            }
        }
        Err(HttpError::Connect {
            origin: shown,
            source: last,
        })
    }
}

impl Connection {
    /// Where it goes.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Whether it carried a response before (a kept-alive connection the server may have
    /// closed while it was idle).
    pub fn was_kept_alive(&self) -> bool {
        self.answered > 0
    }

    /// Whether the last response was finished ([`Connection::finish`]): nothing of it is
    /// left to read, so the connection can carry another request.
    pub fn is_between_responses(&self) -> bool {
        (self.filled, self.consumed) == (0, 0)
    }

    /// Whether the next heads are received without taking any body bytes after them from a
    /// plain connection's socket (they are looked at with `MSG_PEEK` first), so that a body
    /// bound for a pipe is all spliced, none of it copied. TLS records cannot be split so:
    /// there it changes nothing.
    pub fn set_exact_heads(&mut self, exact: bool) {
        self.exact_heads = exact;
    }

    /// Sends `method` for `url` (with `extra` fields) and receives the response's head.
    pub fn exchange(
        &mut self,
        method: Method,
        url: &Url,
        extra: &[HttpHeader],
    ) -> Result<Head, HttpError> {
        debug_assert!(self.is_between_responses(), "a response left unread");
        // A head is a few hundred bytes: the last body's mark would hold it back.
        self.set_low_water(1).map_err(HttpError::Send)?;
        write_request(method, url, extra, &mut self.request);
        self.stream
            .write_all(&self.request)
            .map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    HttpError::TimedOut(self.timeout)
                }
                _ => HttpError::Send(e),
            })?;
        self.receive_head()
    }

    /// Reads until a whole head has come, within the timeout: the first read waits the
    /// timeout, later ones (a head in pieces) only what is left of it, so a server that
    /// trickles its head cannot stretch the wait.
    fn receive_head(&mut self) -> Result<Head, HttpError> {
        let deadline = Instant::now() + self.timeout;
        let head = self.read_head_until(deadline);
        if self.shortened {
            self.shortened = false;
            // The next wait is a whole timeout again (a body's, or the next head's); a
            // failed head's connection is closed anyway, and its error is the one to tell.
            let restored = self.stream.tcp().set_read_timeout(Some(self.timeout));
            if head.is_ok() {
                restored.map_err(HttpError::Receive)?;
            }
        }
        head
    }

    fn read_head_until(&mut self, deadline: Instant) -> Result<Head, HttpError> {
        loop {
            if self.filled > 0 {
                if let Some(head) = parse_head(&self.head_buf[..self.filled])? {
                    self.consumed = head.len;
                    return Ok(head);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(HttpError::TimedOut(self.timeout));
                }
                self.shortened = true;
                let shortened = self.stream.tcp().set_read_timeout(Some(left));
                shortened.map_err(HttpError::Receive)?;
            }
            let want = (self.filled + HEAD_READ_BYTES).min(HEAD_BYTES_MAX);
            self.head_buf.resize(want, 0);
            let read = match &mut self.stream {
                Stream::Plain(tcp) if self.exact_heads => {
                    read_head_part(tcp, &mut self.head_buf[..want], self.filled)
                }
                stream => stream.read(&mut self.head_buf[self.filled..want]),
            };
            match read {
                Ok(0) if self.filled == 0 => return Err(HttpError::Closed),
                Ok(0) => return Err(HttpError::ShortHead),
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if self.filled == 0 && is_reset(&e) => return Err(HttpError::Closed),
                Err(e) => return Err(HttpError::receiving(e, self.timeout)),
            }
        }
    }

    /// Fills `dest` with the body's next bytes: those that came with the head first (one
    /// copy), then straight from the connection. The connection ending first is a short body.
    pub fn read_body(&mut self, dest: &mut [u8]) -> Result<(), HttpError> {
        let buffered = &self.head_buf[self.consumed..self.filled];
        let n = buffered.len().min(dest.len());
        dest[..n].copy_from_slice(&buffered[..n]);
        self.consumed += n;
        let mut at = n;
        while at < dest.len() {
            self.lower_water_for(dest.len(), at)
                .map_err(HttpError::Receive)?;
            let read = match (&mut self.stream, self.low_water > 1) {
                // A blocking read that took some bytes would then wait for the mark's
                // worth of new ones, which may be more than are left to come.
                (Stream::Plain(tcp), true) => recv_under_mark(tcp, &mut dest[at..], self.timeout),
                (stream, _) => stream.read(&mut dest[at..]),
            };
            match read {
                Ok(0) => {
                    return Err(HttpError::ShortBody {
                        got: at,
                        want: dest.len(),
                    })
                }
                Ok(read) => at += read,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(HttpError::receiving(e, self.timeout)),
            }
        }
        Ok(())
    }

    /// Puts the body's next `len` bytes into `pipe` (empty, and said to hold `len` bytes):
    /// those that came with the head written (a copy), the rest spliced from a plain
    /// connection's socket (no copy through user memory) or, under TLS, decrypted into a
    /// small buffer and written. A pipe holds a number of buffers, not of bytes: a server
    /// that sends in small segments can fill it early; the body then goes on into more pipes
    /// ([`PipedRead::more`], up to [`MORE_PIPES_MAX`]), and what they cannot take is read
    /// into [`PipedRead::tail`]. Each wait for the server is bounded by the timeout, as for
    /// [`Connection::read_body`].
    pub fn read_body_to_pipe(&mut self, pipe: &Pipe, len: usize) -> Result<PipedRead, HttpError> {
        let buffered = &self.head_buf[self.consumed..self.filled];
        let n = buffered.len().min(len);
        let mut copied = 0;
        if n > 0 {
            match write_to(pipe.write.as_fd(), &buffered[..n]) {
                Ok(()) => copied = n,
                Err(e) => return Err(HttpError::Receive(e)),
            }
        }
        self.consumed += n;
        let mut at = n;
        let mut bounce = Vec::new();
        // Pipes taken when the one before filled, each with the bytes it holds.
        let mut more: Vec<(Pipe, usize)> = Vec::new();
        while at < len {
            self.lower_water_for(len, at).map_err(HttpError::Receive)?;
            let into = more.last().map_or(pipe, |(p, _)| p);
            let moved = match &mut self.stream {
                Stream::Plain(tcp) => splice_some(tcp, into, len - at, self.timeout),
                Stream::Tls(tls) => {
                    bounce.resize(TLS_PIPE_BOUNCE_BYTES.min(len - at), 0);
                    match tls.read(&mut bounce) {
                        Ok(n) => write_to(into.write.as_fd(), &bounce[..n]).map(|()| {
                            copied += n;
                            Some(n)
                        }),
                        Err(e) => Err(e),
                    }
                }
            };
            match moved {
                Ok(Some(0)) => return Err(HttpError::ShortBody { got: at, want: len }),
                Ok(Some(n)) => {
                    at += n;
                    if let Some((_, held)) = more.last_mut() {
                        *held += n;
                    }
                }
                Ok(None) => {
                    // The pipe filled (with buffers, each a segment's fragment): the next
                    // takes the rest, up to MORE_PIPES_MAX, then a buffer does.
                    let next = (more.len() < MORE_PIPES_MAX)
                        .then(|| Pipe::spare(len - at).ok())
                        .flatten();
                    if let Some(next) = next {
                        more.push((next, 0));
                        continue;
                    }
                    tracing::debug!(
                        at,
                        len,
                        "the pipes filled before the body ended: the rest in a buffer"
                    );
                    let mut tail = vec![0u8; len - at];
                    self.read_body(&mut tail)?;
                    let copied = copied + tail.len();
                    return Ok(PipedRead { copied, more, tail });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(HttpError::receiving(e, self.timeout)),
            }
        }
        Ok(PipedRead {
            copied,
            more,
            tail: Vec::new(),
        })
    }

    /// Sets a plain socket's receive low-water mark to `bytes` (TLS: nothing; OpenSSL asks
    /// for a record at a time).
    fn set_low_water(&mut self, bytes: usize) -> io::Result<()> {
        if let (Stream::Plain(tcp), true) = (&self.stream, bytes != self.low_water) {
            set_receive_low_water(tcp, bytes)?;
            self.low_water = bytes;
        }
        Ok(())
    }

    /// Before waiting for a body of `len` bytes with `at` of them received: a long body's
    /// mark ([`BODY_LOW_WATER_BYTES`]), never more than what is left to come (the wait would
    /// last until the timeout).
    fn lower_water_for(&mut self, len: usize, at: usize) -> io::Result<()> {
        if len < BODY_LOW_WATER_MIN {
            return Ok(());
        }
        let want = (len - at).min(BODY_LOW_WATER_BYTES);
        match self.low_water == 1 || want < self.low_water {
            true => self.set_low_water(want),
            false => Ok(()),
        }
    }

    /// Ends a response whose framing says it ended here (a HEAD's, a body of
    /// `Content-Length` read whole). Whether the connection may carry another request: not
    /// if bytes beyond the response came (the server sent more than it said).
    pub fn finish(&mut self) -> bool {
        let clean = self.consumed == self.filled;
        self.filled = 0;
        self.consumed = 0;
        self.answered += 1;
        if !clean {
            tracing::debug!(origin = %self.origin.host, "bytes after a response: the connection is closed");
        }
        clean
    }
}

/// Reads into `buf[filled..]` what of a head `tcp` holds and no more: looks first
/// (`MSG_PEEK`), then takes the bytes up to the head's end (`\r\n\r\n`) if it is there,
/// else all it saw (all head). Returns the bytes taken (0: the server closed).
fn read_head_part(tcp: &mut TcpStream, buf: &mut [u8], filled: usize) -> io::Result<usize> {
    let seen = tcp.peek(&mut buf[filled..])?;
    if seen == 0 {
        return Ok(0);
    }
    let from = filled.saturating_sub(3);
    let end = buf[from..filled + seen]
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| from + at + 4);
    let take = end.map_or(seen, |end| end - filled);
    tcp.read_exact(&mut buf[filled..filled + take])?;
    Ok(take)
}

/// Splices up to `want` bytes from `tcp` into `pipe`: `Some(n)` moved (0: the server closed
/// the connection), `None` when the splice cannot go on: the pipe is full while the socket
/// has bytes for it, or it found nothing twice with the socket readable. The pipe side
/// never waits (`SPLICE_F_NONBLOCK`); the socket side waits up to `timeout` (its receive
/// timeout, and a poll when the splice found nothing).
fn splice_some(
    tcp: &TcpStream,
    pipe: &Pipe,
    want: usize,
    timeout: Duration,
) -> io::Result<Option<usize>> {
    let flags = rustix::pipe::SpliceFlags::MOVE | rustix::pipe::SpliceFlags::NONBLOCK;
    let splice = || rustix::pipe::splice(tcp, None, &pipe.write, None, want, flags);
    for _ in 0..2 {
        match splice() {
            Ok(n) => return Ok(Some(n)),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                // Either the pipe is full, or the socket had nothing within its timeout:
                // the socket says which.
                if !wait_readable(tcp, timeout)? {
                    // The socket side of a splice blocks (up to the timeout again): take
                    // what came only if something did.
                    return match rustix::io::ioctl_fionread(tcp) {
                        Ok(n) if n > 0 => splice().map(Some).map_err(io::Error::from),
                        _ => Err(io::ErrorKind::TimedOut.into()),
                    };
                }
                if pipe_is_full(pipe) {
                    return Ok(None);
                }
                // Bytes (or the end) arrived: the next splice takes them.
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(None)
}

/// Receives into `dest` what `tcp` holds, waiting (up to `timeout`) only while it holds
/// nothing, for its low-water mark's bytes: never a blocking read, which once it took some
/// bytes waits for the mark's worth of new ones.
fn recv_under_mark(tcp: &TcpStream, dest: &mut [u8], timeout: Duration) -> io::Result<usize> {
    use rustix::net::{recv, RecvFlags};
    let take = |dest: &mut [u8]| recv(tcp, dest, RecvFlags::DONTWAIT).map(|(n, _)| n);
    loop {
        match take(dest) {
            Ok(n) => return Ok(n),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                if !wait_readable(tcp, timeout)? {
                    return match take(dest) {
                        Ok(n) if n > 0 => Ok(n),
                        _ => Err(io::ErrorKind::TimedOut.into()),
                    };
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Waits up to `timeout` for `tcp` to be readable: under a low-water mark, for the mark's
/// bytes. `false`: the timeout passed. A server that sent less than the mark within it is
/// slow, not stalled: the callers take what came before they call it a timeout.
fn wait_readable(tcp: &TcpStream, timeout: Duration) -> io::Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(tcp, PollFlags::IN)];
    let wait = Timespec::try_from(timeout).unwrap_or(Timespec {
        tv_sec: i64::MAX,
        tv_nsec: 0,
    });
    loop {
        match poll(&mut fds, Some(&wait)) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Whether a write of one byte to the pipe would have to wait (every buffer taken).
fn pipe_is_full(pipe: &Pipe) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(&pipe.write, PollFlags::OUT)];
    let now = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    !matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
}

/// Writes all of `bytes` into `pipe` (which has room for them).
fn write_to(pipe: BorrowedFd<'_>, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match rustix::io::write(pipe, bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
