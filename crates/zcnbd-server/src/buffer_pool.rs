//! Page-aligned payload buffers, recycled by size class.
//!
//! A request's payload is received straight into one of these and written to the backend from
//! it; a read's data is read into one and sent from it. Reusing them keeps large requests off
//! malloc/mmap and their page faults. Alignment is 4096 so O_DIRECT can use any of them.
//!
//! Alignment is obtained without `unsafe`: the storage is over-allocated by one alignment unit
//! and the buffer starts at the first aligned byte inside it.

use std::sync::{Arc, Mutex};

use crate::sys::lent_memory::LentMemory;

/// Alignment of every buffer's first byte (enough for O_DIRECT on 4Kn devices).
pub const BUFFER_ALIGN_BYTES: usize = 4096;
/// Smallest size class.
const CLASS_BYTES_MIN: usize = 4096;
/// Number of size classes: 4 KiB, 8 KiB, ... 32 MiB.
const CLASS_COUNT: usize = 14;

/// An owned, aligned byte buffer of a fixed capacity.
#[derive(Debug)]
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    capacity: usize,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `capacity` bytes whose first byte is aligned to `BUFFER_ALIGN_BYTES`.
    pub fn new(capacity: usize) -> Self {
        let storage = vec![0u8; capacity + BUFFER_ALIGN_BYTES];
        let start = storage.as_ptr().align_offset(BUFFER_ALIGN_BYTES);
        // Invariant: start + capacity <= storage.len(), as align_offset < BUFFER_ALIGN_BYTES
        // for u8 pointers.
        debug_assert!(start < BUFFER_ALIGN_BYTES);
        AlignedBuf {
            storage,
            start,
            capacity,
            len: capacity,
        }
    }

    /// Bytes this buffer can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the length in use (at most the capacity).
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "buffer length {len} over capacity {}",
            self.capacity
        );
        self.len = len;
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    /// The bytes in use, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Recycles [`AlignedBuf`]s by power-of-two size class, up to a byte budget.
#[derive(Debug)]
pub struct BufferPool {
    classes: Mutex<PoolState>,
    pooled_bytes_max: usize,
}

#[derive(Debug, Default)]
struct PoolState {
    free: [Vec<AlignedBuf>; CLASS_COUNT],
    pooled_bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `pooled_bytes_max` bytes of idle buffers.
    pub fn new(pooled_bytes_max: usize) -> Arc<Self> {
        Arc::new(BufferPool {
            classes: Mutex::default(),
            pooled_bytes_max,
        })
    }

    fn class_of(len: usize) -> Option<usize> {
        let size = len.max(CLASS_BYTES_MIN).checked_next_power_of_two()?;
        let class = (size / CLASS_BYTES_MIN).trailing_zeros() as usize;
        (class < CLASS_COUNT).then_some(class)
    }

    /// A buffer of exactly `len` bytes in use, reused when one is idle.
    pub fn get(self: &Arc<Self>, len: usize) -> PooledBuf {
        let class = Self::class_of(len);
        let reused = class.and_then(|c| {
            let mut state = self.classes.lock().unwrap_or_else(|e| e.into_inner());
            let buf = state.free[c].pop()?;
            state.pooled_bytes -= buf.capacity();
            Some(buf)
        });
        let mut buf = reused.unwrap_or_else(|| {
            let capacity = class.map_or(len, |c| CLASS_BYTES_MIN << c);
            AlignedBuf::new(capacity)
        });
        buf.set_len(len);
        PooledBuf {
            memory: Memory::Pooled(buf, Arc::clone(self)),
        }
    }

    fn put(&self, buf: AlignedBuf) {
        let Some(class) = Self::class_of(buf.capacity()) else {
            return;
        };
        if CLASS_BYTES_MIN << class != buf.capacity() {
            return;
        }
        let mut state = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        if state.pooled_bytes + buf.capacity() <= self.pooled_bytes_max {
            state.pooled_bytes += buf.capacity();
            state.free[class].push(buf);
        }
    }
}

/// A buffer borrowed from a [`BufferPool`] (it goes back to the pool when dropped), or lent
/// memory (`sys/lent_memory.rs`) in its place.
pub struct PooledBuf {
    memory: Memory,
}

enum Memory {
    Pooled(AlignedBuf, Arc<BufferPool>),
    /// The first `.1` bytes of lent memory.
    Lent(Box<dyn LentMemory>, usize),
    Taken,
}

impl PooledBuf {
    /// The first `len` bytes of `memory` as an operation's buffer (all of it if it is
    /// shorter); [`PooledBuf::take_lent`] hands the memory back.
    pub fn lent(memory: Box<dyn LentMemory>, len: usize) -> PooledBuf {
        let len = len.min(memory.bytes().len());
        PooledBuf {
            memory: Memory::Lent(memory, len),
        }
    }

    /// The lent memory this buffer is, if it is lent memory.
    pub fn take_lent(mut self) -> Option<Box<dyn LentMemory>> {
        match std::mem::replace(&mut self.memory, Memory::Taken) {
            Memory::Lent(memory, _) => Some(memory),
            other => {
                self.memory = other;
                None
            }
        }
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.memory {
            Memory::Pooled(..) => "pooled",
            Memory::Lent(..) => "lent",
            Memory::Taken => "taken",
        };
        f.debug_struct("PooledBuf")
            .field("memory", &kind)
            .field("len", &self.len())
            .finish()
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.memory {
            Memory::Pooled(b, _) => b.as_slice(),
            Memory::Lent(m, len) => &m.bytes()[..*len],
            Memory::Taken => &[],
        }
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.memory {
            Memory::Pooled(b, _) => b.as_mut_slice(),
            Memory::Lent(m, len) => &mut m.bytes_mut()[..*len],
            Memory::Taken => &mut [],
        }
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Memory::Pooled(buf, pool) = std::mem::replace(&mut self.memory, Memory::Taken) {
            pool.put(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_memory_is_the_buffer_and_comes_back() {
        let memory = vec![7u8; 8192];
        let at = memory.as_ptr();
        let mut buf = PooledBuf::lent(Box::new(memory), 4096);
        assert_eq!((buf.len(), buf.as_ptr()), (4096, at));
        buf[0] = 9;
        let back = buf.take_lent().expect("lent memory");
        let back = (back as Box<dyn std::any::Any>)
            .downcast::<Vec<u8>>()
            .unwrap();
        assert_eq!(
            (back.len(), back.as_ptr(), back[0], back[1]),
            (8192, at, 9, 7)
        );
        // Longer than the memory: all of it. A pooled buffer is not lent memory.
        assert_eq!(PooledBuf::lent(Box::new(vec![0u8; 10]), 20).len(), 10);
        assert!(BufferPool::new(1 << 20).get(4096).take_lent().is_none());
    }

    #[test]
    fn buffers_are_aligned_and_sized() {
        let pool = BufferPool::new(1 << 20);
        for len in [0, 1, 4096, 5000, 1 << 20] {
            let b = pool.get(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % BUFFER_ALIGN_BYTES, 0);
        }
    }

    #[test]
    fn buffers_are_reused_within_budget() {
        let pool = BufferPool::new(8192);
        let ptr = {
            let b = pool.get(3000);
            b.as_ptr()
        };
        assert_eq!(pool.get(4096).as_ptr(), ptr);
        // Larger than the budget: not kept; the 4 KiB one still is.
        drop(pool.get(1 << 20));
        assert_eq!(pool.classes.lock().unwrap().pooled_bytes, 4096);
    }
}
