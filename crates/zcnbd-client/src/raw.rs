//! A connection whose transmission phase the caller drives itself: connected and negotiated
//! here (the handshake as [`Client::connect_with`](crate::Client::connect_with) does it), then
//! handed over as the socket and what was agreed. For a caller with an event loop of its own
//! that moves payloads between the socket and memory this library cannot name (`zcnbd
//! attach`'s queues: a ublk request's pages, registered with the queue's io_uring); it frames
//! requests and checks replies with `zcnbd_proto::ClientSession`. Plain sockets only: under
//! TLS the bytes must go through the TLS library.

use std::os::fd::{AsFd, OwnedFd};

use zcnbd_proto::{ClientHandshakeOptions, MetaQueries, ReplyMode};

use crate::client::ClientOptions;
use crate::connect;
use crate::error::{Error, Result};
use crate::link::Link;
use crate::plan::Geometry;
use crate::uri::NbdUri;

/// A negotiated connection, ready for its first request.
#[derive(Debug)]
pub struct RawConnection {
    /// The socket, blocking.
    pub socket: OwnedFd,
    /// What the handshake said of the export (its framing in `mode`).
    pub geometry: Geometry,
}

impl RawConnection {
    /// The reply framing the requests must use.
    pub fn mode(&self) -> ReplyMode {
        self.geometry.mode
    }
}

/// Connects to `uri` and negotiates with `options` (structured replies, extended headers;
/// no metadata context: block status is not this connection's job). An `nbds` URI is
/// refused (`Error::Unsupported`): its bytes need the TLS library.
pub fn open_raw(uri: &str, options: &ClientOptions) -> Result<RawConnection> {
    let uri = NbdUri::parse(uri)?;
    if uri.tls.is_some() {
        return Err(Error::Unsupported("a raw connection carries no TLS"));
    }
    let handshake = ClientHandshakeOptions {
        export_name: uri.export.clone(),
        structured_replies: options.structured_replies,
        extended_headers: options.extended_headers,
        base_allocation: false,
        ..ClientHandshakeOptions::default()
    };
    let none = MetaQueries::default();
    let (link, negotiated) = connect::open(
        &uri,
        handshake,
        (&none, &none),
        None,
        options.handshake_timeout,
    )?;
    let Link::Plain(socket) = link else {
        return Err(Error::Unsupported("a raw connection carries no TLS"));
    };
    // The caller's ring waits for the socket itself: a non-blocking socket would hand it
    // EAGAIN instead.
    let flags =
        rustix::fs::fcntl_getfl(socket.as_fd()).map_err(|e| Error::io("fcntl", e.into()))?;
    rustix::fs::fcntl_setfl(socket.as_fd(), flags - rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| Error::io("fcntl", e.into()))?;
    Ok(RawConnection {
        socket,
        geometry: Geometry::from_negotiated(&negotiated),
    })
}
