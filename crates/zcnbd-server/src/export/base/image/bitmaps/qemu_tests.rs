//! Bitmaps of images QEMU made: `qemu-img create` and `qemu-img bitmap`, written by `qemu-io`
//! (which records its writes in the enabled bitmaps), with QEMU's NBD server as the oracle:
//! `nbdinfo --map=qemu:dirty-bitmap:NAME` of `qemu-nbd -r -B NAME` must give the extents
//! zcnbd gives. Skipped, with the reason printed, when qemu-img or qemu-io is not installed,
//! and the oracle part when qemu-nbd or nbdinfo is not (each fails instead under `CI=true`;
//! scripts/install-deps.sh installs them).

use std::fs::File;
use std::path::Path;
use std::process::Command;

use zcnbd_proto::Extent;

use super::test_image::Built;
use super::tests::damaged_images;
use super::*;

const MIB: u64 = 1 << 20;

/// Whether `tool` is installed; without it the test is skipped with the reason printed, but
/// under CI (`CI=true`) a missing tool fails the test instead.
fn have(tool: &str, package: &str) -> bool {
    let found = Command::new(tool).arg("--version").output().is_ok();
    if !found {
        let why = format!("{tool} not installed (Debian package {package})");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{why}, and CI=true"
        );
        eprintln!("SKIPPED: {why}");
    }
    found
}

fn have_qemu() -> bool {
    have("qemu-img", "qemu-utils") && have("qemu-io", "qemu-utils")
}

fn have_oracle() -> bool {
    have("qemu-nbd", "qemu-utils") && have("nbdinfo", "libnbd-bin")
}

/// Runs `cmd`, which must succeed: its standard output.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn qemu_img(args: &[&str]) -> String {
    run(Command::new("qemu-img").args(args))
}

/// Writes `[offset, offset+len)` of `image` through QEMU.
fn qemu_write(image: &Path, writes: &[(u64, u64)]) {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "qcow2"]);
    for (offset, len) in writes {
        cmd.arg("-c").arg(format!("write -P 7 {offset} {len}"));
    }
    run(cmd.arg(image));
}

/// qemu-nbd's extents of bitmap `name`, as `nbdinfo --map` prints them: (offset, length,
/// flags).
fn qemu_nbd_map(image: &Path, name: &str) -> Vec<(u64, u64, u32)> {
    let out = run(Command::new("nbdinfo")
        .arg(format!("--map=qemu:dirty-bitmap:{name}"))
        .args(["--", "[", "qemu-nbd", "-r", "-f", "qcow2", "-B", name])
        .arg(image)
        .arg("]"));
    let rows = out.lines().map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (
            f[0].parse().unwrap(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
        )
    });
    joined(rows)
}

/// Neighbouring extents with equal flags joined (nbdinfo prints what each reply held).
fn joined(rows: impl IntoIterator<Item = (u64, u64, u32)>) -> Vec<(u64, u64, u32)> {
    let mut out: Vec<(u64, u64, u32)> = Vec::new();
    for (offset, len, flags) in rows {
        match out.last_mut() {
            Some(last) if last.2 == flags && last.0 + last.1 == offset => last.1 += len,
            _ => out.push((offset, len, flags)),
        }
    }
    out
}

/// zcnbd's extents of the whole disk, asked in requests of `chunk` bytes as a client would.
fn our_map(b: &DirtyBitmap, chunk: u64) -> Vec<(u64, u64, u32)> {
    let mut rows = Vec::new();
    let mut pos = 0;
    while pos < b.virtual_bytes() {
        let mut out: Vec<Extent> = Vec::new();
        b.extents(pos, chunk, 1000, &mut out);
        for e in out {
            rows.push((pos, e.length, e.flags));
            pos += e.length;
        }
    }
    joined(rows)
}

/// The extents that `writes` to a disk of `size` leave in a bitmap of granularity `g`.
fn expected(size: u64, g: u64, writes: &[(u64, u64)]) -> Vec<(u64, u64, u32)> {
    let mut granules: Vec<(u64, u64)> = writes
        .iter()
        .map(|&(at, len)| (at / g * g, ((at + len).div_ceil(g) * g).min(size)))
        .collect();
    granules.sort();
    let mut rows = Vec::new();
    let mut pos = 0;
    for (start, end) in granules {
        if start > pos {
            rows.push((pos, start - pos, 0));
        }
        if end > pos {
            rows.push((pos.max(start), end - pos.max(start), STATE_DIRTY));
            pos = end;
        }
    }
    if pos < size {
        rows.push((pos, size - pos, 0));
    }
    joined(rows)
}

fn open(image: &Path) -> (File, BitmapDirectory) {
    let file = File::open(image).unwrap();
    let len = file.metadata().unwrap().len();
    let dir = BitmapDirectory::read(&file, len).unwrap();
    (file, dir)
}

/// An image of `size` bytes with `cluster` clusters and the bitmaps (name, granularity),
/// all enabled.
fn qemu_image(dir: &Path, cluster: &str, size: u64, bitmaps: &[(&str, u64)]) -> std::path::PathBuf {
    let image = dir.join(format!("c{cluster}.qcow2"));
    let opts = format!("cluster_size={cluster}");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &opts,
        image.to_str().unwrap(),
        &size.to_string(),
    ]);
    for (name, g) in bitmaps {
        let g = g.to_string();
        qemu_img(&["bitmap", "--add", "-g", &g, image.to_str().unwrap(), name]);
    }
    image
}

#[test]
fn bitmaps_of_qemu_images_match_what_qemu_nbd_serves() {
    if !have_qemu() {
        return;
    }
    let oracle = have_oracle();
    let tmp = tempfile::tempdir().unwrap();
    // A size that ends inside every granule but the smallest.
    let size = 64 * MIB + 1536;
    let writes = [
        (0, 1),
        (1000, 5000),
        (MIB, 64 << 10),
        (3 * MIB + 100, 3 * MIB),
        (40 * MIB - 1, 2),
        (size - 400, 400),
    ];
    let late = [(50 * MIB, 4096), (7 * MIB, 1)];
    let bitmaps = [
        ("b0", 64 << 10),
        ("fine", 512),
        ("coarse", 2 * MIB),
        ("off", 64 << 10),
    ];
    // 512-byte clusters: "fine" has a table of 32 entries; 4 KiB: 4; 64 KiB: 1.
    for cluster in ["512", "4096", "65536"] {
        let image = qemu_image(tmp.path(), cluster, size, &bitmaps);
        qemu_write(&image, &writes);
        qemu_img(&["bitmap", "--disable", image.to_str().unwrap(), "off"]);
        qemu_write(&image, &late);
        let (file, dir) = open(&image);
        let names: Vec<(&str, Option<u64>, bool)> = dir
            .entries()
            .iter()
            .map(|e| (e.name.as_str(), e.granularity_bytes(), e.auto()))
            .collect();
        assert_eq!(
            names,
            [
                ("b0", Some(64 << 10), true),
                ("fine", Some(512), true),
                ("coarse", Some(2 * MIB), true),
                ("off", Some(64 << 10), false),
            ]
        );
        let all: Vec<(u64, u64)> = writes.iter().chain(&late).copied().collect();
        for (name, g) in bitmaps {
            let b = dir.load(&file, name, BITMAP_BYTES_MAX_DEFAULT).unwrap();
            let want = expected(size, g, if name == "off" { &writes } else { &all });
            // One request for the whole disk, and requests of 1 MiB + 1 byte.
            assert_eq!(
                our_map(&b, u64::MAX),
                want,
                "{name}, {cluster}-byte clusters"
            );
            assert_eq!(
                our_map(&b, MIB + 1),
                want,
                "{name}, {cluster}-byte clusters"
            );
            if oracle {
                assert_eq!(qemu_nbd_map(&image, name), want, "qemu-nbd: {name}");
            }
        }
    }
}

#[test]
fn an_all_ones_table_entry_reads_as_qemu_nbd_reads_it() {
    if !have_qemu() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let size = 64 * MIB;
    let image = qemu_image(tmp.path(), "512", size, &[("fine", 512)]);
    qemu_write(&image, &[(0, 1), (5 * MIB, 700)]);
    // QEMU writes a data cluster even when it is all ones, so the entry is made by hand:
    // entry 3 (bits of 6 MiB to 8 MiB) says "all ones" instead.
    let (_, dir) = open(&image);
    let table = dir.entries()[0].table_offset;
    patch(&image, table + 3 * 8, &1u64.to_be_bytes());
    let (file, dir) = open(&image);
    let b = dir.load(&file, "fine", BITMAP_BYTES_MAX_DEFAULT).unwrap();
    let want = expected(size, 512, &[(0, 1), (5 * MIB, 700), (6 * MIB, 2 * MIB)]);
    assert_eq!(our_map(&b, u64::MAX), want);
    if have_oracle() {
        assert_eq!(qemu_nbd_map(&image, "fine"), want);
    }
}

fn patch(image: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(image).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

#[test]
fn a_bitmap_marked_in_use_at_its_flags_offset_is_refused_as_qemu_refuses_it() {
    if !have_qemu() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let image = qemu_image(
        tmp.path(),
        "65536",
        64 * MIB,
        &[("b0", 65536), ("b1", 65536)],
    );
    let (_, dir) = open(&image);
    let b1 = &dir.entries()[1];
    patch(&image, b1.flags_offset, &(b1.flags | 1).to_be_bytes());
    // QEMU reads the flag where the listing said it is.
    let info = qemu_img(&["info", "--output=json", image.to_str().unwrap()]);
    assert_eq!(info.matches("in-use").count(), 1, "{info}");
    let (file, dir) = open(&image);
    let err = dir.load(&file, "b1", BITMAP_BYTES_MAX_DEFAULT).unwrap_err();
    assert!(matches!(err, BitmapError::InUse { .. }), "{err}");
    dir.load(&file, "b0", BITMAP_BYTES_MAX_DEFAULT).unwrap();
    if have_oracle() {
        let refused = Command::new("nbdinfo")
            .args([
                "--map=qemu:dirty-bitmap:b1",
                "--",
                "[",
                "qemu-nbd",
                "-r",
                "-f",
                "qcow2",
            ])
            .args(["-B", "b1"])
            .arg(&image)
            .arg("]")
            .output()
            .unwrap();
        assert!(
            !refused.status.success(),
            "qemu-nbd served an in-use bitmap"
        );
    }
}

#[test]
fn bitmaps_cleared_from_autoclear_are_ignored_as_qemu_ignores_them() {
    if !have_qemu() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let image = qemu_image(tmp.path(), "65536", 64 * MIB, &[("b0", 65536)]);
    patch(&image, 95, &[0]);
    let info = qemu_img(&["info", "--output=json", image.to_str().unwrap()]);
    assert!(!info.contains("\"b0\""), "{info}");
    let (file, dir) = open(&image);
    assert_eq!(dir.extension(), Extension::Ignored);
    let err = dir.load(&file, "b0", BITMAP_BYTES_MAX_DEFAULT).unwrap_err();
    assert!(matches!(err, BitmapError::Ignored), "{err}");
}

#[test]
fn bitmaps_of_damaged_qemu_images_are_errors_or_consistent() {
    if !have_qemu() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let size = 8 * MIB + 1536;
    let image = qemu_image(
        tmp.path(),
        "512",
        size,
        &[("fine", 512), ("coarse", 2 * MIB)],
    );
    qemu_write(&image, &[(1000, 5000), (size - 400, 400)]);
    let (_, dir) = open(&image);
    let built = Built {
        bytes: std::fs::read(&image).unwrap(),
        ext_at: 104,
        dir_at: dir.entries()[0].flags_offset as usize - 12,
        entry_at: dir
            .entries()
            .iter()
            .map(|e| e.flags_offset as usize - 12)
            .collect(),
        table_at: dir
            .entries()
            .iter()
            .map(|e| e.table_offset as usize)
            .collect(),
    };
    fuzz::run(&built.bytes);
    damaged_images(&built, 1500, 0xbeef, fuzz::run);
}
