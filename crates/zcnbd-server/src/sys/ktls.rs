//! kTLS: the one system call the probe needs and no safe crate offers,
//! `setsockopt(fd, SOL_TCP, TCP_ULP, "tls")`, which attaches the kernel's TLS upper-layer
//! protocol to a TCP socket (and loads the `tls` module on demand, if the kernel can); and
//! the three OpenSSL calls the `openssl` crate does not wrap that route a connection's
//! writes to its socket, where OpenSSL installs kTLS itself (`zcnbd_tls::KernelSend`).

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, BorrowedFd};

use foreign_types::ForeignTypeRef;
use openssl::ssl::SslRef;

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

/// `BIO_get_ktls_send(b)` is a macro over this `BIO_ctrl` command (openssl/bio.h, 3.0).
const BIO_CTRL_GET_KTLS_SEND: libc::c_int = 73;
/// `BIO_new_socket`'s flag: freeing the BIO leaves the descriptor open.
const BIO_NOCLOSE: libc::c_int = 0;

/// Makes `ssl` write to a socket BIO on `socket` (its read BIO, the session's memory, stays).
/// With `SSL_OP_ENABLE_KTLS` set on the context, OpenSSL then installs kTLS for sending
/// when the handshake sets the write keys. The caller keeps `socket` open while `ssl` lives.
pub fn route_to_socket(ssl: &SslRef, socket: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: BIO_new_socket only records the descriptor number (BIO_NOCLOSE: freeing the
    // BIO never closes it); it returns a new BIO with one reference, or NULL.
    let bio = unsafe { openssl_sys::BIO_new_socket(socket.as_raw_fd(), BIO_NOCLOSE) };
    if bio.is_null() {
        return Err(io::Error::other("BIO_new_socket failed"));
    }
    let ssl = ssl.as_ptr();
    // SAFETY: `ssl` is a live SSL (borrowed from its owner, which holds it exclusively while
    // it sets the connection up; SslRef is an opaque foreign type, so OpenSSL may mutate it
    // through this pointer). Its read BIO is passed back as it is (no reference taken or
    // dropped for it); the new `bio`'s one reference goes to `ssl` as its write BIO, and the
    // previous write BIO (the same object as the read BIO, holding two references) loses
    // one: SSL_set_bio(3ssl), "the rbio is the same as the previously set value".
    unsafe { openssl_sys::SSL_set_bio(ssl, openssl_sys::SSL_get_rbio(ssl), bio) };
    Ok(())
}

/// Whether the kernel encrypts what `ssl` sends (`BIO_get_ktls_send` of its write BIO).
pub fn sends_in_kernel(ssl: &SslRef) -> bool {
    // SAFETY: `ssl` is live for the borrow; SSL_get_wbio returns its write BIO (owned by
    // `ssl`, valid while it is) or NULL, and this ctrl only reads a flag of a socket BIO
    // (other BIO types answer 0).
    unsafe {
        let wbio = openssl_sys::SSL_get_wbio(ssl.as_ptr());
        !wbio.is_null()
            && openssl_sys::BIO_ctrl(wbio, BIO_CTRL_GET_KTLS_SEND, 0, std::ptr::null_mut()) > 0
    }
}

/// Makes `ssl` write to its read BIO (the session's memory) again, freeing the socket BIO
/// `route_to_socket` installed (the descriptor stays open).
pub fn route_to_memory(ssl: &SslRef) {
    let ssl = ssl.as_ptr();
    // SAFETY: `ssl` is live and held exclusively by the caller (see `route_to_socket`).
    // SSL_set_bio with the current read BIO as both BIOs takes one more reference to it for
    // the write side ("rbio == wbio": BIO_up_ref) and frees the previous write BIO (the
    // socket BIO, BIO_NOCLOSE), leaving the read BIO untouched.
    unsafe {
        let rbio = openssl_sys::SSL_get_rbio(ssl);
        if !rbio.is_null() {
            openssl_sys::SSL_set_bio(ssl, rbio, rbio);
        }
    }
}
