//! Block status of an image, found by walking its backing chain from the top one layer at a
//! time (imago's shallow mappings): `base:allocation` (a hole where no layer has data, as
//! QEMU's NBD server reports a chain) and `qemu:allocation-depth` (which layer holds each
//! run: 0 none, 1 the image, 2 its backing file, ...).

use std::io;

use imago::{FormatAccess, ShallowMapping};
use zcnbd_proto::consts::state;
use zcnbd_proto::Extent;

use super::header::ImageFormat;
use super::open::LayerInfo;
use crate::export::base::holes::{next_boundary, seeks_are_cheap};
use crate::sys::image_storage::ImageStorage;

/// What one run of the disk is, from the top of the chain down.
#[derive(Debug)]
pub(super) enum Run<'a> {
    /// Data in layer `depth` (1: the image itself) at `offset` of `storage`.
    Data {
        depth: usize,
        storage: &'a ImageStorage,
        offset: u64,
        /// Whether it may be written where it is (a cluster of the image that only it uses).
        writable: bool,
    },
    /// Marked as reading zeroes in layer `depth` (a qcow2 zero cluster).
    Zero { depth: usize },
    /// Stored encoded (compressed) in layer `depth`: only imago can read it.
    Special { depth: usize },
    /// In no layer: zeroes.
    Unallocated,
}

impl Run<'_> {
    /// The layer that holds it (0: none).
    fn depth(&self) -> usize {
        match self {
            Run::Data { depth, .. } | Run::Zero { depth } | Run::Special { depth } => *depth,
            Run::Unallocated => 0,
        }
    }
}

/// The run at `offset`, at most `max` bytes long (> 0), and its length (> 0).
pub(super) fn run_at(
    top: &FormatAccess<ImageStorage>,
    offset: u64,
    max: u64,
) -> io::Result<(Run<'_>, u64)> {
    let (mut layer, mut at, mut len, mut depth) = (top, offset, max, 1usize);
    let mut writable = true;
    loop {
        let (mapping, n) = layer.get_shallow_mapping(at, len)?;
        let n = n.min(len);
        let run = match mapping {
            ShallowMapping::Indirect {
                layer: below,
                offset: below_at,
                writable: w,
                ..
            } if n > 0 => {
                (layer, at, len, depth) = (below, below_at, n, depth + 1);
                writable &= w;
                continue;
            }
            ShallowMapping::Raw {
                storage,
                offset,
                writable: w,
                ..
            } => Run::Data {
                depth,
                storage,
                offset,
                writable: writable && w && depth == 1,
            },
            ShallowMapping::Zero { explicit: true, .. } => Run::Zero { depth },
            ShallowMapping::Zero { .. } => Run::Unallocated,
            // A backing file shorter than the image: past its end nothing is allocated.
            ShallowMapping::Eof { .. } if depth > 1 => return Ok((Run::Unallocated, len)),
            ShallowMapping::Special { .. } => Run::Special { depth },
            _ => {
                return Err(io::Error::other(format!(
                    "the image maps {at:#x} to nothing (depth {depth})"
                )))
            }
        };
        if n == 0 {
            return Err(io::Error::other(format!(
                "the image maps an empty run at {at:#x} (depth {depth})"
            )));
        }
        return Ok((run, n));
    }
}

/// Extents appended to a list, joined where their flags agree, at most `max` of them.
struct Extents<'o> {
    out: &'o mut Vec<Extent>,
    first: usize,
    max: usize,
}

impl Extents<'_> {
    /// Appends `length` bytes with `flags`; false if that needed an extent past `max`.
    fn push(&mut self, length: u64, flags: u32) -> bool {
        if let Some(last) = self.out[self.first..].last_mut() {
            if last.flags == flags {
                last.length += length;
                return true;
            }
        }
        if self.out.len() - self.first >= self.max {
            return false;
        }
        self.out.push(Extent { length, flags });
        true
    }
}

/// `base:allocation` of `[offset, offset+len)`: data where a layer has data (a raw layer's
/// holes are holes), a hole reading zeroes where a layer says zeroes or none has it.
pub(super) fn allocation(
    top: &FormatAccess<ImageStorage>,
    layers: &[LayerInfo],
    offset: u64,
    len: u64,
    max: usize,
    out: &mut Vec<Extent>,
) -> io::Result<()> {
    walk(top, offset, len, max, out, |extents, run, n| match run {
        Run::Data {
            depth,
            storage,
            offset: at,
            ..
        } if layer_is_raw(layers, depth) => !raw_runs(extents, storage, at, n),
        Run::Data { .. } | Run::Special { .. } => extents.push(n, 0),
        Run::Zero { .. } | Run::Unallocated => extents.push(n, state::HOLE | state::ZERO),
    })
}

/// `qemu:allocation-depth` of `[offset, offset+len)`: each extent's flags are the depth of
/// the layer that holds it (0: none).
pub(super) fn depth(
    top: &FormatAccess<ImageStorage>,
    offset: u64,
    len: u64,
    max: usize,
    out: &mut Vec<Extent>,
) -> io::Result<()> {
    walk(top, offset, len, max, out, |extents, run, n| {
        extents.push(n, run.depth() as u32)
    })
}

/// Walks the runs of `[offset, offset+len)`, giving each to `describe` (which appends its
/// extents, and says false once they are full).
fn walk(
    top: &FormatAccess<ImageStorage>,
    offset: u64,
    len: u64,
    max: usize,
    out: &mut Vec<Extent>,
    mut describe: impl FnMut(&mut Extents<'_>, Run<'_>, u64) -> bool,
) -> io::Result<()> {
    let first = out.len();
    let mut extents = Extents { out, first, max };
    let (mut pos, end) = (offset, offset + len);
    while pos < end {
        let (run, n) = run_at(top, pos, end - pos)?;
        if !describe(&mut extents, run, n) {
            break;
        }
        pos += n;
    }
    Ok(())
}

fn layer_is_raw(layers: &[LayerInfo], depth: usize) -> bool {
    layers
        .get(depth.wrapping_sub(1))
        .is_some_and(|l| l.format == ImageFormat::Raw)
}

/// The data and hole runs of `n` bytes at `at` of a raw layer's file; true if the extents
/// filled up before the end.
fn raw_runs(extents: &mut Extents<'_>, storage: &ImageStorage, at: u64, n: u64) -> bool {
    let Some(file) = storage.file().filter(|f| seeks_are_cheap(f.file())) else {
        return !extents.push(n, 0);
    };
    let end = at + n;
    let mut pos = at;
    while pos < end {
        let (next, flags) = next_boundary(file.file(), pos, end).unwrap_or((end, 0));
        let next = next.clamp(pos + 1, end);
        if !extents.push(next - pos, flags) {
            return true;
        }
        pos = next;
    }
    false
}
