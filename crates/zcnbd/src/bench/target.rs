//! Benchmark targets: an NBD URI (`nbd://`, `nbds://` and their `+unix` forms), or a server
//! this run starts on a free loopback port and stops afterwards (`zcnbd:memory`,
//! `zcnbd:memory:copy`, `zcnbd:FILE`, `zcnbd:rbd:POOL/IMAGE`, `nbdkit:memory`, `nbdkit:FILE`,
//! `qemu-nbd:FILE`, `qemu-nbd:rbd:POOL/IMAGE`), with
//! what it costs in CPU and, for zcnbd, its counters. A `:tls` suffix starts the server
//! requiring TLS with the run's certificates (`creds.rs`), and the client connects with
//! `nbds://`. An RBD target serves an existing image (`rbd create --size` it at least as large
//! as the run's region) of the cluster `CEPH_CONF` names (librados' and QEMU's default lookup).
//! `fio-rbd:POOL/IMAGE` starts nothing: fio's rbd engine is its client (`--client fio`).
//! `SERVER:proxy` starts SERVER as an NBD proxy in front of a zcnbd memory export, and
//! `SERVER:web` (`:webs`: HTTPS) as the HTTP source of a file nginx serves (`web.rs`): zcnbd
//! with `--http-connections 4`, nbdkit's curl plugin (one connection a client connection),
//! qemu-nbd's curl block driver (HTTP only).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use zcnbd_server::export::{probe_image, ImageFormat};

use super::creds::BenchCreds;
use super::fio::FioTarget;
use super::netns::{self, Netns};
use super::results::ServerCounters;
use super::web::{WebError, WebServer};

/// The HTTP connections zcnbd keeps to a `:web` target's nginx (the issue's comparison: as
/// many as the four client connections nbdkit's curl plugin makes one each for).
const WEB_HTTP_CONNECTIONS: &str = "4";

/// Why a target could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The spec names nothing this command knows.
    #[error("unknown target {0:?}: want an NBD URI, zcnbd:memory[:copy|:zerocopy|:portable|:tls|:unix|:--OPTION=VALUE], zcnbd:FILE, zcnbd:rbd:POOL/IMAGE, nbdkit:memory[:tls][:unix], nbdkit:FILE[:tls][:unix], qemu-nbd:FILE[:tls][:unix][:--OPTION=VALUE], qemu-nbd:rbd:POOL/IMAGE, zcnbd:proxy, nbdkit:proxy, qemu-nbd:proxy, zcnbd:web, nbdkit:web, qemu-nbd:web, zcnbd:webs, nbdkit:webs (with the same modes) or fio-rbd:POOL/IMAGE[:KEY=VALUE]")]
    Unknown(String),
    /// The run's TLS credentials could not be made.
    #[error(transparent)]
    Credentials(#[from] super::creds::CredsError),
    /// Starting the server failed.
    #[error("{target}: cannot start {program}: {source}")]
    Spawn {
        target: String,
        program: String,
        source: std::io::Error,
    },
    /// The server did not accept connections in time.
    #[error("{0}: the server did not come up within 10 s")]
    NotReady(String),
    /// A web target's nginx could not be started.
    #[error("{target}: {source}")]
    Web { target: String, source: WebError },
    /// A file target could not be prepared.
    #[error("{target}: {source}")]
    File {
        target: String,
        source: std::io::Error,
    },
}

/// `zcnbd:REST` (this binary) or `zcnbd@PATH:REST` (another build): the binary and REST.
fn zcnbd_spec(spec: &str) -> Option<(Option<PathBuf>, &str)> {
    if let Some(rest) = spec.strip_prefix("zcnbd:") {
        return Some((None, rest));
    }
    let (path, rest) = spec.strip_prefix("zcnbd@")?.split_once(':')?;
    (!path.is_empty()).then(|| (Some(PathBuf::from(path)), rest))
}

/// A server to start: program, arguments, and where its metrics are served.
type Launched = (String, Vec<String>, Option<SocketAddr>);

/// What to start.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Launch {
    /// An external server at this URI.
    Uri(String),
    /// `zcnbd serve` with a memory export (or FILE), and extra arguments; `program`: another
    /// zcnbd binary (`zcnbd@PATH:`, for before/after tables), else this one.
    Zcnbd {
        program: Option<PathBuf>,
        file: Option<PathBuf>,
        args: Vec<String>,
    },
    /// nbdkit's memory plugin, or its file plugin on FILE.
    Nbdkit { file: Option<PathBuf> },
    /// qemu-nbd on FILE (raw, or the disk image in it), with extra arguments.
    QemuNbd { file: PathBuf, args: Vec<String> },
    /// No server and no NBD: fio's rbd engine on POOL/IMAGE, with librbd options.
    FioRbd {
        pool: String,
        image: String,
        conf: Vec<String>,
    },
}

/// A parsed target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    /// The label, as given.
    pub label: String,
    launch: Launch,
    /// Start the server requiring TLS (`:tls`).
    tls: bool,
    /// Start the server on a Unix socket rather than TCP (`:unix`).
    unix: bool,
    /// What the server stands in front of, if it serves no data of its own: a memory export
    /// this run starts (`SERVER:proxy`: zcnbd's, on a Unix socket) or a file on nginx
    /// (`SERVER:web`, `SERVER:webs`). The upstream's CPU is not counted.
    upstream: Option<UpstreamKind>,
}

/// What a proxy or web target's server reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UpstreamKind {
    /// Another NBD server's export.
    Nbd,
    /// A file on a web server, over HTTP or (`true`) HTTPS.
    Web { https: bool },
}

/// A started upstream: its URI or URL, and the CA that checks an HTTPS one.
struct UpstreamAt<'a> {
    uri: &'a str,
    ca: Option<&'a Path>,
}

/// `SERVER:proxy...`, `SERVER:web...`, `SERVER:webs...`: the server (`zcnbd@PATH` too: another
/// build, for before/after tables), the upstream and the rest of the modes (`qemu-nbd` has no
/// way to be given an HTTPS server's CA: no `:webs`).
fn upstream_spec(spec: &str) -> Option<(&str, UpstreamKind, &str)> {
    let kinds = [
        (":proxy", UpstreamKind::Nbd),
        (":webs", UpstreamKind::Web { https: true }),
        (":web", UpstreamKind::Web { https: false }),
    ];
    kinds.into_iter().find_map(|(word, kind)| {
        let (server, rest) = spec.split_once(word)?;
        let known = (["zcnbd", "nbdkit", "qemu-nbd"].contains(&server)
            || server
                .strip_prefix("zcnbd@")
                .is_some_and(|path| !path.is_empty()))
            && !(server == "qemu-nbd" && kind == UpstreamKind::Web { https: true });
        (known && (rest.is_empty() || rest.starts_with(':'))).then_some((server, kind, rest))
    })
}

impl TargetSpec {
    /// Parses a target as written on the command line.
    pub fn parse(spec: &str) -> Result<TargetSpec, TargetError> {
        let unknown = || TargetError::Unknown(spec.to_string());
        let uri_schemes = [
            "nbd://",
            "nbd+unix://",
            "nbd+vsock://",
            "nbds://",
            "nbds+unix://",
            "nbds+vsock://",
        ];
        // What the spec says of the target (`:tls`, `:unix`), and how it starts.
        let mut modes = Modes::default();
        // `SERVER:proxy...`, `SERVER:web...`: started like `SERVER:memory...`, with an
        // upstream instead.
        let (spec_words, upstream) = match upstream_spec(spec) {
            Some((server, kind, rest)) => (format!("{server}:memory{rest}"), Some(kind)),
            None => (spec.to_string(), None),
        };
        let spec_words = spec_words.as_str();
        let launch = if uri_schemes.iter().any(|s| spec.starts_with(s)) {
            Launch::Uri(spec.to_string())
        } else if let Some((program, rest)) = zcnbd_spec(spec_words) {
            zcnbd_launch(program, rest, &mut modes).ok_or_else(unknown)?
        } else if let Some(rest) = spec_words.strip_prefix("nbdkit:") {
            let (rest, tls, unix) = strip_modes(rest);
            modes = Modes { tls, unix };
            let file = (rest != "memory").then(|| PathBuf::from(rest));
            Launch::Nbdkit { file }
        } else if let Some(rest) = spec_words.strip_prefix("qemu-nbd:") {
            qemu_nbd_launch(rest, &mut modes).ok_or_else(unknown)?
        } else if let Some(rest) = spec.strip_prefix("fio-rbd:") {
            fio_rbd_launch(rest).ok_or_else(unknown)?
        } else {
            return Err(unknown());
        };
        Ok(TargetSpec {
            label: spec.to_string(),
            launch,
            tls: modes.tls,
            unix: modes.unix,
            upstream,
        })
    }

    /// Whether this run starts the server requiring TLS, or an HTTPS web server (and so
    /// needs credentials).
    pub fn needs_credentials(&self) -> bool {
        self.tls || self.upstream == Some(UpstreamKind::Web { https: true })
    }

    /// Whether the target only reads (a file on a web server): not prefilled.
    pub fn is_read_only(&self) -> bool {
        matches!(self.upstream, Some(UpstreamKind::Web { .. }))
    }

    /// Whether this run starts the server (and so may prefill it and measure its CPU).
    pub fn is_started(&self) -> bool {
        !matches!(self.launch, Launch::Uri(_) | Launch::FioRbd { .. })
    }

    /// Whether clients reach the target over NBD (all but `fio-rbd:`, which only fio reaches).
    pub fn speaks_nbd(&self) -> bool {
        !matches!(self.launch, Launch::FioRbd { .. })
    }

    /// Starts the server (if any) with exports of `size` bytes; a `:tls` target with
    /// `creds` (the run makes them when a target needs them).
    /// Inside `netns` when given (`--netns`), reached over its veth pair.
    pub fn start(
        &self,
        size: u64,
        creds: Option<&BenchCreds>,
        netns: Option<&Netns>,
    ) -> Result<Running, TargetError> {
        let port = free_port();
        let host = if netns.is_some() {
            netns::NS_ADDR
        } else {
            Ipv4Addr::LOCALHOST
        };
        let tls = self.tls_creds(creds)?;
        let socket = self.unix.then(|| {
            std::env::temp_dir().join(format!("zcnbd-bench-{}-{port}.sock", std::process::id()))
        });
        let listen = match &socket {
            Some(path) => Listen::Unix(path.clone()),
            None => Listen::Tcp(host, port),
        };
        let uri = match (tls, &socket) {
            (None, None) => format!("nbd://{host}:{port}/"),
            (Some(c), None) => format!(
                "nbds://{host}:{port}/?tls-certificates={}",
                query_value(&c.client.display().to_string())
            ),
            (None, Some(path)) => format!(
                "nbd+unix:///?socket={}",
                query_value(&path.display().to_string())
            ),
            (Some(c), Some(path)) => format!(
                "nbds+unix:///?socket={}&tls-certificates={}",
                query_value(&path.display().to_string()),
                query_value(&c.client.display().to_string())
            ),
        };
        let fio = FioTarget::nbd(&uri, tls.map(|c| c.home.as_path()));
        let upstream = match self.upstream {
            Some(UpstreamKind::Nbd) => Some(Box::new(self.start_upstream(size)?)),
            _ => None,
        };
        let web = match self.upstream {
            Some(UpstreamKind::Web { https }) => {
                let creds = if https { self.web_creds(creds)? } else { None };
                let web = WebServer::start(size, (host, free_port()), creds, netns);
                Some(web.map_err(|source| TargetError::Web {
                    target: self.label.clone(),
                    source,
                })?)
            }
            _ => None,
        };
        let upstream_at = match (&upstream, &web) {
            (Some(u), _) => Some(UpstreamAt {
                uri: &u.uri,
                ca: None,
            }),
            (None, Some(w)) => Some(UpstreamAt {
                uri: &w.url,
                ca: w.ca.as_deref(),
            }),
            (None, None) => None,
        };
        let upstream_uri = upstream_at.as_ref();
        let (program, args, metrics) = match &self.launch {
            Launch::Uri(uri) => {
                return Ok(Running {
                    uri: uri.clone(),
                    fio: FioTarget::nbd(uri, None),
                    child: None,
                    metrics: None,
                    socket: None,
                    _upstream: None,
                    _web: None,
                })
            }
            Launch::FioRbd { pool, image, conf } => {
                return Ok(Running {
                    uri: String::new(),
                    fio: FioTarget::rbd(pool, image, conf),
                    child: None,
                    metrics: None,
                    socket: None,
                    _upstream: None,
                    _web: None,
                })
            }
            Launch::Zcnbd {
                program,
                file,
                args,
            } => self.zcnbd_command(program, file, args, &listen, size, tls, upstream_uri)?,
            Launch::Nbdkit { file } => {
                self.nbdkit_command(file, &listen, size, tls, upstream_uri)?
            }
            Launch::QemuNbd { file, args } => {
                self.qemu_nbd_command(file, args, &listen, size, tls, upstream_uri)?
            }
        };
        let (program, args) = match netns {
            Some(ns) => ns.wrap(&program, args),
            None => (program, args),
        };
        let child = Command::new(&program)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| self.spawn_error(&program, source))?;
        let running = Running {
            uri,
            fio,
            child: Some(child),
            metrics,
            socket,
            _upstream: upstream,
            _web: web,
        };
        running.wait_ready(&self.label)?;
        Ok(running)
    }

    /// The memory export a proxy target stands in front of: this binary's, on a Unix socket.
    fn start_upstream(&self, size: u64) -> Result<Running, TargetError> {
        let path = std::env::temp_dir().join(format!(
            "zcnbd-bench-{}-{}-upstream.sock",
            std::process::id(),
            free_port()
        ));
        let exe = std::env::current_exe().map_err(|source| self.spawn_error("zcnbd", source))?;
        let path_text = path.display().to_string();
        let size_text = size.to_string();
        let args = [
            "serve",
            "--exit-with-parent",
            "-s",
            &path_text,
            "--memory",
            &size_text,
        ];
        let child = Command::new(&exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| self.spawn_error("zcnbd", source))?;
        let running = Running {
            uri: format!("nbd+unix:///?socket={}", query_value(&path_text)),
            fio: FioTarget::nbd("", None),
            child: Some(child),
            metrics: None,
            socket: Some(path),
            _upstream: None,
            _web: None,
        };
        running.wait_ready(&format!("{} (its upstream)", self.label))?;
        Ok(running)
    }

    /// The run's credentials for an HTTPS web server.
    fn web_creds<'c>(
        &self,
        creds: Option<&'c BenchCreds>,
    ) -> Result<Option<&'c BenchCreds>, TargetError> {
        match creds {
            Some(creds) => Ok(Some(creds)),
            None => {
                let why = format!("{}: no credentials were made for the run", self.label);
                Err(super::creds::CredsError(why).into())
            }
        }
    }

    /// The run's credentials, if this target speaks TLS.
    fn tls_creds<'c>(
        &self,
        creds: Option<&'c BenchCreds>,
    ) -> Result<Option<&'c BenchCreds>, TargetError> {
        match (self.tls, creds) {
            (false, _) => Ok(None),
            (true, Some(creds)) => Ok(Some(creds)),
            (true, None) => {
                let why = format!("{}: no credentials were made for the run", self.label);
                Err(super::creds::CredsError(why).into())
            }
        }
    }

    /// `zcnbd serve` (this very binary) on `port`, with its metrics on another.
    #[allow(clippy::too_many_arguments)]
    fn zcnbd_command(
        &self,
        program: &Option<PathBuf>,
        file: &Option<PathBuf>,
        args: &[String],
        listen: &Listen,
        size: u64,
        tls: Option<&BenchCreds>,
        upstream: Option<&UpstreamAt<'_>>,
    ) -> Result<Launched, TargetError> {
        // The server goes with this process however it ends.
        let mut all = vec!["serve".to_string(), "--exit-with-parent".to_string()];
        let host = match listen {
            Listen::Tcp(host, _) => *host,
            Listen::Unix(_) => Ipv4Addr::LOCALHOST,
        };
        let metrics = SocketAddr::from((host, free_port()));
        match listen {
            Listen::Tcp(host, port) => {
                all.extend(["-b".into(), host.to_string(), "-p".into(), port.to_string()])
            }
            Listen::Unix(path) => all.extend(["-s".into(), path.display().to_string()]),
        }
        all.extend(["--metrics".into(), metrics.to_string()]);
        match (upstream, file) {
            (Some(up), _) => {
                all.push(up.uri.to_string());
                if up.uri.starts_with("http") {
                    all.extend(["--http-connections".into(), WEB_HTTP_CONNECTIONS.into()]);
                }
                if let Some(ca) = up.ca {
                    all.extend(["--http-cafile".into(), ca.display().to_string()]);
                }
            }
            (None, Some(f)) => {
                self.prepare_file(f, size)?;
                all.push(f.display().to_string());
            }
            (None, None) => all.extend(["--memory".into(), size.to_string()]),
        }
        all.extend(args.iter().cloned());
        if let Some(c) = tls {
            all.push("--tls=require".into());
            all.push(format!("--tls-certificates={}", c.server.display()));
        }
        let exe = match program {
            Some(p) => p.clone(),
            None => std::env::current_exe().map_err(|source| self.spawn_error("zcnbd", source))?,
        };
        Ok((exe.display().to_string(), all, Some(metrics)))
    }

    /// nbdkit's memory or file plugin on `port` (its nbd plugin for a proxy, its curl
    /// plugin for a web target).
    fn nbdkit_command(
        &self,
        file: &Option<PathBuf>,
        listen: &Listen,
        size: u64,
        tls: Option<&BenchCreds>,
        upstream: Option<&UpstreamAt<'_>>,
    ) -> Result<Launched, TargetError> {
        let mut all: Vec<String> = vec!["-f".into(), "--exit-with-parent".into()];
        match listen {
            Listen::Tcp(host, port) => {
                all.extend(["-i".into(), host.to_string(), "-p".into(), port.to_string()])
            }
            Listen::Unix(path) => all.extend(["-U".into(), path.display().to_string()]),
        }
        if let Some(c) = tls {
            all.push("--tls=require".into());
            all.push(format!("--tls-certificates={}", c.server.display()));
        }
        match (upstream, file) {
            (Some(up), _) if up.uri.starts_with("http") => {
                all.extend(["curl".into(), format!("url={}", up.uri)]);
                if let Some(ca) = up.ca {
                    all.push(format!("cainfo={}", ca.display()));
                }
            }
            (Some(up), _) => all.extend(["nbd".into(), format!("uri={}", up.uri)]),
            (None, Some(f)) => {
                self.prepare_file(f, size)?;
                all.extend(["file".into(), f.display().to_string()]);
            }
            (None, None) => all.extend(["memory".into(), size.to_string()]),
        }
        Ok(("nbdkit".to_string(), all, None))
    }

    /// qemu-nbd serving `file` on `port` in its format (qemu-nbd's defaults otherwise:
    /// `--cache=writeback --aio=threads`, unless `args` say else).
    fn qemu_nbd_command(
        &self,
        file: &Path,
        args: &[String],
        listen: &Listen,
        size: u64,
        tls: Option<&BenchCreds>,
        upstream: Option<&UpstreamAt<'_>>,
    ) -> Result<Launched, TargetError> {
        let format = match upstream {
            Some(_) => ImageFormat::Raw,
            None => self.prepare_file(file, size)?,
        };
        let mut all: Vec<String> = ["-f", format.name(), "-t", "-e", "16"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        match listen {
            Listen::Tcp(host, port) => {
                all.extend(["-b".into(), host.to_string(), "-p".into(), port.to_string()])
            }
            Listen::Unix(path) => all.extend(["-k".into(), path.display().to_string()]),
        }
        all.extend(args.iter().cloned());
        if let Some(c) = tls {
            // QEMU's server asks for a client certificate by default; the other
            // servers do not, and libnbd (under `--client fio`) offers none.
            let object = format!(
                "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer=off",
                c.server.display()
            );
            all.extend([
                "--object".into(),
                object,
                "--tls-creds".into(),
                "tls0".into(),
            ]);
        }
        match upstream {
            // QEMU's curl driver opens read-only or not at all.
            Some(up) if up.uri.starts_with("http") => all.extend(["-r".into(), up.uri.into()]),
            Some(up) => all.push(up.uri.to_string()),
            None => all.push(file.display().to_string()),
        }
        Ok(("qemu-nbd".to_string(), all, None))
    }

    fn spawn_error(&self, program: &str, source: std::io::Error) -> TargetError {
        TargetError::Spawn {
            target: self.label.clone(),
            program: program.to_string(),
            source,
        }
    }

    /// Makes sure a raw FILE exists and is at least `size` bytes (sparse), and says its
    /// format; a disk image (qcow2, ...) and an `rbd:POOL/IMAGE` are used as they are.
    fn prepare_file(&self, path: &Path, size: u64) -> Result<ImageFormat, TargetError> {
        if is_rbd(path) {
            return Ok(ImageFormat::Raw);
        }
        let file_error = |source| TargetError::File {
            target: self.label.clone(),
            source,
        };
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(file_error)?;
        let format = probe_image(&f).map_err(file_error)?.format();
        if format != ImageFormat::Raw {
            return Ok(format);
        }
        let len = f.metadata().map_err(file_error)?.len();
        if len < size {
            f.set_len(size).map_err(file_error)?;
        }
        Ok(format)
    }
}

/// The modes a target spec names (`:tls`, `:unix`).
#[derive(Debug, Default)]
struct Modes {
    tls: bool,
    unix: bool,
}

/// `zcnbd[@PATH]:WHAT[:MODE...]`'s launch: WHAT is `memory`, a file or `rbd:POOL/IMAGE`;
/// a mode is `tls`, `unix`, a data path, an engine, `direct` or any `zcnbd serve` option.
fn zcnbd_launch(program: Option<PathBuf>, rest: &str, modes: &mut Modes) -> Option<Launch> {
    let mut parts = rest.split(':');
    let mut what = parts.next().filter(|w| !w.is_empty())?.to_string();
    if what == "rbd" {
        let image = parts.next().filter(|i| i.contains('/'))?;
        what = format!("rbd:{image}");
    }
    let mut args = Vec::new();
    for mode in parts {
        match mode {
            "tls" => modes.tls = true,
            "unix" => modes.unix = true,
            "copy" | "zerocopy" | "auto" => {
                args.extend(["--data-path".to_string(), mode.to_string()])
            }
            "portable" | "uring" => args.extend(["--engine".to_string(), mode.to_string()]),
            "direct" => args.push("--direct".to_string()),
            // Any `zcnbd serve` option, e.g. `--receive-in-place-max-bytes=64M`.
            flag if flag.starts_with("--") => args.push(flag.to_string()),
            _ => return None,
        }
    }
    let file = (what != "memory").then(|| PathBuf::from(what));
    Some(Launch::Zcnbd {
        program,
        file,
        args,
    })
}

/// `qemu-nbd:FILE` or `qemu-nbd:rbd:POOL/IMAGE`, then `:tls`, `:unix` and qemu-nbd options
/// (`:--cache=none`).
fn qemu_nbd_launch(rest: &str, modes: &mut Modes) -> Option<Launch> {
    let (file, options) = match rest.strip_prefix("rbd:") {
        Some(image) => {
            let (image, options) = image.split_once(':').unwrap_or((image, ""));
            (format!("rbd:{image}"), options)
        }
        None => {
            let (file, options) = rest.split_once(":").unwrap_or((rest, ""));
            (file.to_string(), options)
        }
    };
    let mut args = Vec::new();
    for option in options.split(':').filter(|o| !o.is_empty()) {
        match option {
            "tls" => modes.tls = true,
            "unix" => modes.unix = true,
            flag if flag.starts_with("--") => args.push(flag.to_string()),
            _ => return None,
        }
    }
    if file.is_empty() {
        return None;
    }
    Some(Launch::QemuNbd {
        file: PathBuf::from(file),
        args,
    })
}

/// `fio-rbd:POOL/IMAGE[:KEY=VALUE...]`: fio's rbd engine, the `KEY=VALUE`s for librbd.
fn fio_rbd_launch(rest: &str) -> Option<Launch> {
    let mut parts = rest.split(':');
    let (pool, image) = parts.next()?.split_once('/')?;
    let conf: Vec<String> = parts.map(str::to_string).collect();
    let bad_conf = conf.iter().any(|kv| !kv.contains('=') || kv.contains(' '));
    if pool.is_empty() || image.is_empty() || image.contains('/') || bad_conf {
        return None;
    }
    Some(Launch::FioRbd {
        pool: pool.to_string(),
        image: image.to_string(),
        conf,
    })
}

/// Whether a target's FILE is an RBD image (`rbd:POOL/IMAGE`), which zcnbd and qemu-nbd both
/// take as written.
fn is_rbd(path: &Path) -> bool {
    path.to_str().is_some_and(|p| p.starts_with("rbd:"))
}

/// `FILE:tls` -> (`FILE`, true).
/// Where a started server listens.
enum Listen {
    /// TCP on this address (the loopback's, or the namespace's end of `--netns`' veth pair).
    Tcp(Ipv4Addr, u16),
    Unix(PathBuf),
}

/// Strips trailing `:tls` and `:unix` (in any order): what is left, and which were there.
fn strip_modes(mut rest: &str) -> (&str, bool, bool) {
    let (mut tls, mut unix) = (false, false);
    loop {
        if let Some(r) = rest.strip_suffix(":tls") {
            (rest, tls) = (r, true);
        } else if let Some(r) = rest.strip_suffix(":unix") {
            (rest, unix) = (r, true);
        } else {
            return (rest, tls, unix);
        }
    }
}

/// Percent-encodes a URI query value (a path: all but unreserved characters and `/`).
fn query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(10809)
}

/// A target ready for clients; a started server is killed when this drops.
pub struct Running {
    /// Where clients connect (empty for `fio-rbd:`).
    pub uri: String,
    /// How fio reaches the target (`--client fio`).
    pub fio: FioTarget,
    child: Option<Child>,
    metrics: Option<SocketAddr>,
    /// The Unix socket a started server listens on, removed at the end.
    socket: Option<PathBuf>,
    /// A proxy's upstream, stopped after it.
    _upstream: Option<Box<Running>>,
    /// A web target's nginx, stopped after it.
    _web: Option<WebServer>,
}

impl Running {
    fn wait_ready(&self, label: &str) -> Result<(), TargetError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if zcnbd_client::Client::connect(&self.uri).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Err(TargetError::NotReady(label.to_string()))
    }

    /// CPU seconds the server process has used so far (user + system), if this run
    /// started it.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let pid = self.child.as_ref()?.id();
        super::machine::cpu_seconds(&pid.to_string())
    }

    /// The zcnbd server's counters now, when the target is a zcnbd this run started.
    pub fn counters(&self) -> Option<ServerCounters> {
        let addr = self.metrics?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let value = |name: &str| -> u64 {
            let key = format!("zcnbd_{name}_total ");
            text.lines()
                .find_map(|l| l.strip_prefix(&key))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        Some(ServerCounters {
            sent_plain_bytes: value("sent_plain_bytes"),
            sent_splice_bytes: value("sent_splice_bytes"),
            sent_zerocopy_bytes: value("sent_zerocopy_bytes"),
            sent_zerocopy_copied_bytes: value("sent_zerocopy_copied_bytes"),
            received_in_place_bytes: value("received_in_place_bytes"),
            received_splice_bytes: value("received_splice_bytes"),
            copied_bytes: value("copied_bytes"),
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(path) = &self.socket {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The difference of two counter snapshots.
pub fn counters_delta(before: ServerCounters, after: ServerCounters) -> ServerCounters {
    ServerCounters {
        sent_plain_bytes: after
            .sent_plain_bytes
            .saturating_sub(before.sent_plain_bytes),
        sent_splice_bytes: after
            .sent_splice_bytes
            .saturating_sub(before.sent_splice_bytes),
        sent_zerocopy_bytes: after
            .sent_zerocopy_bytes
            .saturating_sub(before.sent_zerocopy_bytes),
        sent_zerocopy_copied_bytes: after
            .sent_zerocopy_copied_bytes
            .saturating_sub(before.sent_zerocopy_copied_bytes),
        received_in_place_bytes: after
            .received_in_place_bytes
            .saturating_sub(before.received_in_place_bytes),
        received_splice_bytes: after
            .received_splice_bytes
            .saturating_sub(before.received_splice_bytes),
        copied_bytes: after.copied_bytes.saturating_sub(before.copied_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert!(TargetSpec::parse("nbd://127.0.0.1:10809/").is_ok_and(|t| !t.is_started()));
        assert!(TargetSpec::parse("nbd+vsock://1/").is_ok_and(|t| !t.is_started()));
        let copy = TargetSpec::parse("zcnbd:memory:copy").expect("copy");
        assert_eq!(
            copy.launch,
            Launch::Zcnbd {
                program: None,
                file: None,
                args: vec!["--data-path".into(), "copy".into()]
            }
        );
        assert!(TargetSpec::parse("zcnbd:/tmp/x.img").is_ok());
        let old = TargetSpec::parse("zcnbd@/tmp/zcnbd-old:/tmp/x.img").expect("another build");
        assert_eq!(
            old.launch,
            Launch::Zcnbd {
                program: Some("/tmp/zcnbd-old".into()),
                file: Some("/tmp/x.img".into()),
                args: vec![]
            }
        );
        assert!(TargetSpec::parse("zcnbd@:memory").is_err());
        assert!(TargetSpec::parse("nbdkit:memory").is_ok());
        assert!(TargetSpec::parse("qemu-nbd:/tmp/x.img").is_ok());
        assert!(TargetSpec::parse("zcnbd:memory:bogus").is_err());
        assert!(TargetSpec::parse("what").is_err());
    }

    #[test]
    fn rbd_targets_parse() {
        let zc = TargetSpec::parse("zcnbd:rbd:rbd/bench:portable").expect("zcnbd rbd");
        assert_eq!(
            zc.launch,
            Launch::Zcnbd {
                program: None,
                file: Some("rbd:rbd/bench".into()),
                args: vec!["--engine".into(), "portable".into()]
            }
        );
        let qemu = TargetSpec::parse("qemu-nbd:rbd:rbd/bench").expect("qemu-nbd rbd");
        assert_eq!(
            qemu.launch,
            Launch::QemuNbd {
                file: "rbd:rbd/bench".into(),
                args: vec![]
            }
        );
        let with_options = TargetSpec::parse("qemu-nbd:/tmp/x.qcow2:--cache=none:--aio=io_uring")
            .expect("qemu-nbd options");
        assert_eq!(
            with_options.launch,
            Launch::QemuNbd {
                file: "/tmp/x.qcow2".into(),
                args: vec!["--cache=none".into(), "--aio=io_uring".into()]
            }
        );
        assert!(TargetSpec::parse("qemu-nbd:/tmp/x.img:bogus").is_err());
        assert!(is_rbd(Path::new("rbd:rbd/bench")) && !is_rbd(Path::new("/tmp/rbd")));
        assert!(TargetSpec::parse("zcnbd:rbd").is_err());
        assert!(TargetSpec::parse("zcnbd:rbd:noslash").is_err());
        let fio = TargetSpec::parse("fio-rbd:rbd/bench:rbd_cache=false").expect("fio-rbd");
        assert!(!fio.speaks_nbd() && !fio.is_started());
        assert_eq!(
            fio.launch,
            Launch::FioRbd {
                pool: "rbd".into(),
                image: "bench".into(),
                conf: vec!["rbd_cache=false".into()]
            }
        );
        assert!(TargetSpec::parse("fio-rbd:rbd").is_err());
        assert!(TargetSpec::parse("fio-rbd:rbd/bench:nokey").is_err());
        assert!(TargetSpec::parse("fio-rbd:rbd/a/b").is_err());
    }

    #[test]
    fn tls_targets_parse() {
        let zc = TargetSpec::parse("zcnbd:memory:tls").expect("zcnbd tls");
        assert!(zc.needs_credentials());
        assert_eq!(
            zc.launch,
            Launch::Zcnbd {
                program: None,
                file: None,
                args: vec![]
            }
        );
        let kit = TargetSpec::parse("nbdkit:memory:tls").expect("nbdkit tls");
        assert!(kit.needs_credentials() && kit.launch == Launch::Nbdkit { file: None });
        let qemu = TargetSpec::parse("qemu-nbd:/tmp/x.img:tls").expect("qemu tls");
        assert!(qemu.needs_credentials());
        assert_eq!(
            qemu.launch,
            Launch::QemuNbd {
                file: "/tmp/x.img".into(),
                args: vec![]
            }
        );
        assert!(!TargetSpec::parse("qemu-nbd:/tmp/x.img")
            .unwrap()
            .needs_credentials());
        let uri = TargetSpec::parse("nbds://h/?tls-certificates=/d").expect("nbds URI");
        assert!(!uri.is_started() && !uri.needs_credentials());
        assert_eq!(query_value("/tmp/a b&c"), "/tmp/a%20b%26c");
    }

    #[test]
    fn proxy_targets_parse() {
        for spec in [
            "zcnbd:proxy",
            "nbdkit:proxy",
            "qemu-nbd:proxy",
            "zcnbd:proxy:portable",
            "zcnbd@/tmp/zcnbd-old:proxy",
            "zcnbd@/tmp/zcnbd-old:proxy:--splice-min-bytes=1M",
        ] {
            let t = TargetSpec::parse(spec).expect(spec);
            assert!(
                t.upstream == Some(UpstreamKind::Nbd) && t.is_started(),
                "{spec}"
            );
            assert_eq!(t.label, spec);
        }
        let t = TargetSpec::parse("zcnbd:proxy:unix:tls").unwrap();
        assert!(t.upstream == Some(UpstreamKind::Nbd) && t.unix && t.tls);
        assert!(TargetSpec::parse("zcnbd:memory")
            .unwrap()
            .upstream
            .is_none());
        assert!(TargetSpec::parse("zcnbd:/tmp/proxyfile")
            .unwrap()
            .upstream
            .is_none());
        assert!(TargetSpec::parse("zcnbd:proxy:bogus").is_err());
        // Another build's proxy and web targets are that: not a file named `proxy` or `web`.
        let old = TargetSpec::parse("zcnbd@/tmp/zcnbd-old:web").unwrap();
        assert!(old.upstream == Some(UpstreamKind::Web { https: false }));
    }

    #[test]
    fn web_targets_parse() {
        let http = UpstreamKind::Web { https: false };
        let https = UpstreamKind::Web { https: true };
        for (spec, kind) in [
            ("zcnbd:web", http),
            ("nbdkit:web", http),
            ("qemu-nbd:web", http),
            ("zcnbd:webs", https),
            ("nbdkit:webs:unix", https),
            ("zcnbd:web:portable", http),
        ] {
            let t = TargetSpec::parse(spec).expect(spec);
            assert_eq!(t.upstream, Some(kind), "{spec}");
            assert!(t.is_read_only() && t.is_started(), "{spec}");
            assert_eq!(t.needs_credentials(), kind == https, "{spec}");
        }
        // qemu-nbd's curl driver cannot be given the run's CA: a file called "webs".
        assert!(TargetSpec::parse("qemu-nbd:webs").is_ok_and(|t| t.upstream.is_none()));
        assert!(TargetSpec::parse("zcnbd:website").is_ok_and(|t| t.upstream.is_none()));
        assert!(!TargetSpec::parse("zcnbd:memory").unwrap().is_read_only());
    }

    #[test]
    fn unix_targets_parse() {
        let zc = TargetSpec::parse("zcnbd:memory:tls:unix").expect("zcnbd unix");
        assert!(zc.unix && zc.tls);
        let kit = TargetSpec::parse("nbdkit:memory:unix:tls").expect("nbdkit unix");
        assert!(kit.unix && kit.tls && kit.launch == Launch::Nbdkit { file: None });
        let kit = TargetSpec::parse("nbdkit:/tmp/x.img:unix").expect("nbdkit file unix");
        assert!(kit.unix && !kit.tls);
        assert_eq!(
            kit.launch,
            Launch::Nbdkit {
                file: Some("/tmp/x.img".into())
            }
        );
        let qemu = TargetSpec::parse("qemu-nbd:/tmp/x.img:unix").expect("qemu unix");
        assert!(qemu.unix && !qemu.tls);
        assert!(!TargetSpec::parse("zcnbd:memory").unwrap().unix);
    }
}
