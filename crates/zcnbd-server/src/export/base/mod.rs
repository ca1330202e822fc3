//! Base backends: the bottom of an export's stack, where the bytes are (memory, a raw file or
//! block device, a disk image through imago, null, a Ceph RBD image, another NBD server's
//! export, a file on a web server).

mod file;
mod holes;
mod http;
mod image;
mod known_data;
mod memory;
mod nbd;
mod nbd_async;
mod nbd_upstream;
mod null;
mod rbd;
mod rbd_extents;
mod rbd_snapshots;
mod rbd_spec;

pub use file::{FileBackend, FileMode, DIRECT_ALIGN_BYTES};
pub use http::fuzz as http_fuzz;
pub use http::{
    is_http_url, parse_http_timeout, HttpBackend, HttpError, HttpHeader, HttpSpec, HttpSpecError,
    HTTP_CONNECTIONS_DEFAULT, HTTP_CONNECTIONS_MAX, HTTP_TIMEOUT_DEFAULT,
};
pub use image::bitmaps as qcow2_bitmaps;
pub use image::{
    create_qcow2, overlay_over_file, overlay_over_source, probe as probe_image, BackendSource,
    BitmapRequest, ImageBackend, ImageError, ImageFormat, OpenOptions as ImageOpenOptions, Probed,
    BACKING_DEPTH_MAX, OVERLAY_DIR_DEFAULT,
};
pub use memory::{memory_backend, MemoryBackend};
pub use nbd::{NbdBackend, UPSTREAM_CONNECTIONS_MAX};
pub use null::NullBackend;
pub use rbd::RbdBackend;
pub use rbd_spec::{RbdSpec, RbdSpecError};
