//! Memory that is not a buffer pool's, lent to an operation as its buffer for as long as the
//! operation owns it (`PooledBuf::lent`): a ublk request's own buffer, which an upstream then
//! reads into and writes from, with no copy between it and a pooled one.

use std::any::Any;

/// Memory an operation may use as its buffer.
///
/// # Safety
/// The bytes stay where they are for as long as the value lives, however it moves (code
/// that lends a `PooledBuf`'s bytes to the kernel or to the NBD client relies on it), and
/// nothing else reaches them meanwhile.
pub unsafe trait LentMemory: Any + Send {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

// SAFETY: a `Vec`'s bytes live on the heap and stay there when the `Vec` moves; only
// slices are handed out, so it never reallocates while lent.
unsafe impl LentMemory for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
