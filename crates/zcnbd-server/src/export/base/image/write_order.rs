//! The order in which a writable qcow2 image's writes become durable (the design note is in
//! `image/mod.rs`). imago writes through two views of the image file (`ImageStorage::Ordered`:
//! one for metadata, one for data); this rule sorts each write into a kind by where it lands,
//! and before a write makes durable (one `fdatasync`) the unsynced writes of the kinds that
//! must reach the disk first:
//!
//! | a write of     | waits until durable         | why                                      |
//! |----------------|-----------------------------|------------------------------------------|
//! | data           | links                       | a table's old clusters, freed once the   |
//! |                |                             | header points elsewhere, may be reused   |
//! | refcounts      | tables, links, data         | L2 entries cleared before the refcounts  |
//! |                |                             | of the clusters they freed drop          |
//! | tables (L2...) | data, refcounts, links      | data (and copied backing data) and the   |
//! |                |                             | refcounts of its clusters before the L2  |
//! |                |                             | entry pointing to it                     |
//! | links          | data, refcounts, tables     | a new table and its refcount before the  |
//! |                |                             | L1/reftable entry or header linking it   |
//!
//! Writes of one kind never wait for each other: imago's caches write back every refcount
//! block, then every L2 table, so a FLUSH after allocating writes costs at most three
//! `fdatasync`s (data, refcounts, tables) where it cost one. Writes the engines make in
//! place (to clusters already allocated) depend on nothing and go straight to the file.
//!
//! Kinds by offset: the header's cluster, the L1 table and the refcount table are links;
//! the clusters the refcount table names are refcount blocks; any other metadata write is a
//! table (an L2 table, or a new table not linked yet). A link that moves tables (the header,
//! the refcount table) is followed by reading the layout again.

use std::collections::HashSet;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tracing::error;

use super::header::{probe, Probed, Qcow2Header};
use super::refcounts::REFCOUNT_TABLE_BYTES_MAX;
use crate::export::Durability;
use crate::sys::image_file::ImageFile;
use crate::sys::image_storage::{View, WriteKind, WriteRule};

const KINDS: [WriteKind; 4] = [
    WriteKind::Data,
    WriteKind::Refcounts,
    WriteKind::Table,
    WriteKind::Link,
];

fn index(kind: WriteKind) -> usize {
    match kind {
        WriteKind::Data => 0,
        WriteKind::Refcounts => 1,
        WriteKind::Table => 2,
        WriteKind::Link => 3,
    }
}

/// Whether a write of `kind` must wait until writes of `first` are durable (the table above).
fn waits_for(kind: WriteKind, first: WriteKind) -> bool {
    kind != first && (kind != WriteKind::Data || first == WriteKind::Link)
}

/// Where the image's tables are, as its header and refcount table say.
#[derive(Debug, Default)]
struct Layout {
    cluster_bytes: u64,
    l1: Range<u64>,
    reftable: Range<u64>,
    /// File offsets of the refcount blocks.
    refblocks: HashSet<u64>,
    /// The layout could not be read: every metadata write is a link (waits for all).
    unknown: bool,
}

fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

impl Layout {
    fn read(file: &ImageFile) -> io::Result<Layout> {
        let Probed::Qcow2(h) = probe(file.file())? else {
            return Err(io::Error::other("not a qcow2 header any more"));
        };
        Layout::of(file, &h)
    }

    fn of(file: &ImageFile, h: &Qcow2Header) -> io::Result<Layout> {
        let cluster_bytes = h.cluster_bytes();
        let l1_start = h.l1_table_offset;
        let rt_start = h.refcount_table_offset;
        let rt_bytes = u64::from(h.refcount_table_clusters) * cluster_bytes;
        let mut table = vec![0u8; rt_bytes.min(REFCOUNT_TABLE_BYTES_MAX) as usize];
        file.file().read_exact_at(&mut table, rt_start)?;
        let refblocks = table
            .chunks_exact(8)
            .map(|e| u64::from_be_bytes(<[u8; 8]>::try_from(e).unwrap_or_default()) & !0x1ff)
            .filter(|&offset| offset != 0)
            .collect();
        Ok(Layout {
            cluster_bytes,
            l1: l1_start..l1_start.saturating_add(u64::from(h.l1_size) * 8),
            reftable: rt_start..rt_start.saturating_add(rt_bytes),
            refblocks,
            unknown: false,
        })
    }

    fn kind(&self, range: &Range<u64>) -> WriteKind {
        let header = 0..self.cluster_bytes;
        if self.unknown
            || overlaps(range, &header)
            || overlaps(range, &self.l1)
            || overlaps(range, &self.reftable)
        {
            return WriteKind::Link;
        }
        let cluster = range.start / self.cluster_bytes.max(1) * self.cluster_bytes;
        if self.refblocks.contains(&cluster) {
            WriteKind::Refcounts
        } else {
            WriteKind::Table
        }
    }

    /// Whether a write of `range` may have moved tables (read the layout again after it).
    fn moves_tables(&self, range: &Range<u64>) -> bool {
        overlaps(range, &(0..self.cluster_bytes)) || overlaps(range, &self.reftable)
    }
}

/// The write order of one writable qcow2 image (see the module's documentation).
#[derive(Debug)]
pub struct WriteOrder {
    /// The image file, and its external data file if it has one: what a barrier syncs.
    files: Mutex<Vec<Arc<ImageFile>>>,
    layout: RwLock<Layout>,
    /// Writes of each kind that ended, and how many of them are known durable.
    written: [AtomicU64; 4],
    durable: [AtomicU64; 4],
    /// One barrier at a time (a second finds the first did its work).
    barrier: Mutex<()>,
    /// Barriers made (each one `fdatasync` of each file).
    barriers: AtomicU64,
    /// A failed barrier is a failed sync: the export's FLUSHes fail from then on.
    durability: Arc<Durability>,
}

impl WriteOrder {
    /// The order of the image in `file`, whose header is `header`.
    pub fn new(
        file: &Arc<ImageFile>,
        header: &Qcow2Header,
        durability: Arc<Durability>,
    ) -> io::Result<Arc<WriteOrder>> {
        Ok(Arc::new(WriteOrder {
            files: Mutex::new(vec![Arc::clone(file)]),
            layout: RwLock::new(Layout::of(file, header)?),
            written: Default::default(),
            durable: Default::default(),
            barrier: Mutex::new(()),
            barriers: AtomicU64::new(0),
            durability,
        }))
    }

    /// An external data file: its data writes are ordered too, and barriers sync it.
    pub fn add_data_file(&self, file: &Arc<ImageFile>) {
        let mut files = self.files.lock().unwrap_or_else(PoisonError::into_inner);
        if !files.iter().any(|f| Arc::ptr_eq(f, file)) {
            files.push(Arc::clone(file));
        }
    }

    /// How many barriers (syncs a write waited for, and imago's own) were made.
    #[cfg(test)]
    pub fn barriers(&self) -> u64 {
        self.barriers.load(Ordering::Relaxed)
    }

    fn unsynced(&self, kind: WriteKind) -> bool {
        let i = index(kind);
        self.written[i].load(Ordering::SeqCst) > self.durable[i].load(Ordering::SeqCst)
    }

    /// Makes every write that ended so far durable.
    fn sync_all(&self) -> io::Result<()> {
        let _one = self.barrier.lock().unwrap_or_else(PoisonError::into_inner);
        self.barriers.fetch_add(1, Ordering::Relaxed);
        let ended = KINDS.map(|k| self.written[index(k)].load(Ordering::SeqCst));
        let files = self
            .files
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for file in &files {
            if let Err(e) = file.sync_data() {
                self.durability.lose(&format_args!("{file}: {e}"));
                return Err(e);
            }
        }
        for (i, n) in ended.iter().enumerate() {
            self.durable[i].fetch_max(*n, Ordering::SeqCst);
        }
        Ok(())
    }

    fn reload(&self, file: &ImageFile) {
        let layout = Layout::read(file).unwrap_or_else(|e| {
            error!(image = %file, error = %e, "the qcow2 layout could not be read again: every metadata write now waits for all others");
            Layout {
                unknown: true,
                ..Layout::default()
            }
        });
        *self.layout.write().unwrap_or_else(PoisonError::into_inner) = layout;
    }
}

impl WriteRule for WriteOrder {
    fn before(&self, view: View, offset: u64, len: u64) -> io::Result<WriteKind> {
        let kind = match view {
            View::Data => WriteKind::Data,
            View::Metadata => self
                .layout
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .kind(&(offset..offset.saturating_add(len))),
        };
        if KINDS
            .iter()
            .any(|&first| waits_for(kind, first) && self.unsynced(first))
        {
            self.sync_all()?;
        }
        Ok(kind)
    }

    fn after(&self, kind: WriteKind, file: &ImageFile, offset: u64, len: u64) {
        self.written[index(kind)].fetch_add(1, Ordering::SeqCst);
        let range = offset..offset.saturating_add(len);
        let moved = kind == WriteKind::Link
            && self
                .layout
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .moves_tables(&range);
        if moved {
            self.reload(file);
        }
    }

    fn sync(&self, view: View, file: &ImageFile) -> io::Result<()> {
        let first = self
            .files
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .first()
            .is_some_and(|f| std::ptr::eq(Arc::as_ptr(f), file));
        if view == View::Data && first {
            // imago syncs the metadata view first, which is the same file.
            return Ok(());
        }
        self.sync_all()
    }
}

#[cfg(test)]
#[path = "write_order_tests.rs"]
mod tests;
