//! Owned buffers a request may hold while the owner moves: the memory of the callback submit
//! API (`callback.rs`).

use super::Buffer;

/// Owned memory whose bytes stay where they are when the value moves, because they live in a
/// heap allocation the value owns: a request may read or write them while the value itself
/// travels with the request's callback, which hands it back when the request is done.
///
/// # Safety
/// `stable_bytes` must return the same address and length every time until the value is
/// dropped, however often the value moves in between, and nothing but the value may access
/// those bytes (no shared handle to them may exist).
pub unsafe trait StableBuffer: Send + 'static {
    /// The bytes a request reads into or writes from.
    fn stable_bytes(&mut self) -> &mut [u8];
}

// SAFETY: a `Vec`'s elements are on the heap and only move when it reallocates, which takes
// `&mut Vec` - and the vector is owned by the request until its callback runs.
unsafe impl StableBuffer for Vec<u8> {
    fn stable_bytes(&mut self) -> &mut [u8] {
        self
    }
}

// SAFETY: a boxed slice's bytes are on the heap and a box never reallocates.
unsafe impl StableBuffer for Box<[u8]> {
    fn stable_bytes(&mut self) -> &mut [u8] {
        self
    }
}

/// Lends `owner`'s bytes to a request; `owner` must then move into the request's completer,
/// which keeps them alive and in place until it hands `owner` back.
pub fn lend_stable<B: StableBuffer>(owner: &mut B) -> Buffer {
    let bytes = owner.stable_bytes();
    // SAFETY: `StableBuffer`'s contract keeps the bytes at this address for as long as the
    // value lives, wherever it moves; the caller (`callback.rs`) moves the value into the
    // completer, which runs only once the request is done with the bytes (completed, failed
    // or detached), so the memory outlives the request and nobody else touches it meanwhile.
    unsafe { Buffer::from_raw([(bytes.as_mut_ptr(), bytes.len())]) }
}
