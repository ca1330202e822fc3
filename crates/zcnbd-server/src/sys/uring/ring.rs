//! One ring thread: its io_uring, its connections, its mailbox, and the loop that submits
//! everything queued since the last turn in one `io_uring_enter` and dispatches completions.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use rustix::event::{eventfd, EventfdFlags};
use tracing::{debug, warn};

use super::conn::Conn;
use super::fixed::{FixedBuffers, FixedPool};
use super::op::{lend_chain, Op, Sqe, Submit};
use super::prepared::Cqe;
use super::{EngineShared, Inbox, Mailbox};
use crate::stats::Stats;

/// Operation kinds, in the low byte of `user_data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Tag {
    Recv = 1,
    Send = 2,
    SpliceHeader = 3,
    SpliceIn = 4,
    SpliceOut = 5,
    FileRead = 6,
    FileWrite = 7,
    Wake = 8,
    Writable = 9,
    PipeIn = 10,
    PipeOut = 11,
    Tick = 12,
}

impl Tag {
    fn from_u8(v: u8) -> Option<Tag> {
        Some(match v {
            1 => Tag::Recv,
            2 => Tag::Send,
            3 => Tag::SpliceHeader,
            4 => Tag::SpliceIn,
            5 => Tag::SpliceOut,
            6 => Tag::FileRead,
            7 => Tag::FileWrite,
            8 => Tag::Wake,
            9 => Tag::Writable,
            10 => Tag::PipeIn,
            11 => Tag::PipeOut,
            12 => Tag::Tick,
            _ => return None,
        })
    }
}

/// Identifies a connection slot and the generation living in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ConnKey {
    pub slot: u32,
    pub generation: u16,
}

impl ConnKey {
    /// `user_data` for an operation of this connection: slot (24 bits), generation (16),
    /// index (16), tag (8).
    pub fn op(self, tag: Tag, index: u16) -> u64 {
        (u64::from(self.slot) << 40)
            | (u64::from(self.generation) << 24)
            | (u64::from(index) << 8)
            | tag as u64
    }

    /// The key alone, for the mailbox.
    pub fn packed(self) -> u64 {
        self.op(Tag::Wake, 0) >> 24
    }

    fn unpack_op(user_data: u64) -> (ConnKey, Option<Tag>, u16) {
        let key = ConnKey {
            slot: (user_data >> 40) as u32,
            generation: (user_data >> 24) as u16,
        };
        (key, Tag::from_u8(user_data as u8), (user_data >> 8) as u16)
    }

    fn unpack(packed: u64) -> ConnKey {
        ConnKey::unpack_op(packed << 24).0
    }
}

/// The slot number reserved for the ring's own wake-up read.
const WAKE_SLOT: u32 = (1 << 24) - 1;
/// The slot number reserved for the ring's timer, which checks every connection's deadlines.
const TICK_SLOT: u32 = WAKE_SLOT - 1;
/// How often the timer fires at most; deadlines are met to within this (or a quarter of the
/// shortest timeout, if that is shorter).
const TICK_MS_MAX: u64 = 1000;

/// What a connection needs from its ring while handling a completion.
pub(super) struct Cx<'a> {
    /// The only way to the kernel.
    pub driver: &'a mut dyn Submit,
    pub shared: &'a EngineShared,
    pub mailbox: &'a Mailbox,
    /// The ring's registered region, once an O_DIRECT connection asked for it.
    pub fixed: Option<&'a FixedPool>,
    /// Connections whose replies go out at the end of this turn.
    sends: &'a mut Vec<ConnKey>,
    /// When this turn of the ring began (the clock deadlines are measured with).
    pub now: Instant,
}

impl Cx<'_> {
    /// Sends `key`'s queued replies at the end of the ring's turn, in one send with every
    /// other reply the turn produces for it.
    pub fn send_later(&mut self, key: ConnKey) {
        if self.sends.last() != Some(&key) {
            self.sends.push(key);
        }
    }

    /// Submits one operation.
    pub fn submit(&mut self, user_data: u64, op: Op<'_>) -> io::Result<()> {
        self.driver.submit(&mut [Sqe::new(user_data, op)])
    }
}

/// The ring's submission side, lent to a connection while it handles an event.
pub(super) struct Submitter<'a> {
    ring: &'a mut IoUring,
    stats: &'a Stats,
}

impl Submitter<'_> {
    /// Queues `entries` (kept together, so a linked chain is never split across two
    /// submissions), submitting what is queued first if they do not fit.
    ///
    /// # Safety
    /// Every buffer, iovec, msghdr and descriptor an entry points to must stay valid and
    /// unmoved until that entry's completion (and, for zero-copy sends, its notification)
    /// has been reaped.
    unsafe fn push(&mut self, entries: &[squeue::Entry]) -> io::Result<()> {
        loop {
            let mut sq = self.ring.submission();
            if sq.capacity() - sq.len() >= entries.len() {
                // SAFETY: the caller guarantees the entries' memory outlives the operations.
                return unsafe { sq.push_multiple(entries) }
                    .map_err(|_| io::Error::other("sq full"));
            }
            drop(sq);
            if entries.len() > self.ring.params().sq_entries() as usize {
                return Err(io::Error::other("chain longer than the submission queue"));
            }
            self.ring.submit()?;
            self.stats.ring_entered();
        }
    }

    /// Pushes the entries made from `chain`'s lent memory; if they cannot be queued, gives
    /// the memory back.
    fn push_lent(&mut self, chain: &mut [Sqe<'_>], entries: &[squeue::Entry]) -> io::Result<()> {
        // SAFETY: each entry was built by `Prepared::entry` from what `Sqe::lend` returned
        // for the operation beside it in `chain`, so it points only at memory held by the
        // `Lent` that operation names (checked to lie inside it), now lent to it. A `Lent`
        // neither frees nor hands out its value while lent, and the value's memory does not
        // move when the `Lent` does (heap buffers, the mapping, registered runs); it is
        // taken back only by `Lent::complete`, which the connection calls from the
        // operation's last completion (or below, when it was never queued). The descriptors
        // stay open: see `op.rs`.
        let pushed = unsafe { self.push(entries) };
        if pushed.is_err() {
            chain.iter_mut().for_each(Sqe::unlend);
        }
        pushed
    }
}

impl Submit for Submitter<'_> {
    fn submit(&mut self, chain: &mut [Sqe<'_>]) -> io::Result<()> {
        if let [sqe] = chain {
            let entry = sqe.lend()?.entry(sqe.user_data);
            return self.push_lent(chain, &[entry]);
        }
        let prepared = lend_chain(chain)?;
        let last = prepared.len().saturating_sub(1);
        let entries: Vec<squeue::Entry> = prepared
            .iter()
            .zip(chain.iter())
            .enumerate()
            .map(|(i, (p, sqe))| {
                let entry = p.entry(sqe.user_data);
                if i < last {
                    entry.flags(squeue::Flags::IO_LINK)
                } else {
                    entry
                }
            })
            .collect();
        self.push_lent(chain, &entries)
    }
}

struct RingThread {
    ring: IoUring,
    shared: EngineShared,
    mailbox: Mailbox,
    inbox: Receiver<Inbox>,
    conns: Vec<Option<Conn>>,
    generations: Vec<u16>,
    free: Vec<u32>,
    live: usize,
    stopping: bool,
    wake_buf: Box<[u8; 8]>,
    wake_fd: Arc<OwnedFd>,
    /// The timer's interval, boxed: the kernel reads it after submission.
    tick: Box<types::Timespec>,
    now: Instant,
    /// Connections with replies to send at the end of this turn.
    sends: Vec<ConnKey>,
    /// Declared after `ring`, so the ring (and its registration) is dropped first.
    fixed: FixedBuffers,
}

/// Builds a ring with the flags that suit one thread owning it, dropping the optional ones
/// an older kernel refuses.
fn build_ring(entries: u32) -> io::Result<IoUring> {
    let tuned = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .build(entries);
    let ring = match tuned {
        Ok(ring) => ring,
        Err(_) => IoUring::builder().build(entries)?,
    };
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (code, name) in [
        (opcode::Recv::CODE, "RECV"),
        (opcode::SendMsg::CODE, "SENDMSG"),
        (opcode::Splice::CODE, "SPLICE"),
        (opcode::PollAdd::CODE, "POLL_ADD"),
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::SendMsgZc::CODE, "SENDMSG_ZC"),
        (opcode::SendZc::CODE, "SEND_ZC"),
        (opcode::ReadFixed::CODE, "READ_FIXED"),
        (opcode::WriteFixed::CODE, "WRITE_FIXED"),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::other(format!("kernel lacks IORING_OP_{name}")));
        }
    }
    Ok(ring)
}

/// Starts ring thread `index`; returns its mailbox once the ring is built.
pub(super) fn spawn(index: usize, shared: EngineShared) -> io::Result<(Mailbox, JoinHandle<()>)> {
    let (sender, inbox) = crossbeam_channel::unbounded();
    let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
    let mailbox = Mailbox {
        sender,
        wake: Arc::clone(&wake),
    };
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<io::Result<()>>(1);
    let thread_mailbox = mailbox.clone();
    let handle = std::thread::Builder::new()
        .name(format!("ring-{index}"))
        .spawn(move || {
            // SINGLE_ISSUER: the ring must be created by the thread that submits to it.
            let ring = match build_ring(shared.options.ring_entries) {
                Ok(ring) => ring,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            let fixed = FixedBuffers::reserve(&ring, shared.options.fixed_buffer_bytes_max);
            let shared_limits = shared.limits.clone();
            let thread = RingThread {
                ring,
                shared,
                mailbox: thread_mailbox,
                inbox,
                conns: Vec::new(),
                generations: Vec::new(),
                free: Vec::new(),
                live: 0,
                stopping: false,
                wake_buf: Box::new([0; 8]),
                wake_fd: wake,
                tick: Box::new(types::Timespec::from(tick_interval(&shared_limits))),
                now: Instant::now(),
                sends: Vec::new(),
                fixed,
            };
            thread.run();
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok((mailbox, handle)),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => Err(io::Error::other("ring thread died while starting")),
    }
}

impl RingThread {
    fn run(mut self) {
        if let Err(e) = self.post_wake().and_then(|()| self.post_tick()) {
            warn!("ring cannot arm its mailbox and timer: {e}");
            return;
        }
        let mut completions: Vec<(u64, i32, u32)> = Vec::with_capacity(256);
        loop {
            self.drain_inbox();
            self.flush_sends();
            if self.stopping && self.live == 0 {
                break;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    warn!("io_uring_enter failed: {e}");
                    break;
                }
            }
            self.shared.stats.ring_entered();
            self.now = Instant::now();
            completions.clear();
            completions.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            for &(user_data, result, flags) in &completions {
                self.complete(user_data, result, flags);
            }
        }
        debug!("ring thread exits");
    }

    fn post_wake(&mut self) -> io::Result<()> {
        let key = ConnKey {
            slot: WAKE_SLOT,
            generation: 0,
        };
        let entry = opcode::Read::new(
            types::Fd(self.wake_fd.as_raw_fd()),
            self.wake_buf.as_mut_ptr(),
            8,
        )
        .build()
        .user_data(key.op(Tag::Wake, 0));
        // SAFETY: wake_buf is a Box owned by this thread for the ring's whole life, and the
        // eventfd is kept open by wake_fd; the read is re-posted only after it completed.
        unsafe { self.push_own(entry) }
    }

    /// Submits one of the ring's own operations (its mailbox read, its timer).
    ///
    /// # Safety
    /// As [`Submitter::push`]: what `entry` points to outlives the operation.
    unsafe fn push_own(&mut self, entry: squeue::Entry) -> io::Result<()> {
        let mut submitter = Submitter {
            ring: &mut self.ring,
            stats: &self.shared.stats,
        };
        // SAFETY: the caller guarantees the entry's memory outlives the operation.
        unsafe { submitter.push(&[entry]) }
    }

    fn post_tick(&mut self) -> io::Result<()> {
        let key = ConnKey {
            slot: TICK_SLOT,
            generation: 0,
        };
        let entry = opcode::Timeout::new(&*self.tick)
            .build()
            .user_data(key.op(Tag::Tick, 0));
        // SAFETY: `tick` is a Box owned by this thread for the ring's whole life and never
        // changed; the timeout is re-posted only after it completed.
        unsafe { self.push_own(entry) }
    }

    /// The timer fired: every connection checks its deadlines, and the timer is re-armed.
    fn on_tick(&mut self) {
        if let Err(e) = self.post_tick() {
            warn!("ring cannot re-arm its timer: {e}");
        }
        for slot in 0..self.conns.len() {
            let Some(Some(conn)) = self.conns.get(slot) else {
                continue;
            };
            let key = conn.key();
            self.with_conn(key, |conn, cx| conn.on_tick(cx));
        }
    }

    /// Starts the sends that this turn's completions and messages queued replies for.
    fn flush_sends(&mut self) {
        let mut keys = std::mem::take(&mut self.sends);
        for &key in &keys {
            self.with_conn(key, |conn, cx| conn.send_queued(cx));
        }
        keys.clear();
        // Sending queues no further sends, but keep any that were (and the allocation).
        keys.append(&mut self.sends);
        self.sends = keys;
    }

    fn drain_inbox(&mut self) {
        while let Ok(message) = self.inbox.try_recv() {
            match message {
                Inbox::Attach(attach) => self.attach(*attach),
                Inbox::Answered { key, reply, held } => {
                    let key = ConnKey::unpack(key);
                    self.with_conn(key, |conn, cx| conn.on_answered(cx, reply, held));
                }
                Inbox::Stop => self.stopping = true,
            }
        }
    }

    fn attach(&mut self, attach: super::Attach) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                (self.conns.len() - 1) as u32
            }
        };
        let generation = self.generations[slot as usize].wrapping_add(1);
        self.generations[slot as usize] = generation;
        let key = ConnKey { slot, generation };
        let conn = Conn::new(key, attach, &self.shared);
        if conn.wants_fixed_buffers(&self.shared.options) {
            self.fixed.ensure(&self.ring);
        }
        self.conns[slot as usize] = Some(conn);
        self.live += 1;
        self.with_conn(key, |conn, cx| conn.start(cx));
    }

    fn complete(&mut self, user_data: u64, result: i32, flags: u32) {
        let (key, tag, index) = ConnKey::unpack_op(user_data);
        if key.slot == TICK_SLOT {
            return self.on_tick();
        }
        if key.slot == WAKE_SLOT {
            let mut drained = [0u8; 8];
            let _ = rustix::io::read(self.wake_fd.as_ref(), &mut drained);
            if let Err(e) = self.post_wake() {
                warn!("ring cannot re-arm its mailbox: {e}");
            }
            return;
        }
        let Some(tag) = tag else { return };
        let cqe = Cqe {
            user_data,
            result,
            more: cqueue::more(flags),
            notification: cqueue::notif(flags),
        };
        self.with_conn(key, |conn, cx| conn.on_completion(cx, tag, index, cqe));
    }

    /// Runs `f` on the connection `key` names (if it is still there), then frees the slot
    /// if the connection is finished.
    fn with_conn(&mut self, key: ConnKey, f: impl FnOnce(&mut Conn, &mut Cx<'_>)) {
        let Some(Some(conn)) = self.conns.get_mut(key.slot as usize) else {
            return;
        };
        if conn.key() != key {
            return;
        }
        let mut submitter = Submitter {
            ring: &mut self.ring,
            stats: &self.shared.stats,
        };
        let mut cx = Cx {
            driver: &mut submitter,
            shared: &self.shared,
            mailbox: &self.mailbox,
            fixed: self.fixed.pool(),
            sends: &mut self.sends,
            now: self.now,
        };
        f(conn, &mut cx);
        if conn.is_finished() {
            if let Some(conn) = self.conns[key.slot as usize].take() {
                conn.close();
                self.shared.load.connections.fetch_sub(1, Ordering::Relaxed);
            }
            self.free.push(key.slot);
            self.live -= 1;
        }
    }
}

/// The timer's interval: a quarter of the shortest timeout, at most [`TICK_MS_MAX`].
fn tick_interval(limits: &crate::server::Limits) -> Duration {
    let shortest = limits
        .idle_timeout_ms
        .unwrap_or(u64::MAX)
        .min(limits.write_timeout_ms);
    Duration::from_millis((shortest / 4).clamp(10, TICK_MS_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        let key = ConnKey {
            slot: 0xabcdef,
            generation: 0x1234,
        };
        let (k, tag, index) = ConnKey::unpack_op(key.op(Tag::FileWrite, 0x5678));
        assert_eq!((k, tag, index), (key, Some(Tag::FileWrite), 0x5678));
        assert_eq!(ConnKey::unpack(key.packed()), key);
    }
}
