//! One ublk queue's thread: fetch every tag, then answer each request the kernel hands over
//! through the export's stack, in the tag's buffer, until the device stops (every tag
//! aborted) or the attach is called off (the stop eventfd).
//!
//! With I/O threads (the default), the queue thread lends each request's buffer to a pool
//! that answers many requests at once (an NBD or RBD export waits a round trip per request,
//! a file on a disk waits for the disk) and commits the answers as they come back; the
//! queue thread alone issues the ring's commands, as ublk requires. Without, it answers each
//! request itself, in order. An asynchronous stack (an NBD upstream, RBD) needs no I/O
//! thread: the queue thread submits each request to it (`async_request.rs`) and commits the
//! answers its completions send back, woken by the same eventfd - or, where the stack lets
//! its completions be run by the caller (an NBD upstream), runs them itself when the stack's
//! descriptor, polled on the queue's ring, is readable.
//!
//! Whatever the pool, a read or write the stack maps to files is done by the queue thread on
//! its own ring (`ring_io.rs`). In zero-copy mode a request answered through the stack copies
//! its data between the request and the tag's buffer itself ([`UserCopy`]).

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};

use rustix::thread::CpuSet;

use crate::export::{Stack, ZeroFlags};
use crate::sys::ublk::{LentBuffer, QueueRing, Woken};

use super::async_request::{self, commit_result};
use super::ring_io::RingIo;
use super::ring_nbd::RingNbd;
use super::uapi::{io_desc, user_copy_pos, IoDesc, IO_RES_ABORT};
use super::windows::Windows;

/// The most I/O threads per queue (`--io-threads`).
pub const IO_THREADS_MAX: u16 = 256;

/// Zero-copy mode: how a request answered from the tag's buffer gets its data (a write's)
/// and gives it (a read's) - `pread` and `pwrite` of the request through `/dev/ublkcN`
/// (USER_COPY), since the kernel copies nothing itself. Any thread may do it.
pub(super) struct UserCopy {
    pub cdev: Arc<File>,
    pub q_id: u16,
}

impl UserCopy {
    fn fetch(&self, tag: u16, buf: &mut [u8]) -> io::Result<()> {
        self.cdev
            .read_exact_at(buf, user_copy_pos(self.q_id, tag, 0))
    }

    fn give(&self, tag: u16, buf: &[u8]) -> io::Result<()> {
        self.cdev
            .write_all_at(buf, user_copy_pos(self.q_id, tag, 0))
    }
}

/// A queue's I/O threads: how many, the eventfd they wake the queue thread with, and the
/// CPUs they run on (`None`: the queue thread's).
pub(super) struct Pool {
    pub threads: u16,
    pub wake: Arc<OwnedFd>,
    pub cpus: Option<CpuSet>,
}

/// Serves `queue` until the device goes away; `depth` tags were fetched. With `pool`, the
/// requests are answered by its threads (the queue's ring polls its wake eventfd), or, on an
/// asynchronous stack, by the stack's completions (no thread of the pool is started).
/// Reads and writes the stack maps to files are the queue thread's own, on its ring.
pub(super) fn serve(
    queue: &mut QueueRing,
    stack: &Stack,
    depth: u16,
    pool: Option<Pool>,
    cdev: &Arc<File>,
    windows: &Arc<Windows>,
) -> io::Result<()> {
    let ring = OnRing::new(queue, stack, depth, cdev, windows)?;
    let copy = queue.zero_copy().then(|| UserCopy {
        cdev: Arc::clone(cdev),
        q_id: queue.q_id(),
    });
    match pool {
        None => serve_inline(queue, stack, depth, ring, copy.as_ref()),
        Some(pool) if stack.is_asynchronous() && copy.is_none() => {
            serve_submitted(queue, stack, depth, &pool.wake)
        }
        Some(pool) => serve_pooled(queue, stack, depth, &pool, ring, copy.as_ref()),
    }
}

/// What a queue's ring does itself: a file's reads and writes (`ring_io.rs`), or in
/// zero-copy mode an NBD upstream's over a connection of its own (`ring_nbd.rs`).
enum OnRing {
    Files(Box<RingIo>),
    Nbd(Box<RingNbd>),
}

impl OnRing {
    fn new(
        queue: &QueueRing,
        stack: &Stack,
        depth: u16,
        cdev: &Arc<File>,
        windows: &Arc<Windows>,
    ) -> io::Result<Option<OnRing>> {
        let copy = queue.zero_copy().then_some((cdev, windows));
        if let Some(files) = RingIo::new(stack, depth, copy, queue.q_id())? {
            return Ok(Some(OnRing::Files(Box::new(files))));
        }
        match (queue.zero_copy(), stack.nbd_stream()) {
            (true, Some(stream)) => Ok(Some(OnRing::Nbd(Box::new(RingNbd::new(
                stream,
                Arc::clone(cdev),
                queue.q_id(),
                depth,
            )?)))),
            _ => Ok(None),
        }
    }

    /// Starts `tag`'s request on the ring if it is one the ring does; `false`: answer it
    /// another way (nothing was started).
    fn start(
        &mut self,
        queue: &mut QueueRing,
        stack: &Stack,
        tag: u16,
        desc: &IoDesc,
    ) -> io::Result<bool> {
        if let OnRing::Files(files) = self {
            files.note(desc);
        }
        // Pages the ring could not register are reached through /dev/ublkcN only.
        if desc.op_flags & io_desc::F_NEED_REG_BUF != 0 {
            return Ok(false);
        }
        match self {
            OnRing::Files(files) => files.start(queue, stack, tag, desc),
            OnRing::Nbd(nbd) => Ok(nbd.start(tag, desc)),
        }
    }

    /// Runs the ring's completions; the tags it gives back, to answer another way.
    fn complete(&mut self, queue: &mut QueueRing, stack: &Stack) -> io::Result<Vec<u16>> {
        match self {
            OnRing::Files(files) => files.complete(queue, stack).map(|()| Vec::new()),
            OnRing::Nbd(nbd) => {
                nbd.complete(queue)?;
                Ok(nbd.take_given_back())
            }
        }
    }
}

fn serve_inline(
    queue: &mut QueueRing,
    stack: &Stack,
    depth: u16,
    ring: Option<OnRing>,
    copy: Option<&UserCopy>,
) -> io::Result<()> {
    let ring = RefCell::new(ring);
    serve_loop(
        queue,
        depth,
        |queue, tag, desc| {
            if let Some(ring) = ring.borrow_mut().as_mut() {
                if ring.start(queue, stack, tag, &desc)? {
                    return Ok(());
                }
            }
            let result = match queue.buffer(tag) {
                Some(buf) => answer(stack, &desc, buf, copy.map(|c| (c, tag))),
                None => -libc::EIO,
            };
            queue.commit(tag, result)
        },
        |queue| {
            let back = match ring.borrow_mut().as_mut() {
                Some(ring) => ring.complete(queue, stack)?,
                None => return Ok(()),
            };
            for tag in back {
                let desc = queue.desc(tag);
                let result = match queue.buffer(tag) {
                    Some(buf) => answer(stack, &desc, buf, copy.map(|c| (c, tag))),
                    None => -libc::EIO,
                };
                queue.commit(tag, result)?;
            }
            Ok(())
        },
    )
}

/// Waits for requests until every tag is aborted (or the stop eventfd): each request goes to
/// `request` (its tag and descriptor), and after each wake-up `woken` runs.
fn serve_loop(
    queue: &mut QueueRing,
    depth: u16,
    mut request: impl FnMut(&mut QueueRing, u16, IoDesc) -> io::Result<()>,
    mut woken: impl FnMut(&mut QueueRing) -> io::Result<()>,
) -> io::Result<()> {
    let mut done = Vec::with_capacity(depth as usize);
    let mut aborted = 0u16;
    let mut counts = LoopCounts {
        q_id: queue.q_id(),
        wake_ups: 0,
        requests: 0,
    };
    while aborted < depth {
        done.clear();
        if queue.wait(&mut done)? == Woken::Stop {
            return Ok(());
        }
        counts.wake_ups += 1;
        for &(tag, res) in &done {
            if arrived(res, &mut aborted)? {
                counts.requests += 1;
                let desc = queue.desc(tag);
                request(queue, tag, desc)?;
            }
        }
        woken(queue)?;
    }
    Ok(())
}

/// How many requests a queue's thread took and how often it woke for them (logged when the
/// queue ends: requests per wake-up is what batching buys).
struct LoopCounts {
    q_id: u16,
    wake_ups: u64,
    requests: u64,
}

impl Drop for LoopCounts {
    fn drop(&mut self) {
        tracing::info!(
            queue = self.q_id,
            requests = self.requests,
            wake_ups = self.wake_ups,
            "the queue's requests"
        );
    }
}

/// Whether a completion brought a request (false: the tag was aborted, counted).
fn arrived(res: i32, aborted: &mut u16) -> io::Result<bool> {
    if res == IO_RES_ABORT {
        *aborted += 1;
        return Ok(false);
    }
    if res < 0 {
        return Err(io::Error::from_raw_os_error(-res));
    }
    Ok(true)
}

/// The queue thread's loop on an asynchronous stack: each request submitted with its tag's
/// buffer, whose completion sends it back with its answer and wakes the queue thread, which
/// commits it. Operations still in flight when the device goes away keep their buffer
/// (the lent buffer holds the mapping) and their answers are dropped, never committed.
///
/// Where the stack lets its completions be run by the caller (an NBD upstream), the queue's
/// ring polls its descriptor while the queue has operations in flight and this thread runs
/// them: a reply is received, its request committed, on this thread, with no other thread
/// woken (an operation of another queue's, completed here, goes back to its queue as above).
fn serve_submitted(
    queue: &mut QueueRing,
    stack: &Stack,
    depth: u16,
    wake: &Arc<OwnedFd>,
) -> io::Result<()> {
    let (answers, answer_rx) = mpsc::channel::<(LentBuffer, i32)>();
    let polled = stack.poll_completions();
    if let Some(events) = &polled {
        queue.poll_events(Arc::clone(events));
    }
    let here = std::thread::current().id();
    let in_flight = Cell::new(0usize);
    // The requests of one wake-up leave together (one send to an NBD upstream): plugged at
    // the first, released once all are submitted.
    let plug = RefCell::new(None);
    serve_loop(
        queue,
        depth,
        |queue, tag, desc| {
            let Some(lent) = queue.lend(tag) else {
                return queue.commit(tag, -libc::EIO);
            };
            in_flight.set(in_flight.get() + 1);
            queue.want_events(true);
            if plug.borrow().is_none() {
                *plug.borrow_mut() = stack.plug();
            }
            let (answers, wake) = (answers.clone(), Arc::clone(wake));
            async_request::start(stack, &desc, lent, move |lent, result| {
                // On this queue's own thread the answer is taken after the requests or the
                // completions it is running now (`woken`): no wake-up needed.
                if answers.send((lent, result)).is_ok() && std::thread::current().id() != here {
                    let _ = rustix::io::write(&*wake, &1u64.to_ne_bytes());
                }
            });
            Ok(())
        },
        |queue| {
            drop(plug.borrow_mut().take());
            if queue.take_events() {
                stack.run_completions();
            }
            while let Ok((lent, result)) = answer_rx.try_recv() {
                in_flight.set(in_flight.get().saturating_sub(1));
                queue.commit_lent(lent, result)?;
            }
            let orphans = queue.commit_orphans()?;
            in_flight.set(in_flight.get().saturating_sub(orphans));
            queue.want_events(polled.is_some() && in_flight.get() > 0);
            Ok(())
        },
    )
}

type Job = (LentBuffer, IoDesc);

fn serve_pooled(
    queue: &mut QueueRing,
    stack: &Stack,
    depth: u16,
    pool: &Pool,
    ring: Option<OnRing>,
    copy: Option<&UserCopy>,
) -> io::Result<()> {
    let (jobs, job_rx) = mpsc::channel::<Job>();
    let job_rx = Mutex::new(job_rx);
    let (answers, answer_rx) = mpsc::channel::<(LentBuffer, i32)>();
    let wake = &*pool.wake;
    std::thread::scope(|scope| {
        for i in 0..pool.threads {
            let (job_rx, answers) = (&job_rx, answers.clone());
            std::thread::Builder::new()
                .name(format!("ublk-io{i}"))
                .spawn_scoped(scope, move || {
                    // Not kept to the queue thread's CPUs (`--queue-placement`).
                    if let Some(cpus) = &pool.cpus {
                        let _ = rustix::thread::sched_setaffinity(None, cpus);
                    }
                    work(stack, job_rx, &answers, wake, copy)
                })?;
        }
        drop(answers);
        let served = dispatch(queue, stack, depth, &jobs, &answer_rx, ring);
        // The threads end once the jobs they have are answered.
        drop(jobs);
        served
    })
}

/// The queue thread's loop: requests out to the pool (or to its ring), answers back to the
/// kernel.
fn dispatch(
    queue: &mut QueueRing,
    stack: &Stack,
    depth: u16,
    jobs: &Sender<Job>,
    answers: &Receiver<(LentBuffer, i32)>,
    ring: Option<OnRing>,
) -> io::Result<()> {
    let ring = RefCell::new(ring);
    serve_loop(
        queue,
        depth,
        |queue, tag, desc| {
            if let Some(ring) = ring.borrow_mut().as_mut() {
                if ring.start(queue, stack, tag, &desc)? {
                    return Ok(());
                }
            }
            to_pool(queue, jobs, tag, desc)
        },
        |queue| {
            if let Some(ring) = ring.borrow_mut().as_mut() {
                for tag in ring.complete(queue, stack)? {
                    let desc = queue.desc(tag);
                    to_pool(queue, jobs, tag, desc)?;
                }
            }
            while let Ok((lent, result)) = answers.try_recv() {
                queue.commit_lent(lent, result)?;
            }
            queue.commit_orphans().map(drop)
        },
    )
}

/// Hands `tag`'s request to the pool.
fn to_pool(queue: &mut QueueRing, jobs: &Sender<Job>, tag: u16, desc: IoDesc) -> io::Result<()> {
    match queue.lend(tag) {
        Some(lent) => match jobs.send((lent, desc)) {
            Ok(()) => Ok(()),
            Err(mpsc::SendError((lent, _))) => queue.commit_lent(lent, -libc::EIO),
        },
        None => queue.commit(tag, -libc::EIO),
    }
}

/// An I/O thread: answers requests until the queue hangs up.
fn work(
    stack: &Stack,
    jobs: &Mutex<Receiver<Job>>,
    answers: &Sender<(LentBuffer, i32)>,
    wake: &OwnedFd,
    copy: Option<&UserCopy>,
) {
    loop {
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((mut lent, desc)) = job else { return };
        let tag = lent.tag();
        let result = answer(stack, &desc, lent.as_mut_slice(), copy.map(|c| (c, tag)));
        if answers.send((lent, result)).is_err() {
            return;
        }
        let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
    }
}

/// Does one request in `buf` (with `copy`, zero-copy mode: a write's data fetched into it
/// first, a read's given from it after); its COMMIT result: the bytes of a read or write, 0
/// for the others, or a negative errno (which the block layer reports as an I/O error, "not
/// supported", ...).
pub(super) fn answer(
    stack: &Stack,
    desc: &IoDesc,
    buf: &mut [u8],
    copy: Option<(&UserCopy, u16)>,
) -> i32 {
    let (offset, len) = (desc.offset(), desc.bytes());
    let fua = desc.op_flags & io_desc::F_FUA != 0;
    let data = usize::try_from(len).ok().and_then(|n| buf.get_mut(..n));
    let done = match (desc.op(), data) {
        (io_desc::OP_READ, Some(b)) => stack
            .read(b, offset)
            .and_then(|()| copy.map_or(Ok(()), |(c, tag)| c.give(tag, b)))
            .map(|()| len),
        (io_desc::OP_WRITE, Some(b)) => copy
            .map_or(Ok(()), |(c, tag)| c.fetch(tag, b))
            .and_then(|()| stack.write(b, offset, fua))
            .map(|()| len),
        (io_desc::OP_READ | io_desc::OP_WRITE, None) => {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        }
        (io_desc::OP_FLUSH, _) => stack.flush().map(|()| 0),
        (io_desc::OP_DISCARD, _) => stack.trim(offset, len, fua).map(|()| 0),
        (io_desc::OP_WRITE_ZEROES, _) => {
            let flags = ZeroFlags {
                may_trim: desc.op_flags & io_desc::F_NOUNMAP == 0,
                fast: false,
                fua,
            };
            stack
                .zero(offset, len, flags)
                .map(|()| 0)
                .map_err(io::Error::from)
        }
        _ => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
    };
    commit_result(
        done.and_then(|n| {
            usize::try_from(n).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
        }),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::MemoryBackend;

    fn desc(op: u8, flags: u32, sector: u64, sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: u32::from(op) | flags,
            nr_sectors: sectors,
            start_sector: sector,
            addr: 0,
        }
    }

    #[test]
    fn requests_go_through_the_stack() {
        let backend = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let stack = Stack::of(backend, false);
        let mut buf = vec![0x5au8; 8192];
        assert_eq!(
            answer(
                &stack,
                &desc(io_desc::OP_WRITE, io_desc::F_FUA, 8, 16),
                &mut buf,
                None
            ),
            8192
        );
        let mut back = vec![0u8; 8192];
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_READ, 0, 8, 16), &mut back, None),
            8192
        );
        assert_eq!(back, buf);
        assert_eq!(
            answer(
                &stack,
                &desc(io_desc::OP_WRITE_ZEROES, 0, 8, 8),
                &mut back,
                None
            ),
            0
        );
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_READ, 0, 8, 16), &mut back, None),
            8192
        );
        assert!(back[..4096].iter().all(|&b| b == 0) && back[4096..].iter().all(|&b| b == 0x5a));
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_FLUSH, 0, 0, 0), &mut back, None),
            0
        );
        // Larger than the tag's buffer, past the end, an operation zcnbd does not offer.
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_READ, 0, 0, 32), &mut back, None),
            -libc::EINVAL
        );
        assert!(
            answer(
                &stack,
                &desc(io_desc::OP_READ, 0, 2047, 16),
                &mut back,
                None
            ) < 0
        );
        assert_eq!(
            answer(&stack, &desc(10, 0, 0, 0), &mut back, None),
            -libc::EOPNOTSUPP
        );
    }

    #[test]
    fn a_read_only_stack_refuses_writes() {
        let backend = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let stack = Stack::of(backend, true);
        let mut buf = vec![0u8; 4096];
        assert!(answer(&stack, &desc(io_desc::OP_WRITE, 0, 0, 8), &mut buf, None) < 0);
    }
}
