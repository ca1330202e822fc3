//! Shared by the client's integration tests (each binary uses a part of it).
#![allow(dead_code)]
pub mod ceph;
pub mod fake;
pub mod images;
pub mod servers;
pub mod tls_creds;
