use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// A ring thread's turns while its client pipelines.
const STEP: Duration = Duration::from_micros(500);

/// A ring thread's clock and CPU time, driving trials.
struct Sim {
    t: WaitTrial,
    now: Instant,
    cpu: Duration,
}

impl Sim {
    fn new(can_coalesce: bool) -> Sim {
        Sim::with(can_coalesce, false)
    }

    fn with(can_coalesce: bool, can_overlap: bool) -> Sim {
        let now = Instant::now();
        Sim {
            t: WaitTrial::new(now, can_coalesce, can_overlap),
            now,
            cpu: Duration::ZERO,
        }
    }

    fn wait(&mut self) -> Wait {
        let cpu = self.cpu;
        self.t.next(self.now, true, || cpu)
    }

    /// Moves time on by `d` in turns of [`STEP`], asking how to wait at each; what the last
    /// turn answered (the ones before must answer `same`).
    fn run(&mut self, d: Duration, same: Wait) -> Wait {
        let turns = d.as_micros() / STEP.as_micros();
        for turn in 1..=turns {
            self.now += STEP;
            let wait = self.wait();
            if turn == turns {
                return wait;
            }
            assert_eq!(wait, same, "turn {turn} of {turns}");
        }
        same
    }

    /// Runs the current trial to its end: it settles, then moves `requests` for `cpu_each`
    /// of CPU each over [`TRIAL`]. Returns how it waited and what comes next.
    fn trial(&mut self, requests: u64, cpu_each: Duration) -> (Wait, Wait) {
        let trying = self.wait();
        // Requests during the settling time are not counted.
        self.t.count(1_000_000);
        assert_eq!(self.run(SETTLE, trying), trying, "counting starts");
        self.t.count(requests);
        self.cpu += cpu_each * requests as u32;
        (trying, self.run(TRIAL, trying))
    }

    /// A whole round: sleeping, polling and coalescing trials at these rates (requests per
    /// trial) and CPU per request; the choice.
    fn round(&mut self, slept: (u64, u64), polled: u64, coalesced: (u64, u64)) -> Wait {
        assert_eq!(self.trial(slept.0, us(slept.1)), (Wait::Sleep, Wait::Poll));
        assert_eq!(self.trial(polled, us(slept.1)).0, Wait::Poll);
        let (tried, chosen) = self.trial(coalesced.0, us(coalesced.1));
        assert_eq!(tried, Wait::Coalesce);
        chosen
    }
}

#[test]
fn polling_that_moves_clearly_more_requests_is_chosen_and_kept() {
    let mut s = Sim::new(true);
    assert_eq!(s.round((2700, 6), 5300, (2700, 6)), Wait::Poll);
    assert_eq!(s.run(KEEP - ms(1), Wait::Poll), Wait::Poll);
    assert_eq!(
        s.run(ms(1), Wait::Poll),
        Wait::Sleep,
        "kept long enough: a new round"
    );
}

#[test]
fn polling_that_buys_little_is_not_chosen() {
    let mut s = Sim::new(true);
    assert_eq!(s.round((2400, 6), 2900, (1500, 6)), Wait::Sleep, "1.21x");
}

#[test]
fn coalescing_that_moves_clearly_more_requests_is_chosen_whatever_its_cpu() {
    let mut s = Sim::new(true);
    assert_eq!(s.round((2500, 5), 2500, (2800, 7)), Wait::Sleep, "1.12x");
    let mut s = Sim::new(true);
    assert_eq!(s.round((2500, 5), 2500, (3200, 7)), Wait::Coalesce, "1.28x");
}

#[test]
fn of_two_ways_that_move_clearly_more_the_faster_is_chosen() {
    let mut s = Sim::new(true);
    assert_eq!(s.round((2000, 6), 3000, (3500, 6)), Wait::Coalesce);
    let mut s = Sim::new(true);
    assert_eq!(s.round((2000, 6), 3600, (3500, 3)), Wait::Poll);
}

#[test]
fn coalescing_at_the_same_rate_for_less_cpu_is_chosen() {
    let mut s = Sim::new(true);
    // fio at iodepth 16 over TCP: 124k against 119k a second, 3.9 against 6.0 us a request.
    assert_eq!(s.round((2380, 6), 2380, (2440, 4)), Wait::Coalesce);
    // Within the noise of the rate, and 0.85x the CPU.
    let mut s = Sim::new(true);
    assert_eq!(s.round((2400, 20), 2400, (2290, 16)), Wait::Coalesce);
}

#[test]
fn coalescing_that_starves_the_client_is_not_chosen() {
    // fio at iodepth 4: 0.70x the IOPS, for more CPU per request.
    let mut s = Sim::new(true);
    assert_eq!(s.round((1810, 6), 1810, (1270, 10)), Wait::Sleep);
    // Even at half the CPU per request, 0.8x the rate is too little (fio at iodepth 8)...
    let mut s = Sim::new(true);
    assert_eq!(s.round((2000, 6), 2000, (1600, 3)), Wait::Sleep);
    // ... and 0.9x is too little for 0.7x the CPU.
    let mut s = Sim::new(true);
    assert_eq!(s.round((2000, 10), 2000, (1800, 7)), Wait::Sleep);
}

#[test]
fn coalescing_that_saves_much_cpu_is_chosen_within_the_noise_of_the_rate() {
    // fio at iodepth 16, one round: 0.85x sleeping's rate at 0.5x its CPU per request.
    let mut s = Sim::new(true);
    assert_eq!(s.round((2900, 6), 2900, (2480, 3)), Wait::Coalesce);
}

#[test]
fn coalescing_that_saves_little_cpu_is_not_chosen() {
    // fio at iodepth 2: 1.09x the IOPS at 1.2x the CPU per request.
    let mut s = Sim::new(true);
    assert_eq!(s.round((680, 11), 680, (750, 13)), Wait::Sleep);
    let mut s = Sim::new(true);
    assert_eq!(s.round((2000, 40), 2000, (2000, 39)), Wait::Sleep, "0.975x");
}

#[test]
fn without_coalescing_a_round_is_two_trials() {
    let mut s = Sim::new(false);
    assert_eq!(s.trial(2400, us(6)), (Wait::Sleep, Wait::Poll));
    assert_eq!(s.trial(2400, us(1)), (Wait::Poll, Wait::Sleep));
    let mut s = Sim::new(false);
    assert_eq!(s.trial(2400, us(6)), (Wait::Sleep, Wait::Poll));
    assert_eq!(s.trial(4000, us(6)), (Wait::Poll, Wait::Poll));
}

#[test]
fn the_same_choice_in_a_row_is_kept_twice_as_long_up_to_a_limit() {
    let mut s = Sim::new(true);
    let mut kept = Vec::new();
    for _ in 0..5 {
        assert_eq!(s.round((2400, 6), 2400, (2400, 3)), Wait::Coalesce);
        let Phase::Keep { until, .. } = s.t.phase else {
            panic!("a choice is kept: {:?}", s.t.phase);
        };
        kept.push(until - s.now);
        assert_eq!(s.run(until - s.now - ms(1), Wait::Coalesce), Wait::Coalesce);
        assert_eq!(s.run(ms(1), Wait::Coalesce), Wait::Sleep, "a new round");
    }
    assert_eq!(kept, [KEEP, KEEP * 2, KEEP * 4, KEEP * 8, KEEP * 8]);
    // Another choice starts from KEEP again.
    assert_eq!(s.round((2400, 6), 2400, (2400, 6)), Wait::Sleep);
    assert_eq!(s.t.streak, 0);
}

#[test]
fn an_idle_turn_starts_the_round_again() {
    let mut s = Sim::new(true);
    assert_eq!(s.trial(2400, us(6)).1, Wait::Poll);
    assert_eq!(s.run(ms(5), Wait::Poll), Wait::Poll);
    // The client went quiet for a while: nothing it did then is counted.
    s.now += TURN_MAX + us(1);
    assert_eq!(s.wait(), Wait::Sleep, "the sleeping trial again");
    assert_eq!(s.trial(2400, us(6)), (Wait::Sleep, Wait::Poll));
    // A chosen way of waiting is kept through idle turns...
    assert_eq!(s.trial(2400, us(6)).1, Wait::Coalesce);
    assert_eq!(s.trial(2400, us(3)).1, Wait::Coalesce);
    s.now += KEEP_IDLE_MAX;
    assert_eq!(s.wait(), Wait::Coalesce);
    // ... but not through a longer quiet spell: the trials start again.
    s.now += KEEP_IDLE_MAX + us(1);
    assert_eq!(s.wait(), Wait::Sleep, "the sleeping trial again");
    assert_eq!(s.trial(2400, us(6)), (Wait::Sleep, Wait::Poll));
}

#[test]
fn a_thread_busy_between_its_waits_for_clients_is_not_idle() {
    let mut s = Sim::new(true);
    assert_eq!(s.run(SETTLE, Wait::Sleep), Wait::Sleep);
    // 5 ms between two waits for the client, the thread busy all along (waiting for its
    // sends): the trial goes on.
    for _ in 0..10 {
        s.now += STEP;
        s.t.busy(s.now);
    }
    s.t.count(2400);
    s.now += STEP;
    assert_eq!(s.wait(), Wait::Sleep);
    assert_eq!(
        s.run(TRIAL - ms(5) - STEP, Wait::Sleep),
        Wait::Poll,
        "the trial ran its length"
    );
}

#[test]
fn a_trial_without_requests_chooses_sleeping() {
    let mut s = Sim::new(true);
    assert_eq!(s.round((0, 6), 0, (0, 6)), Wait::Sleep);
}

#[test]
fn a_client_that_stops_pipelining_restarts_the_trials() {
    let mut s = Sim::new(true);
    assert_eq!(s.run(SETTLE + ms(5), Wait::Sleep), Wait::Sleep);
    s.now += STEP;
    assert_eq!(s.t.next(s.now, false, || unreachable!()), Wait::Sleep);
    s.t.count(100_000);
    assert_eq!(s.wait(), Wait::Sleep, "a fresh sleeping trial");
    assert_eq!(
        s.run(SETTLE, Wait::Sleep),
        Wait::Sleep,
        "settled: counting starts"
    );
    assert_eq!(
        s.run(TRIAL - STEP, Wait::Sleep),
        Wait::Sleep,
        "not yet its length"
    );
    s.t.count(2000);
    assert_eq!(
        s.run(STEP, Wait::Sleep),
        Wait::Poll,
        "the polling trial next"
    );
}

#[test]
fn polling_goes_on_while_it_catches_requests_one_at_a_time() {
    let mut s = Sim::new(true);
    assert_eq!(s.trial(2000, us(6)).1, Wait::Poll);
    // Polled, a pipelining client's requests come one per wake: not a reason to stop.
    assert_eq!(s.t.next(s.now, false, || us(0)), Wait::Poll);
    assert_eq!(s.trial(3000, us(6)), (Wait::Poll, Wait::Coalesce));
    assert_eq!(s.trial(2000, us(6)).1, Wait::Poll, "chosen");
    s.now += STEP;
    assert_eq!(s.t.next(s.now, false, || us(0)), Wait::Poll, "and kept");
    // Nor the coalescing trial after it, which starts with polling's one-request wakes
    // behind it; a kept coalescing is ended by a client seen not pipelining.
    let mut s = Sim::new(true);
    s.trial(2000, us(6));
    s.trial(2000, us(6));
    assert_eq!(s.wait(), Wait::Coalesce);
    assert_eq!(s.t.next(s.now, false, || us(0)), Wait::Coalesce);
    assert_eq!(s.trial(2000, us(3)).1, Wait::Coalesce, "chosen");
    s.now += STEP;
    assert_eq!(s.t.next(s.now, false, || us(0)), Wait::Sleep);
}

#[test]
fn cpu_time_is_asked_for_only_at_a_trials_start_and_end() {
    let mut s = Sim::new(true);
    let asked = std::cell::Cell::new(0);
    let turns = |s: &mut Sim, d: Duration| {
        for _ in 0..d.as_micros() / 50 {
            s.now += us(50);
            s.t.next(s.now, true, || {
                asked.set(asked.get() + 1);
                Duration::ZERO
            });
        }
    };
    turns(&mut s, SETTLE);
    assert_eq!(asked.get(), 1, "once: counting starts");
    turns(&mut s, TRIAL - us(50));
    assert_eq!(asked.get(), 1);
    s.t.count(10);
    turns(&mut s, us(50));
    assert_eq!(asked.get(), 2, "and once at the end");
}

/// A portable reader's round: sleeping, polling, coalescing (if it may) and overlapping.
fn overlap_round(s: &mut Sim, coalesces: bool, slept: u64, overlapped: (u64, u64)) -> Wait {
    assert_eq!(s.trial(slept, us(4)), (Wait::Sleep, Wait::Poll));
    let after_polling = if coalesces {
        Wait::Coalesce
    } else {
        Wait::Overlap
    };
    assert_eq!(s.trial(slept, us(5)), (Wait::Poll, after_polling));
    if coalesces {
        assert_eq!(s.trial(slept, us(4)), (Wait::Coalesce, Wait::Overlap));
    }
    let (tried, chosen) = s.trial(overlapped.0, us(overlapped.1));
    assert_eq!(tried, Wait::Overlap);
    chosen
}

#[test]
fn overlapping_that_moves_clearly_more_requests_is_chosen_and_kept() {
    // `zcnbd bench` TLS writes at iodepth 16: 140k a second sleeping, 290k overlapping.
    let mut s = Sim::with(true, true);
    assert_eq!(overlap_round(&mut s, true, 2800, (5800, 3)), Wait::Overlap);
    s.now += STEP;
    // It polls: requests caught one per wake do not end it.
    assert_eq!(s.t.next(s.now, false, || us(0)), Wait::Overlap, "kept");
    assert_eq!(
        s.run(KEEP - ms(1) - STEP, Wait::Overlap),
        Wait::Overlap,
        "kept"
    );
    // Without coalescing (`--coalesce-max-us 0`) it is still tried.
    let mut s = Sim::with(false, true);
    assert_eq!(overlap_round(&mut s, false, 2800, (5800, 3)), Wait::Overlap);
}

#[test]
fn overlapping_that_buys_little_or_costs_the_client_requests_is_not_chosen() {
    // fio (libnbd) TLS writes at iodepth 16: its client, not the server, is the limit, and
    // more, smaller replies cost it more.
    let mut s = Sim::with(true, true);
    assert_eq!(overlap_round(&mut s, true, 1400, (1480, 10)), Wait::Sleep);
    // Not chosen for its CPU either: only coalescing is.
    let mut s = Sim::with(true, true);
    assert_eq!(overlap_round(&mut s, true, 1400, (1400, 1)), Wait::Sleep);
}
