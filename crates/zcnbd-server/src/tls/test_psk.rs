//! For tests: a PSK server and clients for it, with no certificates to make.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use zcnbd_tls::{TlsClientConfig, TlsConfig, TlsConnector, TlsMode, TlsServer, TlsVersion};

const KEY: &str = "7682841d058dc2bf74f0ba3589703d86c13e819fa6f50dd3407e4634bb8744f9";

/// A server requiring TLS with the key of user `alice`, written (mode 0600) into `dir`;
/// and the key file, for clients.
pub fn psk_server(dir: &Path) -> (TlsServer, PathBuf) {
    let keys = dir.join("keys.psk");
    std::fs::write(&keys, format!("alice:{KEY}\n")).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let server = TlsConfig {
        mode: TlsMode::Require,
        psk: Some(keys.clone()),
        ..TlsConfig::default()
    }
    .load()
    .unwrap()
    .unwrap();
    (server, keys)
}

/// A client as `alice` with `keys`, up to `version_max`.
pub fn psk_client(keys: &Path, version_max: Option<TlsVersion>) -> TlsConnector {
    TlsClientConfig {
        psk_file: Some(keys.to_path_buf()),
        username: Some("alice".into()),
        version_max,
        ..TlsClientConfig::default()
    }
    .load()
    .unwrap()
}
