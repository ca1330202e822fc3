//! The body of the `qcow2_bitmaps` fuzz target (`fuzz/fuzz_targets/qcow2_bitmaps.rs`), here
//! so that the unit tests replay `fuzz/regressions/qcow2_bitmaps/` and their generated
//! damaged images through the same code. Not part of the server: it panics, on purpose, when
//! an invariant breaks.

use std::fs::File;
use std::os::unix::fs::FileExt;

use rustix::fs::{memfd_create, MemfdFlags};
use zcnbd_proto::Extent;

use super::{BitmapDirectory, DirtyBitmap, STATE_DIRTY};

/// The memory one bitmap may take here: small enough for libFuzzer's `-malloc_limit_mb`
/// and a fast run, large enough for a 512 MiB disk at 64 KiB granularity.
pub const FUZZ_BITMAP_BYTES_MAX: u64 = 1 << 20;
/// The most extents one query asks for.
const FUZZ_EXTENTS_MAX: usize = 4096;

/// Takes `data` as a whole image file: reads its bitmap directory, loads every bitmap and
/// asks each for block status over a few ranges. Every failure must be an error, never a
/// panic; every answer must describe the range asked and agree with the bits.
pub fn run(data: &[u8]) {
    let file = image_file(data);
    let Ok(directory) = BitmapDirectory::read(&file, data.len() as u64) else {
        return;
    };
    for entry in directory.entries() {
        assert!(entry.flags_offset + 4 <= data.len() as u64, "{entry:?}");
        match directory.load(&file, &entry.name, FUZZ_BITMAP_BYTES_MAX) {
            Ok(bitmap) => check_queries(&bitmap),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}

/// `data` in a memory file.
fn image_file(data: &[u8]) -> File {
    let fd = memfd_create("zcnbd-fuzz-bitmaps", MemfdFlags::CLOEXEC).expect("memfd");
    let file = File::from(fd);
    file.write_all_at(data, 0).expect("write the image");
    file
}

/// Block status of the whole disk and of ranges cut inside granules, at several limits.
fn check_queries(bitmap: &DirtyBitmap) {
    let size = bitmap.virtual_bytes();
    let g = bitmap.granularity_bytes();
    let queries = [
        (0, size, FUZZ_EXTENTS_MAX),
        (0, size, 1),
        (0, u64::MAX, 2),
        (size / 3, size / 2 + 1, 3),
        (g - 1, 2 * g + 1, 8),
        (size.saturating_sub(1), 10, 4),
        (size, 1, 4),
    ];
    let mut out = Vec::new();
    for (offset, len, max) in queries {
        out.clear();
        bitmap.extents(offset, len, max, &mut out);
        check_extents(bitmap, offset, len, max, &out);
    }
}

/// Each extent has a length and a known flag, neighbours differ, each agrees with the bits
/// at both its ends, inner edges fall on granules, and the list covers the range (clipped
/// to the disk) unless it stopped at `max`.
fn check_extents(bitmap: &DirtyBitmap, offset: u64, len: u64, max: usize, out: &[Extent]) {
    let end = offset.saturating_add(len).min(bitmap.virtual_bytes());
    let want = end.saturating_sub(offset);
    assert!(out.len() <= max, "{} extents, max {max}", out.len());
    let mut pos = offset;
    for (i, e) in out.iter().enumerate() {
        assert!(e.length > 0, "empty extent {i}: {out:?}");
        assert!(
            e.flags == 0 || e.flags == STATE_DIRTY,
            "flags {:#x}",
            e.flags
        );
        if i > 0 {
            assert_ne!(out[i - 1].flags, e.flags, "neighbours {i} not joined");
            assert!(pos.is_multiple_of(bitmap.granularity_bytes()), "edge {pos}");
        }
        let last = pos + e.length - 1;
        let dirty = e.flags == STATE_DIRTY;
        assert_eq!(bitmap.is_dirty(pos), dirty, "extent {i} at {pos}");
        assert_eq!(bitmap.is_dirty(last), dirty, "extent {i} to {last}");
        pos += e.length;
    }
    assert!(pos - offset <= want, "past the range: {out:?}");
    if out.len() < max {
        assert_eq!(pos - offset, want, "short of the range: {out:?}");
    }
}
