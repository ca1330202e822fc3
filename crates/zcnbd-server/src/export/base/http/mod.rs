//! A disk image on a web server (`http://`, `https://`; nbdkit's curl plugin): its size from
//! HEAD (or from a ranged GET's `Content-Range` when HEAD is refused or says no length),
//! checked at start with a ranged GET, so a server that ignores `Range` is refused with one
//! line; reads are `Range` GETs over a pool of keep-alive connections, each body read
//! straight into the caller's buffer. Read-only (`--snapshot` puts a writable overlay over
//! it). A hostile server's answer - another range, another size, a short or long body, a
//! chunked one, a head over the limit, garbage, a stall - fails that read with `EIO` and a log
//! line saying why.
//!
//! - `url.rs`: URLs, redirects' `Location`, the redacted form logs show;
//! - `spec.rs`: the settings ([`HttpSpec`]), header fields whose values are never shown;
//! - `request.rs`, `response.rs`: a request's head written, a response's parsed (sans-IO);
//! - `tls.rs`, `connection.rs`: one connection, plain or TLS, and its body reads;
//! - `pool.rs`: the connections; `client.rs`: requests with redirects and a retry.

mod client;
mod connection;
mod error;
pub mod fuzz;
mod pool;
mod request;
mod response;
mod spec;
mod tls;
mod url;

#[cfg(test)]
mod tests;

use std::io;

use zcnbd_proto::Extent;

use crate::export::{Backend, Capabilities, ZeroError, ZeroFlags};
use client::{Body, Client};
use connection::Connector;
use pool::Pool;

pub use error::HttpError;
pub use spec::{
    parse_timeout as parse_http_timeout, HttpHeader, HttpSpec, HttpSpecError,
    HTTP_CONNECTIONS_DEFAULT, HTTP_CONNECTIONS_MAX, HTTP_TIMEOUT_DEFAULT,
};
pub use url::is_http_url;

/// The most redirects followed in a row, at start and for each read.
pub const REDIRECTS_MAX: usize = 8;
/// The largest file served: offsets are signed 64-bit numbers in most of the stack's
/// neighbours (`off_t`).
pub const HTTP_SIZE_BYTES_MAX: u64 = i64::MAX as u64;

/// A file on a web server.
pub struct HttpBackend {
    client: Client,
    /// Connections to the server at most (`--http-connections`).
    connections: usize,
    /// Where reads go: the URL given, after the start's redirects.
    url: url::Url,
    size: u64,
}

impl std::fmt::Debug for HttpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpBackend")
            .field("url", &self.url)
            .field("size", &self.size)
            .finish()
    }
}

impl HttpBackend {
    /// Checks `spec`, asks the server for the size and whether it serves ranges.
    pub fn open(spec: &HttpSpec) -> Result<HttpBackend, HttpError> {
        spec.check()?;
        let given = spec.parsed_url()?;
        let connector = Connector::new(spec.timeout, spec.ca_file.clone(), spec.insecure);
        if given.origin.scheme == url::Scheme::Https || spec.ca_file.is_some() {
            // A CA file that does not load is refused at start, even for an http URL
            // (a redirect may lead to https).
            connector.tls()?;
        }
        let client = Client {
            connector,
            pool: Pool::new(spec.connections),
            headers: spec.headers.clone(),
            headers_origin: given.origin.clone(),
        };
        let (url, size) = probe(&client, &given)?;
        tracing::info!(
            url = %url,
            size,
            connections = spec.connections,
            headers = spec.headers.len(),
            tls = tls_said(spec, &url),
            "serving a file from a web server{}",
            if url == given { "" } else { " (after redirects)" }
        );
        Ok(HttpBackend {
            client,
            connections: spec.connections,
            url,
            size,
        })
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), HttpError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.client
            .read_range(&self.url, Some(self.size), offset, Body::Slice(buf))
            .map(drop)
    }

    fn fail(&self, offset: u64, len: usize, e: HttpError) -> io::Error {
        tracing::warn!(url = %self.url, offset, len, error = %e, "HTTP read failed: EIO");
        io::Error::from_raw_os_error(libc::EIO)
    }
}

/// How the log describes the server's verification.
fn tls_said(spec: &HttpSpec, url: &url::Url) -> &'static str {
    match (url.origin.scheme, spec.insecure, spec.ca_file.is_some()) {
        (url::Scheme::Http, _, _) => "none (http)",
        (_, true, _) => "unverified (--http-insecure)",
        (_, _, true) => "verified with --http-cafile",
        _ => "verified with the system's CA store",
    }
}

/// The size and where reads go: HEAD's `Content-Length` (redirects followed), then a GET of
/// the first byte, which must come back as a range with the same size.
fn probe(client: &Client, given: &url::Url) -> Result<(url::Url, u64), HttpError> {
    let head = client.head(given)?;
    let (start, head_size) = match head.status {
        200..=299 => (head.url, head.content_length),
        status => {
            tracing::debug!(status, "HEAD refused: the size comes from a ranged GET");
            (given.clone(), None)
        }
    };
    if head_size == Some(0) {
        return Err(HttpError::Empty);
    }
    let mut first = [0u8; 1];
    let got = client.read_range(&start, None, 0, Body::Slice(&mut first))?;
    if let Some(head) = head_size.filter(|h| *h != got.size) {
        return Err(HttpError::SizesDiffer {
            head,
            get: got.size,
        });
    }
    if got.size > HTTP_SIZE_BYTES_MAX {
        return Err(HttpError::TooLarge(got.size));
    }
    Ok((got.url.into_owned(), got.size))
}

fn read_only() -> io::Error {
    io::Error::from_raw_os_error(libc::EROFS)
}

impl Backend for HttpBackend {
    fn size(&self) -> u64 {
        self.size
    }

    /// Read-only; one consistent file for every connection.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            multi_conn: true,
            ..Capabilities::default()
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len();
        self.read(buf, offset)
            .map_err(|e| self.fail(offset, len, e))
    }

    /// A plain-HTTP server's bodies: spliced from its socket into the pipe (HTTPS records
    /// are decrypted in user memory anyway: no gain from a pipe).
    fn pipes_reads(&self) -> bool {
        self.url.origin.scheme == url::Scheme::Http
    }

    /// A read needs one of the connections.
    fn concurrency_max(&self) -> Option<usize> {
        Some(self.connections)
    }

    fn read_to_pipe(
        &self,
        pipe: &crate::pipe::Pipe,
        offset: u64,
        len: usize,
    ) -> io::Result<crate::export::PipedRead> {
        let body = Body::Pipe(pipe, len);
        match self
            .client
            .read_range(&self.url, Some(self.size), offset, body)
        {
            Ok(answer) => answer
                .piped
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO)),
            Err(e) => Err(self.fail(offset, len, e)),
        }
    }

    fn pwrite(&self, _buf: &[u8], _offset: u64, _fua: bool) -> io::Result<()> {
        Err(read_only())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn trim(&self, _offset: u64, _len: u64, _fua: bool) -> io::Result<()> {
        Err(read_only())
    }

    fn zero(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<(), ZeroError> {
        Err(ZeroError::Io(read_only()))
    }

    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    /// All data: a web server says nothing of holes.
    fn extents(
        &self,
        _offset: u64,
        len: u64,
        _max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        if len > 0 {
            out.push(Extent {
                length: len,
                flags: 0,
            });
        }
        Ok(())
    }

    /// Every read is one request; asking for holes first would find none.
    fn sparse_reads(&self) -> bool {
        false
    }
}
