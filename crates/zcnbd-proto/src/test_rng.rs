//! A tiny deterministic pseudo-random generator for tests (Marsaglia's xorshift64), so every
//! failure reproduces from its seed without a dependency.

/// Xorshift64 state; never zero.
pub(crate) struct XorShift(u64);

impl XorShift {
    /// A generator for `seed` (any value, zero included).
    pub(crate) fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 pseudo-random bits.
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A value in `0..n` (0 if `n` is 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % (n.max(1) as u64)) as usize
    }

    /// A value in `1..=n`: the length of one short read.
    pub(crate) fn piece(&mut self, n: usize) -> usize {
        1 + self.below(n)
    }

    /// `true` one time in `n`.
    pub(crate) fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    /// `len` pseudo-random bytes.
    pub(crate) fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}
