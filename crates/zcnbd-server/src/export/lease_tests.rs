use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use super::*;

const CLUSTER: u64 = 65536;

/// A change of `[offset, offset+len)` asked for now; the receiver gets it when it starts.
fn ask(leases: &Arc<Leases>, offset: u64, len: u64) -> mpsc::Receiver<Change> {
    let (tx, rx) = mpsc::channel();
    leases.when_changeable(offset, len, move |c| {
        let _ = tx.send(c);
    });
    rx
}

fn started(rx: &mpsc::Receiver<Change>) -> Option<Change> {
    rx.try_recv().ok()
}

#[test]
fn a_change_waits_for_an_overlapping_lease_and_starts_when_it_ends() {
    let leases = Leases::new(CLUSTER);
    let lease = leases.lease(CLUSTER, 4096).expect("nothing in the way");
    let rx = ask(&leases, CLUSTER + 8192, 4096);
    assert!(started(&rx).is_none(), "same cluster: the change waits");
    drop(lease);
    assert!(started(&rx).is_some(), "started by the lease's end");
}

#[test]
fn ranges_in_other_clusters_do_not_wait() {
    let leases = Leases::new(CLUSTER);
    let _lease = leases.lease(0, CLUSTER).expect("free");
    let rx = ask(&leases, CLUSTER, CLUSTER);
    assert!(started(&rx).is_some());
    assert!(leases.lease(2 * CLUSTER, 1).is_some());
}

#[test]
fn no_lease_while_a_change_runs_or_waits() {
    let leases = Leases::new(CLUSTER);
    let first = leases.lease(0, 10).expect("free");
    let waiting = ask(&leases, 0, 10);
    // A waiting change is not overtaken by new leases (no starvation).
    assert!(leases.lease(5, 10).is_none());
    drop(first);
    let change = started(&waiting).expect("started");
    assert!(leases.lease(5, 10).is_none(), "the change runs");
    drop(change);
    assert!(leases.lease(5, 10).is_some());
}

#[test]
fn overlapping_changes_run_one_at_a_time_in_order() {
    let leases = Leases::new(4096);
    let a = ask(&leases, 0, 8192);
    let b = ask(&leases, 4096, 4096);
    let c = ask(&leases, 100_000, 1);
    let a = started(&a).expect("first");
    assert!(started(&b).is_none());
    assert!(started(&c).is_some(), "apart: runs at once");
    drop(a);
    assert!(started(&b).is_some());
}

#[test]
fn a_later_change_never_overtakes_an_earlier_overlapping_one() {
    let leases = Leases::new(4096);
    let lease = leases.lease(0, 4096).expect("free");
    let first = ask(&leases, 0, 8192);
    let lease2 = leases.lease(8192, 4096).expect("apart from the waiter");
    let second = ask(&leases, 4096, 8192);
    drop(lease);
    let first = started(&first).expect("nothing in its way now");
    assert!(started(&second).is_none());
    drop(first);
    assert!(started(&second).is_none(), "lease2 is still in its way");
    drop(lease2);
    assert!(started(&second).is_some());
}

#[test]
fn inside_a_change_the_stack_registers_its_own_at_once() {
    let leases = Leases::new(4096);
    let outer = started(&ask(&leases, 0, 8192)).expect("free");
    let inner = outer.enter(|| leases.change(4096, 100));
    drop(inner);
    // Outside `enter` the same call would wait; another range does not.
    let apart = leases.change(1 << 20, 1);
    drop(apart);
    drop(outer);
    drop(leases.change(0, 1));
}

#[test]
fn a_blocking_change_waits_for_a_lease_another_thread_ends() {
    let leases = Leases::new(4096);
    let lease = leases.lease(0, 4096).expect("free");
    let waiter = {
        let leases = Arc::clone(&leases);
        std::thread::spawn(move || {
            let change = leases.change(0, 1);
            assert!(!leases.leased(0, 1));
            drop(change);
        })
    };
    std::thread::sleep(Duration::from_millis(30));
    assert!(!waiter.is_finished());
    drop(lease);
    waiter.join().unwrap();
}

#[derive(Debug, Default)]
struct Told(AtomicUsize);

impl Backend for Told {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn capabilities(&self) -> crate::export::Capabilities {
        crate::export::Capabilities::default()
    }
    fn pread(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn pwrite(&self, _: &[u8], _: u64, _: bool) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> std::io::Result<()> {
        Ok(())
    }
    fn zero(
        &self,
        _: u64,
        _: u64,
        _: crate::export::ZeroFlags,
    ) -> Result<(), crate::export::ZeroError> {
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn extents(
        &self,
        _: u64,
        _: u64,
        _: usize,
        _: &mut Vec<zcnbd_proto::Extent>,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn wrote_in_place(&self, offset: u64, len: u64) {
        assert_eq!((offset, len), (4096, 100));
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_write_lease_tells_the_layers_when_it_ends_whatever_happened() {
    let told = Arc::new(Told::default());
    let leases = Leases::new(4096);
    let top: Arc<dyn Backend> = told.clone();
    let lease = Lease::new(leases.lease(4096, 100), Some(top), 4096, 100);
    assert!(lease.covers(4096, 100) && lease.covers(4100, 10));
    assert!(!lease.covers(0, 4096) && !lease.covers(4096, 101));
    assert_eq!(told.0.load(Ordering::SeqCst), 0);
    drop(lease);
    assert_eq!(told.0.load(Ordering::SeqCst), 1);
    assert!(!leases.leased(4096, 100));
}

#[test]
fn a_tried_change_is_refused_while_a_lease_or_change_overlaps_and_never_waits() {
    let leases = Leases::new(CLUSTER);
    let lease = leases.lease(0, 4096).expect("free");
    assert!(leases.try_change(100, 1).is_none(), "the leased cluster");
    let other = leases.try_change(CLUSTER, 1).expect("another cluster");
    assert!(
        leases.lease(CLUSTER, 1).is_none(),
        "a tried change maps nothing"
    );
    assert!(
        leases.try_change(CLUSTER, CLUSTER).is_none(),
        "changes exclude each other"
    );
    drop(lease);
    let first = leases.try_change(0, 1).expect("the lease ended");
    // Inside a change that covers it, at once.
    first.enter(|| assert!(leases.try_change(10, 10).is_some()));
    drop((first, other));
    assert!(leases.lease(0, 2 * CLUSTER).is_some());
}
