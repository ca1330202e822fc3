//! One connection's OpenSSL state over memory instead of a socket: ciphertext from the
//! socket is fed in, ciphertext OpenSSL produces piles up to be taken out and sent. No call
//! here blocks or touches a socket, so a mutex around an [`Engine`] is only ever held for
//! CPU work (the reader and writer threads share one, see `session.rs`).

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use openssl::ssl::{self, ErrorCode, Ssl, SslRef, SslStream};

use crate::raw::{RawDest, RawPlaintext, RawSslError};
use crate::refusal::Classifier;

/// Bytes TLS encrypted and decrypted in user space for one session (plaintext bytes), for
/// the server's `tls_encrypted_bytes` / `tls_decrypted_bytes`.
#[derive(Debug, Default)]
pub struct TlsCounters {
    encrypted: AtomicU64,
    decrypted: AtomicU64,
}

impl TlsCounters {
    /// Plaintext bytes encrypted so far.
    pub fn encrypted_bytes(&self) -> u64 {
        self.encrypted.load(Ordering::Relaxed)
    }

    /// Plaintext bytes decrypted so far.
    pub fn decrypted_bytes(&self) -> u64 {
        self.decrypted.load(Ordering::Relaxed)
    }

    pub(crate) fn add_encrypted(&self, n: usize) {
        self.encrypted.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn add_decrypted(&self, n: usize) {
        self.decrypted.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Room kept in front of each socket read for [`MemIo::feed_swap`]: more than the longest
/// TLS record's ciphertext (16 KiB of plaintext, its header and at most 256 bytes of
/// expansion), the most that can stay unconsumed when more is fed.
pub const FEED_HEAD_BYTES: usize = 16 * 1024 + 512;

/// The memory OpenSSL reads from and writes to.
///
/// Invariant: `start <= end <= incoming.len()`; `incoming[start..end]` is ciphertext fed and
/// not yet consumed, `incoming[end..]` room for more. Ciphertext is fed only when OpenSSL
/// has no whole record left (see `decrypt`), so what stays unconsumed is less than one
/// record, and `incoming` stays about one socket read plus one record long.
#[derive(Debug, Default)]
pub struct MemIo {
    incoming: Vec<u8>,
    start: usize,
    end: usize,
    outgoing: Vec<u8>,
    eof: bool,
}

impl MemIo {
    /// Appends ciphertext read from the socket.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.make_room(bytes.len());
        self.incoming[self.end..self.end + bytes.len()].copy_from_slice(bytes);
        self.end += bytes.len();
    }

    /// Takes `buf[head..head + n]`, ciphertext read from the socket, as the next bytes fed,
    /// without copying it: the bytes still unconsumed here are copied just in front of it
    /// (fewer than one record, see the invariant: they fit in `head` when it is
    /// [`FEED_HEAD_BYTES`]) and the two buffers change places, so `buf` comes back holding
    /// this side's old buffer, to read into next (`head` bytes of it kept free again by the
    /// caller). Copies, as [`feed`](Self::feed) does, when they do not fit.
    pub fn feed_swap(&mut self, buf: &mut Vec<u8>, head: usize, n: usize) {
        let pending = self.end - self.start;
        if pending > head {
            self.feed(&buf[head..head + n]);
            return;
        }
        let at = head - pending;
        buf[at..head].copy_from_slice(&self.incoming[self.start..self.end]);
        std::mem::swap(&mut self.incoming, buf);
        self.start = at;
        self.end = head + n;
    }

    /// Lets `read` put up to `room` bytes of ciphertext straight into the buffer OpenSSL
    /// reads from (a socket read, with no copy of ours between). Returns what `read` did.
    pub fn fill_from(
        &mut self,
        room: usize,
        read: impl FnOnce(&mut [u8]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        self.make_room(room);
        let spare = &mut self.incoming[self.end..self.end + room];
        let n = read(spare)?.min(room);
        self.end += n;
        Ok(n)
    }

    /// The socket reached end-of-stream: OpenSSL sees EOF once `incoming` is used up.
    pub fn feed_eof(&mut self) {
        self.eof = true;
    }

    /// Whether end-of-stream was fed.
    pub fn eof(&self) -> bool {
        self.eof
    }

    /// The ciphertext waiting to be sent (the caller swaps it out, or sends and drains it).
    pub fn outgoing(&mut self) -> &mut Vec<u8> {
        &mut self.outgoing
    }

    /// Makes `incoming[end..]` at least `n` bytes long: starts over when everything fed was
    /// consumed, moves the unconsumed tail to the front when that makes room, else grows.
    fn make_room(&mut self, n: usize) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.incoming.len() - self.end >= n {
            return;
        }
        if self.start > 0 {
            self.incoming.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.incoming.len() - self.end < n {
            self.incoming.resize(self.end + n, 0);
        }
    }
}

impl Read for MemIo {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = &self.incoming[self.start..self.end];
        if available.is_empty() {
            return if self.eof {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let n = available.len().min(buf.len());
        buf[..n].copy_from_slice(&available[..n]);
        self.start += n;
        Ok(n)
    }
}

impl Write for MemIo {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.outgoing.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What one decrypt step produced.
#[derive(Debug, PartialEq, Eq)]
pub enum Decrypted {
    /// This many plaintext bytes are in the caller's buffer.
    Data(usize),
    /// The peer closed the TLS session (close_notify, or end-of-stream).
    Closed,
    /// More ciphertext is needed.
    NeedMore,
}

/// An OpenSSL connection over [`MemIo`].
pub struct Engine {
    stream: SslStream<MemIo>,
    /// Sorts a fatal error into a [`Refusal`](crate::Refusal) (an alert after the handshake:
    /// under TLS 1.3 a server refuses a client certificate only then).
    classifier: Classifier,
    /// A fatal error ended the session; every later call fails.
    broken: bool,
}

impl Engine {
    /// Wraps a configured `Ssl` (accept or connect state already set).
    pub fn new(ssl: Ssl, classifier: Classifier) -> io::Result<Engine> {
        let stream = SslStream::new(ssl, MemIo::default()).map_err(io::Error::other)?;
        Ok(Engine {
            stream,
            classifier,
            broken: false,
        })
    }

    pub fn io(&mut self) -> &mut MemIo {
        self.stream.get_mut()
    }

    /// Bytes of ciphertext waiting in `outgoing`.
    pub fn outgoing_len(&self) -> usize {
        self.stream.get_ref().outgoing.len()
    }

    pub fn ssl(&self) -> &SslRef {
        self.stream.ssl()
    }

    /// One handshake step.
    pub fn handshake(&mut self) -> Result<(), ssl::Error> {
        self.stream.do_handshake()
    }

    /// Decrypts as much as is available into `buf`.
    pub fn decrypt(&mut self, buf: &mut [u8]) -> io::Result<Decrypted> {
        self.check()?;
        let mut filled = 0;
        while filled < buf.len() {
            match self.stream.ssl_read(&mut buf[filled..]) {
                Ok(n) => filled += n,
                Err(e) if e.code() == ErrorCode::WANT_READ => break,
                Err(e) if e.code() == ErrorCode::ZERO_RETURN && filled == 0 => {
                    return Ok(Decrypted::Closed);
                }
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => break,
                // End-of-stream without close_notify. qemu and nbdkit clients often just
                // close after NBD_CMD_DISC, and NBD frames its own messages, so a cut is
                // caught there; OpenSSL 3.0 reports it as SYSCALL with no errno over a
                // custom BIO even with SSL_OP_IGNORE_UNEXPECTED_EOF.
                Err(e) if self.is_plain_eof(&e) && filled == 0 => return Ok(Decrypted::Closed),
                Err(e) if self.is_plain_eof(&e) => break,
                Err(e) => return Err(self.fatal(e)),
            }
        }
        Ok(if filled > 0 {
            Decrypted::Data(filled)
        } else {
            Decrypted::NeedMore
        })
    }

    /// Decrypts what is available, up to `len` bytes, into `dest` from `at`, OpenSSL writing
    /// the memory itself (see `raw.rs`); ends as [`Engine::decrypt`] does.
    pub fn decrypt_raw(
        &mut self,
        dest: &dyn RawDest,
        at: usize,
        len: usize,
    ) -> io::Result<Decrypted> {
        self.check()?;
        if at.checked_add(len).is_none_or(|end| end > dest.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "raw range out of bounds",
            ));
        }
        let mut filled = 0;
        while filled < len {
            let code = match dest.ssl_read(self.stream.ssl(), at + filled, len - filled) {
                Ok(n) => {
                    filled += n;
                    continue;
                }
                Err(e) => ErrorCode::from_raw(e.code),
            };
            let eof =
                code == ErrorCode::ZERO_RETURN || (code == ErrorCode::SYSCALL && self.io().eof());
            match code {
                ErrorCode::WANT_READ => break,
                _ if eof && filled == 0 => return Ok(Decrypted::Closed),
                _ if eof => break,
                _ => {
                    self.broken = true;
                    return Err(RawSslError {
                        code: code.as_raw(),
                    }
                    .into());
                }
            }
        }
        Ok(if filled > 0 {
            Decrypted::Data(filled)
        } else {
            Decrypted::NeedMore
        })
    }

    /// Encrypts all of `plaintext` into the outgoing ciphertext.
    pub fn encrypt(&mut self, mut plaintext: &[u8]) -> io::Result<()> {
        self.check()?;
        while !plaintext.is_empty() {
            match self.stream.ssl_write(plaintext) {
                Ok(n) => plaintext = &plaintext[n..],
                Err(e) => return Err(self.fatal(e)),
            }
        }
        Ok(())
    }

    /// Encrypts `len` bytes of `raw` from `at` into the outgoing ciphertext, OpenSSL reading
    /// the plaintext itself (see `raw.rs`).
    pub fn encrypt_raw(&mut self, raw: &dyn RawPlaintext, at: usize, len: usize) -> io::Result<()> {
        self.check()?;
        let end = at
            .checked_add(len)
            .filter(|&end| end <= raw.len())
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "raw range out of bounds")
            })?;
        let mut pos = at;
        while pos < end {
            match raw.ssl_write(self.stream.ssl(), pos, end - pos) {
                Ok(n) if n > 0 => pos += n,
                Ok(_) => {
                    self.broken = true;
                    return Err(io::ErrorKind::WriteZero.into());
                }
                Err(e) => {
                    self.broken = true;
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Queues a close_notify alert (best effort: a broken session sends nothing).
    pub fn close_notify(&mut self) {
        if !self.broken {
            let _ = self.stream.shutdown();
        }
    }

    fn is_plain_eof(&mut self, e: &ssl::Error) -> bool {
        e.code() == ErrorCode::SYSCALL && e.io_error().is_none() && self.io().eof()
    }

    fn check(&self) -> io::Result<()> {
        if self.broken {
            return Err(io::Error::other("the TLS session has already failed"));
        }
        Ok(())
    }

    /// Ends the session for `e`: an I/O error as it was, a TLS error as an
    /// `InvalidData` error whose inner error is the [`Refusal`](crate::Refusal) it means
    /// (see [`crate::refusal_of`]).
    fn fatal(&mut self, e: ssl::Error) -> io::Error {
        self.broken = true;
        if e.io_error().is_some() {
            if let Ok(io) = e.into_io_error() {
                return io;
            }
            return io::Error::other("TLS: I/O error");
        }
        let refusal = self.classifier.classify(&e, self.stream.ssl());
        io::Error::new(io::ErrorKind::InvalidData, refusal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(io: &mut MemIo) -> Vec<u8> {
        let mut out = vec![0u8; 1 << 16];
        let n = io.read(&mut out).unwrap_or(0);
        out.truncate(n);
        out
    }

    #[test]
    fn fed_and_filled_bytes_come_out_in_order_and_the_buffer_stays_small() {
        let mut io = MemIo::default();
        io.feed(b"abc");
        let n = io.fill_from(8, |b| {
            b[..2].copy_from_slice(b"de");
            Ok(2)
        });
        assert_eq!(n.unwrap(), 2);
        let mut two = [0u8; 2];
        assert_eq!(io.read(&mut two).unwrap(), 2);
        assert_eq!(&two, b"ab");
        // The unconsumed tail moves to the front rather than the buffer growing.
        for round in 0..100u8 {
            io.fill_from(1000, |b| {
                b[..1000].fill(round);
                Ok(1000)
            })
            .unwrap();
            let mut chunk = vec![0u8; 1000];
            assert_eq!(io.read(&mut chunk).unwrap(), 1000);
        }
        assert!(io.incoming.len() <= 2000, "{}", io.incoming.len());
        assert_eq!(read_all(&mut io).len(), 3);
        assert_eq!(
            io.read(&mut two).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        io.feed_eof();
        assert_eq!(io.read(&mut two).unwrap(), 0);
    }

    #[test]
    fn swapped_feeds_keep_the_unconsumed_bytes_in_front_and_copy_when_they_do_not_fit() {
        let head = 8;
        let mut io = MemIo::default();
        let mut rx = vec![0u8; head + 16];
        rx[head..head + 5].copy_from_slice(b"hello");
        io.feed_swap(&mut rx, head, 5);
        assert!(rx.is_empty(), "the engine's first buffer comes back");
        let mut three = [0u8; 3];
        assert_eq!(io.read(&mut three).unwrap(), 3);
        assert_eq!(&three, b"hel");
        // "lo" is unconsumed: it goes in front of the next read's bytes.
        rx.resize(head + 16, 0);
        rx[head..head + 6].copy_from_slice(b" world");
        io.feed_swap(&mut rx, head, 6);
        assert_eq!(read_all(&mut io), b"lo world");
        // More unconsumed than the head holds: copied behind it instead, nothing lost.
        io.feed(b"0123456789");
        let mut rx = vec![b'x'; head + 4];
        rx[head..].copy_from_slice(b"abcd");
        io.feed_swap(&mut rx, head, 4);
        assert_eq!(rx.len(), head + 4, "no swap");
        assert_eq!(read_all(&mut io), b"0123456789abcd");
    }

    #[test]
    fn a_failed_fill_adds_nothing() {
        let mut io = MemIo::default();
        let r = io.fill_from(64, |_| Err(io::ErrorKind::WouldBlock.into()));
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert_eq!(read_all(&mut io), b"");
    }
}
