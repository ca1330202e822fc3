//! A Unix socket a server listens on at a path (`-s`, `--control`): bound only where no live
//! server listens - a stale socket left by a server that was killed is replaced, a socket a
//! server answers on is refused ("another server is listening"), any other file is refused
//! with what it is - and removed at the end only while the path is still the socket this
//! process bound (a second server that took the path over must keep it).

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The socket file this process bound: its path and (device, inode).
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

/// Why nothing was bound at `path`.
fn refusal(path: &Path, meta: &std::fs::Metadata) -> io::Error {
    let shown = path.display();
    if meta.file_type().is_socket() {
        return io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("another server is listening on {shown}"),
        );
    }
    let why = if meta.is_file() {
        format!(
            "{shown} is a file, not a socket: -s is --socket here (qemu-nbd's -s, a \
             throwaway overlay, is --snapshot); to serve the file, give it without -s"
        )
    } else {
        format!("{shown} exists and is not a socket")
    };
    io::Error::new(io::ErrorKind::AlreadyExists, why)
}

/// Binds a listening socket at `path` (see the module's documentation).
pub fn bind(path: &Path) -> io::Result<(UnixListener, SocketFile)> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => return Err(refusal(path, &meta)),
        Ok(meta) => {
            if UnixStream::connect(path).is_ok() {
                return Err(refusal(path, &meta));
            }
            // Nobody answers: left by a server that did not remove it.
            std::fs::remove_file(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    let meta = std::fs::symlink_metadata(path)?;
    let file = SocketFile {
        path: path.to_owned(),
        id: (meta.dev(), meta.ino()),
    };
    Ok((listener, file))
}

impl Drop for SocketFile {
    /// Removes the path if it is still this socket.
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && (m.dev(), m.ino()) == self.id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_socket_is_kept_a_stale_one_replaced_and_only_our_own_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let (first, file) = bind(&path).unwrap();
        let err = bind(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(
            err.to_string().contains("another server is listening"),
            "{err}"
        );
        // The first server dies without removing its socket: the next replaces it.
        drop(first);
        std::mem::forget(file);
        let (_second, second_file) = bind(&path).unwrap();
        // An older server's exit leaves the newer one's socket alone.
        let stale = SocketFile {
            path: path.clone(),
            id: (0, 0),
        };
        drop(stale);
        assert!(path.exists());
        drop(second_file);
        assert!(!path.exists());
    }

    #[test]
    fn a_file_is_never_replaced_and_the_error_says_what_s_means_here() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, b"data").unwrap();
        let err = bind(&path).unwrap_err().to_string();
        assert!(
            err.contains("--snapshot") && err.contains("--socket"),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }
}
