//! `--fork` and `--pid-file` of `serve` and `attach` (qemu-nbd's `--fork`, nbdkit's `-P`):
//! scripts start the server (or attach a device), wait for the command (or the pid file) and
//! use it at once, so both only happen once the listeners accept clients (the device takes
//! I/O).
//!
//! `--fork` forks after the listeners are bound and the exports opened (so the parent can
//! report those errors itself) and before any thread starts (fork copies only the calling
//! thread). The child reports readiness through a pipe: one byte once ready,
//! or end-of-file if it failed first, and then the parent exits with the child's status.

use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::pipe::{pipe_with, PipeFlags};
use rustix::process::{waitpid, Pid, WaitOptions};
use zcnbd_server::{fork_single_threaded, Forked};

/// A pid file this process wrote; removed when dropped (at a clean exit).
#[derive(Debug)]
pub(crate) struct PidFile(PathBuf);

impl PidFile {
    /// Writes this process's pid to `path` atomically: a temporary file beside it, renamed
    /// over it, so a reader never sees a partial file.
    pub(crate) fn write(path: &Path) -> io::Result<PidFile> {
        let name = path.file_name().ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "--pid-file needs a file name")
        })?;
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".{}.tmp", std::process::id()));
        let temp = path.with_file_name(temp_name);
        let written = fs::write(&temp, format!("{}\n", std::process::id()))
            .and_then(|()| fs::rename(&temp, path));
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(io::Error::new(
                e.kind(),
                format!("cannot write the pid file {}: {e}", path.display()),
            ));
        }
        Ok(PidFile(path.to_owned()))
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// The forked child's end of the readiness pipe.
#[derive(Debug)]
pub(crate) struct Readiness(OwnedFd);

impl Readiness {
    /// Tells the waiting parent the server is ready (it then exits 0), and lets go of the
    /// parent's stdout and stderr (a caller capturing them sees end-of-file): from now on the
    /// server writes to /dev/null.
    pub(crate) fn notify(self) -> io::Result<()> {
        let null = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        rustix::stdio::dup2_stdin(&null)?;
        let mut pipe = fs::File::from(self.0);
        pipe.write_all(&[1])?;
        drop(pipe);
        rustix::stdio::dup2_stdout(&null)?;
        rustix::stdio::dup2_stderr(&null)?;
        Ok(())
    }
}

/// Forks. The parent waits until the child is ready and exits (0, or the child's status
/// if it failed first): this returns only in the child, in a new session (no controlling
/// terminal), with the pipe to report readiness on.
pub(crate) fn fork() -> io::Result<Readiness> {
    let (read, write) = pipe_with(PipeFlags::CLOEXEC)?;
    match fork_single_threaded()? {
        Forked::Child => {
            drop(read);
            rustix::process::setsid()?;
            Ok(Readiness(write))
        }
        Forked::Parent { child } => {
            drop(write);
            std::process::exit(wait_ready(read, child))
        }
    }
}

/// In the parent: 0 once the child says it is ready; its exit status if it exits first.
fn wait_ready(read: OwnedFd, child: Pid) -> i32 {
    let mut byte = [0u8; 1];
    let n = loop {
        match rustix::io::read(&read, &mut byte) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other,
        }
    };
    if let Ok(1) = n {
        return 0;
    }
    match waitpid(Some(child), WaitOptions::empty()) {
        Ok(Some((_, status))) => status
            .exit_status()
            .or_else(|| status.terminating_signal().map(|s| 128 + s))
            .unwrap_or(1),
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_file_is_written_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("zcnbd.pid");
        let file = PidFile::write(&path).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
        drop(file);
        assert!(!path.exists());
        assert!(PidFile::write(&dir.path().join("missing/zcnbd.pid")).is_err());
    }
}
