//! Bitmaps of synthetic images (`test_image.rs`): listing, loading, block status against a
//! bit-by-bit model, every refusal, and damaged images (every prefix, thousands of random
//! byte flips, the fuzz target's saved inputs) through the fuzz target's body.

use std::path::Path;

use zcnbd_proto::Extent;

use super::test_image::{file_of, Built, TestBitmap, TestImage};
use super::*;

const MIB: u64 = 1 << 20;
const LIMIT: u64 = BITMAP_BYTES_MAX_DEFAULT;

/// A change that makes a bitmap unusable, and what the refusal must say.
type Sickness = (fn(&mut TestBitmap), &'static str);
/// Damage to an image, and what the refusal must say.
type Damage = (Box<dyn Fn(&mut Built)>, &'static str);

fn read(built: &Built) -> Result<BitmapDirectory, BitmapError> {
    BitmapDirectory::read(&built.file(), built.bytes.len() as u64)
}

fn load(built: &Built, name: &str) -> Result<DirtyBitmap, BitmapError> {
    let file = built.file();
    BitmapDirectory::read(&file, built.bytes.len() as u64)?.load(&file, name, LIMIT)
}

/// `(offset, length, flags)` of the extents of `[offset, offset+len)`.
fn extents(b: &DirtyBitmap, offset: u64, len: u64, max: usize) -> Vec<(u64, u64, u32)> {
    let mut out: Vec<Extent> = Vec::new();
    b.extents(offset, len, max, &mut out);
    let mut pos = offset;
    out.iter()
        .map(|e| {
            pos += e.length;
            (pos - e.length, e.length, e.flags)
        })
        .collect()
}

/// The extents a bit-by-bit walk of the model gives for the whole disk.
fn model(image: &TestImage, b: &TestBitmap) -> Vec<(u64, u64, u32)> {
    let g = 1u64 << b.granularity_bits;
    let mut out: Vec<(u64, u64, u32)> = Vec::new();
    for i in 0..b.bits(image.virtual_bytes) {
        let flags = u32::from(b.granule_dirty(i) || ones(image, b, i));
        let (start, end) = (i * g, ((i + 1) * g).min(image.virtual_bytes));
        match out.last_mut() {
            Some(last) if last.2 == flags => last.1 += end - start,
            _ => out.push((start, end - start, flags)),
        }
    }
    out
}

/// Whether granule `i` is in an all-ones table entry.
fn ones(image: &TestImage, b: &TestBitmap, i: u64) -> bool {
    let per_cluster = 8u64 << image.cluster_bits;
    b.all_ones.contains(&((i / per_cluster) as usize))
}

fn two_bitmaps() -> TestImage {
    TestImage::new(vec![
        TestBitmap::new("b0", 16).dirty(&[(MIB, 64 << 10), (3 * MIB, 1024)]),
        TestBitmap {
            flags: 0,
            ..TestBitmap::new("disabled één", 21).dirty(&[(5 * MIB, 1)])
        },
    ])
}

#[test]
fn bitmaps_are_listed_with_their_flags_and_where_the_flags_are() {
    let built = two_bitmaps().build();
    let dir = read(&built).unwrap();
    assert!(matches!(dir.extension(), Extension::Present(_)));
    assert_eq!(dir.shape().cluster_bytes, 64 << 10);
    assert_eq!(dir.shape().virtual_bytes, 64 * MIB);
    let e = dir.entries();
    assert_eq!(e.len(), 2);
    assert_eq!(
        (e[0].name.as_str(), e[0].granularity_bytes()),
        ("b0", Some(64 << 10))
    );
    assert!(e[0].auto() && !e[0].in_use());
    assert_eq!(e[1].name, "disabled één");
    assert_eq!(e[1].granularity_bytes(), Some(2 * MIB));
    assert!(!e[1].auto());
    for (entry, &at) in e.iter().zip(&built.entry_at) {
        assert_eq!(entry.flags_offset, at as u64 + 12);
        let f = &built.bytes[at + 12..at + 16];
        assert_eq!(u32::from_be_bytes(f.try_into().unwrap()), entry.flags);
    }
}

#[test]
fn bitmaps_extents_are_runs_of_equal_bits_clipped_to_the_request() {
    let image = two_bitmaps();
    let built = image.build();
    let b0 = load(&built, "b0").unwrap();
    assert_eq!(b0.context(), "qemu:dirty-bitmap:b0");
    assert_eq!(b0.memory_bytes(), 128);
    let k = 64 << 10;
    assert_eq!(
        extents(&b0, 0, 64 * MIB, 100),
        vec![
            (0, MIB, 0),
            (MIB, k, STATE_DIRTY),
            (MIB + k, 2 * MIB - k, 0),
            (3 * MIB, k, STATE_DIRTY),
            (3 * MIB + k, 61 * MIB - k, 0),
        ]
    );
    assert_eq!(
        extents(&b0, 0, 64 * MIB, 100),
        model(&image, &image.bitmaps[0])
    );
    // Cut inside granules at both ends, and by extents_max.
    assert_eq!(
        extents(&b0, MIB + 100, k, 100),
        vec![(MIB + 100, k - 100, STATE_DIRTY), (MIB + k, 100, 0)]
    );
    assert_eq!(extents(&b0, 0, 64 * MIB, 2).len(), 2);
    assert_eq!(extents(&b0, 0, 64 * MIB, 0), vec![]);
    // Past the end: clipped, or nothing.
    assert_eq!(
        extents(&b0, 64 * MIB - 1, 10, 9),
        vec![(64 * MIB - 1, 1, 0)]
    );
    assert_eq!(extents(&b0, 64 * MIB, 10, 9), vec![]);
    assert_eq!(extents(&b0, 0, u64::MAX, 9).len(), 5);
    let disabled = load(&built, "disabled één").unwrap();
    assert_eq!(
        extents(&disabled, 0, 64 * MIB, 9),
        vec![
            (0, 4 * MIB, 0),
            (4 * MIB, 2 * MIB, 1),
            (6 * MIB, 58 * MIB, 0)
        ]
    );
}

#[test]
fn bitmaps_with_many_table_entries_and_all_ones_entries_match_the_model() {
    // 512-byte clusters and granules: 4096 bits a cluster, 32 table entries for 64 MiB; a
    // disk size that ends inside a granule; entries 3 and the last all ones.
    let mut b = TestBitmap::new("fine", 9).dirty(&[
        (0, 1),
        (1000, 5000),
        (2 * MIB - 1, 2),
        (10 * MIB + 512, 512),
        (20 * MIB, 3 * MIB),
    ]);
    b.all_ones = vec![3, 32];
    let image = TestImage {
        cluster_bits: 9,
        virtual_bytes: 64 * MIB + 700,
        autoclear: 1,
        bitmaps: vec![b, TestBitmap::new("coarse", 31).dirty(&[(7, 1)])],
    };
    let built = image.build();
    for (i, want) in image.bitmaps.iter().enumerate() {
        let got = load(&built, &want.name).unwrap();
        let whole = extents(&got, 0, image.virtual_bytes, usize::MAX);
        assert_eq!(whole, model(&image, want), "{}", want.name);
        assert_eq!(
            whole.last().unwrap().0 + whole.last().unwrap().1,
            image.virtual_bytes
        );
        // Every granule's bit, through is_dirty.
        let g = 1u64 << want.granularity_bits;
        for i in 0..want.bits(image.virtual_bytes) {
            let dirty = want.granule_dirty(i) || ones(&image, want, i);
            assert_eq!(got.is_dirty(i * g + g / 2), dirty, "granule {i}");
        }
        // Past the last granule, nothing is dirty.
        let past = want.bits(image.virtual_bytes) * g;
        assert!(!got.is_dirty(past) && !got.is_dirty(u64::MAX), "bitmap {i}");
    }
    let fine = load(&built, "fine").unwrap();
    // All of table entry 3 (granules 3*4096..4*4096: 6 MiB to 8 MiB) is dirty.
    assert_eq!(
        extents(&fine, 6 * MIB - 512, 2 * MIB + 1024, 9),
        vec![
            (6 * MIB - 512, 512, 0),
            (6 * MIB, 2 * MIB, STATE_DIRTY),
            (8 * MIB, 512, 0)
        ]
    );
    // The last entry, all ones: its bits past the disk's end do not count.
    assert_eq!(
        extents(&fine, 64 * MIB, 700, 9),
        vec![(64 * MIB, 700, STATE_DIRTY)]
    );
}

#[test]
fn bitmaps_that_cannot_be_served_are_refused_by_name() {
    let cases: [Sickness; 7] = [
        (|b| b.flags |= 1, "in use"),
        (|b| b.kind = 2, "type 2"),
        (|b| b.granularity_bits = 8, "granularity_bits 8"),
        (|b| b.granularity_bits = 32, "granularity_bits 32"),
        (|b| b.flags |= 1 << 3, "unknown flags 0x8"),
        (|b| b.extra = vec![1, 2, 3], "3 bytes of extra data"),
        (|b| b.flags |= 1 << 9, "unknown flags 0x200"),
    ];
    for (damage, why) in cases {
        let mut b = TestBitmap::new("sick", 16);
        damage(&mut b);
        let image = TestImage::new(vec![TestBitmap::new("fine", 16), b]);
        let built = image.build();
        let dir = read(&built).unwrap();
        assert_eq!(dir.entries().len(), 2, "{why}: still listed");
        let e = load(&built, "sick").unwrap_err().to_string();
        assert!(e.contains("\"sick\"") && e.contains(why), "{why}: {e}");
        load(&built, "fine").unwrap();
    }
    // Extra data marked compatible may be ignored.
    let mut b = TestBitmap::new("extra", 16).dirty(&[(0, 1)]);
    b.extra = vec![9; 5];
    b.flags |= 1 << 2;
    let loaded = load(&TestImage::new(vec![b]).build(), "extra").unwrap();
    assert!(loaded.is_dirty(0) && !loaded.is_dirty(64 << 10));
}

#[test]
fn an_in_use_bitmap_is_refused_with_how_to_repair_it() {
    let mut b = TestBitmap::new("b0", 16);
    b.flags |= 1;
    let err = load(&TestImage::new(vec![b]).build(), "b0").unwrap_err();
    assert!(matches!(err, BitmapError::InUse { .. }), "{err}");
    assert!(
        err.to_string().contains("qemu-img bitmap --remove"),
        "{err}"
    );
}

#[test]
fn a_bitmap_over_the_memory_limit_is_refused_with_the_numbers() {
    // 64 MiB at 512-byte granules: 131072 bits, 16 KiB.
    let built = TestImage::new(vec![TestBitmap::new("b0", 9)]).build();
    let file = built.file();
    let dir = BitmapDirectory::read(&file, built.bytes.len() as u64).unwrap();
    let err = dir.load(&file, "b0", 16 * 1024 - 8).unwrap_err();
    assert!(
        matches!(
            err,
            BitmapError::TooLarge {
                bits: 131072,
                bytes: 16384,
                limit: 16376,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("16384 bytes"), "{err}");
    assert_eq!(
        dir.load(&file, "b0", 16 * 1024).unwrap().memory_bytes(),
        16384
    );
}

#[test]
fn damaged_bitmap_tables_are_refused_by_name() {
    let image = TestImage::new(vec![TestBitmap::new("b0", 9).dirty(&[(0, MIB)])]);
    let base = image.build();
    let (entry, table) = (base.entry_at[0], base.table_at[0]);
    let file_bytes = base.bytes.len() as u64;
    let cases: Vec<Damage> = vec![
        (Box::new(move |b| b.put_u32(entry + 8, 2)), "2 entries"),
        (Box::new(move |b| b.put_u32(entry + 8, 0)), "0 entries"),
        (
            Box::new(move |b| b.put_u64(entry, 0)),
            "offset 0x0 is not a cluster's",
        ),
        (
            Box::new(move |b| b.put_u64(entry, table as u64 + 8)),
            "is not a cluster's",
        ),
        (
            Box::new(move |b| b.put_u64(entry, file_bytes)),
            "outside the file",
        ),
        (
            Box::new(move |b| b.put_u64(entry, !0xffff)),
            "outside the file",
        ),
        (Box::new(move |b| b.put_u64(table, 1 << 60)), "malformed"),
        (Box::new(move |b| b.put_u64(table, 2)), "malformed"),
        (
            Box::new(move |b| b.put_u64(table, (64 << 10) | 1)),
            "malformed",
        ),
        (
            Box::new(move |b| b.put_u64(table, (64 << 10) + 512)),
            "malformed",
        ),
        (
            Box::new(move |b| b.put_u64(table, 1 << 40)),
            "outside the file",
        ),
    ];
    for (damage, why) in cases {
        let mut built = base.clone();
        damage(&mut built);
        let e = load(&built, "b0").unwrap_err();
        assert!(matches!(e, BitmapError::Damaged { .. }), "{why}: {e}");
        assert!(
            e.to_string().contains(why) && e.to_string().contains("\"b0\""),
            "{why}: {e}"
        );
    }
}

#[test]
fn damaged_bitmap_directories_are_refused() {
    let image = TestImage::new(vec![TestBitmap::new("b0", 16), TestBitmap::new("b1", 16)]);
    let base = image.build();
    let (ext, e0, e1) = (base.ext_at + 8, base.entry_at[0], base.entry_at[1]);
    let dir_bytes = (base.entry_at[1] - base.entry_at[0]) as u64 * 2;
    let cases: Vec<Damage> = vec![
        (Box::new(move |b| b.put_u16(e0 + 18, 0)), "name_size 0"),
        (
            Box::new(move |b| b.put_u16(e0 + 18, 1024)),
            "name_size 1024",
        ),
        (Box::new(move |b| b.put_u16(e1 + 18, 9)), "runs past"),
        (Box::new(move |b| b.put_u32(e1 + 20, u32::MAX)), "runs past"),
        (
            Box::new(move |b| b.put_u32(ext, 1)),
            "more bitmaps than the 1",
        ),
        (
            Box::new(move |b| b.put_u32(ext, 3)),
            "2 bitmaps where the extension says 3",
        ),
        (Box::new(move |b| b.put_u32(ext, 0)), "nb_bitmaps 0"),
        (Box::new(move |b| b.put_u32(ext, 65536)), "nb_bitmaps 65536"),
        (Box::new(move |b| b.put_u32(ext + 4, 1)), "reserved"),
        (Box::new(move |b| b.put_u64(ext + 8, 0)), "size 0"),
        (
            Box::new(move |b| b.put_u64(ext + 8, dir_bytes - 8)),
            "runs past",
        ),
        (
            Box::new(move |b| b.put_u64(ext + 8, (64 << 20) + 1)),
            "out of range",
        ),
        (
            Box::new(move |b| b.put_u64(ext + 8, u64::MAX)),
            "out of range",
        ),
        (Box::new(move |b| b.put_u64(ext + 16, 0)), "not a cluster's"),
        (
            Box::new(move |b| b.put_u64(ext + 16, 512)),
            "not a cluster's",
        ),
        (
            Box::new(move |b| b.put_u64(ext + 16, 1 << 40)),
            "outside the file",
        ),
        (
            Box::new(move |b| b.put_u64(ext + 16, !0xffff)),
            "outside the file",
        ),
        (Box::new(move |b| b.put_u32(ext - 4, 23)), "23 bytes"),
        (
            Box::new(move |b| b.bytes[e1 + 25] = b'0'),
            "two bitmaps are named \"b0\"",
        ),
        (Box::new(move |b| b.bytes[e1 + 24] = 0xff), "not UTF-8"),
        (
            Box::new(|b| {
                let ext = b.bytes[104..136].to_vec();
                b.bytes[136..168].copy_from_slice(&ext);
            }),
            "two bitmaps header extensions",
        ),
    ];
    for (damage, why) in cases {
        let mut built = base.clone();
        damage(&mut built);
        let e = read(&built).unwrap_err();
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
}

#[test]
fn damaged_headers_are_refused() {
    let base = TestImage::new(vec![TestBitmap::new("b0", 16)]).build();
    let cases: Vec<Damage> = vec![
        (Box::new(|b| b.bytes[0] = b'X'), "not a qcow2 image"),
        (Box::new(|b| b.put_u32(4, 4)), "version 4"),
        (Box::new(|b| b.put_u32(20, 22)), "cluster_bits 22"),
        (Box::new(|b| b.put_u32(100, 96)), "header_length 96"),
        (Box::new(|b| b.put_u32(100, 1 << 17)), "header_length"),
        (Box::new(|b| b.put_u64(8, 1 << 17)), "backing_file_offset"),
        // The extension runs past the backing file's name.
        (Box::new(|b| b.put_u64(8, 120)), "too large"),
        (Box::new(|b| b.put_u32(108, 1 << 16)), "too large"),
    ];
    for (damage, why) in cases {
        let mut built = base.clone();
        damage(&mut built);
        let e = read(&built).unwrap_err();
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
}

#[test]
fn bitmaps_are_ignored_without_the_autoclear_bit_as_qemu_ignores_them() {
    let mut image = two_bitmaps();
    image.autoclear = 0b10;
    let built = image.build();
    let dir = read(&built).unwrap();
    assert_eq!(dir.extension(), Extension::Ignored);
    assert!(dir.entries().is_empty());
    assert!(matches!(load(&built, "b0"), Err(BitmapError::Ignored)));
    // A version 2 image has no autoclear bits: its bitmaps are ignored too.
    let mut v2 = image.build();
    v2.put_u32(4, 2);
    v2.bytes.copy_within(104..144, 72);
    assert_eq!(read(&v2).unwrap().extension(), Extension::Ignored);
    // Even when the directory they point to is garbage.
    let mut junk = built.clone();
    junk.put_u64(junk.ext_at + 16, u64::MAX);
    assert_eq!(read(&junk).unwrap().extension(), Extension::Ignored);
}

#[test]
fn an_image_without_bitmaps_has_none_and_says_so() {
    let built = TestImage::new(vec![]).build();
    let mut plain = built.clone();
    plain.bytes[104..112].fill(0);
    let dir = read(&plain).unwrap();
    assert_eq!(dir.extension(), Extension::Absent);
    let e = dir.find("b0").unwrap_err().to_string();
    assert!(e.contains("\"b0\"") && e.contains("it has none"), "{e}");
    let many: Vec<TestBitmap> = (0..20)
        .map(|i| TestBitmap::new(&format!("m{i}"), 20))
        .collect();
    let built = TestImage::new(many).build();
    let e = read(&built).unwrap().find("x").unwrap_err().to_string();
    assert!(e.contains("\"m7\" and 12 more"), "{e}");
}

#[test]
fn bitmaps_of_a_file_shorter_than_its_length_says_are_io_errors() {
    let built = two_bitmaps().build();
    let file = built.file();
    let table_end = built.table_at[1] as u64 + 8;
    file.set_len(table_end).unwrap();
    // The directory is there, the data cluster of "b0" is not.
    let dir = BitmapDirectory::read(&file, built.bytes.len() as u64).unwrap();
    let e = dir.load(&file, "b0", LIMIT).unwrap_err();
    assert!(matches!(e, BitmapError::Io { .. }), "{e}");
    assert!(e.to_string().contains("bitmap \"b0\"'s data"), "{e}");
    file.set_len(1000).unwrap();
    let e = BitmapDirectory::read(&file, built.bytes.len() as u64).unwrap_err();
    assert!(e.to_string().contains("reading the qcow2 header"), "{e}");
}

/// A valid image with bitmaps of several shapes, for the damage tests: small, so that every
/// byte of it can be damaged.
fn small_image() -> Built {
    let mut ones = TestBitmap::new("ones", 9).dirty(&[(3000, 100)]);
    ones.all_ones = vec![1];
    TestImage {
        cluster_bits: 9,
        virtual_bytes: 5 * 4096 * 512 + 1000,
        autoclear: 1,
        bitmaps: vec![
            ones,
            TestBitmap::new("b", 12).dirty(&[(0, 1), (700_000, 9000)]),
            TestBitmap::new("c", 31),
        ],
    }
    .build()
}

#[test]
fn bitmaps_of_every_prefix_of_an_image_are_read_without_a_panic() {
    let built = small_image();
    for n in 0..built.bytes.len() {
        fuzz::run(&built.bytes[..n]);
    }
    fuzz::run(&built.bytes);
    for b in ["ones", "b", "c"] {
        load(&built, b).unwrap();
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// Random damage to the parts of `built` the reader looks at: the header's fields, the
/// extension, the directory and the tables, with values at the edges of their fields.
pub(super) fn damaged_images(built: &Built, count: usize, seed: u64, mut each: impl FnMut(&[u8])) {
    let mut rng = Rng(seed);
    let mut hot: Vec<usize> = (0..144).collect();
    hot.extend(built.dir_at..built.dir_at + 128);
    for &t in &built.table_at {
        hot.extend(t..t + 64);
    }
    hot.retain(|&i| i < built.bytes.len());
    for _ in 0..count {
        let mut bytes = built.bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let at = if rng.below(4) == 0 {
                rng.below(bytes.len() as u64) as usize
            } else {
                hot[rng.below(hot.len() as u64) as usize]
            };
            bytes[at] = match rng.below(5) {
                0 => 0,
                1 => 0xff,
                2 => bytes[at] ^ (1 << rng.below(8)),
                3 => bytes[at].wrapping_add(1),
                _ => rng.below(256) as u8,
            };
        }
        if rng.below(10) == 0 {
            bytes.truncate(rng.below(bytes.len() as u64 + 1) as usize);
        }
        each(&bytes);
    }
}

#[test]
fn bitmaps_of_randomly_damaged_images_are_errors_or_consistent() {
    let built = small_image();
    let mut loaded = 0;
    damaged_images(&built, 4000, 0x5eed, |bytes| {
        fuzz::run(bytes);
        let file = file_of(bytes);
        if let Ok(dir) = BitmapDirectory::read(&file, bytes.len() as u64) {
            loaded += dir
                .entries()
                .iter()
                .filter(|e| dir.load(&file, &e.name, LIMIT).is_ok())
                .count();
        }
    });
    // The damage is not so heavy that nothing is left to query.
    assert!(loaded > 1000, "{loaded} bitmaps loaded");
}

#[test]
fn bitmaps_fuzz_regressions_still_pass() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/qcow2_bitmaps");
    let Ok(files) = std::fs::read_dir(&dir) else {
        eprintln!("no saved inputs in {}", dir.display());
        return;
    };
    for f in files {
        let path = f.unwrap().path();
        if path.file_name().is_some_and(|n| n != "README.md") {
            fuzz::run(&std::fs::read(&path).unwrap());
        }
    }
}
