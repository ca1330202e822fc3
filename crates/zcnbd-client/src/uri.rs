//! NBD URIs (`nbd://host[:port]/export`, `nbd+unix:///export?socket=PATH`,
//! `nbd+vsock://CID[:port]/export`, and their TLS forms `nbds://`, `nbds+unix://`,
//! `nbds+vsock://`), as the NBD URI document defines them, with libnbd's
//! query keys for TLS (`tls-certificates=DIR`, `tls-psk-file=FILE` with the URI's user as
//! the PSK username, `tls-verify-peer=BOOL`, `tls-hostname=NAME`); parsing and
//! percent-decoding are the `url` crate's.

use std::path::PathBuf;

use url::Url;
use zcnbd_tls::TlsClientConfig;

use crate::error::{Error, Result};

/// The IANA-assigned NBD port, the default when the URI names none.
pub const NBD_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// TCP: host name or address, and port.
    Tcp { host: String, port: u16 },
    /// A Unix domain socket path.
    Unix(PathBuf),
    /// AF_VSOCK: context id (1: this machine through vsock_loopback, 2: a guest's host)
    /// and port.
    Vsock { cid: u32, port: u32 },
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// Where to connect.
    pub address: Address,
    /// The export name: the path without its leading `/`, percent-decoded.
    pub export: String,
    /// `nbds` schemes: TLS is required, with these settings (libnbd's defaults for what the
    /// URI leaves out are applied when connecting).
    pub tls: Option<TlsClientConfig>,
}

impl NbdUri {
    /// Parses `uri`.
    pub fn parse(uri: &str) -> Result<NbdUri> {
        let bad = |why: &str| Error::Uri {
            uri: uri.to_string(),
            why: why.to_string(),
        };
        let url = Url::parse(&unix_user_host(uri)).map_err(|e| bad(&e.to_string()))?;
        let (transport, tls) = match url.scheme() {
            "nbd" => ("tcp", false),
            "nbds" => ("tcp", true),
            "nbd+unix" => ("unix", false),
            "nbds+unix" => ("unix", true),
            "nbd+vsock" => ("vsock", false),
            "nbds+vsock" => ("vsock", true),
            other => return Err(bad(&format!("unknown scheme {other:?}"))),
        };
        let address = match transport {
            "tcp" => tcp_address(&url).ok_or_else(|| bad("nbd:// and nbds:// need a host"))?,
            "vsock" => vsock_address(&url).map_err(|why| bad(&why))?,
            _ => {
                let socket = query(&url, "socket")
                    .ok_or_else(|| bad("nbd+unix:// and nbds+unix:// need ?socket=PATH"))?;
                Address::Unix(PathBuf::from(socket))
            }
        };
        let tls = match tls {
            true => Some(tls_settings(&url).map_err(|why| bad(&why))?),
            false => None,
        };
        // "the path part of the URI except for the leading / character MUST be passed to
        // the server as the export name".
        let path = url.path();
        let path = path.strip_prefix('/').unwrap_or(path);
        let export = percent_decode(path).ok_or_else(|| bad("export name is not UTF-8"))?;
        Ok(NbdUri {
            address,
            export,
            tls,
        })
    }

    /// The name the server's certificate must carry: `tls-hostname`, else the URI's host
    /// (`localhost` for a Unix or vsock socket, whose "host" is no name).
    pub fn tls_hostname(&self) -> &str {
        let given = self.tls.as_ref().and_then(|t| t.hostname.as_deref());
        match (&self.address, given) {
            (_, Some(name)) => name,
            (Address::Tcp { host, .. }, None) => host,
            (Address::Unix(_) | Address::Vsock { .. }, None) => "localhost",
        }
    }
}

/// `nbds+unix://alice@/?socket=...` (libnbd's own example: a PSK username on a Unix
/// socket) has a user but no host, which the URL standard refuses; a Unix URI's host means
/// nothing, so `localhost` is put in for the parser.
fn unix_user_host(uri: &str) -> std::borrow::Cow<'_, str> {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.into();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    if scheme.ends_with("+unix") && authority.ends_with('@') {
        format!("{scheme}://{authority}localhost{tail}").into()
    } else {
        uri.into()
    }
}

/// The value of query key `key`, percent-decoded (the last one, if repeated).
fn query(url: &Url, key: &str) -> Option<String> {
    url.query_pairs()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
        .last()
}

/// libnbd's TLS keys. Keys it does not know are ignored, as libnbd ignores them.
fn tls_settings(url: &Url) -> std::result::Result<TlsClientConfig, String> {
    let verify_peer = match query(url, "tls-verify-peer") {
        None => true,
        Some(v) => parse_bool(&v)
            .ok_or_else(|| format!("tls-verify-peer={v:?}: expected true or false"))?,
    };
    let username = match url.username() {
        "" => None,
        user => Some(percent_decode(user).ok_or("the username is not UTF-8")?),
    };
    Ok(TlsClientConfig {
        certificates: query(url, "tls-certificates").map(PathBuf::from),
        psk_file: query(url, "tls-psk-file").map(PathBuf::from),
        username,
        verify_peer,
        hostname: query(url, "tls-hostname").filter(|h| !h.is_empty()),
        version_max: None,
    })
}

/// The booleans libnbd's URI parser takes.
fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn tcp_address(url: &Url) -> Option<Address> {
    let host = url.host_str().filter(|h| !h.is_empty())?;
    // An IPv6 literal comes back bracketed; the resolver wants it bare.
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    Some(Address::Tcp {
        host,
        port: url.port().unwrap_or(NBD_PORT),
    })
}

/// `nbd+vsock://CID[:PORT]`: the CID is a number (libnbd's form; no names).
fn vsock_address(url: &Url) -> std::result::Result<Address, String> {
    let host = url.host_str().filter(|h| !h.is_empty());
    let host = host.ok_or("nbd+vsock:// and nbds+vsock:// need a CID (1: this machine)")?;
    let cid = host
        .parse::<u32>()
        .map_err(|_| format!("vsock CID {host:?} is not a number from 0 to 4294967295"))?;
    Ok(Address::Vsock {
        cid,
        port: url.port().map_or(u32::from(NBD_PORT), u32::from),
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let decoded = percent_encoding::percent_decode_str(s).decode_utf8().ok()?;
    Some(decoded.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(uri: &str) -> NbdUri {
        NbdUri::parse(uri).unwrap_or_else(|e| panic!("{uri}: {e}"))
    }

    #[test]
    fn export_names_follow_the_uri_document_table() {
        let cases = [
            ("nbd://example.com/disk", "disk"),
            ("nbd+unix:///disk?socket=sock", "disk"),
            ("nbd://example.com/", ""),
            ("nbd://example.com", ""),
            ("nbd://example.com//disk", "/disk"),
            ("nbd://example.com/hello%20world", "hello world"),
            ("nbd://example.com/a+b", "a+b"),
        ];
        for (uri, export) in cases {
            assert_eq!(parse(uri).export, export, "{uri}");
        }
    }

    #[test]
    fn addresses() {
        assert_eq!(
            parse("nbd://example.com/x").address,
            Address::Tcp {
                host: "example.com".into(),
                port: NBD_PORT
            }
        );
        assert_eq!(
            parse("nbd://127.0.0.1:1234").address,
            Address::Tcp {
                host: "127.0.0.1".into(),
                port: 1234
            }
        );
        assert_eq!(
            parse("nbd://[::1]:99/").address,
            Address::Tcp {
                host: "::1".into(),
                port: 99
            }
        );
        assert_eq!(
            parse("nbd+unix:///e?socket=/tmp/a%20b.sock").address,
            Address::Unix("/tmp/a b.sock".into())
        );
        let vsock = parse("nbd+vsock://1/disk");
        assert_eq!(
            vsock.address,
            Address::Vsock {
                cid: 1,
                port: u32::from(NBD_PORT)
            }
        );
        assert_eq!(vsock.export, "disk");
        assert_eq!(
            parse("nbd+vsock://4294967295:2000").address,
            Address::Vsock {
                cid: u32::MAX,
                port: 2000
            }
        );
        let tls = parse("nbds+vsock://3/?tls-certificates=/c");
        assert!(tls.tls.is_some());
        assert_eq!(tls.tls_hostname(), "localhost");
    }

    #[test]
    fn tls_uris_carry_libnbd_keys() {
        let plain = parse("nbd://example.com/x?tls-certificates=/etc/x");
        assert_eq!(plain.tls, None);
        let x509 = parse("nbds://example.com:99/x?tls-certificates=/etc/a%20b");
        let tls = x509.tls.clone().expect("nbds is TLS");
        assert_eq!(tls.certificates, Some(PathBuf::from("/etc/a b")));
        assert!(tls.verify_peer && tls.psk_file.is_none() && tls.username.is_none());
        assert_eq!(x509.tls_hostname(), "example.com");
        assert_eq!(x509.export, "x");
        let psk =
            parse("nbds+unix://alice@/e?socket=/s&tls-psk-file=keys.psk&tls-verify-peer=false");
        let tls = psk.tls.clone().expect("nbds+unix is TLS");
        assert_eq!(psk.address, Address::Unix("/s".into()));
        assert_eq!(tls.psk_file, Some(PathBuf::from("keys.psk")));
        assert_eq!(tls.username.as_deref(), Some("alice"));
        assert!(!tls.verify_peer);
        assert_eq!(psk.tls_hostname(), "localhost");
        let named = parse("nbds://127.0.0.1/?tls-hostname=server.example");
        assert_eq!(named.tls_hostname(), "server.example");
        let e = NbdUri::parse("nbds://h/?tls-verify-peer=maybe").expect_err("bad bool");
        assert!(e.to_string().contains("tls-verify-peer"), "{e}");
        assert!(NbdUri::parse("nbds+unix:///x").is_err());
    }

    #[test]
    fn refusals_are_clear() {
        let e = NbdUri::parse("nbd+unix:///x").expect_err("no socket");
        assert!(e.to_string().contains("socket"), "{e}");
        assert!(NbdUri::parse("http://example.com/").is_err());
        assert!(NbdUri::parse("nbd:///x").is_err());
        assert!(NbdUri::parse("not a uri").is_err());
        let e = NbdUri::parse("nbd+vsock:///x").expect_err("no CID");
        assert!(e.to_string().contains("need a CID"), "{e}");
        let e = NbdUri::parse("nbd+vsock://host/").expect_err("a name");
        assert!(e.to_string().contains("not a number"), "{e}");
        assert!(NbdUri::parse("nbd+vsock://4294967296/").is_err());
    }
}
