//! The server's TLS settings, named as nbdkit names its flags (`--tls`, `--tls-certificates`,
//! `--tls-verify-peer`, `--tls-psk`) plus qemu-nbd's `--tls-authz`, and the same in the
//! `[tls]` table of the TOML `--config`:
//!
//! ```toml
//! [tls]
//! mode = "require"                 # off | on | require
//! certificates = "/etc/zcnbd/tls"  # ca-cert.pem, server-cert.pem, server-key.pem
//! verify_peer = true               # ask for a client certificate signed by ca-cert.pem
//! authz = ["CN=client,O=Example"]  # allowed client subjects (or PSK usernames)
//! # psk = "/etc/zcnbd/keys.psk"    # instead of certificates: psktool's username:hexkey
//! ktls = "auto"                    # auto | off: let the kernel encrypt what is sent
//! ```

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Deserialize;

use crate::acceptor::TlsServer;
use crate::error::TlsLoadError;

/// Whether a client may, or must, switch to TLS (NBD_OPT_STARTTLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// No TLS; STARTTLS is refused.
    #[default]
    Off,
    /// TLS offered; a client may also go on in plain text.
    On,
    /// Every option but STARTTLS (and ABORT) is refused until TLS is up.
    Require,
}

impl FromStr for TlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("--tls: expected off, on or require, not {s:?}")),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

/// Whether the kernel may take over sending TLS records (kTLS), `--tls-ktls`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KtlsMode {
    /// Where the kernel has kTLS and the negotiated cipher suits it (a log line at start
    /// says whether the kernel has it).
    #[default]
    Auto,
    /// Never: every record is made in user space.
    Off,
}

impl FromStr for KtlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(KtlsMode::Auto),
            "off" => Ok(KtlsMode::Off),
            _ => Err(format!("--tls-ktls: expected auto or off, not {s:?}")),
        }
    }
}

/// The server's TLS settings as given; [`TlsConfig::load`] checks them and reads the files.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// `--tls`.
    pub mode: TlsMode,
    /// `--tls-certificates DIR`: `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    pub certificates: Option<PathBuf>,
    /// `--tls-verify-peer`: require a client certificate signed by `ca-cert.pem`.
    pub verify_peer: bool,
    /// `--tls-authz NAME...`: only these client certificate subjects (in GnuTLS's RFC 4514
    /// form, see `dn.rs`) or, with PSK, these usernames may connect. Empty: anyone the
    /// credentials let in.
    pub authz: Vec<String>,
    /// `--tls-psk FILE`: psktool's `username:hexkey` lines.
    pub psk: Option<PathBuf>,
    /// `--tls-ktls`: whether the kernel may encrypt what is sent.
    pub ktls: KtlsMode,
}

impl TlsConfig {
    /// Whether the settings restrict which clients may connect (`--tls-authz`,
    /// `--tls-verify-peer`): then TLS must be required.
    pub fn restricts_clients(&self) -> bool {
        self.verify_peer || !self.authz.is_empty()
    }

    /// Checks the settings, reads and checks every file, logs each warning, and builds the
    /// server's TLS context. `Ok(None)` when the mode is off. Fails at start, never at a
    /// client's handshake, for a missing or unreadable file, a key that does not match its
    /// certificate, a malformed PSK file, or settings that contradict each other.
    pub fn load(&self) -> Result<Option<TlsServer>, TlsLoadError> {
        // A restriction on who may connect means nothing if anyone may connect without TLS
        // (qemu-nbd makes TLS mandatory once it is configured).
        if self.restricts_clients() && self.mode != TlsMode::Require {
            return Err(TlsLoadError::RestrictionBypassed(self.mode));
        }
        if self.mode == TlsMode::Off {
            return Ok(None);
        }
        let server = TlsServer::load(self)?;
        for warning in server.warnings() {
            tracing::warn!("TLS: {warning}");
        }
        Ok(Some(server))
    }
}
