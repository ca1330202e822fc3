//! An `[[export]]` table's `url` and `http_*` keys: a file on a web server
//! ([`HttpSpec`], `export/base/http`).

use std::path::PathBuf;

use super::{ConfigError, ExportTable};
use crate::export::{parse_http_timeout, HttpHeader, HttpSpec, HttpSpecError};

impl ExportTable {
    /// Whether any `http_*` key is set (they go with `url` only).
    pub(super) fn has_http_keys(&self) -> bool {
        self.http_connections.is_some()
            || !self.http_headers.is_empty()
            || self.http_cafile.is_some()
            || self.http_insecure
            || self.http_timeout.is_some()
    }

    /// The `url` export's settings, from the `http_*` keys. Errors name a header field by its
    /// name and the URL without its query, never a secret.
    pub(super) fn http_spec(&self, url: &str) -> Result<HttpSpec, ConfigError> {
        let mut spec = HttpSpec::new(url);
        let refused = |source: HttpSpecError| ConfigError::Http {
            name: self.name.clone(),
            url: spec.redacted(),
            source: source.into(),
        };
        let headers = self.http_headers.iter().map(|h| HttpHeader::parse(h));
        let headers = headers.collect::<Result<_, _>>().map_err(refused)?;
        spec.headers = headers;
        spec.connections = self.http_connections.unwrap_or(spec.connections);
        spec.ca_file.clone_from(&self.http_cafile);
        spec.insecure = self.http_insecure;
        if let Some(text) = &self.http_timeout {
            spec.timeout = parse_http_timeout(text).ok_or_else(|| ConfigError::Parse {
                path: PathBuf::new(),
                message: format!(
                    "export {:?}: http_timeout {text:?}: write 500ms, 30s, 2m",
                    self.name
                ),
            })?;
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::{is_http_url, parse_config, BackendSpec, ConfigError};

    #[test]
    fn http_exports_parse_and_never_show_their_secrets() {
        let config = parse_config(
            "[[export]]\nname = \"web\"\nurl = \"https://h/d.img?sig=tok3n\"\n\
             http_connections = 8\nhttp_headers = [\"Authorization: Bearer s3cret\"]\n\
             http_cafile = \"/ca.pem\"\nhttp_timeout = \"5s\"\nsnapshot = true\n",
        )
        .expect("url export");
        let export = &config.exports[0];
        let BackendSpec::Http(spec) = &export.backend else {
            panic!("not http: {:?}", export.backend);
        };
        assert_eq!((spec.connections, spec.headers.len()), (8, 1));
        assert_eq!(spec.timeout, std::time::Duration::from_secs(5));
        assert_eq!(spec.ca_file.as_deref(), Some(Path::new("/ca.pem")));
        assert!(export.image.snapshot);
        let shown = format!("{} {export:?}", export.source());
        assert!(
            !shown.contains("tok3n") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(matches!(
            parse_config("[[export]]\nmemory = \"1M\"\nhttp_connections = 2\n"),
            Err(ConfigError::HttpOptions(_))
        ));
        assert!(matches!(
            parse_config("[[export]]\nurl = \"http://h/\"\nfile = \"/x\"\n"),
            Err(ConfigError::Backend(_))
        ));
        let bad_header =
            parse_config("[[export]]\nurl = \"http://h/?k=s3cret\"\nhttp_headers = [\"s3cret\"]\n");
        let message = bad_header.expect_err("refused").to_string();
        assert!(!message.contains("s3cret"), "{message}");
        assert!(matches!(
            parse_config("[[export]]\nurl = \"http://h/\"\nhttp_timeout = \"soon\"\n"),
            Err(ConfigError::Parse { .. })
        ));
        let refused = |toml: &str| {
            let spec = parse_config(toml).expect("parses").exports.remove(0);
            matches!(spec.build(), Err(ConfigError::Http { .. }))
        };
        assert!(refused(
            "[[export]]\nurl = \"http://h/\"\nhttp_connections = 0\n"
        ));
        assert!(refused("[[export]]\nurl = \"ftp://h/\"\n"));
        assert!(is_http_url("https://h/x") && !is_http_url("nbd://h/x"));
    }
}
