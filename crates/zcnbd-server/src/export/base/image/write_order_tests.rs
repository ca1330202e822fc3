//! The write order: kinds by offset, which writes wait, and a crash at any table or link
//! write (the file copied as it is then) leaves an image `qemu-img check` finds consistent.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicUsize;

use imago::qcow2::Qcow2;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, Storage};

use super::*;
use crate::export::base::image::create_qcow2;
use crate::export::base::image::header::probe;
use crate::sys::image_storage::ImageStorage;

const MIB: u64 = 1 << 20;

fn image(dir: &Path, cluster: usize) -> (Arc<ImageFile>, Qcow2Header) {
    let path = dir.join("image.qcow2");
    create_qcow2(&path, 64 * MIB, cluster, None).unwrap();
    let file = Arc::new(ImageFile::open(&path, true).unwrap());
    let Probed::Qcow2(h) = probe(file.file()).unwrap() else {
        panic!("not qcow2")
    };
    (file, h)
}

fn order(file: &Arc<ImageFile>, h: &Qcow2Header) -> Arc<WriteOrder> {
    WriteOrder::new(file, h, Arc::default()).unwrap()
}

#[test]
fn writes_are_told_apart_by_where_they_land() {
    let dir = tempfile::tempdir().unwrap();
    let (file, h) = image(dir.path(), 64 << 10);
    let order = order(&file, &h);
    let kind = |view, offset| order.before(view, offset, 512).unwrap();
    let rb = *order
        .layout
        .read()
        .unwrap()
        .refblocks
        .iter()
        .next()
        .unwrap();
    assert_eq!(kind(View::Metadata, 0), WriteKind::Link);
    assert_eq!(kind(View::Metadata, h.l1_table_offset), WriteKind::Link);
    assert_eq!(
        kind(View::Metadata, h.refcount_table_offset),
        WriteKind::Link
    );
    assert_eq!(kind(View::Metadata, rb + 512), WriteKind::Refcounts);
    assert_eq!(kind(View::Metadata, 40 * MIB), WriteKind::Table);
    assert_eq!(kind(View::Data, 0), WriteKind::Data);
}

#[test]
fn a_write_waits_only_for_the_kinds_that_must_be_durable_first() {
    let dir = tempfile::tempdir().unwrap();
    let (file, h) = image(dir.path(), 64 << 10);
    let order = order(&file, &h);
    let rb = *order
        .layout
        .read()
        .unwrap()
        .refblocks
        .iter()
        .next()
        .unwrap();
    let at = |kind: WriteKind| match kind {
        WriteKind::Data => 8 * MIB,
        WriteKind::Refcounts => rb,
        WriteKind::Table => 9 * MIB,
        WriteKind::Link => h.l1_table_offset,
    };
    // (the write, barriers made before it)
    let steps = [
        (WriteKind::Data, 0),
        (WriteKind::Data, 0),
        (WriteKind::Refcounts, 1),
        (WriteKind::Refcounts, 1),
        (WriteKind::Table, 2),
        (WriteKind::Table, 2),
        (WriteKind::Data, 2),
        (WriteKind::Link, 3),
        (WriteKind::Link, 3),
        (WriteKind::Data, 4),
    ];
    for (kind, barriers) in steps {
        let view = if kind == WriteKind::Data {
            View::Data
        } else {
            View::Metadata
        };
        assert_eq!(order.before(view, at(kind), 512).unwrap(), kind);
        assert_eq!(order.barriers(), barriers, "before a {kind:?} write");
        order.after(kind, &file, at(kind), 512);
    }
}

/// A rule that, after each table or link write, copies the file as it is (what a power cut
/// then leaves: everything before the write's barrier is durable) and checks the copy.
#[derive(Debug)]
struct CrashAfterEach {
    order: Arc<WriteOrder>,
    dir: std::path::PathBuf,
    checked: AtomicUsize,
}

impl WriteRule for CrashAfterEach {
    fn before(&self, view: View, offset: u64, len: u64) -> io::Result<WriteKind> {
        self.order.before(view, offset, len)
    }

    fn after(&self, kind: WriteKind, file: &ImageFile, offset: u64, len: u64) {
        self.order.after(kind, file, offset, len);
        if matches!(kind, WriteKind::Table | WriteKind::Link) {
            let n = self.checked.fetch_add(1, Ordering::Relaxed);
            let copy = self.dir.join(format!("crash-{n}.qcow2"));
            std::fs::copy(file.get_filename().unwrap(), &copy).unwrap();
            let out = Command::new("qemu-img")
                .args(["check", "-f", "qcow2"])
                .arg(&copy)
                .output()
                .unwrap();
            // 0: clean; 3: leaked clusters only (what QEMU leaves after a crash too).
            assert!(
                matches!(out.status.code(), Some(0 | 3)),
                "a crash after a {kind:?} write at {offset}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            std::fs::remove_file(copy).unwrap();
        }
    }

    fn sync(&self, view: View, file: &ImageFile) -> io::Result<()> {
        self.order.sync(view, file)
    }
}

fn have_qemu_img() -> bool {
    let found = Command::new("qemu-img").arg("--version").output().is_ok();
    assert!(
        found || std::env::var("CI").as_deref() != Ok("true"),
        "qemu-img (qemu-utils) not installed, and CI=true"
    );
    if !found {
        eprintln!("SKIPPED: qemu-img not installed (Debian package qemu-utils)");
    }
    found
}

/// Small clusters, so that writes spread over the image make new L2 tables (each covers
/// 2 MiB of 4 KiB clusters) and new refcount blocks (each covers 8 MiB of the file).
#[test]
fn a_crash_after_any_table_or_link_write_leaves_a_consistent_image() {
    if !have_qemu_img() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (file, h) = image(dir.path(), 4 << 10);
    let rule = Arc::new(CrashAfterEach {
        order: order(&file, &h),
        dir: dir.path().to_owned(),
        checked: AtomicUsize::new(0),
    });
    let view = |view| ImageStorage::Ordered {
        file: Arc::clone(&file),
        view,
        rule: Arc::clone(&rule) as _,
    };
    let image = Qcow2::<ImageStorage>::builder(view(View::Metadata))
        .data_file(Some(view(View::Data)))
        .write(true)
        .open(DenyImplicitOpenGate::default())
        .unwrap();
    let access = FormatAccess::new(image);
    let data = vec![0x5a; 64 << 10];
    // 12 MiB of new clusters over 48 MiB: new L2 tables, and a new refcount block.
    for i in 0..192u64 {
        access.write(&data, i * (256 << 10)).unwrap();
        if i % 48 == 47 {
            access.flush().unwrap();
            access.sync().unwrap();
        }
    }
    let checked = rule.checked.load(Ordering::Relaxed);
    assert!(checked >= 24, "only {checked} crash points");
}
