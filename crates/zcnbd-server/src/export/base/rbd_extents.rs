//! librbd's extents (`rbd_diff_iterate2`'s pieces, whole objects or exact, in order or not)
//! as NBD block status: clipped to the question, merged, bounded, the gaps between them
//! flagged apart. Shared by allocation (`rbd.rs`) and changes since a snapshot
//! (`rbd_snapshots.rs`).

use std::io;

use zcnbd_proto::Extent;

/// Appends up to `extents_max` extents of `[offset, offset+len)` from what `runs` reports
/// (librbd's pieces: clipped to the range, merged, flagged `run`; the gaps between them
/// flagged `gap`). `runs` calls its visitor for each piece until the visitor says enough.
pub(super) fn runs_as_extents(
    offset: u64,
    len: u64,
    extents_max: usize,
    runs: impl FnOnce(&mut dyn FnMut(u64, u64) -> bool) -> io::Result<()>,
    run: u32,
    gap: u32,
    out: &mut Vec<Extent>,
) -> io::Result<()> {
    let end = offset.saturating_add(len);
    let max = extents_max.max(1);
    let mut found = Allocated::default();
    runs(&mut |at, n| {
        // whole_object reports whole objects: clip to the question.
        let (start, stop) = (at.max(offset), at.saturating_add(n).min(end));
        if start < stop {
            found.add(start, stop);
        }
        found.sorted_runs() <= max
    })?;
    let first = out.len();
    let mut at = offset;
    let push = |out: &mut Vec<Extent>, length, flags| out.push(Extent { length, flags });
    for (start, stop) in found.into_runs() {
        if start > at {
            push(out, start - at, gap);
        }
        push(out, stop - start, run);
        at = stop;
        if out.len() - first >= max {
            break;
        }
    }
    if at < end && out.len() - first < max {
        push(out, end - at, gap);
    }
    out.truncate(first + max);
    Ok(())
}

/// Allocated ranges as librbd reports them: in order (then merged as they come), or not (then
/// sorted and merged at the end).
#[derive(Debug, Default)]
struct Allocated {
    runs: Vec<(u64, u64)>,
    unordered: bool,
}

impl Allocated {
    fn add(&mut self, start: u64, stop: u64) {
        match self.runs.last_mut() {
            Some(last) if last.1 == start => last.1 = stop,
            Some(last) if last.1 > start => {
                self.unordered = true;
                self.runs.push((start, stop));
            }
            _ => self.runs.push((start, stop)),
        }
    }

    /// How many runs are known final (none while out of order).
    fn sorted_runs(&self) -> usize {
        if self.unordered {
            0
        } else {
            self.runs.len()
        }
    }

    fn into_runs(mut self) -> Vec<(u64, u64)> {
        if !self.unordered {
            return self.runs;
        }
        self.runs.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.runs.len());
        for (start, stop) in self.runs {
            match merged.last_mut() {
                Some(last) if last.1 >= start => last.1 = last.1.max(stop),
                _ => merged.push((start, stop)),
            }
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_become_extents_with_gaps_flagged_and_a_bound() {
        let pieces = [(8u64, 4u64), (0, 2), (20, 100)];
        let runs = |visit: &mut dyn FnMut(u64, u64) -> bool| {
            for (at, n) in pieces {
                if !visit(at, n) {
                    break;
                }
            }
            Ok(())
        };
        let mut out = Vec::new();
        runs_as_extents(1, 30, 10, runs, 1, 7, &mut out).unwrap();
        let got: Vec<(u64, u32)> = out.iter().map(|e| (e.length, e.flags)).collect();
        assert_eq!(got, [(1, 1), (6, 7), (4, 1), (8, 7), (11, 1)]);
        let mut out = Vec::new();
        runs_as_extents(1, 30, 2, runs, 1, 7, &mut out).unwrap();
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn allocated_runs_merge_in_order_and_out_of_order() {
        let mut a = Allocated::default();
        a.add(0, 4);
        a.add(4, 8);
        a.add(12, 16);
        assert_eq!(a.sorted_runs(), 2);
        assert_eq!(a.into_runs(), vec![(0, 8), (12, 16)]);
        let mut b = Allocated::default();
        b.add(12, 16);
        b.add(0, 4);
        b.add(4, 12);
        assert_eq!(b.sorted_runs(), 0);
        assert_eq!(b.into_runs(), vec![(0, 16)]);
    }
}
