//! `fork(2)` for `zcnbd serve --fork`, made safe by refusing unless the process has one
//! thread.

use std::io;

use rustix::process::Pid;

/// Which side of a fork this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forked {
    /// The original process; `child` is the new one.
    Parent { child: Pid },
    /// The new process.
    Child,
}

/// Forks this process, which must have exactly one thread (checked in `/proc/self/task`;
/// an error otherwise, and nothing forked).
pub fn fork_single_threaded() -> io::Result<Forked> {
    let threads = std::fs::read_dir("/proc/self/task")?.count();
    if threads != 1 {
        return Err(io::Error::other(format!(
            "cannot fork: the process has {threads} threads (fork before starting any)"
        )));
    }
    // SAFETY: after fork in a multithreaded process the child may only call
    // async-signal-safe functions, because other threads may have held locks (the allocator's,
    // stdio's) that no thread in the child will release. This process has one thread (checked
    // just above, and only this thread could start another), so no lock is held by anyone
    // else, and the child may go on running ordinary Rust code.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        child => Pid::from_raw(child)
            .map(|child| Forked::Parent { child })
            .ok_or_else(|| io::Error::other("fork returned a negative pid")),
    }
}

/// The CPU time the calling thread has used (user and system).
pub fn thread_cpu_time() -> std::time::Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    std::time::Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}
