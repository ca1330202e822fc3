//! Polling before sleeping: a thread that has nothing to do but expects its next request soon
//! looks for it for a short, adaptive while before it sleeps.
//!
//! Why: on a VM a wake-up across vCPUs costs tens of µs (an idle vCPU halts and must be
//! woken by the host). At queue depth 1 every request costs two of them - the server woken
//! by the request, the client woken by the reply - unless the server is still awake when the
//! request comes. Measured on the 2-vCPU AMD EPYC VM (docs/benchmarks/history.md): 4 KiB reads at
//! iodepth 1 went from 17k to 40k IOPS on both engines.
//!
//! How long: [`PollWindow`], the rule of Linux's cpuidle haltpoll governor. The window grows
//! (doubling from [`POLL_START`], up to the configured maximum) while the next request comes
//! too late for the window but soon enough that a longer one would have caught it, and
//! halves (to zero) when it comes later than any window would wait. Requests that arrive
//! while polling leave it as it is. An idle connection therefore costs nothing: its first
//! long gap halves the window, the next ones take it to zero. While polling the thread gives
//! the CPU to anything else runnable there (`sched_yield`), so a client sharing the CPU is
//! not held up.
//!
//! When: only while the client waits for each reply before it sends its next request. A
//! client that keeps several requests in flight gains nothing from it (its next request is
//! already on its way) and loses the batching that sleeping brings: while the thread wakes,
//! several requests arrive, are received together and answered in one send. Polled, each is
//! caught alone. Measured with fio at iodepth 16, 4 KiB writes: polling took 1.5x the server
//! CPU per GiB at 0.87x the IOPS. So a wake that brings more than one request turns polling
//! off for the next [`PIPELINED_QUIET_REQUESTS`] requests.

use std::time::{Duration, Instant};

/// `--poll-max-us`'s default: at most this long a thread polls before it sleeps. Measured:
/// 20, 50 and 100 µs gave the same IOPS at iodepth 1 (requests come back within ~25 µs on
/// loopback); 50 µs leaves room for a slower client.
pub const POLL_MAX_US_DEFAULT: u64 = 50;

/// The largest `--poll-max-us` accepted (1 ms): beyond it a poll costs more than a sleep
/// and wake-up on any machine.
pub const POLL_MAX_US_LIMIT: u64 = 1000;

/// The window a growing poll starts from.
pub const POLL_START: Duration = Duration::from_micros(10);

/// Requests after a wake that brought several during which nothing polls.
pub const PIPELINED_QUIET_REQUESTS: u64 = 256;

/// While replies are queued and the payload of a request whose header has arrived is still
/// on its way, the portable reader looks for it this long (at most `--poll-max-us`) before
/// it sends them - never longer, so a client that stalls mid-request gets its earlier
/// replies after this. libnbd sends a small write under TLS as two records, header then
/// payload; sending the replies in that gap put one reply segment per request on the wire
/// for fio to read. Measured (fio, TLS 4 KiB writes at iodepth 16, portable engine, AMD
/// EPYC, one run): 1.08x the IOPS with 10 µs, the same with 30 µs.
pub const PAYLOAD_HOLD: Duration = Duration::from_micros(10);

/// Only a request whose payload is at most this long is held for ([`PAYLOAD_HOLD`]): the
/// most plaintext a TLS record carries, so the payload comes whole in the record after its
/// header. A longer one comes in pieces, and a hold in each gap only cost CPU: fio, TLS
/// 64 KiB writes at iodepth 16, AMD EPYC: 1.18x the server CPU per GiB of the build before
/// the hold, 6-10% of it polling (docs/benchmarks/large-requests.md).
pub const PAYLOAD_HOLD_MAX_BYTES: usize = 16 * 1024;

/// Whether a request with a payload of `len` bytes is held for once its header has come.
pub fn holds_for_payload(len: usize) -> bool {
    len > 0 && len <= PAYLOAD_HOLD_MAX_BYTES
}

/// How long to poll before the next sleep, learned from how long the waits were.
#[derive(Debug, Clone)]
pub struct PollWindow {
    window: Duration,
    max: Duration,
    /// Requests to go before polling again (the client was seen pipelining).
    quiet: u64,
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// What was waited for came while polling.
    Polled,
    /// The thread slept; from the start of the wait (polling included) to the wake-up.
    Slept(Duration),
}

impl PollWindow {
    /// A window of at most `max` (zero: never poll), starting at the maximum: a client that
    /// has just sent its first request is likely to send the next one soon.
    pub fn new(max: Duration) -> PollWindow {
        PollWindow {
            window: max,
            max,
            quiet: 0,
        }
    }

    /// How long the next wait polls before sleeping.
    #[cfg(test)]
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Learns from a wait. A wake-up itself takes time (the measured wait is the gap plus
    /// the wake-up), so a sleep counts as "a longer window would have caught it" up to
    /// twice the maximum.
    pub fn learn(&mut self, waited: Waited) {
        let Waited::Slept(waited) = waited else {
            return;
        };
        if self.window < self.max && waited <= self.max.saturating_mul(2) {
            self.window = (self.window * 2).max(POLL_START).min(self.max);
        } else {
            self.window /= 2;
            if self.window < POLL_START {
                self.window = Duration::ZERO;
            }
        }
    }

    /// Whether the next wait polls, given the requests started since the last wait: not
    /// while the client is seen keeping several in flight.
    pub fn polls_after(&mut self, requests: u64) -> bool {
        if requests > 1 {
            self.quiet = PIPELINED_QUIET_REQUESTS;
        } else {
            self.quiet = self.quiet.saturating_sub(requests);
        }
        self.quiet == 0 && !self.window.is_zero()
    }

    /// Whether the client was seen keeping several requests in flight lately (the ordinary
    /// rule does not poll then; `engine/wait_trial.rs` may).
    pub fn pipelined(&self) -> bool {
        self.quiet > 0
    }

    /// Calls `ready` until it answers or the window has passed, yielding the CPU between
    /// calls; `None`: the caller sleeps next.
    pub fn poll<T>(&self, started: Instant, ready: impl FnMut() -> Option<T>) -> Option<T> {
        look_until(started, self.window, ready)
    }

    /// Like [`Self::poll`], for [`PAYLOAD_HOLD`] (at most the configured maximum) whatever
    /// the window: the rest of a request that has begun to arrive. The caller has just
    /// looked and found nothing, so the CPU goes to anything runnable before the next look.
    pub fn hold_for_payload<T>(
        &self,
        started: Instant,
        ready: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        let window = PAYLOAD_HOLD.min(self.max);
        if window.is_zero() {
            return None;
        }
        std::thread::yield_now();
        look_until(started, window, ready)
    }
}

/// Calls `ready` until it answers or `window` has passed since `started`, yielding the CPU
/// between calls (a zero window: never).
fn look_until<T>(
    started: Instant,
    window: Duration,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    if window.is_zero() {
        return None;
    }
    let until = started + window;
    loop {
        if let Some(found) = ready() {
            return Some(found);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(50);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn only_a_payload_that_comes_in_one_tls_record_is_held_for() {
        assert!(holds_for_payload(4096) && holds_for_payload(16 * 1024));
        assert!(!holds_for_payload(0), "no payload: nothing to wait for");
        assert!(!holds_for_payload(16 * 1024 + 1) && !holds_for_payload(64 * 1024));
    }

    #[test]
    fn starts_at_the_maximum_and_keeps_it_while_polls_find() {
        let mut w = PollWindow::new(MAX);
        assert_eq!(w.window(), MAX);
        for _ in 0..100 {
            w.learn(Waited::Polled);
        }
        assert_eq!(w.window(), MAX);
    }

    #[test]
    fn long_gaps_take_it_to_zero_and_short_ones_back() {
        let mut w = PollWindow::new(MAX);
        w.learn(Waited::Slept(us(5000)));
        assert_eq!(w.window(), us(25));
        w.learn(Waited::Slept(us(5000)));
        assert_eq!(w.window(), us(25) / 2);
        w.learn(Waited::Slept(us(5000)));
        assert_eq!(w.window(), Duration::ZERO, "below the start it stops");
        w.learn(Waited::Slept(us(5000)));
        assert_eq!(w.window(), Duration::ZERO);
        // A request that came soon after the thread slept: a window would have caught it.
        w.learn(Waited::Slept(us(60)));
        assert_eq!(w.window(), POLL_START);
        w.learn(Waited::Slept(us(60)));
        assert_eq!(w.window(), us(20));
        w.learn(Waited::Slept(us(60)));
        w.learn(Waited::Slept(us(60)));
        assert_eq!(w.window(), MAX, "never beyond the maximum");
    }

    #[test]
    fn a_full_window_that_missed_halves() {
        // At the maximum, a miss means the gap is longer than any window polls.
        let mut w = PollWindow::new(MAX);
        w.learn(Waited::Slept(us(80)));
        assert_eq!(w.window(), us(25));
    }

    #[test]
    fn a_pipelining_client_turns_polling_off_for_a_while() {
        let mut w = PollWindow::new(MAX);
        assert!(w.polls_after(1));
        assert!(
            w.polls_after(0),
            "a wake that started nothing changes nothing"
        );
        assert!(!w.polls_after(3));
        for _ in 0..PIPELINED_QUIET_REQUESTS - 1 {
            assert!(!w.polls_after(1));
            assert!(!w.polls_after(0));
        }
        assert!(w.polls_after(1), "one request per wake for long enough");
    }

    #[test]
    fn the_payload_hold_ignores_the_window_but_not_the_maximum() {
        let mut w = PollWindow::new(MAX);
        // A pipelining client: the window stays open, but no poll before sleeping.
        assert!(!w.polls_after(2));
        let started = Instant::now();
        let mut calls = 0;
        let found = w.hold_for_payload(started, || {
            calls += 1;
            None::<()>
        });
        assert_eq!(found, None);
        assert!(calls >= 1 && started.elapsed() >= PAYLOAD_HOLD);
        assert_eq!(w.hold_for_payload(Instant::now(), || Some(7)), Some(7));
        let off = PollWindow::new(Duration::ZERO);
        assert_eq!(off.hold_for_payload(Instant::now(), || Some(7)), None);
    }

    #[test]
    fn zero_maximum_never_polls() {
        let mut w = PollWindow::new(Duration::ZERO);
        w.learn(Waited::Slept(us(1)));
        assert_eq!(w.window(), Duration::ZERO);
        assert!(!w.polls_after(1));
        let mut calls = 0;
        assert_eq!(
            w.poll(Instant::now(), || {
                calls += 1;
                Some(())
            }),
            None
        );
        assert_eq!(calls, 0);
    }

    #[test]
    fn poll_returns_what_is_ready_or_gives_up_after_the_window() {
        // A window far longer than three calls can take, even on a loaded machine (a 200 µs
        // one failed in CI once, the thread preempted between two calls).
        let long = PollWindow::new(Duration::from_secs(5));
        let mut n = 0;
        assert_eq!(
            long.poll(Instant::now(), || {
                n += 1;
                (n == 3).then_some(n)
            }),
            Some(3)
        );
        let w = PollWindow::new(us(200));
        let started = Instant::now();
        assert_eq!(w.poll(started, || None::<()>), None);
        assert!(started.elapsed() >= us(200));
    }
}
