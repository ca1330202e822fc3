use super::bitmap::DIRTY as DIRTY_FLAG;
use super::*;
use crate::export::{memory_backend, MapFor, Stack, ZeroFlags};

const G: u64 = 64 << 10;
const SIZE: u64 = 64 * G;

fn tracked(home: BitmapHome) -> (Stack, Arc<Bitmaps>) {
    let bitmaps = Arc::new(Bitmaps::new("e", SIZE, home, G, None));
    let layer: Arc<dyn Layer> = Arc::new(Tracking(Arc::clone(&bitmaps)));
    let base = Arc::new(memory_backend(SIZE).unwrap());
    (Stack::new(base, vec![layer], false), bitmaps)
}

fn dirty(stack: &Stack, name: &str) -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    let context = format!("{DIRTY_BITMAP_PREFIX}{name}");
    stack.meta_extents(&context, 0, SIZE, 64, &mut out).unwrap();
    out.iter().map(|e| (e.length, e.flags)).collect()
}

#[test]
fn every_kind_of_change_is_recorded_in_every_bitmap() {
    let (stack, bitmaps) = tracked(BitmapHome::Memory);
    bitmaps.add("a", None).unwrap();
    bitmaps.add("b", Some(2 * G)).unwrap();
    assert_eq!(
        stack.meta_contexts(),
        ["qemu:dirty-bitmap:a", "qemu:dirty-bitmap:b"]
    );
    assert_eq!(dirty(&stack, "a"), [(SIZE, 0)]);
    stack.write(&[1; 10], G, false).unwrap();
    stack.trim(4 * G, G, false).unwrap();
    let zero = ZeroFlags {
        may_trim: true,
        fast: false,
        fua: false,
    };
    stack.zero(8 * G, G, zero).unwrap();
    // A write an engine landed in place itself.
    let mut map = crate::export::Map::default();
    let _lease = stack.map(12 * G, G, MapFor::Write, &mut map).unwrap();
    stack.wrote_in_place(12 * G, G);
    assert_eq!(
        dirty(&stack, "a"),
        [
            (G, 0),
            (G, DIRTY_FLAG),
            (2 * G, 0),
            (G, DIRTY_FLAG),
            (3 * G, 0),
            (G, DIRTY_FLAG),
            (3 * G, 0),
            (G, DIRTY_FLAG),
            (51 * G, 0)
        ]
    );
    // Granularity 128 KiB: the first write dirties [0, 2G).
    assert_eq!(dirty(&stack, "b")[0], (2 * G, DIRTY_FLAG));
    bitmaps.clear("a").unwrap();
    assert_eq!(dirty(&stack, "a"), [(SIZE, 0)]);
    assert_eq!(
        dirty(&stack, "b")[0],
        (2 * G, DIRTY_FLAG),
        "clearing one leaves the other"
    );
}

#[test]
fn a_removed_bitmap_is_no_longer_offered_or_answered() {
    let (stack, bitmaps) = tracked(BitmapHome::Memory);
    bitmaps.add("a", None).unwrap();
    assert!(matches!(
        bitmaps.add("a", None),
        Err(TrackingError::Exists { .. })
    ));
    bitmaps.remove("a").unwrap();
    assert!(stack.meta_contexts().is_empty());
    let mut out = Vec::new();
    let err = stack
        .meta_extents("qemu:dirty-bitmap:a", 0, SIZE, 4, &mut out)
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    assert!(matches!(
        bitmaps.clear("a"),
        Err(TrackingError::NoSuch { .. })
    ));
    assert!(matches!(
        bitmaps.remove("a"),
        Err(TrackingError::NoSuch { .. })
    ));
}

#[test]
fn names_and_counts_are_bounded() {
    let (_stack, bitmaps) = tracked(BitmapHome::Memory);
    for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(1024)] {
        assert!(
            matches!(bitmaps.add(bad, None), Err(TrackingError::Name(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(
        bitmaps.add("g", Some(1000)),
        Err(TrackingError::Bitmap { .. })
    ));
    for i in 0..TRACKED_BITMAPS_MAX {
        bitmaps.add(&format!("b{i}"), None).unwrap();
    }
    assert!(matches!(
        bitmaps.add("one-more", None),
        Err(TrackingError::TooMany { .. })
    ));
}

#[test]
fn bitmaps_in_files_survive_a_clean_stop_and_not_an_unclean_one() {
    let dir = tempfile::tempdir().unwrap();
    let home = BitmapHome::Files {
        dir: dir.path().to_owned(),
        stem: "disk.img".into(),
    };
    let (stack, bitmaps) = tracked(home.clone());
    bitmaps.add("a", None).unwrap();
    assert!(dir.path().join("disk.img.a.zcnbd-bitmap").exists());
    stack.write(&[1; 10], 3 * G, false).unwrap();
    drop(stack);
    drop(bitmaps); // saved on drop
    let (stack, bitmaps) = tracked(home.clone());
    bitmaps.add("a", None).unwrap();
    assert_eq!(
        dirty(&stack, "a"),
        [(3 * G, 0), (G, DIRTY_FLAG), (60 * G, 0)]
    );
    // Killed: nothing saved, the file still says in use.
    std::mem::forget(bitmaps);
    drop(stack);
    // (The forgotten bitmaps keep the file locked: look at what the next server sees
    // through a copy.)
    let copy = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir.path().join("disk.img.a.zcnbd-bitmap"),
        copy.path().join("disk.img.a.zcnbd-bitmap"),
    )
    .unwrap();
    let home = BitmapHome::Files {
        dir: copy.path().to_owned(),
        stem: "disk.img".into(),
    };
    let (stack, bitmaps) = tracked(home);
    bitmaps.add("a", None).unwrap();
    assert_eq!(dirty(&stack, "a"), [(SIZE, DIRTY_FLAG)]);
    bitmaps.remove("a").unwrap();
    assert!(!copy.path().join("disk.img.a.zcnbd-bitmap").exists());
}

/// A source that has dirty bitmaps of its own (as an NBD upstream or a qcow2 image does):
/// `qemu:dirty-bitmap:a` all dirty.
#[derive(Debug)]
struct SourceWithBitmap;

impl Layer for SourceWithBitmap {
    fn name(&self) -> &'static str {
        "source-with-bitmap"
    }
    fn meta_contexts(&self, _next: &dyn Backend) -> Vec<String> {
        vec!["qemu:dirty-bitmap:a".into()]
    }
    fn meta_extents(
        &self,
        _next: &dyn Backend,
        context: &str,
        _offset: u64,
        len: u64,
        _extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        assert_eq!(context, "qemu:dirty-bitmap:a");
        out.push(Extent {
            length: len,
            flags: DIRTY_FLAG,
        });
        Ok(())
    }
}

#[test]
fn a_bitmap_of_the_source_wins_over_a_tracked_one_of_the_same_name() {
    let bitmaps = Arc::new(Bitmaps::new("e", SIZE, BitmapHome::Memory, G, None));
    let base: Arc<dyn Backend> = Arc::new(memory_backend(SIZE).unwrap());
    let layers: Vec<Arc<dyn Layer>> = vec![
        Arc::new(SourceWithBitmap),
        Arc::new(Tracking(Arc::clone(&bitmaps))),
    ];
    let stack = Stack::new(base, layers, false);
    // Tracked "a" (clean, nothing written) and "b": "a" is offered once, as the source's.
    bitmaps.add("a", None).unwrap();
    bitmaps.add("b", None).unwrap();
    assert_eq!(
        stack.meta_contexts(),
        ["qemu:dirty-bitmap:a", "qemu:dirty-bitmap:b"]
    );
    assert_eq!(
        dirty(&stack, "a"),
        [(SIZE, DIRTY_FLAG)],
        "the source's answer"
    );
    assert_eq!(dirty(&stack, "b"), [(SIZE, 0)], "the tracked one's answer");
}
