//! Taking ownership of listening sockets a service manager passed down (systemd's socket
//! activation protocol, `sd_listen_fds(3)`): descriptors 3, 4, ... 3+N-1, open across
//! `exec` and owned by nobody in this process until [`take_sockets`] takes them.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// The first passed descriptor (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// Set once the passed descriptors have been taken: a second owner would close them twice.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// Takes ownership of descriptors `3..3+count` (marked close-on-exec, so nothing this
/// process starts inherits them). Each must be an open socket; the first one that is not
/// fails the call, before any is taken. Succeeds at most once per process.
///
/// The caller has checked that the descriptors were passed to *this* process
/// (`LISTEN_PID` is its pid), which is what makes them unowned: the service manager opened
/// them, `exec` kept them, and no code in this process opened them (nothing opens
/// descriptors before `main` reads the environment, and the kernel hands out the lowest
/// free number, which 3.. were not).
pub fn take_sockets(count: usize) -> io::Result<Vec<OwnedFd>> {
    let count_fds =
        RawFd::try_from(count).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let end = LISTEN_FDS_START
        .checked_add(count_fds)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    for fd in LISTEN_FDS_START..end {
        check_socket(fd)?;
    }
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the passed sockets were taken already",
        ));
    }
    let mut sockets = Vec::with_capacity(count);
    for fd in LISTEN_FDS_START..end {
        // SAFETY: `fd` is open and a socket (`check_socket` above), it was passed by the
        // service manager to this process and nothing else here owns it (see the doc
        // comment: the caller checked LISTEN_PID, and `TAKEN` makes this the only call
        // that gets this far), so this `OwnedFd` becomes its one owner and closes it once.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)?;
        sockets.push(owned);
    }
    Ok(sockets)
}

/// Fails unless `fd` is open and a socket.
fn check_socket(fd: RawFd) -> io::Result<()> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `fstat` writes at most one `struct stat` into `stat`, which is that size, and
    // reads nothing else; an fd that is not open gives EBADF, not undefined behaviour.
    let rc = unsafe { libc::fstat(fd, stat.as_mut_ptr()) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("passed descriptor {fd}: {e}"),
        ));
    }
    // SAFETY: `fstat` returned 0, so it filled `stat` in.
    let mode = unsafe { stat.assume_init() }.st_mode;
    if mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("passed descriptor {fd} is not a socket"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_socket_is_refused() {
        let file = tempfile::tempfile().unwrap();
        use std::os::fd::AsRawFd;
        assert!(check_socket(file.as_raw_fd()).is_err());
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(check_socket(a.as_raw_fd()).is_ok());
        assert!(check_socket(-1).is_err());
    }
}
