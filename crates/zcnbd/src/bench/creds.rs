//! X.509 credentials for one run's TLS targets (`zcnbd:memory:tls`, `nbdkit:memory:tls`,
//! `qemu-nbd:FILE:tls`), made with GnuTLS's certtool in a temporary directory removed at
//! the end, in the layout nbdkit, QEMU and libnbd read:
//!
//! - `server/`: `ca-cert.pem`, `server-cert.pem`, `server-key.pem` (for `localhost` and
//!   `127.0.0.1`, where the servers listen, and `--netns`' address);
//! - `home/.pki/libnbd/`: `ca-cert.pem`, `client-cert.pem`, `client-key.pem` - what our
//!   client's `tls-certificates` names, and where libnbd looks when `HOME` is `home/` (fio's
//!   nbd engine refuses URI keys that read files, so `--client fio` runs fio with that `HOME`);
//!   no server this run starts asks for the client certificate.

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

/// Why the credentials could not be made.
#[derive(Debug, thiserror::Error)]
#[error("TLS targets need certtool (gnutls-bin; scripts/install-deps.sh installs it): {0}")]
pub struct CredsError(pub(super) String);

/// The run's credentials; the directory goes when this drops.
pub struct BenchCreds {
    _dir: TempDir,
    /// The servers' certificates directory.
    pub server: PathBuf,
    /// The client's certificates directory (`home/.pki/libnbd`).
    pub client: PathBuf,
    /// A `HOME` whose `.pki/libnbd` is `client`, for libnbd programs (fio).
    pub home: PathBuf,
}

impl BenchCreds {
    /// A CA, a server certificate and a client certificate, in a fresh directory.
    pub fn make() -> Result<BenchCreds, CredsError> {
        let dir = tempfile::Builder::new()
            .prefix("zcnbd-bench-tls.")
            .tempdir()
            .map_err(|e| CredsError(format!("temporary directory: {e}")))?;
        let root = dir.path();
        let server = root.join("server");
        let home = root.join("home");
        let client = home.join(".pki").join("libnbd");
        for d in [&server, &client] {
            std::fs::create_dir_all(d).map_err(|e| CredsError(format!("{}: {e}", d.display())))?;
        }
        let ca_cert = server.join("ca-cert.pem");
        let ca_key = root.join("ca-key.pem");
        key(&ca_key)?;
        let ca_info = template(
            root,
            "ca",
            "cn = \"zcnbd bench CA\"\nca\ncert_signing_key\n",
        )?;
        certtool(&[
            "--generate-self-signed",
            "--load-privkey",
            &s(&ca_key),
            "--template",
            &s(&ca_info),
            "--outfile",
            &s(&ca_cert),
        ])?;
        std::fs::copy(&ca_cert, client.join("ca-cert.pem"))
            .map_err(|e| CredsError(format!("copy the CA: {e}")))?;
        // Also for the address servers listen on inside `--netns`' namespace.
        let server_info = format!(
            "cn = \"localhost\"\ndns_name = \"localhost\"\nip_address = \"127.0.0.1\"\n\
             ip_address = \"{}\"\ntls_www_server\nsigning_key\nencryption_key\n",
            super::netns::NS_ADDR
        );
        signed(root, &server, "server", &server_info, (&ca_cert, &ca_key))?;
        let client_info =
            "cn = \"zcnbd bench client\"\ntls_www_client\nsigning_key\nencryption_key\n";
        signed(root, &client, "client", client_info, (&ca_cert, &ca_key))?;
        Ok(BenchCreds {
            _dir: dir,
            server,
            client,
            home,
        })
    }
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn certtool(args: &[&str]) -> Result<(), CredsError> {
    let out = Command::new("certtool")
        .args(args)
        .output()
        .map_err(|e| CredsError(format!("certtool: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(CredsError(format!("certtool {}: {}", args[0], err.trim())));
    }
    Ok(())
}

fn key(path: &Path) -> Result<(), CredsError> {
    certtool(&["--generate-privkey", "--outfile", &s(path)])?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| CredsError(format!("chmod {}: {e}", path.display())))
}

fn template(root: &Path, name: &str, text: &str) -> Result<PathBuf, CredsError> {
    let path = root.join(format!("{name}.info"));
    let text = format!("{text}expiration_days = 7\n");
    std::fs::write(&path, text).map_err(|e| CredsError(format!("{}: {e}", path.display())))?;
    Ok(path)
}

/// `dir/{stem}-cert.pem` and `dir/{stem}-key.pem`, signed by the CA.
fn signed(
    root: &Path,
    dir: &Path,
    stem: &str,
    info: &str,
    (ca_cert, ca_key): (&Path, &Path),
) -> Result<(), CredsError> {
    let key_path = dir.join(format!("{stem}-key.pem"));
    key(&key_path)?;
    let info = template(root, stem, info)?;
    certtool(&[
        "--generate-certificate",
        "--load-ca-certificate",
        &s(ca_cert),
        "--load-ca-privkey",
        &s(ca_key),
        "--load-privkey",
        &s(&key_path),
        "--template",
        &s(&info),
        "--outfile",
        &s(&dir.join(format!("{stem}-cert.pem"))),
    ])
}
