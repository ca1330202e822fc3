//! Real NBD servers started for a test: zcnbd (the built binary), nbdkit's memory plugin,
//! qemu-nbd and nbd-server on a file, in plain text or (all but nbd-server) requiring TLS.
//! A server that is not installed is skipped with a message, except under CI=true, where the
//! run fails instead.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Size of every export the tests use.
pub const EXPORT_BYTES: u64 = 64 << 20;

/// The servers the same checks run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// zcnbd, memory export, default engine, minimum block size 512.
    Zcnbd,
    /// zcnbd, portable engine, a file export.
    ZcnbdPortableFile,
    /// nbdkit's memory plugin.
    Nbdkit,
    /// qemu-nbd on a raw file (extended headers).
    QemuNbd,
    /// nbd-server on a file.
    NbdServer,
    /// zcnbd on a Ceph RBD image of a throwaway cluster (`common/ceph.rs`), default engine.
    ZcnbdRbd,
}

/// The TLS a server requires (`--tls=require` or QEMU's `--tls-creds`).
#[derive(Debug, Clone, Copy)]
pub enum Tls<'a> {
    /// Certificates from a server directory; `verify_peer`: clients must present one too.
    X509 { dir: &'a Path, verify_peer: bool },
    /// Pre-shared keys from a psktool file (QEMU reads `keys.psk` in its directory).
    Psk { file: &'a Path },
}

/// A running server; killed when dropped.
pub struct Running {
    pub kind: Kind,
    pub uri: String,
    /// The Unix socket it listens on (`None` for nbd-server, which listens on TCP).
    pub socket: Option<PathBuf>,
    child: Child,
    /// A daemon's pid file (nbd-server forks away from `child`, and per connection).
    pid_file: Option<PathBuf>,
    _dir: tempfile::TempDir,
    /// An RBD export's cluster, stopped after the server (fields drop after `Drop::drop`).
    _cluster: Option<super::ceph::Cluster>,
}

impl Running {
    /// Kills the server (SIGKILL) now, with any processes it forked for connections.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let pid = self
            .pid_file
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok());
        if let Some(pid) = pid.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
            let _ = Command::new("pkill").args(["-KILL", "-P", pid]).status();
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The zcnbd binary next to this test's target directory.
pub fn zcnbd_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("ZCNBD_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let bin = profile_dir.join("zcnbd");
    bin.exists().then_some(bin)
}

pub fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("address").port()
}

fn sparse_file(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    let f = std::fs::File::create(&path).expect("create disk file");
    f.set_len(EXPORT_BYTES).expect("size disk file");
    path
}

/// Starts `kind`, or says why it cannot (`None`; under CI=true that panics).
pub fn start(kind: Kind) -> Option<Running> {
    start_with(kind, None)
}

/// Starts `kind` requiring `tls`; its `uri` is `nbds+unix://{uri_user}/?socket=...&{query}`
/// (`uri_user`: `alice@` for a PSK user, or empty).
pub fn start_tls(kind: Kind, tls: Tls<'_>, uri_user: &str, query: &str) -> Option<Running> {
    start_with(kind, Some((tls, uri_user, query)))
}

fn start_with(kind: Kind, tls: Option<(Tls<'_>, &str, &str)>) -> Option<Running> {
    let dir = tempfile::tempdir().expect("temp dir");
    let sock = dir.path().join("nbd.sock");
    let unix_uri = match tls {
        None => format!("nbd+unix:///?socket={}", sock.display()),
        Some((_, user, query)) => format!("nbds+unix://{user}/?socket={}&{query}", sock.display()),
    };
    let mut cluster = None;
    let (program, mut args, uri): (String, Vec<String>, String) = match kind {
        Kind::ZcnbdRbd => {
            let Some(bin) = zcnbd_bin() else {
                return skip(kind, "the zcnbd binary is not built (cargo build first)");
            };
            if !installed("ceph-mon") || !installed("rbd") {
                return skip(kind, "Ceph is not installed (scripts/install-deps.sh)");
            }
            let started = super::ceph::Cluster::start().and_then(|c| {
                let image = c.new_image(EXPORT_BYTES)?;
                Ok((c, image))
            });
            let (c, image) = match started {
                Ok(c) => c,
                Err(why) => return skip(kind, &why),
            };
            let args = vec![
                "serve".to_string(),
                "-s".into(),
                sock.display().to_string(),
                format!("rbd:{image}"),
                "--ceph-conf".into(),
                c.conf.display().to_string(),
            ];
            cluster = Some(c);
            (bin.display().to_string(), args, unix_uri)
        }
        Kind::Zcnbd | Kind::ZcnbdPortableFile => {
            let Some(bin) = zcnbd_bin() else {
                return skip(kind, "the zcnbd binary is not built (cargo build first)");
            };
            let mut args = vec!["serve".to_string(), "-s".into(), sock.display().to_string()];
            if kind == Kind::Zcnbd {
                args.extend([
                    "--memory".into(),
                    "64M".into(),
                    "--min-block-size".into(),
                    "512".into(),
                ]);
            } else {
                let file = sparse_file(dir.path());
                args.extend([
                    "--engine".into(),
                    "portable".into(),
                    file.display().to_string(),
                ]);
            }
            (bin.display().to_string(), args, unix_uri)
        }
        Kind::Nbdkit => {
            let args = ["-f", "--exit-with-parent", "-U"]
                .iter()
                .map(|s| s.to_string())
                .chain([sock.display().to_string(), "memory".into(), "64M".into()])
                .collect();
            ("nbdkit".into(), args, unix_uri)
        }
        Kind::QemuNbd => {
            let file = sparse_file(dir.path());
            let args = vec![
                "-f".into(),
                "raw".into(),
                "-t".into(),
                "-e".into(),
                "8".into(),
                "--cache=writeback".into(),
                "-k".into(),
                sock.display().to_string(),
                file.display().to_string(),
            ];
            ("qemu-nbd".into(), args, unix_uri)
        }
        Kind::NbdServer => {
            let file = sparse_file(dir.path());
            let port = free_port();
            let conf = dir.path().join("nbd-server.conf");
            let text = format!(
                "[generic]\n    listenaddr = 127.0.0.1\n    port = {port}\n    allowlist = true\n\
                 [disk]\n    exportname = {}\n    flush = true\n    fua = true\n    trim = true\n",
                file.display()
            );
            std::fs::write(&conf, text).expect("write nbd-server config");
            let pid = dir.path().join("nbd-server.pid");
            let args = vec![
                "-C".into(),
                conf.display().to_string(),
                "-p".into(),
                pid.display().to_string(),
            ];
            (
                "nbd-server".into(),
                args,
                format!("nbd://127.0.0.1:{port}/disk"),
            )
        }
    };
    if !installed(&program) && !Path::new(&program).exists() {
        return skip(kind, &format!("{program} is not installed"));
    }
    if let Some((tls, ..)) = tls {
        let mut tls_args = tls_args(kind, tls);
        if matches!(kind, Kind::Zcnbd | Kind::ZcnbdPortableFile | Kind::ZcnbdRbd) {
            // After `serve`: zcnbd's options go anywhere behind the subcommand.
            args.append(&mut tls_args);
        } else {
            // First: nbdkit takes options before the plugin's name, qemu-nbd before FILE.
            tls_args.append(&mut args);
            args = tls_args;
        }
    }
    let child = Command::new(&program)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    let pid_file = (kind == Kind::NbdServer).then(|| dir.path().join("nbd-server.pid"));
    let running = Running {
        kind,
        uri,
        socket: (kind != Kind::NbdServer).then_some(sock),
        child,
        pid_file,
        _dir: dir,
        _cluster: cluster,
    };
    wait_ready(&running);
    Some(running)
}

/// The server's flags for `tls`.
fn tls_args(kind: Kind, tls: Tls<'_>) -> Vec<String> {
    let qemu = |object: String| {
        vec![
            "--object".into(),
            object,
            "--tls-creds".into(),
            "tls0".into(),
        ]
    };
    match (kind, tls) {
        (Kind::NbdServer, _) => panic!("nbd-server is not started with TLS"),
        (Kind::QemuNbd, Tls::X509 { dir, verify_peer }) => qemu(format!(
            "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer={}",
            dir.display(),
            if verify_peer { "on" } else { "off" }
        )),
        (Kind::QemuNbd, Tls::Psk { file }) => qemu(format!(
            "tls-creds-psk,id=tls0,endpoint=server,dir={}",
            file.parent().expect("a PSK file's directory").display()
        )),
        (_, Tls::X509 { dir, verify_peer }) => {
            let mut args = vec![
                "--tls=require".to_string(),
                format!("--tls-certificates={}", dir.display()),
            ];
            if verify_peer {
                args.push("--tls-verify-peer".into());
            }
            args
        }
        (_, Tls::Psk { file }) => vec![
            "--tls=require".into(),
            format!("--tls-psk={}", file.display()),
        ],
    }
}

fn skip(kind: Kind, why: &str) -> Option<Running> {
    assert!(!ci(), "{kind:?}: {why} (CI=true requires every server)");
    eprintln!("SKIP {kind:?}: {why}");
    None
}

/// Waits until a client can finish a handshake.
fn wait_ready(server: &Running) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match zcnbd_client::Client::connect(&server.uri) {
            Ok(_) => return,
            Err(e) if Instant::now() > deadline => panic!("{:?} never came up: {e}", server.kind),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
