//! Whether this kernel can take over sending TLS records (kTLS), probed once at start, and
//! the hook (`KernelTls`) that lets OpenSSL install it on each TLS connection's socket
//! (docs/design/tls.md: what is offloaded, what stays in user space, and why).
//!
//! The probe attaches the `tls` upper-layer protocol to a connected loopback TCP socket, as
//! OpenSSL's own kTLS setup does first; `ENOENT` means the kernel has no `tls` module (the
//! kernel tries to load it on demand, so `/proc/sys/net/ipv4/tcp_available_ulp` alone can
//! say "no" when the probe would say "yes").

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, TcpListener, TcpStream};

use std::os::fd::BorrowedFd;

use openssl::ssl::SslRef;
use zcnbd_tls::KernelSend;

use crate::sys::ktls::{self as sys, set_tcp_ulp_tls};

/// zcnbd-tls's kTLS hook, over the OpenSSL calls of `sys::ktls`.
#[derive(Debug, Clone, Copy)]
pub struct KernelTls;

impl KernelSend for KernelTls {
    fn route_to_socket(&self, ssl: &SslRef, socket: BorrowedFd<'_>) -> io::Result<()> {
        sys::route_to_socket(ssl, socket)
    }

    fn is_in_kernel(&self, ssl: &SslRef) -> bool {
        sys::sends_in_kernel(ssl)
    }

    fn route_to_memory(&self, ssl: &SslRef) {
        sys::route_to_memory(ssl)
    }
}

/// Probes once, at start, whether TLS connections can send through the kernel; the text
/// says what was found, for the log lines.
pub fn probe_once() -> (Option<KernelTls>, String) {
    let support = probe();
    let kernel = support.is_available().then_some(KernelTls);
    (kernel, support.to_string())
}

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

/// Two ends of a loopback TCP connection: (client's, server's).
pub(crate) fn loopback_pair() -> io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    Ok((client, server))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Duration;

    use zcnbd_tls::TlsVersion;

    use crate::tls::test_psk::{psk_client, psk_server};

    /// A TLS session whose writes were routed to the socket for the handshake: with kTLS
    /// the kernel encrypts what the server writes in plain text; without it (this host,
    /// say) the session is back on memory. Either way a megabyte each way arrives intact,
    /// and `kernel_sends` agrees with the probe. Both TLS versions (1.2 installs its
    /// keys after the client's Finished, 1.3 before it).
    #[test]
    fn routed_sessions_carry_data_both_ways_with_or_without_ktls() {
        let dir = tempfile::tempdir().unwrap();
        let (server, keys) = psk_server(dir.path());
        let in_kernel = probe().is_available();
        for version in [TlsVersion::Tls12, TlsVersion::Tls13] {
            let client = psk_client(&keys, Some(version));
            let (client_sock, server_sock) = loopback_pair().unwrap();
            let timeout = Duration::from_secs(10);
            let client = std::thread::spawn(move || {
                let session = client.connect(client_sock, "localhost", timeout).unwrap();
                let (mut r, mut w) = session.split();
                let data = pattern(1 << 20);
                w.write_all(&data).unwrap();
                let mut back = vec![0u8; data.len()];
                r.read_exact(&mut back).unwrap();
                assert!(back == data, "{version:?}: the echo differs");
            });
            let session = server
                .accept_with_kernel(server_sock, &[], timeout, Some(&KernelTls))
                .unwrap();
            assert_eq!(session.kernel_sends(), in_kernel, "{version:?}");
            let (mut r, mut w) = session.split();
            let mut got = vec![0u8; 1 << 20];
            r.read_exact(&mut got).unwrap();
            w.write_all(&got).unwrap();
            client.join().unwrap();
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

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
