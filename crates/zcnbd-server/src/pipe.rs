//! A pipe spliced bytes pass through: socket → pipe → file and file → pipe → socket on the
//! io_uring engine, and an upstream's socket → pipe → the client's socket for a read an HTTP
//! source fills ([`Backend::read_to_pipe`](crate::export::Backend::read_to_pipe)).

use std::os::fd::OwnedFd;

/// Pipe size asked for (Linux's default limit for unprivileged processes,
/// `/proc/sys/fs/pipe-max-size`).
pub const PIPE_BYTES: usize = 1 << 20;

/// Both ends of a pipe, and what it holds at most.
#[derive(Debug)]
pub struct Pipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
    pub capacity: usize,
}

impl Pipe {
    /// A pipe of [`PIPE_BYTES`] if the system allows it (else whatever it gives: a smaller
    /// pipe only means more steps per reply).
    pub fn new() -> std::io::Result<Pipe> {
        Pipe::with_capacity(PIPE_BYTES)
    }

    /// A pipe of `bytes` (more than [`PIPE_BYTES`] only for a process the system lets
    /// exceed its `pipe-max-size`), else of [`PIPE_BYTES`], else of what the system gives.
    pub fn with_capacity(bytes: usize) -> std::io::Result<Pipe> {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let capacity = rustix::pipe::fcntl_setpipe_size(&write, bytes)
            .or_else(|_| rustix::pipe::fcntl_setpipe_size(&write, PIPE_BYTES))
            .unwrap_or(65536);
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }
}
