//! Images made with imago itself (the interop suite checks them against qemu-img and
//! qemu-nbd): reads through a backing chain, where the map sends them, block status,
//! zeroing, and the refusals.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use zcnbd_proto::consts::state;
use zcnbd_proto::Extent;

use super::*;

const MIB: u64 = 1 << 20;
const CLUSTER: u64 = 64 << 10;

fn create_qcow2(path: &Path, size: u64, backing: Option<(&str, &str)>) {
    let backing = backing.map(|(name, format)| (name, ImageFormat::named(format).unwrap()));
    super::create_qcow2(path, size, CLUSTER as usize, backing).unwrap();
}

fn rw() -> OpenOptions {
    OpenOptions {
        writable: true,
        force_share: false,
        direct: false,
    }
}

/// A 4 MiB raw base whose first 2 MiB hold 0xaa (the rest a hole) under a qcow2 overlay.
fn chain(dir: &Path) -> PathBuf {
    let base = dir.join("base.raw");
    let f = File::create(&base).unwrap();
    f.set_len(4 * MIB).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &vec![0xaa; 2 * MIB as usize], 0).unwrap();
    let top = dir.join("top.qcow2");
    create_qcow2(&top, 4 * MIB, Some(("base.raw", "raw")));
    top
}

/// [`chain`] in `dir`, opened for writing.
fn open_chain(dir: &Path) -> ImageBackend {
    ImageBackend::open(&chain(dir), ImageFormat::Qcow2, rw(), Default::default()).unwrap()
}

fn extents(b: &ImageBackend, depth: bool) -> Vec<(u64, u32)> {
    let mut out: Vec<Extent> = Vec::new();
    if depth {
        b.meta_extents(ALLOCATION_DEPTH, 0, 4 * MIB, 64, &mut out)
            .unwrap();
    } else {
        b.extents(0, 4 * MIB, 64, &mut out).unwrap();
    }
    out.iter().map(|e| (e.length, e.flags)).collect()
}

#[test]
fn reads_come_from_the_layer_that_has_the_data_and_writes_stay_on_top() {
    let dir = tempfile::tempdir().unwrap();
    let b = open_chain(dir.path());
    assert_eq!(b.size(), 4 * MIB);
    let mut buf = vec![0u8; 4096];
    b.pread(&mut buf, MIB).unwrap();
    assert!(buf.iter().all(|&x| x == 0xaa));
    b.pwrite(&[0x55; 4096], MIB + 4096, false).unwrap();
    b.pread(&mut buf, MIB + 4096).unwrap();
    assert!(buf.iter().all(|&x| x == 0x55));
    // Copy-on-write kept the rest of the cluster from the base.
    b.pread(&mut buf, MIB).unwrap();
    assert!(buf.iter().all(|&x| x == 0xaa));
    b.flush().unwrap();
    let raw = std::fs::read(dir.path().join("base.raw")).unwrap();
    assert!(raw[..2 * MIB as usize].iter().all(|&x| x == 0xaa));
}

#[test]
fn the_map_names_the_file_of_each_layer() {
    let dir = tempfile::tempdir().unwrap();
    let b = open_chain(dir.path());
    b.pwrite(&[1; CLUSTER as usize], 0, false).unwrap();
    let mut map = Map::default();
    let read = MapFor::Read { holes: true };
    b.map(0, CLUSTER, read, &mut map).unwrap();
    let Some(Place::File { fd: top_fd, .. }) = map.single().map(|s| &s.place) else {
        panic!("an allocated cluster is not in the image file: {map:?}");
    };
    let top_fd = *top_fd;
    map.clear();
    b.map(MIB, CLUSTER, read, &mut map).unwrap();
    match map.single().map(|s| &s.place) {
        Some(Place::File { fd, offset }) => assert!(*fd != top_fd && *offset == MIB),
        other => panic!("a backing cluster is not in the base file: {other:?}"),
    }
    assert!(!map.dsync_is_fua);
    // Writes: in place where the image owns the cluster, through the stack where it must
    // allocate first.
    map.clear();
    b.map(0, CLUSTER, MapFor::Write, &mut map).unwrap();
    assert!(
        matches!(map.single().map(|s| &s.place), Some(Place::File { fd, .. }) if *fd == top_fd)
    );
    map.clear();
    b.map(MIB, CLUSTER, MapFor::Write, &mut map).unwrap();
    assert!(matches!(map.single().map(|s| &s.place), Some(Place::Stack)));
}

/// A 4 KiB-aligned heap buffer of `len` bytes filled with `byte` (O_DIRECT's rule for memory).
fn aligned(len: usize, byte: u8) -> (Vec<u8>, usize) {
    let v = vec![byte; len + 4096];
    let skip = v.as_ptr().align_offset(4096);
    (v, skip)
}

/// Whether the backend's descriptor `fd` was opened with O_DIRECT (its fdinfo's flags).
fn opened_direct(fd: std::os::fd::RawFd) -> bool {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
        .unwrap();
    flags & rustix::fs::OFlags::DIRECT.bits() != 0
}

#[test]
fn direct_maps_data_clusters_to_o_direct_descriptors_of_each_layer() {
    let dir = tempfile::tempdir().unwrap();
    let options = OpenOptions {
        direct: true,
        ..rw()
    };
    let b = ImageBackend::open(
        &chain(dir.path()),
        ImageFormat::Qcow2,
        options,
        Default::default(),
    )
    .unwrap();
    assert_eq!(b.medium(), Some(Medium::Direct));
    // Aligned guest data goes through imago to the O_DIRECT descriptor; unaligned (and
    // imago's tables) through the buffered one; both read back the same bytes.
    let (mut data, at) = aligned(CLUSTER as usize, 0x5a);
    b.pwrite(&data[at..at + CLUSTER as usize], 0, false)
        .unwrap();
    b.pwrite(&[0x11; 100], CLUSTER + 7, false).unwrap();
    data[at..at + CLUSTER as usize].fill(0);
    b.pread(&mut data[at..at + CLUSTER as usize], 0).unwrap();
    assert!(data[at..at + CLUSTER as usize].iter().all(|&x| x == 0x5a));
    let mut odd = [0u8; 100];
    b.pread(&mut odd, CLUSTER + 7).unwrap();
    assert_eq!(odd, [0x11; 100]);
    let mut map = Map::default();
    for (offset, how) in [
        (0, MapFor::Read { holes: true }),
        (0, MapFor::Write),
        (MIB, MapFor::Read { holes: true }),
    ] {
        map.clear();
        b.map(offset, CLUSTER, how, &mut map).unwrap();
        let Some(Place::Direct {
            direct,
            buffered,
            offset: place,
        }) = map.single().map(|s| &s.place)
        else {
            panic!("{offset} {how:?}: not an O_DIRECT place: {map:?}");
        };
        assert!(opened_direct(*direct) && !opened_direct(*buffered));
        // What an engine reads there with O_DIRECT is the cluster's data.
        let (mut got, g) = aligned(CLUSTER as usize, 0);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(format!("/proc/self/fd/{direct}"))
            .unwrap();
        let got_here = &mut got[g..g + CLUSTER as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file, got_here, *place).unwrap();
        let want = if offset == 0 { 0x5a } else { 0xaa };
        assert!(
            got[g..g + CLUSTER as usize].iter().all(|&x| x == want),
            "{offset}"
        );
    }
    b.flush().unwrap();
}

#[test]
fn a_map_never_waits_for_imago() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = open_chain(dir.path());
    let place = |b: &ImageBackend| {
        let mut map = Map::default();
        b.map(MIB, CLUSTER, MapFor::Read { holes: true }, &mut map)
            .unwrap();
        match map.single().map(|s| &s.place) {
            Some(Place::Stack) => "stack",
            Some(Place::File { .. }) => "file",
            other => panic!("{other:?}"),
        }
    };
    // Opened: a small image's tables are loaded at once.
    assert_eq!(place(&b), "file");
    // Not used recently: its L2 table may have to be read from the file.
    b.warm = map_gate::Warm::new(CLUSTER / 8 * CLUSTER);
    assert_eq!(place(&b), "stack");
    let mut buf = vec![0; 512];
    b.pread(&mut buf, MIB).unwrap();
    assert_eq!(place(&b), "file");
    // While another imago operation runs (it may hold imago's locks across disk I/O).
    let op = b.gate.op();
    assert_eq!(place(&b), "stack");
    drop(op);
    assert_eq!(place(&b), "file");
}

#[test]
fn block_status_describes_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let b = open_chain(dir.path());
    b.pwrite(&[1; CLUSTER as usize], 3 * MIB, false).unwrap();
    let hole = state::HOLE | state::ZERO;
    assert_eq!(
        extents(&b, false),
        [
            (2 * MIB, 0),
            (MIB, hole),
            (CLUSTER, 0),
            (MIB - CLUSTER, hole)
        ]
    );
    assert_eq!(
        extents(&b, true),
        [(3 * MIB, 2), (CLUSTER, 1), (MIB - CLUSTER, 2)]
    );
    assert_eq!(b.meta_contexts(), [ALLOCATION_DEPTH]);
}

#[test]
fn zeroing_marks_clusters_and_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let b = open_chain(dir.path());
    b.pwrite(&[7; 2 * CLUSTER as usize], 0, false).unwrap();
    let mut map = Map::default();
    b.map(0, CLUSTER, MapFor::Write, &mut map).unwrap();
    let before = format!("{map:?}");
    b.trim(0, CLUSTER, false).unwrap();
    let slow = ZeroFlags {
        fast: true,
        ..ZeroFlags::default()
    };
    assert!(matches!(
        b.zero(CLUSTER, 100, slow),
        Err(ZeroError::NotFast)
    ));
    b.zero(MIB, CLUSTER, slow).unwrap();
    let mut buf = vec![1u8; CLUSTER as usize];
    b.pread(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&x| x == 0));
    b.pread(&mut buf, MIB).unwrap();
    assert!(
        buf.iter().all(|&x| x == 0),
        "the base shows through a zeroed cluster"
    );
    b.pread(&mut buf, CLUSTER).unwrap();
    assert!(buf.iter().all(|&x| x == 7));
    // The trimmed cluster is still the image's, at the same place: nothing was freed.
    let mut depth = Vec::new();
    b.meta_extents(ALLOCATION_DEPTH, 0, CLUSTER, 1, &mut depth)
        .unwrap();
    assert_eq!(depth[0].flags, 1);
    b.pwrite(&[9; CLUSTER as usize], 0, false).unwrap();
    map.clear();
    b.map(0, CLUSTER, MapFor::Write, &mut map).unwrap();
    assert_eq!(format!("{map:?}"), before);
}

#[test]
fn broken_chains_and_unservable_images_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ro = OpenOptions {
        writable: false,
        force_share: false,
        direct: false,
    };
    let selfish = dir.path().join("self.qcow2");
    create_qcow2(&selfish, MIB, Some(("self.qcow2", "qcow2")));
    let err = ImageBackend::open(&selfish, ImageFormat::Qcow2, ro, Default::default()).unwrap_err();
    assert!(err.to_string().contains("loop"), "{err}");
    let a = dir.path().join("a.qcow2");
    let b = dir.path().join("b.qcow2");
    create_qcow2(&a, MIB, Some(("b.qcow2", "qcow2")));
    create_qcow2(&b, MIB, Some(("a.qcow2", "qcow2")));
    // imago wraps the gate's error in its own words about the backing file.
    let err = ImageBackend::open(&a, ImageFormat::Qcow2, ro, Default::default()).unwrap_err();
    assert!(err.to_string().contains("loop"), "{err}");
    let missing = dir.path().join("missing.qcow2");
    create_qcow2(&missing, MIB, Some(("nowhere.raw", "raw")));
    let err = ImageBackend::open(&missing, ImageFormat::Qcow2, ro, Default::default()).unwrap_err();
    assert!(err.to_string().contains("nowhere.raw"), "{err}");
    let device = dir.path().join("device.qcow2");
    create_qcow2(&device, MIB, Some(("/dev/zero", "raw")));
    let err = ImageBackend::open(&device, ImageFormat::Qcow2, ro, Default::default()).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
    // Encrypted: the header says so at byte 32.
    let encrypted = dir.path().join("luks.qcow2");
    create_qcow2(&encrypted, MIB, None);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&encrypted)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &2u32.to_be_bytes(), 32).unwrap();
    assert!(matches!(
        ImageBackend::open(&encrypted, ImageFormat::Qcow2, rw(), Default::default()),
        Err(ImageError::Unsupported { .. })
    ));
}

#[test]
fn a_deep_chain_stops_at_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let name = |i: usize| format!("l{i}.qcow2");
    let depth = BACKING_DEPTH_MAX + 2;
    for i in 0..depth {
        let backing = (i + 1 < depth).then(|| name(i + 1));
        create_qcow2(
            &dir.path().join(name(i)),
            MIB,
            backing.as_deref().map(|b| (b, "qcow2")),
        );
    }
    let ro = OpenOptions {
        writable: false,
        force_share: false,
        direct: false,
    };
    let err = ImageBackend::open(
        &dir.path().join(name(0)),
        ImageFormat::Qcow2,
        ro,
        Default::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("BACKING_DEPTH_MAX"), "{err}");
}

#[test]
fn a_writer_locks_out_others_as_qemu_does() {
    let dir = tempfile::tempdir().unwrap();
    let top = chain(dir.path());
    let _writer = ImageBackend::open(&top, ImageFormat::Qcow2, rw(), Default::default()).unwrap();
    assert!(matches!(
        ImageBackend::open(&top, ImageFormat::Qcow2, rw(), Default::default()),
        Err(ImageError::Locked { .. })
    ));
    let shared = OpenOptions {
        writable: false,
        force_share: true,
        direct: false,
    };
    ImageBackend::open(&top, ImageFormat::Qcow2, shared, Default::default()).unwrap();
}

#[test]
fn an_overlay_takes_the_writes_and_leaves_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let top = chain(dir.path());
    let before = std::fs::read(&top).unwrap();
    let b = overlay_over_file(&top, ImageFormat::Qcow2, false, dir.path()).unwrap();
    b.pwrite(&[3; 4096], 0, true).unwrap();
    let mut buf = vec![0u8; 4096];
    b.pread(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&x| x == 3));
    b.pread(&mut buf, MIB).unwrap();
    assert!(buf.iter().all(|&x| x == 0xaa));
    // The overlay is depth 1, the image 2, its raw base 3.
    assert_eq!(extents(&b, true), [(CLUSTER, 1), (4 * MIB - CLUSTER, 3)]);
    drop(b);
    assert_eq!(std::fs::read(&top).unwrap(), before, "the base was written");
    // Nothing is left in the directory but what was there.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 2);
}

/// The lease rule through the stack: while an engine holds a write map's lease on a cluster,
/// a write through the stack to that cluster (which may reallocate it) waits, new maps of it
/// are "not mappable now", other clusters go on, and the image refuses a change that comes
/// around the stack while a lease is held.
#[test]
fn a_leased_cluster_is_never_changed_under_an_engine() {
    use crate::export::Stack;
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let b = open_chain(dir.path());
    b.pwrite(&[1; CLUSTER as usize], 0, false).unwrap();
    let base: Arc<dyn Backend> = Arc::new(b);
    let stack = Arc::new(Stack::of(Arc::clone(&base), false));
    assert!(stack.changes_wait() && !stack.never_waits());
    let mut map = Map::default();
    let lease = stack.map(4096, 4096, MapFor::Write, &mut map).unwrap();
    assert!(matches!(
        map.single().map(|s| &s.place),
        Some(Place::File { .. })
    ));
    // Around the stack: refused, never done.
    let err = base.pwrite(&[2; 512], 0, false).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    // Through the stack: waits for the lease.
    let (tx, rx) = mpsc::channel();
    let writer = {
        let stack = Arc::clone(&stack);
        std::thread::spawn(move || {
            stack.write(&[3; 512], 512, false).unwrap();
            tx.send(()).unwrap();
        })
    };
    assert!(
        rx.recv_timeout(Duration::from_millis(100)).is_err(),
        "it waits"
    );
    // Meanwhile the cluster is not mappable, and another is.
    let mut other = Map::default();
    let none = stack.map(8192, 512, MapFor::Write, &mut other).unwrap();
    assert!(matches!(
        other.single().map(|s| &s.place),
        Some(Place::Stack)
    ));
    drop(none);
    let apart = stack
        .map(2 * MIB, 4096, MapFor::Read { holes: false }, &mut other)
        .unwrap();
    assert!(!matches!(
        other.single().map(|s| &s.place),
        Some(Place::Stack)
    ));
    drop(apart);
    drop(lease);
    rx.recv_timeout(Duration::from_secs(5))
        .expect("the write ran");
    writer.join().unwrap();
    let mut buf = [0u8; 1024];
    stack.read(&mut buf, 0).unwrap();
    assert_eq!(&buf[..512], &[1; 512]);
    assert_eq!(&buf[512..], &[3; 512]);
}
