//! How a ring sends a memory export's large reads to clients on other hosts - by `sendfile`
//! from the memfd, or in one `sendmsg` from the mapping: measured on this machine, not
//! assumed.
//!
//! Why: which costs less depends on the CPU. Over a veth pair into a network namespace (the
//! client's receive in a thread of its own), 1 MiB reads by `sendfile` moved 1.01x-1.29x the
//! MiB/s of sending from the mapping at 0.70x-0.80x the server's CPU per GiB on an Intel
//! Xeon (docs/benchmarks/large-requests.md), but on an AMD EPYC sending from the mapping moved
//! 1.14x-1.23x the MiB/s at 0.64x-0.95x the CPU (docs/benchmarks/veth.md): there a 1 MiB copy
//! costs less than taking and dropping references to its 256 pages.
//!
//! How: while a ring's connections (those whose peer is on another host, with
//! `--splice-min-bytes` not given) send reads of at least
//! [`super::mechanism::SPLICE_MIN_BYTES_REMOTE`], it tries each way in turn - `sendfile`
//! first, the measured default - for at least [`TRIAL`] and [`TRIAL_BYTES`] (after
//! [`SETTLE_BYTES`] uncounted, for the client's queue to settle after the switch), measuring
//! the bytes those reads moved per second and the ring thread's CPU time per byte. The faster
//! is chosen if it moved at least [`GAIN`] times the other's bytes per second; else the
//! cheaper, if it cost at most [`CHEAPER`] times the other's CPU per byte; else `sendfile`.
//! The choice is kept for [`KEEP`], doubled each time the same choice is made again in a row,
//! up to [`STREAK_MAX`] doublings (8 s). A gap of more than [`GAP_MAX`] between large reads
//! voids the trial under way (an idle spell would make either way look slower), which starts
//! again with the next large read.

use std::time::{Duration, Instant};

use tracing::debug;

/// How long each way is measured at least, after [`SETTLE_BYTES`].
pub const TRIAL: Duration = Duration::from_millis(30);

/// How many bytes of large reads each way is measured for at least.
pub const TRIAL_BYTES: u64 = 32 << 20;

/// The bytes of large reads after a switch that are not counted.
pub const SETTLE_BYTES: u64 = 4 << 20;

/// A trial during which no large read started for this long is void.
pub const GAP_MAX: Duration = Duration::from_millis(10);

/// The faster way is chosen when it moved at least this many times the other's bytes per
/// second.
pub const GAIN: f64 = 1.1;

/// Otherwise the cheaper way is chosen when it cost at most this share of the other's CPU
/// time per byte (else `sendfile`, the measured default).
pub const CHEAPER: f64 = 0.95;

/// How long a choice is kept the first time it is made.
pub const KEEP: Duration = Duration::from_secs(1);

/// The most times [`KEEP`] doubles while the trials keep making the same choice.
pub const STREAK_MAX: u32 = 3;

/// How a large read to a client on another host is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LargeReads {
    /// `sendfile` from the memory export's memfd.
    Sendfile,
    /// One `sendmsg` of header and data from the mapping.
    Mapped,
}

/// What one way's trial measured.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Measured {
    bytes_per_s: f64,
    cpu_per_byte: f64,
}

/// Where the trials stand.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Trying `way`: `seen` bytes since the switch; counting since `counting` (the instant,
    /// the ring thread's CPU time then, and the bytes seen then), once [`SETTLE_BYTES`] have
    /// passed.
    Trial {
        way: LargeReads,
        seen: u64,
        counting: Option<(Instant, Duration, u64)>,
    },
    /// The choice, kept until `until`.
    Keep { way: LargeReads, until: Instant },
}

/// Decides, trial by trial, how a ring sends large reads to clients on other hosts.
#[derive(Debug, Clone)]
pub struct SendfileTrial {
    phase: Phase,
    /// `sendfile`'s result in this round.
    sendfile: Option<Measured>,
    /// When the last large read started.
    last: Option<Instant>,
    /// The last choice, and how many times in a row it was made before.
    chosen: Option<LargeReads>,
    streak: u32,
}

impl Default for SendfileTrial {
    fn default() -> Self {
        SendfileTrial {
            phase: trial(LargeReads::Sendfile),
            sendfile: None,
            last: None,
            chosen: None,
            streak: 0,
        }
    }
}

impl SendfileTrial {
    /// Trials that have chosen `way` for a while (for tests of what the ring does with it).
    #[cfg(test)]
    pub fn kept(way: LargeReads) -> SendfileTrial {
        SendfileTrial {
            phase: Phase::Keep {
                way,
                until: Instant::now() + KEEP,
            },
            ..SendfileTrial::default()
        }
    }

    /// The way the next large read goes.
    pub fn current(&self) -> LargeReads {
        match self.phase {
            Phase::Trial { way, .. } | Phase::Keep { way, .. } => way,
        }
    }

    /// A large read of `bytes` starts at `now` (the way [`Self::current`] said); `cpu`: the
    /// ring thread's CPU time so far, asked for only when a trial starts counting or ends.
    pub fn count(&mut self, now: Instant, bytes: usize, cpu: impl FnOnce() -> Duration) {
        let gap = self
            .last
            .replace(now)
            .is_some_and(|last| now.saturating_duration_since(last) > GAP_MAX);
        match &mut self.phase {
            Phase::Keep { until, .. } => {
                if now >= *until {
                    self.phase = trial(LargeReads::Sendfile);
                    self.sendfile = None;
                    self.count_trial(now, bytes, cpu);
                }
            }
            Phase::Trial { way, .. } => {
                if gap {
                    // An idle spell: this trial starts again.
                    self.phase = trial(*way);
                }
                self.count_trial(now, bytes, cpu);
            }
        }
    }

    /// Counts `bytes` in the trial under way; ends it once it has run long enough.
    fn count_trial(&mut self, now: Instant, bytes: usize, cpu: impl FnOnce() -> Duration) {
        let Phase::Trial {
            way,
            seen,
            counting,
        } = &mut self.phase
        else {
            return;
        };
        let way = *way;
        match *counting {
            None => {
                *seen += bytes as u64;
                if *seen >= SETTLE_BYTES {
                    *counting = Some((now, cpu(), *seen));
                }
            }
            Some((from, cpu_from, seen_from)) => {
                let ran = now.saturating_duration_since(from);
                let counted = *seen - seen_from;
                if ran < TRIAL || counted < TRIAL_BYTES {
                    // Counted when the next read starts: this one's bytes leave after now.
                    *seen += bytes as u64;
                    return;
                }
                let cpu_used = cpu().saturating_sub(cpu_from);
                let measured = Measured {
                    bytes_per_s: counted as f64 / ran.as_secs_f64(),
                    cpu_per_byte: cpu_used.as_secs_f64() / counted as f64,
                };
                self.after(way, measured, now);
            }
        }
    }

    /// The trial of `way` measured `measured`: the next trial, or the choice.
    fn after(&mut self, way: LargeReads, measured: Measured, now: Instant) {
        let sendfile = match (way, self.sendfile) {
            (LargeReads::Sendfile, _) => {
                self.sendfile = Some(measured);
                self.phase = trial(LargeReads::Mapped);
                return;
            }
            (LargeReads::Mapped, Some(sendfile)) => sendfile,
            // Unreachable: the mapped trial follows sendfile's. Start the round again.
            (LargeReads::Mapped, None) => {
                self.phase = trial(LargeReads::Sendfile);
                return;
            }
        };
        let chosen = choose(sendfile, measured);
        debug!(
            "large-read trials: sendfile {:.0} MiB/s at {:.3} s/GiB, from the mapping {:.0} \
             MiB/s at {:.3} s/GiB: {chosen:?}",
            sendfile.bytes_per_s / f64::from(1 << 20),
            sendfile.cpu_per_byte * f64::from(1 << 30),
            measured.bytes_per_s / f64::from(1 << 20),
            measured.cpu_per_byte * f64::from(1 << 30),
        );
        self.streak = match self.chosen {
            Some(last) if last == chosen => (self.streak + 1).min(STREAK_MAX),
            _ => 0,
        };
        self.chosen = Some(chosen);
        self.sendfile = None;
        self.phase = Phase::Keep {
            way: chosen,
            until: now + KEEP * (1 << self.streak),
        };
    }
}

fn trial(way: LargeReads) -> Phase {
    Phase::Trial {
        way,
        seen: 0,
        counting: None,
    }
}

/// The rule in the module's comment.
fn choose(sendfile: Measured, mapped: Measured) -> LargeReads {
    if mapped.bytes_per_s >= sendfile.bytes_per_s * GAIN {
        return LargeReads::Mapped;
    }
    if sendfile.bytes_per_s >= mapped.bytes_per_s * GAIN {
        return LargeReads::Sendfile;
    }
    if mapped.cpu_per_byte <= sendfile.cpu_per_byte * CHEAPER {
        return LargeReads::Mapped;
    }
    LargeReads::Sendfile
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// Drives `t` with 1 MiB reads every `every`, the thread's CPU growing by `cpu_per_read`
    /// per read, until the way changes, a trial ends in a choice, or `limit` reads have
    /// started; returns the reads.
    fn run(
        t: &mut SendfileTrial,
        now: &mut Instant,
        cpu: &mut Duration,
        every: Duration,
        cpu_per_read: Duration,
        limit: usize,
    ) -> usize {
        let way = t.current();
        let tried = matches!(t.phase, Phase::Trial { .. });
        for n in 1..=limit {
            *now += every;
            *cpu += cpu_per_read;
            let at = *cpu;
            t.count(*now, MIB, || at);
            let kept = matches!(t.phase, Phase::Keep { .. });
            if t.current() != way || (tried && kept) {
                return n;
            }
        }
        limit
    }

    /// A trial round where sendfile and the mapping cost what `costs` say (interval between
    /// reads, CPU per read): the choice.
    fn round(costs: [(u64, u64); 2]) -> (SendfileTrial, LargeReads) {
        let mut t = SendfileTrial::default();
        let (mut now, mut cpu) = (Instant::now(), Duration::ZERO);
        for (way, (every_us, cpu_us)) in [LargeReads::Sendfile, LargeReads::Mapped]
            .into_iter()
            .zip(costs)
        {
            assert_eq!(t.current(), way);
            let every = Duration::from_micros(every_us);
            let cost = Duration::from_micros(cpu_us);
            run(&mut t, &mut now, &mut cpu, every, cost, 10_000);
        }
        assert!(matches!(t.phase, Phase::Keep { .. }), "{:?}", t.phase);
        let chosen = t.current();
        (t, chosen)
    }

    #[test]
    fn the_faster_way_is_chosen() {
        // From the mapping 1.25x the MiB/s at more CPU per byte.
        assert_eq!(round([(250, 200), (200, 220)]).1, LargeReads::Mapped);
        assert_eq!(round([(200, 220), (250, 200)]).1, LargeReads::Sendfile);
    }

    #[test]
    fn at_the_same_speed_the_cheaper_way_is_chosen() {
        assert_eq!(round([(250, 200), (250, 150)]).1, LargeReads::Mapped);
        assert_eq!(round([(250, 150), (250, 200)]).1, LargeReads::Sendfile);
    }

    #[test]
    fn a_tie_keeps_sendfile() {
        assert_eq!(round([(250, 200), (245, 195)]).1, LargeReads::Sendfile);
    }

    #[test]
    fn a_trial_counts_long_and_many_enough() {
        let mut t = SendfileTrial::default();
        let (mut now, mut cpu) = (Instant::now(), Duration::ZERO);
        let settle = (SETTLE_BYTES as usize) / MIB;
        // A read every 100 us: TRIAL_BYTES take 3.2 ms, so TRIAL (30 ms) decides: the trial
        // ends at the read that starts TRIAL after counting began.
        let every = Duration::from_micros(100);
        let reads = run(&mut t, &mut now, &mut cpu, every, every, 10_000);
        assert_eq!(reads, settle + (TRIAL.as_micros() / 100) as usize);
        // A read every 2 ms: TRIAL takes 15 reads, so TRIAL_BYTES decide: counted when the
        // next read starts.
        let mut t = SendfileTrial::default();
        let every = Duration::from_millis(2);
        let reads = run(&mut t, &mut now, &mut cpu, every, every, 10_000);
        assert_eq!(reads, settle + (TRIAL_BYTES as usize) / MIB + 1);
    }

    #[test]
    fn a_gap_voids_the_trial_under_way() {
        let mut t = SendfileTrial::default();
        let (mut now, mut cpu) = (Instant::now(), Duration::ZERO);
        let every = Duration::from_micros(1000);
        run(&mut t, &mut now, &mut cpu, every, every, 20);
        now += GAP_MAX * 2;
        t.count(now, MIB, || cpu);
        assert!(matches!(
            t.phase,
            Phase::Trial {
                way: LargeReads::Sendfile,
                seen,
                counting: None,
            } if seen == MIB as u64
        ));
    }

    #[test]
    fn a_choice_is_kept_longer_each_time_it_is_made_again() {
        let (mut t, chosen) = round([(250, 200), (250, 150)]);
        assert_eq!(chosen, LargeReads::Mapped);
        let Phase::Keep { until, .. } = t.phase else {
            panic!("kept");
        };
        // Reads while it is kept go the chosen way, until it ends: then sendfile's trial.
        let mut now = until - Duration::from_millis(5);
        for _ in 0..4 {
            now += Duration::from_millis(1);
            t.count(now, MIB, || Duration::ZERO);
            assert_eq!(t.current(), LargeReads::Mapped);
        }
        now = until;
        t.count(now, MIB, || Duration::ZERO);
        assert_eq!(t.current(), LargeReads::Sendfile);
        assert_eq!(t.streak, 0);
        let (mut now, mut cpu) = (now, Duration::ZERO);
        for (every, cost) in [(250, 200), (250, 150)] {
            let (every, cost) = (Duration::from_micros(every), Duration::from_micros(cost));
            run(&mut t, &mut now, &mut cpu, every, cost, 10_000);
        }
        assert_eq!(t.current(), LargeReads::Mapped);
        assert_eq!(t.streak, 1);
        let Phase::Keep { until, .. } = t.phase else {
            panic!("kept");
        };
        assert_eq!(until - now, KEEP * 2);
    }
}
