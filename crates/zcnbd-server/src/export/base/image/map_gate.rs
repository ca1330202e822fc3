//! A map question never waits (the engines ask on their ring threads, where a wait stalls
//! every connection of the ring). imago's lookup of a mapping takes locks that its other
//! operations hold across disk I/O (the L1 table's while a new L2 table is written, the L2
//! cache's while a table is loaded or written back, the cache order's while a cache is
//! flushed), and loads an L2 table from the file when it is not cached. So:
//!
//! - [`MapGate`]: a map enters only while no other imago operation of the image runs, and
//!   answers "not mappable now" (the request goes through the dispatcher) otherwise; an
//!   operation announces itself first, so no new map enters, and waits only for the maps
//!   already in (in-memory lookups, microseconds).
//! - [`Warm`]: a map is answered only for guest ranges whose L2 tables are certainly in
//!   imago's cache, which keeps the [`L2_CACHE_TABLES`] most recently used: every imago
//!   access goes through the image backend, which notes the L2 regions (the guest bytes one
//!   L2 table covers) it touched in [`WARM_SLOTS`] slots, a region taking a slot only when it
//!   has none. A region in a slot was used when it took it, and since then at most
//!   `WARM_SLOTS - 1` other regions took slots and at most `WARM_SLOTS - 1` held one: fewer
//!   than `L2_CACHE_TABLES` distinct tables were used after it, so it is still cached.
//!   (A backing file with smaller clusters than the image has more, smaller tables per
//!   region: its lookups may still read a table.)

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// L2 tables imago's cache keeps (imago 0.2.6: `MetadataCaches::new(.., 128, ..)`).
pub const L2_CACHE_TABLES: usize = 128;
/// Regions [`Warm`] remembers: `2 * WARM_SLOTS - 1` < [`L2_CACHE_TABLES`].
pub const WARM_SLOTS: usize = 48;

const _: () = assert!(2 * WARM_SLOTS - 1 < L2_CACHE_TABLES);

const OP: u64 = 1 << 32;
const MAPS: u64 = OP - 1;

/// Maps in (low 32 bits) and operations in or waiting (high bits).
#[derive(Debug, Default)]
pub struct MapGate(AtomicU64);

/// A map inside the gate.
pub struct MapPass<'a>(&'a MapGate);

/// An imago operation inside the gate.
pub struct OpPass<'a>(&'a MapGate);

impl MapGate {
    /// Enters for a map, unless an operation is in or waiting (then `None`: never waits).
    pub fn try_map(&self) -> Option<MapPass<'_>> {
        let before = self.0.fetch_add(1, Ordering::AcqRel);
        if before >= OP {
            self.0.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(MapPass(self))
    }

    /// Enters for an operation: no map enters from now on, and the ones in leave.
    pub fn op(&self) -> OpPass<'_> {
        self.0.fetch_add(OP, Ordering::AcqRel);
        while self.0.load(Ordering::Acquire) & MAPS != 0 {
            std::thread::yield_now();
        }
        OpPass(self)
    }
}

impl Drop for MapPass<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for OpPass<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(OP, Ordering::AcqRel);
    }
}

/// The L2 regions used most recently (see the module's documentation).
#[derive(Debug)]
pub struct Warm {
    /// Guest bytes one L2 table covers (0: the format has no tables to load).
    region_bytes: u64,
    /// Region index + 1 (0: empty).
    slots: [AtomicU64; WARM_SLOTS],
    hand: AtomicUsize,
}

impl Warm {
    /// For an image whose L2 tables each cover `region_bytes` (0: every range is warm).
    pub fn new(region_bytes: u64) -> Warm {
        Warm {
            region_bytes,
            slots: std::array::from_fn(|_| AtomicU64::new(0)),
            hand: AtomicUsize::new(0),
        }
    }

    fn regions(&self, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        let last = offset.saturating_add(len.max(1) - 1);
        offset / self.region_bytes..=last / self.region_bytes
    }

    fn holds(&self, region: u64) -> bool {
        self.slots
            .iter()
            .any(|s| s.load(Ordering::Acquire) == region + 1)
    }

    /// Notes that `[offset, offset+len)` was used through imago (its tables are cached).
    pub fn touch(&self, offset: u64, len: u64) {
        if self.region_bytes == 0 {
            return;
        }
        for region in self.regions(offset, len).take(WARM_SLOTS) {
            if !self.holds(region) {
                let at = self.hand.fetch_add(1, Ordering::AcqRel) % WARM_SLOTS;
                self.slots[at].store(region + 1, Ordering::Release);
            }
        }
    }

    /// Whether the tables of `[offset, offset+len)` are certainly cached.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        self.region_bytes == 0 || self.regions(offset, len).all(|r| self.holds(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_never_wait_and_operations_wait_only_for_maps_in() {
        let gate = MapGate::default();
        let map = gate.try_map().unwrap();
        std::thread::scope(|s| {
            let op = s.spawn(|| {
                let _op = gate.op();
                // Announced: no map enters while it waits or runs.
                std::thread::sleep(std::time::Duration::from_millis(20));
            });
            while gate.0.load(Ordering::Acquire) < OP {
                std::thread::yield_now();
            }
            assert!(
                gate.try_map().is_none(),
                "a map entered beside an operation"
            );
            drop(map);
            op.join().unwrap();
        });
        assert!(gate.try_map().is_some(), "the gate opens again");
    }

    #[test]
    fn only_recently_used_regions_are_warm() {
        let warm = Warm::new(1 << 20);
        assert!(!warm.covers(0, 4096));
        warm.touch(0, 4096);
        assert!(warm.covers(100, 4096));
        assert!(
            !warm.covers((1 << 20) - 1, 2),
            "a range reaching a cold region"
        );
        for r in 1..=WARM_SLOTS as u64 {
            warm.touch(r << 20, 1);
        }
        assert!(!warm.covers(0, 1), "pushed out by WARM_SLOTS newer regions");
        assert!(Warm::new(0).covers(0, u64::MAX));
    }
}
