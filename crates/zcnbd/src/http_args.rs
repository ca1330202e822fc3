//! The `--http-*` options of `zcnbd serve` and `zcnbd attach`, for a source that is an
//! `http://` or `https://` URL (nbdkit's curl plugin), and the settings they make.

use std::path::PathBuf;
use std::time::Duration;

use zcnbd_server::{HttpHeader, HttpSpec};

use crate::units;

/// `--http-timeout`'s default as the option shows it (a test checks it is the server's).
const HTTP_TIMEOUT_DEFAULT: &str = "30s";

/// Options for a URL source. Its `Debug` shows how many header fields, never their text.
#[derive(clap::Args)]
pub struct HttpArgs {
    /// With an http:// or https:// URL: connections kept alive to the web server (reads wait
    /// for a free one).
    #[arg(
        help_heading = "HTTP",
        long,
        value_name = "N",
        default_value_t = zcnbd_server::export::HTTP_CONNECTIONS_DEFAULT
    )]
    http_connections: usize,
    /// With a URL: a request header field, "Name: value" (repeatable), such as a token's
    /// "Authorization: Bearer ..."; its value is never logged. Sent to the URL's host only,
    /// not to another host a redirect leads to.
    #[arg(
        help_heading = "HTTP",
        long = "http-header",
        value_name = "NAME: VALUE"
    )]
    http_headers: Vec<String>,
    /// With an https:// URL: verify the server with the CA certificates (PEM) in FILE instead
    /// of the system's store (the server's name is checked either way).
    #[arg(
        help_heading = "HTTP",
        long,
        value_name = "FILE",
        conflicts_with = "http_insecure"
    )]
    http_cafile: Option<PathBuf>,
    /// With an https:// URL: do not verify the server's certificate or name at all.
    #[arg(help_heading = "HTTP", long)]
    http_insecure: bool,
    /// With a URL: how long connecting, a response's head, and each wait for body bytes may
    /// take before the read fails with EIO (or the start, for the first requests).
    #[arg(help_heading = "HTTP", long, value_name = "DURATION", default_value = HTTP_TIMEOUT_DEFAULT, value_parser = units::duration)]
    http_timeout: Duration,
}

impl std::fmt::Debug for HttpArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpArgs")
            .field("http_connections", &self.http_connections)
            .field("http_headers", &self.http_headers.len())
            .field("http_cafile", &self.http_cafile)
            .field("http_insecure", &self.http_insecure)
            .field("http_timeout", &self.http_timeout)
            .finish()
    }
}

impl HttpArgs {
    /// Whether any option was given that only a URL takes.
    pub fn given(&self) -> bool {
        self.http_connections != zcnbd_server::export::HTTP_CONNECTIONS_DEFAULT
            || !self.http_headers.is_empty()
            || self.http_cafile.is_some()
            || self.http_insecure
            || units::parse_duration(HTTP_TIMEOUT_DEFAULT) != Some(self.http_timeout)
    }

    /// The settings for `url`, or (no URL) a refusal of options given without one.
    pub fn spec(&self, url: Option<&str>) -> Result<Option<HttpSpec>, String> {
        let Some(url) = url else {
            return match self.given() {
                true => Err("the --http-* options go with an http:// or https:// URL".into()),
                false => Ok(None),
            };
        };
        let headers = self
            .http_headers
            .iter()
            .map(|h| HttpHeader::parse(h))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        Ok(Some(HttpSpec {
            connections: self.http_connections,
            headers,
            ca_file: self.http_cafile.clone(),
            insecure: self.http_insecure,
            timeout: self.http_timeout,
            ..HttpSpec::new(url)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        http: HttpArgs,
    }

    fn parse(args: &[&str]) -> HttpArgs {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .unwrap()
            .http
    }

    #[test]
    fn options_make_the_settings_and_show_the_servers_defaults() {
        assert_eq!(
            units::parse_duration(HTTP_TIMEOUT_DEFAULT),
            Some(zcnbd_server::export::HTTP_TIMEOUT_DEFAULT)
        );
        let args = parse(&[
            "--http-connections",
            "8",
            "--http-header",
            "Authorization: Bearer x",
            "--http-timeout",
            "5s",
        ]);
        let spec = args.spec(Some("https://h/d")).unwrap().unwrap();
        assert_eq!((spec.connections, spec.headers.len()), (8, 1));
        assert_eq!(spec.timeout, Duration::from_secs(5));
        assert!(args.spec(None).is_err(), "options without a URL");
        assert!(!format!("{args:?}").contains("Bearer"));
        assert_eq!(parse(&[]).spec(None), Ok(None));
        assert!(parse(&["--http-header", "no colon"])
            .spec(Some("http://h/"))
            .is_err());
        let both = ["t", "--http-cafile", "/ca.pem", "--http-insecure"];
        assert!(Cli::try_parse_from(both).is_err());
    }
}
