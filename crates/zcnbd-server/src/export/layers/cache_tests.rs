//! The cache layer against a model: random requests (reads, writes of any alignment,
//! zeroes, trims, flushes) in both modes, with eviction forced by a small maximum; what a
//! read returns is always the model's, and after each FLUSH the source below holds the
//! model. Then requests from several threads at once, a source that cannot be written,
//! block status, and the cache file leaving nothing behind.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::*;
use crate::export::layers::options::split;
use crate::export::layers::test_disk::TestDisk;
use crate::export::{Layered, Map, MapFor, Medium, Place, Stack};

const KIB: u64 = 1024;

/// The disk below: writable or not.
fn below(size: u64, writable: bool) -> Arc<TestDisk> {
    let mut disk = TestDisk::new(size);
    disk.writable = writable;
    disk.shared()
}

fn cache_over(below: &Arc<TestDisk>, entry: &str, dir: &std::path::Path) -> (Arc<Cache>, Layered) {
    let entry = format!("{entry},cache-dir={}", dir.display());
    let (_, options) = split(&entry).unwrap();
    let cache = Arc::new(Cache::from_options(options).unwrap());
    cache.open(&**below).unwrap();
    let stack = Layered::new(cache.clone(), below.clone() as Arc<dyn Backend>);
    (cache, stack)
}

/// Reads `[offset, offset+len)` as an engine does, under the map's lease: the places it
/// names from their descriptors, the rest through the stack.
fn read_as_engine(stack: &Stack, offset: u64, len: u64) -> Vec<u8> {
    let mut map = Map::default();
    let _lease = stack
        .map(offset, len, MapFor::Read { holes: false }, &mut map)
        .unwrap();
    let mut buf = vec![0u8; len as usize];
    let mut at = 0usize;
    for segment in map.segments() {
        let part = &mut buf[at..at + segment.len as usize];
        match segment.place {
            Place::File { fd, offset: o } => read_fd(fd, part, o),
            Place::Stack => stack.read(part, offset + at as u64).unwrap(),
            ref other => panic!("the cache mapped to {other:?}"),
        }
        at += segment.len as usize;
    }
    assert_eq!(at as u64, len, "the map covers the range");
    buf
}

fn read_fd(fd: std::os::fd::RawFd, buf: &mut [u8], offset: u64) {
    // The descriptor reopened by its /proc name (the cache file's stays the layer's).
    let file = std::fs::File::open(format!("/proc/self/fd/{fd}")).unwrap();
    std::os::unix::fs::FileExt::read_exact_at(&file, buf, offset).unwrap();
}

/// A stack of the cache over `below`, opened, as the engines see it (with its lease table).
fn stack_over(below: &Arc<TestDisk>, entry: &str, dir: &std::path::Path) -> (Arc<Cache>, Stack) {
    let entry = format!("{entry},cache-dir={}", dir.display());
    let (_, options) = split(&entry).unwrap();
    let cache = Arc::new(Cache::from_options(options).unwrap());
    let layer: Arc<dyn Layer> = cache.clone();
    let stack = Stack::open(below.clone() as Arc<dyn Backend>, vec![layer], false).unwrap();
    (cache, stack)
}

/// xorshift64: the same requests every run.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn run_model(entry: &str, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let size = 1024 * KIB + 3 * 512; // a short last block
    let below = below(size, true);
    let (cache, stack) = stack_over(&below, entry, dir.path());
    let mut model = vec![0u8; size as usize];
    let mut r = Random(seed);
    for step in 0..2000u64 {
        let offset = r.below(size);
        let len = 1 + r.below((size - offset).min(40 * KIB));
        let (offset, len) = match r.below(3) {
            // Aligned to 512 bytes, as most clients send.
            0 => {
                let o = offset / 512 * 512;
                (o, (len / 512).max(1) * 512).min((o, size - o))
            }
            _ => (offset, len),
        };
        let kind = r.below(10);
        if std::env::var_os("CACHE_TRACE").is_some() {
            eprintln!("step {step}: kind {kind} [{offset}, +{len})");
        }
        match kind {
            0..=3 => {
                // Half the reads as an engine makes them: held blocks from the file.
                let buf = match r.below(2) {
                    0 => read_as_engine(&stack, offset, len),
                    _ => {
                        let mut buf = vec![0u8; len as usize];
                        stack.read(&mut buf, offset).unwrap();
                        buf
                    }
                };
                assert!(
                    buf == model[offset as usize..(offset + len) as usize],
                    "{entry}: step {step}: read [{offset}, +{len}) differs"
                );
            }
            4..=6 => {
                let data: Vec<u8> = (0..len).map(|i| (step + i) as u8 | 1).collect();
                stack.write(&data, offset, r.below(8) == 0).unwrap();
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
            }
            7 => {
                stack.zero(offset, len, ZeroFlags::default()).unwrap();
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            8 => {
                // A trim leaves the bytes unspecified: the model takes what is read.
                stack.trim(offset, len, false).unwrap();
                let mut buf = vec![0u8; len as usize];
                stack.read(&mut buf, offset).unwrap();
                model[offset as usize..(offset + len) as usize].copy_from_slice(&buf);
            }
            _ => {
                stack.flush().unwrap();
                let got = below.contents();
                let first = got.iter().zip(&model).position(|(a, b)| a != b);
                assert!(
                    first.is_none(),
                    "{entry}: step {step}: after FLUSH, from byte {first:?}"
                );
            }
        }
        // Eviction passes over the blocks a read holds leased (at most a request's, 40 KiB
        // here), which may stay over the bound until the next eviction.
        let o = cache.opened().unwrap();
        let leased_max = (40 * KIB).div_ceil(cache.block) as usize + 1;
        assert!(
            lock(&o.blocks).len() <= o.max_blocks + 1 + leased_max,
            "{entry}: the cache outgrew its bound"
        );
    }
    stack.flush().unwrap();
    assert!(below.contents() == model, "{entry}: at the end");
}

#[test]
fn every_mode_matches_the_model_and_a_flush_leaves_it_below() {
    for (i, entry) in [
        "cache",
        "cache:cache=writeback,cache-on-read=yes,cache-block-size=4K,cache-max-size=64K",
        "cache:cache=writethrough,cache-on-read=yes,cache-block-size=4K,cache-max-size=64K",
        "cache:cache=writethrough",
        "cache:cache-block-size=16K,cache-max-size=128K",
    ]
    .iter()
    .enumerate()
    {
        run_model(entry, 0x9e37_79b9_7f4a_7c15 + i as u64);
    }
}

#[test]
fn reads_of_cached_blocks_stay_local() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(1 << 20, true);
    below.disk.pwrite(&[5u8; 1 << 20], 0, false).unwrap();
    let (_, stack) = cache_over(&below, "cache:cache-on-read=yes", dir.path());
    let mut buf = vec![0u8; 256 << 10];
    stack.pread(&mut buf, 100).unwrap();
    let first = below.read_bytes.load(Ordering::SeqCst);
    stack.pread(&mut buf, 100).unwrap();
    assert_eq!(below.read_bytes.load(Ordering::SeqCst), first);
    assert_eq!(buf, vec![5u8; 256 << 10]);
    // NBD_CMD_CACHE fetches ahead of reads.
    stack.cache(512 << 10, 512 << 10).unwrap();
    let fetched = below.read_bytes.load(Ordering::SeqCst);
    stack.pread(&mut buf, 700 << 10).unwrap();
    assert_eq!(below.read_bytes.load(Ordering::SeqCst), fetched);
}

#[test]
fn writeback_holds_writes_until_a_flush_and_reports_them_as_data() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(1 << 20, true);
    let (_, stack) = cache_over(&below, "cache", dir.path());
    stack.pwrite(&[7u8; 1000], 70_000, false).unwrap();
    assert_eq!(below.contents()[70_000], 0, "not below before a flush");
    let mut extents = Vec::new();
    stack.extents(0, 1 << 20, 16, &mut extents).unwrap();
    // The block (64K..128K) is data; the memory below says the rest is a hole.
    assert_eq!(extents[0].length, 64 << 10);
    assert_eq!((extents[1].length, extents[1].flags), (64 << 10, 0));
    assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 1 << 20);
    // A source's dirty bitmap shows the block the cache holds dirty.
    let mut bitmap = Vec::new();
    stack
        .meta_extents("qemu:dirty-bitmap:b", 0, 1 << 20, 16, &mut bitmap)
        .unwrap();
    let flags: Vec<(u64, u32)> = bitmap.iter().map(|e| (e.length, e.flags)).collect();
    assert_eq!(flags, [(64 << 10, 0), (64 << 10, 1), (896 << 10, 0)]);
    stack.flush().unwrap();
    assert_eq!(below.contents()[70_000..71_000], [7u8; 1000]);
}

#[test]
fn over_a_source_that_cannot_be_written_writes_stay_in_the_cache_until_it_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(1 << 20, false);
    let (cache, stack) = cache_over(
        &below,
        "cache:cache-block-size=4K,cache-max-size=64K",
        dir.path(),
    );
    let caps = cache.capabilities(&*below);
    assert!(caps.write && caps.flush && !caps.trim && !caps.zero);
    for i in 0..16u64 {
        stack.pwrite(&[i as u8 + 1; 4096], i * 8192, false).unwrap();
    }
    stack.flush().unwrap();
    let e = stack.pwrite(&[1u8; 4096], 1 << 19, false).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    let mut buf = vec![0u8; 4096];
    stack.pread(&mut buf, 3 * 8192).unwrap();
    assert_eq!(buf, vec![4u8; 4096]);
    assert_eq!(below.contents(), vec![0u8; 1 << 20]);
}

#[test]
fn threads_writing_and_reading_at_once_see_their_own_writes() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(4 << 20, true);
    for entry in [
        "cache:cache-block-size=4K,cache-max-size=256K,cache-on-read=yes",
        "cache:cache=writethrough,cache-block-size=4K,cache-max-size=256K,cache-on-read=yes",
    ] {
        let (_, stack) = cache_over(&below, entry, dir.path());
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let stack = &stack;
                s.spawn(move || {
                    let mut r = Random(t + 1);
                    // Each thread owns every fourth 16 KiB region; writes cross blocks.
                    let mut mine = vec![0u8; 4 << 20];
                    for step in 0..600u64 {
                        let region = r.below(64) * 4 + t;
                        let offset = region * 16 * KIB + r.below(12 * KIB);
                        let len = 1 + r.below(4 * KIB);
                        if r.below(2) == 0 {
                            let data = vec![(step as u8) | 1; len as usize];
                            stack.pwrite(&data, offset, false).unwrap();
                            mine[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                        } else {
                            let mut buf = vec![0u8; len as usize];
                            stack.pread(&mut buf, offset).unwrap();
                            let want = &mine[offset as usize..(offset + len) as usize];
                            assert!(buf == want, "thread {t} step {step}");
                        }
                        if step % 100 == 99 {
                            stack.flush().unwrap();
                        }
                    }
                });
            }
        });
        stack.flush().unwrap();
        stack.zero(0, 4 << 20, ZeroFlags::default()).unwrap();
    }
}

#[test]
fn the_cache_file_is_unnamed_and_bad_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(1 << 20, true);
    let (cache, stack) = cache_over(&below, "cache:cache-on-read=yes", dir.path());
    let mut buf = vec![0u8; 1 << 20];
    stack.pread(&mut buf, 0).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    assert!(cache.opened().unwrap().file.allocated() >= 1 << 20);
    for (entry, says) in [
        ("cache:cache=unsafe", "writeback or writethrough"),
        ("cache:cache-block-size=3000", "from 4096"),
        ("cache:cache-block-size=12K", "power of two"),
        ("cache:size=1", "cache-max-size"),
    ] {
        let (_, o) = split(entry).unwrap();
        let e = Cache::from_options(o).unwrap_err();
        assert!(e.contains(says), "{entry}: {e}");
    }
}

#[test]
fn held_blocks_map_to_the_cache_file_and_the_rest_to_the_stack() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(1 << 20, true);
    let (_, stack) = stack_over(&below, "cache:cache-block-size=4K", dir.path());
    assert_eq!(stack.medium(), Some(Medium::PageCache));
    assert!(!stack.is_asynchronous());
    stack.write(&[9u8; 8192], 4096, false).unwrap();
    let mut map = Map::default();
    let lease = stack
        .map(0, 16384, MapFor::Read { holes: true }, &mut map)
        .unwrap();
    let kinds: Vec<(u64, bool)> = map
        .segments()
        .iter()
        .map(|s| (s.len, matches!(s.place, Place::File { offset: 4096, .. })))
        .collect();
    assert_eq!(kinds, [(4096, false), (8192, true), (4096, false)]);
    assert!(matches!(map.segments()[0].place, Place::Stack));
    let Place::File { fd, .. } = map.segments()[1].place else {
        unreachable!()
    };
    let mut got = vec![0u8; 8192];
    read_fd(fd, &mut got, 4096);
    assert_eq!(got, vec![9u8; 8192]);
    drop(lease);
    // Writes always go through the layer.
    let _lease = stack.map(4096, 4096, MapFor::Write, &mut map).unwrap();
    assert!(matches!(map.single().map(|s| &s.place), Some(Place::Stack)));
}

#[test]
fn a_write_to_a_block_an_engine_reads_waits_for_the_read() {
    let dir = tempfile::tempdir().unwrap();
    let below = below(1 << 20, true);
    for entry in [
        "cache:cache-block-size=4K",
        "cache:cache=writethrough,cache-on-read=yes,cache-block-size=4K",
    ] {
        let (_, stack) = stack_over(&below, entry, dir.path());
        stack.write(&[1u8; 4096], 8192, false).unwrap();
        let mut map = Map::default();
        let lease = stack
            .map(8192 + 100, 200, MapFor::Read { holes: false }, &mut map)
            .unwrap();
        let Some(Place::File { fd, offset }) = map.single().map(|s| &s.place) else {
            panic!("{entry}: a held block maps to the file: {map:?}");
        };
        let (fd, offset) = (*fd, *offset);
        std::thread::scope(|s| {
            let writer = s.spawn(|| stack.write(&[2u8; 100], 8192 + 1000, false));
            std::thread::sleep(std::time::Duration::from_millis(100));
            assert!(
                !writer.is_finished(),
                "{entry}: the write waits for the lease"
            );
            let mut got = vec![0u8; 200];
            read_fd(fd, &mut got, offset);
            assert_eq!(
                got,
                vec![1u8; 200],
                "{entry}: the read's bytes are still there"
            );
            drop(lease);
            writer.join().unwrap().unwrap();
        });
        let mut got = vec![0u8; 4096];
        stack.read(&mut got, 8192).unwrap();
        assert_eq!(got[1000..1100], [2u8; 100]);
        stack.flush().unwrap();
    }
}

#[test]
fn eviction_passes_over_a_block_an_engine_reads() {
    let dir = tempfile::tempdir().unwrap();
    let below = Arc::new(TestDisk::new(1 << 20).with_pattern());
    let (_, stack) = stack_over(
        &below,
        "cache:cache-on-read=yes,cache-block-size=4K,cache-max-size=32K",
        dir.path(),
    );
    let mut buf = vec![0u8; 4096];
    stack.read(&mut buf, 0).unwrap();
    let mut map = Map::default();
    let lease = stack
        .map(0, 4096, MapFor::Read { holes: false }, &mut map)
        .unwrap();
    let Some(Place::File { fd, .. }) = map.single().map(|s| &s.place) else {
        panic!("block 0 is held: {map:?}");
    };
    let fd = *fd;
    // Many more blocks than the cache keeps: block 0 is the oldest, yet stays while leased.
    for n in 1..64u64 {
        stack.read(&mut buf, n * 4096).unwrap();
    }
    let mut got = vec![0u8; 4096];
    read_fd(fd, &mut got, 0);
    assert_eq!(
        got,
        below.contents()[..4096],
        "the leased block was not punched out"
    );
    drop(lease);
    for n in 64..128u64 {
        stack.read(&mut buf, n * 4096).unwrap();
    }
    let _lease = stack
        .map(0, 4096, MapFor::Read { holes: false }, &mut map)
        .unwrap();
    assert!(
        matches!(map.single().map(|s| &s.place), Some(Place::Stack)),
        "once the read ended, block 0 could leave"
    );
}
