//! The receiving half of a kTLS connection on the io_uring engine.
//!
//! With kTLS the kernel encrypts what the ring sends, so replies keep their mechanisms
//! (sends from the memory export's mapping, splice from the page cache), but records are still
//! decrypted in user space (OpenSSL 3.0 offloads no TLS 1.3 receiving, docs/design/tls.md).
//! A feed thread per connection reads and decrypts the client's records, as the portable
//! engine's reader does, and writes the plain text into a Unix socket pair whose other end
//! the ring receives requests from: writes still land in place (the memory export's
//! mapping) or are spliced, from that socket.
//!
//! Ends: the client closes or the session fails (the feed's end closes, the ring sees the
//! end of its stream); the ring closes the connection (it shuts the TCP socket down, which
//! wakes the feed's read, and its end of the pair is gone, so the feed's next write fails);
//! the server stops (the TCP socket is shut down for reading like every live socket).

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use tracing::debug;

use crate::session::channel::Tally;
use crate::stream::Stream;
use crate::tls::TlsReader;

/// Plain text decrypted per read, at most (the reader decrypts what one socket read brought).
const FEED_CHUNK_BYTES: usize = 256 * 1024;

/// Starts the feed thread for `reader`; returns the ring's end of the pair. `tally` keeps
/// the session's byte counts open until the feed ends.
pub fn start(reader: TlsReader<Stream>, tally: Arc<Tally>, peer: &str) -> io::Result<OwnedFd> {
    let (feed, ring) = UnixStream::pair()?;
    let peer = peer.to_owned();
    std::thread::Builder::new()
        .name("zcnbd-tls-feed".into())
        .spawn(move || {
            if let Err(e) = pump(reader, feed) {
                debug!(%peer, "TLS feed ended: {e}");
            }
            drop(tally);
        })?;
    Ok(OwnedFd::from(ring))
}

/// Decrypts records into `feed` until the client's stream ends or either side fails.
fn pump(mut reader: TlsReader<Stream>, mut feed: UnixStream) -> io::Result<()> {
    let mut buf = vec![0u8; FEED_CHUNK_BYTES];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => feed.write_all(&buf[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // The ring keeps a kTLS socket blocking (no sendfile there, `uring/conn/mod.rs`);
            // should a read still say so, wait for the next bytes here.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                reader.socket().wait_readable(None)?;
            }
            Err(e) => return Err(e),
        }
    }
}
