//! One connection's OpenSSL state over memory instead of a socket: ciphertext from the
//! socket is fed in, ciphertext OpenSSL produces piles up to be taken out and sent. No call
//! here blocks or touches a socket, so a mutex around an [`Engine`] is only ever held for
//! CPU work (the reader and writer threads share one, see `session.rs`).

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use openssl::ssl::{self, ErrorCode, Ssl, SslRef, SslStream};

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

/// The memory OpenSSL reads from and writes to.
///
/// Invariant: `consumed <= incoming.len()`; once everything fed is consumed both reset to 0,
/// so `incoming` holds at most one partial record plus what one socket read brought.
#[derive(Debug, Default)]
pub struct MemIo {
    incoming: Vec<u8>,
    consumed: usize,
    outgoing: Vec<u8>,
    eof: bool,
}

impl MemIo {
    /// Appends ciphertext read from the socket.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.consumed == self.incoming.len() {
            self.incoming.clear();
            self.consumed = 0;
        } else if self.consumed > self.incoming.len() / 2 {
            self.incoming.drain(..self.consumed);
            self.consumed = 0;
        }
        self.incoming.extend_from_slice(bytes);
    }

    /// The socket reached end-of-stream: OpenSSL sees EOF once `incoming` is used up.
    pub fn feed_eof(&mut self) {
        self.eof = true;
    }

    /// Whether end-of-stream was fed.
    pub fn eof(&self) -> bool {
        self.eof
    }

    /// The ciphertext waiting to be sent (the caller swaps it out and clears it).
    pub fn outgoing(&mut self) -> &mut Vec<u8> {
        &mut self.outgoing
    }
}

impl Read for MemIo {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = &self.incoming[self.consumed..];
        if available.is_empty() {
            return if self.eof {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let n = available.len().min(buf.len());
        buf[..n].copy_from_slice(&available[..n]);
        self.consumed += n;
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
    /// A fatal error ended the session; every later call fails.
    broken: bool,
}

impl Engine {
    /// Wraps a configured `Ssl` (accept or connect state already set).
    pub fn new(ssl: Ssl) -> io::Result<Engine> {
        let stream = SslStream::new(ssl, MemIo::default()).map_err(io::Error::other)?;
        Ok(Engine {
            stream,
            broken: false,
        })
    }

    pub fn io(&mut self) -> &mut MemIo {
        self.stream.get_mut()
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

    fn fatal(&mut self, e: ssl::Error) -> io::Error {
        self.broken = true;
        match e.into_io_error() {
            Ok(io) => io,
            Err(e) => io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}")),
        }
    }
}
