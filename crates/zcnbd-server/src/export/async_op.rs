//! The asynchronous side of a backend: an [`AsyncOp`] that owns the memory it works on, handed to
//! [`Backend::submit`](super::Backend::submit) with a [`Completion`] that the backend calls once, from any thread,
//! when the operation is done - as librbd calls an `rbd_aio_*` request's callback. No thread
//! of the server waits while the operation is in flight.
//!
//! Ownership: the backend owns the `AsyncOp` (and so a read's destination or a write's payload)
//! from `submit` until it hands it back through [`Completion::complete`]; the dispatcher
//! takes the result out of what comes back (a read's data, the extents found).

use std::fmt;
use std::io;

use zcnbd_proto::Extent;

use super::flags::ZeroFlags;
use crate::buffer_pool::PooledBuf;
use crate::pipe::Pipe;

/// One operation for an asynchronous backend, with its flags (as the blocking methods of
/// [`Backend`](super::Backend)); offsets and lengths are already validated against the size.
#[derive(Debug)]
pub enum AsyncOp {
    /// Fill all of `buf` from `offset`; holes read as zeroes.
    Read { buf: PooledBuf, offset: u64 },
    /// A read of `buf.len()` bytes from `offset` whose first `in_pipe` bytes the backend put
    /// into `pipe` (spliced from an upstream's socket), the others into `buf` at their
    /// places: for a backend that [pipes reads](super::Backend::pipes_reads), on an engine
    /// that sends piped replies. A backend that cannot pipe fills `buf` ([`unpiped`]).
    ReadPiped {
        pipe: Pipe,
        buf: PooledBuf,
        offset: u64,
        in_pipe: usize,
    },
    /// Write all of `buf` at `offset`, durably before completing if `fua`.
    Write {
        buf: PooledBuf,
        offset: u64,
        fua: bool,
    },
    /// Make every write completed before it durable.
    Flush,
    /// Discard a range (advisory).
    Trim { offset: u64, len: u64, fua: bool },
    /// Make a range read as zeroes. A `fast` zero that would be slow fails with `EOPNOTSUPP`
    /// (what [`ZeroError::NotFast`](super::ZeroError::NotFast) converts to), as nbdkit's plugins do.
    Zero {
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    },
    /// Prefetch a range.
    Cache { offset: u64, len: u64 },
    /// Append to `out` up to `extents_max` `base:allocation` extents from `offset`, as
    /// [`Backend::extents`](super::Backend::extents) does.
    Extents {
        offset: u64,
        len: u64,
        extents_max: usize,
        out: Vec<Extent>,
    },
}

/// Submissions held back while it lives ([`Backend::plug`](super::Backend::plug)): dropping
/// it sends them.
pub struct Plug {
    /// Ends the hold when dropped (read by nothing: it is here to be dropped).
    _release: Box<dyn Send>,
}

impl Plug {
    /// A plug that `release` ends when it is dropped.
    pub fn new(release: impl Send + 'static) -> Plug {
        Plug {
            _release: Box::new(release),
        }
    }
}

impl fmt::Debug for Plug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Plug")
    }
}

impl AsyncOp {
    /// What the operation is, for logs and error messages.
    pub fn what(&self) -> &'static str {
        match self {
            AsyncOp::Read { .. } | AsyncOp::ReadPiped { .. } => "read",
            AsyncOp::Write { .. } => "write",
            AsyncOp::Flush => "flush",
            AsyncOp::Trim { .. } => "trim",
            AsyncOp::Zero { .. } => "write zeroes",
            AsyncOp::Cache { .. } => "cache",
            AsyncOp::Extents { .. } => "block status",
        }
    }
}

/// `op` for a backend that reads into memory only: a piped read becomes a plain read of
/// its buffer, and its completion gets it back as a piped read with nothing in the pipe.
/// Any other operation, and `done`, come back as they are.
pub fn unpiped(op: AsyncOp, done: Completion) -> (AsyncOp, Completion) {
    let AsyncOp::ReadPiped {
        pipe, buf, offset, ..
    } = op
    else {
        return (op, done);
    };
    let done = Completion::new(move |op, result| match op {
        Some(AsyncOp::Read { buf, offset }) => {
            let op = AsyncOp::ReadPiped {
                pipe,
                buf,
                offset,
                in_pipe: 0,
            };
            done.complete(op, result);
        }
        Some(other) => done.complete(other, result),
        None => drop(done),
    });
    (AsyncOp::Read { buf, offset }, done)
}

/// What the dispatcher does with an operation's end: the operation handed back (`None`: the
/// backend dropped it without completing) and its result.
type Then = Box<dyn FnOnce(Option<AsyncOp>, io::Result<()>) + Send>;

/// The backend's half of an operation in flight. Call [`Completion::complete`] exactly once,
/// from any thread, or before `submit` returns. Dropping it uncalled is a backend bug: the
/// request is answered `EIO` (and logged), so it never stays unanswered, never keeps its
/// place in the connection's in-flight budget and never holds up shutdown.
pub struct Completion {
    then: Option<Then>,
}

impl Completion {
    /// A completion that runs `then` with what the backend hands back.
    pub fn new(then: impl FnOnce(Option<AsyncOp>, io::Result<()>) + Send + 'static) -> Self {
        Completion {
            then: Some(Box::new(then)),
        }
    }

    /// The operation is done: hands it (and the memory it owns) back with its result.
    pub fn complete(mut self, op: AsyncOp, result: io::Result<()>) {
        if let Some(then) = self.then.take() {
            then(Some(op), result);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(then) = self.then.take() {
            // Also reached while unwinding from a panic in the backend that owned it.
            then(None, Err(io::Error::from_raw_os_error(libc::EIO)));
        }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("pending", &self.then.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn completion() -> (Completion, mpsc::Receiver<(bool, Option<i32>)>) {
        let (tx, rx) = mpsc::channel();
        let done = Completion::new(move |op, result| {
            let _ = tx.send((op.is_some(), result.err().and_then(|e| e.raw_os_error())));
        });
        (done, rx)
    }

    #[test]
    fn complete_runs_once_with_the_op() {
        let (done, rx) = completion();
        done.complete(AsyncOp::Flush, Ok(()));
        assert_eq!(rx.try_recv().unwrap(), (true, None));
        assert!(
            rx.try_recv().is_err(),
            "the drop after complete ran it again"
        );
    }

    #[test]
    fn dropped_completion_is_eio() {
        let (done, rx) = completion();
        drop(done);
        assert_eq!(rx.try_recv().unwrap(), (false, Some(libc::EIO)));
    }

    #[test]
    fn not_fast_is_eopnotsupp() {
        let e = io::Error::from(crate::export::ZeroError::NotFast);
        assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
    }
}
