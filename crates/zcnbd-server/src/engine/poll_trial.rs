//! Whether a ring thread polls for a client that pipelines: measured, not assumed.
//!
//! Polling before sleeping (`engine/poll.rs`) is off for a client that keeps several requests
//! in flight: over TCP its next request is usually on its way and polling only costs CPU
//! (fio, 4 KiB writes at iodepth 16: 1.5x the server CPU per GiB at 0.87x the IOPS). But
//! where a request costs the kernel little (a Unix socket), the ring thread runs dry between
//! requests even at iodepth 16 and sleeps, and the client waits for its wake-up: measured by
//! hand (docs/BENCHMARKS.md section 22, third pass; 2-vCPU AMD EPYC), `zcnbd bench` at
//! iodepth 16 on a Unix socket moved 136k writes a second with sleeping and 266k with
//! polling, at about the same CPU per GiB. Nothing about one request tells the two cases
//! apart, the client's throughput does, so the thread tries both.
//!
//! How ([`PollTrial`]): while a client pipelines, [`TRIAL`] of sleeping, then [`TRIAL`] of
//! polling; polling is kept for [`KEEP`] if its trial moved at least [`POLL_GAIN`] times the
//! requests per second, sleeping otherwise - for `KEEP` doubled with each loss in a row, up to
//! [`LOSSES_MAX`] doublings (4 s), so where polling does not pay (fio over TCP: it lost every
//! trial) it costs one polling trial in every 4 s or so.

use std::time::{Duration, Instant};

/// How long each trial (sleeping, then polling) runs.
pub const TRIAL: Duration = Duration::from_millis(20);

/// How long the winner of a pair of trials is kept before the next pair.
pub const KEEP: Duration = Duration::from_millis(500);

/// The most times [`KEEP`] doubles after polling lost trials in a row.
pub const LOSSES_MAX: u32 = 3;

/// Polling wins when its trial moved at least this many times the requests per second the
/// sleeping trial did: it costs CPU, so it must buy clearly more than the trials' noise (over
/// TCP, where it buys nothing, 1.15 still let noise choose it now and then).
pub const POLL_GAIN: f64 = 1.25;

/// Where the trials stand.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Sleeping, counting requests since `since`.
    TrialSleep { since: Instant },
    /// Polling, counting requests since `since`; the sleeping trial's rate.
    TrialPoll { since: Instant, sleep_per_s: f64 },
    /// The decision, kept until `until`.
    Keep { until: Instant, poll: bool },
}

/// Decides, wait by wait, whether a ring thread polls for a pipelining client.
#[derive(Debug, Clone)]
pub struct PollTrial {
    phase: Phase,
    /// Requests started during the current trial.
    requests: u64,
    /// Trials polling lost in a row (at most [`LOSSES_MAX`]).
    losses: u32,
}

impl PollTrial {
    /// Trials that start with sleeping at `now`.
    pub fn new(now: Instant) -> PollTrial {
        PollTrial {
            phase: Phase::TrialSleep { since: now },
            requests: 0,
            losses: 0,
        }
    }

    /// Counts `requests` more started.
    pub fn count(&mut self, requests: u64) {
        self.requests = self.requests.saturating_add(requests);
    }

    /// Whether the wait starting at `now` polls. `pipelined`: the ring's clients are seen
    /// keeping several requests in flight; while they are not, this says no and the trials
    /// start again once they are (the ordinary polling rule covers them).
    pub fn polls(&mut self, now: Instant, pipelined: bool) -> bool {
        if !pipelined {
            self.restart(now);
            return false;
        }
        match self.phase {
            Phase::TrialSleep { since } => {
                let Some(sleep_per_s) = self.rate_after(since, now) else {
                    return false;
                };
                self.phase = Phase::TrialPoll {
                    since: now,
                    sleep_per_s,
                };
                true
            }
            Phase::TrialPoll { since, sleep_per_s } => {
                let Some(per_s) = self.rate_after(since, now) else {
                    return true;
                };
                let poll = per_s >= sleep_per_s * POLL_GAIN;
                self.losses = if poll {
                    0
                } else {
                    (self.losses + 1).min(LOSSES_MAX)
                };
                let keep = if poll {
                    KEEP
                } else {
                    KEEP * (1 << self.losses)
                };
                self.phase = Phase::Keep {
                    until: now + keep,
                    poll,
                };
                poll
            }
            Phase::Keep { until, poll } => {
                if now < until {
                    return poll;
                }
                self.restart(now);
                false
            }
        }
    }

    /// Once a trial that began at `since` has run [`TRIAL`]: its requests per second, and
    /// the count starts again.
    fn rate_after(&mut self, since: Instant, now: Instant) -> Option<f64> {
        let ran = now.saturating_duration_since(since);
        if ran < TRIAL {
            return None;
        }
        let per_s = self.requests as f64 / ran.as_secs_f64();
        self.requests = 0;
        Some(per_s)
    }

    fn restart(&mut self, now: Instant) {
        self.phase = Phase::TrialSleep { since: now };
        self.requests = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Ends a trial begun at `at` with `requests` started in it; the decision then.
    fn trial(t: &mut PollTrial, at: Instant, requests: u64) -> bool {
        t.count(requests);
        t.polls(at + TRIAL, true)
    }

    #[test]
    fn polling_that_moves_clearly_more_requests_is_kept_until_the_next_trials() {
        let t0 = Instant::now();
        let mut t = PollTrial::new(t0);
        assert!(!t.polls(t0, true), "the sleeping trial comes first");
        assert!(trial(&mut t, t0, 2700), "then the polling trial");
        assert!(t.polls(t0 + TRIAL + ms(1), true));
        assert!(trial(&mut t, t0 + TRIAL, 5300), "1.96x: polling wins");
        let kept = t0 + TRIAL * 2;
        assert!(t.polls(kept + KEEP - ms(1), true));
        assert!(
            !t.polls(kept + KEEP, true),
            "kept long enough: a new sleeping trial"
        );
    }

    #[test]
    fn polling_that_buys_little_loses() {
        let t0 = Instant::now();
        let mut t = PollTrial::new(t0);
        assert!(trial(&mut t, t0, 2400));
        assert!(
            !trial(&mut t, t0 + TRIAL, 2900),
            "1.21x is within the noise"
        );
        assert!(!t.polls(t0 + TRIAL * 2 + ms(100), true));
    }

    #[test]
    fn each_loss_in_a_row_keeps_sleeping_twice_as_long_up_to_a_limit() {
        let t0 = Instant::now();
        let mut t = PollTrial::new(t0);
        let mut at = t0;
        let mut kept = Vec::new();
        for _ in 0..5 {
            assert!(trial(&mut t, at, 2400));
            assert!(!trial(&mut t, at + TRIAL, 2400));
            let decided = at + TRIAL * 2;
            let Phase::Keep { until, poll: false } = t.phase else {
                panic!("sleeping is kept: {:?}", t.phase);
            };
            kept.push(until - decided);
            assert!(!t.polls(until - ms(1), true));
            assert!(!t.polls(until, true), "a new sleeping trial");
            at = until;
        }
        assert_eq!(kept, [KEEP * 2, KEEP * 4, KEEP * 8, KEEP * 8, KEEP * 8]);
        // A win ends the run of losses: the next loss keeps sleeping for twice KEEP again.
        assert!(trial(&mut t, at, 2000));
        assert!(trial(&mut t, at + TRIAL, 4000));
        assert_eq!(t.losses, 0);
    }

    #[test]
    fn rates_count_the_time_each_trial_really_ran() {
        let t0 = Instant::now();
        let mut t = PollTrial::new(t0);
        // The sleeping trial ran twice its length (a long sleep at its end): the same count
        // in half the time is twice the rate.
        t.count(4000);
        assert!(t.polls(t0 + TRIAL * 2, true));
        t.count(2600);
        assert!(t.polls(t0 + TRIAL * 3, true), "1.3x the sleeping rate");
    }

    #[test]
    fn a_client_that_stops_pipelining_restarts_the_trials() {
        let t0 = Instant::now();
        let mut t = PollTrial::new(t0);
        assert!(trial(&mut t, t0, 2000));
        assert!(!t.polls(t0 + TRIAL + ms(1), false));
        t.count(100_000);
        assert!(!t.polls(t0 + TRIAL + ms(2), true), "a fresh sleeping trial");
        assert!(!t.polls(t0 + TRIAL * 2, true), "still short of its length");
    }
}
