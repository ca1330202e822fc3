//! TLS credentials for the client's tests, made with GnuTLS's certtool and psktool as
//! `tests/interop/tls_creds.py` makes them, in the layout nbdkit, QEMU and libnbd read:
//!
//! - server dir: ca-cert.pem, server-cert.pem, server-key.pem (names localhost, 127.0.0.1)
//! - client dirs: ca-cert.pem, and client-cert.pem + client-key.pem where a certificate is
//!   wanted
//! - PSK files: keys.psk ("username:hexkey")
//!
//! Made once per test binary (key generation is the slow part), under Cargo's temporary
//! directory for tests. Without certtool or psktool the tests skip, except under CI=true.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::servers::{ci, installed};

/// The PSK username in every PSK file but `psk_unknown`.
pub const PSK_USER: &str = "alice";

pub struct Creds {
    /// ca-cert.pem, server-cert.pem, server-key.pem.
    pub server: PathBuf,
    /// The CA and a client certificate it signed.
    pub client: PathBuf,
    /// Only the CA: a client without a certificate.
    pub client_no_cert: PathBuf,
    /// Only another CA's certificate: the server's certificate is from an unknown CA.
    pub client_other_ca: PathBuf,
    /// A directory holding keys.psk with `PSK_USER` (QEMU's tls-creds-psk `dir=`).
    pub psk_dir: PathBuf,
    /// `psk_dir/keys.psk`.
    pub psk: PathBuf,
    /// `PSK_USER` with another key.
    pub psk_wrong: PathBuf,
}

/// The credentials, or `None` (a printed reason) when the tools are missing outside CI.
pub fn get() -> Option<&'static Creds> {
    static CREDS: OnceLock<Option<Creds>> = OnceLock::new();
    CREDS.get_or_init(make).as_ref()
}

fn make() -> Option<Creds> {
    for tool in ["certtool", "psktool"] {
        if !installed(tool) {
            assert!(!ci(), "{tool} is not installed (CI=true requires it)");
            eprintln!("SKIP TLS tests: {tool} is not installed (apt install gnutls-bin)");
            return None;
        }
    }
    let root = tempfile::Builder::new()
        .prefix("tls-creds")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("temp dir")
        // Shared by every test in this binary for its whole life; a few KiB under target/.
        .keep();
    let cas = mkdir(&root, "cas");
    let ca = self_signed(&cas, "ca");
    let other = self_signed(&cas, "other-ca");
    let server = mkdir(&root, "server");
    std::fs::copy(&ca.0, server.join("ca-cert.pem")).expect("copy CA");
    signed(
        &server,
        "server",
        &ca,
        &[
            "organization = \"zcnbd tests\"",
            "cn = \"localhost\"",
            "dns_name = \"localhost\"",
            "ip_address = \"127.0.0.1\"",
            "tls_www_server",
            "signing_key",
            "encryption_key",
            "expiration_days = 30",
        ],
    );
    let client = mkdir(&root, "client");
    std::fs::copy(&ca.0, client.join("ca-cert.pem")).expect("copy CA");
    signed(
        &client,
        "client",
        &ca,
        &[
            "organization = \"zcnbd tests\"",
            "cn = \"client\"",
            "tls_www_client",
            "signing_key",
            "encryption_key",
            "expiration_days = 30",
        ],
    );
    let client_no_cert = mkdir(&root, "client-no-cert");
    std::fs::copy(&ca.0, client_no_cert.join("ca-cert.pem")).expect("copy CA");
    let client_other_ca = mkdir(&root, "client-other-ca");
    std::fs::copy(&other.0, client_other_ca.join("ca-cert.pem")).expect("copy CA");
    let psk_dir = mkdir(&root, "psk");
    let psk = psk_file(&psk_dir, PSK_USER);
    let psk_wrong = psk_file(&mkdir(&root, "psk-wrong"), PSK_USER);
    Some(Creds {
        server,
        client,
        client_no_cert,
        client_other_ca,
        psk_dir,
        psk,
        psk_wrong,
    })
}

fn mkdir(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir(&dir).expect("mkdir");
    dir
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temp path")
}

fn private_key(path: &Path) {
    run(
        "certtool",
        &[
            "--generate-privkey",
            "--key-type=rsa",
            "--bits=2048",
            "--outfile",
            path_str(path),
        ],
    );
    set_mode(path, 0o600);
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn template(path: &Path, lines: &[&str]) {
    std::fs::write(path, lines.join("\n") + "\n").expect("write template");
}

/// A CA: (certificate, key).
fn self_signed(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{name}-key.pem"));
    let cert = dir.join(format!("{name}-cert.pem"));
    let info = dir.join(format!("{name}.info"));
    private_key(&key);
    let cn = format!("cn = \"{name}\"");
    template(
        &info,
        &[&cn, "ca", "cert_signing_key", "expiration_days = 30"],
    );
    run(
        "certtool",
        &[
            "--generate-self-signed",
            "--load-privkey",
            path_str(&key),
            "--template",
            path_str(&info),
            "--outfile",
            path_str(&cert),
        ],
    );
    (cert, key)
}

/// `dir/{stem}-cert.pem` and `dir/{stem}-key.pem`, signed by `ca`.
fn signed(dir: &Path, stem: &str, ca: &(PathBuf, PathBuf), lines: &[&str]) {
    let key = dir.join(format!("{stem}-key.pem"));
    let info = dir.join(format!("{stem}.info"));
    private_key(&key);
    template(&info, lines);
    run(
        "certtool",
        &[
            "--generate-certificate",
            "--load-ca-certificate",
            path_str(&ca.0),
            "--load-ca-privkey",
            path_str(&ca.1),
            "--load-privkey",
            path_str(&key),
            "--template",
            path_str(&info),
            "--outfile",
            path_str(&dir.join(format!("{stem}-cert.pem"))),
        ],
    );
    std::fs::remove_file(info).expect("remove template");
}

fn psk_file(dir: &Path, user: &str) -> PathBuf {
    let path = dir.join("keys.psk");
    run("psktool", &["-u", user, "-p", path_str(&path)]);
    set_mode(&path, 0o600);
    path
}
