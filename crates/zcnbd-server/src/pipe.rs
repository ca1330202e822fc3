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

/// Most empty pipes kept for reuse ([`Pipe::spare`]): a piped read takes one and its reply
/// gives it back, so this bounds the pipes a busy server keeps open between reads.
pub const SPARE_PIPES_MAX: usize = 64;

/// Empty pipes kept for reuse, at most `max`.
struct SparePipes {
    pipes: std::sync::Mutex<Vec<Pipe>>,
    max: usize,
}

impl SparePipes {
    const fn new(max: usize) -> SparePipes {
        SparePipes {
            pipes: std::sync::Mutex::new(Vec::new()),
            max,
        }
    }

    /// A kept pipe that holds at least `bytes`, if there is one.
    fn take(&self, bytes: usize) -> Option<Pipe> {
        let mut pipes = self.pipes.lock().unwrap_or_else(|p| p.into_inner());
        let at = pipes.iter().rposition(|p| p.capacity >= bytes)?;
        Some(pipes.swap_remove(at))
    }

    /// Keeps `pipe` (empty), or closes it when `max` are kept.
    fn keep(&self, pipe: Pipe) {
        let mut pipes = self.pipes.lock().unwrap_or_else(|p| p.into_inner());
        if pipes.len() < self.max {
            pipes.push(pipe);
        }
    }
}

/// The process's spare pipes.
static SPARE: SparePipes = SparePipes::new(SPARE_PIPES_MAX);

impl Pipe {
    /// An empty pipe that holds at least `bytes`: a spare one if there is one, else a new
    /// one (making a pipe of 1 MiB costs two system calls and a zeroed allocation, closing it
    /// two more: more than a piped read of 64 KiB saves).
    pub fn spare(bytes: usize) -> std::io::Result<Pipe> {
        match SPARE.take(bytes) {
            Some(pipe) => Ok(pipe),
            None => Pipe::with_capacity(bytes.max(PIPE_BYTES)),
        }
    }

    /// Reads the `bytes` this pipe holds (they are there, so the reads do not wait) and
    /// appends them to `out`.
    pub fn read_exact_into(&self, bytes: usize, out: &mut Vec<u8>) -> std::io::Result<()> {
        let start = out.len();
        out.resize(start + bytes, 0);
        let mut at = start;
        while at < out.len() {
            match rustix::io::read(&self.read, &mut out[at..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Keeps this pipe for [`Pipe::spare`]. The caller says it is empty (every byte put into
    /// it was spliced out); beyond [`SPARE_PIPES_MAX`] it is closed.
    pub fn recycle(self) {
        SPARE.keep(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn spare_pipes_are_reused_up_to_the_bound() {
        let spare = SparePipes::new(2);
        assert!(spare.take(1).is_none());
        let pipes: Vec<Pipe> = (0..3).map(|_| Pipe::with_capacity(8192).unwrap()).collect();
        let fds: Vec<i32> = pipes.iter().map(|p| p.read.as_raw_fd()).collect();
        let capacity = pipes[0].capacity;
        pipes.into_iter().for_each(|p| spare.keep(p));
        // The third was closed: two come back, then none.
        let a = spare.take(capacity).unwrap();
        let b = spare.take(capacity).unwrap();
        assert!(spare.take(1).is_none());
        assert_eq!([a.read.as_raw_fd(), b.read.as_raw_fd()], [fds[1], fds[0]]);
        // None too small is handed out for a larger read.
        spare.keep(a);
        assert!(spare.take(capacity + 1).is_none());
    }
}
