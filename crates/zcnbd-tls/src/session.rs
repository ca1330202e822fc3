//! A TLS connection shared by a reader thread and a writer thread.
//!
//! OpenSSL's `SSL` cannot be used from two threads at once, so it lives in an [`Engine`]
//! behind a mutex that is held only while OpenSSL works on memory (see `engine.rs`); no
//! thread ever blocks on the socket while holding it:
//!
//! - the reader reads ciphertext from the socket with no lock held, then locks the engine to
//!   feed it and decrypt straight into the caller's buffer;
//! - the writer locks the engine to encrypt straight from the caller's slices, then sends
//!   the ciphertext with the engine unlocked.
//!
//! Records carry sequence numbers, so ciphertext must reach the socket in the order OpenSSL
//! produced it, and the reader produces some too (a TLS 1.3 KeyUpdate answer, an alert).
//! Both sides therefore send through one [`Sender`] and take its lock *before* releasing the
//! engine's: the order of the two locks is always engine, then sender, so it cannot
//! deadlock, and a thread blocked in a send holds only the sender.
//!
//! When the kernel encrypts (kTLS, [`TlsSession::kernel_sends`]) the writer sends plaintext
//! on the socket through the sender, without the engine; what OpenSSL itself still sends
//! (the reader's KeyUpdate answer, alerts) goes straight to the socket as kTLS control
//! records, so no ciphertext ever waits in memory.

use std::io::{self, IoSlice, Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::{Decrypted, Engine, TlsCounters, FEED_HEAD_BYTES};
use crate::raw::{Plaintext, RawDest, RawPlaintext};
use crate::transport::Transport;
use crate::TlsInfo;

/// Ciphertext read from the socket per read call.
pub const RECEIVE_BUFFER_BYTES: usize = 64 * 1024;
/// Plaintext encrypted per lock hold before the ciphertext is sent: bounds the memory held
/// and lets a large reply's encryption and sending overlap with the reader's work.
pub const SEND_CHUNK_BYTES: usize = 256 * 1024;
/// The largest TLS record payload; small slices are gathered up to this so a reply's header
/// shares a record with the start of its data.
pub const RECORD_PLAINTEXT_BYTES: usize = 16 * 1024;

/// The sending end of the socket.
///
/// Invariant: `buf` is empty whenever the lock is free (a sender clears it after sending).
struct Sender<S> {
    sock: S,
    buf: Vec<u8>,
}

struct Shared<S> {
    engine: Mutex<Engine>,
    sender: Mutex<Sender<S>>,
    counters: Arc<TlsCounters>,
    /// The kernel encrypts what is written on the socket.
    kernel_sends: bool,
}

/// An established TLS session, before it is split between a reader and a writer.
pub struct TlsSession<S> {
    shared: Arc<Shared<S>>,
    reader_sock: S,
    info: TlsInfo,
}

impl<S: Transport> TlsSession<S> {
    /// Wraps an engine whose handshake is complete; `sock` is the connection's socket.
    pub(crate) fn new(engine: Engine, sock: S, info: TlsInfo) -> io::Result<TlsSession<S>> {
        let reader_sock = sock.try_clone()?;
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            sender: Mutex::new(Sender {
                sock,
                buf: Vec::new(),
            }),
            counters: Arc::default(),
            kernel_sends: info.kernel_sends,
        });
        Ok(TlsSession {
            shared,
            reader_sock,
            info,
        })
    }

    /// What was negotiated and who the peer is.
    pub fn info(&self) -> &TlsInfo {
        &self.info
    }

    /// Whether the kernel encrypts what is sent (kTLS): plaintext written on the socket
    /// leaves as TLS records.
    pub fn kernel_sends(&self) -> bool {
        self.shared.kernel_sends
    }

    /// The session's byte counters (live: they keep counting after `split`).
    pub fn counters(&self) -> Arc<TlsCounters> {
        self.shared.counters.clone()
    }

    /// The reader and writer halves, one for each thread.
    pub fn split(self) -> (TlsReader<S>, TlsWriter<S>) {
        let reader = TlsReader {
            shared: self.shared.clone(),
            sock: self.reader_sock,
            rx: vec![0; FEED_HEAD_BYTES + RECEIVE_BUFFER_BYTES],
            rx_len: 0,
            eof: false,
        };
        let writer = TlsWriter {
            shared: self.shared,
            staging: Vec::with_capacity(RECORD_PLAINTEXT_BYTES),
        };
        (reader, writer)
    }
}

/// Sends what the engine has queued, in order; releases the engine before the socket write.
fn ship<S: Write>(mut engine: MutexGuard<'_, Engine>, sender: &Mutex<Sender<S>>) -> io::Result<()> {
    if engine.io().outgoing().is_empty() {
        return Ok(());
    }
    let mut tx = lock(sender)?;
    std::mem::swap(engine.io().outgoing(), &mut tx.buf);
    drop(engine);
    let Sender { sock, buf } = &mut *tx;
    let sent = sock.write_all(buf);
    buf.clear();
    sent
}

/// Writes every byte of `slices`, resuming after short writes. A reply usually goes in one
/// vectored write; only a short one pays for a copy of the slice list to advance through.
fn write_all_slices<S: Write>(sock: &mut S, slices: &[IoSlice<'_>]) -> io::Result<()> {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let first = loop {
        match sock.write_vectored(slices) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            other => break other?,
        }
    };
    if first == total {
        return Ok(());
    }
    let mut owned: Vec<IoSlice<'_>> = slices.to_vec();
    let mut rest = &mut owned[..];
    IoSlice::advance_slices(&mut rest, first);
    while !rest.is_empty() {
        match sock.write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> io::Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| io::Error::other("TLS session poisoned by a panic"))
}

/// The reading half: decrypted bytes through [`Read`]; `Ok(0)` once the peer has closed.
pub struct TlsReader<S> {
    shared: Arc<Shared<S>>,
    sock: S,
    /// Ciphertext read from the socket and not yet fed (`rx[FEED_HEAD_BYTES..][..rx_len]`),
    /// read there unlocked (the writer may encrypt meanwhile) and then swapped in, not
    /// copied (`MemIo::feed_swap`).
    rx: Vec<u8>,
    rx_len: usize,
    eof: bool,
}

impl<S: Transport> TlsReader<S> {
    /// The session's byte counters.
    pub fn counters(&self) -> Arc<TlsCounters> {
        self.shared.counters.clone()
    }

    /// The socket this half reads from (to set timeouts, say).
    pub fn socket(&self) -> &S {
        &self.sock
    }

    /// Decrypts up to `len` bytes into `dest` from `at`, OpenSSL writing the memory itself
    /// (see `raw.rs`); `Ok(0)` once the peer has closed, as for [`Read::read`].
    pub fn read_raw(&mut self, dest: &dyn RawDest, at: usize, len: usize) -> io::Result<usize> {
        if len == 0 {
            return Ok(0);
        }
        self.read_with(Wait::Yes, |engine| engine.decrypt_raw(dest, at, len))
    }

    /// Like [`read_raw`](Self::read_raw), but `WouldBlock` instead of waiting for the socket
    /// when what has arrived holds no whole record.
    pub fn read_raw_nowait(
        &mut self,
        dest: &dyn RawDest,
        at: usize,
        len: usize,
    ) -> io::Result<usize> {
        if len == 0 {
            return Ok(0);
        }
        self.read_with(Wait::No, |engine| engine.decrypt_raw(dest, at, len))
    }

    /// Like [`Read::read`], but `WouldBlock` instead of waiting for the socket when what has
    /// arrived holds no whole record (the caller has something to do before it waits).
    pub fn read_nowait(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.read_with(Wait::No, |engine| engine.decrypt(buf))
    }

    /// Feeds what was read, decrypts with `decrypt`, and reads more ciphertext until
    /// something was decrypted or the session ended (or, with `Wait::No`, until the socket
    /// has nothing more now: `WouldBlock`).
    fn read_with(
        &mut self,
        wait: Wait,
        mut decrypt: impl FnMut(&mut Engine) -> io::Result<Decrypted>,
    ) -> io::Result<usize> {
        loop {
            let mut engine = lock(&self.shared.engine)?;
            if self.rx_len > 0 {
                engine
                    .io()
                    .feed_swap(&mut self.rx, FEED_HEAD_BYTES, self.rx_len);
                self.rx_len = 0;
            }
            if self.eof {
                engine.io().feed_eof();
            }
            let step = decrypt(&mut engine);
            // Whatever the read made OpenSSL say (a KeyUpdate answer, an alert) goes out now:
            // the writer may be idle for a long time.
            ship(engine, &self.shared.sender)?;
            match step? {
                Decrypted::Data(n) => {
                    self.shared.counters.add_decrypted(n);
                    return Ok(n);
                }
                Decrypted::Closed => return Ok(0),
                Decrypted::NeedMore if self.eof => {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                Decrypted::NeedMore => {}
            }
            // After a swap `rx` is the engine's old buffer, which may be shorter.
            if self.rx.len() < FEED_HEAD_BYTES + RECEIVE_BUFFER_BYTES {
                self.rx.resize(FEED_HEAD_BYTES + RECEIVE_BUFFER_BYTES, 0);
            }
            let into = &mut self.rx[FEED_HEAD_BYTES..FEED_HEAD_BYTES + RECEIVE_BUFFER_BYTES];
            let n = match wait {
                Wait::Yes => self.sock.read(into)?,
                Wait::No => self.sock.read_nowait(into)?,
            };
            self.rx_len = n;
            self.eof = n == 0;
        }
    }
}

impl<S: Transport> Read for TlsReader<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.read_with(Wait::Yes, |engine| engine.decrypt(buf))
    }
}

/// Whether a read may wait for the socket.
#[derive(Clone, Copy)]
enum Wait {
    Yes,
    No,
}

/// The writing half: every write is encrypted and sent before it returns.
pub struct TlsWriter<S> {
    shared: Arc<Shared<S>>,
    /// Plaintext gathered from small slices, sent as one record (`<= RECORD_PLAINTEXT_BYTES`).
    staging: Vec<u8>,
}

impl<S: Transport> TlsWriter<S> {
    /// Encrypts and sends all of `slices` as one stream of bytes. Small slices (a reply
    /// header) are gathered into full records; large ones are encrypted in place. Under
    /// kTLS the plaintext goes to the socket as it is, in one vectored write.
    pub fn write_all_vectored(&mut self, slices: &[IoSlice<'_>]) -> io::Result<()> {
        if self.shared.kernel_sends {
            let mut tx = lock(&self.shared.sender)?;
            return write_all_slices(&mut tx.sock, slices);
        }
        self.encrypt_all(slices.iter().map(|s| Plaintext::Bytes(s)))
    }

    /// Encrypts and sends `pieces` as one stream of bytes, like
    /// [`write_all_vectored`](Self::write_all_vectored); raw pieces are encrypted by
    /// OpenSSL straight from their memory (see `raw.rs`). Raw plaintext cannot be sent under
    /// kTLS (the kernel would need the raw memory): that is an error, and nothing is sent.
    pub fn write_all_parts(&mut self, pieces: &[Plaintext<'_>]) -> io::Result<()> {
        if self.shared.kernel_sends {
            if pieces.iter().any(|p| matches!(p, Plaintext::Raw(_))) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "raw plaintext cannot be sent under kTLS",
                ));
            }
            let slices: Vec<IoSlice<'_>> = pieces
                .iter()
                .filter_map(|p| match p {
                    Plaintext::Bytes(b) => Some(IoSlice::new(b)),
                    Plaintext::Raw(_) => None,
                })
                .collect();
            let mut tx = lock(&self.shared.sender)?;
            return write_all_slices(&mut tx.sock, &slices);
        }
        self.encrypt_all(pieces.iter().copied())
    }

    /// The user-space record path: small byte pieces are gathered into full records, large
    /// ones and raw ones encrypted where they are.
    fn encrypt_all<'a>(&mut self, pieces: impl Iterator<Item = Plaintext<'a>>) -> io::Result<()> {
        for piece in pieces {
            let mut rest: &[u8] = match piece {
                Plaintext::Bytes(bytes) => bytes,
                Plaintext::Raw(raw) => {
                    // What was gathered before it goes first: records leave in order.
                    self.flush_staging()?;
                    self.send_raw(raw)?;
                    continue;
                }
            };
            if !self.staging.is_empty() || rest.len() < RECORD_PLAINTEXT_BYTES {
                let take = rest.len().min(RECORD_PLAINTEXT_BYTES - self.staging.len());
                self.staging.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
                if self.staging.len() == RECORD_PLAINTEXT_BYTES {
                    self.flush_staging()?;
                }
            }
            if rest.len() >= RECORD_PLAINTEXT_BYTES {
                self.send(rest)?;
            } else {
                self.staging.extend_from_slice(rest);
            }
        }
        self.flush_staging()
    }

    /// Sends a close_notify alert; the peer's reader sees a clean end.
    pub fn close(&mut self) -> io::Result<()> {
        let mut engine = lock(&self.shared.engine)?;
        engine.close_notify();
        ship(engine, &self.shared.sender)
    }

    /// The session's byte counters.
    pub fn counters(&self) -> Arc<TlsCounters> {
        self.shared.counters.clone()
    }

    fn flush_staging(&mut self) -> io::Result<()> {
        if self.staging.is_empty() {
            return Ok(());
        }
        let staged = std::mem::take(&mut self.staging);
        let sent = self.send(&staged);
        self.staging = staged;
        self.staging.clear();
        sent
    }

    fn send(&self, plaintext: &[u8]) -> io::Result<()> {
        for chunk in plaintext.chunks(SEND_CHUNK_BYTES) {
            let mut engine = lock(&self.shared.engine)?;
            engine.encrypt(chunk)?;
            self.shared.counters.add_encrypted(chunk.len());
            ship(engine, &self.shared.sender)?;
        }
        Ok(())
    }

    /// Encrypts and sends all of `raw`, a chunk per lock hold as for bytes.
    fn send_raw(&self, raw: &dyn RawPlaintext) -> io::Result<()> {
        let len = raw.len();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(SEND_CHUNK_BYTES);
            let mut engine = lock(&self.shared.engine)?;
            engine.encrypt_raw(raw, at, n)?;
            self.shared.counters.add_encrypted(n);
            ship(engine, &self.shared.sender)?;
            at += n;
        }
        Ok(())
    }
}

impl<S: Transport> Write for TlsWriter<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all_vectored(&[IoSlice::new(buf)])?;
        Ok(buf.len())
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.write_all_vectored(bufs)?;
        Ok(bufs.iter().map(|b| b.len()).sum())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
