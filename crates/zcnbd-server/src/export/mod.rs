//! Exports: what a client can attach to. Each backend answers capability queries and performs
//! flagged operations (nbdkit's plugin shape); [`Export`] adds the name, description, policy
//! (read-only) and size constraints, and derives the transmission flags from all of that.
//!
//! A backend's operations are blocking methods, run on the worker pool, unless it says it
//! can take them asynchronously ([`Backend::can_submit`]): then each request's operations are
//! handed to [`Backend::submit`] with a [`Completion`] (`submission.rs`), and no thread waits
//! while they are in flight.

mod file;
mod known_data;
mod memory;
mod null;
mod rbd;
mod rbd_spec;
mod submission;

pub use file::{FileBackend, FileMode, DIRECT_ALIGN_BYTES};
pub use memory::{memory_backend, MemoryBackend};
pub use null::NullBackend;
pub use rbd::RbdBackend;
pub use rbd_spec::{RbdSpec, RbdSpecError};
pub use submission::{Completion, Op};

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use zcnbd_proto::consts::transmission_flags as tf;
use zcnbd_proto::{BlockSize, ExportInfo, Extent};

/// What a backend can do; each true value becomes an advertised transmission flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Accepts writes at all.
    pub write: bool,
    /// `flush` makes earlier writes durable.
    pub flush: bool,
    /// `pwrite(.., fua = true)` is durable on return.
    pub fua: bool,
    /// `trim` can discard.
    pub trim: bool,
    /// `zero` is implemented.
    pub zero: bool,
    /// `zero` can fail fast when it would be slow.
    pub fast_zero: bool,
    /// `cache` does something useful (prefetch).
    pub cache: bool,
    /// All connections see one consistent image and a flush on one covers all.
    pub multi_conn: bool,
}

/// How `zero` may do its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroFlags {
    /// The range may become a hole (`NBD_CMD_FLAG_NO_HOLE` not set).
    pub may_trim: bool,
    /// Fail with [`ZeroError::NotFast`] instead of writing zeroes slowly.
    pub fast: bool,
    /// Durable on return.
    pub fua: bool,
}

/// Why `zero` failed.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// `fast` was asked and zeroing would be no faster than writing.
    #[error("zeroing would not be fast")]
    NotFast,
    /// The backend failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// A storage backend. All offsets and lengths are already validated against the size.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// What it can do.
    fn capabilities(&self) -> Capabilities;
    /// Fills `buf` from `offset`.
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`, durably if `fua`.
    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Discards a range (advisory).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()>;
    /// Makes a range read as zeroes.
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError>;
    /// Prefetches a range.
    fn cache(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Appends up to `extents_max` `base:allocation` extents covering `[offset, offset+len)`
    /// from `offset` on (fewer if they run out; at least one when `len > 0`).
    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()>;
    /// Where an I/O engine can reach the bytes without `pread`/`pwrite` (splice, mmap,
    /// O_DIRECT reads into its own buffers).
    fn data_source(&self) -> DataSource<'_> {
        DataSource::Synthetic
    }
    /// Whether a structured read asks [`Backend::extents`] first, to send its holes as hole
    /// chunks. False where finding the extents costs a round trip of its own (RBD: a RADOS
    /// read of the object map), so that every read is one data chunk read in one operation.
    fn sparse_reads(&self) -> bool {
        true
    }
    /// Whether every blocking method returns without waiting on a device or the network (a
    /// memory export: its work is a copy), so an engine may run requests on the thread that
    /// read them instead of handing them to the worker pool.
    fn never_waits(&self) -> bool {
        false
    }
    /// Whether requests' operations go to [`Backend::submit`] instead of the blocking methods
    /// on the worker pool. An asynchronous backend's data source is `Synthetic`, so every
    /// request goes through the dispatcher; its blocking methods are still called outside
    /// requests (the flush at shutdown).
    fn can_submit(&self) -> bool {
        false
    }
    /// Starts `op` and returns without waiting for it; `done` is to be called when it is
    /// finished, from any thread (the backend's own, as librbd's aio callbacks are) or before
    /// `submit` returns. Called only if [`Backend::can_submit`], from an engine's thread (a
    /// connection's reader, a ring), so it must not block, or from the thread that completes
    /// the request's previous operation (a read's data after its extents), so it must not
    /// wait for that thread either. The completion may release the last reference to the
    /// backend, on the thread that calls it. The default refuses (`EOPNOTSUPP`): blocking
    /// backends are never asked.
    fn submit(&self, op: Op, done: Completion) {
        done.complete(op, Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
    }
}

/// How an engine can reach a backend's bytes directly.
#[derive(Debug, Clone, Copy)]
pub enum DataSource<'a> {
    /// The memory export: its memfd (splice-able) and a shared mapping of it (receive into,
    /// send from).
    Memory {
        fd: BorrowedFd<'a>,
        mapping: &'a Arc<crate::sys::mapping::Mapping>,
    },
    /// A file served through the page cache: splice-able.
    PageCache { fd: BorrowedFd<'a> },
    /// A file with an O_DIRECT descriptor for aligned I/O and a buffered twin for the rest.
    Direct {
        direct: BorrowedFd<'a>,
        buffered: BorrowedFd<'a>,
    },
    /// No file behind it (null): only the backend's methods.
    Synthetic,
}

/// A named export: a backend plus policy.
#[derive(Debug, Clone)]
pub struct Export {
    /// Name clients select.
    pub name: String,
    /// Shown by `nbdinfo --list`.
    pub description: String,
    /// Refuse writes even if the backend could.
    pub read_only: bool,
    /// Advertised size constraints.
    pub block_size: BlockSize,
    /// Where the data lives.
    pub backend: Arc<dyn Backend>,
    /// Most clients attached to this export at once (`None`: only the server's limit).
    pub clients_max: Option<usize>,
    /// Only clients that switched to TLS may see or use it (nbd-server's `tlsonly`).
    pub tls_only: bool,
    /// Advertise `NBD_FLAG_ROTATIONAL` (the kernel client then sorts requests).
    pub rotational: bool,
}

impl Export {
    /// Transmission flags, advertised honestly from the backend's capabilities.
    pub fn transmission_flags(&self) -> u16 {
        let caps = self.backend.capabilities();
        let writable = caps.write && !self.read_only;
        let mut flags = tf::HAS_FLAGS | tf::SEND_DF;
        let mut set = |cond: bool, flag: u16| {
            if cond {
                flags |= flag;
            }
        };
        set(!writable, tf::READ_ONLY);
        set(caps.flush, tf::SEND_FLUSH);
        set(writable && caps.fua, tf::SEND_FUA);
        set(writable && caps.trim, tf::SEND_TRIM);
        set(writable && caps.zero, tf::SEND_WRITE_ZEROES);
        set(writable && caps.zero && caps.fast_zero, tf::SEND_FAST_ZERO);
        set(caps.cache, tf::SEND_CACHE);
        set(caps.multi_conn, tf::CAN_MULTI_CONN);
        set(self.rotational, tf::ROTATIONAL);
        flags
    }

    /// What the handshake tells clients about this export.
    pub fn info(&self) -> ExportInfo {
        ExportInfo {
            name: self.name.clone(),
            description: self.description.clone(),
            size: self.backend.size(),
            flags: self.transmission_flags(),
            block_size: self.block_size,
            tls_only: self.tls_only,
        }
    }
}

/// Maps an I/O error to the errno a reply carries.
pub fn errno_of(err: &io::Error) -> zcnbd_proto::Errno {
    zcnbd_proto::Errno::from_host(err.raw_os_error().unwrap_or(5))
}
