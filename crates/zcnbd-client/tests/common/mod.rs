//! Shared by the client's integration tests.
pub mod servers;
