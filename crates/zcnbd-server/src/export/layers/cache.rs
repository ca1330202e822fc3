//! The cache layer (`--filter cache`, nbdkit-cache-filter): a local sparse file
//! (`cache_file.rs`) holds blocks of the export, so that reads of them do not go to a
//! slow source (an HTTP or NBD upstream) again, and - in writeback mode - writes are
//! answered from local disk and written back at FLUSH.
//!
//! Options: `cache=writeback|writethrough` (default writeback), `cache-on-read` (blocks read
//! from below are kept; default no: only written blocks are), `cache-max-size` (evict above
//! 95% of it, down to 80%; default none, up to [`CACHE_BLOCKS_MAX`] blocks),
//! `cache-block-size` (a power of two from 4K to 16M; default 64K; nbdkit's
//! `cache-min-block-size` is taken too), `cache-dir` (default `$TMPDIR`, else /var/tmp;
//! `--cache-dir` on the command line). The file is unnamed: nothing is left on disk.
//!
//! - **writeback**: a write lands in the cache (a partial block read from below first) and
//!   is dirty until a FLUSH writes every dirty block back, in order, then flushes below:
//!   what a FLUSH acknowledges is durable below, as without the cache. A write with FUA
//!   goes through at once. Eviction writes dirty blocks back before dropping them. Over a
//!   source that cannot be written (an HTTP URL, a read-only upstream) the cache is where
//!   writes stay: the client may write, nothing reaches the source, and the cache cannot
//!   evict what was written (a write that finds the cache full of it fails with ENOSPC).
//! - **writethrough**: a write goes below first, then updates the blocks the cache holds.
//!
//! Reads of blocks the cache holds are places: the layer maps them to the cache file at the
//! same offset ([`Place::File`]), so an engine answers them on its ring (spliced or read into
//! its buffer) as it answers a file export's, with no hop to the worker pool. Everything
//! else - blocks it does not hold, and every write - goes through the layer's methods.
//!
//! Ownership: a block's bytes in the cache file are read, written, written back and
//! dropped only under that block's lock (one of [`STRIPES`]); trims and zeroes run alone
//! (an exclusive lock); a block read from below is kept only if no write, trim or zero
//! finished meanwhile (a generation count), so the cache never holds bytes older than a
//! write acknowledged before them. A held block an engine was given stays that read's until
//! its I/O completes (`lease.rs`): the layer answers a lease table of block granules, so the
//! stack's writes, trims and zeroes of a leased block wait for the read, and eviction passes
//! over a leased block ([`Leases::try_change`]) rather than punch it out from under the
//! read. A block not held maps to the stack, so the bytes a read brings in, and blocks
//! becoming held, need no change of their own.
//!
//! Block status: what the stack below says, with blocks dirty in the cache as data.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

use zcnbd_proto::Extent;

use super::cache_blocks::{Blocks, Held};
use super::cache_file::{default_dir, CacheFile};
use super::options::Options;
use crate::export::{
    Backend, Capabilities, Layer, Leases, Map, MapFor, Medium, Place, ZeroError, ZeroFlags,
};

/// The most blocks the cache holds (1 TiB at the default block size), whatever
/// `cache-max-size` says: the table of blocks costs memory per block.
pub const CACHE_BLOCKS_MAX: u64 = 16 << 20;
/// How many locks the blocks share (block `n` takes lock `n % STRIPES`).
pub const STRIPES: usize = 64;
/// The most blocks one write-back request carries.
const WRITE_BACK_BLOCKS_MAX: usize = 16;
/// Eviction starts above this share of the maximum and stops at the next.
const HIGH_PERCENT: usize = 95;
const LOW_PERCENT: usize = 80;
/// The most bytes one prefetch (NBD_CMD_CACHE) reads at a time.
const PREFETCH_CHUNK: u64 = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Writeback,
    Writethrough,
}

/// A layer keeping blocks in a local file.
#[derive(Debug)]
pub struct Cache {
    mode: Mode,
    on_read: bool,
    block: u64,
    max_size: Option<u64>,
    dir: PathBuf,
    /// Engines' leases on held blocks (one block a granule), and the stack's changes.
    leases: Arc<Leases>,
    opened: OnceLock<Opened>,
}

/// The cache once the export opened.
#[derive(Debug)]
struct Opened {
    file: CacheFile,
    size: u64,
    max_blocks: usize,
    blocks: Mutex<Blocks>,
    stripes: Vec<Mutex<()>>,
    /// Trims and zeroes take it alone; everything else shares it.
    structure: RwLock<()>,
    /// Counts finished changes: a block read from below is kept only if none finished
    /// since the read began.
    generation: AtomicU64,
    /// One eviction, or write-back of everything, at a time.
    evicting: Mutex<()>,
    below: Capabilities,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn not_open() -> io::Error {
    io::Error::other("the cache was not opened")
}

impl Cache {
    /// The layer `options` describe.
    pub fn from_options(mut o: Options<'_>) -> Result<Cache, String> {
        let mode = match o.get("cache") {
            None | Some("writeback") => Mode::Writeback,
            Some("writethrough") => Mode::Writethrough,
            Some(other) => {
                return Err(format!(
                    "filter cache: cache={other:?} is not writeback or writethrough"
                ))
            }
        };
        let on_read = o.boolean("cache-on-read")?.unwrap_or(false);
        let block = match o.size("cache-block-size", 4096, 16 << 20)? {
            Some(b) => Some(b),
            None => o.size("cache-min-block-size", 4096, 16 << 20)?,
        }
        .unwrap_or(64 << 10);
        if !block.is_power_of_two() {
            return Err(format!(
                "filter cache: cache-block-size={block} is not a power of two"
            ));
        }
        let max_size = o.size("cache-max-size", block, u64::MAX)?;
        let dir = o.get("cache-dir").map_or_else(default_dir, PathBuf::from);
        o.finish()?;
        Ok(Cache {
            mode,
            on_read,
            block,
            max_size,
            dir,
            leases: Leases::new(block),
            opened: OnceLock::new(),
        })
    }

    fn opened(&self) -> io::Result<&Opened> {
        self.opened.get().ok_or_else(not_open)
    }

    /// Block `n`'s offset and length (the last block may be short).
    fn span(&self, o: &Opened, n: u64) -> (u64, u64) {
        let start = n * self.block;
        (start, self.block.min(o.size - start))
    }

    /// Whether dirty blocks can be written back (else they stay in the cache).
    fn writes_back(&self, o: &Opened) -> bool {
        self.mode == Mode::Writeback && o.below.write
    }

    /// Writes block `n` back below if it is dirty; the caller holds its lock.
    fn write_back(&self, o: &Opened, next: &dyn Backend, n: u64) -> io::Result<()> {
        if !lock(&o.blocks).is_dirty(n) {
            return Ok(());
        }
        let (start, len) = self.span(o, n);
        let mut data = vec![0u8; len as usize];
        o.file.read(&mut data, start)?;
        next.pwrite(&data, start, false)?;
        lock(&o.blocks).set(n, Held::Clean);
        Ok(())
    }

    /// Writes every dirty block back, runs of adjacent ones in one request each.
    fn write_back_all(&self, o: &Opened, next: &dyn Backend) -> io::Result<()> {
        // Only this holds several blocks' locks at once, one at a time (`evicting`).
        let _one = lock(&o.evicting);
        let dirty = lock(&o.blocks).dirty_blocks();
        for run in dirty.chunk_by(|a, b| b - a == 1) {
            for group in run.chunks(WRITE_BACK_BLOCKS_MAX.min(STRIPES)) {
                let _locks: Vec<_> = group
                    .iter()
                    .map(|n| lock(&o.stripes[*n as usize % STRIPES]))
                    .collect();
                let still: Vec<u64> = {
                    let blocks = lock(&o.blocks);
                    group
                        .iter()
                        .copied()
                        .filter(|n| blocks.is_dirty(*n))
                        .collect()
                };
                if still.len() != group.len() {
                    // Some were written back or dropped meanwhile: one at a time.
                    for n in still {
                        self.write_back(o, next, n)?;
                    }
                    continue;
                }
                let (start, _) = self.span(o, group[0]);
                let (last, last_len) = self.span(o, group[group.len() - 1]);
                let mut data = vec![0u8; (last + last_len - start) as usize];
                o.file.read(&mut data, start)?;
                next.pwrite(&data, start, false)?;
                let mut blocks = lock(&o.blocks);
                for n in group {
                    blocks.set(*n, Held::Clean);
                }
            }
        }
        Ok(())
    }

    /// Drops blocks until the cache is under its low mark (if it is over `needed` blocks),
    /// writing dirty ones back first where it can; if another eviction runs, waits for it
    /// only if `wait`. The caller holds no block's lock.
    fn evict(&self, o: &Opened, next: &dyn Backend, needed: usize, wait: bool) {
        if lock(&o.blocks).len() <= needed {
            return;
        }
        let _one = match o.evicting.try_lock() {
            Ok(one) => one,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if wait => lock(&o.evicting),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        if lock(&o.blocks).len() <= needed {
            return;
        }
        let low = o.max_blocks * LOW_PERCENT / 100;
        let excess = lock(&o.blocks).len().saturating_sub(low);
        let victims = lock(&o.blocks).victims(excess, self.writes_back(o));
        let (mut dropped, mut leased) = (0, 0);
        for n in victims {
            let (start, len) = self.span(o, n);
            // An engine reading the block from the file holds it until its I/O completes.
            let Some(_change) = self.leases.try_change(start, len) else {
                leased += 1;
                continue;
            };
            let _block = lock(&o.stripes[n as usize % STRIPES]);
            if !lock(&o.blocks).holds(n) {
                continue;
            }
            if let Err(e) = self.write_back(o, next, n) {
                tracing::warn!(error = %e, block = n, "cache: writing a block back to evict it failed");
                continue;
            }
            if let Err(e) = o.file.drop_range(start, len) {
                tracing::warn!(error = %e, "cache: could not drop a block from the file");
                continue;
            }
            lock(&o.blocks).remove(n);
            dropped += 1;
        }
        tracing::debug!(
            dropped,
            leased,
            "cache: evicted blocks (passed over those being read)"
        );
    }

    fn evict_if_over(&self, o: &Opened, next: &dyn Backend) {
        self.evict(o, next, o.max_blocks * HIGH_PERCENT / 100, false);
    }

    /// Reads `buf` at `offset` from below, keeping the whole blocks it touches if `keep`.
    fn read_below(
        &self,
        o: &Opened,
        next: &dyn Backend,
        buf: &mut [u8],
        offset: u64,
        keep: bool,
    ) -> io::Result<()> {
        if !keep {
            return next.pread(buf, offset);
        }
        let first = offset / self.block;
        let last = (offset + buf.len() as u64 - 1) / self.block;
        let start = first * self.block;
        let (last_start, last_len) = self.span(o, last);
        let generation = o.generation.load(Ordering::Acquire);
        let mut data = vec![0u8; (last_start + last_len - start) as usize];
        next.pread(&mut data, start)?;
        let from = (offset - start) as usize;
        buf.copy_from_slice(&data[from..from + buf.len()]);
        for n in first..=last {
            let _block = lock(&o.stripes[n as usize % STRIPES]);
            if o.generation.load(Ordering::Acquire) != generation {
                break;
            }
            let mut blocks = lock(&o.blocks);
            if blocks.get(n).is_some() || blocks.len() as u64 >= CACHE_BLOCKS_MAX {
                continue;
            }
            let (bs, bl) = self.span(o, n);
            let at = (bs - start) as usize;
            o.file.write(&data[at..at + bl as usize], bs)?;
            blocks.set(n, Held::Clean);
        }
        Ok(())
    }

    /// Reads `[offset, offset+buf.len())`: held blocks from the file, runs of others from
    /// below (kept if `keep`).
    fn read(
        &self,
        o: &Opened,
        next: &dyn Backend,
        buf: &mut [u8],
        offset: u64,
        keep: bool,
    ) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        let mut pos = offset;
        while pos < end {
            let n = pos / self.block;
            let (bs, bl) = self.span(o, n);
            let part_end = end.min(bs + bl);
            if lock(&o.blocks).get(n).is_some() {
                let _block = lock(&o.stripes[n as usize % STRIPES]);
                if lock(&o.blocks).get(n).is_some() {
                    let range = (pos - offset) as usize..(part_end - offset) as usize;
                    o.file.read(&mut buf[range], pos)?;
                    pos = part_end;
                    continue;
                }
            }
            // A run of blocks the cache does not hold: one read below.
            let mut run_end = part_end;
            while run_end < end && lock(&o.blocks).get(run_end / self.block).is_none() {
                run_end = end.min((run_end / self.block + 1) * self.block);
            }
            let range = (pos - offset) as usize..(run_end - offset) as usize;
            self.read_below(o, next, &mut buf[range], pos, keep)?;
            pos = run_end;
        }
        Ok(())
    }

    /// Writes below, then updates the blocks the cache holds (and keeps whole ones).
    fn write_through(
        &self,
        o: &Opened,
        next: &dyn Backend,
        buf: &[u8],
        offset: u64,
        fua: bool,
    ) -> io::Result<()> {
        next.pwrite(buf, offset, fua)?;
        let end = offset + buf.len() as u64;
        for n in offset / self.block..=(end - 1) / self.block {
            let (bs, bl) = self.span(o, n);
            let (from, to) = (offset.max(bs), end.min(bs + bl));
            let part = &buf[(from - offset) as usize..(to - offset) as usize];
            let _block = lock(&o.stripes[n as usize % STRIPES]);
            let held = lock(&o.blocks).get(n).is_some();
            let whole = to - from == bl;
            if held || (whole && (lock(&o.blocks).len() as u64) < CACHE_BLOCKS_MAX) {
                o.file.write(part, from)?;
                if !held {
                    lock(&o.blocks).set(n, Held::Clean);
                }
            }
            o.generation.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Writes into the cache: each block dirty (a partial one read from below first).
    fn write_back_later(
        &self,
        o: &Opened,
        next: &dyn Backend,
        buf: &[u8],
        offset: u64,
    ) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        for n in offset / self.block..=(end - 1) / self.block {
            let full = lock(&o.blocks).len() >= o.max_blocks;
            if full && lock(&o.blocks).get(n).is_none() {
                self.evict(o, next, o.max_blocks.saturating_sub(1), true);
                // Blocks that can be written back always make room (other writers may
                // fill it again meanwhile: the bound is kept to within their number); a
                // cache full of writes that cannot leave it refuses more.
                let dirty = lock(&o.blocks).dirty_count();
                if !self.writes_back(o) && dirty >= o.max_blocks {
                    tracing::warn!(
                        max_blocks = o.max_blocks,
                        "cache: full of writes the source cannot take: write refused (ENOSPC)"
                    );
                    return Err(io::Error::from_raw_os_error(libc::ENOSPC));
                }
            }
            let (bs, bl) = self.span(o, n);
            let (from, to) = (offset.max(bs), end.min(bs + bl));
            let part = &buf[(from - offset) as usize..(to - offset) as usize];
            let _block = lock(&o.stripes[n as usize % STRIPES]);
            let held = lock(&o.blocks).get(n).is_some();
            if held || to - from == bl {
                o.file.write(part, from)?;
            } else {
                let mut data = vec![0u8; bl as usize];
                next.pread(&mut data, bs)?;
                data[(from - bs) as usize..(to - bs) as usize].copy_from_slice(part);
                o.file.write(&data, bs)?;
            }
            lock(&o.blocks).set(n, Held::Dirty);
            o.generation.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }

    /// After a trim or zero below: whole blocks leave the cache; the held parts of partial
    /// ones are zeroed if `zero_parts` (a zero), else clean ones leave too (a trim). The caller holds the structure alone.
    fn forget(&self, o: &Opened, offset: u64, len: u64, zero_parts: bool) -> io::Result<()> {
        let end = offset + len;
        let held = lock(&o.blocks).held_between(offset / self.block, (end - 1) / self.block);
        for n in held {
            let (bs, bl) = self.span(o, n);
            let (from, to) = (offset.max(bs), end.min(bs + bl));
            let dirty = lock(&o.blocks).is_dirty(n);
            if to - from == bl || (!zero_parts && !dirty) {
                // Whole blocks, and clean ones a trim touched (below may read otherwise
                // now), leave; a trimmed part of a dirty one keeps its bytes (a trim
                // promises nothing of what is read after it) and is written back.
                o.file.drop_range(bs, bl)?;
                lock(&o.blocks).remove(n);
            } else if zero_parts {
                o.file.write(&vec![0u8; (to - from) as usize], from)?;
            }
        }
        o.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// `extents` with the ranges in `data` (sorted, within them) given `flags`.
fn with_flags(extents: Vec<Extent>, offset: u64, data: &[(u64, u64)], flags: u32) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::with_capacity(extents.len() + 2 * data.len());
    let mut push = |length: u64, flags: u32| {
        if length == 0 {
            return;
        }
        match out.last_mut() {
            Some(last) if last.flags == flags => last.length += length,
            _ => out.push(Extent { length, flags }),
        }
    };
    let mut pos = offset;
    let mut d = data.iter().peekable();
    for e in extents {
        let end = pos + e.length;
        while pos < end {
            while d.peek().is_some_and(|(_, de)| *de <= pos) {
                d.next();
            }
            match d.peek() {
                Some(&&(ds, de)) if ds <= pos => {
                    let to = de.min(end);
                    push(to - pos, flags);
                    pos = to;
                }
                Some(&&(ds, _)) if ds < end => {
                    push(ds - pos, e.flags);
                    pos = ds;
                }
                _ => {
                    push(end - pos, e.flags);
                    pos = end;
                }
            }
        }
    }
    out
}

impl Layer for Cache {
    fn name(&self) -> &'static str {
        "cache"
    }
    /// Held blocks are read from the cache file by the engine itself; the rest of a read,
    /// and every write, comes to the methods below.
    fn map(
        &self,
        _next: &dyn Backend,
        offset: u64,
        len: u64,
        how: MapFor,
        out: &mut Map,
    ) -> io::Result<()> {
        let o = self.opened()?;
        if how == MapFor::Write {
            out.push_stack(len);
            return Ok(());
        }
        let fd = o.file.fd();
        let end = offset + len;
        let mut blocks = lock(&o.blocks);
        let mut pos = offset;
        while pos < end {
            let part_end = end.min((pos / self.block + 1) * self.block);
            let place = match blocks.get(pos / self.block) {
                Some(_) => Place::File { fd, offset: pos },
                None => Place::Stack,
            };
            out.push(part_end - pos, place);
            pos = part_end;
        }
        Ok(())
    }
    fn leases(&self, _next: &dyn Backend) -> Option<Arc<Leases>> {
        Some(Arc::clone(&self.leases))
    }
    fn medium(&self, _next: &dyn Backend) -> Option<Medium> {
        Some(Medium::PageCache)
    }
    /// A read of a hole below still comes to the layer (to be kept, or read from a block
    /// written since).
    fn sparse_reads(&self, _next: &dyn Backend) -> bool {
        false
    }
    /// Its methods read and write a local file, and may wait for an engine's lease.
    fn never_waits(&self, _next: &dyn Backend) -> bool {
        false
    }
    /// Requests come to its blocking methods, never to an asynchronous source below.
    fn can_submit(&self, _next: &dyn Backend) -> bool {
        false
    }
    fn open(&self, next: &dyn Backend) -> io::Result<()> {
        let size = next.size();
        let file = CacheFile::create(&self.dir, size).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("filter cache: a cache file in {}: {e}", self.dir.display()),
            )
        })?;
        let max_blocks = self
            .max_size
            .map_or(CACHE_BLOCKS_MAX, |m| m / self.block)
            .clamp(1, CACHE_BLOCKS_MAX) as usize;
        let below = next.capabilities();
        tracing::info!(
            dir = %self.dir.display(),
            mode = ?self.mode,
            block = self.block,
            max_blocks,
            on_read = self.on_read,
            source_writable = below.write,
            "cache file made"
        );
        let opened = Opened {
            file,
            size,
            max_blocks,
            blocks: Mutex::new(Blocks::default()),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            structure: RwLock::new(()),
            generation: AtomicU64::new(0),
            evicting: Mutex::new(()),
            below,
        };
        self.opened
            .set(opened)
            .map_err(|_| io::Error::other("the cache was opened twice"))
    }
    fn capabilities(&self, next: &dyn Backend) -> Capabilities {
        let c = next.capabilities();
        Capabilities {
            write: c.write || self.mode == Mode::Writeback,
            flush: match (self.mode, c.write) {
                (Mode::Writethrough, _) => c.flush,
                // Writeback: FLUSH writes back (a source that cannot be written has nothing
                // to flush: what clients write lives only in the cache).
                (Mode::Writeback, _) => true,
            },
            fua: c.write && c.fua,
            trim: c.write && c.trim,
            zero: c.write && c.zero,
            fast_zero: c.write && c.fast_zero,
            cache: true,
            multi_conn: c.multi_conn || !c.write,
        }
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let o = self.opened()?;
        let _shared = o.structure.read().unwrap_or_else(|p| p.into_inner());
        self.read(o, next, buf, offset, self.on_read)?;
        if self.on_read {
            self.evict_if_over(o, next);
        }
        Ok(())
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let o = self.opened()?;
        let _shared = o.structure.read().unwrap_or_else(|p| p.into_inner());
        match self.mode == Mode::Writethrough || (fua && o.below.write) {
            true => self.write_through(o, next, buf, offset, fua)?,
            false => self.write_back_later(o, next, buf, offset)?,
        }
        self.evict_if_over(o, next);
        Ok(())
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        let o = self.opened()?;
        if !o.below.write {
            return Ok(());
        }
        if self.writes_back(o) {
            let _shared = o.structure.read().unwrap_or_else(|p| p.into_inner());
            self.write_back_all(o, next)?;
        }
        match o.below.flush {
            true => next.flush(),
            false => Ok(()),
        }
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let o = self.opened()?;
        let _alone = o.structure.write().unwrap_or_else(|p| p.into_inner());
        next.trim(offset, len, fua)?;
        self.forget(o, offset, len, false)
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        let o = self.opened()?;
        let _alone = o.structure.write().unwrap_or_else(|p| p.into_inner());
        next.zero(offset, len, flags)?;
        Ok(self.forget(o, offset, len, true)?)
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        let o = self.opened()?;
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let chunk = (end - pos).min(PREFETCH_CHUNK);
            let mut scratch = vec![0u8; chunk as usize];
            {
                let _shared = o.structure.read().unwrap_or_else(|p| p.into_inner());
                self.read(o, next, &mut scratch, pos, true)?;
            }
            self.evict_if_over(o, next);
            pos += chunk;
        }
        Ok(())
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let o = self.opened()?;
        let start = out.len();
        next.extents(offset, len, extents_max, out)?;
        // Dirty blocks are data, whatever the source says of their place.
        self.overlay_dirty(o, out, start, offset, extents_max, 0);
        Ok(())
    }
    fn meta_extents(
        &self,
        next: &dyn Backend,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let o = self.opened()?;
        let start = out.len();
        next.meta_extents(context, offset, len, extents_max, out)?;
        // A block the cache holds dirty was written: a source's dirty bitmap learns of it
        // only when it is written back, so the cache says so itself (bit 0, dirty); for
        // `qemu:allocation-depth` it is allocated in the top layer (1).
        if context.starts_with("qemu:dirty-bitmap:") || context == "qemu:allocation-depth" {
            self.overlay_dirty(o, out, start, offset, extents_max, 1);
        }
        Ok(())
    }
}

impl Cache {
    /// Gives the dirty blocks within `out[start..]` (extents from `offset`) `flags`.
    fn overlay_dirty(
        &self,
        o: &Opened,
        out: &mut Vec<Extent>,
        start: usize,
        offset: u64,
        extents_max: usize,
        flags: u32,
    ) {
        let below: Vec<Extent> = out.drain(start..).collect();
        let covered: u64 = below.iter().map(|e| e.length).sum();
        if covered == 0 {
            out.extend(below);
            return;
        }
        let end = offset + covered;
        let dirty: Vec<(u64, u64)> = lock(&o.blocks)
            .dirty_between(offset / self.block, (end - 1) / self.block)
            .into_iter()
            .map(|n| {
                let (bs, bl) = self.span(o, n);
                (bs.max(offset), (bs + bl).min(end))
            })
            .collect();
        let mut merged = with_flags(below, offset, &dirty, flags);
        merged.truncate(extents_max.max(1));
        out.extend(merged);
    }
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;
