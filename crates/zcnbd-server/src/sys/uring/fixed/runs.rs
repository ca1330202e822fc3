//! Which pages of a ring's registered region are in use: a bitmap handing out runs of
//! contiguous pages, first fit. Sans-IO and safe; `fixed` maps the runs onto memory.
//!
//! Invariants: `free` equals the number of clear bits below `pages`, and the bits of the last
//! word at and above `pages` are permanently set, so no run can extend past the region.

/// Pages per bitmap word.
const WORD_PAGES: usize = 64;

/// A bitmap of `pages` pages: a set bit is a page in use.
#[derive(Debug)]
pub(super) struct PageRuns {
    words: Vec<u64>,
    pages: usize,
    free: usize,
}

impl PageRuns {
    /// `pages` free pages.
    pub fn new(pages: usize) -> PageRuns {
        let mut words = vec![0u64; pages.div_ceil(WORD_PAGES)];
        let tail = pages % WORD_PAGES;
        if let (Some(last), true) = (words.last_mut(), tail != 0) {
            *last = !0u64 << tail;
        }
        PageRuns {
            words,
            pages,
            free: pages,
        }
    }

    /// Pages not in use.
    #[cfg(test)]
    pub fn free_pages(&self) -> usize {
        self.free
    }

    /// Marks the first run of `n` free pages in use and returns its first page; `None` if
    /// there is no such run (the caller falls back, it never waits).
    pub fn take(&mut self, n: usize) -> Option<usize> {
        if n == 0 || n > self.free {
            return None;
        }
        let start = self.first_fit(n)?;
        self.set(start, n, true);
        self.free -= n;
        Some(start)
    }

    /// Returns the run `[first, first + n)`, which `take` handed out.
    pub fn give(&mut self, first: usize, n: usize) {
        self.set(first, n, false);
        self.free += n;
    }

    /// The first page of the lowest run of `n` clear bits. Whole words are skipped at once:
    /// full ones reset the run, empty ones extend it by 64 pages.
    fn first_fit(&self, n: usize) -> Option<usize> {
        let (mut start, mut page) = (0, 0);
        while page < self.pages {
            let word = self.words[page / WORD_PAGES];
            let bit = page % WORD_PAGES;
            if bit == 0 && word == !0 {
                page += WORD_PAGES;
                start = page;
            } else if bit == 0 && word == 0 {
                page += WORD_PAGES;
            } else if word & (1 << bit) != 0 {
                page += 1;
                start = page;
            } else {
                page += 1;
            }
            // A clear last word cannot be partial (its tail bits are set), so `page` only
            // passes `pages` through a full word, which reset `start`.
            if page - start >= n {
                return Some(start);
            }
        }
        None
    }

    /// Sets or clears the bits of `[first, first + n)`, checking each was the opposite.
    fn set(&mut self, first: usize, n: usize, used: bool) {
        assert!(first + n <= self.pages, "page run outside the region");
        let mut page = first;
        let end = first + n;
        while page < end {
            let bit = page % WORD_PAGES;
            let count = (WORD_PAGES - bit).min(end - page);
            let mask = (!0u64 >> (WORD_PAGES - count)) << bit;
            let word = &mut self.words[page / WORD_PAGES];
            let expected = if used { 0 } else { mask };
            assert_eq!(
                *word & mask,
                expected,
                "page run taken twice or given back twice"
            );
            *word ^= mask;
            page += count;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_first_fit_and_reuses_given_runs() {
        let mut runs = PageRuns::new(200);
        assert_eq!(runs.take(3), Some(0));
        assert_eq!(runs.take(100), Some(3));
        assert_eq!(runs.take(97), Some(103));
        assert_eq!(runs.take(1), None);
        runs.give(3, 100);
        assert_eq!(runs.free_pages(), 100);
        assert_eq!(runs.take(2), Some(3));
        assert_eq!(runs.take(98), Some(5));
        assert_eq!(runs.free_pages(), 0);
    }

    #[test]
    fn a_run_never_crosses_a_used_page_or_the_end() {
        let mut runs = PageRuns::new(130);
        assert_eq!(runs.take(64), Some(0));
        assert_eq!(runs.take(1), Some(64));
        runs.give(0, 64);
        // 64 free below page 64, 65 above it: 65 fits only above.
        assert_eq!(runs.take(65), Some(65));
        assert_eq!(runs.take(65), None);
        assert_eq!(runs.take(64), Some(0));
        assert_eq!(runs.free_pages(), 0);
    }

    #[test]
    fn fragmentation_refuses_rather_than_splits() {
        let mut runs = PageRuns::new(8);
        let firsts: Vec<_> = (0..8).map(|_| runs.take(1).unwrap()).collect();
        for first in firsts.iter().step_by(2) {
            runs.give(*first, 1);
        }
        assert_eq!(runs.free_pages(), 4);
        assert_eq!(runs.take(2), None);
        assert_eq!(runs.take(1), Some(0));
    }

    #[test]
    #[should_panic(expected = "given back twice")]
    fn giving_back_twice_is_caught() {
        let mut runs = PageRuns::new(4);
        let first = runs.take(2).unwrap();
        runs.give(first, 2);
        runs.give(first, 2);
    }
}
