//! The readahead layer (`--filter readahead`, nbdkit-readahead-filter): when a client reads
//! sequentially, each read from the stack below fetches a window beyond it, and the reads
//! that follow are answered from that window - fewer, larger requests to a source where
//! each request costs a round trip (an HTTP or NBD upstream). The window starts at `window`
//! (default 64K) and doubles with each sequential read that misses it, up to `max` (default
//! 4M, at most [`READAHEAD_MAX`]); a read elsewhere starts it again. It never reads past the
//! end of the export.
//!
//! A write, trim or zero drops the window once it is done, and a window being fetched while
//! one of them finished is not kept, so a read never answers bytes older than a write
//! acknowledged before it.

use std::io;
use std::sync::Mutex;

use zcnbd_proto::Extent;

use super::options::Options;
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// The largest window.
pub const READAHEAD_MAX: u64 = 64 << 20;

/// What was read ahead, and where the next sequential read would start.
#[derive(Debug, Default)]
struct Window {
    start: u64,
    data: Vec<u8>,
    /// Where the last read ended.
    expected: u64,
    /// The size of the next fetch.
    size: u64,
    /// Counts writes done: a fetch that overlapped one is not kept.
    generation: u64,
}

/// A layer reading ahead of sequential reads.
#[derive(Debug)]
pub struct Readahead {
    initial: u64,
    max: u64,
    window: Mutex<Window>,
}

impl Readahead {
    /// The layer `options` describe.
    pub fn from_options(mut o: Options<'_>) -> Result<Readahead, String> {
        let initial = o.size("window", 512, READAHEAD_MAX)?.unwrap_or(64 << 10);
        let max = o.size("max", 512, READAHEAD_MAX)?.unwrap_or(4 << 20);
        o.finish()?;
        if initial > max {
            return Err(format!(
                "filter readahead: window={initial} is larger than max={max}"
            ));
        }
        Ok(Readahead {
            initial,
            max,
            window: Mutex::new(Window {
                size: initial,
                ..Window::default()
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the window after a change of the export's bytes.
    fn changed(&self) {
        let mut w = self.lock();
        w.generation += 1;
        w.data = Vec::new();
    }
}

impl Layer for Readahead {
    fn name(&self) -> &'static str {
        "readahead"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len() as u64;
        let (fetch, generation) = {
            let mut w = self.lock();
            let sequential = offset == w.expected;
            w.expected = offset + len;
            if offset >= w.start && offset + len <= w.start + w.data.len() as u64 {
                let from = (offset - w.start) as usize;
                buf.copy_from_slice(&w.data[from..from + buf.len()]);
                return Ok(());
            }
            w.size = match sequential {
                true => (w.size * 2).min(self.max),
                false => self.initial,
            };
            (sequential.then_some(w.size), w.generation)
        };
        let end = next.size();
        let Some(fetch) = fetch.filter(|f| *f > len && offset + len < end) else {
            return next.pread(buf, offset);
        };
        let mut data = vec![0u8; fetch.min(end - offset) as usize];
        next.pread(&mut data, offset)?;
        buf.copy_from_slice(&data[..buf.len()]);
        let mut w = self.lock();
        if w.generation == generation {
            w.start = offset;
            w.data = data;
        }
        Ok(())
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let done = next.pwrite(buf, offset, fua);
        self.changed();
        done
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let done = next.trim(offset, len, fua);
        self.changed();
        done
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        let done = next.zero(offset, len, flags);
        self.changed();
        done
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        next.extents(offset, len, extents_max, out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::layers::test_disk::TestDisk;
    use crate::export::Layered;

    fn setup(entry: &str, size: u64) -> (Arc<TestDisk>, Layered) {
        let (_, options) = split(entry).unwrap();
        let layer = Readahead::from_options(options).unwrap();
        let below = TestDisk::new(size).with_pattern().shared();
        (below.clone(), Layered::new(Arc::new(layer), below))
    }

    #[test]
    fn sequential_reads_fetch_growing_windows_and_never_past_the_end() {
        let size = (8 << 20) + 1000;
        let (below, stack) = setup("readahead:window=64K,max=1M", size);
        let mut buf = vec![0u8; 4096];
        let mut offset = 0;
        while offset < size {
            let n = 4096.min(size - offset) as usize;
            stack.pread(&mut buf[..n], offset).unwrap();
            for (i, b) in buf[..n].iter().enumerate() {
                assert_eq!(*b, ((offset + i as u64) % 251) as u8);
            }
            offset += n as u64;
        }
        let reads = below.reads.load(Ordering::SeqCst);
        // 2049 client reads; windows of 128K, 256K, 512K, then 1M: about 11 below.
        assert!(reads <= 16, "{reads} reads below");
        assert_eq!(below.read_bytes.load(Ordering::SeqCst), size);
    }

    #[test]
    fn random_reads_pass_through_and_writes_drop_the_window() {
        let (below, stack) = setup("readahead", 4 << 20);
        let mut buf = vec![0u8; 4096];
        for offset in [3 << 20, 1 << 20, 2 << 20] {
            stack.pread(&mut buf, offset).unwrap();
        }
        assert_eq!(below.read_bytes.load(Ordering::SeqCst), 3 * 4096);
        stack.pread(&mut buf, (2 << 20) + 4096).unwrap();
        stack.pread(&mut buf, (2 << 20) + 8192).unwrap();
        stack.pwrite(&[9u8; 100], (2 << 20) + 12288, false).unwrap();
        stack.pread(&mut buf, (2 << 20) + 12288).unwrap();
        assert_eq!(&buf[..100], &[9u8; 100][..]);
        assert_eq!(buf[100], (((2 << 20) + 12288 + 100) % 251) as u8);
        stack.zero(0, 4 << 20, ZeroFlags::default()).unwrap();
        stack.pread(&mut buf, (2 << 20) + 16384).unwrap();
        assert_eq!(buf, vec![0u8; 4096]);
    }

    #[test]
    fn options_are_bounded() {
        let (_, o) = split("readahead:window=1M,max=64K").unwrap();
        assert!(Readahead::from_options(o)
            .unwrap_err()
            .contains("larger than max"));
        let (_, o) = split("readahead:max=1G").unwrap();
        assert!(Readahead::from_options(o).is_err());
    }
}
