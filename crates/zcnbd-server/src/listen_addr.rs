//! Where a server listens, as configured (the listeners themselves are in `listener.rs`).

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::vsock::VsockAddr;

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
    /// AF_VSOCK: a context id ([`crate::vsock::CID_ANY`]: any of this machine's) and port.
    Vsock(VsockAddr),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Vsock(a) => write!(f, "{a}"),
        }
    }
}
