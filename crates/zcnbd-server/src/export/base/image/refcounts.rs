//! A check of a qcow2 image's refcount table before it is opened for writing: every part of the
//! file must be covered by a refcount block. imago allocates a missing refcount block by
//! allocating a cluster for it, which may need another missing block, and so on, by recursion:
//! a damaged table that leaves much of the file uncovered would overflow the stack (the image
//! fuzz target found it). QEMU's `qemu-img check -r all` repairs such an image.

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::header::Qcow2Header;

/// The largest refcount table read (QEMU's limit on a refcount table, 8 MiB).
pub const REFCOUNT_TABLE_BYTES_MAX: u64 = 8 << 20;

/// Why the image must not be written, if it must not.
pub fn uncovered(file: &File, file_bytes: u64, h: &Qcow2Header) -> Option<String> {
    let cluster = h.cluster_bytes();
    if !(0..=6).contains(&h.refcount_order) {
        return Some(format!(
            "refcount_order {} is out of range",
            h.refcount_order
        ));
    }
    // Clusters one refcount block describes, and bytes of file per refcount table entry.
    let per_block = (cluster * 8) >> h.refcount_order;
    let per_entry = per_block.saturating_mul(cluster);
    let needed = file_bytes.div_ceil(per_entry);
    let entries = u64::from(h.refcount_table_clusters) * cluster / 8;
    if needed > entries {
        return Some(format!(
            "the refcount table ({entries} entries) does not cover the file ({needed} needed)"
        ));
    }
    let bytes = needed * 8;
    if bytes > REFCOUNT_TABLE_BYTES_MAX {
        return Some(format!(
            "the refcount table is larger than {REFCOUNT_TABLE_BYTES_MAX} bytes (REFCOUNT_TABLE_BYTES_MAX)"
        ));
    }
    let mut table = vec![0u8; bytes as usize];
    if !h.refcount_table_offset.is_multiple_of(cluster)
        || file
            .read_exact_at(&mut table, h.refcount_table_offset)
            .is_err()
    {
        return Some("the refcount table is not where the header says".to_owned());
    }
    for (i, entry) in table.chunks_exact(8).enumerate() {
        let offset = u64::from_be_bytes(<[u8; 8]>::try_from(entry).unwrap_or_default()) & !0x1ff;
        if offset == 0 || !offset.is_multiple_of(cluster) || offset >= file_bytes {
            return Some(format!(
                "refcount table entry {i} is missing or outside the file"
            ));
        }
    }
    None
}
