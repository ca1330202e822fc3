//! One io_uring, as a ring thread drives it: built with the flags that suit one thread owning
//! it, its own two operations (the mailbox's wake-up read and the timer), its registered
//! region, one `io_uring_enter` per turn, and the submission side a connection gets
//! ([`Submitter`], the real [`Submit`]).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use tracing::warn;

use super::fixed::{FixedBuffers, FixedPool};
use super::op::{lend_chain, Sqe, Submit};
use super::prepared::Cqe;
use crate::stats::Stats;

/// `user_data` of the ring's own read of its mailbox's eventfd.
const WAKE_USER_DATA: u64 = u64::MAX;
/// `user_data` of the ring's own timer.
const TICK_USER_DATA: u64 = u64::MAX - 1;

/// The overall timeout of a coalesced wait, in seconds (the ring's timer, at most 1 s apart,
/// ends it first).
const COALESCED_WAIT_MAX_S: u64 = 60;

/// What a turn of the ring reaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaped {
    /// A completion of a connection's operation.
    Cqe(Cqe),
    /// The mailbox was written to (already drained, and the read re-posted).
    Woken,
    /// The timer fired (already re-armed).
    Ticked,
}

/// A ring thread's io_uring and the memory its own operations use.
pub struct Ring {
    /// Declared first, so it is dropped first: its registration and operations go before
    /// the memory they point at.
    uring: IoUring,
    /// The mailbox's eventfd, and the buffer the ring's read of it fills.
    wake: Arc<OwnedFd>,
    wake_buf: Box<[u8; 8]>,
    /// The timer's interval, boxed: the kernel reads it after submission.
    tick: Box<types::Timespec>,
    fixed: FixedBuffers,
    stats: Arc<Stats>,
}

/// Builds a ring with the flags that suit one thread owning it, dropping the optional ones
/// an older kernel refuses.
fn build_ring(entries: u32) -> io::Result<IoUring> {
    let tuned = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
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

impl Ring {
    /// A ring of `entries` submission entries whose wake-up read watches `wake` and whose
    /// timer fires every `tick`, with a table slot reserved for `fixed_bytes` of registered
    /// buffers. Must be called on the thread that will submit to it (`SINGLE_ISSUER`).
    pub fn new(
        entries: u32,
        fixed_bytes: usize,
        tick: Duration,
        wake: Arc<OwnedFd>,
        stats: Arc<Stats>,
    ) -> io::Result<Ring> {
        let uring = build_ring(entries)?;
        let fixed = FixedBuffers::reserve(&uring, fixed_bytes);
        Ok(Ring {
            uring,
            wake,
            wake_buf: Box::new([0; 8]),
            tick: Box::new(types::Timespec::from(tick)),
            fixed,
            stats,
        })
    }

    /// Posts the ring's own operations: the mailbox read and the timer. Once, before the
    /// first turn; each is re-posted when it completes ([`Ring::reap`]).
    pub fn arm(&mut self) -> io::Result<()> {
        self.post_wake()?;
        self.post_tick()
    }

    /// Registers the region of fixed buffers, if reserved and not yet registered (the first
    /// O_DIRECT connection asks for it).
    pub fn ensure_fixed(&mut self) {
        self.fixed.ensure(&self.uring);
    }

    /// The submission side and the registered region, for a connection handling an event.
    pub fn parts(&mut self) -> (Submitter<'_>, Option<&FixedPool>) {
        let submitter = Submitter {
            ring: &mut self.uring,
            stats: &self.stats,
        };
        (submitter, self.fixed.pool())
    }

    /// Submits everything queued and waits for at least one completion: one
    /// `io_uring_enter`.
    pub fn submit_and_wait(&mut self) -> io::Result<()> {
        self.stats.ring_entered();
        self.uring.submit_and_wait(1).map(drop)
    }

    /// Whether the kernel can end a wait for several completions early
    /// (`IORING_FEAT_MIN_TIMEOUT`, Linux 6.12): what [`Ring::submit_and_wait_coalesced`]
    /// needs.
    pub fn can_coalesce(&self) -> bool {
        self.uring.params().is_feature_min_timeout()
    }

    /// Submits everything queued and waits for `completions` completions, or for `wait` to
    /// pass with at least one there (after it, for the first one): one `io_uring_enter`.
    /// Only where [`Ring::can_coalesce`].
    pub fn submit_and_wait_coalesced(
        &mut self,
        completions: usize,
        wait: Duration,
    ) -> io::Result<()> {
        self.stats.ring_entered();
        let micros = u32::try_from(wait.as_micros()).unwrap_or(u32::MAX);
        // Without an overall timeout the kernel ends the wait when `wait` passes even with
        // nothing there; with one, it then waits for the first completion. The ring's own
        // timer fires long before this one.
        let overall = types::Timespec::new().sec(COALESCED_WAIT_MAX_S);
        let args = types::SubmitArgs::new()
            .min_wait_usec(micros)
            .timespec(&overall);
        match self.uring.submitter().submit_with_args(completions, &args) {
            Ok(_) => Ok(()),
            // The overall timeout passed with nothing there: an empty turn, not an error.
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Submits everything queued without waiting (no call when nothing is queued).
    pub fn submit(&mut self) -> io::Result<()> {
        if self.uring.submission().is_empty() {
            return Ok(());
        }
        self.stats.ring_entered();
        self.uring.submit().map(drop)
    }

    /// Whether completions wait to be reaped, after running the completion work the kernel
    /// deferred to this thread if the ring says there is some (`IORING_SQ_TASKRUN`; an
    /// `io_uring_enter` then, a memory load otherwise): what a polling thread asks.
    pub fn has_completions(&mut self) -> io::Result<bool> {
        if self.uring.submission().taskrun() {
            self.stats.ring_entered();
            self.uring.submit()?;
        }
        Ok(!self.uring.completion().is_empty())
    }

    /// Appends what completed to `out`, re-posting the ring's own operations as they fire.
    pub fn reap(&mut self, out: &mut Vec<Reaped>) {
        let start = out.len();
        out.extend(self.uring.completion().map(|c| match c.user_data() {
            WAKE_USER_DATA => Reaped::Woken,
            TICK_USER_DATA => Reaped::Ticked,
            user_data => Reaped::Cqe(Cqe {
                user_data,
                result: c.result(),
                more: cqueue::more(c.flags()),
                notification: cqueue::notif(c.flags()),
                sock_nonempty: cqueue::sock_nonempty(c.flags()),
            }),
        }));
        for event in &out[start..] {
            match event {
                Reaped::Woken => {
                    let mut drained = [0u8; 8];
                    let _ = rustix::io::read(self.wake.as_ref(), &mut drained);
                    if let Err(e) = self.post_wake() {
                        warn!("ring cannot re-arm its mailbox: {e}");
                    }
                }
                Reaped::Ticked => {
                    if let Err(e) = self.post_tick() {
                        warn!("ring cannot re-arm its timer: {e}");
                    }
                }
                Reaped::Cqe(_) => {}
            }
        }
    }

    fn post_wake(&mut self) -> io::Result<()> {
        let fd = types::Fd(self.wake.as_raw_fd());
        let entry = opcode::Read::new(fd, self.wake_buf.as_mut_ptr(), 8)
            .build()
            .user_data(WAKE_USER_DATA);
        // SAFETY: wake_buf is a Box the ring owns for its whole life (and nothing reads it),
        // and the eventfd is kept open by `wake`; the read is re-posted only after it
        // completed.
        unsafe { self.submitter().push(&[entry]) }
    }

    fn post_tick(&mut self) -> io::Result<()> {
        let entry = opcode::Timeout::new(&*self.tick)
            .build()
            .user_data(TICK_USER_DATA);
        // SAFETY: `tick` is a Box the ring owns for its whole life and never changes; the
        // timeout is re-posted only after it completed.
        unsafe { self.submitter().push(&[entry]) }
    }

    fn submitter(&mut self) -> Submitter<'_> {
        self.parts().0
    }
}

/// The ring's submission side, lent to a connection while it handles an event.
pub struct Submitter<'a> {
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

/// Whether `user_data` is one the ring keeps for its own operations.
fn is_reserved(user_data: u64) -> bool {
    user_data == WAKE_USER_DATA || user_data == TICK_USER_DATA
}

impl Submit for Submitter<'_> {
    fn submit(&mut self, chain: &mut [Sqe<'_>]) -> io::Result<()> {
        if chain.iter().any(|sqe| is_reserved(sqe.user_data)) {
            return Err(io::Error::other(
                "user_data reserved for the ring's own operations",
            ));
        }
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

#[cfg(test)]
#[path = "ring_tests.rs"]
mod tests;
