//! Pooled buffers lent to the NBD client library while a request to an upstream server is in
//! flight (the NBD backend's asynchronous side, `export/base/nbd_async.rs`): the client
//! receives a read's data into one and sends a write's payload from one.

use crate::buffer_pool::PooledBuf;

// SAFETY: a `PooledBuf`'s bytes live in the `Vec` of its `AlignedBuf` (on the heap; the
// buffer never reallocates while it is in use, and its length only changes through
// `&mut`, which the request's owner does not have), or in lent memory, whose `LentMemory`
// promise is the same; so they stay put when the `PooledBuf` moves; nothing else holds
// them (the pool takes the buffer back only when it is dropped).
unsafe impl zcnbd_client::StableBuffer for PooledBuf {
    fn stable_bytes(&mut self) -> &mut [u8] {
        self
    }
}
