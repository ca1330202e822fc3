//! How a thread that answers a client that pipelines (a ring thread, or the portable
//! engine's reader when it sends the replies itself) waits for it - sleeping, polling, or
//! coalescing: measured, not assumed.
//!
//! Polling before sleeping (`engine/poll.rs`) is off for a client that keeps several requests
//! in flight: over TCP its next request is usually on its way and polling only costs CPU
//! (fio, 4 KiB writes at iodepth 16: 1.5x the server CPU per GiB at 0.87x the IOPS). But
//! where a request costs the kernel little (a Unix socket), the ring thread runs dry between
//! requests even at iodepth 16 and sleeps, and the client waits for its wake-up: measured by
//! hand (docs/benchmarks/history.md, section 22, third pass; 2-vCPU AMD EPYC), `zcnbd bench` at
//! iodepth 16 on a Unix socket moved 136k writes a second with sleeping and 266k with
//! polling, at about the same CPU per GiB.
//!
//! The other way round, a client with requests to spare loses nothing if the thread waits a
//! little longer and wakes for several completions at once ([`Wait::Coalesce`]: at most
//! `--coalesce-max-us` (default [`COALESCE_MAX_US_DEFAULT`]) for [`COALESCE_COMPLETIONS`];
//! the portable reader holds its queued replies that long for more requests): fewer
//! wake-ups, and replies leave several to a send, so the client reads fewer segments too. A
//! ring that coalesces waits so also while its replies' plain send is its only other
//! business (`uring/thread.rs`): the kernel finishes such a send as it is submitted, and a
//! client that keeps the ring busy would otherwise have its requests caught as they come.
//! Measured at 20 us (section 22, fourth pass; fio over TCP, iodepth 16, 4 KiB, 5 repeats): writes
//! 130k against 119k IOPS at 1.48 against 1.67 s of server CPU per GiB, reads 131k against
//! 104k; under TLS (portable engine) reads 134k against 109k. But at iodepth 4 the same wait
//! starves the client (forced on: 0.6x-0.7x the IOPS at more CPU per request), and nothing
//! about one request tells the two apart.
//!
//! There is one more way ([`Wait::Overlap`]). The portable reader sends its queued replies
//! just before it waits, and a ring receives a burst in one receive and answers it in one
//! send, so a client that sends its requests in bursts (`zcnbd bench`'s client refills its
//! queue depth with one send) gets the whole burst's replies together and sits idle while
//! the server works through the burst, then the server sits idle while the client works
//! through the replies: lock step. Overlapping sends replies [`OVERLAP_REPLIES`] at a time
//! as soon as they are queued, so the two work at once: the portable reader sends them
//! before it reads the rest of the burst (`zcnbd bench` TLS writes at iodepth 16: about 280k
//! against 130k requests a second, over TCP and a Unix socket); a ring's connection starts no
//! more of the burst it has received while that many wait, so they leave at the end of the
//! turn and the send's completion starts the next ones (`zcnbd bench` plain 4 KiB reads at
//! iodepth 16, AMD EPYC, 7 repeats, docs/benchmarks/engines.md: 1236 against 776 MiB/s
//! sequential, 1036 against 646 random, at 0.72x and 0.80x the server CPU per GiB). But a
//! client that sends its requests one at a time and is itself the limit (fio's libnbd under
//! TLS, a whole CPU) loses by it (its trials: 61k and 70k writes a second overlapping, 68k
//! and 73k sleeping): polling takes CPU it needs, and it gets more, smaller replies to read.
//! So this is tried too, and kept only for speed.
//!
//! The client's throughput and the thread's CPU per request tell them apart, so the thread
//! tries each ([`WaitTrial`]): while a client pipelines, [`TRIAL`] of sleeping, of polling, of
//! coalescing, of overlapping (each after [`SETTLE`] uncounted, for the client's queue to
//! settle after the switch; a turn longer than [`TURN_MAX`] starts the round again). Polling,
//! coalescing or overlapping is chosen if it moved at least [`GAIN`] times the requests per
//! second sleeping did (the fastest, if several); else coalescing if it moved at least
//! [`COALESCE_RATE_MIN`] times as many at most [`COALESCE_CPU_MAX`] times sleeping's CPU per
//! request, or [`COALESCE_RATE_MIN_SAVING`] times as many at most [`COALESCE_CPU_SAVING`]
//! times its CPU; else sleeping. The choice is kept for [`KEEP`], doubled each time the same choice
//! is made again in a row, up to [`STREAK_MAX`] doublings (4 s): a steady client pays for one
//! round of trials every 4 s. A turn longer than [`KEEP_IDLE_MAX`] ends a kept choice too.

use std::time::{Duration, Instant};

use tracing::debug;

/// How long each trial counts, after [`SETTLE`].
pub const TRIAL: Duration = Duration::from_millis(20);

/// The start of each trial that is not counted: right after a switch the client's queue
/// still reflects the previous way of waiting (measured: 5 ms trials counted from the
/// switch chose by noise).
pub const SETTLE: Duration = Duration::from_millis(2);

/// A turn of the ring longer than this (an idle client, the gap between two runs) voids the
/// round of trials under way, which starts again from sleeping: a trial that counted an
/// idle spell would make any other way of waiting look faster.
pub const TURN_MAX: Duration = Duration::from_millis(1);

/// A turn longer than this also ends a kept choice, and the trials start again: the client
/// that made it went quiet, and what comes next (the same client doing something else,
/// another client, a benchmark's next cell) may want another way. Kept through such a gap,
/// a choice made for fio at iodepth 4 (sleeping, for up to 4 s) held through the whole next
/// cell at iodepth 16, where coalescing halves the CPU per request.
pub const KEEP_IDLE_MAX: Duration = Duration::from_millis(50);

/// How long a choice is kept the first time it is made.
pub const KEEP: Duration = Duration::from_millis(500);

/// The most times [`KEEP`] doubles while the trials keep making the same choice.
pub const STREAK_MAX: u32 = 3;

/// Polling or coalescing is chosen for its speed when its trial moved at least this many
/// times the requests per second the sleeping trial did (the faster of the two if both
/// did): it may cost CPU, so it must buy clearly more than the trials' noise (polling over
/// TCP, where it buys nothing: 1.15 still let noise choose it now and then).
pub const GAIN: f64 = 1.25;

/// Otherwise coalescing is chosen for its cost: it must keep at least this share of the
/// sleeping trial's requests per second...
pub const COALESCE_RATE_MIN: f64 = 0.95;

/// ... and cost at most this share of its CPU per request, to be chosen (it exists to save
/// CPU; at iodepth 2 it kept the IOPS but cost 1.2x the CPU per request).
pub const COALESCE_CPU_MAX: f64 = 0.95;

/// Or, where it saves much - at most this share of sleeping's CPU per request - it need keep
/// only [`COALESCE_RATE_MIN_SAVING`] of the rate: trials of 20 ms on a busy VM are noisy.
/// Measured (fio, 4 KiB, iodepth 16, Intel Xeon): coalescing cost 0.3x-0.6x sleeping's CPU per
/// request, and its rate against sleeping's ranged over 0.80x-1.69x from round to round of
/// one run, so a rule of 0.95 chose sleeping in a third of the rounds; at iodepth 8 it
/// moved 0.68x-0.82x as many at 0.53x-0.99x the CPU, and at iodepth 4 or 2 less than half.
pub const COALESCE_CPU_SAVING: f64 = 0.6;

/// The share of sleeping's rate a coalescing that saves [`COALESCE_CPU_SAVING`] must keep.
pub const COALESCE_RATE_MIN_SAVING: f64 = 0.85;

/// A coalescing wait returns once this many completions are there...
pub const COALESCE_COMPLETIONS: usize = 4;

/// `--coalesce-max-us`'s default: a coalescing wait returns once this long has passed and
/// there is at least one completion (the portable reader holds its replies this long at
/// most). With one connection a ring has at most its receive and its send in flight, so the
/// wait nearly always runs this long, and requests gather in the socket meanwhile. Measured
/// (section 22, fourth pass; fio over TCP at iodepth 16, 4 KiB, 5 repeats, side by side):
/// writes cost 1.47, 1.28 and 1.05 s of server CPU per GiB with 20, 40 and 60 us at the same
/// IOPS, reads 1.35, 1.24 and 1.12 s at 137k, 136k and 130k IOPS; under TLS the three were
/// alike. 40 us: most of the saving, no IOPS lost.
pub const COALESCE_MAX_US_DEFAULT: u64 = 40;

/// The largest `--coalesce-max-us` accepted (1 ms): a reply held longer is a latency no
/// saving pays for.
pub const COALESCE_MAX_US_LIMIT: u64 = 1000;

/// How the next wait for a pipelining client goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Wait {
    /// Sleep until the first completion.
    Sleep,
    /// Poll (for the ordinary window) before sleeping.
    Poll,
    /// Sleep until [`COALESCE_COMPLETIONS`] completions, or `--coalesce-max-us` with one (the
    /// portable reader: hold replies that long for more requests, while fewer are queued).
    Coalesce,
    /// Poll, and send replies as soon as [`OVERLAP_REPLIES`] are queued, while the rest of
    /// the client's burst is still to be read (the portable reader) or started (a ring): the
    /// client works on the first replies while this thread works on the rest of the burst,
    /// and the thread catches the client's next requests as they come.
    Overlap,
}

/// How many kinds of [`Wait`] there are.
const WAITS: usize = 4;

/// While overlapping, replies leave as soon as this many are queued. Measured by hand
/// (section 22, fifth pass; `zcnbd bench` TLS writes at iodepth 16, 4 KiB, early sends forced
/// on, one run each, 2-vCPU AMD EPYC): over TCP 147k, 231k, 299k, 278k, 234k and 204k IOPS
/// at 1, 2, 3, 4, 6 and 8 queued replies, against 130k sending only before a wait; over a
/// Unix socket 213k, 280k, 293k and 210k at 1, 2, 4 and 8. 4 replies of 4 KiB fill one TLS
/// record.
pub const OVERLAP_REPLIES: usize = 4;

/// What one trial measured.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Measured {
    per_s: f64,
    /// The thread's CPU time per request (`None`: no requests).
    cpu_per_request: Option<Duration>,
}

/// Where the trials stand.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Trying `wait` since `since`; counting since `counting` (the instant and the thread's
    /// CPU time then), once [`SETTLE`] has passed.
    Trial {
        wait: Wait,
        since: Instant,
        counting: Option<(Instant, Duration)>,
    },
    /// The choice, kept until `until`.
    Keep { until: Instant, wait: Wait },
}

/// Decides, wait by wait, how a thread waits for a pipelining client.
#[derive(Debug, Clone)]
pub struct WaitTrial {
    phase: Phase,
    /// Whether the thread may coalesce (a ring needs `IORING_FEAT_MIN_TIMEOUT`, Linux 6.12;
    /// `--coalesce-max-us 0` turns it off); if not, its trial is skipped.
    can_coalesce: bool,
    /// Whether the thread may overlap; if not, its trial is skipped.
    can_overlap: bool,
    /// Requests started during the current trial's count.
    requests: u64,
    /// This round's results so far, by [`Wait`].
    measured: [Option<Measured>; WAITS],
    /// When the thread last asked how to wait, or said it was busy.
    asked: Instant,
    /// The last choice, and how many times in a row it was made before (at most
    /// [`STREAK_MAX`]).
    last: Option<Wait>,
    streak: u32,
}

impl WaitTrial {
    /// Trials that start with sleeping at `now`.
    pub fn new(now: Instant, can_coalesce: bool, can_overlap: bool) -> WaitTrial {
        WaitTrial {
            phase: trial(Wait::Sleep, now),
            can_coalesce,
            can_overlap,
            requests: 0,
            measured: [None; WAITS],
            asked: now,
            last: None,
            streak: 0,
        }
    }

    /// The thread waits at `now` for something other than its clients (a send, a file
    /// operation): busy, not idle, so the time since is what the next turn is measured from.
    pub fn busy(&mut self, now: Instant) {
        self.asked = now;
    }

    /// The wait being tried or kept, without counting a turn (what a thread that is busy
    /// only with its own sends may follow).
    pub fn current(&self) -> Wait {
        match self.phase {
            Phase::Trial { wait, .. } | Phase::Keep { wait, .. } => wait,
        }
    }

    /// Counts `requests` more started.
    pub fn count(&mut self, requests: u64) {
        self.requests = self.requests.saturating_add(requests);
    }

    /// How the wait starting at `now` goes. `pipelined`: the ring's clients are seen keeping
    /// several requests in flight; while they are not, this says [`Wait::Sleep`] (the
    /// ordinary polling rule covers them) and the trials start again once they are. `cpu`:
    /// the thread's CPU time so far, asked for only at a trial's start and end.
    pub fn next(&mut self, now: Instant, pipelined: bool, cpu: impl FnOnce() -> Duration) -> Wait {
        let turn = now.saturating_duration_since(std::mem::replace(&mut self.asked, now));
        let idle =
            turn > KEEP_IDLE_MAX || (turn > TURN_MAX && matches!(self.phase, Phase::Trial { .. }));
        // Polling catches a pipelining client's requests one at a time, which reads as a
        // client that stopped pipelining - still so when the trials that follow polling's
        // start: only idle turns end a round once its sleeping trial is over, or a kept
        // polling (or overlapping, which polls). (A client that really stopped moves fewer
        // requests in the trials it is left in, and a kept coalescing ends as soon as it is
        // seen.)
        let polling = matches!(
            self.phase,
            Phase::Trial {
                wait: Wait::Poll | Wait::Coalesce | Wait::Overlap,
                ..
            } | Phase::Keep {
                wait: Wait::Poll | Wait::Overlap,
                ..
            }
        );
        if (!pipelined && !polling) || idle {
            self.restart(now);
            return Wait::Sleep;
        }
        match self.phase {
            Phase::Keep { until, wait } => {
                if now < until {
                    return wait;
                }
                self.restart(now);
                Wait::Sleep
            }
            Phase::Trial {
                wait,
                since,
                counting: None,
            } => {
                if now.saturating_duration_since(since) >= SETTLE {
                    self.phase = Phase::Trial {
                        wait,
                        since,
                        counting: Some((now, cpu())),
                    };
                    self.requests = 0;
                }
                wait
            }
            Phase::Trial {
                wait,
                counting: Some((from, cpu_from)),
                ..
            } => {
                let ran = now.saturating_duration_since(from);
                if ran < TRIAL {
                    return wait;
                }
                let requests = std::mem::take(&mut self.requests);
                let measured = Measured {
                    per_s: requests as f64 / ran.as_secs_f64(),
                    cpu_per_request: u32::try_from(requests)
                        .ok()
                        .filter(|&n| n > 0)
                        .map(|n| cpu().saturating_sub(cpu_from) / n),
                };
                self.after(wait, measured, now)
            }
        }
    }

    /// The trial of `wait` measured `measured`: the next trial, or the choice.
    fn after(&mut self, wait: Wait, measured: Measured, now: Instant) -> Wait {
        self.measured[wait as usize] = Some(measured);
        let later: &[(Wait, bool)] = match wait {
            Wait::Sleep => &[(Wait::Poll, true)],
            Wait::Poll => &[
                (Wait::Coalesce, self.can_coalesce),
                (Wait::Overlap, self.can_overlap),
            ],
            Wait::Coalesce => &[(Wait::Overlap, self.can_overlap)],
            Wait::Overlap => &[],
        };
        if let Some(&(next, _)) = later.iter().find(|(_, can)| *can) {
            self.phase = trial(next, now);
            return next;
        }
        let m = std::mem::take(&mut self.measured);
        let chosen = choose(&m);
        debug!(
            "wait trials: sleeping {:?}, polling {:?}, coalescing {:?}, overlapping {:?}: \
             {chosen:?}",
            m[Wait::Sleep as usize],
            m[Wait::Poll as usize],
            m[Wait::Coalesce as usize],
            m[Wait::Overlap as usize]
        );
        self.streak = match self.last {
            Some(last) if last == chosen => (self.streak + 1).min(STREAK_MAX),
            _ => 0,
        };
        self.last = Some(chosen);
        self.phase = Phase::Keep {
            until: now + KEEP * (1 << self.streak),
            wait: chosen,
        };
        chosen
    }

    fn restart(&mut self, now: Instant) {
        self.phase = trial(Wait::Sleep, now);
        self.requests = 0;
        self.measured = [None; WAITS];
    }
}

fn trial(wait: Wait, now: Instant) -> Phase {
    Phase::Trial {
        wait,
        since: now,
        counting: None,
    }
}

/// The rule in the module's comment, over a round's results by [`Wait`].
fn choose(measured: &[Option<Measured>; WAITS]) -> Wait {
    let Some(slept) = measured[Wait::Sleep as usize] else {
        return Wait::Sleep;
    };
    let coalesced = measured[Wait::Coalesce as usize];
    let faster = [Wait::Poll, Wait::Coalesce, Wait::Overlap]
        .into_iter()
        .filter_map(|wait| Some((wait, measured[wait as usize]?)))
        .filter(|(_, m)| m.per_s > 0.0 && m.per_s >= slept.per_s * GAIN)
        .max_by(|a, b| a.1.per_s.total_cmp(&b.1.per_s));
    if let Some((wait, _)) = faster {
        return wait;
    }
    let cheaper = |c: Measured, share: f64| match (c.cpu_per_request, slept.cpu_per_request) {
        (Some(c), Some(s)) => c.as_secs_f64() <= s.as_secs_f64() * share,
        _ => false,
    };
    let keeps = |c: Measured, share: f64| c.per_s >= slept.per_s * share;
    if coalesced.is_some_and(|c| {
        (keeps(c, COALESCE_RATE_MIN) && cheaper(c, COALESCE_CPU_MAX))
            || (keeps(c, COALESCE_RATE_MIN_SAVING) && cheaper(c, COALESCE_CPU_SAVING))
    }) {
        return Wait::Coalesce;
    }
    Wait::Sleep
}

#[cfg(test)]
#[path = "wait_trial_tests.rs"]
mod tests;
