//! Loading TLS settings: every fault is an error at start, loose permissions a warning.

mod tls_support;

use std::fs;
use std::path::Path;

use tempfile::TempDir;
use tls_support::*;
use zcnbd_tls::{LoadWarning, PskLineProblem, TlsConfig, TlsLoadError, TlsMode, TlsServer};

fn x509(dir: &Path) -> TlsConfig {
    TlsConfig {
        mode: TlsMode::Require,
        certificates: Some(dir.to_path_buf()),
        ..TlsConfig::default()
    }
}

fn load(config: &TlsConfig) -> Result<TlsServer, TlsLoadError> {
    config.load().map(|s| s.expect("mode is not off"))
}

#[test]
fn off_loads_nothing() {
    let config = TlsConfig {
        certificates: Some("/nonexistent".into()),
        ..TlsConfig::default()
    };
    assert!(config.load().unwrap().is_none());
}

#[test]
fn a_key_that_is_not_the_certificates_is_refused_at_load() {
    let pki = Pki::new();
    let dir = pki.server_dir(&pki.server);
    let other_key = pki.client.key.private_key_to_pem_pkcs8().unwrap();
    write_pem(dir.path(), "server-key.pem", &other_key, 0o600);
    match load(&x509(dir.path())) {
        Err(TlsLoadError::KeyMismatch { cert, key }) => {
            assert!(cert.ends_with("server-cert.pem") && key.ends_with("server-key.pem"));
        }
        other => panic!("expected KeyMismatch, got {:?}", other.err()),
    }
}

#[test]
fn missing_and_unparsable_files_name_the_file() {
    let pki = Pki::new();
    let dir = pki.server_dir(&pki.server);
    fs::remove_file(dir.path().join("server-key.pem")).unwrap();
    let err = load(&x509(dir.path())).err().unwrap();
    assert!(matches!(&err, TlsLoadError::Read { path, .. } if path.ends_with("server-key.pem")));

    let dir = pki.server_dir(&pki.server);
    write_pem(dir.path(), "server-cert.pem", b"not a certificate\n", 0o644);
    let err = load(&x509(dir.path())).err().unwrap();
    assert!(matches!(err, TlsLoadError::BadCertificate { .. }), "{err}");

    let dir = pki.server_dir(&pki.server);
    write_pem(
        dir.path(),
        "server-key.pem",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n",
        0o600,
    );
    let err = load(&x509(dir.path())).err().unwrap();
    assert!(matches!(err, TlsLoadError::BadKey { .. }), "{err}");

    // ca-cert.pem is needed only to verify clients.
    let dir = pki.server_dir(&pki.server);
    fs::remove_file(dir.path().join("ca-cert.pem")).unwrap();
    assert!(load(&x509(dir.path())).is_ok());
    let verifying = TlsConfig {
        verify_peer: true,
        ..x509(dir.path())
    };
    let err = load(&verifying).err().unwrap();
    assert!(matches!(&err, TlsLoadError::Read { path, .. } if path.ends_with("ca-cert.pem")));
}

#[test]
fn contradictory_settings_are_refused() {
    let dir = TempDir::new().unwrap();
    let base = TlsConfig {
        mode: TlsMode::On,
        ..TlsConfig::default()
    };
    assert!(matches!(load(&base), Err(TlsLoadError::NoCredentials)));
    let both = TlsConfig {
        certificates: Some(dir.path().into()),
        psk: Some(dir.path().join("keys.psk")),
        ..base.clone()
    };
    assert!(matches!(load(&both), Err(TlsLoadError::BothCredentials)));
    let authz = TlsConfig {
        mode: TlsMode::Require,
        certificates: Some(dir.path().into()),
        authz: vec![CLIENT_DN.into()],
        ..base.clone()
    };
    assert!(matches!(
        load(&authz),
        Err(TlsLoadError::AuthzWithoutVerify)
    ));
    // A restriction on who may connect, with plain text allowed (or no TLS at all), would
    // be gone around.
    for mode in [TlsMode::On, TlsMode::Off] {
        for restricted in [
            TlsConfig {
                mode,
                authz: vec![CLIENT_DN.into()],
                ..authz.clone()
            },
            TlsConfig {
                mode,
                verify_peer: true,
                ..base.clone()
            },
        ] {
            assert!(matches!(
                load(&restricted),
                Err(TlsLoadError::RestrictionBypassed(m)) if m == mode
            ));
        }
    }
}

#[test]
fn secret_files_readable_by_others_warn() {
    let pki = Pki::new();
    let dir = pki.server_dir(&pki.server);
    assert!(load(&x509(dir.path())).unwrap().warnings().is_empty());
    let key = dir.path().join("server-key.pem");
    fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    let warnings = load(&x509(dir.path())).unwrap().warnings().to_vec();
    assert_eq!(
        warnings,
        [LoadWarning::SecretReadableByOthers {
            path: key,
            mode: 0o100640
        }]
    );
    assert!(warnings[0].to_string().contains("640"), "{}", warnings[0]);

    let psk = psk_file(dir.path());
    let config = TlsConfig {
        mode: TlsMode::On,
        psk: Some(psk.clone()),
        ..TlsConfig::default()
    };
    assert!(load(&config).unwrap().warnings().is_empty());
    fs::set_permissions(&psk, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let warnings = load(&config).unwrap().warnings().to_vec();
    assert!(
        matches!(&warnings[..], [LoadWarning::SecretReadableByOthers { path, .. }] if *path == psk)
    );
}

#[test]
fn an_expired_server_certificate_warns() {
    let pki = Pki::new();
    let dir = pki.server_dir(&pki.expired_client);
    let warnings = load(&x509(dir.path())).unwrap().warnings().to_vec();
    assert!(
        matches!(&warnings[..], [LoadWarning::CertificateExpired { .. }]),
        "{warnings:?}"
    );
}

#[test]
fn psk_file_errors_give_the_line_and_never_the_key() {
    let dir = TempDir::new().unwrap();
    let text = format!("alice:{PSK_ALICE}\nbob {PSK_BOB}\n");
    let path = write_pem(dir.path(), "keys.psk", text.as_bytes(), 0o600);
    let config = TlsConfig {
        mode: TlsMode::On,
        psk: Some(path),
        ..TlsConfig::default()
    };
    let err = load(&config).err().unwrap();
    assert!(matches!(
        err,
        TlsLoadError::PskLine {
            line: 2,
            problem: PskLineProblem::NoColon,
            ..
        }
    ));
    let shown = format!("{err} {err:?}");
    assert!(
        !shown.contains(&PSK_BOB[..8]) && !shown.contains(&PSK_ALICE[..8]),
        "{shown}"
    );
}

#[test]
fn the_tls_table_of_the_toml_config() {
    let config: TlsConfig = toml::from_str(
        r#"
        mode = "require"
        certificates = "/etc/zcnbd/tls"
        verify_peer = true
        authz = ["CN=client,O=Example"]
        "#,
    )
    .unwrap();
    assert_eq!(config.mode, TlsMode::Require);
    assert!(config.verify_peer && config.authz == [CLIENT_DN]);
    assert!(toml::from_str::<TlsConfig>("mode = \"maybe\"").is_err());
    assert!(toml::from_str::<TlsConfig>("psk_file = \"x\"").is_err());
    assert_eq!("on".parse::<TlsMode>().unwrap(), TlsMode::On);
    assert!("yes".parse::<TlsMode>().is_err());
}
