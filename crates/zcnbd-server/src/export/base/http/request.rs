//! A request's head, sans-IO: written into a buffer the connection owns (no allocation once
//! it has grown). `Accept-Encoding: identity` asks for the bytes as they are on the server.

use std::io::Write;

use super::spec::HttpHeader;
use super::url::Url;

/// What is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The size, without the body.
    Head,
    /// The bytes `first..=last`.
    Range { first: u64, last: u64 },
}

/// Writes the request for `url` into `out` (cleared first), with `extra` fields after
/// zcnbd's own (`Host` and `User-Agent` left out where `extra` has them).
pub fn write_request(method: Method, url: &Url, extra: &[HttpHeader], out: &mut Vec<u8>) {
    out.clear();
    let has = |name: &str| extra.iter().any(|h| h.name.eq_ignore_ascii_case(name));
    let verb = match method {
        Method::Head => "HEAD",
        Method::Range { .. } => "GET",
    };
    // Writing to a Vec cannot fail.
    let _ = write!(out, "{verb} {} HTTP/1.1\r\n", url.target);
    if !has("host") {
        let _ = write!(out, "Host: {}\r\n", url.host_field());
    }
    if !has("user-agent") {
        let _ = write!(out, "User-Agent: zcnbd/{}\r\n", env!("CARGO_PKG_VERSION"));
    }
    out.extend_from_slice(b"Accept-Encoding: identity\r\n");
    if let Method::Range { first, last } = method {
        let _ = write!(out, "Range: bytes={first}-{last}\r\n");
    }
    for field in extra {
        let _ = write!(out, "{}: {}\r\n", field.name, field.value);
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_the_range_the_host_and_the_extra_fields() {
        let url = Url::parse("http://[::1]:8080/d/disk.img?t=1").unwrap();
        let auth = HttpHeader::parse("Authorization: Bearer x").unwrap();
        let mut out = Vec::new();
        write_request(
            Method::Range {
                first: 512,
                last: 1023,
            },
            &url,
            &[auth],
            &mut out,
        );
        let text = String::from_utf8(out.clone()).unwrap();
        assert!(
            text.starts_with("GET /d/disk.img?t=1 HTTP/1.1\r\nHost: [::1]:8080\r\n"),
            "{text}"
        );
        assert!(text.contains("\r\nRange: bytes=512-1023\r\n"), "{text}");
        assert!(text.ends_with("Authorization: Bearer x\r\n\r\n"), "{text}");
        let host = HttpHeader::parse("Host: other").unwrap();
        write_request(Method::Head, &url, &[host], &mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("HEAD /d/disk.img?t=1 HTTP/1.1\r\n"),
            "{text}"
        );
        assert_eq!(text.matches("Host:").count(), 1, "{text}");
        assert!(!text.contains("Range"), "{text}");
    }
}
