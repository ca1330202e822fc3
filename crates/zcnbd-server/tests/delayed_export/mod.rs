//! An asynchronous test export: a memory disk whose operations complete on one background
//! thread after a delay, as librbd's aio callbacks do. No server thread waits for them.
//!
//! To show what the server does with that, it can hold its completions until a number of
//! operations are waiting at once (the gather gate), drop a completion without calling it,
//! and panic in `submit`.

use std::collections::{BTreeSet, VecDeque};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zcnbd_proto::Extent;
use zcnbd_server::export::{AsyncOp, Backend, Capabilities, Completion, ZeroError, ZeroFlags};

/// What the export does wrong, on purpose, for operations at an offset.
#[derive(Debug, Default, Clone, Copy)]
pub struct Faults {
    /// Operations at this offset are dropped uncompleted (on the background thread).
    pub drop_at: Option<u64>,
    /// `submit` panics for operations at this offset.
    pub panic_at: Option<u64>,
}

/// What the export has seen, for the tests' assertions.
#[derive(Debug, Default)]
pub struct Counters {
    /// Operations submitted and not yet completed (or dropped).
    pending: AtomicUsize,
    /// The most operations pending at once since the last `take_pending_max`.
    pending_max: AtomicUsize,
    /// Completions dropped on purpose.
    pub dropped: AtomicUsize,
    /// The names of the threads that called `submit`.
    submitters: Mutex<BTreeSet<String>>,
}

impl Counters {
    /// The most operations that were pending at once; starts counting again from now.
    pub fn take_pending_max(&self) -> usize {
        self.pending_max
            .swap(self.pending.load(Ordering::SeqCst), Ordering::SeqCst)
    }

    /// The names of the threads that called `submit`.
    pub fn submitters(&self) -> BTreeSet<String> {
        self.submitters.lock().unwrap().clone()
    }
}

/// An operation waiting on the background thread.
struct Job {
    op: AsyncOp,
    done: Completion,
    submitted: Instant,
}

/// The memory disk with asynchronous completions.
#[derive(Debug)]
pub struct Delayed {
    inner: Arc<dyn Backend>,
    jobs: Sender<Job>,
    counters: Arc<Counters>,
    /// Completions wait until this many operations are waiting (or the oldest waited
    /// [`GATHER_TIMEOUT`]).
    gather: Arc<AtomicUsize>,
    faults: Faults,
}

/// Longest an operation waits at the gather gate.
const GATHER_TIMEOUT: Duration = Duration::from_secs(10);

/// Where an operation works, if it has an offset.
fn offset_of(op: &AsyncOp) -> Option<u64> {
    match op {
        AsyncOp::Read { offset, .. }
        | AsyncOp::ReadPiped { offset, .. }
        | AsyncOp::Write { offset, .. }
        | AsyncOp::Trim { offset, .. }
        | AsyncOp::Zero { offset, .. }
        | AsyncOp::Cache { offset, .. }
        | AsyncOp::Extents { offset, .. } => Some(*offset),
        AsyncOp::Flush => None,
    }
}

impl Delayed {
    /// `inner`'s data, each operation completed `delay` after it was submitted (or after
    /// the gather gate opened).
    pub fn new(inner: Arc<dyn Backend>, delay: Duration, faults: Faults) -> Arc<Delayed> {
        let (jobs, receiver) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let gather = Arc::new(AtomicUsize::new(1));
        let worker = Completer {
            inner: Arc::clone(&inner),
            counters: Arc::clone(&counters),
            gather: Arc::clone(&gather),
            faults,
            delay,
        };
        std::thread::Builder::new()
            .name("delayed-export".into())
            .spawn(move || worker.run(receiver))
            .expect("spawn the export's thread");
        Arc::new(Delayed {
            inner,
            jobs,
            counters,
            gather,
            faults,
        })
    }

    /// Holds completions until `n` operations are waiting at once.
    pub fn gather(&self, n: usize) {
        self.gather.store(n.max(1), Ordering::SeqCst);
    }

    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }
}

impl Backend for Delayed {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.pread(buf, offset)
    }
    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.inner.pwrite(buf, offset, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.inner.trim(offset, len, fua)
    }
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        self.inner.zero(offset, len, flags)
    }
    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.cache(offset, len)
    }
    fn extents(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) -> io::Result<()> {
        self.inner.extents(offset, len, max, out)
    }

    fn can_submit(&self) -> bool {
        true
    }

    fn submit(&self, op: AsyncOp, done: Completion) {
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        self.counters.submitters.lock().unwrap().insert(thread);
        if self.faults.panic_at.is_some() && offset_of(&op) == self.faults.panic_at {
            panic!("injected panic in submit");
        }
        let pending = self.counters.pending.fetch_add(1, Ordering::SeqCst) + 1;
        self.counters
            .pending_max
            .fetch_max(pending, Ordering::SeqCst);
        let job = Job {
            op,
            done,
            submitted: Instant::now(),
        };
        // A thread that is gone drops the job, and its completion answers EIO.
        let _ = self.jobs.send(job);
    }
}

/// The background thread: completes operations in order, each `delay` after it was
/// submitted, once the gather gate is open.
struct Completer {
    inner: Arc<dyn Backend>,
    counters: Arc<Counters>,
    gather: Arc<AtomicUsize>,
    faults: Faults,
    delay: Duration,
}

impl Completer {
    fn run(self, receiver: Receiver<Job>) {
        let mut waiting: VecDeque<Job> = VecDeque::new();
        // Once open, the gate stays open until nothing waits.
        let mut open = false;
        loop {
            let received = match self.next_wake(&waiting, open) {
                None => receiver.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => receiver.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match received {
                Ok(job) => waiting.push_back(job),
                Err(RecvTimeoutError::Timeout) => {}
                // The export is gone; what still waits is dropped (and answered EIO).
                Err(RecvTimeoutError::Disconnected) => return,
            }
            waiting.extend(receiver.try_iter());
            let now = Instant::now();
            open = open
                || waiting.len() >= self.gather.load(Ordering::SeqCst)
                || waiting
                    .front()
                    .is_some_and(|j| now >= j.submitted + GATHER_TIMEOUT);
            while open
                && waiting
                    .front()
                    .is_some_and(|j| now >= j.submitted + self.delay)
            {
                let job = waiting.pop_front().expect("a job waits");
                self.finish(job);
            }
            open &= !waiting.is_empty();
        }
    }

    /// When something is next due: the front job's completion, or the gate's timeout.
    fn next_wake(&self, waiting: &VecDeque<Job>, open: bool) -> Option<Instant> {
        let front = waiting.front()?;
        Some(if open {
            front.submitted + self.delay
        } else {
            front.submitted + GATHER_TIMEOUT
        })
    }

    fn finish(&self, mut job: Job) {
        self.counters.pending.fetch_sub(1, Ordering::SeqCst);
        if self.faults.drop_at.is_some() && offset_of(&job.op) == self.faults.drop_at {
            self.counters.dropped.fetch_add(1, Ordering::SeqCst);
            return drop(job);
        }
        let result = zcnbd_server::export::run_blocking(self.inner.as_ref(), &mut job.op);
        job.done.complete(job.op, result);
    }
}
