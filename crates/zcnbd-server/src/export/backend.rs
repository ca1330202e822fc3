//! The operations every part of an export's stack answers (nbdkit's plugin shape: capability
//! queries plus flagged operations): a base backend (memory, file, null, RBD) implements
//! [`Backend`]; a layer over it is a [`Layer`](super::Layer), which the stack turns into a
//! `Backend` over the rest ([`Layered`](super::Layered)). Nothing here checks a request: the
//! stack's top ([`Stack`](super::Stack)) does, once, before a call comes down.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use zcnbd_proto::Extent;

use super::async_op::{AsyncOp, Completion, Plug};
use super::durability::Durability;
use super::flags::{Capabilities, ZeroError, ZeroFlags};
use super::lease::Leases;
use super::place::{Map, MapFor, Medium, Place};
use crate::pipe::Pipe;

/// A part of an export's stack. Offsets and lengths are already checked against the size by
/// the stack's top, and a write never reaches a read-only stack.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// What it can do.
    fn capabilities(&self) -> Capabilities;
    /// Fills `buf` from `offset`.
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`, durably if `fua` (asked only if it says it can).
    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Discards a range (advisory).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()>;
    /// Makes a range read as zeroes.
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError>;
    /// Prefetches a range.
    fn cache(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Appends up to `extents_max` `base:allocation` extents covering `[offset, offset+len)`
    /// from `offset` on (fewer if they run out; at least one when `len > 0`).
    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()>;
    /// Metadata contexts it answers besides `base:allocation`, by name (an image:
    /// `qemu:allocation-depth`). The default: none.
    fn meta_contexts(&self) -> Vec<String> {
        Vec::new()
    }
    /// Appends up to `extents_max` extents of `context` (one that [`Backend::meta_contexts`]
    /// names) covering `[offset, offset+len)` from `offset` on, as [`Backend::extents`] does
    /// for `base:allocation`; each extent's flags mean what the context says.
    fn meta_extents(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let _ = (context, offset, len, extents_max, out);
        Err(io::Error::from_raw_os_error(libc::EINVAL))
    }
    /// Where the bytes of `[offset, offset+len)` live, so that an engine can move them
    /// itself (splice, sendfile, a send from a mapping, O_DIRECT into its own buffers, a
    /// payload received in place): appends segments covering the range to `out`. For
    /// [`MapFor::Write`] a backend that allocates (an image) allocates first. The default
    /// says "nowhere an engine can reach": the bytes are computed, and every request goes
    /// through the methods above. Called on an engine's thread: it must not wait on a
    /// device or the network (a backend that would answers [`Place::Stack`](super::Place)).
    fn map(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<()> {
        let _ = (offset, how);
        out.push_stack(len);
        Ok(())
    }
    /// Whether the export can still promise durability, where the backend keeps it across
    /// a reload (it keeps its descriptors): see `durability.rs`. `None`: the stack keeps one.
    fn durability(&self) -> Option<std::sync::Arc<Durability>> {
        None
    }
    /// The lease table of a backend whose maps can change while the server runs (a writable
    /// disk image: imago reallocates clusters and reuses freed ones), or `None` where a place
    /// it names stays where that range's bytes live for as long as it is open.
    ///
    /// The contract of [`Backend::map`]: a place it named stays that range's, and no other
    /// range's, for as long as the engine that was given it holds its lease. With a table the
    /// stack leases every map (rounded out to the table's granule) and registers every
    /// write, trim and zero as a change, which waits for the overlapping leases to end (see
    /// `lease.rs`); the backend must free or reuse a place only inside a change of the range
    /// it was mapped for. Without one, the backend promises that its places never change.
    fn leases(&self) -> Option<std::sync::Arc<Leases>> {
        None
    }
    /// An engine wrote `[offset, offset+len)` into places [`Backend::map`] named, itself:
    /// called once the bytes landed and before the write is acknowledged (a layer that
    /// records writes, such as the dirty bitmaps, records it here). The default: nothing.
    fn wrote_in_place(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }
    /// What kind of places [`Backend::map`] answers with, for choices an engine makes once
    /// per connection (a nonblocking socket for `sendfile`, registered buffers for
    /// O_DIRECT). `None`: it never names a place.
    fn medium(&self) -> Option<Medium> {
        None
    }
    /// The alignment every request must have (an NBD upstream's minimum block size): the
    /// export advertises at least this. The default: 1, any.
    fn block_size_minimum(&self) -> u32 {
        1
    }
    /// Whether a structured read asks [`Backend::extents`] first, to send its holes as hole
    /// chunks. False where finding the extents costs a round trip of its own (RBD: a RADOS
    /// read of the object map), so that every read is one data chunk read in one operation.
    fn sparse_reads(&self) -> bool {
        true
    }
    /// Whether every blocking method returns without waiting on a device or the network (a
    /// memory export: its work is a copy), so an engine may run requests on the thread that
    /// read them instead of handing them to the worker pool.
    fn never_waits(&self) -> bool {
        false
    }
    /// Whether requests' operations go to [`Backend::submit`] instead of the blocking methods
    /// on the worker pool. Such a backend's `map` names no place, so every request goes
    /// through the dispatcher; its blocking methods are still called outside requests (the
    /// flush at shutdown).
    fn can_submit(&self) -> bool {
        false
    }
    /// Starts `op` and returns without waiting for it; `done` is to be called when it is
    /// finished, from any thread (the backend's own, as librbd's aio callbacks are) or before
    /// `submit` returns. Called only if [`Backend::can_submit`], from an engine's thread (a
    /// connection's reader, a ring), so it must not block, or from the thread that completes
    /// the request's previous operation (a read's data after its extents), so it must not
    /// wait for that thread either. The completion may release the last reference to the
    /// backend, on the thread that calls it. The default refuses (`EOPNOTSUPP`): blocking
    /// backends are never asked.
    fn submit(&self, op: AsyncOp, done: Completion) {
        done.complete(op, Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
    }
    /// For an engine with an event loop of its own, on an asynchronous backend: from now on
    /// the completions of submitted operations are the caller's to run - it polls the
    /// returned descriptor (readable while some wait) and calls
    /// [`Backend::run_completions`] on whichever of its threads sees it - instead of a
    /// thread of the backend's waking for each and handing it over. `None` (the default):
    /// the backend has no such descriptor; its completions run where they run.
    fn poll_completions(&self) -> Option<Arc<OwnedFd>> {
        None
    }
    /// Runs the completions that wait now on the caller's thread, without waiting (see
    /// [`Backend::poll_completions`]). Returns how many ran.
    fn run_completions(&self) -> usize {
        0
    }
    /// Holds back the sending of operations submitted from now until the returned value is
    /// dropped, so that a caller about to submit several sends them together (one socket
    /// call for all). `None` (the default): each leaves as it is submitted.
    fn plug(&self) -> Option<Plug> {
        None
    }
    /// For an engine that drives sockets on its own ring (`zcnbd attach`'s queues in
    /// zero-copy mode): how to open more connections to the NBD server this backend is a
    /// plain client of, whose reads and writes are the backend's own (a bare upstream with
    /// multi-conn, so a request on any connection is as good as one through the backend).
    /// The default: none.
    fn nbd_stream(&self) -> Option<NbdStream> {
        None
    }
    /// How many of its operations can make progress at once, if a bound is known (a web
    /// server's source: its connections). The stack runs no more than that on workers at a
    /// time; the rest wait in its lane (`worker_pool::Lane`). The default: no bound.
    fn concurrency_max(&self) -> Option<usize> {
        None
    }
    /// Whether [`Backend::read_to_pipe`] answers reads: a source whose bytes arrive on a
    /// socket (a plain-HTTP web server's) can move them into a pipe by `splice`, and an
    /// engine that takes piped replies sends them on by `splice` again - no copy through
    /// user memory on the way from the upstream to the client. The default: no.
    fn pipes_reads(&self) -> bool {
        false
    }
    /// Puts the `len` bytes at `offset` into `pipe` (empty, said to hold at least `len`
    /// bytes) - where the pipe fills early (it holds buffers, not bytes), as many as it
    /// takes, the rest handed back in a buffer - or fails. Called only where [`Backend::pipes_reads`] says
    /// so, on a worker thread (it may wait). The default refuses (`EOPNOTSUPP`).
    fn read_to_pipe(&self, pipe: &Pipe, offset: u64, len: usize) -> io::Result<PipedRead> {
        let _ = (pipe, offset, len);
        Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }
    /// Drops what the backend holds open to its source and opens it again (a remote
    /// source's connections), for the retry layer after a failure. The default: nothing to
    /// reopen.
    fn reopen(&self) -> io::Result<()> {
        Ok(())
    }
}

/// How [`Backend::read_to_pipe`] answered: the read's bytes are in the pipe, then in the
/// `more` pipes in order, then `tail`.
#[derive(Debug, Default)]
pub struct PipedRead {
    /// Bytes that went through user memory on the way (body bytes that came with a
    /// response's head; the tail).
    pub copied: usize,
    /// Pipes taken when the first filled before the read's end (a pipe holds buffers, not
    /// bytes: one per TCP segment's fragment), each with the bytes it holds; at most
    /// [`MORE_PIPES_MAX`].
    pub more: Vec<(Pipe, usize)>,
    /// The last bytes, which did not fit in the pipes (usually none).
    pub tail: Vec<u8>,
}

/// The most pipes a piped read takes after its first (see [`PipedRead::more`]): a 1 MiB body
/// in 1500-byte Ethernet segments takes about 725 buffers, three pipes of 256.
pub const MORE_PIPES_MAX: usize = 3;

impl PipedRead {
    /// The bytes in the `more` pipes.
    pub fn more_bytes(&self) -> usize {
        self.more.iter().map(|(_, n)| n).sum()
    }
}

/// Performs `op` with `backend`'s blocking methods, unchecked (the stack's `run` is the
/// checked form): how an asynchronous backend built over a blocking one can run it on a
/// thread of its own.
pub fn run_blocking<B: Backend + ?Sized>(backend: &B, op: &mut AsyncOp) -> io::Result<()> {
    match op {
        AsyncOp::Read { buf, offset } => backend.pread(buf, *offset),
        AsyncOp::ReadPiped {
            buf,
            offset,
            in_pipe,
            ..
        } => {
            *in_pipe = 0;
            backend.pread(buf, *offset)
        }
        AsyncOp::Write { buf, offset, fua } => backend.pwrite(buf, *offset, *fua),
        AsyncOp::Flush => backend.flush(),
        AsyncOp::Trim { offset, len, fua } => backend.trim(*offset, *len, *fua),
        AsyncOp::Zero { offset, len, flags } => Ok(backend.zero(*offset, *len, *flags)?),
        AsyncOp::Cache { offset, len } => backend.cache(*offset, *len),
        AsyncOp::Extents {
            offset,
            len,
            extents_max,
            out,
        } => backend.extents(*offset, *len, *extents_max, out),
    }
}

/// How a backend whose holes read as zeroes at their place maps a range: all of it at
/// `place_at(offset, len)`, unless holes are wanted: then two extents tell whether it is all
/// data, all hole, or mixed (the rest left to the stack, which reads it as a sparse reply).
pub(crate) fn map_with_holes<B: Backend + ?Sized>(
    backend: &B,
    offset: u64,
    len: u64,
    how: MapFor,
    out: &mut Map,
    place_at: impl FnMut(u64, u64) -> Place,
) -> io::Result<()> {
    let mut place_at = place_at;
    if how != (MapFor::Read { holes: true }) {
        out.push(len, place_at(offset, len));
        return Ok(());
    }
    let mut extents = Vec::with_capacity(2);
    backend.extents(offset, len, 2, &mut extents)?;
    out.push_extents(offset, len, &extents, place_at);
    Ok(())
}

/// How to open another plain connection to a backend's NBD server ([`Backend::nbd_stream`]).
#[derive(Debug, Clone)]
pub struct NbdStream {
    /// The server's URI (names no key: a plain `nbd://`, `nbd+unix://` or `nbd+vsock://`).
    pub uri: String,
    /// The options the backend's own connections use (metadata contexts aside).
    pub options: zcnbd_client::ClientOptions,
}

impl NbdStream {
    /// Connects and negotiates a connection the caller drives.
    pub fn open(&self) -> Result<zcnbd_client::RawConnection, zcnbd_client::Error> {
        zcnbd_client::open_raw(&self.uri, &self.options)
    }
}
