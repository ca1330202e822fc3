//! NBD URIs (`nbd://host[:port]/export`, `nbd+unix:///export?socket=PATH`), as the NBD URI
//! document defines them; parsing and percent-decoding are the `url` crate's.

use std::path::PathBuf;

use url::Url;

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
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// Where to connect.
    pub address: Address,
    /// The export name: the path without its leading `/`, percent-decoded.
    pub export: String,
}

impl NbdUri {
    /// Parses `uri`; `nbds://` and `nbds+unix://` answer [`Error::TlsUnsupported`].
    pub fn parse(uri: &str) -> Result<NbdUri> {
        let bad = |why: &str| Error::Uri {
            uri: uri.to_string(),
            why: why.to_string(),
        };
        let url = Url::parse(uri).map_err(|e| bad(&e.to_string()))?;
        let address = match url.scheme() {
            "nbd" => tcp_address(&url).ok_or_else(|| bad("nbd:// needs a host"))?,
            "nbd+unix" => {
                let socket = url
                    .query_pairs()
                    .find(|(k, _)| k == "socket")
                    .map(|(_, v)| v.into_owned())
                    .ok_or_else(|| bad("nbd+unix:// needs ?socket=PATH"))?;
                Address::Unix(PathBuf::from(socket))
            }
            "nbds" | "nbds+unix" => return Err(Error::TlsUnsupported(uri.to_string())),
            "nbd+vsock" | "nbds+vsock" => return Err(bad("vsock is not supported")),
            other => return Err(bad(&format!("unknown scheme {other:?}"))),
        };
        // "the path part of the URI except for the leading / character MUST be passed to
        // the server as the export name".
        let path = url.path();
        let path = path.strip_prefix('/').unwrap_or(path);
        let export = percent_decode(path).ok_or_else(|| bad("export name is not UTF-8"))?;
        Ok(NbdUri { address, export })
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
    }

    #[test]
    fn refusals_are_clear() {
        assert!(matches!(
            NbdUri::parse("nbds://example.com/x"),
            Err(Error::TlsUnsupported(_))
        ));
        let e = NbdUri::parse("nbd+unix:///x").expect_err("no socket");
        assert!(e.to_string().contains("socket"), "{e}");
        assert!(NbdUri::parse("http://example.com/").is_err());
        assert!(NbdUri::parse("nbd:///x").is_err());
        assert!(NbdUri::parse("not a uri").is_err());
    }
}
