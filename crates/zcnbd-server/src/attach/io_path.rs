//! A device's server is in the block I/O path: what it does for the kernel must not wait on
//! the kernel writing back to the very device it serves.

/// Puts this thread, and the threads it starts from now on (queue threads, their I/O helpers,
/// io_uring's io-wq workers), in the block I/O path (`PR_SET_IO_FLUSHER`, Linux 5.6): their
/// allocations then never wait for writeback, and their buffered writes are throttled only
/// by the device they write to, not by the system's dirty pages - which may be the pages of
/// the device they serve, waiting for them. A kernel that refuses is logged: the device still
/// works, short of memory or dirty-page pressure.
///
/// For ublk it matters twice: a queue's buffered write held up that way also holds its ring,
/// and in zero-copy mode a device whose server died leaves `LIVE` only once its rings are
/// gone (the kernel waits for every registered request buffer), so a takeover waits for it.
pub fn join() {
    if let Err(e) = rustix::process::configure_io_flusher_behavior(true) {
        tracing::warn!(error = %e, "cannot mark the server as an I/O flusher (PR_SET_IO_FLUSHER)");
    }
}
