//! Captive mode, `--run CMD` (nbdkit's): once the server listens, run CMD through the shell
//! with the address in its environment, stop the server when CMD exits and exit with its
//! status. Also the private socket directory `--run` listens in by default, and
//! `--exit-with-parent`.

use std::ffi::OsString;
use std::net::IpAddr;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::sync::mpsc;
use std::{io, thread};

use tracing::{info, warn};
use zcnbd_server::{vsock, ListenAddr, Ready};

/// The command's environment: the variables nbdkit's `--run` sets.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct CaptiveEnv {
    /// An NBD URI of the export (`$uri`, and `$nbd`, the same).
    pub uri: String,
    /// The TCP port, or "" (`$port`).
    pub port: String,
    /// The Unix socket, or "" (`$unixsocket`).
    pub unixsocket: OsString,
    /// The export name (`$exportname`).
    pub exportname: String,
}

impl CaptiveEnv {
    /// The environment for a client of `export` at `addr`.
    pub(super) fn new(addr: &ListenAddr, export: &str) -> CaptiveEnv {
        let name = percent_encode(export);
        let (uri, port, unixsocket) = match addr {
            ListenAddr::Tcp(a) => {
                let host = match a.ip() {
                    IpAddr::V4(ip) if ip.is_unspecified() => "localhost".to_string(),
                    IpAddr::V6(ip) if ip.is_unspecified() => "localhost".to_string(),
                    IpAddr::V4(ip) => ip.to_string(),
                    IpAddr::V6(ip) => format!("[{ip}]"),
                };
                let uri = format!("nbd://{host}:{}/{name}", a.port());
                (uri, a.port().to_string(), OsString::new())
            }
            ListenAddr::Unix(path) => {
                let socket = percent_encode(&path.to_string_lossy());
                let uri = format!("nbd+unix:///{name}?socket={socket}");
                (uri, String::new(), path.clone().into_os_string())
            }
            // A socket passed by a service manager may be the only one: the local machine is
            // CID 1 (vsock_loopback).
            ListenAddr::Vsock(a) => {
                let cid = if a.cid == vsock::CID_ANY { 1 } else { a.cid };
                let uri = format!("nbd+vsock://{cid}:{}/{name}", a.port);
                (uri, a.port.to_string(), OsString::new())
            }
        };
        CaptiveEnv {
            uri,
            port,
            unixsocket,
            exportname: export.to_string(),
        }
    }
}

/// URI-escapes everything but RFC 3986's unreserved characters and `/`.
/// The NBD URI of `export` at `addr` (`nbds` when TLS is offered).
pub(super) fn uri(addr: &ListenAddr, export: &str, tls: bool) -> String {
    let uri = CaptiveEnv::new(addr, export).uri;
    match uri.strip_prefix("nbd") {
        Some(rest) if tls => format!("nbds{rest}"),
        _ => uri,
    }
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The captive command's exit status, once it has exited.
pub(super) type Outcome = mpsc::Receiver<ExitStatus>;

/// Starts `/bin/sh -c command` for the server that is now `ready`; when it exits, the
/// server is stopped and its status sent on the returned channel.
pub(super) fn start(command: &str, ready: Ready, export: &str) -> io::Result<Outcome> {
    let addr = ready
        .addrs
        .first()
        .ok_or_else(|| io::Error::other("no listener"))?;
    let env = CaptiveEnv::new(addr, export);
    info!(uri = %env.uri, "running: {command}");
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(command)
        .env("uri", &env.uri)
        .env("nbd", &env.uri)
        .env("port", &env.port)
        .env("unixsocket", &env.unixsocket)
        .env("exportname", &env.exportname)
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run /bin/sh: {e}")))?;
    let (sender, outcome) = mpsc::channel();
    thread::Builder::new()
        .name("captive".into())
        .spawn(move || {
            let status = child.wait();
            match status {
                Ok(status) => {
                    info!("the command exited ({status}): stopping");
                    let _ = sender.send(status);
                }
                Err(e) => warn!("cannot wait for the command: {e}; stopping"),
            }
            ready.stop.stop();
        })?;
    Ok(outcome)
}

/// The exit code for the command's status: its own, or 128 + the signal that ended it, as
/// shells do; 1 if the server stopped first (a signal) or the status was lost.
pub(super) fn exit_code(outcome: &Outcome) -> ExitCode {
    match outcome.try_recv() {
        Ok(status) => ExitCode::from(status_code(status)),
        Err(_) => {
            warn!("the server stopped while the command was still running");
            ExitCode::FAILURE
        }
    }
}

fn status_code(status: ExitStatus) -> u8 {
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    };
    u8::try_from(code & 0xff).unwrap_or(1)
}

/// A fresh private directory for `--run`'s socket (mode 0700), removed with its contents
/// when dropped.
#[derive(Debug)]
pub(super) struct PrivateDir(PathBuf);

impl PrivateDir {
    pub(super) fn new() -> io::Result<PrivateDir> {
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let mut last = io::Error::other("no attempt");
        for attempt in 0..16u32 {
            let name = format!("zcnbd-{}-{:08x}", std::process::id(), nanos ^ attempt);
            let path = base.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(PrivateDir(path)),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `--exit-with-parent`: SIGTERM (an orderly shutdown) when the parent exits; exits now if
/// it already has.
pub(super) fn exit_with_parent() -> io::Result<()> {
    let parent = rustix::process::getppid();
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
    // The parent may have exited before the signal was asked for: then it never comes.
    if rustix::process::getppid() != parent {
        return Err(io::Error::other(
            "--exit-with-parent: the parent has exited",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_for_tcp_and_unix() {
        let tcp = CaptiveEnv::new(&ListenAddr::Tcp("127.0.0.1:10809".parse().unwrap()), "a b");
        assert_eq!(tcp.uri, "nbd://127.0.0.1:10809/a%20b");
        assert_eq!((tcp.port.as_str(), tcp.unixsocket.len()), ("10809", 0));
        let any = CaptiveEnv::new(&ListenAddr::Tcp("[::]:7".parse().unwrap()), "");
        assert_eq!(any.uri, "nbd://localhost:7/");
        let v6 = CaptiveEnv::new(&ListenAddr::Tcp("[::1]:7".parse().unwrap()), "");
        assert_eq!(v6.uri, "nbd://[::1]:7/");
        let unix = CaptiveEnv::new(&ListenAddr::Unix("/tmp/d/nbd.sock".into()), "");
        assert_eq!(unix.uri, "nbd+unix:///?socket=/tmp/d/nbd.sock");
        assert_eq!(unix.unixsocket, "/tmp/d/nbd.sock");
        assert_eq!(unix.port, "");
        let vsock = CaptiveEnv::new(
            &ListenAddr::Vsock(vsock::VsockAddr {
                cid: vsock::CID_ANY,
                port: 10809,
            }),
            "e",
        );
        assert_eq!(vsock.uri, "nbd+vsock://1:10809/e");
        assert_eq!(vsock.port, "10809");
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(status_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(status_code(ExitStatus::from_raw(15)), 128 + 15);
    }

    #[test]
    fn private_dir_is_private_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = PrivateDir::new().unwrap();
        let path = dir.path().to_owned();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(path.join("x"), b"").unwrap();
        drop(dir);
        assert!(!path.exists());
    }
}
