//! What an HTTP(S) export is made of, from the command line or a TOML table: the URL, the
//! connections, the extra header fields (secrets: their values appear in no `Debug`, log or
//! error), the CA file or no verification at all, and the timeout.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::url::{Url, UrlError};

/// Connections to the web server unless configured (`--http-connections`), as nbdkit's curl
/// plugin has.
pub const HTTP_CONNECTIONS_DEFAULT: usize = 4;
/// The most connections to one web server.
pub const HTTP_CONNECTIONS_MAX: usize = 64;
/// How long connecting, a response's head, or any wait for body bytes may take unless
/// configured (`--http-timeout`).
pub const HTTP_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// The most `--http-header` fields.
pub const HTTP_HEADERS_MAX: usize = 32;
/// The longest `--http-header` field, name and value.
pub const HTTP_HEADER_BYTES_MAX: usize = 8 << 10;

/// Why an HTTP source's settings are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpSpecError {
    /// The URL does not parse.
    #[error("{url}: {why}")]
    Url { url: String, why: UrlError },
    /// A header field is not `Name: value` with a token name and a value without line breaks.
    #[error("--http-header {name:?}: write \"Name: value\" (a token name, no line breaks, at most {HTTP_HEADER_BYTES_MAX} bytes)")]
    Header { name: String },
    /// A field zcnbd writes itself, which the framing of its requests depends on.
    #[error("--http-header {0:?}: zcnbd writes this field itself")]
    ReservedHeader(String),
    /// More than `HTTP_HEADERS_MAX` fields.
    #[error("at most {HTTP_HEADERS_MAX} --http-header fields (HTTP_HEADERS_MAX)")]
    TooManyHeaders,
    /// A connection count of 0 or over the maximum.
    #[error("--http-connections: 1 to {HTTP_CONNECTIONS_MAX} (HTTP_CONNECTIONS_MAX)")]
    Connections,
    /// A zero timeout.
    #[error("--http-timeout must be more than 0")]
    Timeout,
    /// Both a CA file and no verification.
    #[error("--http-cafile and --http-insecure do not go together")]
    Verification,
}

/// An extra request header field (`--http-header "Name: value"`). Its `Debug` shows the name
/// only: values are tokens.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpHeader {
    pub name: String,
    pub value: String,
}

impl fmt::Debug for HttpHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: <{} bytes>", self.name, self.value.len())
    }
}

/// Fields whose meaning the request's framing depends on (`Host` and `User-Agent` may be
/// replaced).
const RESERVED_FIELDS: &[&str] = &[
    "range",
    "content-length",
    "transfer-encoding",
    "connection",
    "te",
    "upgrade",
    "expect",
];

impl HttpHeader {
    /// Parses `Name: value`. The error names the field's name, never its value.
    pub fn parse(text: &str) -> Result<HttpHeader, HttpSpecError> {
        let (name, value) = text.split_once(':').unwrap_or((text, ""));
        let name = name.trim();
        let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        let is_name = text.contains(':') && !name.is_empty() && name.chars().all(token);
        // Only a well-formed name is shown: text without a colon, or a "name" with spaces,
        // may be the token itself.
        let shown = || match is_name {
            true => name.chars().take(64).collect::<String>(),
            false => "(not \"Name: value\")".to_owned(),
        };
        let value = value.trim_matches([' ', '\t']);
        let value_ok = value
            .chars()
            .all(|c| c == '\t' || (c >= ' ' && c != '\u{7f}'));
        if !is_name || text.len() > HTTP_HEADER_BYTES_MAX || !value_ok {
            return Err(HttpSpecError::Header { name: shown() });
        }
        if RESERVED_FIELDS.iter().any(|r| name.eq_ignore_ascii_case(r)) {
            return Err(HttpSpecError::ReservedHeader(name.to_owned()));
        }
        Ok(HttpHeader {
            name: name.to_owned(),
            value: value.to_owned(),
        })
    }
}

/// A TOML `http_timeout`: the command line's syntax (a number with `ms`, `s` or `m`, or bare
/// seconds: `500ms`, `30s`, `2m`, `30`).
pub fn parse_timeout(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, scale) = [("ms", 1e-3), ("s", 1.0), ("m", 60.0)]
        .iter()
        .find_map(|(unit, scale)| text.strip_suffix(unit).map(|n| (n, *scale)))
        .unwrap_or((text, 1.0));
    let seconds: f64 = number.trim().parse().ok()?;
    let seconds = seconds * scale;
    (seconds.is_finite() && seconds > 0.0 && seconds < 1e9)
        .then(|| Duration::from_secs_f64(seconds))
}

/// An HTTP(S) export's settings.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpSpec {
    /// The URL as given (it may hold a token in its query: log [`HttpSpec::redacted`]).
    pub url: String,
    /// Connections kept to the server.
    pub connections: usize,
    /// Extra request fields, sent to the URL's origin only (not to another host a redirect
    /// leads to).
    pub headers: Vec<HttpHeader>,
    /// CA certificates (PEM) that verify an `https` server, instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// No verification of an `https` server's certificate or name.
    pub insecure: bool,
    /// Connecting, a response's head, and each wait for body bytes.
    pub timeout: Duration,
}

impl HttpSpec {
    /// Settings for `url` with the defaults.
    pub fn new(url: &str) -> HttpSpec {
        HttpSpec {
            url: url.to_owned(),
            connections: HTTP_CONNECTIONS_DEFAULT,
            headers: Vec::new(),
            ca_file: None,
            insecure: false,
            timeout: HTTP_TIMEOUT_DEFAULT,
        }
    }

    /// The URL, parsed.
    pub fn parsed_url(&self) -> Result<Url, HttpSpecError> {
        Url::parse(&self.url).map_err(|why| HttpSpecError::Url {
            url: self.redacted(),
            why,
        })
    }

    /// Everything checked that can be without the network.
    pub fn check(&self) -> Result<(), HttpSpecError> {
        self.parsed_url()?;
        if self.connections == 0 || self.connections > HTTP_CONNECTIONS_MAX {
            return Err(HttpSpecError::Connections);
        }
        if self.headers.len() > HTTP_HEADERS_MAX {
            return Err(HttpSpecError::TooManyHeaders);
        }
        if self.timeout.is_zero() {
            return Err(HttpSpecError::Timeout);
        }
        if self.ca_file.is_some() && self.insecure {
            return Err(HttpSpecError::Verification);
        }
        Ok(())
    }

    /// The URL for logs (no query; see `Url::redacted`); a URL that does not parse is
    /// shown up to its query.
    pub fn redacted(&self) -> String {
        match Url::parse(&self.url) {
            Ok(url) => url.redacted(),
            Err(_) => redact_unparsed(&self.url),
        }
    }

    /// What the log says of the source: the URL and how it is reached.
    pub fn describe(&self) -> String {
        let mut text = format!("{}, {} connection(s)", self.redacted(), self.connections);
        if !self.headers.is_empty() {
            text.push_str(&format!(", {} header(s)", self.headers.len()));
        }
        if self.insecure {
            text.push_str(", TLS unverified");
        }
        text
    }
}

/// A URL that does not parse, for an error message: up to its query, without credentials.
fn redact_unparsed(url: &str) -> String {
    let cut = url.find(['?', '#']).unwrap_or(url.len());
    let mut shown = url[..cut].to_owned();
    let after_scheme = shown.find("://").map_or(0, |i| i + 3);
    if let Some(at) = shown.rfind('@').filter(|at| *at >= after_scheme) {
        shown.replace_range(after_scheme..=at, "…@");
    }
    if cut < url.len() {
        shown.push_str("?…");
    }
    shown
}

impl fmt::Debug for HttpSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpSpec")
            .field("url", &self.redacted())
            .field("connections", &self.connections)
            .field("headers", &self.headers)
            .field("ca_file", &self.ca_file)
            .field("insecure", &self.insecure)
            .field("timeout", &self.timeout)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_and_bad_ones_are_refused_without_their_value() {
        let h = HttpHeader::parse("Authorization:  Bearer s3cret ").unwrap();
        assert_eq!(
            (h.name.as_str(), h.value.as_str()),
            ("Authorization", "Bearer s3cret")
        );
        assert!(!format!("{h:?}").contains("s3cret"));
        assert_eq!(HttpHeader::parse("X-Empty:").unwrap().value, "");
        for bad in [
            "no colon",
            ": v",
            "Bad Name: v",
            "X: a\r\nInjected: b",
            "X: a\nb",
            "Ü: v",
        ] {
            let e = HttpHeader::parse(bad).unwrap_err();
            assert!(matches!(e, HttpSpecError::Header { .. }), "{bad:?}");
        }
        for leaky in [
            "X: secret\r\n",
            "Authorization Bearer secret",
            "secret",
            "a b: secret",
        ] {
            let e = HttpHeader::parse(leaky).unwrap_err().to_string();
            assert!(!e.contains("secret"), "{e}");
        }
        assert!(matches!(
            HttpHeader::parse("range: bytes=0-1"),
            Err(HttpSpecError::ReservedHeader(_))
        ));
        assert!(HttpHeader::parse("Host: other").is_ok());
    }

    #[test]
    fn specs_are_checked_and_never_show_secrets() {
        let mut spec = HttpSpec::new("https://h/d.img?sig=tok3n");
        spec.headers
            .push(HttpHeader::parse("Authorization: Bearer s3cret").unwrap());
        assert_eq!(spec.check(), Ok(()));
        let shown = format!("{spec:?} {}", spec.describe());
        assert!(
            !shown.contains("tok3n") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(spec.describe().contains("1 header(s)"));
        for bad in [
            HttpSpec {
                connections: 0,
                ..spec.clone()
            },
            HttpSpec {
                connections: HTTP_CONNECTIONS_MAX + 1,
                ..spec.clone()
            },
            HttpSpec {
                timeout: Duration::ZERO,
                ..spec.clone()
            },
            HttpSpec {
                ca_file: Some("/ca.pem".into()),
                insecure: true,
                ..spec.clone()
            },
            HttpSpec::new("http://u:pw@h/x"),
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert_eq!(parse_timeout("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_timeout("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_timeout("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_timeout("30"), Some(Duration::from_secs(30)));
        for bad in ["", "0", "-1s", "soon", "1h", "inf"] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
        let bad = HttpSpec::new("http://u:pw@h/x?k");
        assert_eq!(bad.redacted(), "http://…@h/x?…");
    }
}
