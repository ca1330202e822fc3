//! A disk image (qcow2, or a flat VMDK read-only) with its backing chain, through imago: the
//! image's clusters are mapped to the files that hold them, so reads of data clusters - in
//! the image or in any backing file - are sent from those files by the engines' zero-copy
//! mechanisms, and writes to clusters the image owns are received in place. Everything else
//! (clusters to allocate, copy-on-write from a backing file, compressed clusters, zeroes) goes
//! through imago's reads and writes.
//!
//! Clusters move while the server runs: TRIM and WRITE_ZEROES mark clusters as reading
//! zeroes (qcow2 version 3 zero clusters) and punch their blocks out of the file where holes
//! are allowed, and imago reallocates a cluster on its own - a write to a zero cluster that
//! kept its host cluster, copy-on-write - freeing the old host cluster for the next
//! allocation, which may be any other guest cluster's. So a writable image has a lease table
//! (`export/lease.rs`, one granule a cluster): the stack leases every map it answers and
//! registers every write, trim and zero that goes through imago as a change, which waits
//! until no lease overlaps its clusters; a host offset an engine was given therefore stays
//! that guest cluster's until the engine's I/O there has completed. A change is the only
//! thing that frees a cluster, and only clusters of its own range (the image refuses, with
//! EIO and a log line, any change that reaches it while a lease overlaps).
//!
//! **Flush ordering**, as QEMU keeps it (`qcow2_cache_depends_on_flush`): after a power cut
//! the file must hold a consistent image whose FLUSHed writes are all there. imago writes
//! metadata back from caches (L2 tables, refcount blocks) in dependency order but never
//! syncs between writes, and the page cache writes back in any order; so a writable qcow2's
//! file is opened as two views, one imago writes its metadata through and one it writes data
//! through (`sys::image_storage`, `ImageStorage::Ordered`), and a rule (`write_order.rs`)
//! sorts every write into data, refcounts, tables or links (header, L1 table, refcount
//! table) and makes the kinds that must come first durable (one `fdatasync`) before a write
//! of a kind that depends on them: data and copied backing data before the L2 entries that
//! point to it, refcounts before L2 entries that use their clusters (and L2 entries cleared
//! before refcounts drop), a new table and its refcount before the entry that links it.
//! imago 0.2.6 wrote that entry before the new table's refcount left its cache; the copy in
//! `third_party/imago` flushes the refcount cache first, as QEMU does
//! (`third_party/imago/ZCNBD-PATCH.md`). Engines' in-place writes go to clusters already
//! allocated and depend on nothing. What this does not close, like QEMU: a cluster freed by a
//! reallocation can be reused for another guest cluster's data before the freeing L2 write
//! is durable, so after a power cut without a FLUSH the old L2 entry can show the new data
//! (only data written after the last FLUSH is involved).
//!
//! **Maps never wait** (the engines ask on their ring threads): `map_gate.rs`.

pub mod bitmaps;
mod create;
mod header;
mod map_gate;
mod open;
mod overlay;
mod persistent;
mod refcounts;
mod status;
mod write_order;

use std::io;

use imago::{FormatAccess, Mapping};
use tracing::{error, info};
use zcnbd_proto::meta::ALLOCATION_DEPTH;
use zcnbd_proto::Extent;

pub use create::create_qcow2;
pub use header::{probe, ImageFormat, Probed};
pub use open::{ImageError, OpenOptions, BACKING_DEPTH_MAX};
pub use overlay::{overlay_over_file, overlay_over_source, BackendSource, OVERLAY_DIR_DEFAULT};
pub use persistent::BitmapRequest;

use crate::export::{
    Backend, Capabilities, Leases, Map, MapFor, Medium, Place, ZeroError, ZeroFlags,
};
use crate::sys::image_storage::ImageStorage;
use map_gate::{MapGate, Warm};
use open::{LayerInfo, Opened};

/// A disk image export.
#[derive(Debug)]
pub struct ImageBackend {
    access: FormatAccess<ImageStorage>,
    /// The chain, top first (for block status and the log).
    layers: Vec<LayerInfo>,
    size: u64,
    writable: bool,
    /// Clusters can be marked zero (qcow2 version 3): TRIM and WRITE_ZEROES are offered.
    zero_clusters: bool,
    /// The image's cluster size (fast zeroing needs whole clusters).
    cluster_bytes: u64,
    /// The image's persistent dirty bitmaps it serves (`-B`, read-only).
    bitmaps: Vec<bitmaps::DirtyBitmap>,
    /// A writable image's lease table, one granule a cluster (see the module's doc).
    leases: Option<std::sync::Arc<Leases>>,
    /// Whether its syncs have all succeeded (kept across a reload with the image).
    durability: std::sync::Arc<crate::export::Durability>,
    /// Maps never wait: they enter only while no other imago operation runs
    /// (`map_gate.rs`)...
    gate: MapGate,
    /// ... and only for ranges whose L2 tables are certainly cached.
    warm: Warm,
    /// Its files have O_DIRECT descriptors (`--direct`): data clusters are mapped to them.
    direct: bool,
}

impl ImageBackend {
    /// Opens the image at `path` in `format` (qcow2 or VMDK) and its backing chain.
    pub fn open(
        path: &std::path::Path,
        format: ImageFormat,
        options: OpenOptions,
        bitmaps: BitmapRequest<'_>,
    ) -> Result<ImageBackend, ImageError> {
        // Locked from before the bitmap directory is read until after its flags are written.
        let top = open::Top::open(path, options)?;
        let found = probe(top.file()).map_err(|source| ImageError::Io {
            path: path.to_owned(),
            source,
        })?;
        if found.format() != format {
            return Err(ImageError::Unsupported {
                path: path.to_owned(),
                why: format!(
                    "not a {} image: its first bytes look like {} (leave out -f to serve what it is, or say -f {})",
                    format.name(),
                    found.format().name(),
                    found.format().name()
                ),
            });
        }
        let file = top.file().try_clone().map_err(|source| ImageError::Io {
            path: path.to_owned(),
            source,
        })?;
        let persistent =
            persistent::Persistent::read(&file, path, format, options.writable, bitmaps)?;
        let opened = open::open_locked(top, path, format, options)?;
        persistent.invalidate(&file, path)?;
        let mut image = ImageBackend::from_opened(opened, options.writable);
        image.bitmaps = persistent.served;
        image.direct = options.direct;
        Ok(image)
    }

    fn from_opened(opened: Opened, writable: bool) -> ImageBackend {
        let Opened {
            access,
            layers,
            header,
            durability,
        } = opened;
        let chain: Vec<String> = layers
            .iter()
            .map(|l| format!("{} ({})", l.path.display(), l.format.name()))
            .collect();
        info!(
            chain = %chain.join(" -> "),
            size = access.size(),
            writable,
            "disk image opened"
        );
        let cluster_bytes = header.map_or(512, |h| h.cluster_bytes());
        // One L2 table covers a cluster of 8-byte entries, each a cluster (a VMDK's flat
        // extents have no tables).
        let region_bytes = header.map_or(0, |h| h.cluster_bytes() / 8 * h.cluster_bytes());
        let image = ImageBackend {
            gate: MapGate::default(),
            warm: Warm::new(region_bytes),
            leases: writable.then(|| Leases::new(cluster_bytes)),
            durability,
            size: access.size(),
            writable,
            zero_clusters: header.is_some_and(|h| h.has_zero_clusters()),
            cluster_bytes,
            access,
            layers,
            bitmaps: Vec::new(),
            direct: false,
        };
        image.prewarm(region_bytes);
        image
    }

    /// Loads the L2 tables of the first [`map_gate::WARM_SLOTS`] regions (what a small
    /// image has; a few MiB at most), so that the first requests are mapped too. Errors are
    /// left for the requests to meet.
    fn prewarm(&self, region_bytes: u64) {
        if region_bytes == 0 {
            return;
        }
        let regions = self
            .size
            .div_ceil(region_bytes)
            .min(map_gate::WARM_SLOTS as u64);
        for r in 0..regions {
            let at = r * region_bytes;
            let _ = self.op(at, 1, || self.access.get_mapping(at, 1).map(|_| ()));
        }
    }

    /// The layers of the chain, top first: (path, format name).
    pub fn chain(&self) -> impl Iterator<Item = (&std::path::Path, &'static str)> {
        self.layers
            .iter()
            .map(|l| (l.path.as_path(), l.format.name()))
    }

    /// The check of the lease rule, before anything that may free or move clusters: no
    /// engine holds a lease on any of them (else the stack did not register the change: a
    /// bug, refused with EIO rather than let a late write land on reused clusters).
    fn check_no_lease(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.leases.as_ref().is_some_and(|l| l.leased(offset, len)) {
            error!(
                offset,
                len, "a change of a leased range reached the image: refused"
            );
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Runs `f`, an imago operation on `[offset, offset+len)`, inside the map gate, and
    /// notes the range's L2 tables as cached.
    fn op<T>(&self, offset: u64, len: u64, f: impl FnOnce() -> T) -> T {
        let _pass = self.gate.op();
        let done = f();
        self.warm.touch(offset, len);
        done
    }

    /// Writes back imago's metadata and makes every file written durable.
    fn flush_all(&self) -> io::Result<()> {
        let _pass = self.gate.op();
        self.access.flush()?;
        self.access.sync()
    }

    /// Marks `[offset, offset+len)` as reading zeroes, keeping its clusters allocated; with
    /// `punch`, the blocks of the whole clusters the image owns in the range go back to the
    /// file system.
    fn zero_range(&self, offset: u64, len: u64, punch: bool) -> io::Result<()> {
        let owned = if punch {
            self.owned_runs(offset, len)?
        } else {
            Vec::new()
        };
        self.access.write_zeroes(offset, len)?;
        for (storage, at, n) in owned {
            if let Some(file) = storage.file() {
                file.punch(at, n)?;
            }
        }
        Ok(())
    }

    /// The runs of whole clusters in `[offset, offset+len)` whose data lives in a file
    /// cluster that only this image uses: (storage, file offset, length).
    fn owned_runs(&self, offset: u64, len: u64) -> io::Result<Vec<(&ImageStorage, u64, u64)>> {
        let c = self.cluster_bytes;
        let start = offset.div_ceil(c) * c;
        let end = (offset + len) / c * c;
        let mut runs = Vec::new();
        let mut pos = start;
        while pos < end {
            let (run, n) = status::run_at(&self.access, pos, end - pos)?;
            if let status::Run::Data {
                storage,
                offset: at,
                writable: true,
                ..
            } = run
            {
                runs.push((storage, at, n));
            }
            pos += n;
        }
        Ok(runs)
    }

    /// Whether zeroing `[offset, offset+len)` is only marking clusters: whole clusters (the
    /// export's end counts as a cluster's).
    fn zeroing_is_fast(&self, offset: u64, len: u64) -> bool {
        let c = self.cluster_bytes;
        let end = offset + len;
        offset.is_multiple_of(c) && (end.is_multiple_of(c) || end == self.size)
    }
}

impl Backend for ImageBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        let w = self.writable;
        Capabilities {
            write: w,
            flush: true,
            // A write is durable only with imago's metadata: the stack flushes after it.
            fua: false,
            trim: w && self.zero_clusters,
            zero: w && self.zero_clusters,
            fast_zero: w && self.zero_clusters,
            cache: false,
            // One image, one imago instance for every connection, and a flush covers all.
            multi_conn: true,
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.op(offset, buf.len() as u64, || self.access.read(buf, offset))
    }

    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.check_no_lease(offset, buf.len() as u64)?;
        self.op(offset, buf.len() as u64, || self.access.write(buf, offset))?;
        if fua {
            self.flush_all()?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.flush_all()
    }

    /// Whole clusters only, as QEMU discards: the bytes of a partial cluster stay (a trim
    /// is advisory), so a trim never writes zeroes.
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let c = self.cluster_bytes;
        let start = offset.div_ceil(c) * c;
        let end = ((offset + len) / c * c).max(start);
        self.check_no_lease(offset, len)?;
        if end > start {
            self.op(start, end - start, || {
                self.zero_range(start, end - start, true)
            })?;
        }
        if fua {
            self.flush_all()?;
        }
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        if flags.fast && !self.zeroing_is_fast(offset, len) {
            return Err(ZeroError::NotFast);
        }
        self.check_no_lease(offset, len)?;
        self.op(offset, len, || self.zero_range(offset, len, flags.may_trim))?;
        if flags.fua {
            self.flush_all()?;
        }
        Ok(())
    }

    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.op(offset, len, || {
            status::allocation(&self.access, &self.layers, offset, len, extents_max, out)
        })
    }

    fn meta_contexts(&self) -> Vec<String> {
        let bitmaps = self.bitmaps.iter().map(bitmaps::DirtyBitmap::context);
        std::iter::once(ALLOCATION_DEPTH.to_owned())
            .chain(bitmaps)
            .collect()
    }

    fn meta_extents(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        if context == ALLOCATION_DEPTH {
            return self.op(offset, len, || {
                status::depth(&self.access, offset, len, extents_max, out)
            });
        }
        let Some(bitmap) = self.bitmaps.iter().find(|b| b.context() == context) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        bitmap.extents(offset, len, extents_max, out);
        Ok(())
    }

    /// Data clusters at their file offsets (the image's own, or a backing file's for a read);
    /// zero clusters and unallocated ones as zeroes; anything imago must compute or allocate
    /// (compressed clusters, writes to clusters the image does not own yet) through the stack.
    ///
    /// Never waits (engines ask on ring threads): while another imago operation runs, or for
    /// a range whose L2 tables may not be cached, the whole range goes through the stack
    /// (`map_gate.rs`).
    fn map(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<()> {
        // A FUA write is durable only once imago's metadata is too.
        out.dsync_is_fua = false;
        let pass = self.gate.try_map();
        if pass.is_none() || !self.warm.covers(offset, len) {
            out.push_stack(len);
            return Ok(());
        }
        let (mut pos, end) = (offset, offset + len);
        while pos < end {
            if out.segments().len() + 1 >= crate::export::SEGMENTS_MAX {
                out.push_stack(end - pos);
                break;
            }
            let (mapping, n) = self.access.get_mapping(pos, end - pos)?;
            let n = n.min(end - pos);
            if n == 0 {
                out.push_stack(end - pos);
                break;
            }
            out.push(n, place_of(mapping, n, how));
            pos += n;
        }
        Ok(())
    }

    fn medium(&self) -> Option<Medium> {
        Some(if self.direct {
            Medium::Direct
        } else {
            Medium::PageCache
        })
    }

    fn leases(&self) -> Option<std::sync::Arc<Leases>> {
        self.leases.clone()
    }

    fn durability(&self) -> Option<std::sync::Arc<crate::export::Durability>> {
        Some(std::sync::Arc::clone(&self.durability))
    }
}

/// Where a mapping's `n` bytes can be reached by an engine for `how` (with `--direct`, the
/// file's O_DIRECT descriptor beside its buffered one, for the engine's unaligned requests).
/// Data that a (damaged or hostile) image maps past the end of its file is left to imago,
/// which reads it as zeroes: an engine is never sent to read where the file has no bytes.
fn place_of(mapping: Mapping<'_, ImageStorage>, n: u64, how: MapFor) -> Place {
    match (mapping, how) {
        (
            Mapping::Raw {
                storage, offset, ..
            },
            MapFor::Read { .. },
        )
        | (
            Mapping::Raw {
                storage,
                offset,
                writable: true,
                ..
            },
            MapFor::Write,
        ) => match storage.file() {
            Some(file)
                if offset
                    .checked_add(n)
                    .is_some_and(|end| end <= file.length()) =>
            {
                match file.direct_fd() {
                    Some(direct) => Place::Direct {
                        direct,
                        buffered: file.raw_fd(),
                        offset,
                    },
                    None => Place::File {
                        fd: file.raw_fd(),
                        offset,
                    },
                }
            }
            _ => Place::Stack,
        },
        (Mapping::Zero { .. }, MapFor::Read { .. }) => Place::Zero,
        _ => Place::Stack,
    }
}

#[cfg(test)]
mod tests;
