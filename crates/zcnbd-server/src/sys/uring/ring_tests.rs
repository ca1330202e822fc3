use std::time::Instant;

use rustix::event::{eventfd, EventfdFlags};

use super::*;

fn ring(tick: Duration) -> (Ring, Arc<OwnedFd>) {
    let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).unwrap());
    let stats = Arc::new(Stats::default());
    let mut ring = Ring::new(64, 0, tick, Arc::clone(&wake), stats).unwrap();
    ring.arm().unwrap();
    (ring, wake)
}

/// One coalesced wait for four completions or 20 us on `ring`: how long it took and what it
/// reaped (`None`: this kernel cannot coalesce).
fn coalesced_wait(ring: &mut Ring) -> Option<(Duration, Vec<Reaped>)> {
    if !ring.can_coalesce() {
        eprintln!("skipped: this kernel lacks IORING_FEAT_MIN_TIMEOUT");
        return None;
    }
    let start = Instant::now();
    ring.submit_and_wait_coalesced(4, Duration::from_micros(20))
        .unwrap();
    let waited = start.elapsed();
    let mut reaped = Vec::new();
    ring.reap(&mut reaped);
    Some((waited, reaped))
}

#[test]
fn a_coalesced_wait_ends_with_one_completion_once_its_time_has_passed() {
    let (mut ring, wake) = ring(Duration::from_secs(1));
    rustix::io::write(wake.as_ref(), &1u64.to_ne_bytes()).unwrap();
    // Four asked for, one there (the mailbox's read): the wait ends after 20 us, not after
    // the timer's ticks bring more.
    let Some((waited, reaped)) = coalesced_wait(&mut ring) else {
        return;
    };
    assert_eq!(reaped, [Reaped::Woken]);
    assert!(waited < Duration::from_millis(500), "waited {waited:?}");
}

#[test]
fn a_coalesced_wait_with_nothing_there_sleeps_until_the_first_completion() {
    let (mut ring, _wake) = ring(Duration::from_millis(30));
    let Some((waited, reaped)) = coalesced_wait(&mut ring) else {
        return;
    };
    assert_eq!(reaped, [Reaped::Ticked]);
    assert!(waited >= Duration::from_millis(25), "waited {waited:?}");
    assert!(waited < Duration::from_millis(500), "waited {waited:?}");
}
