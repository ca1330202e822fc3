//! The worker threads: they run backend operations (for the portable engine, and for the io_uring
//! engine's requests it does not run on the ring) and hand replies back, so one
//! connection can have many requests in flight on a blocking backend.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

/// A unit of work.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of threads fed from one queue.
#[derive(Debug)]
pub struct WorkerPool {
    sender: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts `threads` workers.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let (sender, receiver) = crossbeam_channel::unbounded::<Job>();
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx: Receiver<Job> = receiver.clone();
                std::thread::Builder::new()
                    .name(format!("worker-{i}"))
                    .spawn(move || rx.iter().for_each(run_job))
            })
            .collect::<Result<_, _>>()?;
        Ok(WorkerPool {
            sender: Some(sender),
            threads,
        })
    }

    /// Queues a job. The queue is unbounded, but every connection bounds its own requests in
    /// flight, so its length is bounded by connections x requests in flight.
    pub fn submit(&self, job: Job) {
        if let Some(sender) = &self.sender {
            // Send fails only once every worker has exited, which happens only after drop.
            let _ = sender.send(job);
        }
    }

    /// Queues a job of `lane`: to a worker while fewer than the lane's bound of its jobs
    /// run, else into the lane, whose next job the worker that finishes one runs itself.
    pub fn submit_in(&self, lane: &Arc<Lane>, job: Job) {
        let mut state = lane.lock();
        if state.running >= lane.bound {
            state.waiting.push_back(job);
            return;
        }
        state.running += 1;
        drop(state);
        let lane = Arc::clone(lane);
        self.submit(Box::new(move || lane.run_from(job)));
    }
}

/// The jobs of a backend that can only run so many at a time (a web server's source holds
/// `--http-connections` connections: a read beyond them would wait for one). Beyond its
/// bound they wait here rather than in a worker: a worker blocked waiting for a connection
/// would be woken for each one that frees, a wake-up and a switch per request, and while
/// it waits it is one worker fewer for the other exports. The worker that finishes a job
/// runs the next one waiting, with no hand-off. Its length is bounded as the pool's queue
/// is (every connection bounds its own requests in flight).
pub struct Lane {
    bound: usize,
    state: Mutex<LaneState>,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("Lane")
            .field("bound", &self.bound)
            .field("running", &state.running)
            .field("waiting", &state.waiting.len())
            .finish()
    }
}

#[derive(Default)]
struct LaneState {
    running: usize,
    waiting: VecDeque<Job>,
}

impl Lane {
    /// A lane that runs at most `bound` (at least 1) of its jobs at once.
    pub fn new(bound: usize) -> Lane {
        Lane {
            bound: bound.max(1),
            state: Mutex::new(LaneState::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `job`, then the lane's waiting jobs one after another until none is left.
    fn run_from(&self, mut job: Job) {
        loop {
            run_job(job);
            let mut state = self.lock();
            match state.waiting.pop_front() {
                Some(next) => job = next,
                None => {
                    state.running -= 1;
                    return;
                }
            }
        }
    }
}

/// Runs a job; a panic that escapes it (backend calls catch their own, see
/// `Dispatcher::execute_guarded`) is logged and the worker goes on, so the pool never shrinks.
fn run_job(job: Job) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)) {
        let what = panic_message(panic.as_ref());
        tracing::error!("a worker job panicked ({what})");
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.sender.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What a caught panic said, for the log.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "no message"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn a_lane_runs_at_most_its_bound_at_once_on_that_many_workers_and_survives_a_panic() {
        let pool = WorkerPool::new(8).unwrap();
        let lane = Arc::new(Lane::new(2));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let threads = Arc::new(Mutex::new(std::collections::HashSet::new()));
        for i in 0..10 {
            let (running, most, done, threads) =
                (running.clone(), most.clone(), done.clone(), threads.clone());
            pool.submit_in(
                &lane,
                Box::new(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    threads.lock().unwrap().insert(std::thread::current().id());
                    std::thread::sleep(Duration::from_millis(20));
                    running.fetch_sub(1, Ordering::SeqCst);
                    done.fetch_add(1, Ordering::SeqCst);
                    assert!(i != 3, "a job that panics");
                }),
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while done.load(Ordering::SeqCst) < 10 || lane.lock().running > 0 {
            assert!(Instant::now() < deadline, "{lane:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(most.load(Ordering::SeqCst), 2);
        // The waiting jobs ran on the workers that finished the lane's jobs before them.
        assert_eq!(threads.lock().unwrap().len(), 2);
        assert!(lane.lock().waiting.is_empty());
    }
}
