//! TLS for the server: everything but the kTLS probe is the `zcnbd-tls` crate (shared with
//! the client), re-exported here so the server names it as `crate::tls`. The probe needs a
//! `setsockopt`, and the server's `sys` is where its `unsafe` lives.

pub use zcnbd_tls::*;

pub mod ktls;

#[cfg(test)]
pub mod test_psk;
