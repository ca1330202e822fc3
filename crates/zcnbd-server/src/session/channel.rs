//! A client's byte stream: the socket itself, or a TLS session over it once the client sent
//! `NBD_OPT_STARTTLS` (records encrypted and decrypted in user space, `zcnbd-tls`). The handshake
//! reads and writes a [`Channel`]; the portable engine splits it into the reader's
//! [`Inbound`] and the writer's [`Outbound`].

use std::io::{self, IoSlice, Read};
use std::sync::Arc;

use crate::stats::Stats;
use crate::stream::Stream;
use crate::sys::mapped_io::{recv_into, recv_into_nowait, send_pieces, OutPiece};
use crate::sys::mapping::MappedRange;
use crate::tls::{Plaintext, TlsCounters, TlsReader, TlsSession, TlsWriter};

/// One client's bytes, both ways.
pub enum Channel {
    Plain(Stream),
    Tls(TlsHalves),
}

/// A TLS session's two halves and the socket under them.
pub struct TlsHalves {
    reader: TlsReader<Stream>,
    writer: TlsWriter<Stream>,
    socket: Stream,
    tally: Arc<Tally>,
    /// The kernel encrypts what is sent on `socket` (kTLS).
    kernel_sends: bool,
}

impl Channel {
    /// Wraps an established TLS session over `socket`; its bytes are counted in `stats`.
    pub fn tls(session: TlsSession<Stream>, socket: Stream, stats: &Arc<Stats>) -> Channel {
        let tally = Arc::new(Tally {
            counters: session.counters(),
            stats: Arc::clone(stats),
        });
        stats.tls_connection();
        let kernel_sends = session.kernel_sends();
        if kernel_sends {
            stats.tls_kernel_connection();
        }
        let (reader, writer) = session.split();
        Channel::Tls(TlsHalves {
            reader,
            writer,
            socket,
            tally,
            kernel_sends,
        })
    }

    /// The socket (for timeouts and shutdown; never for bytes under TLS).
    pub fn socket(&self) -> &Stream {
        match self {
            Channel::Plain(s) => s,
            Channel::Tls(t) => &t.socket,
        }
    }

    /// Whether the bytes are under TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, Channel::Tls(_))
    }

    /// Reads what is there (decrypted, under TLS).
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Channel::Plain(s) => s.read(buf),
            Channel::Tls(t) => t.reader.read(buf),
        }
    }

    /// Sends all of `bytes` (encrypted, under TLS).
    pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Channel::Plain(s) => s.write_all_vectored(&mut [IoSlice::new(bytes)]),
            Channel::Tls(t) => t.writer.write_all_vectored(&[IoSlice::new(bytes)]),
        }
    }

    /// The reader's and the writer's halves, for two threads.
    pub fn split(self) -> io::Result<(Inbound, Outbound)> {
        Ok(match self {
            Channel::Plain(s) => {
                let writer = s.try_clone()?;
                (
                    Inbound::Plain(s),
                    Outbound {
                        socket: writer,
                        tls: None,
                    },
                )
            }
            Channel::Tls(t) => (
                Inbound::Tls {
                    reader: t.reader,
                    _tally: Arc::clone(&t.tally),
                },
                Outbound {
                    socket: t.socket,
                    tls: Some((t.writer, t.tally)),
                },
            ),
        })
    }
}

impl TlsHalves {
    /// Whether the kernel encrypts what is sent on the socket (kTLS).
    pub fn kernel_sends(&self) -> bool {
        self.kernel_sends
    }

    /// For the io_uring engine (kTLS only): the socket replies are sent on in plain text,
    /// and the reader with the session's tally for the feed thread (`tls_feed.rs`). The
    /// writer half is dropped: the ring writes on the socket itself.
    pub fn into_kernel_parts(self) -> (Stream, TlsReader<Stream>, Arc<Tally>) {
        (self.socket, self.reader, self.tally)
    }
}

/// The reading half.
pub enum Inbound {
    Plain(Stream),
    Tls {
        reader: TlsReader<Stream>,
        /// Keeps the session's count open until both halves are gone.
        _tally: Arc<Tally>,
    },
}

impl Inbound {
    /// The socket under this half.
    pub fn socket(&self) -> &Stream {
        match self {
            Inbound::Plain(s) => s,
            Inbound::Tls { reader, .. } => reader.socket(),
        }
    }

    /// Reads up to `len` bytes into `range` from `at` (decrypted, under TLS) without Rust
    /// touching the mapping: `recv` into it, or OpenSSL decrypting into it.
    pub fn read_into(&mut self, range: &MappedRange, at: usize, len: usize) -> io::Result<usize> {
        match self {
            Inbound::Plain(s) => recv_into(s.fd(), range, at, len),
            Inbound::Tls { reader, .. } => reader.read_raw(range, at, len),
        }
    }

    /// Like [`read_into`](Self::read_into), but `WouldBlock` instead of waiting.
    pub fn read_into_nowait(
        &mut self,
        range: &MappedRange,
        at: usize,
        len: usize,
    ) -> io::Result<usize> {
        match self {
            Inbound::Plain(s) => recv_into_nowait(s.fd(), range, at, len),
            Inbound::Tls { reader, .. } => reader.read_raw_nowait(range, at, len),
        }
    }

    /// Like [`Read::read`], but `WouldBlock` instead of waiting: what has arrived (under
    /// TLS: whole records of it).
    pub fn read_nowait(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Inbound::Plain(s) => s.read_nowait(buf),
            Inbound::Tls { reader, .. } => reader.read_nowait(buf),
        }
    }
}

impl Read for Inbound {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Inbound::Plain(s) => s.read(buf),
            Inbound::Tls { reader, .. } => reader.read(buf),
        }
    }
}

/// The writing half, with the socket for timeouts and a hard disconnect.
pub struct Outbound {
    socket: Stream,
    tls: Option<(TlsWriter<Stream>, Arc<Tally>)>,
}

impl Outbound {
    /// The socket under this half.
    pub fn socket(&self) -> &Stream {
        &self.socket
    }

    /// Sends every byte of `pieces`: in plain text with no copy of ours (a mapped piece
    /// straight from the export's pages), or encrypted straight from them under TLS.
    pub fn write_all_pieces(&mut self, pieces: &[OutPiece<'_>]) -> io::Result<()> {
        match &mut self.tls {
            None => {
                let total: usize = pieces.iter().map(|p| p.len()).sum();
                let mut sent = 0;
                while sent < total {
                    match send_pieces(self.socket.fd(), pieces, sent) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => sent += n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
            Some((writer, _)) => {
                let parts: Vec<Plaintext<'_>> = pieces
                    .iter()
                    .map(|p| match p {
                        OutPiece::Bytes(b) => Plaintext::Bytes(b),
                        OutPiece::Mapped(m) => Plaintext::Raw(*m),
                    })
                    .collect();
                writer.write_all_parts(&parts)
            }
        }
    }

    /// The end of a healthy connection: under TLS, a close_notify alert (best effort).
    pub fn finish(&mut self) {
        if let Some((writer, _)) = &mut self.tls {
            let _ = writer.close();
        }
    }
}

/// Adds a TLS session's byte counts to the server's counters once both halves are gone.
pub struct Tally {
    counters: Arc<TlsCounters>,
    stats: Arc<Stats>,
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.stats.tls_session_closed(
            self.counters.encrypted_bytes(),
            self.counters.decrypted_bytes(),
        );
    }
}
