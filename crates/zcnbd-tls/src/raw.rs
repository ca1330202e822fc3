//! Plaintext that Rust code must not read or write: a range of a shared mapping that other
//! connections may be writing at the same moment (NBD leaves the result of overlapping
//! requests undefined, but Rust must not see a data race). OpenSSL reads it itself: `SSL_write`
//! copies the plaintext into its record buffer before it encrypts, in C, so no Rust
//! reference to those bytes is ever formed and no copy of ours comes before OpenSSL's.
//!
//! Handing OpenSSL a raw address needs `unsafe`, which this crate does not have, so the
//! owner of the memory implements [`RawPlaintext`] (the server's `sys`, as for
//! [`KernelSend`](crate::KernelSend)).

use std::io;

use openssl::ssl::SslRef;

/// Memory OpenSSL encrypts from without Rust reading it.
pub trait RawPlaintext: Send + Sync {
    /// Bytes in it.
    fn len(&self) -> usize;

    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One `SSL_write` of `len` bytes starting at `at` (`at + len <= self.len()`, `len > 0`):
    /// the bytes OpenSSL took (all of them, on a memory BIO), or `SSL_get_error`'s code.
    fn ssl_write(&self, ssl: &SslRef, at: usize, len: usize) -> Result<usize, RawSslError>;
}

/// Memory OpenSSL decrypts into without Rust writing it (a write request's range of a
/// shared mapping: the payload lands in the export with no buffer of ours between).
pub trait RawDest: Send + Sync {
    /// Bytes in it.
    fn len(&self) -> usize;

    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One `SSL_read` of up to `len` bytes into the memory from `at` (`at + len <=
    /// self.len()`, `len > 0`): the bytes OpenSSL put there, or `SSL_get_error`'s code.
    fn ssl_read(&self, ssl: &SslRef, at: usize, len: usize) -> Result<usize, RawSslError>;
}

/// `SSL_write` or `SSL_read` failed on raw memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("TLS: encrypting or decrypting failed (SSL_get_error {code})")]
pub struct RawSslError {
    /// What `SSL_get_error` said.
    pub code: i32,
}

impl From<RawSslError> for io::Error {
    fn from(e: RawSslError) -> io::Error {
        io::Error::other(e)
    }
}

/// A piece of what a writer sends: bytes Rust owns, or raw plaintext.
#[derive(Clone, Copy)]
pub enum Plaintext<'a> {
    /// Ordinary bytes (headers, a reply buffer).
    Bytes(&'a [u8]),
    /// Memory only OpenSSL reads.
    Raw(&'a dyn RawPlaintext),
}

impl Plaintext<'_> {
    /// Bytes in the piece.
    pub fn len(&self) -> usize {
        match self {
            Plaintext::Bytes(b) => b.len(),
            Plaintext::Raw(r) => r.len(),
        }
    }

    /// Whether the piece is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
