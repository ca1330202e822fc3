//! Whether this kernel can take over the TLS record layer (kTLS). Only a probe: zcnbd's TLS
//! runs in user space (docs/TLS-DESIGN.md says why and what turning kTLS on would take).
//!
//! The probe attaches the `tls` upper-layer protocol to a connected loopback TCP socket, as
//! OpenSSL's own kTLS setup does first; `ENOENT` means the kernel has no `tls` module (the
//! kernel tries to load it on demand, so `/proc/sys/net/ipv4/tcp_available_ulp` alone can
//! say "no" when the probe would say "yes").

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, TcpListener, TcpStream};

use crate::sys::ktls::set_tcp_ulp_tls;

/// What the probe found.
#[derive(Debug)]
pub enum KtlsSupport {
    /// `TCP_ULP "tls"` was accepted.
    Available,
    /// The kernel has no `tls` ULP (`ENOENT`): built without `CONFIG_TLS` or module missing.
    NoTlsModule,
    /// The probe could not run or failed otherwise.
    Unknown(io::Error),
}

impl KtlsSupport {
    /// Whether kTLS can be used.
    pub fn is_available(&self) -> bool {
        matches!(self, KtlsSupport::Available)
    }
}

impl fmt::Display for KtlsSupport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KtlsSupport::Available => write!(f, "kTLS available (TCP_ULP \"tls\" accepted)"),
            KtlsSupport::NoTlsModule => write!(f, "no kTLS: the kernel has no \"tls\" ULP"),
            KtlsSupport::Unknown(e) => write!(f, "kTLS unknown: the probe failed: {e}"),
        }
    }
}

/// Probes kTLS on a throwaway loopback connection.
pub fn probe() -> KtlsSupport {
    match loopback_pair().and_then(|(client, _server)| set_tcp_ulp_tls(&client)) {
        Ok(()) => KtlsSupport::Available,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => KtlsSupport::NoTlsModule,
        Err(e) => KtlsSupport::Unknown(e),
    }
}

/// The kernel's list of registered ULPs (`tcp_available_ulp`), for reports.
pub fn available_ulps() -> io::Result<String> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp").map(|s| s.trim().into())
}

fn loopback_pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    Ok((client, server))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports, never fails: whether kTLS exists is the kernel's business. The io_uring
    /// tests' convention: say what was found and why a feature test would be skipped.
    #[test]
    fn probe_reports_what_the_kernel_has() {
        let support = probe();
        let ulps = available_ulps().unwrap_or_else(|e| format!("unreadable: {e}"));
        eprintln!("kTLS probe: {support}; tcp_available_ulp: {ulps}");
        assert!(!matches!(support, KtlsSupport::Unknown(_)), "{support}");
    }
}
