//! The worker threads: they run backend operations (for the portable engine, and for the io_uring
//! engine's requests it does not run on the ring) and hand replies back, so one
//! connection can have many requests in flight on a blocking backend.

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
