//! HTTP(S) URLs, parsed by hand (RFC 3986, the part an HTTP source needs): the scheme, the
//! host (a name, an IPv4 address or a bracketed IPv6 literal), the port, and the request
//! target (path and query). A redirect's `Location` is resolved against the URL it came from.
//! Credentials in a URL (`user:pass@`) are refused: `--http-header` carries them, so that
//! nothing secret is ever part of a string that is logged. Logs show [`Url::redacted`], which
//! leaves out the query (a presigned URL's signature lives there).

use std::fmt;
use std::net::Ipv6Addr;

/// The longest URL accepted (and the longest `Location` followed).
pub const URL_BYTES_MAX: usize = 8 << 10;

/// Why a URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not `http://` or `https://`.
    #[error("not an http:// or https:// URL")]
    Scheme,
    /// Longer than `URL_BYTES_MAX`.
    #[error("longer than {URL_BYTES_MAX} bytes (URL_BYTES_MAX)")]
    TooLong,
    /// `user:password@` in the URL.
    #[error(
        "credentials in the URL are not taken: give them with --http-header \"Authorization: ...\""
    )]
    UserInfo,
    /// No host, or one with characters a host cannot have.
    #[error("a bad host")]
    Host,
    /// A port that is not a number from 1 to 65535.
    #[error("a bad port")]
    Port,
    /// Spaces, control characters or non-ASCII bytes (write them percent-encoded).
    #[error("characters a URL cannot hold (spaces, controls, non-ASCII: percent-encode them)")]
    Characters,
}

/// `http` or `https`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    fn name(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }

    fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

/// Where requests go: connections are shared by the URLs of one origin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub scheme: Scheme,
    /// A name (lower case) or an IP address, without brackets.
    pub host: String,
    pub port: u16,
}

/// An HTTP(S) URL.
#[derive(Clone, PartialEq, Eq)]
pub struct Url {
    pub origin: Origin,
    /// Path and query, starting with `/`; the fragment is dropped.
    pub target: String,
}

/// Whether `text` names an HTTP(S) source (rather than a file).
pub fn is_http_url(text: &str) -> bool {
    strip_scheme(text).is_some()
}

fn strip_scheme(text: &str) -> Option<(Scheme, &str)> {
    let prefixed = |prefix: &str| {
        let head = text.get(..prefix.len())?;
        head.eq_ignore_ascii_case(prefix)
            .then(|| &text[prefix.len()..])
    };
    match prefixed("http://") {
        Some(rest) => Some((Scheme::Http, rest)),
        None => prefixed("https://").map(|rest| (Scheme::Https, rest)),
    }
}

/// Printable ASCII but space: what a URL may hold unencoded.
fn url_chars(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_graphic())
}

impl Url {
    /// Parses an absolute `http://` or `https://` URL.
    pub fn parse(text: &str) -> Result<Url, UrlError> {
        if text.len() > URL_BYTES_MAX {
            return Err(UrlError::TooLong);
        }
        let (scheme, rest) = strip_scheme(text).ok_or(UrlError::Scheme)?;
        if !url_chars(rest) {
            return Err(UrlError::Characters);
        }
        let rest = rest.split('#').next().unwrap_or_default();
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, target) = rest.split_at(authority_end);
        if authority.contains('@') {
            return Err(UrlError::UserInfo);
        }
        let (host, port) = split_authority(authority)?;
        let port = match port {
            None | Some("") => scheme.default_port(),
            Some(p) => parse_port(p)?,
        };
        let target = match target.strip_prefix('?') {
            Some(query) => format!("/?{query}"),
            None if target.is_empty() => "/".to_owned(),
            None => target.to_owned(),
        };
        Ok(Url {
            origin: Origin { scheme, host, port },
            target: remove_dot_segments(&target),
        })
    }

    /// Where a redirect to `location` (a `Location` field's value) leads from here.
    pub fn resolve(&self, location: &str) -> Result<Url, UrlError> {
        let location = location.trim();
        if location.len() > URL_BYTES_MAX {
            return Err(UrlError::TooLong);
        }
        if !url_chars(location) {
            return Err(UrlError::Characters);
        }
        if strip_scheme(location).is_some() {
            return Url::parse(location);
        }
        if location.starts_with("//") {
            return Url::parse(&format!("{}:{location}", self.origin.scheme.name()));
        }
        if has_other_scheme(location) {
            return Err(UrlError::Scheme);
        }
        let location = location.split('#').next().unwrap_or_default();
        let path = self.path();
        let target = if location.starts_with('/') {
            location.to_owned()
        } else if location.starts_with('?') {
            format!("{path}{location}")
        } else if location.is_empty() {
            self.target.clone()
        } else {
            let directory = &path[..path.rfind('/').map_or(0, |i| i + 1)];
            format!("{directory}{location}")
        };
        Ok(Url {
            origin: self.origin.clone(),
            target: remove_dot_segments(&target),
        })
    }

    /// The path, without the query.
    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("/")
    }

    /// The `Host` field's value: the host (an IPv6 address in brackets), and the port unless
    /// it is the scheme's.
    pub fn host_field(&self) -> String {
        let o = &self.origin;
        let host = bracketed(&o.host);
        match o.port == o.scheme.default_port() {
            true => host,
            false => format!("{host}:{}", o.port),
        }
    }

    /// The URL for logs: scheme, host, port and path; a query is shown as `?…`.
    pub fn redacted(&self) -> String {
        let query = if self.target.contains('?') {
            "?…"
        } else {
            ""
        };
        format!(
            "{}://{}{}{query}",
            self.origin.scheme.name(),
            self.host_field(),
            self.path()
        )
    }
}

/// Never the query: the `Debug` form is the redacted one, so a URL in a logged structure
/// leaks no token.
impl fmt::Debug for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

fn bracketed(host: &str) -> String {
    match host.contains(':') {
        true => format!("[{host}]"),
        false => host.to_owned(),
    }
}

/// Whether `location` starts with a scheme other than HTTP's (`ftp:`, `file:`): letters,
/// digits, `+`, `-`, `.` up to a colon before any `/`, `?`.
fn has_other_scheme(location: &str) -> bool {
    let Some(colon) = location.find(':') else {
        return false;
    };
    let head = &location[..colon];
    head.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && head
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
}

/// The host (lower case, IPv6 without brackets) and the port's text if any.
fn split_authority(authority: &str) -> Result<(String, Option<&str>), UrlError> {
    if let Some(inner) = authority.strip_prefix('[') {
        let (literal, after) = inner.split_once(']').ok_or(UrlError::Host)?;
        let address: Ipv6Addr = literal.parse().map_err(|_| UrlError::Host)?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or(UrlError::Port)?),
        };
        return Ok((address.to_string(), port));
    }
    let (host, port) = match authority.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    };
    let host_char = |c: char| c.is_ascii_alphanumeric() || "-._".contains(c);
    if host.is_empty() || !host.chars().all(host_char) {
        return Err(UrlError::Host);
    }
    Ok((host.to_ascii_lowercase(), port))
}

fn parse_port(text: &str) -> Result<u16, UrlError> {
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(UrlError::Port);
    }
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err(UrlError::Port),
        Ok(port) => Ok(port),
    }
}

/// RFC 3986 5.2.4: `.` and `..` segments of the path removed (the query kept as it is).
fn remove_dot_segments(target: &str) -> String {
    let (path, query) = match target.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (target, None),
    };
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    for (i, segment) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        match *segment {
            "." if last => out.push(""),
            "." => {}
            ".." => {
                out.pop();
                if last {
                    out.push("");
                }
            }
            other => out.push(other),
        }
    }
    let mut result = String::with_capacity(target.len());
    for segment in &out {
        result.push('/');
        result.push_str(segment);
    }
    if result.is_empty() {
        result.push('/');
    }
    if let Some(query) = query {
        result.push('?');
        result.push_str(query);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> Url {
        Url::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn hosts_ports_and_targets() {
        let u = url("http://Example.COM/disk.img");
        assert_eq!(u.origin.scheme, Scheme::Http);
        assert_eq!((u.origin.host.as_str(), u.origin.port), ("example.com", 80));
        assert_eq!(u.target, "/disk.img");
        assert_eq!(u.host_field(), "example.com");
        let u = url("HTTPS://h:8443");
        assert_eq!((u.origin.scheme, u.origin.port), (Scheme::Https, 8443));
        assert_eq!(
            (u.target.as_str(), u.host_field().as_str()),
            ("/", "h:8443")
        );
        let u = url("https://h:443/a?x=1&sig=secret#frag");
        assert_eq!(
            (u.target.as_str(), u.host_field().as_str()),
            ("/a?x=1&sig=secret", "h")
        );
        assert_eq!(url("http://h?q").target, "/?q");
        assert_eq!(url("http://h:/x").origin.port, 80);
        assert_eq!(url("http://10.0.0.1:81/x").host_field(), "10.0.0.1:81");
    }

    #[test]
    fn ipv6_literals() {
        let u = url("http://[::1]:8080/d");
        assert_eq!((u.origin.host.as_str(), u.origin.port), ("::1", 8080));
        assert_eq!(u.host_field(), "[::1]:8080");
        assert_eq!(url("https://[2001:DB8::1]/").host_field(), "[2001:db8::1]");
        assert_eq!(url("http://[::1]/d").redacted(), "http://[::1]/d");
        for bad in [
            "http://[::1/x",
            "http://[zz]/",
            "http://[::1]x/",
            "http://[::1]:x/",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_urls_are_refused() {
        let refused = |text: &str, why: UrlError| assert_eq!(Url::parse(text), Err(why), "{text}");
        refused("ftp://h/x", UrlError::Scheme);
        refused("disk.img", UrlError::Scheme);
        refused("http://user:pw@h/x", UrlError::UserInfo);
        refused("http:///x", UrlError::Host);
        refused("http://h%41/x", UrlError::Host);
        refused("http://h:0/", UrlError::Port);
        refused("http://h:65536/", UrlError::Port);
        refused("http://h:+80/", UrlError::Port);
        refused("http://h:8x/", UrlError::Port);
        refused("http://h/a b", UrlError::Characters);
        refused("http://h/a\r\nX: y", UrlError::Characters);
        refused("http://h/é", UrlError::Characters);
        let long = format!("http://h/{}", "a".repeat(URL_BYTES_MAX));
        refused(&long, UrlError::TooLong);
        assert!(is_http_url("HTTP://x") && is_http_url("https://x"));
        assert!(!is_http_url("nbd://x") && !is_http_url("http.img") && !is_http_url("h"));
    }

    #[test]
    fn logs_never_show_the_query() {
        let u = url("https://bucket.s3:9000/d/disk.img?X-Amz-Signature=abc&X-Amz-Credential=k");
        assert_eq!(u.redacted(), "https://bucket.s3:9000/d/disk.img?…");
        assert_eq!(format!("{u:?}"), u.redacted());
        assert!(!format!("{u}").contains("abc"));
    }

    #[test]
    fn redirects_resolve_against_the_url() {
        let base = url("https://h:8443/a/b/disk.img?t=1");
        let at = |loc: &str| base.resolve(loc).unwrap();
        assert_eq!(at("http://o/x"), url("http://o/x"));
        assert_eq!(at("//cdn:81/y?z"), url("https://cdn:81/y?z"));
        assert_eq!(at("/root/z"), url("https://h:8443/root/z"));
        assert_eq!(at("other.img"), url("https://h:8443/a/b/other.img"));
        assert_eq!(at("../c/d.img?s=2"), url("https://h:8443/a/c/d.img?s=2"));
        assert_eq!(at("../../../../x"), url("https://h:8443/x"));
        assert_eq!(at("./"), url("https://h:8443/a/b/"));
        assert_eq!(at("?t=2"), url("https://h:8443/a/b/disk.img?t=2"));
        assert_eq!(at("  /sp  "), url("https://h:8443/sp"));
        assert_eq!(base.resolve("ftp://h/x"), Err(UrlError::Scheme));
        assert_eq!(base.resolve("file:/etc/passwd"), Err(UrlError::Scheme));
        assert_eq!(base.resolve("/a\r\nb"), Err(UrlError::Characters));
        assert_eq!(base.resolve("http://u@h/"), Err(UrlError::UserInfo));
    }
}
