//! A memory disk for the layers' unit tests, as the stack below a layer: it counts the reads
//! and bytes asked of it (and that none goes past its end), can fail its next requests
//! with an errno, counts reopens, can refuse writes, and answers one metadata context
//! (`qemu:dirty-bitmap:b`, all clean).

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use zcnbd_proto::Extent;

use crate::export::{Backend, Capabilities, MemoryBackend, ZeroError, ZeroFlags};

#[derive(Debug)]
pub struct TestDisk {
    pub disk: MemoryBackend,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    /// How many of the next reads, writes, flushes and block status requests fail.
    pub fails: AtomicU32,
    pub errno: i32,
    pub reopened: AtomicU32,
    pub writable: bool,
}

impl TestDisk {
    /// A writable disk of `size` bytes that fails nothing.
    pub fn new(size: u64) -> TestDisk {
        TestDisk {
            disk: MemoryBackend::new(size).unwrap(),
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            fails: AtomicU32::new(0),
            errno: libc::EIO,
            reopened: AtomicU32::new(0),
            writable: true,
        }
    }

    /// Every byte, `i % 251` at offset `i`.
    pub fn with_pattern(self) -> TestDisk {
        let pattern: Vec<u8> = (0..self.disk.size()).map(|i| (i % 251) as u8).collect();
        self.disk.pwrite(&pattern, 0, false).unwrap();
        self
    }

    pub fn shared(self) -> Arc<TestDisk> {
        Arc::new(self)
    }

    /// Everything on the disk.
    pub fn contents(&self) -> Vec<u8> {
        let mut all = vec![0u8; self.disk.size() as usize];
        self.disk.pread(&mut all, 0).unwrap();
        all
    }

    fn check(&self) -> io::Result<()> {
        let left = self.fails.load(Ordering::SeqCst);
        if left > 0 {
            self.fails.store(left - 1, Ordering::SeqCst);
            return Err(io::Error::from_raw_os_error(self.errno));
        }
        Ok(())
    }
}

impl Backend for TestDisk {
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn capabilities(&self) -> Capabilities {
        let mut c = self.disk.capabilities();
        c.write &= self.writable;
        c
    }
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        assert!(
            offset + buf.len() as u64 <= self.size(),
            "read past the end"
        );
        self.check()?;
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.read_bytes
            .fetch_add(buf.len() as u64, Ordering::SeqCst);
        self.disk.pread(buf, offset)
    }
    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        assert!(
            self.writable,
            "a write reached a disk that cannot be written"
        );
        self.check()?;
        self.disk.pwrite(buf, offset, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.check()
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.disk.trim(offset, len, fua)
    }
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        self.disk.zero(offset, len, flags)
    }
    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.check()?;
        self.disk.extents(offset, len, extents_max, out)
    }
    fn meta_contexts(&self) -> Vec<String> {
        vec!["qemu:dirty-bitmap:b".into()]
    }
    fn meta_extents(
        &self,
        _context: &str,
        _offset: u64,
        len: u64,
        _extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        out.push(Extent {
            length: len,
            flags: 0,
        });
        Ok(())
    }
    fn reopen(&self) -> io::Result<()> {
        self.reopened.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
