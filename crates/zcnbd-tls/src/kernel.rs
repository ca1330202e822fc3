//! Handing the sending half of the record layer to the kernel (kTLS).
//!
//! OpenSSL 3.0 installs kTLS itself once the keys are known, but only on a *socket* BIO
//! (`SSL_OP_ENABLE_KTLS`, then `setsockopt(TCP_ULP "tls")` and `SOL_TLS`/`TLS_TX` with the
//! keys it derived: no key schedule of ours). Switching a connection's write BIO to its
//! socket needs a few OpenSSL calls the `openssl` crate does not wrap, so this crate, which
//! has no `unsafe`, takes them through [`KernelSend`], implemented by the server's `sys`.
//!
//! Only the sending half moves: OpenSSL 3.0 offloads TLS 1.3 receiving not at all (and TLS
//! 1.2 receiving only on a socket read BIO, which would make the reader block inside OpenSSL
//! while holding the session), so records are still read and decrypted in user space, over
//! memory, as without kTLS (docs/design/tls.md).

use std::io;
use std::os::fd::BorrowedFd;

use openssl::ssl::SslRef;

/// The OpenSSL calls that move a connection's sending half between memory and its socket.
///
/// Protocol: [`route_to_socket`](Self::route_to_socket) before the handshake; after it,
/// either [`is_in_kernel`](Self::is_in_kernel) says the kernel took the keys, or
/// [`route_to_memory`](Self::route_to_memory) puts the connection back on memory (a cipher
/// or kernel that kTLS cannot serve) with nothing lost, since the socket BIO buffers nothing.
pub trait KernelSend: Send + Sync {
    /// Sends what `ssl` writes straight to `socket` (with `SSL_OP_ENABLE_KTLS`). The socket
    /// must stay open for as long as `ssl` lives.
    fn route_to_socket(&self, ssl: &SslRef, socket: BorrowedFd<'_>) -> io::Result<()>;
    /// Whether the kernel now encrypts what is sent on the socket.
    fn is_in_kernel(&self, ssl: &SslRef) -> bool;
    /// Sends what `ssl` writes to its read BIO's memory again (the user-space path).
    fn route_to_memory(&self, ssl: &SslRef);
}
