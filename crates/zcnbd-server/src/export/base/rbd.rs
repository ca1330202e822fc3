//! The Ceph RBD export: an image (or a read-only snapshot) of a Ceph cluster, served through
//! librbd's asynchronous calls (`sys/rbd.rs`). Many requests are in flight to the cluster at
//! once and no server thread waits for one: reads land in the buffer the reply is sent from,
//! writes go from the buffer the payload was received into, and completions come back on
//! librbd's callback thread. Block status is librbd's allocation map (`rbd_diff_iterate2`,
//! whole objects), which blocks, so it runs on the export's own few metadata threads; reads do
//! not ask it first (see `sparse_reads`).
//!
//! One image handle per export, shared by every connection: a flush on it covers every write
//! completed on it, whichever connection sent it, so multi-conn is honest.

use std::io;
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use crossbeam_channel::{Receiver, Sender};
use tracing::{info, warn};
use zcnbd_proto::consts::state;
use zcnbd_proto::meta::DIRTY_BITMAP_PREFIX;
use zcnbd_proto::Extent;

use super::rbd_extents::runs_as_extents;
use super::rbd_snapshots::{changed_extents, older_snapshots, snapshot_of};
use super::RbdSpec;
use crate::export::{unpiped, AsyncOp, Backend, Capabilities, Completion, ZeroError, ZeroFlags};
use crate::sys::rbd::{on_callback_thread, Aio, CephError, Image, Rados};

/// How long connecting may take before start-up fails (`client_mount_timeout`), unless the
/// Ceph configuration sets it (Ceph's own default, 300 s, is too long to wait for a typo).
pub const MOUNT_TIMEOUT_S_DEFAULT: u32 = 30;
/// How long an operation on the cluster may take before its request fails with EIO
/// (`rados_osd_op_timeout`), unless the configuration sets it (Ceph's default: forever).
pub const OP_TIMEOUT_S_DEFAULT: u32 = 30;
/// Threads answering block status (`rbd_diff_iterate2` blocks for a RADOS read of the object
/// map: up to the op timeout when the cluster does not answer). Block-status requests beyond
/// this many wait in a queue; reads and writes never do.
const METADATA_THREADS_MAX: usize = 4;
/// Ceph's default `client_mount_timeout`, which we replace with ours.
const CEPH_MOUNT_TIMEOUT_S: f64 = 300.0;

/// A block-status question for the metadata threads.
type Job = (AsyncOp, Completion);

/// An RBD image as a backend.
#[derive(Debug)]
pub struct RbdBackend {
    image: Arc<ImageRef>,
    jobs: Sender<Job>,
    /// The metadata threads, joined on drop (so the image is closed before the process can
    /// exit under librbd's threads) unless dropped on librbd's callback thread.
    threads: Vec<JoinHandle<()>>,
    size: u64,
    writable: bool,
    name: String,
    /// Snapshots older than what is served, offered as dirty bitmaps (`rbd_snapshots.rs`).
    snapshots: Vec<String>,
}

/// The image, with a `Debug` that says which.
struct ImageRef(Image);

impl std::fmt::Debug for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Image")
    }
}

impl RbdBackend {
    /// Connects to the cluster and opens the image; read-only if `read_only` or a snapshot.
    /// Fails within `client_mount_timeout` (at most `MOUNT_TIMEOUT_S_DEFAULT` unless
    /// configured) for an unreachable cluster, and at once for a missing pool, image or key.
    pub fn open(spec: &RbdSpec, read_only: bool) -> io::Result<RbdBackend> {
        let image = connect(spec)?.open(&spec.image_name(), read_only)?;
        let size = image.size()?;
        let name = spec.name();
        let snapshots = older_snapshots(&image, spec.snap.as_deref(), &name)?;
        let image = Arc::new(ImageRef(image));
        let (jobs, rx) = crossbeam_channel::unbounded();
        let threads = (0..METADATA_THREADS_MAX)
            .map(|_| {
                let (theirs, rx) = (Arc::clone(&image), rx.clone());
                thread::Builder::new()
                    .name("rbd-meta".to_owned())
                    .spawn(move || metadata_thread(&theirs, &rx))
            })
            .collect::<io::Result<_>>()?;
        info!("RBD image {name}: {size} bytes");
        Ok(RbdBackend {
            image,
            jobs,
            threads,
            size,
            writable: !read_only && spec.snap.is_none(),
            name,
            snapshots,
        })
    }

    fn image(&self) -> &Image {
        &self.image.0
    }

    /// Starts `aio` on `op`, then (if `fua`) a flush, then completes `done`.
    /// Only a read's or write's buffer goes to librbd; the operation itself waits in the
    /// completion's closure and is handed back with the buffer put back in it.
    fn start(&self, aio: Aio, op: AsyncOp, fua: bool, done: Completion) {
        let image = Arc::clone(&self.image);
        let then = move |op: AsyncOp, result: io::Result<usize>| match result {
            Ok(_) if fua => image.0.aio(Aio::Flush, (), move |(), result| {
                done.complete(op, result.map(drop));
            }),
            result => done.complete(op, result.map(drop)),
        };
        match op {
            AsyncOp::Read { buf, offset } => self.image().aio(aio, buf, move |buf, result| {
                then(AsyncOp::Read { buf, offset }, result)
            }),
            AsyncOp::Write { buf, offset, fua } => {
                self.image().aio(aio, buf, move |buf, result| {
                    then(AsyncOp::Write { buf, offset, fua }, result)
                })
            }
            op => self
                .image()
                .aio(aio, (), move |(), result| then(op, result)),
        }
    }
}

impl Drop for RbdBackend {
    fn drop(&mut self) {
        // Disconnect the metadata threads: they finish their questions and exit.
        let (gone, _) = crossbeam_channel::bounded(0);
        drop(std::mem::replace(&mut self.jobs, gone));
        if on_callback_thread() {
            return; // they cannot need this thread; the image closes on its own thread
        }
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                warn!("RBD image {}: a metadata thread panicked", self.name);
            }
        }
        // Then `image` drops: the last reference, closing the image here.
    }
}

/// A cluster handle configured from `spec`, with our bounds on time where the configuration
/// leaves Ceph's unbounded defaults.
fn connect(spec: &RbdSpec) -> Result<Rados, CephError> {
    let mut rados = Rados::create(spec.id.as_deref())?;
    rados.read_conf(spec.conf.as_deref())?;
    // librbd's cache off, whatever the configuration says: Ceph 16's default write-around
    // cache completes writes before the OSDs have them, and when the OSD was killed under a
    // FUA write, the write and the flush after it both succeeded with the data never
    // written (test_rbd_osd_stopped_mid_run found it). Without the cache a write completes
    // when the OSDs have committed it, and an error reaches its request.
    rados.conf_set("rbd_cache", "false")?;
    let mount_s: f64 = rados
        .conf_get("client_mount_timeout")?
        .parse()
        .unwrap_or(0.0);
    if mount_s == CEPH_MOUNT_TIMEOUT_S {
        rados.conf_set("client_mount_timeout", &MOUNT_TIMEOUT_S_DEFAULT.to_string())?;
        info!(
            "client_mount_timeout not configured: connecting may take {MOUNT_TIMEOUT_S_DEFAULT} s"
        );
    }
    let op_s: f64 = rados
        .conf_get("rados_osd_op_timeout")?
        .parse()
        .unwrap_or(0.0);
    if op_s <= 0.0 {
        rados.conf_set("rados_osd_op_timeout", &OP_TIMEOUT_S_DEFAULT.to_string())?;
        info!("rados_osd_op_timeout not configured: a request the cluster leaves unanswered fails after {OP_TIMEOUT_S_DEFAULT} s");
    }
    Ok(rados)
}

/// Answers block-status questions, one at a time, until the backend is gone.
fn metadata_thread(image: &Arc<ImageRef>, jobs: &Receiver<Job>) {
    for (mut op, done) in jobs {
        let result = match &mut op {
            AsyncOp::Extents {
                offset,
                len,
                extents_max,
                out,
            } => extents(&image.0, *offset, *len, *extents_max, out),
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
        done.complete(op, result);
    }
}

/// Appends the extents of `[offset, offset+len)`: allocated objects (neighbours merged) as
/// data, the gaps between them as holes that read as zeroes.
fn extents(
    image: &Image,
    offset: u64,
    len: u64,
    extents_max: usize,
    out: &mut Vec<Extent>,
) -> io::Result<()> {
    let runs = |visit: &mut dyn FnMut(u64, u64) -> bool| image.allocated(offset, len, visit);
    let (data, gap) = (0, state::HOLE | state::ZERO);
    runs_as_extents(offset, len, extents_max, runs, data, gap, out)
}

impl Backend for RbdBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        let w = self.writable;
        Capabilities {
            write: w,
            flush: true,
            // Write, then flush: librbd's write-around cache may complete a write before the
            // OSDs have it, and librados' FADVISE_FUA flag is not documented to reach them.
            fua: w,
            trim: w,
            zero: w,
            // Zeroing that may leave holes deallocates or truncates objects on the OSDs: no
            // data moves, never slower than writing. With NO_HOLE it writes zeroes, which is
            // not faster: refused when FAST_ZERO asks (see `submit`).
            fast_zero: w,
            cache: false,
            multi_conn: true,
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.image().read(buf, offset)
    }

    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.image().write(buf, offset)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.image().flush()
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.image().discard(offset, len)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        if flags.fast && !flags.may_trim {
            return Err(ZeroError::NotFast);
        }
        self.image().write_zeroes(offset, len, !flags.may_trim)?;
        if flags.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) -> io::Result<()> {
        extents(self.image(), offset, len, max, out)
    }

    fn meta_contexts(&self) -> Vec<String> {
        let prefixed = |s: &String| format!("{DIRTY_BITMAP_PREFIX}{s}");
        self.snapshots.iter().map(prefixed).collect()
    }

    fn meta_extents(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let Some(snap) = snapshot_of(&self.snapshots, context) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        changed_extents(self.image(), snap, offset, len, max, out)
    }

    fn sparse_reads(&self) -> bool {
        // rbd_diff_iterate2 reads the object map from the cluster: a round trip before every
        // read's data, and with the OSD stopped each read waited for two op timeouts.
        false
    }

    fn can_submit(&self) -> bool {
        true
    }

    fn submit(&self, op: AsyncOp, done: Completion) {
        let (op, done) = unpiped(op, done);
        match op {
            AsyncOp::Read { offset, .. } => self.start(Aio::Read { offset }, op, false, done),
            // `unpiped` made it a plain read.
            AsyncOp::ReadPiped { .. } => {
                done.complete(op, Err(io::Error::from_raw_os_error(libc::EIO)))
            }
            AsyncOp::Write { offset, fua, .. } => self.start(Aio::Write { offset }, op, fua, done),
            AsyncOp::Flush => self.start(Aio::Flush, op, false, done),
            AsyncOp::Trim { offset, len, fua } => {
                self.start(Aio::Discard { offset, len }, op, fua, done);
            }
            AsyncOp::Zero { flags, .. } if flags.fast && !flags.may_trim => {
                done.complete(op, Err(ZeroError::NotFast.into()));
            }
            AsyncOp::Zero { offset, len, flags } => {
                let thick = !flags.may_trim;
                let aio = Aio::WriteZeroes { offset, len, thick };
                self.start(aio, op, flags.fua, done);
            }
            AsyncOp::Cache { .. } => done.complete(op, Ok(())),
            AsyncOp::Extents { .. } => {
                if let Err(e) = self.jobs.send((op, done)) {
                    // Only if the metadata threads died: answer rather than drop silently.
                    let (op, done) = e.into_inner();
                    warn!("RBD image {}: metadata threads gone", self.name);
                    done.complete(op, Err(io::Error::from_raw_os_error(libc::EIO)));
                }
            }
        }
    }
}
