//! The client handle: one or more connections to one export, blocking positional I/O that
//! feels like `std::os::unix::fs::FileExt`, and the pieces the submit APIs build on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use zcnbd_proto::consts::{cmd_flags, transmission_flags as tf};
use zcnbd_proto::{
    ClientHandshakeOptions, ClientNegotiated, ClientSession, Command, MetaContext, MetaQueries,
    ReplyMode, SessionLimits,
};

use crate::conn::{Completed, Completer, Conn, PartSpec};
use crate::connect;
use crate::error::{Error, Result};
use crate::plan::{self, Geometry};
use crate::stats::{Stats, StatsSnapshot};
use crate::sys::Buffer;
use crate::uri::NbdUri;
use crate::wait::{lock, ConnCell, Waiter};

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Connections to open; more than 1 only if the server advertises `CAN_MULTI_CONN`.
    pub connections: usize,
    /// Most requests in flight per connection.
    pub requests_in_flight_max: u32,
    /// Ask for structured replies.
    pub structured_replies: bool,
    /// Ask for extended headers.
    pub extended_headers: bool,
    /// Ask for the `base:allocation` context (needed for [`Client::block_status`]).
    pub base_allocation: bool,
    /// More metadata contexts to ask for (`qemu:allocation-depth`,
    /// `qemu:dirty-bitmap:NAME`, ...; naming `base:allocation` asks for it too): at most
    /// [`META_CONTEXT_QUERIES_MAX`](zcnbd_proto::client_meta::META_CONTEXT_QUERIES_MAX),
    /// each `namespace:leaf` of at most 4096 bytes. Those the server selected are
    /// [`Client::meta_contexts`]; one it does not have is simply absent.
    pub meta_contexts: Vec<String>,
    /// Queries to list first (`NBD_OPT_LIST_META_CONTEXT`), whose contexts are then asked
    /// for too: a namespace such as `qemu:` (QEMU lists its `qemu:allocation-depth` and
    /// every `qemu:dirty-bitmap:NAME` under it) or `base:`. At most
    /// [`META_CONTEXT_QUERIES_MAX`](zcnbd_proto::client_meta::META_CONTEXT_QUERIES_MAX)
    /// queries; of what the server lists, as many are asked for as fit one selection beside
    /// `meta_contexts` ([`Client::meta_contexts_left_out`] counts the others). Further
    /// connections ask for the first one's contexts by name.
    pub list_meta_contexts: Vec<String>,
    /// Longest the connect and handshake of one connection may take.
    pub handshake_timeout: Duration,
    /// Most operations of the callback API (`Client::start_read`, ...) waiting, per
    /// connection, for a request slot: beyond it they fail with [`Error::Busy`].
    pub operations_queued_max: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connections: 1,
            requests_in_flight_max: 1024,
            structured_replies: true,
            extended_headers: true,
            base_allocation: true,
            meta_contexts: Vec::new(),
            list_meta_contexts: Vec::new(),
            handshake_timeout: Duration::from_secs(30),
            operations_queued_max: crate::backlog::OPERATIONS_QUEUED_MAX_DEFAULT,
        }
    }
}

/// Flags of a write.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriteFlags {
    /// Durable before the reply (`NBD_CMD_FLAG_FUA`).
    pub fua: bool,
}

/// Flags of a zero request.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Durable before the reply.
    pub fua: bool,
    /// Keep the range allocated (`NBD_CMD_FLAG_NO_HOLE`).
    pub no_hole: bool,
    /// Fail with `ENOTSUP` unless zeroing is fast (`NBD_CMD_FLAG_FAST_ZERO`).
    pub fast: bool,
}

pub(crate) fn fua(on: bool) -> u16 {
    if on {
        cmd_flags::FUA
    } else {
        0
    }
}

/// Largest part of a blocking operation submitted at once (bounded in-flight requests).
const BLOCKING_WINDOW_PARTS: u64 = 64;

/// A connected NBD client. All methods take `&self`: share it between threads freely.
pub struct Client {
    pub(crate) cells: Vec<ConnCell>,
    pub(crate) waiter: Waiter,
    geometry: Geometry,
    /// The metadata contexts the server selected, with the first connection's ids; every
    /// connection selected the same names (under ids of its own).
    pub(crate) meta_contexts: Vec<MetaContext>,
    /// Contexts the server listed that were not asked for.
    pub(crate) meta_left_out: u32,
    description: Option<String>,
    next: AtomicUsize,
    stats: Arc<Stats>,
    pub(crate) queue: crate::submit::CompletionQueue,
    /// Live [`Plug`](crate::Plug)s: while any lives, submissions are queued, not sent.
    pub(crate) plugs: AtomicUsize,
}

impl Client {
    /// Connects to `uri` with default options.
    pub fn connect(uri: &str) -> Result<Client> {
        Client::connect_with(uri, &ClientOptions::default())
    }

    /// Connects to `uri`: one connection, or `options.connections` when the server allows
    /// several (`CAN_MULTI_CONN`). An `nbds` URI requires TLS on every connection.
    pub fn connect_with(uri: &str, options: &ClientOptions) -> Result<Client> {
        let meta = MetaQueries::new(options.meta_contexts.iter().cloned())?;
        let list = MetaQueries::new(options.list_meta_contexts.iter().cloned())?;
        let uri = NbdUri::parse(uri)?;
        let tls = uri.tls.as_ref().map(crate::tls::connector).transpose()?;
        let tls = tls.as_ref();
        let handshake = ClientHandshakeOptions {
            export_name: uri.export.clone(),
            structured_replies: options.structured_replies,
            extended_headers: options.extended_headers,
            base_allocation: options.base_allocation,
            ..ClientHandshakeOptions::default()
        };
        let timeout = options.handshake_timeout;
        let (link, negotiated) =
            connect::open(&uri, handshake.clone(), (&meta, &list), tls, timeout)?;
        // After a listing, further connections ask for what this one selected, by name (the
        // server's list may have changed since).
        let (handshake, meta) = match list.is_empty() {
            true => (handshake, meta),
            false => connect::by_name(handshake, &negotiated.meta_contexts)?,
        };
        let none = MetaQueries::default();
        let geometry = Geometry::from_negotiated(&negotiated);
        let meta_contexts = negotiated.meta_contexts.clone();
        let stats = Arc::new(Stats::default());
        let limits = SessionLimits {
            requests_in_flight_max: options.requests_in_flight_max.max(1),
            ..SessionLimits::default()
        };
        let session = |n: &ClientNegotiated| {
            let ids = n.meta_contexts.iter().map(|c| c.id);
            ClientSession::new(n.mode, None, limits).with_context_ids(ids)
        };
        let ids = meta_contexts.iter().map(|c| c.id).collect();
        let mut cells = vec![ConnCell::new(Conn::new(
            link,
            session(&negotiated),
            ids,
            stats.clone(),
            options.operations_queued_max,
        )?)];
        let wanted = if geometry.has(tf::CAN_MULTI_CONN) {
            options.connections.max(1)
        } else {
            if options.connections > 1 {
                tracing::info!("the server does not advertise multi-conn: using 1 connection");
            }
            1
        };
        while cells.len() < wanted.min(64) {
            let (link, other) =
                connect::open(&uri, handshake.clone(), (&meta, &none), tls, timeout)?;
            if other.size != negotiated.size || other.mode != negotiated.mode {
                return Err(Error::Handshake(
                    "connections to one export disagree on its size or framing".into(),
                ));
            }
            let ids = connect::ids_on(&meta_contexts, &other)?;
            cells.push(ConnCell::new(Conn::new(
                link,
                session(&other),
                ids,
                stats.clone(),
                options.operations_queued_max,
            )?));
        }
        let waiter = Waiter::new(&cells)?;
        Ok(Client {
            cells,
            waiter,
            geometry,
            meta_contexts,
            meta_left_out: negotiated.meta_left_out,
            description: negotiated.description,
            next: AtomicUsize::new(0),
            stats,
            queue: Default::default(),
            plugs: AtomicUsize::new(0),
        })
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.geometry.size
    }

    /// What the handshake said about the export.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The export's description, if the server sent one.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// Connections in use.
    pub fn connections(&self) -> usize {
        self.cells.len()
    }

    /// Reply framing negotiated.
    pub fn mode(&self) -> ReplyMode {
        self.geometry.mode
    }

    /// Whether the export is read-only.
    pub fn is_read_only(&self) -> bool {
        self.geometry.has(tf::READ_ONLY)
    }

    /// The client's counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Makes every completed write durable.
    pub fn flush(&self) -> Result<()> {
        let parts = plan::flush(&self.geometry)?;
        self.blocking(parts).map(drop)
    }

    /// Discards `length` bytes at `offset` (reads may then return anything, typically zeroes).
    pub fn trim(&self, offset: u64, length: u64, flags: WriteFlags) -> Result<()> {
        let parts = plan::effect(
            &self.geometry,
            Command::Trim,
            fua(flags.fua),
            offset,
            length,
        )?;
        self.blocking(parts).map(drop)
    }

    /// Writes `length` zero bytes at `offset` without sending them.
    pub fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        let mut bits = fua(flags.fua);
        if flags.no_hole {
            bits |= cmd_flags::NO_HOLE;
        }
        if flags.fast {
            bits |= cmd_flags::FAST_ZERO;
        }
        let parts = plan::effect(&self.geometry, Command::WriteZeroes, bits, offset, length)?;
        self.blocking(parts).map(drop)
    }

    /// Asks the server to prefetch `length` bytes at `offset`.
    pub fn cache(&self, offset: u64, length: u64) -> Result<()> {
        let parts = plan::effect(&self.geometry, Command::Cache, 0, offset, length)?;
        self.blocking(parts).map(drop)
    }

    /// A read or write, in windows of bounded parts.
    pub(crate) fn blocking_rw(
        &self,
        command: Command,
        flags: u16,
        offset: u64,
        buffer: Buffer,
    ) -> Result<usize> {
        let total = buffer.len();
        let window = u64::from(self.geometry.payload_max) * BLOCKING_WINDOW_PARTS;
        if total <= window {
            let parts = plan::read_write(&self.geometry, command, flags, offset, buffer)?;
            return self.blocking(parts).map(|_| total as usize);
        }
        let mut at = 0;
        while at < total {
            let n = window.min(total - at);
            let parts = plan::read_write(
                &self.geometry,
                command,
                flags,
                offset + at,
                buffer.sub(at, n),
            )?;
            self.blocking(parts)?;
            at += n;
        }
        Ok(total as usize)
    }

    /// Submits `parts` as one operation and waits for it, running any other completions
    /// that arrive meanwhile.
    pub(crate) fn blocking(&self, mut parts: Vec<PartSpec>) -> Result<Completed> {
        if parts.is_empty() {
            return Ok(Completed::default());
        }
        let slot: Arc<Mutex<Option<Result<Completed>>>> = Arc::new(Mutex::new(None));
        let filled = slot.clone();
        let completer: Completer = Box::new(move |r| *lock(&filled) = Some(r));
        let (index, serial) = loop {
            let index = self.pick()?;
            let mut conn = lock(&self.cells[index].conn);
            if conn.dead().is_none() && conn.room() < parts.len() {
                drop(conn);
                let room_needed = parts.len();
                let cell = &self.cells[index];
                self.waiter.drive(
                    &self.cells,
                    &|_| lock(&cell.conn).room() >= room_needed,
                    None,
                );
                continue;
            }
            match conn.submit(std::mem::take(&mut parts), completer) {
                Ok(serial) => break (index, serial),
                Err((e, _)) => return Err(e),
            }
        };
        let guard = Detach {
            client: self,
            index,
            serial,
            slot: &slot,
        };
        self.waiter.progress(&self.cells, Some(1 << index.min(63)));
        self.waiter
            .drive(&self.cells, &|_| lock(&slot).is_some(), None);
        drop(guard);
        let result = lock(&slot).take();
        result.unwrap_or(Err(Error::Closed))
    }

    /// Picks the next live connection, round robin.
    pub(crate) fn pick(&self) -> Result<usize> {
        let n = self.cells.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut last = None;
        for k in 0..n {
            let i = (start + k) % n;
            match lock(&self.cells[i].conn).dead() {
                None => return Ok(i),
                Some(e) => last = Some(e.clone()),
            }
        }
        Err(last.unwrap_or(Error::Closed))
    }

    /// Runs completions of finished requests, waiting up to `timeout` for at least one
    /// (`None`: until one finishes or nothing is in flight). Returns how many ran.
    pub fn poll(&self, timeout: Option<Duration>) -> usize {
        let idle = || self.cells.iter().all(|c| lock(&c.conn).in_flight() == 0);
        self.waiter
            .drive(&self.cells, &|ran| ran > 0 || idle(), timeout)
    }

    /// Runs completions of finished requests (and sends what waited for room), waiting up to
    /// `timeout` for at least one or for [`Client::wake`]. Unlike [`Client::poll`] it waits
    /// when nothing is in flight too: the loop of a thread that drives the client for
    /// callers who never wait themselves (the callback API's). Returns how many ran.
    pub fn drive(&self, timeout: Duration) -> usize {
        let woken = || self.waiter.take_nudge();
        self.waiter
            .drive(&self.cells, &|ran| ran > 0 || woken(), Some(timeout))
    }

    /// Makes [`Client::drive`] return now, in whichever thread runs it (or the next call,
    /// if none does).
    pub fn wake(&self) {
        self.waiter.nudge();
    }

    /// A descriptor that becomes readable when [`Client::poll`] has work: for event loops.
    /// A loop that polls it and calls [`Client::run_ready`] drives the client itself, with
    /// no thread of its own waiting on the sockets.
    pub fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.waiter.fd()
    }

    /// Runs the completions of finished requests and sends what waited for room, on the
    /// caller's thread, without waiting; takes a pending [`Client::wake`] too, so that
    /// [`Client::event_fd`] stops being readable for it. For an event loop that polls
    /// `event_fd`. Returns how many completions ran.
    pub fn run_ready(&self) -> usize {
        // One look at the epoll set (which also takes a wake-up) says which sockets have
        // something: the others are not asked.
        let mask = self.waiter.ready_now();
        self.waiter.progress(&self.cells, Some(mask))
    }

    /// Submits `parts` with `completer`, without waiting. [`Error::Busy`] when the connection
    /// has no room.
    pub(crate) fn submit_parts(&self, parts: Vec<PartSpec>, completer: Completer) -> Result<()> {
        if parts.is_empty() {
            completer(Ok(Completed::default()));
            return Ok(());
        }
        let index = self.pick()?;
        let mut conn = lock(&self.cells[index].conn);
        conn.submit(parts, completer).map_err(|(e, _)| e)?;
        if self.plugs.load(Ordering::Acquire) == 0 {
            self.send_queued(index, conn);
        }
        Ok(())
    }

    /// Starts `parts` with `completer` on the next connection, without waiting: an operation
    /// that finds no room waits in that connection's backlog (`backlog.rs`). Every failure
    /// runs `completer` with the error, on this thread, before returning.
    pub(crate) fn start_parts(&self, parts: Vec<PartSpec>, completer: Completer) {
        if parts.is_empty() {
            return completer(Ok(Completed::default()));
        }
        let index = match self.pick() {
            Ok(index) => index,
            Err(e) => return completer(Err(e)),
        };
        let mut conn = lock(&self.cells[index].conn);
        if let Err((e, completer)) = conn.start(parts, completer) {
            drop(conn);
            return completer(Err(e));
        }
        if self.plugs.load(Ordering::Acquire) == 0 {
            self.send_queued(index, conn);
        }
    }

    /// Sends what connection `index` has queued, as far as its socket takes it now.
    pub(crate) fn send_queued(&self, index: usize, mut conn: MutexGuard<'_, Conn>) {
        let cell = &self.cells[index];
        conn.send_now();
        // Epoll now watches for writability if the send could not finish; a thread already
        // waiting sees that change. Only a failed send needs the waiting thread woken.
        self.waiter.update_interest(cell, &conn, index);
        let failed = conn.has_deferred();
        drop(conn);
        if failed {
            self.waiter.wake();
        }
    }

    /// Hangs up every connection: in-flight requests fail with [`Error::Closed`].
    pub fn close(&self) {
        let mut ready = Vec::new();
        for cell in &self.cells {
            let mut conn = lock(&cell.conn);
            if conn.in_flight() == 0 {
                conn.disconnect();
            }
            conn.die(Error::Closed, &mut ready);
        }
        self.waiter.run(ready);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

/// Detaches a blocking call's buffer if it stops waiting before the request finished (a
/// completion it ran panicked): the buffer's memory is going away.
struct Detach<'a> {
    client: &'a Client,
    index: usize,
    serial: u64,
    slot: &'a Mutex<Option<Result<Completed>>>,
}

impl Drop for Detach<'_> {
    fn drop(&mut self) {
        if lock(self.slot).is_none() {
            lock(&self.client.cells[self.index].conn).detach(self.serial);
        }
    }
}
