//! The words a backend and its callers share: what it can do ([`Capabilities`]), how a zeroing
//! may be done ([`ZeroFlags`]) and why it failed ([`ZeroError`]).

use std::io;

/// What a backend can do; each true value becomes an advertised transmission flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Accepts writes at all.
    pub write: bool,
    /// `flush` makes earlier writes durable.
    pub flush: bool,
    /// `pwrite(.., fua = true)` is durable on return (else the stack emulates FUA with a
    /// flush after the write).
    pub fua: bool,
    /// `trim` can discard.
    pub trim: bool,
    /// `zero` is implemented.
    pub zero: bool,
    /// `zero` can fail fast when it would be slow.
    pub fast_zero: bool,
    /// `cache` does something useful (prefetch).
    pub cache: bool,
    /// All connections see one consistent image and a flush on one covers all.
    pub multi_conn: bool,
}

/// How `zero` may do its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroFlags {
    /// The range may become a hole (`NBD_CMD_FLAG_NO_HOLE` not set).
    pub may_trim: bool,
    /// Fail with [`ZeroError::NotFast`] instead of writing zeroes slowly.
    pub fast: bool,
    /// Durable on return.
    pub fua: bool,
}

/// Why `zero` failed.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// `fast` was asked and zeroing would be no faster than writing.
    #[error("zeroing would not be fast")]
    NotFast,
    /// The backend failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<ZeroError> for io::Error {
    fn from(e: ZeroError) -> io::Error {
        match e {
            ZeroError::NotFast => io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            ZeroError::Io(e) => e,
        }
    }
}
