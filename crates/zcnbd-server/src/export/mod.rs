//! Exports: what a client can attach to. An export is a stack (`stack.rs`): a base backend
//! (`base/`: memory, file or block device, null, Ceph RBD) under zero or more layers
//! (`layers/`, nbdkit's filters; `tracking/`, the dirty bitmaps zcnbd keeps), with one checked top that every request of both engines
//! goes through. Each part answers capability queries and performs flagged operations
//! (nbdkit's plugin shape, `backend.rs`), and says where its bytes live for an engine that
//! moves them itself (`place.rs`: a map of segments per request). [`Export`] adds the name,
//! description, and limits, and derives the transmission flags.
//!
//! A backend's operations are blocking methods, run on the worker pool, unless it says it
//! can take them asynchronously ([`Backend::can_submit`]): then each request's operations are
//! handed to [`Backend::submit`] with a [`Completion`] (`async_op.rs`), and no thread waits
//! while they are in flight.

mod async_op;
mod backend;
mod base;
pub mod connection;
mod durability;
mod flags;
mod layer;
pub mod layers;
mod lease;
mod place;
mod stack;
pub mod tracking;

pub use async_op::{unpiped, AsyncOp, Completion, Plug};
pub use backend::{run_blocking, Backend, NbdStream, PipedRead, MORE_PIPES_MAX};
pub use base::http_fuzz;
pub use base::qcow2_bitmaps;
pub use base::{
    create_qcow2, is_http_url, memory_backend, overlay_over_file, overlay_over_source,
    parse_http_timeout, probe_image, BackendSource, BitmapRequest, FileBackend, FileMode,
    HttpBackend, HttpError, HttpHeader, HttpSpec, HttpSpecError, ImageBackend, ImageError,
    ImageFormat, ImageOpenOptions, MemoryBackend, NbdBackend, NullBackend, Probed, RbdBackend,
    RbdSpec, RbdSpecError, BACKING_DEPTH_MAX, DIRECT_ALIGN_BYTES, HTTP_CONNECTIONS_DEFAULT,
    HTTP_CONNECTIONS_MAX, HTTP_TIMEOUT_DEFAULT, OVERLAY_DIR_DEFAULT, UPSTREAM_CONNECTIONS_MAX,
};
pub use durability::Durability;
pub use flags::{Capabilities, ZeroError, ZeroFlags};
pub use layer::{Layer, Layered};
pub use lease::{Change, Lease, LeaseHold, Leases};
pub use place::{Map, MapFor, Medium, Place, Segment, SEGMENTS_MAX};
pub use stack::{Refusal, Stack};

use std::io;
use std::sync::Arc;

use zcnbd_proto::consts::transmission_flags as tf;
use zcnbd_proto::{BlockSize, ExportInfo};

/// A named export: a stack plus policy.
#[derive(Debug, Clone)]
pub struct Export {
    /// Name clients select.
    pub name: String,
    /// Shown by `nbdinfo --list`.
    pub description: String,
    /// Advertised size constraints.
    pub block_size: BlockSize,
    /// Where the data lives, and the checks every request goes through (read-only among
    /// them).
    pub stack: Arc<Stack>,
    /// Most clients attached to this export at once (`None`: only the server's limit).
    pub clients_max: Option<usize>,
    /// Only clients that switched to TLS may see or use it (nbd-server's `tlsonly`).
    pub tls_only: bool,
    /// Advertise `NBD_FLAG_ROTATIONAL` (the kernel client then sorts requests).
    pub rotational: bool,
    /// The dirty bitmaps it tracks (`-B NAME`), recorded by the stack's top layer.
    pub bitmaps: Option<Arc<tracking::Bitmaps>>,
    /// What it serves, for the log ("file /var/lib/vm.qcow2", "memory", "rbd:rbd/vm1").
    pub source: String,
}

impl Export {
    /// An export called `name` over `stack`, with no description, the default block sizes
    /// and no limits of its own.
    pub fn new(name: impl Into<String>, stack: Stack) -> Export {
        Export {
            name: name.into(),
            description: String::new(),
            block_size: BlockSize::default(),
            stack: Arc::new(stack),
            clients_max: None,
            tls_only: false,
            rotational: false,
            bitmaps: None,
            source: String::new(),
        }
    }

    /// Transmission flags, advertised honestly from the stack's capabilities.
    pub fn transmission_flags(&self) -> u16 {
        let caps = self.stack.capabilities();
        let writable = !self.stack.is_read_only();
        let mut flags = tf::HAS_FLAGS | tf::SEND_DF;
        let mut set = |cond: bool, flag: u16| {
            if cond {
                flags |= flag;
            }
        };
        set(!writable, tf::READ_ONLY);
        set(caps.flush, tf::SEND_FLUSH);
        // FUA is emulated by a flush where the layers have none of their own (the stack's).
        set(writable && (caps.fua || caps.flush), tf::SEND_FUA);
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
            size: self.stack.size(),
            flags: self.transmission_flags(),
            block_size: self.block_size,
            tls_only: self.tls_only,
            meta_contexts: self.stack.meta_contexts(),
        }
    }
}

/// Maps an I/O error to the errno a reply carries (a stack's [`Refusal`] carries its own).
pub fn errno_of(err: &io::Error) -> zcnbd_proto::Errno {
    let refused = err.get_ref().and_then(|e| e.downcast_ref::<Refusal>());
    let code = refused.map(|r| r.errno).or(err.raw_os_error());
    zcnbd_proto::Errno::from_host(code.unwrap_or(libc::EIO))
}
