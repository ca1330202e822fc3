//! Where the server listens (sockets it binds, or was passed), and the accept loop: every
//! accepted connection gets a thread for its handshake (admission bounds them, see
//! `admission.rs`).

use std::io;
use std::net::TcpListener;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::sockopt::{socket_acceptconn, socket_type};
use rustix::net::{getsockname, AddressFamily, SocketType};
use tracing::{info, warn};

use crate::listen_addr::ListenAddr;
use crate::server::{Server, ServerError};
use crate::stream::Stream;
use crate::unix_socket::{self, SocketFile};
use crate::vsock::VsockListener;

pub(crate) enum Listener {
    Tcp(TcpListener),
    /// `_file`: the socket file this server bound, removed when done if it is still ours (a
    /// passed socket's file belongs to whoever made it).
    Unix {
        listener: UnixListener,
        path: PathBuf,
        _file: Option<SocketFile>,
    },
    Vsock(VsockListener),
}

impl Listener {
    pub(crate) fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        let listener = match addr {
            ListenAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a)?),
            ListenAddr::Unix(path) => {
                // Never another live server's socket, nor any other file.
                let (listener, file) = unix_socket::bind(path)?;
                Listener::Unix {
                    listener,
                    path: path.clone(),
                    _file: Some(file),
                }
            }
            ListenAddr::Vsock(a) => Listener::Vsock(VsockListener::bind(a)?),
        };
        listener.set_nonblocking()?;
        Ok(listener)
    }

    /// A listener on a socket opened elsewhere (socket activation): TCP, Unix or vsock, as
    /// `getsockname` says; it must be a listening stream socket.
    pub(crate) fn from_fd(fd: OwnedFd) -> io::Result<Listener> {
        let not_listening =
            || io::Error::new(io::ErrorKind::InvalidInput, "not a listening stream socket");
        if socket_type(&fd)? != SocketType::STREAM || !socket_acceptconn(&fd)? {
            return Err(not_listening());
        }
        let listener = match getsockname(&fd)?.address_family() {
            AddressFamily::INET | AddressFamily::INET6 => Listener::Tcp(TcpListener::from(fd)),
            AddressFamily::UNIX => {
                let listener = UnixListener::from(fd);
                let path = listener.local_addr()?.as_pathname().map(PathBuf::from);
                Listener::Unix {
                    listener,
                    path: path.unwrap_or_default(),
                    _file: None,
                }
            }
            AddressFamily::VSOCK => match VsockListener::from_fd(fd)? {
                Ok(listener) => Listener::Vsock(listener),
                Err(_) => return Err(not_listening()),
            },
            _ => return Err(not_listening()),
        };
        listener.set_nonblocking()?;
        Ok(listener)
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.set_nonblocking(true),
            Listener::Unix { listener, .. } => listener.set_nonblocking(true),
            Listener::Vsock(l) => l.set_nonblocking(true),
        }
    }

    /// Where it listens (a TCP port 0 resolved to the port the kernel chose).
    pub(crate) fn addr(&self) -> io::Result<ListenAddr> {
        Ok(match self {
            Listener::Tcp(l) => ListenAddr::Tcp(l.local_addr()?),
            Listener::Unix { path, .. } => ListenAddr::Unix(path.clone()),
            Listener::Vsock(l) => ListenAddr::Vsock(l.local_addr()?),
        })
    }

    fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, a)| (Stream::Tcp(s), a.to_string())),
            Listener::Unix { listener, path, .. } => listener
                .accept()
                .map(|(s, _)| (Stream::Unix(s), format!("unix:{}", path.display()))),
            Listener::Vsock(l) => l.accept().map(|(s, peer)| {
                let peer = peer.map_or_else(|| "vsock".to_string(), |a| a.to_string());
                (Stream::Vsock(s), peer)
            }),
        }
    }

    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix { listener, .. } => listener.as_fd(),
            Listener::Vsock(l) => l.as_fd(),
        }
    }
}

/// Open listening sockets, for [`crate::serve_on`]: bound here, or passed by a service
/// manager ([`crate::activation`]).
pub struct Listeners(pub(crate) Vec<Listener>);

impl std::fmt::Debug for Listeners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.addrs()).finish()
    }
}

impl Listeners {
    /// Listens on every address in `addrs`.
    pub fn bind(addrs: &[ListenAddr]) -> Result<Listeners, ServerError> {
        let listeners = addrs
            .iter()
            .map(|addr| {
                Listener::bind(addr).map_err(|source| ServerError::Listen {
                    addr: addr.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Listeners(listeners))
    }

    /// Listens on sockets opened elsewhere: each must be a listening TCP, Unix or vsock
    /// stream socket.
    pub fn from_fds(fds: Vec<OwnedFd>) -> Result<Listeners, ServerError> {
        let listeners = fds
            .into_iter()
            .map(|fd| {
                let raw = fd.as_raw_fd();
                Listener::from_fd(fd).map_err(|source| ServerError::Passed { fd: raw, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Listeners(listeners))
    }

    /// Where each listener listens (for a socket whose address cannot be read, nothing).
    pub fn addrs(&self) -> Vec<ListenAddr> {
        self.0.iter().filter_map(|l| l.addr().ok()).collect()
    }
}

/// What wakes the accept loop besides clients: `stop` (SIGINT, SIGTERM, a stop handle) ends
/// it; `reload` (SIGHUP; nonblocking) runs `on_reload` on this thread.
pub(crate) struct Wake<'a> {
    pub(crate) stop: &'a UnixStream,
    pub(crate) reload: &'a UnixStream,
    pub(crate) on_reload: &'a mut dyn FnMut(),
}

/// Accepts until a signal or a stop request arrives; returns the connection threads.
pub(crate) fn accept_loop(
    server: &Arc<Server>,
    listeners: &[Listener],
    wake: Wake<'_>,
) -> io::Result<Vec<JoinHandle<()>>> {
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let n = listeners.len();
    loop {
        let mut fds: Vec<PollFd<'_>> = listeners
            .iter()
            .map(|l| PollFd::from_borrowed_fd(l.as_fd(), PollFlags::IN))
            .collect();
        fds.push(PollFd::new(wake.stop, PollFlags::IN));
        fds.push(PollFd::new(wake.reload, PollFlags::IN));
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        if !fds[n].revents().is_empty() {
            info!("signal or stop request received: shutting down");
            return Ok(threads);
        }
        let ready: Vec<bool> = fds[..n].iter().map(|f| !f.revents().is_empty()).collect();
        if !fds[n + 1].revents().is_empty() {
            // Several SIGHUPs before this turn make one reload.
            drain(wake.reload);
            (wake.on_reload)();
        }
        threads.retain(|t| !t.is_finished());
        for (listener, _) in listeners.iter().zip(ready).filter(|(_, r)| *r) {
            accept_ready(server, listener, &mut threads);
        }
    }
}

/// Reads whatever wake-up bytes are queued on a nonblocking socket.
fn drain(socket: &UnixStream) {
    use std::io::Read;
    let mut bytes = [0u8; 64];
    while matches!((&*socket).read(&mut bytes), Ok(n) if n > 0) {}
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vsock::{VsockAddr, CID_ANY, PORT_ANY};

    /// A passed AF_VSOCK socket (socket activation) is served as vsock, and reports its
    /// address; a socket that does not listen is refused. Needs AF_VSOCK in the kernel.
    #[test]
    fn a_passed_vsock_socket_is_a_vsock_listener() {
        let any = VsockAddr {
            cid: CID_ANY,
            port: PORT_ANY,
        };
        let listener = match VsockListener::bind(&any) {
            Ok(listener) => listener,
            Err(e) => return eprintln!("SKIP: no AF_VSOCK here: {e}"),
        };
        let port = listener.local_addr().unwrap().port;
        let listeners = Listeners::from_fds(vec![OwnedFd::from(listener)]).unwrap();
        let want = ListenAddr::Vsock(VsockAddr { cid: CID_ANY, port });
        assert_eq!(listeners.addrs(), vec![want.clone()]);
        assert_eq!(want.to_string(), format!("vsock:any:{port}"));
        let bound = rustix::net::socket(AddressFamily::VSOCK, SocketType::STREAM, None).unwrap();
        assert!(Listeners::from_fds(vec![bound]).is_err(), "not listening");
    }
}
