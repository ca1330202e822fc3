//! One bounds-checked cursor for everything a peer sends, and big-endian writers.
//!
//! Every read either returns the bytes asked for or `None`: nothing is indexed by a
//! peer-supplied length without a check.

/// A read position over a borrowed byte slice.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A cursor over `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Takes the next `len` bytes, or `None` if fewer remain.
    pub fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        if len > self.buf.len() {
            return None;
        }
        let (head, tail) = self.buf.split_at(len);
        self.buf = tail;
        Some(head)
    }

    /// Takes the next `N` bytes as an array.
    pub fn take_array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).and_then(|b| b.try_into().ok())
    }

    /// Takes a big-endian u16.
    pub fn u16(&mut self) -> Option<u16> {
        self.take_array().map(u16::from_be_bytes)
    }

    /// Takes a big-endian u32.
    pub fn u32(&mut self) -> Option<u32> {
        self.take_array().map(u32::from_be_bytes)
    }

    /// Takes a big-endian u64.
    pub fn u64(&mut self) -> Option<u64> {
        self.take_array().map(u64::from_be_bytes)
    }

    /// Takes a string prefixed by its u32 length, refusing lengths over `max`.
    pub fn string_u32(&mut self, max: usize) -> Option<&'a [u8]> {
        let len = usize::try_from(self.u32()?).ok()?;
        if len > max {
            return None;
        }
        self.take(len)
    }

    /// Takes everything that is left.
    pub fn rest(&mut self) -> &'a [u8] {
        let all = self.buf;
        self.buf = &[];
        all
    }
}

/// Big-endian appends to a caller-owned buffer.
pub trait PutBe {
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
}

impl PutBe for Vec<u8> {
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_refuses_short_input() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.take(4), None);
        assert_eq!(r.u16(), Some(0x0102));
        assert_eq!(r.u16(), None);
        assert_eq!(r.remaining(), 1);
    }

    #[test]
    fn string_refuses_length_over_max_and_over_input() {
        let mut r = Reader::new(&[0, 0, 0, 5, b'a', b'b']);
        assert_eq!(r.clone().string_u32(4), None);
        assert_eq!(r.string_u32(4096), None);
        let mut ok = Reader::new(&[0, 0, 0, 2, b'a', b'b', 9]);
        assert_eq!(ok.string_u32(2), Some(&b"ab"[..]));
        assert_eq!(ok.rest(), &[9]);
    }
}
