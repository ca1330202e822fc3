//! Requests over the pool: a ranged GET into the caller's buffer, a HEAD, each following
//! redirects (up to `REDIRECTS_MAX`, never from https to http) and sent once more on a new
//! connection when a kept-alive one turns out closed. The extra header fields go only to the
//! origin of the URL given; a redirect to another host gets none of them (as curl does with
//! credentials).

use std::borrow::Cow;

use super::connection::{Connection, Connector};
use super::error::HttpError;
use super::pool::{Pool, Slot};
use super::request::Method;
use super::response::{check_range, ContentRange, Framing, Head};
use super::spec::HttpHeader;
use super::url::{Origin, Scheme, Url};
use super::REDIRECTS_MAX;

/// What requests share.
pub struct Client {
    pub connector: Connector,
    pub pool: Pool,
    pub headers: Vec<HttpHeader>,
    /// Where `headers` may go: the origin of the URL given.
    pub headers_origin: Origin,
}

/// What a HEAD found.
pub struct HeadAnswer {
    /// Where the redirects led.
    pub url: Url,
    /// The status (2xx: `content_length` is the size, if given).
    pub status: u16,
    pub content_length: Option<u64>,
}

/// Where a ranged GET's body goes.
pub enum Body<'b> {
    /// Into the caller's buffer, all of it.
    Slice(&'b mut [u8]),
    /// Into a pipe, `len` bytes (see `Connection::read_body_to_pipe`).
    Pipe(&'b crate::pipe::Pipe, usize),
}

impl Body<'_> {
    fn len(&self) -> usize {
        match self {
            Body::Slice(dest) => dest.len(),
            Body::Pipe(_, len) => *len,
        }
    }
}

/// What a ranged GET found.
pub struct RangeAnswer<'a> {
    /// Where the redirects led (the URL asked, if none).
    pub url: Cow<'a, Url>,
    /// The file's size, from `Content-Range`.
    pub size: u64,
    /// What became of a body bound for a pipe (`None` for a slice).
    pub piped: Option<crate::export::PipedRead>,
}

impl Client {
    /// Reads `dest.len()` (> 0) bytes at `offset` of `url` into `dest`; `size`, if known,
    /// must be the `Content-Range` total.
    pub fn read_range<'a>(
        &self,
        url: &'a Url,
        size: Option<u64>,
        offset: u64,
        dest: Body<'_>,
    ) -> Result<RangeAnswer<'a>, HttpError> {
        let len = dest.len() as u64;
        // The stack keeps offset + len within the size (at most i64::MAX): no overflow, and
        // check_range computes the same last byte.
        let method = Method::Range {
            first: offset,
            last: offset.saturating_add(len.saturating_sub(1)),
        };
        let mut slot = self.pool.take();
        // Borrowed until a redirect: a read makes no copy of the URL.
        let mut url = Cow::Borrowed(url);
        for _ in 0..=REDIRECTS_MAX {
            let exact = matches!(dest, Body::Pipe(..));
            let head = self.exchange(&mut slot, (method, exact), &url)?;
            if head.is_redirect() {
                slot.discard();
                url = Cow::Owned(follow(&url, &head)?);
                continue;
            }
            match head.status {
                206 => {}
                200 => return Err(HttpError::RangeIgnored(200)),
                416 if matches!(
                    head.content_range,
                    Some(ContentRange::Unsatisfied { total: 0 })
                ) =>
                {
                    return Err(HttpError::Empty)
                }
                status => {
                    return Err(HttpError::Status {
                        status,
                        reason: head.reason,
                    })
                }
            }
            let (total, framing) = check_range(&head, offset, len, size)?;
            let connection = slot.connection(&self.connector, &url.origin)?;
            let piped = match dest {
                Body::Slice(dest) => connection.read_body(dest).map(|()| None)?,
                Body::Pipe(pipe, len) => Some(connection.read_body_to_pipe(pipe, len)?),
            };
            if !(framing == Framing::Length && head.keep_alive && connection.finish()) {
                slot.discard();
            }
            return Ok(RangeAnswer {
                url,
                size: total,
                piped,
            });
        }
        Err(HttpError::Redirects)
    }

    /// Asks `url` for its size with HEAD.
    pub fn head(&self, url: &Url) -> Result<HeadAnswer, HttpError> {
        let mut slot = self.pool.take();
        let mut url = url.clone();
        for _ in 0..=REDIRECTS_MAX {
            let head = self.exchange(&mut slot, (Method::Head, false), &url)?;
            if head.is_redirect() {
                slot.discard();
                url = follow(&url, &head)?;
                continue;
            }
            // A HEAD's answer has no body, whatever its fields say.
            let connection = slot.connection(&self.connector, &url.origin)?;
            if !(head.keep_alive && connection.finish()) {
                slot.discard();
            }
            return Ok(HeadAnswer {
                url,
                status: head.status,
                content_length: head.content_length,
            });
        }
        Err(HttpError::Redirects)
    }

    /// Sends `method` for `url` on the slot's connection and receives the head (`exact`:
    /// without taking any of the body from a plain connection's socket, for a body bound
    /// for a pipe); a kept-alive connection found closed is replaced once. A failed
    /// connection is discarded.
    fn exchange(
        &self,
        slot: &mut Slot<'_>,
        (method, exact): (Method, bool),
        url: &Url,
    ) -> Result<Head, HttpError> {
        let headers: &[HttpHeader] = match url.origin == self.headers_origin {
            true => &self.headers,
            false => &[],
        };
        let attempt = |slot: &mut Slot<'_>| -> Result<(bool, Result<Head, HttpError>), HttpError> {
            let connection: &mut Connection = slot.connection(&self.connector, &url.origin)?;
            let reused = connection.was_kept_alive();
            connection.set_exact_heads(exact);
            Ok((reused, connection.exchange(method, url, headers)))
        };
        let result = match attempt(slot)? {
            (true, Err(e)) if e.closed_before_answer() => {
                tracing::debug!(url = %url, "a kept-alive connection was closed: sending again on a new one");
                slot.discard();
                attempt(slot)?.1
            }
            (_, result) => result,
        };
        if result.is_err() {
            slot.discard();
        }
        result
    }
}

/// Where a redirect `head` from `from` leads.
pub(super) fn follow(from: &Url, head: &Head) -> Result<Url, HttpError> {
    let location = head
        .location
        .as_deref()
        .ok_or(HttpError::NoLocation(head.status))?;
    let to = from.resolve(location).map_err(HttpError::Redirect)?;
    if from.origin.scheme == Scheme::Https && to.origin.scheme == Scheme::Http {
        return Err(HttpError::Downgrade);
    }
    tracing::debug!(status = head.status, from = %from, to = %to, "following a redirect");
    Ok(to)
}
