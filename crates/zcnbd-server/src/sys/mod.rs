//! The one place with `unsafe`: memory mappings and the io_uring driver. Every block carries
//! a `SAFETY:` comment naming the invariant and who upholds it.
#![allow(unsafe_code)]

pub mod ktls;
pub mod mapping;
pub mod uring;
