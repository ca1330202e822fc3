//! A TLS connection that one thread drives (the client's): reads decrypt straight into the
//! caller's buffers, writes encrypt from the caller's slices. No lock, unlike
//! [`TlsSession`](crate::TlsSession), whose halves two threads share.
//!
//! The socket may be blocking (the rest of an NBD handshake, with timeouts) or non-blocking
//! (a transmission phase driven by readiness): a `WouldBlock` from the socket comes back to
//! the caller unchanged. Ciphertext the socket did not take waits in the stream
//! ([`TlsStream::wants_write`]), and new plaintext is accepted only once it is gone, so at
//! most `SEND_CHUNK_BYTES` (256 KiB) of plaintext's ciphertext is ever held.
//!
//! What is copied where, besides the cipher's one pass over the data (OpenSSL 3.0's record
//! layer works in its own buffers):
//! - read: the socket read lands in the buffer OpenSSL reads from (`MemIo::fill_from`, no
//!   copy of ours); OpenSSL copies each record into its read buffer, decrypts it there and
//!   copies the plaintext into the caller's buffer;
//! - write: OpenSSL copies the caller's plaintext into its write buffer and encrypts it
//!   there; the ciphertext is copied out into `MemIo` and sent from there. Slices shorter
//!   than a record (a request header) are first gathered into one record's worth, so a
//!   header shares a record with the data behind it.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::sync::Arc;

use crate::engine::{Decrypted, Engine, TlsCounters};
use crate::session::{RECEIVE_BUFFER_BYTES, RECORD_PLAINTEXT_BYTES, SEND_CHUNK_BYTES};
use crate::TlsInfo;

/// Most ciphertext read after a failed write while looking for the peer's alert: more than
/// a socket's receive queue holds on Linux (`tcp_rmem`'s default maximum is 6 MiB).
const LAST_ALERT_READ_BYTES_MAX: usize = 8 << 20;

/// An established TLS connection over `S`, for one thread.
///
/// Invariant: `sent <= engine.io().outgoing().len()`; `outgoing[sent..]` is ciphertext
/// the socket has not taken yet, and it is cleared once all of it is sent.
pub struct TlsStream<S> {
    engine: Engine,
    sock: S,
    info: TlsInfo,
    counters: Arc<TlsCounters>,
    /// Bytes of the engine's outgoing ciphertext already sent.
    sent: usize,
    /// Plaintext from slices shorter than a record, gathered into one (`<= RECORD_PLAINTEXT_BYTES`).
    staging: Vec<u8>,
    /// The socket reached end-of-stream.
    eof: bool,
}

impl<S> TlsStream<S> {
    pub(crate) fn new(engine: Engine, sock: S, info: TlsInfo) -> TlsStream<S> {
        TlsStream {
            engine,
            sock,
            info,
            counters: Arc::default(),
            sent: 0,
            staging: Vec::with_capacity(RECORD_PLAINTEXT_BYTES),
            eof: false,
        }
    }

    /// What was negotiated and who the peer is.
    pub fn info(&self) -> &TlsInfo {
        &self.info
    }

    /// The socket under the stream (for readiness waits; never for bytes).
    pub fn get_ref(&self) -> &S {
        &self.sock
    }

    /// The socket, to change its settings (never to read or write it: the bytes on it are
    /// TLS records).
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.sock
    }

    /// Plaintext bytes encrypted and decrypted so far.
    pub fn counters(&self) -> Arc<TlsCounters> {
        self.counters.clone()
    }

    /// Whether ciphertext waits for the socket to take it.
    pub fn wants_write(&self) -> bool {
        self.engine.outgoing_len() > self.sent
    }

    /// The same connection over another handle to its socket (a blocking one swapped for
    /// a non-blocking one once a handshake is over, say). Nothing buffered is lost.
    pub fn map_socket<T>(self, f: impl FnOnce(S) -> io::Result<T>) -> io::Result<TlsStream<T>> {
        Ok(TlsStream {
            engine: self.engine,
            sock: f(self.sock)?,
            info: self.info,
            counters: self.counters,
            sent: self.sent,
            staging: self.staging,
            eof: self.eof,
        })
    }
}

impl<S: Read + Write> TlsStream<S> {
    /// Decrypts into `bufs`, in order, as much as has arrived (at least one byte), reading
    /// the socket only when no whole record is buffered. `Ok(0)`: the peer closed the
    /// session. A non-blocking socket with nothing to read gives `WouldBlock`.
    pub fn read_into(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Ok(0);
        }
        loop {
            let step = self.decrypt(bufs);
            // What the read made OpenSSL say (a KeyUpdate answer, an alert) goes out as the
            // socket allows; the rest waits for the next write or flush.
            self.send_pending_quietly();
            match step? {
                Decrypted::Data(n) => {
                    self.counters.add_decrypted(n);
                    return Ok(n);
                }
                Decrypted::Closed => return Ok(0),
                Decrypted::NeedMore if self.eof => {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                Decrypted::NeedMore => {
                    self.pull()?;
                }
            }
        }
    }

    /// Encrypts a prefix of `bufs` (up to `SEND_CHUNK_BYTES` (256 KiB), whole records where the
    /// slices allow) and sends what the socket takes; returns how many plaintext bytes were
    /// taken. Nothing is taken while earlier ciphertext is still unsent: that gives the
    /// socket's error (`WouldBlock` on a full non-blocking socket).
    pub fn write_from(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.send_pending()?;
        let mut taken = 0;
        for slice in bufs {
            let room = SEND_CHUNK_BYTES - taken;
            if room == 0 {
                break;
            }
            let slice = &slice[..slice.len().min(room)];
            self.take(slice)?;
            taken += slice.len();
        }
        self.seal_staging()?;
        self.send_pending_quietly();
        Ok(taken)
    }

    /// Sends all waiting ciphertext (`WouldBlock` if a non-blocking socket is full).
    ///
    /// If the peer is gone (`BrokenPipe`, `ConnectionReset`), what it sent before it left is
    /// read and decrypted, and an alert there comes back instead of the socket's error,
    /// carrying its [`Refusal`](crate::Refusal): under TLS 1.3 a server refuses a client
    /// certificate only after the client's side of the handshake is done, so the client's
    /// next write can meet the closed socket before a read meets the alert. The session is
    /// over then; plaintext still unread on the way to the alert is dropped.
    pub fn send_pending(&mut self) -> io::Result<()> {
        self.send_waiting().map_err(|e| self.why_peer_left(e))
    }

    /// Sends all waiting ciphertext; the socket's error as it is.
    fn send_waiting(&mut self) -> io::Result<()> {
        while self.wants_write() {
            let out = &self.engine.io().outgoing()[self.sent..];
            match self.sock.write(out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.engine.io().outgoing().clear();
        self.sent = 0;
        Ok(())
    }

    /// Queues a close_notify alert and sends it if the socket takes it now (best effort).
    pub fn close_notify(&mut self) {
        self.engine.close_notify();
        self.send_pending_quietly();
    }

    /// Like `send_pending`, leaving what the socket does not take now (and its error, which
    /// the next read or write meets again) for later. Reads nothing: a read may be what
    /// called it, and the plaintext it reads is the caller's.
    fn send_pending_quietly(&mut self) {
        let _ = self.send_waiting();
    }

    /// `e`, from a write, or the alert the peer sent before it left, if `e` says it left.
    fn why_peer_left(&mut self, e: io::Error) -> io::Error {
        let gone = matches!(
            e.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        );
        match gone.then(|| self.last_alert()).flatten() {
            Some(alert) => alert,
            None => e,
        }
    }

    /// Reads and decrypts what the peer sent before it left, up to `LAST_ALERT_READ_BYTES_MAX`,
    /// dropping plaintext, until an alert (its error), the end of the stream or a socket
    /// error (`None`). The peer is gone, so a read does not wait (a blocking socket waits at
    /// most its timeout if the kernel says otherwise).
    fn last_alert(&mut self) -> Option<io::Error> {
        let mut scratch = vec![0u8; RECORD_PLAINTEXT_BYTES];
        let mut pulled = 0;
        loop {
            match self.engine.decrypt(&mut scratch) {
                Ok(Decrypted::Data(_)) => continue,
                Ok(Decrypted::Closed) => return None,
                Ok(Decrypted::NeedMore) if self.eof || pulled >= LAST_ALERT_READ_BYTES_MAX => {
                    return None
                }
                Ok(Decrypted::NeedMore) => pulled += self.pull().ok()?,
                Err(e) => return crate::refusal_of(&e).is_some().then_some(e),
            }
        }
    }

    /// One decrypt step across `bufs`: each is filled before the next is started.
    fn decrypt(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<Decrypted> {
        let mut filled = 0;
        for buf in bufs.iter_mut().filter(|b| !b.is_empty()) {
            match self.engine.decrypt(buf)? {
                Decrypted::Data(n) => {
                    filled += n;
                    if n < buf.len() {
                        break;
                    }
                }
                Decrypted::Closed if filled == 0 => return Ok(Decrypted::Closed),
                Decrypted::Closed | Decrypted::NeedMore => break,
            }
        }
        Ok(if filled > 0 {
            Decrypted::Data(filled)
        } else {
            Decrypted::NeedMore
        })
    }

    /// Reads ciphertext from the socket straight into the engine's input; returns how many
    /// bytes came (0: end-of-stream).
    fn pull(&mut self) -> io::Result<usize> {
        let sock = &mut self.sock;
        let n = loop {
            match self
                .engine
                .io()
                .fill_from(RECEIVE_BUFFER_BYTES, |b| sock.read(b))
            {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other?,
            }
        };
        if n == 0 {
            self.eof = true;
            self.engine.io().feed_eof();
        }
        Ok(n)
    }

    /// Encrypts `plaintext`: whole records straight from it, the rest gathered.
    fn take(&mut self, mut plaintext: &[u8]) -> io::Result<()> {
        if !self.staging.is_empty() {
            let n = plaintext
                .len()
                .min(RECORD_PLAINTEXT_BYTES - self.staging.len());
            self.staging.extend_from_slice(&plaintext[..n]);
            plaintext = &plaintext[n..];
            if self.staging.len() < RECORD_PLAINTEXT_BYTES {
                return Ok(());
            }
            self.seal_staging()?;
        }
        let whole = plaintext.len() - plaintext.len() % RECORD_PLAINTEXT_BYTES;
        if whole > 0 {
            self.seal(&plaintext[..whole])?;
        }
        self.staging.extend_from_slice(&plaintext[whole..]);
        Ok(())
    }

    fn seal_staging(&mut self) -> io::Result<()> {
        if self.staging.is_empty() {
            return Ok(());
        }
        let staged = std::mem::take(&mut self.staging);
        let sealed = self.seal(&staged);
        self.staging = staged;
        self.staging.clear();
        sealed
    }

    fn seal(&mut self, plaintext: &[u8]) -> io::Result<()> {
        self.engine.encrypt(plaintext)?;
        self.counters.add_encrypted(plaintext.len());
        Ok(())
    }
}

impl<S: Read + Write> Read for TlsStream<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_into(&mut [IoSliceMut::new(buf)])
    }

    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.read_into(bufs)
    }
}

impl<S: Read + Write> Write for TlsStream<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_from(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.write_from(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send_pending()
    }
}
