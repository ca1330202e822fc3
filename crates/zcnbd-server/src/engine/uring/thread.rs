//! One ring thread: its connections, its mailbox, and the loop that submits everything
//! queued since the last turn in one `io_uring_enter` and hands each completion to the
//! connection it is for.

use std::io;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tracing::{debug, warn};

use super::conn::Conn;
use super::cx::Cx;
use super::key::ConnKey;
use super::mailbox::{Inbox, Mailbox};
use super::sendfile_trial::SendfileTrial;
use super::shared::EngineShared;
use crate::engine::poll::{PollWindow, Waited};
use crate::engine::wait_trial::{Wait, WaitTrial, COALESCE_COMPLETIONS};
use crate::sys::process::thread_cpu_time;
use crate::sys::uring::{Cqe, Reaped, Ring};

/// Rings with more connections than this never poll (`engine/poll.rs`).
const POLL_CONNECTIONS_MAX: usize = 4;

/// How often the timer fires at most; deadlines are met to within this (or a quarter of the
/// shortest timeout, if that is shorter).
const TICK_MS_MAX: u64 = 1000;

struct RingThread {
    ring: Ring,
    shared: EngineShared,
    mailbox: Mailbox,
    inbox: Receiver<Inbox>,
    conns: Vec<Option<Conn>>,
    generations: Vec<u16>,
    free: Vec<u32>,
    live: usize,
    stopping: bool,
    now: Instant,
    /// Connections with replies to send at the end of this turn.
    sends: Vec<ConnKey>,
    /// Connections with a request waiting for buffer memory.
    parked: Vec<ConnKey>,
    /// How long the thread polls before it sleeps.
    poll: PollWindow,
    /// Requests started since the thread last waited.
    started: u64,
    /// Requests started since the thread last waited for its clients (what the polling
    /// window learns from).
    since_client_wait: u64,
    /// How the thread waits for clients that pipeline.
    trial: WaitTrial,
    /// How long a coalescing wait waits at most with one completion (`--coalesce-max-us`).
    coalesce_max: Duration,
    /// How large reads go to clients on other hosts (`sendfile_trial.rs`).
    sendfile_trial: SendfileTrial,
}

/// Starts ring thread `index`; returns its mailbox once the ring is built.
pub(super) fn spawn(index: usize, shared: EngineShared) -> io::Result<(Mailbox, JoinHandle<()>)> {
    let (mailbox, inbox) = Mailbox::new()?;
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<io::Result<()>>(1);
    let thread_mailbox = mailbox.clone();
    // Memory given back while requests wait wakes this ring, which tries its parked ones.
    let waker = mailbox.clone();
    shared.memory.add_waker(Box::new(move || waker.wake()));
    let handle = std::thread::Builder::new()
        .name(format!("ring-{index}"))
        .spawn(move || {
            // SINGLE_ISSUER: the ring must be created by the thread that submits to it.
            let options = &shared.options;
            let poll = PollWindow::new(options.poll_max);
            let tick = tick_interval(&shared.limits);
            let wake = std::sync::Arc::clone(&thread_mailbox.wake);
            let stats = std::sync::Arc::clone(&shared.stats);
            let built = Ring::new(
                options.ring_entries,
                options.fixed_buffer_bytes_max,
                tick,
                wake,
                stats,
            );
            let ring = match built {
                Ok(ring) => ring,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            let coalesce_max = shared.options.coalesce_max;
            let can_coalesce = ring.can_coalesce() && !coalesce_max.is_zero();
            RingThread {
                ring,
                shared,
                mailbox: thread_mailbox,
                inbox,
                conns: Vec::new(),
                generations: Vec::new(),
                free: Vec::new(),
                live: 0,
                stopping: false,
                now: Instant::now(),
                sends: Vec::new(),
                parked: Vec::new(),
                poll,
                started: 0,
                since_client_wait: 0,
                trial: WaitTrial::new(Instant::now(), can_coalesce, true),
                coalesce_max,
                sendfile_trial: SendfileTrial::default(),
            }
            .run();
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
        if let Err(e) = self.ring.arm() {
            warn!("ring cannot arm its mailbox and timer: {e}");
            return;
        }
        let mut reaped = Vec::with_capacity(256);
        loop {
            self.drain_inbox();
            self.resume_parked();
            self.flush_sends();
            if self.stopping && self.live == 0 {
                break;
            }
            match self.wait() {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    warn!("io_uring_enter failed: {e}");
                    break;
                }
            }
            self.now = Instant::now();
            reaped.clear();
            self.ring.reap(&mut reaped);
            for &event in &reaped {
                match event {
                    Reaped::Cqe(cqe) => self.complete(cqe),
                    Reaped::Ticked => self.on_tick(),
                    // The inbox is drained at the top of every turn.
                    Reaped::Woken => {}
                }
            }
        }
        debug!("ring thread exits");
    }

    /// Submits what this turn queued and waits for a completion: polls for one first while
    /// connections are attached (`engine/poll.rs`); for clients that pipeline, polls, sleeps
    /// or waits for several completions at once as trials say pays (`engine/wait_trial.rs`);
    /// then sleeps in `io_uring_enter`.
    fn wait(&mut self) -> io::Result<()> {
        let started = Instant::now();
        // Only a wait for clients' next requests may poll or coalesce, and only such waits
        // teach the window how long clients take (requests started are counted until then).
        // While coalescing, a wait whose only other business is the replies' plain send
        // counts as one too: the kernel finishes that send as it is submitted, so without
        // this a client that keeps the ring busy would have its requests caught as they come
        // instead of gathered (fio at iodepth 16: most waits were such).
        let for_clients = self.awaits_clients();
        let also_sends = !for_clients
            && self.trial.current() == Wait::Coalesce
            && self.awaits_clients_or_sends();
        let mut coalesce = false;
        // The trials count requests as they are started, whatever the wait: counted only at
        // the waits for clients, a trial that has fewer of them would be credited with
        // requests started before it.
        let requests = std::mem::take(&mut self.started);
        self.trial.count(requests);
        self.since_client_wait += requests;
        if for_clients || also_sends {
            // Polling and its window are for waits with nothing at all in flight.
            let ordinary = for_clients
                && self
                    .poll
                    .polls_after(std::mem::take(&mut self.since_client_wait));
            let chosen = self
                .trial
                .next(started, self.poll.pipelined(), thread_cpu_time);
            coalesce = chosen == Wait::Coalesce;
            // The ordinary rule polls once a pipelining client's requests come one per wake
            // (as polling's trial leaves them): not while coalescing is tried or kept.
            // Overlapping polls too: the client's next requests come while it reads the
            // replies sent early.
            let polls = (ordinary && !coalesce) || matches!(chosen, Wait::Poll | Wait::Overlap);
            if for_clients && polls {
                self.ring.submit()?;
                let ring = &mut self.ring;
                // An error is left for the sleeping enter below to report.
                let found = self.poll.poll(started, || match ring.has_completions() {
                    Ok(false) => None,
                    Ok(true) | Err(_) => Some(()),
                });
                if found.is_some() {
                    self.poll.learn(Waited::Polled);
                    self.shared.stats.waited(true);
                    return Ok(());
                }
            }
        } else {
            self.trial.busy(started);
        }
        let waited = if coalesce {
            self.shared.stats.waited_coalesced();
            self.ring
                .submit_and_wait_coalesced(COALESCE_COMPLETIONS, self.coalesce_max)
        } else {
            self.ring.submit_and_wait()
        };
        if for_clients {
            self.poll.learn(Waited::Slept(started.elapsed()));
            self.shared.stats.waited(false);
        }
        waited
    }

    /// Whether the ring has connections, few enough to poll for (a ring with more has work
    /// coming anyway), and each waits for its client's next request only: polling while a
    /// file operation or a worker is still busy would take the CPU they need.
    fn awaits_clients(&self) -> bool {
        (1..=POLL_CONNECTIONS_MAX).contains(&self.live)
            && self.conns.iter().flatten().all(Conn::awaits_client)
    }

    /// Whether the ring's connections, few enough to poll for, each wait for their client's
    /// next request and at most their own replies' plain send.
    fn awaits_clients_or_sends(&self) -> bool {
        (1..=POLL_CONNECTIONS_MAX).contains(&self.live)
            && self.conns.iter().flatten().all(Conn::awaits_client_or_send)
    }

    /// The timer fired: every connection checks its deadlines.
    fn on_tick(&mut self) {
        for slot in 0..self.conns.len() {
            let Some(Some(conn)) = self.conns.get(slot) else {
                continue;
            };
            let key = conn.key();
            self.with_conn(key, |conn, cx| conn.on_tick(cx));
        }
    }

    /// Tries the requests waiting for buffer memory again.
    fn resume_parked(&mut self) {
        let keys = std::mem::take(&mut self.parked);
        for key in keys {
            self.with_conn(key, |conn, cx| conn.resume(cx));
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
            self.ring.ensure_fixed();
        }
        self.conns[slot as usize] = Some(conn);
        self.live += 1;
        self.with_conn(key, |conn, cx| conn.start(cx));
    }

    fn complete(&mut self, cqe: Cqe) {
        let (key, tag, index) = ConnKey::unpack_op(cqe.user_data);
        let Some(tag) = tag else { return };
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
        let (mut submitter, fixed) = self.ring.parts();
        let mut cx = Cx {
            driver: &mut submitter,
            shared: &self.shared,
            mailbox: &self.mailbox,
            fixed,
            sends: &mut self.sends,
            parked: &mut self.parked,
            now: self.now,
            started: &mut self.started,
            overlap: self.trial.current() == Wait::Overlap,
            sendfile_trial: &mut self.sendfile_trial,
        };
        f(conn, &mut cx);
        conn.settle_broken();
        if conn.is_finished() {
            if let Some(conn) = self.conns[key.slot as usize].take() {
                conn.close();
            }
            self.free.push(key.slot);
            self.live -= 1;
        }
    }
}

/// The timer's interval: a quarter of the shortest timeout, at most [`TICK_MS_MAX`].
fn tick_interval(limits: &crate::limits::Limits) -> Duration {
    let shortest = limits
        .idle_timeout_ms
        .unwrap_or(u64::MAX)
        .min(limits.write_timeout_ms)
        .min(limits.payload_timeout_ms);
    Duration::from_millis((shortest / 4).clamp(10, TICK_MS_MAX))
}
