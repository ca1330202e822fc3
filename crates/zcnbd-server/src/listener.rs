//! Where the server listens, and the accept loop: every accepted connection gets a thread
//! for its handshake (admission bounds them, see `admission.rs`).

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use rustix::event::{poll, PollFd, PollFlags};
use tracing::{info, warn};

use crate::server::Server;
use crate::stream::Stream;

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    pub(crate) fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        let listener = match addr {
            ListenAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a)?),
            ListenAddr::Unix(path) => {
                // Replace a stale socket left by a killed server, but never another file.
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    use std::os::unix::fs::FileTypeExt;
                    if meta.file_type().is_socket() {
                        std::fs::remove_file(path)?;
                    }
                }
                Listener::Unix(UnixListener::bind(path)?, path.clone())
            }
        };
        match &listener {
            Listener::Tcp(l) => l.set_nonblocking(true)?,
            Listener::Unix(l, _) => l.set_nonblocking(true)?,
        }
        Ok(listener)
    }

    fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, a)| (Stream::Tcp(s), a.to_string())),
            Listener::Unix(l, p) => l
                .accept()
                .map(|(s, _)| (Stream::Unix(s), format!("unix:{}", p.display()))),
        }
    }

    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l, _) => l.as_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Accepts until a signal arrives; returns the connection threads.
pub(crate) fn accept_loop(
    server: &Arc<Server>,
    listeners: &[Listener],
    wake: &UnixStream,
) -> io::Result<Vec<JoinHandle<()>>> {
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let mut fds: Vec<PollFd<'_>> = listeners
            .iter()
            .map(|l| PollFd::from_borrowed_fd(l.as_fd(), PollFlags::IN))
            .collect();
        fds.push(PollFd::new(wake, PollFlags::IN));
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        if !fds[listeners.len()].revents().is_empty() {
            info!("signal received: shutting down");
            return Ok(threads);
        }
        let ready: Vec<bool> = fds[..listeners.len()]
            .iter()
            .map(|f| !f.revents().is_empty())
            .collect();
        threads.retain(|t| !t.is_finished());
        for (listener, _) in listeners.iter().zip(ready).filter(|(_, r)| *r) {
            accept_ready(server, listener, &mut threads);
        }
    }
}

fn accept_ready(server: &Arc<Server>, listener: &Listener, threads: &mut Vec<JoinHandle<()>>) {
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => {
                warn!("accept failed: {e}");
                return;
            }
        };
        if let Some(ms) = server.limits.keepalive_idle_ms {
            if let Err(e) = stream.set_keepalive(std::time::Duration::from_millis(ms)) {
                warn!(%peer, "cannot turn on TCP keepalive: {e}");
            }
        }
        // No limit here: admission bounds handshakes (closing the longest-silent one when
        // full) and attached clients (refused when they ask to attach).
        let server = Arc::clone(server);
        let spawned = std::thread::Builder::new()
            .name("conn".into())
            .spawn(move || server.start_session(stream, &peer, None));
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => warn!("cannot start a connection thread: {e}"),
        }
    }
}
