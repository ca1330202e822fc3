//! The `image` target: a small valid qcow2 image (4 KiB clusters, some clusters written, over
//! a raw backing file) with fuzz-chosen bytes written over it - header fields, the L1 and L2
//! tables, refcounts, the backing file's name - and maybe cut short, is opened (read-only,
//! then writable) and used: reads, maps, block status, writes, zeroing, flushes.
//!
//! Nothing may panic or hang, and no map may send an engine to bytes the file does not have
//! (a place past the end of the file that holds it): what a damaged image cannot answer is an
//! error for the request, or for the open.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use zcnbd_server::export::{
    create_qcow2, Backend, ImageBackend, ImageFormat, ImageOpenOptions, Map, MapFor, Place,
    ZeroFlags,
};

use super::Bytes;

const CLUSTER_BYTES: usize = 4096;
const IMAGE_BYTES: u64 = 1 << 20;
/// Patches one input may apply, and the longest.
const PATCHES_MAX: u8 = 24;
const PATCH_BYTES_MAX: u8 = 16;
/// Operations one input may run on an opened image, and the longest read or write.
const OPS_MAX: u8 = 16;
const IO_BYTES_MAX: u64 = 64 << 10;

/// The template image's bytes: made once per process.
fn template() -> &'static [u8] {
    static TEMPLATE: OnceLock<Vec<u8>> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dir = scratch_dir("template");
        let base = dir.join("base.raw");
        fs::write(&base, vec![0xbb; 256 << 10]).expect("base");
        let top = dir.join("top.qcow2");
        create_qcow2(
            &top,
            IMAGE_BYTES,
            CLUSTER_BYTES,
            Some(("base.raw", ImageFormat::Raw)),
        )
        .expect("template image");
        let options = ImageOpenOptions {
            writable: true,
            force_share: false,
            direct: false,
        };
        let image = ImageBackend::open(&top, ImageFormat::Qcow2, options, Default::default())
            .expect("open template");
        image
            .pwrite(&[0x11; 3 * CLUSTER_BYTES], 0, false)
            .expect("write");
        image.pwrite(&[0x22; 100], 70_000, false).expect("write");
        image
            .zero(
                8 * CLUSTER_BYTES as u64,
                2 * CLUSTER_BYTES as u64,
                ZeroFlags::default(),
            )
            .expect("zero");
        image.flush().expect("flush");
        drop(image);
        let bytes = fs::read(&top).expect("read template");
        let _ = fs::remove_dir_all(&dir);
        bytes
    })
}

/// A fresh directory of this process's for one input.
fn scratch_dir(what: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "zcnbd-fuzz-image-{}-{what}-{n}",
        std::process::id()
    ));
    fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

pub fn run(data: &[u8]) {
    let mut p = Bytes::new(data);
    let mut image = template().to_vec();
    for _ in 0..p.u8() % PATCHES_MAX {
        let at = p.u32() as usize % image.len();
        let n = usize::from(p.u8() % PATCH_BYTES_MAX) + 1;
        let bytes = p.take(n);
        let end = (at + bytes.len()).min(image.len());
        image[at..end].copy_from_slice(&bytes[..end - at]);
    }
    if p.u8() & 1 == 1 {
        let keep = p.u32() as usize % (image.len() + 1);
        image.truncate(keep);
    }
    let dir = scratch_dir("input");
    fs::write(dir.join("base.raw"), vec![0xbb; 256 << 10]).expect("base");
    let top = dir.join("top.qcow2");
    fs::write(&top, &image).expect("image");
    for writable in [false, true] {
        let options = ImageOpenOptions {
            writable,
            force_share: false,
            direct: false,
        };
        if let Ok(backend) =
            ImageBackend::open(&top, ImageFormat::Qcow2, options, Default::default())
        {
            exercise(&backend, &top, writable, &mut p.clone());
        }
    }
    let _ = fs::remove_dir_all(&dir);
}

/// Runs the input's operations on an opened image.
fn exercise(image: &ImageBackend, path: &Path, writable: bool, p: &mut Bytes<'_>) {
    let size = image.size();
    let mut map = Map::default();
    for _ in 0..p.u8() % OPS_MAX {
        let kind = p.u8();
        let offset = if size == 0 { 0 } else { p.u64() % size };
        let len = (p.u32() as u64 % IO_BYTES_MAX + 1).min(size - offset);
        if len == 0 {
            continue;
        }
        match kind % 8 {
            0 => {
                let mut buf = vec![0u8; len as usize];
                let _ = image.pread(&mut buf, offset);
            }
            1 | 2 => {
                let how = if kind % 8 == 1 {
                    MapFor::Read { holes: true }
                } else {
                    MapFor::Write
                };
                map.clear();
                if image.map(offset, len, how, &mut map).is_ok() {
                    check_map(&map, path, len);
                }
            }
            3 => {
                let mut out = Vec::new();
                let _ = image.extents(offset, len, 64, &mut out);
                let mut out = Vec::new();
                let _ = image.meta_extents("qemu:allocation-depth", offset, len, 64, &mut out);
            }
            4 if writable => {
                let _ = image.pwrite(&vec![kind; len as usize], offset, kind & 0x10 != 0);
            }
            5 if writable => {
                let flags = ZeroFlags {
                    may_trim: kind & 0x10 != 0,
                    fast: kind & 0x20 != 0,
                    fua: false,
                };
                let _ = image.zero(offset, len, flags);
            }
            6 if writable => {
                let _ = image.trim(offset, len, false);
            }
            _ => {
                let _ = image.flush();
            }
        }
    }
}

/// Every place a map names is inside the file that holds it, and the map covers the range.
fn check_map(map: &Map, top: &Path, len: u64) {
    assert_eq!(
        map.covered(),
        len,
        "a map that does not cover its range: {map:?}"
    );
    let file_len =
        |fd: i32| fs::metadata(format!("/proc/self/fd/{fd}")).map_or(u64::MAX, |m| m.len());
    for segment in map.segments() {
        if let Place::File { fd, offset } = segment.place {
            let end = offset.checked_add(segment.len).expect("a place past u64");
            let have = file_len(fd);
            assert!(
                end <= have,
                "{}: a place [{offset:#x}, {end:#x}) past the end of a {have}-byte file",
                top.display()
            );
        }
    }
}
