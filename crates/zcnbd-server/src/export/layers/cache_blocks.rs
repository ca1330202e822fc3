//! The cache layer's table of blocks: which blocks of the export the cache file holds,
//! whether each is clean (the same as the stack below) or dirty (newer, not yet written
//! back), and which were used lately, for choosing what to evict (second chance: a block
//! used since the last sweep is passed over once).

use std::collections::HashMap;

#[derive(Debug, Clone, Copy)]
struct Entry {
    dirty: bool,
    referenced: bool,
}

/// Cached blocks by number.
#[derive(Debug, Default)]
pub struct Blocks {
    map: HashMap<u64, Entry>,
    dirty: usize,
}

/// What the cache holds of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    Clean,
    Dirty,
}

impl Blocks {
    /// What the cache holds of block `n` (marking it used).
    pub fn get(&mut self, n: u64) -> Option<Held> {
        let entry = self.map.get_mut(&n)?;
        entry.referenced = true;
        Some(match entry.dirty {
            true => Held::Dirty,
            false => Held::Clean,
        })
    }

    /// Whether block `n` is held (without marking it used).
    pub fn holds(&self, n: u64) -> bool {
        self.map.contains_key(&n)
    }

    /// Whether block `n` is dirty (without marking it used).
    pub fn is_dirty(&self, n: u64) -> bool {
        self.map.get(&n).is_some_and(|e| e.dirty)
    }

    /// Block `n` is held, as `held`.
    pub fn set(&mut self, n: u64, held: Held) {
        let dirty = held == Held::Dirty;
        let old = self.map.insert(
            n,
            Entry {
                dirty,
                referenced: true,
            },
        );
        self.dirty = self.dirty + usize::from(dirty) - usize::from(old.is_some_and(|e| e.dirty));
    }

    /// Block `n` is no longer held.
    pub fn remove(&mut self, n: u64) {
        if let Some(old) = self.map.remove(&n) {
            self.dirty -= usize::from(old.dirty);
        }
    }

    /// How many blocks are held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// How many of them are dirty.
    pub fn dirty_count(&self) -> usize {
        self.dirty
    }

    /// The dirty blocks, in order.
    pub fn dirty_blocks(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .map
            .iter()
            .filter(|(_, e)| e.dirty)
            .map(|(n, _)| *n)
            .collect();
        out.sort_unstable();
        out
    }

    /// The dirty blocks among `first..=last`, in order.
    pub fn dirty_between(&self, first: u64, last: u64) -> Vec<u64> {
        if last - first < self.map.len() as u64 {
            return (first..=last).filter(|n| self.is_dirty(*n)).collect();
        }
        let mut out: Vec<u64> = self
            .map
            .iter()
            .filter(|(n, e)| e.dirty && (first..=last).contains(*n))
            .map(|(n, _)| *n)
            .collect();
        out.sort_unstable();
        out
    }

    /// The held blocks among `first..=last`, in order.
    pub fn held_between(&self, first: u64, last: u64) -> Vec<u64> {
        if last - first < self.map.len() as u64 {
            return (first..=last)
                .filter(|n| self.map.contains_key(n))
                .collect();
        }
        let mut out: Vec<u64> = self
            .map
            .keys()
            .filter(|n| (first..=last).contains(*n))
            .copied()
            .collect();
        out.sort_unstable();
        out
    }

    /// Up to `count` blocks to evict: clean ones not used since the last sweep first (the
    /// sweep clears the marks of those it passes over), then any clean ones, then - if
    /// `dirty_too` - dirty ones (to be written back first).
    pub fn victims(&mut self, count: usize, dirty_too: bool) -> Vec<u64> {
        let mut out = Vec::with_capacity(count);
        let mut chosen = std::collections::HashSet::with_capacity(count);
        for entry_pass in 0..3 {
            for (n, e) in self.map.iter_mut() {
                if out.len() >= count {
                    return out;
                }
                let wanted = match entry_pass {
                    0 => !e.dirty && !e.referenced,
                    1 => !e.dirty,
                    _ => dirty_too && e.dirty,
                };
                if wanted && chosen.insert(*n) {
                    out.push(*n);
                }
                if entry_pass == 0 {
                    e.referenced = false;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_states() {
        let mut b = Blocks::default();
        b.set(1, Held::Clean);
        b.set(2, Held::Dirty);
        b.set(3, Held::Dirty);
        b.set(3, Held::Clean);
        assert_eq!((b.len(), b.dirty_count()), (3, 1));
        assert_eq!(b.dirty_blocks(), vec![2]);
        assert_eq!(b.dirty_between(0, 1), Vec::<u64>::new());
        assert_eq!(b.dirty_between(2, 1 << 40), vec![2]);
        b.remove(2);
        b.remove(9);
        assert_eq!((b.len(), b.dirty_count()), (2, 0));
        assert_eq!(b.get(1), Some(Held::Clean));
        assert_eq!(b.get(2), None);
    }

    #[test]
    fn victims_are_clean_and_unused_first_and_dirty_only_when_allowed() {
        let mut b = Blocks::default();
        for n in 0..10 {
            b.set(n, if n < 5 { Held::Dirty } else { Held::Clean });
        }
        // All were used: the first sweep clears the marks, the second takes clean ones.
        let v = b.victims(3, false);
        assert_eq!(v.len(), 3);
        assert!(v.iter().all(|n| *n >= 5));
        b.get(5);
        let v = b.victims(10, false);
        assert_eq!(v.len(), 5);
        let v = b.victims(10, true);
        assert_eq!(v.len(), 10);
    }
}
