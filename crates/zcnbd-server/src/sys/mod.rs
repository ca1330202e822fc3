//! The one place with `unsafe`: memory mappings, the io_uring driver, taking ownership of
//! passed sockets, forking and vsock addresses. Every block carries
//! a `SAFETY:` comment naming the invariant and who upholds it.
#![allow(unsafe_code)]

pub mod inherited;
pub mod ktls;
pub mod mapping;
pub mod process;
pub mod uring;
pub mod vsock;
