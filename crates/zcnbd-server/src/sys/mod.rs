//! The one place with `unsafe`: memory mappings (and sending from them), the io_uring driver, taking ownership of
//! passed sockets, forking, vsock addresses, librbd, buffers lent to the NBD client, and image files (imago's storage, QEMU's
//! byte-range locks). Every block carries
//! a `SAFETY:` comment naming the invariant and who upholds it.
#![allow(unsafe_code)]

pub mod image_file;
pub mod image_lock;
pub mod image_storage;
pub mod inherited;
pub mod ktls;
pub mod lent_memory;
pub mod mapped_io;
pub mod mapping;
pub mod netlink;
pub mod place_io;
pub mod process;
pub mod rbd;
pub mod ublk;
pub mod upstream_buffer;
pub mod uring;
pub mod vsock;
pub mod window_copy;
