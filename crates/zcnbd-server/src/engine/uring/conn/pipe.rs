//! A pipe spliced bytes pass through (socket → pipe → file, or file → pipe → socket).

use std::os::fd::OwnedFd;

/// Pipe size asked for (Linux's default limit for unprivileged processes).
const PIPE_BYTES: usize = 1 << 20;

pub(super) struct Pipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
    pub capacity: usize,
}

impl Pipe {
    pub fn new() -> std::io::Result<Pipe> {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // A smaller pipe only means more steps per reply.
        let capacity = rustix::pipe::fcntl_setpipe_size(&write, PIPE_BYTES).unwrap_or(65536);
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }
}
