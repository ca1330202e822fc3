//! An RBD image's snapshots as dirty bitmaps: for each snapshot S older than what is served
//! (the image, or the snapshot `@SNAP` names), `qemu:dirty-bitmap:S` is the extents changed
//! since S (`rbd_diff_iterate2` from S: written, discarded or zeroed), so that serving
//! `rbd:pool/img@snap2` with the context of `snap1` is a consistent incremental backup
//! through any NBD client. The list is read when the export is opened.

use std::io;

use tracing::info;
use zcnbd_proto::meta::DIRTY_BITMAP_PREFIX;
use zcnbd_proto::Extent;

use super::rbd_extents::runs_as_extents;
use crate::sys::rbd::Image;

/// The flag of a changed extent.
const DIRTY: u32 = 1;

/// The snapshots older than the one served (`served`: `None` for the image itself).
pub(super) fn older_snapshots(
    image: &Image,
    served: Option<&str>,
    name: &str,
) -> io::Result<Vec<String>> {
    let snaps = image.snapshots()?;
    let before = match served {
        None => u64::MAX,
        Some(served) => snaps
            .iter()
            .find(|s| s.name == served)
            .map_or(u64::MAX, |s| s.id),
    };
    let older: Vec<String> = snaps
        .into_iter()
        .filter(|s| s.id < before)
        .map(|s| s.name)
        .collect();
    if !older.is_empty() {
        info!(
            "RBD image {name}: snapshots offered as dirty bitmaps (changes since each): {}",
            older.join(", ")
        );
    }
    Ok(older)
}

/// The snapshot a context names, if it is one of `snapshots`.
pub(super) fn snapshot_of<'a>(snapshots: &'a [String], context: &str) -> Option<&'a str> {
    let name = context.strip_prefix(DIRTY_BITMAP_PREFIX)?;
    snapshots.iter().find(|s| *s == name).map(String::as_str)
}

/// Appends up to `extents_max` extents of `[offset, offset+len)`: changed since `snap`
/// (flag 1, dirty) or not (0).
pub(super) fn changed_extents(
    image: &Image,
    snap: &str,
    offset: u64,
    len: u64,
    extents_max: usize,
    out: &mut Vec<Extent>,
) -> io::Result<()> {
    let runs =
        |visit: &mut dyn FnMut(u64, u64) -> bool| image.changed_since(snap, offset, len, visit);
    runs_as_extents(offset, len, extents_max, runs, DIRTY, 0, out)
}
