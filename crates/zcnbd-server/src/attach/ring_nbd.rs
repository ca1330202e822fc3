//! A queue's own connection to an NBD upstream, driven on the queue's ring (zero-copy mode):
//! a large write's payload leaves from the request's pages (`WRITE_FIXED` on the socket from
//! the registered buffer) and a large read's reply payload goes from the socket straight
//! into them (`READ_FIXED`: each structured `OFFSET_DATA` chunk at its offset) - the kernel's
//! TCP copy only, where the client library through the tag's buffer adds ublk's. Small
//! requests are cheaper copied (the seeds' vhost-net patch copies small packets): while no
//! read of [`RECEIVE_IN_PLACE_MIN_BYTES`] or more is in flight, replies are received many at
//! a time and a small read's data, like a hole's zeroes, is written into its request through
//! `/dev/ublkcN` (USER_COPY) - one wake-up for many replies instead of two per reply; a
//! write shorter than [`SEND_IN_PLACE_MIN_BYTES`] has its payload read from its request the
//! same way, straight into the send area after its header (one copy: under TCG a copy in
//! user space costs about what the kernel's does), so that many small writes leave in one
//! send instead of two sends each.
//! Requests are framed and replies checked by zcnbd-proto's `ClientSession`; request
//! headers leave from the queue's send area and replies come into its receive area
//! (`sys::ublk::StreamOp`).
//!
//! Sends are one chain of linked entries at a time (headers and payloads in wire order,
//! nothing else between them); what a short send left, and what was cancelled behind it, is
//! the next chain's start. Receives are one at a time: headers (with small reads' data), then
//! the payload of a large read in place.
//!
//! Only reads and writes come here; flushes, trims and zeroes go through the stack (the
//! multi-conn a ring connection needs makes a flush on any connection cover the writes
//! answered on this one). When the connection fails (the upstream went away, a violation
//! of the protocol), the requests it held go back to the stack - whose client reconnects
//! and sends them again (a write may repeat, which is safe) - and a new ring connection is
//! opened on a thread of its own, with backoff, while the stack serves.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use zcnbd_client::RawConnection;
use zcnbd_proto::consts::cmd_flags;
use zcnbd_proto::{ClientSession, Command, ReplyEvent, Request, SessionLimits, Want};

use crate::export::NbdStream;
use crate::sys::ublk::{DataDone, DataOp, QueueRing, StreamDone, StreamOp, STREAM_RECV_AREA_BYTES};

use super::uapi::{io_desc, user_copy_pos, IoDesc};

/// Reads at least this long are received only in place: while one is in flight, replies
/// are received a header at a time (never into the staging area); while none is, many
/// replies at once, and the data of short reads copied from there into their requests
/// (through `/dev/ublkcN`) - a copy, as the seeds' vhost-net patch copies small packets,
/// cheaper than a wake-up per reply.
const RECEIVE_IN_PLACE_MIN_BYTES: u64 = 16 * 1024;

/// Writes shorter than this have their payload copied from the request (through
/// `/dev/ublkcN`) into the send area after their header, when their chain is made, so that
/// many small writes leave in one send, as small reads' data is copied: a send of its own
/// per payload (and per header) costs more than the copy. Longer ones are sent from the
/// request's pages.
const SEND_IN_PLACE_MIN_BYTES: u64 = 16 * 1024;

/// Most entries in one chain of sends.
const CHAIN_ENTRIES_MAX: usize = 64;
/// Data operation slots: a chain's payload (entry index in the low bits), a reply's
/// payload, a hole's zeroes (hole index in the low bits).
const SLOT_TX: u16 = 0x8000;
const SLOT_RX: u16 = 0x4000;
/// Zeroes a hole is written from (in steps of this many bytes).
const ZEROES_BYTES: usize = 64 * 1024;
/// The first wait before opening a new connection after one failed, and the longest.
const REOPEN_WAIT_FIRST: Duration = Duration::from_secs(1);
const REOPEN_WAIT_MAX: Duration = Duration::from_secs(30);

/// Something to send, in wire order.
#[derive(Debug, Clone, Copy)]
enum Tx {
    /// `len` bytes of the stream (the next of `Conn::tx_bytes`): request headers.
    Header { len: u32 },
    /// The payload of `tag`'s small write (`len` bytes): read from its request through
    /// `/dev/ublkcN` straight into the send area, after its header, when its chain is made.
    Copied { tag: u16, len: u32 },
    /// `len` bytes of `tag`'s request from `at`, sent from its pages.
    Payload { tag: u16, at: u32, len: u32 },
}

/// What an entry of the chain in the ring sends.
#[derive(Debug, Clone, Copy)]
enum Sent {
    /// `len` bytes of the send area from `at`: headers, and small writes' payloads.
    Area { at: u32, len: u32 },
    /// `len` bytes of `tag`'s request from `at`.
    Pages { tag: u16, at: u32, len: u32 },
}

/// An entry of the chain in the ring.
struct Chained {
    sent: Sent,
    result: Option<i32>,
}

/// Where the receiving stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rx {
    Idle,
    Header,
    Payload,
}

/// A read or write on the ring connection.
struct NbdReq {
    len: u32,
    /// Data operations of its tag in the ring.
    ops: u32,
    /// Its COMMIT result, once the reply is complete.
    reply: Option<i32>,
    /// Part of the read's data (a hole's zeroes, staged bytes) did not reach the request:
    /// the read fails.
    data_failed: bool,
    /// A read of at least [`RECEIVE_IN_PLACE_MIN_BYTES`].
    large: bool,
}

/// The connection and its protocol state.
struct Conn {
    sock: OwnedFd,
    session: ClientSession,
    payload_max: u32,
    by_cookie: HashMap<u64, u16>,
    tx_wait: VecDeque<Tx>,
    /// Header bytes of `tx_wait`'s headers, in order.
    tx_bytes: Vec<u8>,
    chain: Vec<Chained>,
    chain_left: usize,
    rx: Rx,
    failed: bool,
}

impl Conn {
    fn new(raw: RawConnection, depth: u16) -> Conn {
        let limits = SessionLimits {
            requests_in_flight_max: u32::from(depth),
            ..SessionLimits::default()
        };
        Conn {
            session: ClientSession::new(raw.mode(), None, limits),
            payload_max: raw.geometry.payload_max,
            sock: raw.socket,
            by_cookie: HashMap::new(),
            tx_wait: VecDeque::new(),
            tx_bytes: Vec::new(),
            chain: Vec::new(),
            chain_left: 0,
            rx: Rx::Idle,
            failed: false,
        }
    }
}

/// What a queue's ring connections did (logged when the queue ends).
#[derive(Debug, Default)]
struct Counts {
    requests: u64,
    chains: u64,
    chain_entries: u64,
    sends_again: u64,
    header_receives: u64,
    payload_receives: u64,
    staged_bytes: u64,
    retried: u64,
    holes: u64,
    writes_copied: u64,
}

/// A queue's ring connection to the upstream, and its requests per tag.
pub(super) struct RingNbd {
    counts: Counts,
    /// `/dev/ublkcN`: staged read data is copied into a request through it (USER_COPY).
    cdev: Arc<File>,
    /// Reads of at least [`RECEIVE_IN_PLACE_MIN_BYTES`] in flight.
    large_reads: usize,
    stream: NbdStream,
    q_id: u16,
    depth: u16,
    /// Zeroes for holes.
    zeroes: Vec<u8>,
    conn: Option<Conn>,
    opening: Option<JoinHandle<Result<RawConnection, zcnbd_client::Error>>>,
    next_try: Instant,
    wait: Duration,
    reqs: Vec<Option<NbdReq>>,
    given_back: Vec<u16>,
    /// What the received header bytes said.
    events: Vec<ReplyEvent>,
    data_done: Vec<DataDone>,
    stream_done: Vec<StreamDone>,
}

/// Feeds `input` (header bytes) to `session`, its events into `events`: how many bytes it
/// took (all of them, unless the bytes ran into a payload).
fn feed(
    session: &mut ClientSession,
    input: &[u8],
    events: &mut Vec<ReplyEvent>,
) -> Result<usize, zcnbd_proto::Violation> {
    let mut fed = 0;
    while fed < input.len() {
        match session.handle_input(&input[fed..])? {
            (0, None) => break,
            (used, event) => {
                fed += used;
                events.extend(event);
            }
        }
    }
    Ok(fed)
}

/// Whether a receive or send that ended so is simply tried again.
fn retry(result: i32) -> bool {
    result == -libc::EAGAIN || result == -libc::EINTR
}

impl RingNbd {
    /// For queue `q_id` of `depth` tags in zero-copy mode, on a stack whose upstream can be
    /// reached so: the first connection is opened now (if that fails, later, while the stack
    /// serves).
    pub(super) fn new(
        stream: NbdStream,
        cdev: Arc<File>,
        q_id: u16,
        depth: u16,
    ) -> io::Result<RingNbd> {
        let mut ring = RingNbd {
            counts: Counts::default(),
            cdev,
            large_reads: 0,
            stream,
            q_id,
            depth,
            zeroes: vec![0; ZEROES_BYTES],
            conn: None,
            opening: None,
            next_try: Instant::now(),
            wait: REOPEN_WAIT_FIRST,
            reqs: (0..depth).map(|_| None).collect(),
            given_back: Vec::new(),
            events: Vec::new(),
            data_done: Vec::new(),
            stream_done: Vec::new(),
        };
        match ring.stream.open() {
            Ok(raw) => ring.connected(raw),
            Err(e) => ring.open_failed(&e),
        }
        Ok(ring)
    }

    fn connected(&mut self, raw: RawConnection) {
        tracing::info!(
            queue = self.q_id,
            uri = %self.stream.uri,
            framing = ?raw.mode(),
            "the queue's ring has its own connection to the upstream: payloads go between \
             the socket and the requests' pages"
        );
        self.conn = Some(Conn::new(raw, self.depth));
        self.wait = REOPEN_WAIT_FIRST;
    }

    fn open_failed(&mut self, e: &zcnbd_client::Error) {
        tracing::warn!(
            queue = self.q_id,
            uri = %self.stream.uri,
            error = %e,
            retry_s = self.wait.as_secs_f64(),
            "the queue's ring could not connect to the upstream: its requests go through the \
             stack meanwhile"
        );
        self.next_try = Instant::now() + self.wait;
        self.wait = (self.wait * 2).min(REOPEN_WAIT_MAX);
    }

    /// Takes a new connection once one is open; starts opening one when it is time.
    fn reopen(&mut self) {
        if self.conn.is_some() {
            return;
        }
        if let Some(opening) = &self.opening {
            if !opening.is_finished() {
                return;
            }
            match self.opening.take().map(JoinHandle::join) {
                Some(Ok(Ok(raw))) => self.connected(raw),
                Some(Ok(Err(e))) => self.open_failed(&e),
                _ => self.open_failed(&zcnbd_client::Error::Closed),
            }
            return;
        }
        if Instant::now() >= self.next_try {
            let stream = self.stream.clone();
            let opening = std::thread::Builder::new()
                .name(format!("ublk-q{}-nbd", self.q_id))
                .spawn(move || stream.open());
            match opening {
                Ok(handle) => self.opening = Some(handle),
                Err(e) => self.open_failed(&zcnbd_client::Error::io("spawn", e)),
            }
        }
    }

    /// Starts `tag`'s request on the connection if it is a read or write it carries;
    /// `false`: answer it another way (nothing was started).
    pub(super) fn start(&mut self, tag: u16, desc: &IoDesc) -> bool {
        self.reopen();
        let command = match desc.op() {
            io_desc::OP_READ => Command::Read,
            io_desc::OP_WRITE => Command::Write,
            _ => return false,
        };
        let Some(conn) = self.conn.as_mut().filter(|c| !c.failed) else {
            return false;
        };
        let len = desc.bytes();
        if len == 0 || len > u64::from(conn.payload_max) || self.reqs.get(tag as usize).is_none() {
            return false;
        }
        let flags = match command == Command::Write && desc.op_flags & io_desc::F_FUA != 0 {
            true => cmd_flags::FUA,
            false => 0,
        };
        let request = Request {
            command,
            flags,
            offset: desc.offset(),
            length: len,
        };
        let before = conn.tx_bytes.len();
        let Ok(cookie) = conn.session.start(request, &mut conn.tx_bytes) else {
            return false;
        };
        let header = (conn.tx_bytes.len() - before) as u32;
        conn.tx_wait.push_back(Tx::Header { len: header });
        match command {
            Command::Write if len < SEND_IN_PLACE_MIN_BYTES => {
                conn.tx_wait.push_back(Tx::Copied {
                    tag,
                    len: len as u32,
                });
                self.counts.writes_copied += 1;
            }
            Command::Write => conn.tx_wait.push_back(Tx::Payload {
                tag,
                at: 0,
                len: len as u32,
            }),
            _ => {}
        }
        conn.by_cookie.insert(cookie, tag);
        self.counts.requests += 1;
        if command == Command::Read && len >= RECEIVE_IN_PLACE_MIN_BYTES {
            self.large_reads += 1;
        }
        self.reqs[tag as usize] = Some(NbdReq {
            len: len as u32,
            ops: 0,
            reply: None,
            data_failed: false,
            large: command == Command::Read && len >= RECEIVE_IN_PLACE_MIN_BYTES,
        });
        true
    }

    /// Tags whose requests the connection gave back (it failed): the caller answers them
    /// through the stack.
    pub(super) fn take_given_back(&mut self) -> Vec<u16> {
        std::mem::take(&mut self.given_back)
    }

    /// Runs what completed, answers the requests whose replies are whole, and sends and
    /// receives what is next.
    pub(super) fn complete(&mut self, queue: &mut QueueRing) -> io::Result<()> {
        queue.take_stream_done(&mut self.stream_done);
        queue.take_data_done(&mut self.data_done);
        let (streams, datas) = (
            std::mem::take(&mut self.stream_done),
            std::mem::take(&mut self.data_done),
        );
        for d in &streams {
            match d.send {
                true => self.sent(queue, d.id as usize, d.result)?,
                false => self.received_header(queue, d.result)?,
            }
        }
        for d in &datas {
            match d.slot {
                s if s & SLOT_TX != 0 => {
                    self.op_done(d.tag);
                    self.sent(queue, (s & !SLOT_TX) as usize, d.result)?;
                }
                SLOT_RX => {
                    self.op_done(d.tag);
                    self.received_payload(queue, d.result)?;
                }
                _ => {}
            }
            self.answer_if_done(queue, d.tag)?;
        }
        (self.stream_done, self.data_done) = (streams, datas);
        self.stream_done.clear();
        self.data_done.clear();
        self.pump(queue)?;
        self.settle(queue)
    }

    fn op_done(&mut self, tag: u16) {
        if let Some(Some(req)) = self.reqs.get_mut(tag as usize) {
            req.ops = req.ops.saturating_sub(1);
        }
    }

    /// Answers `tag`'s request if its reply is whole and nothing of it is in the ring.
    fn answer_if_done(&mut self, queue: &mut QueueRing, tag: u16) -> io::Result<()> {
        let Some(slot) = self.reqs.get_mut(tag as usize) else {
            return Ok(());
        };
        let Some(req) = slot.as_ref() else {
            return Ok(());
        };
        if req.ops > 0 || req.reply.is_none() {
            return Ok(());
        }
        let result = match (req.reply, req.data_failed) {
            (Some(r), false) => r,
            _ => -libc::EIO,
        };
        *slot = None;
        queue.commit(tag, result)
    }

    /// The connection cannot go on: every operation of it is ended (shutdown), and once
    /// they are all back its requests go to the stack (`settle`).
    fn fail(&mut self, why: &dyn std::fmt::Display) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if conn.failed {
            return;
        }
        conn.failed = true;
        tracing::warn!(
            queue = self.q_id,
            uri = %self.stream.uri,
            why = %why,
            in_flight = conn.session.in_flight(),
            "the queue's ring connection to the upstream failed: its requests go through the \
             stack, and a new connection is opened"
        );
        let _ = rustix::net::shutdown(&conn.sock, rustix::net::Shutdown::Both);
    }

    /// A failed connection whose operations are all back: its requests answered as far as
    /// they were, or given back, and the connection dropped.
    fn settle(&mut self, queue: &mut QueueRing) -> io::Result<()> {
        let Some(conn) = &self.conn else {
            return Ok(());
        };
        let busy = self.reqs.iter().flatten().any(|r| r.ops > 0);
        if !conn.failed || conn.chain_left > 0 || conn.rx != Rx::Idle || busy {
            return Ok(());
        }
        self.conn = None;
        self.large_reads = 0;
        for tag in 0..self.reqs.len() as u16 {
            let Some(req) = self.reqs[tag as usize].take() else {
                continue;
            };
            match (req.reply, req.data_failed) {
                (Some(result), false) => queue.commit(tag, result)?,
                _ => self.given_back.push(tag),
            }
        }
        self.next_try = Instant::now() + self.wait;
        self.wait = (self.wait * 2).min(REOPEN_WAIT_MAX);
        Ok(())
    }

    /// Sends the next chain if none is in the ring; receives the next header or payload.
    fn pump(&mut self, queue: &mut QueueRing) -> io::Result<()> {
        self.send_chain(queue)?;
        self.arm_receive(queue)
    }

    fn send_chain(&mut self, queue: &mut QueueRing) -> io::Result<()> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        if conn.failed || conn.chain_left > 0 || conn.tx_wait.is_empty() {
            return Ok(());
        }
        let room = queue.make_room(CHAIN_ENTRIES_MAX)?.min(CHAIN_ENTRIES_MAX);
        let Some(area) = queue.send_area() else {
            return Ok(());
        };
        let (mut used, mut taken) = (0usize, 0usize);
        let mut copy_failed = None;
        while let Some(&tx) = conn.tx_wait.front() {
            let n = match tx {
                Tx::Header { len } | Tx::Copied { len, .. } => len as usize,
                Tx::Payload { .. } => 0,
            };
            if used + n > area.len() {
                break;
            }
            let full = conn.chain.len() == room;
            match tx {
                Tx::Header { .. } | Tx::Copied { .. } => {
                    // Bytes of the area one after another are one send.
                    match conn.chain.last_mut() {
                        Some(Chained {
                            sent: Sent::Area { at, len },
                            ..
                        }) if (*at + *len) as usize == used => *len += n as u32,
                        _ if full => break,
                        _ => conn.chain.push(Chained {
                            sent: Sent::Area {
                                at: used as u32,
                                len: n as u32,
                            },
                            result: None,
                        }),
                    }
                }
                Tx::Payload { tag, at, len } => {
                    if full {
                        break;
                    }
                    conn.chain.push(Chained {
                        sent: Sent::Pages { tag, at, len },
                        result: None,
                    });
                }
            }
            match tx {
                Tx::Header { .. } => {
                    area[used..used + n].copy_from_slice(&conn.tx_bytes[taken..taken + n]);
                    taken += n;
                }
                Tx::Copied { tag, .. } => {
                    // The request is ours until it is answered: its data is read now.
                    let pos = user_copy_pos(self.q_id, tag, 0);
                    if let Err(e) = self.cdev.read_exact_at(&mut area[used..used + n], pos) {
                        copy_failed = Some(e);
                        break;
                    }
                }
                Tx::Payload { .. } => {}
            }
            used += n;
            conn.tx_wait.pop_front();
        }
        conn.tx_bytes.drain(..taken);
        if let Some(e) = copy_failed {
            // A header would leave without its payload: nothing of the chain is sent, and
            // the connection's requests go to the stack.
            conn.chain.clear();
            self.fail(&format_args!("copy of a small write's payload: {e}"));
            return Ok(());
        }
        let fd = conn.sock.as_raw_fd();
        let last = conn.chain.len().saturating_sub(1);
        for (i, c) in conn.chain.iter().enumerate() {
            let link = i < last;
            match c.sent {
                Sent::Area { at, len } => queue.push_stream(StreamOp {
                    fd,
                    send: true,
                    at,
                    len,
                    link,
                    id: i as u16,
                })?,
                Sent::Pages { tag, at, len } => {
                    let op = DataOp {
                        write: true,
                        fd,
                        file_offset: 0,
                        at,
                        len,
                        dsync: false,
                        link,
                    };
                    queue.push_data(tag, SLOT_TX | i as u16, op)?;
                    if let Some(Some(req)) = self.reqs.get_mut(tag as usize) {
                        req.ops += 1;
                    }
                }
            }
        }
        conn.chain_left = conn.chain.len();
        self.counts.chains += 1;
        self.counts.chain_entries += conn.chain.len() as u64;
        Ok(())
    }

    /// Entry `i` of the chain completed with `result`; once the whole chain has, what was
    /// not sent goes first in the next.
    fn sent(&mut self, queue: &mut QueueRing, i: usize, result: i32) -> io::Result<()> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        let Some(entry) = conn.chain.get_mut(i) else {
            return Ok(());
        };
        entry.result = Some(result);
        conn.chain_left = conn.chain_left.saturating_sub(1);
        if conn.chain_left > 0 {
            return Ok(());
        }
        let chain = std::mem::take(&mut conn.chain);
        if conn.failed {
            return Ok(());
        }
        let area = queue.send_area().map(|a| &a[..]).unwrap_or_default();
        let (mut again, mut again_bytes) = (Vec::new(), Vec::new());
        let mut broken = false;
        let mut error = None;
        for c in chain {
            let (len, r) = match c.sent {
                Sent::Area { len, .. } | Sent::Pages { len, .. } => (len, c.result.unwrap_or(0)),
            };
            let done = match r {
                r if !broken && r > 0 && r as u32 >= len => continue,
                r if !broken && r > 0 => r as u32,
                r if broken || r == -libc::ECANCELED || retry(r) => 0,
                r => {
                    error = Some(r);
                    break;
                }
            };
            broken = true;
            self.counts.sends_again += 1;
            match c.sent {
                // What is left of the area's bytes (small writes' payloads too) goes again
                // as header bytes.
                Sent::Area { at, len } => {
                    again_bytes.extend_from_slice(&area[(at + done) as usize..(at + len) as usize]);
                    again.push(Tx::Header { len: len - done });
                }
                Sent::Pages { tag, at, len } => again.push(Tx::Payload {
                    tag,
                    at: at + done,
                    len: len - done,
                }),
            }
        }
        if let Some(r) = error {
            let e = io::Error::from_raw_os_error(-r);
            self.fail(&format_args!("send: {e}"));
            return Ok(());
        }
        for tx in again.into_iter().rev() {
            conn.tx_wait.push_front(tx);
        }
        again_bytes.append(&mut conn.tx_bytes);
        conn.tx_bytes = again_bytes;
        Ok(())
    }

    /// Receives what the session wants next, unless something is being received.
    fn arm_receive(&mut self, queue: &mut QueueRing) -> io::Result<()> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        if conn.failed || conn.rx != Rx::Idle || conn.session.in_flight() == 0 {
            return Ok(());
        }
        let fd = conn.sock.as_raw_fd();
        match conn.session.want() {
            Want::Header(_) => {
                let len = match self.large_reads {
                    0 => STREAM_RECV_AREA_BYTES,
                    _ => conn.session.header_read_hint().min(STREAM_RECV_AREA_BYTES),
                };
                queue.push_stream(StreamOp {
                    fd,
                    send: false,
                    at: 0,
                    len: len.max(1) as u32,
                    link: false,
                    id: 0,
                })?;
                conn.rx = Rx::Header;
            }
            // An empty data chunk: nothing to receive.
            Want::Payload { bytes: 0, .. } => {
                if let Some(event) = conn.session.payload_received(0) {
                    self.on_event(queue, event)?;
                }
                return self.arm_receive(queue);
            }
            Want::Payload { cookie, at, bytes } => {
                let tag = conn.by_cookie.get(&cookie).copied();
                let req = tag.and_then(|t| self.reqs.get_mut(t as usize)?.as_mut());
                let (Some(tag), Some(req)) = (tag, req) else {
                    self.fail(&"read data for no request");
                    return Ok(());
                };
                if at.saturating_add(bytes) > u64::from(req.len) {
                    let len = req.len;
                    self.fail(&format_args!(
                        "read data outside its request ({bytes} bytes at {at} of tag {tag}'s \
                         {len})"
                    ));
                    return Ok(());
                }
                let len = bytes as u32;
                let op = DataOp {
                    write: false,
                    fd,
                    file_offset: 0,
                    at: at as u32,
                    len,
                    dsync: false,
                    link: false,
                };
                queue.push_data(tag, SLOT_RX, op)?;
                req.ops += 1;
                conn.rx = Rx::Payload;
            }
        }
        Ok(())
    }

    /// Whether a receive that ended with `result` brought bytes to handle; if not, it is
    /// simply received again (`arm_receive`), or the connection failed (the upstream hung
    /// up, the socket's error).
    fn brought_bytes(&mut self, result: i32) -> bool {
        if self.conn.as_ref().is_none_or(|c| c.failed) || retry(result) {
            return false;
        }
        if result <= 0 {
            let why = match result {
                0 => "the upstream closed the connection".to_string(),
                r => format!("receive: {}", io::Error::from_raw_os_error(-r)),
            };
            self.fail(&why);
            return false;
        }
        true
    }

    /// Header bytes came (or the receive failed).
    fn received_header(&mut self, queue: &mut QueueRing, result: i32) -> io::Result<()> {
        self.counts.header_receives += 1;
        self.counts.retried += u64::from(retry(result));
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        conn.rx = Rx::Idle;
        if !self.brought_bytes(result) {
            return Ok(());
        }
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        let n = result as usize;
        let mut events = std::mem::take(&mut self.events);
        // The bytes are read where they came (the queue's receive area: nothing receives
        // into it until the next `arm_receive`), not copied out first.
        let Some(area) = queue.recv_area() else {
            self.events = events;
            return Ok(());
        };
        let input = &area[..n.min(area.len())];
        let received = input.len();
        let mut fed = feed(&mut conn.session, input, &mut events);
        // Read data that came with the headers (staged: no large read in flight) goes into
        // its request through /dev/ublkcN; whatever of it is still to come, in place.
        while let (Ok(at_input), Want::Payload { cookie, at, bytes }) =
            (fed.as_ref().copied(), conn.session.want())
        {
            if at_input >= input.len() {
                break;
            }
            let take = bytes.min((input.len() - at_input) as u64);
            let tag = conn.by_cookie.get(&cookie).copied();
            let req = tag.and_then(|t| self.reqs.get_mut(t as usize)?.as_mut());
            let (Some(tag), Some(req)) = (tag, req) else {
                fed = Ok(usize::MAX);
                break;
            };
            if at.saturating_add(take) > u64::from(req.len) {
                fed = Ok(usize::MAX);
                break;
            }
            let data = &input[at_input..at_input + take as usize];
            let pos = user_copy_pos(self.q_id, tag, at as u32);
            if self.cdev.write_all_at(data, pos).is_err() {
                req.data_failed = true;
            }
            self.counts.staged_bytes += take;
            events.extend(conn.session.payload_received(take));
            let more = feed(
                &mut conn.session,
                &input[at_input + take as usize..],
                &mut events,
            );
            fed = more.map(|n| at_input + take as usize + n);
        }
        let outcome = match fed {
            Ok(usize::MAX) => {
                self.fail(&"read data for no request, or outside it");
                Ok(())
            }
            Err(v) => {
                self.fail(&format_args!("protocol violation: {v}"));
                Ok(())
            }
            Ok(fed) if fed < received => {
                self.fail(&"bytes of a reply past its header were taken for the header");
                Ok(())
            }
            Ok(_) => events
                .drain(..)
                .try_for_each(|event| self.on_event(queue, event)),
        };
        self.events = events;
        outcome
    }

    /// Payload bytes came into the request (or the receive failed).
    fn received_payload(&mut self, queue: &mut QueueRing, result: i32) -> io::Result<()> {
        self.counts.payload_receives += 1;
        self.counts.retried += u64::from(retry(result));
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        if conn.rx != Rx::Payload {
            return Ok(());
        }
        conn.rx = Rx::Idle;
        if !self.brought_bytes(result) {
            return Ok(());
        }
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        if let Some(event) = conn.session.payload_received(result as u64) {
            self.on_event(queue, event)?;
        }
        Ok(())
    }

    /// What a reply said.
    fn on_event(&mut self, queue: &mut QueueRing, event: ReplyEvent) -> io::Result<()> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        match event {
            // The session wants the payload next (`arm_receive`).
            ReplyEvent::Data { .. } => Ok(()),
            ReplyEvent::Hole { cookie, at, bytes } => {
                let tag = conn.by_cookie.get(&cookie).copied();
                let req = tag.and_then(|t| self.reqs.get_mut(t as usize)?.as_mut());
                let (Some(tag), Some(req)) = (tag, req) else {
                    self.fail(&"a hole for no request");
                    return Ok(());
                };
                if at.saturating_add(bytes) > u64::from(req.len) {
                    self.fail(&"a hole outside its request");
                    return Ok(());
                }
                if bytes == 0 {
                    return Ok(());
                }
                // Zeroes written into the request now (a hole is the server's promise
                // of them: no wait for a read of /dev/zero on another thread).
                self.counts.holes += 1;
                let mut done = 0;
                while done < bytes {
                    let n = (bytes - done).min(ZEROES_BYTES as u64);
                    let pos = user_copy_pos(self.q_id, tag, (at + done) as u32);
                    if self
                        .cdev
                        .write_all_at(&self.zeroes[..n as usize], pos)
                        .is_err()
                    {
                        req.data_failed = true;
                        break;
                    }
                    done += n;
                }
                Ok(())
            }
            ReplyEvent::Done { cookie, result } => {
                let Some(tag) = conn.by_cookie.remove(&cookie) else {
                    return Ok(());
                };
                let Some(Some(req)) = self.reqs.get_mut(tag as usize) else {
                    return Ok(());
                };
                if req.large {
                    self.large_reads = self.large_reads.saturating_sub(1);
                }
                req.reply = Some(match result {
                    Ok(()) => req.len as i32,
                    Err(f) => -zcnbd_client::Error::Server(f).errno(),
                });
                self.answer_if_done(queue, tag)
            }
            ReplyEvent::Extents { .. } => {
                self.fail(&"block status nobody asked for");
                Ok(())
            }
        }
    }
}

impl Drop for RingNbd {
    fn drop(&mut self) {
        let c = &self.counts;
        tracing::info!(
            queue = self.q_id,
            requests = c.requests,
            chains = c.chains,
            chain_entries = c.chain_entries,
            sent_again = c.sends_again,
            header_receives = c.header_receives,
            payload_receives = c.payload_receives,
            staged_bytes = c.staged_bytes,
            retried = c.retried,
            holes = c.holes,
            writes_copied = c.writes_copied,
            "the queue's ring connections to the upstream"
        );
    }
}
