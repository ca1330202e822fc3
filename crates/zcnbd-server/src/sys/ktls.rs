//! The one system call the kTLS probe needs and no safe crate offers:
//! `setsockopt(fd, SOL_TCP, TCP_ULP, "tls")`, which attaches the kernel's TLS upper-layer
//! protocol to a TCP socket (and loads the `tls` module on demand, if the kernel can).

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// Attaches the `tls` ULP to a connected TCP socket.
pub fn set_tcp_ulp_tls(sock: &TcpStream) -> io::Result<()> {
    const ULP: &[u8] = b"tls";
    // SAFETY: the descriptor belongs to `sock`, which the borrow keeps open for the call;
    // `optval` points to ULP.len() readable bytes of a static and `optlen` says exactly
    // that; the kernel copies the name during the call and keeps no pointer to it.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            ULP.as_ptr().cast(),
            ULP.len() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
