//! The web server an HTTP source's target reads from (`zcnbd:web`, `nbdkit:web`,
//! `qemu-nbd:web`, and `:webs` for HTTPS): nginx from Debian's packages, in the foreground
//! on a free loopback port with a worker process per CPU (nginx's `auto`, as Debian's
//! configuration has it), serving one file of the run's size made for it (bytes that differ
//! from block to block, so nothing reads as a hole), from the page cache by `sendfile`,
//! without an access log and without closing kept-alive connections. Its CPU is not counted:
//! the same nginx stands behind every target. Everything lives in a temporary directory
//! removed when this drops.

use std::io::Write;
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::creds::BenchCreds;
use super::netns::Netns;

/// Where nginx is looked for (Debian installs it in /usr/sbin, often not on a user's PATH).
const NGINX_PATHS: [&str; 2] = ["/usr/sbin/nginx", "/usr/bin/nginx"];
/// The file's name under the served root.
const FILE_NAME: &str = "disk.img";
/// How the file is written: this many bytes at a time.
const FILL_CHUNK_BYTES: usize = 1 << 20;

/// Why the web server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    #[error("web targets need nginx (scripts/install-deps.sh installs it): none at {0:?}")]
    NoNginx([&'static str; 2]),
    #[error("web server: {0}")]
    Io(#[from] std::io::Error),
    #[error("nginx did not listen within 10 s (its log: {0})")]
    NotReady(PathBuf),
}

/// A running nginx serving one file; stopped and removed when dropped.
pub struct WebServer {
    child: Child,
    /// The file's URL.
    pub url: String,
    /// The CA that signed the certificate, for an HTTPS server.
    pub ca: Option<PathBuf>,
    _dir: TempDir,
}

impl WebServer {
    /// Starts nginx on a file of `size` bytes; over HTTPS with the run's server certificate
    /// (made for `localhost` and `127.0.0.1`) when `tls` is given.
    /// Listens on `(host, port)`, inside `netns` when given (where the servers run).
    pub fn start(
        size: u64,
        (host, port): (Ipv4Addr, u16),
        tls: Option<&BenchCreds>,
        netns: Option<&Netns>,
    ) -> Result<WebServer, WebError> {
        let nginx = NGINX_PATHS
            .iter()
            .find(|p| Path::new(p).exists())
            .ok_or(WebError::NoNginx(NGINX_PATHS))?;
        let dir = tempfile::Builder::new()
            .prefix("zcnbd-bench-web.")
            .tempdir()?;
        let root = dir.path().join("www");
        std::fs::create_dir(&root)?;
        fill(&root.join(FILE_NAME), size)?;
        let conf = dir.path().join("nginx.conf");
        std::fs::write(&conf, config(dir.path(), &root, (host, port), tls))?;
        let log = dir.path().join("error.log");
        let args = vec![
            "-e".to_string(),
            log.display().to_string(),
            "-c".to_string(),
            conf.display().to_string(),
        ];
        let (program, args) = match netns {
            Some(ns) => ns.wrap(nginx, args),
            None => (nginx.to_string(), args),
        };
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let server = WebServer {
            child,
            url: format!("{scheme}://{host}:{port}/{FILE_NAME}"),
            ca: tls.map(|c| c.server.join("ca-cert.pem")),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((host, port)).is_err() {
            if Instant::now() >= deadline {
                return Err(WebError::NotReady(log));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}

impl Drop for WebServer {
    /// Stops the master, which stops its workers first (a killed master would leave them
    /// running); killed if it has not gone within 5 s.
    fn drop(&mut self) {
        let master = rustix::process::Pid::from_raw(self.child.id() as i32);
        if let Some(master) = master {
            let _ = rustix::process::kill_process(master, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx's configuration: a master and a worker per CPU, everything under `work`, `root`
/// served on `(host, port)`. One worker alone made an HTTPS run measure its one CPU's
/// encryption, the same for every target, whatever each server spent.
fn config(
    work: &Path,
    root: &Path,
    (host, port): (Ipv4Addr, u16),
    tls: Option<&BenchCreds>,
) -> String {
    let w = work.display();
    let (ssl, certs) = match tls {
        Some(c) => (
            " ssl",
            format!(
                "ssl_certificate {}; ssl_certificate_key {};",
                c.server.join("server-cert.pem").display(),
                c.server.join("server-key.pem").display()
            ),
        ),
        None => ("", String::new()),
    };
    format!(
        "daemon off;\nworker_processes auto;\npid {w}/nginx.pid;\nerror_log {w}/error.log;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  default_type application/octet-stream;\n  sendfile on;\n\
         \x20 keepalive_requests 1000000;\n  keepalive_timeout 600s;\n\
         \x20 client_body_temp_path {w}/body; proxy_temp_path {w}/proxy; fastcgi_temp_path {w}/fcgi;\n\
         \x20 uwsgi_temp_path {w}/uwsgi; scgi_temp_path {w}/scgi;\n\
         \x20 server {{ listen {host}:{port}{ssl}; server_name localhost; root {}; {certs} }}\n}}\n",
        root.display()
    )
}

/// Writes `size` bytes to `path`: a block of xorshift bytes, each MiB stamped with its index.
fn fill(path: &Path, size: u64) -> std::io::Result<()> {
    let mut block = vec![0u8; FILL_CHUNK_BYTES];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in block.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut left = size;
    let mut index = 0u64;
    while left > 0 {
        block[..8].copy_from_slice(&index.to_le_bytes());
        let n = left.min(FILL_CHUNK_BYTES as u64) as usize;
        file.write_all(&block[..n])?;
        left -= n as u64;
        index += 1;
    }
    file.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_serves_the_root_on_the_port_and_https_with_the_certificates() {
        let at = (Ipv4Addr::LOCALHOST, 8080);
        let plain = config(Path::new("/w"), Path::new("/w/www"), at, None);
        assert!(plain.contains("listen 127.0.0.1:8080;") && plain.contains("root /w/www;"));
        assert!(plain.contains("access_log off;") && !plain.contains("ssl"));
        // A worker per CPU under a master, which stops them when it is stopped.
        assert!(plain.contains("worker_processes auto;") && !plain.contains("master_process"));
    }

    #[test]
    fn fill_writes_size_bytes_that_differ_from_mib_to_mib() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        fill(&path, 2 * FILL_CHUNK_BYTES as u64 + 100).unwrap();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(data.len(), 2 * FILL_CHUNK_BYTES + 100);
        assert_ne!(data[..8], data[FILL_CHUNK_BYTES..FILL_CHUNK_BYTES + 8]);
        assert!(data[8..4096].iter().any(|&b| b != 0));
    }
}
