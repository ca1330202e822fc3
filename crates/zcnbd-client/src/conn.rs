//! One connection in the transmission phase: requests queued for sending (header and the
//! caller's write data in one vectored send, many requests per send), replies received
//! straight into the buffers of the requests they answer - or, while only small reads are
//! in flight, many replies in one receive and their data copied out - completions handed
//! back.
//!
//! A `Conn` never blocks: every socket call is non-blocking, and the caller (`client.rs`)
//! waits for readiness outside the connection's lock. The bytes go through a [`Link`]: the
//! socket, or TLS over it.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd};

use zcnbd_proto::{ClientSession, Command, Extent, ReplyEvent, Request, Want};

use crate::backlog::{Backlog, Waiting};
use crate::error::{Error, Result};
use crate::link::Link;
use crate::piped::PipeCursor;
use crate::stats::Stats;
use crate::sys::low_water::set_receive_low_water;
use crate::sys::{Buffer, PipeEnd, Spliced};

/// Most pieces in one vectored socket call (the kernel's `UIO_MAXIOV`).
const IOVECS_MAX: usize = 1024;
/// Scratch for payload whose caller stopped waiting (read and dropped).
const DISCARD_BYTES: usize = 64 * 1024;
/// One receive of replies while no large read is in flight: as many replies as the socket
/// holds, up to this, in one call, their small payloads copied out (cheaper than a call for
/// each header and each payload, as the vhost-net seed copies small packets).
const STAGE_BYTES: usize = 64 * 1024;
/// A read this long or longer is received straight into its buffer: while one is in
/// flight, headers are received exactly (never past the header into its payload).
pub(crate) const LARGE_READ_BYTES: u64 = 16 * 1024;
/// While at least this much of a payload is left to come over TCP, the socket gets a receive
/// low-water mark before the caller waits for it ([`Conn::mark_for_wait`]).
const PAYLOAD_LOW_WATER_MIN: usize = 128 * 1024;
/// The mark: a wait ends once this much more of the payload came (or all that is left).
/// Measured on the 2-vCPU AMD EPYC machine, `zcnbd bench`'s client reading 1 MiB from a
/// memory export at queue depth 16: 0.81x-0.88x the client's CPU per GiB of no mark, and
/// more MiB/s (docs/benchmarks/low-water.md).
const PAYLOAD_LOW_WATER_BYTES: usize = 256 * 1024;
/// `NBD_ESHUTDOWN`: "If the client receives an NBD_ESHUTDOWN error it MUST initiate a soft
/// disconnect."
const NBD_ESHUTDOWN: u32 = 108;

/// What a finished operation produced.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Completed {
    /// Bytes read or written (the whole request's length on success).
    pub bytes: u64,
    /// Extents, for block status: every chunk's, in the order the chunks came (with one
    /// metadata context selected, that context's); `contexts` says which are whose.
    pub extents: Vec<Extent>,
    /// For block status: which run of `extents` each chunk described, and for which context.
    pub contexts: Vec<ContextRun>,
    /// For a read into a pipe: how many of its first bytes are in the pipe (the others are
    /// in its buffer).
    pub piped_bytes: u64,
}

/// The extents one block status chunk gave one metadata context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextRun {
    /// The context: its index in [`Client::meta_contexts`](crate::Client::meta_contexts).
    pub context: usize,
    /// Where its extents are in [`Completed::extents`].
    pub extents: Range<usize>,
}

impl Completed {
    /// The extents block status gave the context at `index` of
    /// [`Client::meta_contexts`](crate::Client::meta_contexts), if the reply described it.
    pub fn extents_of(&self, index: usize) -> Option<&[Extent]> {
        let run = self.contexts.iter().find(|run| run.context == index)?;
        self.extents.get(run.extents.clone())
    }
}

/// Runs when an operation finishes, in the thread that drove the connection.
pub type Completer = Box<dyn FnOnce(Result<Completed>) + Send>;

/// Operations finished during one drive, to be completed once no lock is held.
pub type Ready = Vec<(Completer, Result<Completed>)>;

/// One wire request of an operation (large operations are split).
pub struct PartSpec {
    /// The request.
    pub request: Request,
    /// Where its data comes from (write) or goes (read); empty otherwise.
    pub buffer: Buffer,
    /// For a read: a pipe its data is spliced into, as far as it can be (`piped.rs`).
    pub pipe: Option<PipeEnd>,
}

/// A request on the wire.
struct Part {
    op: usize,
    buffer: Buffer,
    length: u64,
    /// A read of at least [`LARGE_READ_BYTES`] (counted in `Conn::large_reads`).
    large_read: bool,
    /// Where a piped read's data goes next.
    pipe: Option<PipeCursor>,
}

/// An operation: one or more parts and whoever waits for them.
struct Op {
    serial: u64,
    parts_left: usize,
    bytes: u64,
    failure: Option<Error>,
    extents: Vec<Extent>,
    contexts: Vec<ContextRun>,
    piped_bytes: u64,
    completer: Option<Completer>,
}

/// A request header (and, for a write, its payload) not yet fully sent.
struct Outgoing {
    header: [u8; 32],
    header_bytes: usize,
    slot: usize,
    payload_bytes: u64,
    sent: u64,
}

impl Outgoing {
    fn total(&self) -> u64 {
        self.header_bytes as u64 + self.payload_bytes
    }
}

/// The transmission state of one socket.
pub struct Conn {
    link: Link,
    session: ClientSession,
    /// The id of each of the client's metadata contexts on this connection, by index.
    context_ids: Vec<u32>,
    out: VecDeque<Outgoing>,
    parts: Vec<Option<Part>>,
    ops: Vec<Option<Op>>,
    ops_free: Vec<usize>,
    header: [u8; 64],
    wire: Vec<u8>,
    discard: Vec<u8>,
    /// Replies received ahead ([`STAGE_BYTES`]), `staged.0..staged.1` not yet handled.
    stage: Vec<u8>,
    staged: (usize, usize),
    /// Large reads on the wire (see [`LARGE_READ_BYTES`]).
    large_reads: usize,
    /// The socket is TCP, whose readiness honours a receive low-water mark (see
    /// [`PAYLOAD_LOW_WATER_BYTES`]).
    tcp: bool,
    /// The socket's receive low-water mark now (1: the kernel's default).
    low_water: usize,
    dead: Option<Error>,
    draining: bool,
    serial: u64,
    /// Completions produced outside `progress` (a send that failed in `send_now`), handed
    /// out by the next `progress`, so callbacks only ever run from a drive.
    deferred: Ready,
    /// Operations of the callback API waiting for room (`backlog.rs`).
    backlog: Backlog,
    stats: std::sync::Arc<Stats>,
}

/// Whether `fd` is a TCP socket (IPv4 or IPv6), not a Unix or vsock one.
fn is_tcp(fd: BorrowedFd<'_>) -> bool {
    use rustix::net::AddressFamily;
    rustix::net::getsockname(fd).is_ok_and(|a| {
        matches!(
            a.address_family(),
            AddressFamily::INET | AddressFamily::INET6
        )
    })
}

fn slot_of(cookie: u64) -> usize {
    (cookie & 0xffff_ffff) as usize
}

impl Conn {
    /// Wraps a connection that finished the handshake; its socket is made non-blocking.
    /// `context_ids`: the id this connection's server gave each of the client's metadata
    /// contexts, in the client's order (block status chunks are routed by them).
    /// `operations_queued_max`: most operations waiting for room ([`Conn::start`]).
    pub fn new(
        mut link: Link,
        session: ClientSession,
        context_ids: Vec<u32>,
        stats: std::sync::Arc<Stats>,
        operations_queued_max: usize,
    ) -> Result<Conn> {
        rustix::io::ioctl_fionbio(link.fd(), true)
            .map_err(|e| Error::io("set non-blocking", e.into()))?;
        link.count_into(&stats);
        let tcp = matches!(&link, Link::Plain(fd) if is_tcp(fd.as_fd()));
        Ok(Conn {
            link,
            session,
            context_ids,
            out: VecDeque::new(),
            parts: Vec::new(),
            ops: Vec::new(),
            ops_free: Vec::new(),
            header: [0; 64],
            wire: Vec::with_capacity(32),
            discard: Vec::new(),
            stage: Vec::new(),
            staged: (0, 0),
            large_reads: 0,
            tcp,
            low_water: 1,
            dead: None,
            draining: false,
            serial: 0,
            deferred: Vec::new(),
            backlog: Backlog::new(operations_queued_max),
            stats,
        })
    }

    /// The socket, for readiness waits.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.link.fd()
    }

    /// Whether bytes wait to be sent (the socket's writability matters).
    pub fn wants_output(&self) -> bool {
        (!self.out.is_empty() || self.link.has_pending()) && self.dead.is_none()
    }

    /// Why the connection is unusable, if it is.
    pub fn dead(&self) -> Option<&Error> {
        self.dead.as_ref()
    }

    /// How many more requests fit on the wire now.
    pub fn room(&self) -> usize {
        self.session.room()
    }

    /// Requests on the wire.
    pub fn in_flight(&self) -> usize {
        self.session.in_flight()
    }

    /// Queues an operation made of `parts`; `completer` runs when all are answered. Returns
    /// the operation's serial number (for [`Conn::detach`]). On failure nothing was queued
    /// and the completer comes back.
    pub fn submit(
        &mut self,
        parts: Vec<PartSpec>,
        completer: Completer,
    ) -> std::result::Result<u64, (Error, Completer)> {
        if let Some(e) = &self.dead {
            return Err((e.clone(), completer));
        }
        if self.draining {
            let e = Error::Disconnected("the server is shutting down".into());
            return Err((e, completer));
        }
        if parts.len() > self.session.room() {
            return Err((Error::Busy, completer));
        }
        let op = self.new_op(parts.len(), completer);
        for spec in parts {
            self.wire.clear();
            let cookie = match self.session.start(spec.request, &mut self.wire) {
                Ok(c) => c,
                // Lengths were checked by the caller and room above: a bug, not a peer.
                Err(e) => unreachable!("request refused after checks: {e}"),
            };
            let slot = slot_of(cookie);
            if slot >= self.parts.len() {
                self.parts.resize_with(slot + 1, || None);
            }
            let is_write = spec.request.command == Command::Write;
            let mut header = [0u8; 32];
            header[..self.wire.len()].copy_from_slice(&self.wire);
            self.out.push_back(Outgoing {
                header,
                header_bytes: self.wire.len(),
                slot,
                payload_bytes: if is_write { spec.buffer.len() } else { 0 },
                sent: 0,
            });
            let large_read =
                spec.request.command == Command::Read && spec.request.length >= LARGE_READ_BYTES;
            self.large_reads += usize::from(large_read);
            self.parts[slot] = Some(Part {
                op,
                length: spec.request.length,
                buffer: spec.buffer,
                large_read,
                pipe: spec.pipe.map(PipeCursor::new),
            });
        }
        self.stats.add_requests(1);
        Ok(self.serial)
    }

    /// Queues an operation as [`Conn::submit`] does, or, when there is no room for it now,
    /// keeps it in the backlog until replies free room (`progress` sends it then): operations
    /// go on the wire in the order they were started. On failure (dead, draining, more parts
    /// than the connection ever has room for, or a full backlog) the completer comes back.
    pub fn start(
        &mut self,
        parts: Vec<PartSpec>,
        completer: Completer,
    ) -> std::result::Result<(), (Error, Completer)> {
        let slots = self.session.room() + self.session.in_flight();
        if parts.len() > slots {
            return Err((Error::Busy, completer));
        }
        if self.backlog.is_empty() && parts.len() <= self.session.room() {
            return self.submit(parts, completer).map(drop);
        }
        if let Some(e) = self.refusal() {
            return Err((e, completer));
        }
        self.backlog
            .push(Waiting { parts, completer })
            .map_err(|w| (Error::Busy, w.completer))
    }

    /// Why no operation can be queued now, if none can.
    fn refusal(&self) -> Option<Error> {
        if let Some(e) = &self.dead {
            return Some(e.clone());
        }
        self.draining
            .then(|| Error::Disconnected("the server is shutting down".into()))
    }

    /// Moves operations from the backlog onto the wire while they fit; whether any moved.
    fn admit(&mut self, ready: &mut Ready) -> bool {
        let mut moved = false;
        while let Some(waiting) = self.backlog.pop_fitting(self.session.room()) {
            if let Err((e, completer)) = self.submit(waiting.parts, waiting.completer) {
                ready.push((completer, Err(e)));
            }
            moved = true;
        }
        moved
    }

    fn new_op(&mut self, parts: usize, completer: Completer) -> usize {
        self.serial += 1;
        let op = Op {
            serial: self.serial,
            parts_left: parts,
            bytes: 0,
            failure: None,
            extents: Vec::new(),
            contexts: Vec::new(),
            piped_bytes: 0,
            completer: Some(completer),
        };
        match self.ops_free.pop() {
            Some(i) => {
                self.ops[i] = Some(op);
                i
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        }
    }

    /// Sends and receives whatever the socket allows without blocking; finished operations
    /// go to `ready`. Returns whether anything moved.
    pub fn progress(&mut self, ready: &mut Ready) -> bool {
        let had_deferred = !self.deferred.is_empty();
        ready.append(&mut self.deferred);
        if self.dead.is_some() {
            return had_deferred;
        }
        let moved = match self
            .send()
            .and_then(|sent| Ok(self.receive(ready)? || sent))
            .and_then(|moved| {
                self.mark_for_wait()?;
                Ok(moved)
            })
            .and_then(|moved| match self.admit(ready) {
                true => self.send().map(|_| true),
                false => Ok(moved),
            }) {
            Ok(moved) => moved,
            Err(e) => {
                self.die(e, ready);
                return true;
            }
        };
        if self.draining && self.session.in_flight() == 0 {
            self.disconnect();
            let e = Error::Disconnected("the server shut down".into());
            self.die(e, ready);
        }
        moved
    }

    /// Sends what the socket takes now, and nothing else (no receiving, so no completions
    /// run in a submitting thread).
    pub fn send_now(&mut self) {
        if self.dead.is_some() {
            return;
        }
        if let Err(e) = self.send() {
            let mut deferred = std::mem::take(&mut self.deferred);
            self.die(e, &mut deferred);
            self.deferred = deferred;
        }
    }

    /// Whether completions wait for the next `progress`.
    pub fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// Sends queued requests, as many per `sendmsg` (or TLS write) as fit.
    fn send(&mut self) -> Result<bool> {
        let mut moved = false;
        while !self.out.is_empty() {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(8);
            for item in &self.out {
                if slices.len() >= IOVECS_MAX {
                    break;
                }
                let header_sent = (item.sent as usize).min(item.header_bytes);
                if header_sent < item.header_bytes {
                    slices.push(IoSlice::new(&item.header[header_sent..item.header_bytes]));
                }
                let from = item.sent.saturating_sub(item.header_bytes as u64);
                if item.payload_bytes > from {
                    let Some(part) = self.parts[item.slot].as_ref() else {
                        continue;
                    };
                    let left = item.payload_bytes - from;
                    part.buffer.slices(from, left, &mut slices, IOVECS_MAX);
                }
            }
            let Some(sent) = self.link.send(&slices, &self.stats)? else {
                return Ok(moved);
            };
            drop(slices);
            moved = true;
            self.advance_out(sent as u64);
        }
        // TLS: the last requests' ciphertext may still wait for the socket.
        if self.link.has_pending() {
            moved |= self.link.send_pending()?.is_some();
        }
        Ok(moved)
    }

    fn advance_out(&mut self, mut sent: u64) {
        while sent > 0 {
            let Some(item) = self.out.front_mut() else {
                return;
            };
            let step = (item.total() - item.sent).min(sent);
            item.sent += step;
            sent -= step;
            if item.sent == item.total() {
                let payload = item.payload_bytes;
                self.out.pop_front();
                self.stats.add_written(payload);
            }
        }
    }

    /// Receives replies until the socket has nothing more: while no large read is in flight,
    /// as many as one receive of [`STAGE_BYTES`] brings, else each header exactly and each
    /// payload straight into its buffer.
    fn receive(&mut self, ready: &mut Ready) -> Result<bool> {
        let mut moved = false;
        // A short staged receive emptied the socket: nothing more to ask it this time.
        let mut drained = false;
        loop {
            if self.staged.0 < self.staged.1 {
                self.handle_staged(ready)?;
                moved = true;
                continue;
            }
            if let Want::Payload { bytes: 0, .. } = self.session.want() {
                // A message whose last bytes were staged ends with no payload to wait for.
                let event = self.session.payload_received(0);
                self.on_event(event, ready);
                moved = true;
                continue;
            }
            if drained {
                return Ok(moved);
            }
            let small = matches!(
                self.session.want(),
                Want::Header(_)
                    | Want::Payload {
                        bytes: 1..LARGE_READ_BYTES,
                        ..
                    }
            );
            if small && self.large_reads == 0 {
                match self.receive_staged()? {
                    Some(n) => {
                        drained = n < STAGE_BYTES && self.link.short_receive_drains();
                        continue;
                    }
                    None => return Ok(moved),
                }
            }
            let got = match self.session.want() {
                Want::Header(_) => {
                    let hint = self.session.header_read_hint();
                    self.receive_header(hint, ready)?
                }
                Want::Payload { bytes: 0, .. } => {
                    let event = self.session.payload_received(0);
                    self.on_event(event, ready);
                    Some(0)
                }
                Want::Payload { cookie, at, bytes } => {
                    self.receive_payload(cookie, at, bytes, ready)?
                }
            };
            match got {
                Some(_) => moved = true,
                None => return Ok(moved),
            }
        }
    }

    /// Before the caller waits for the socket: while a long payload comes, a low-water mark
    /// of up to [`PAYLOAD_LOW_WATER_BYTES`] (never more than what is left of it), so the
    /// wait ends once per that many bytes rather than per segment; else none (1), for
    /// headers.
    fn mark_for_wait(&mut self) -> Result<()> {
        if !self.tcp {
            return Ok(());
        }
        let mark = match self.session.want() {
            Want::Payload { bytes, .. } if bytes >= PAYLOAD_LOW_WATER_MIN as u64 => {
                (bytes as usize).min(PAYLOAD_LOW_WATER_BYTES)
            }
            _ => 1,
        };
        if mark != self.low_water {
            self.stats.add_syscalls(1);
            set_receive_low_water(self.link.fd(), mark)
                .map_err(|e| Error::io("set the receive low-water mark", e))?;
            self.low_water = mark;
        }
        Ok(())
    }

    /// One receive of as much as the socket holds, up to [`STAGE_BYTES`], into the stage:
    /// how many bytes, `None` when the socket is empty.
    fn receive_staged(&mut self) -> Result<Option<usize>> {
        self.stage.resize(STAGE_BYTES, 0);
        match self.link.recv(&mut self.stage, &self.stats)? {
            Some(0) => Err(Error::Disconnected(
                "the server closed the connection".into(),
            )),
            Some(n) => {
                self.staged = (0, n);
                Ok(Some(n))
            }
            None => Ok(None),
        }
    }

    /// Feeds the staged bytes to the session - headers, and payload copied into the buffers
    /// of the reads they answer - until none are left.
    fn handle_staged(&mut self, ready: &mut Ready) -> Result<()> {
        let stage = std::mem::take(&mut self.stage);
        let result = self.handle_stage(&stage, ready);
        self.stage = stage;
        result
    }

    fn handle_stage(&mut self, stage: &[u8], ready: &mut Ready) -> Result<()> {
        while self.staged.0 < self.staged.1 {
            let input = &stage[self.staged.0..self.staged.1];
            let took = match self.session.want() {
                Want::Payload { bytes: 0, .. } => {
                    let event = self.session.payload_received(0);
                    self.on_event(event, ready);
                    continue;
                }
                Want::Payload { cookie, at, bytes } => {
                    let take = (bytes as usize).min(input.len());
                    self.deliver_copied(cookie, at, &input[..take]);
                    let event = self.session.payload_received(take as u64);
                    self.on_event(event, ready);
                    take
                }
                Want::Header(_) => {
                    let (took, event) =
                        self.session.handle_input(input).map_err(Error::Protocol)?;
                    self.on_event(event, ready);
                    took
                }
            };
            if took == 0 {
                // Unreachable (a header or payload takes at least a byte of what is there);
                // never spin on it.
                return Err(Error::Disconnected(
                    "a reply's bytes could not be placed".into(),
                ));
            }
            self.staged.0 += took;
        }
        Ok(())
    }

    /// One receive of at most `need` header bytes: `None` when the socket is empty.
    fn receive_header(&mut self, need: usize, ready: &mut Ready) -> Result<Option<usize>> {
        let need = need.min(self.header.len());
        let n = match self.link.recv(&mut self.header[..need], &self.stats)? {
            Some(0) => {
                return Err(Error::Disconnected(
                    "the server closed the connection".into(),
                ))
            }
            Some(n) => n,
            None => return Ok(None),
        };
        let mut used = 0;
        while used < n {
            let header = self.header;
            if let Want::Payload { cookie, at, bytes } = self.session.want() {
                // Only a server breaking the framing could make read data arrive inside a
                // header-sized read (see `header_read_hint`); deliver it, counted as copied.
                let take = (bytes as usize).min(n - used);
                self.deliver_copied(cookie, at, &header[used..used + take]);
                used += take;
                let event = self.session.payload_received(take as u64);
                self.on_event(event, ready);
                continue;
            }
            let (took, event) = self
                .session
                .handle_input(&header[used..n])
                .map_err(Error::Protocol)?;
            if took == 0 {
                break;
            }
            used += took;
            self.on_event(event, ready);
        }
        Ok(Some(n))
    }

    /// One vectored receive of read data straight into the request's buffer.
    fn receive_payload(
        &mut self,
        cookie: u64,
        at: u64,
        bytes: u64,
        ready: &mut Ready,
    ) -> Result<Option<usize>> {
        let part = self.parts.get_mut(slot_of(cookie)).and_then(Option::as_mut);
        let (result, in_place) = match part {
            Some(part) if !part.buffer.is_detached() => {
                if let Some(pipe) = part.pipe.as_mut() {
                    if pipe.takes(at) && self.link.receives_in_place() {
                        self.stats.add_syscalls(1);
                        let spliced = pipe
                            .splice(self.link.fd(), bytes)
                            .map_err(|e| Error::io("splice", e))?;
                        match spliced {
                            Spliced::Moved(0) => {
                                return Err(Error::Disconnected(
                                    "the server closed the connection".into(),
                                ))
                            }
                            Spliced::Moved(n) => {
                                self.stats.add_spliced(n as u64);
                                let event = self.session.payload_received(n as u64);
                                self.on_event(event, ready);
                                return Ok(Some(n));
                            }
                            Spliced::WouldBlock => return Ok(None),
                            // The rest goes to memory (the cursor knows).
                            Spliced::NoRoom => {}
                        }
                    }
                    pipe.went_to_memory(at);
                }
                let mut slices = part.buffer.slices_mut(at, bytes, IOVECS_MAX);
                (self.link.recv_vectored(&mut slices, &self.stats), true)
            }
            _ => {
                self.discard.resize(DISCARD_BYTES, 0);
                let take = (bytes as usize).min(DISCARD_BYTES);
                let mut slices = [IoSliceMut::new(&mut self.discard[..take])];
                (self.link.recv_vectored(&mut slices, &self.stats), false)
            }
        };
        let n = match result? {
            Some(0) => {
                return Err(Error::Disconnected(
                    "the server closed the connection".into(),
                ))
            }
            Some(n) => n,
            None => return Ok(None),
        };
        match (in_place, self.link.receives_in_place()) {
            (true, true) => self.stats.add_received_in_place(n as u64),
            // Decrypted into the caller's buffer: counted as `tls_decrypted_bytes`.
            (true, false) => {}
            (false, _) => self.stats.add_discarded(n as u64),
        }
        // Payload is never followed by an event other than the reply's end.
        let event = self.session.payload_received(n as u64);
        self.on_event(event, ready);
        Ok(Some(n))
    }

    /// Copies `data` into the request's buffer at `at` (the rare path `receive_header` notes).
    fn deliver_copied(&mut self, cookie: u64, at: u64, data: &[u8]) {
        if let Some(part) = self.parts.get_mut(slot_of(cookie)).and_then(Option::as_mut) {
            if !part.buffer.is_detached() {
                if let Some(pipe) = part.pipe.as_mut() {
                    pipe.went_to_memory(at);
                }
                let mut from = 0;
                for mut slice in part.buffer.slices_mut(at, data.len() as u64, IOVECS_MAX) {
                    let n = slice.len();
                    slice.copy_from_slice(&data[from..from + n]);
                    from += n;
                }
                self.stats.add_copied(data.len() as u64);
            }
        }
    }

    fn on_event(&mut self, event: Option<ReplyEvent>, ready: &mut Ready) {
        match event {
            None | Some(ReplyEvent::Data { .. }) => {}
            Some(ReplyEvent::Hole { cookie, at, bytes }) => {
                if let Some(part) = self.parts.get_mut(slot_of(cookie)).and_then(Option::as_mut) {
                    if !part.buffer.is_detached() {
                        if let Some(pipe) = part.pipe.as_mut() {
                            pipe.went_to_memory(at);
                        }
                        part.buffer.zero(at, bytes);
                        self.stats.add_zeroed(bytes);
                    }
                }
            }
            Some(ReplyEvent::Extents {
                cookie,
                context_id,
                extents,
            }) => self.on_extents(cookie, context_id, extents),
            Some(ReplyEvent::Done { cookie, result }) => {
                let result = result.map_err(|failure| {
                    if failure.errno == NBD_ESHUTDOWN {
                        self.draining = true;
                    }
                    Error::Server(failure)
                });
                self.finish_part(slot_of(cookie), result, ready);
            }
        }
    }

    /// Block status for `context_id` (one the session checked was selected): kept with its
    /// operation under the client's index of that context.
    fn on_extents(&mut self, cookie: u64, context_id: u32, extents: Vec<Extent>) {
        let op = self
            .parts
            .get(slot_of(cookie))
            .and_then(Option::as_ref)
            .map(|p| p.op);
        let Some(op) = op.and_then(|i| self.ops[i].as_mut()) else {
            return;
        };
        // Every context of this connection is one of the client's (`Client::connect_with`
        // checks the names agree), so the lookup only fails on a bug; the chunk is dropped.
        let Some(context) = self.context_ids.iter().position(|&id| id == context_id) else {
            return;
        };
        let start = op.extents.len();
        op.extents.extend(extents);
        op.contexts.push(ContextRun {
            context,
            extents: start..op.extents.len(),
        });
    }

    /// Ends one part; its operation completes with its last part.
    fn finish_part(&mut self, slot: usize, result: Result<()>, ready: &mut Ready) {
        let Some(part) = self.parts.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.large_reads -= usize::from(part.large_read);
        let Some(op) = self.ops[part.op].as_mut() else {
            return;
        };
        match result {
            Ok(()) => {
                op.bytes += part.length;
                op.piped_bytes += part.pipe.as_ref().map_or(0, PipeCursor::in_pipe);
            }
            Err(e) => {
                op.failure.get_or_insert(e);
            }
        }
        op.parts_left -= 1;
        if op.parts_left > 0 {
            return;
        }
        let Some(op) = self.ops[part.op].take() else {
            return;
        };
        self.ops_free.push(part.op);
        let result = match op.failure {
            Some(e) => Err(e),
            None => Ok(Completed {
                bytes: op.bytes,
                extents: op.extents,
                contexts: op.contexts,
                piped_bytes: op.piped_bytes,
            }),
        };
        if let Some(completer) = op.completer {
            ready.push((completer, result));
        }
    }

    /// Hangs up: every request in flight fails with `error`, now.
    pub fn die(&mut self, error: Error, ready: &mut Ready) {
        if self.dead.is_some() {
            return;
        }
        tracing::debug!("connection ends: {error}");
        self.link.shutdown();
        self.dead = Some(error.clone());
        self.out.clear();
        for cookie in self.session.drain() {
            self.finish_part(slot_of(cookie), Err(error.clone()), ready);
        }
        for waiting in self.backlog.take_all() {
            ready.push((waiting.completer, Err(error.clone())));
        }
    }

    /// Sends `NBD_CMD_DISC` if the wire is between requests (best effort: the server may be
    /// gone already).
    pub fn disconnect(&mut self) {
        if self.dead.is_some() || !self.out.is_empty() {
            return;
        }
        self.wire.clear();
        let disc = Request {
            command: Command::Disc,
            flags: 0,
            offset: 0,
            length: 0,
        };
        if let Ok(cookie) = self.session.start(disc, &mut self.wire) {
            // A disconnect gets no reply: forget the cookie at once.
            self.session.abandon(cookie);
            self.link.send_last(&self.wire);
        }
    }

    /// Detaches the buffers of operation `serial` if it is still in flight (its caller stops
    /// waiting): data still to come for it is read and dropped, never written to its memory.
    pub fn detach(&mut self, serial: u64) {
        let Some(index) = self
            .ops
            .iter()
            .position(|op| op.as_ref().is_some_and(|op| op.serial == serial))
        else {
            return;
        };
        for part in self.parts.iter_mut().flatten() {
            if part.op == index {
                part.buffer.detach();
                part.pipe = None;
            }
        }
    }
}
