//! The device's connections: each a Unix socket pair, one end served by zcnbd's own server
//! (its handshake, then an engine, on a thread of its own), the other negotiated here with
//! the sans-IO `ClientHandshake` and then handed to the kernel (`qemu-nbd -c` does the same
//! with its own server). nbd.ko reads simple replies only, so the handshake asks for neither
//! structured replies nor extended headers, and for no metadata context.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use zcnbd_proto::{
    ClientHandshake, ClientHandshakeOptions, ClientHandshakeStatus, ClientNegotiated,
};

use super::error::{kernel, NbdError};
use crate::server::Server;
use crate::stream::Stream;

/// How long the handshake with the server may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One connection: the kernel's end (until it is handed over) and the server's session.
pub struct Link {
    /// The client's end, past the handshake, blocking with no timeout (the kernel reads it
    /// with the socket's own settings).
    pub client: UnixStream,
    /// What the handshake agreed on.
    pub negotiated: ClientNegotiated,
    /// The server's side, ending when the connection closes.
    pub session: JoinHandle<()>,
}

impl Link {
    /// The descriptor number the kernel is told.
    pub fn fd(&self) -> u32 {
        self.client.as_raw_fd().unsigned_abs()
    }
}

/// A new connection to `server`'s default export, past its handshake; `n` names its thread.
pub fn open(server: &Arc<Server>, n: usize) -> Result<Link, NbdError> {
    let (mut client, served) = UnixStream::pair().map_err(kernel("make a socket pair"))?;
    let server = Arc::clone(server);
    let session = std::thread::Builder::new()
        .name(format!("nbd-conn{n}"))
        .spawn(move || server.serve_stream(Stream::Unix(served), "nbd.ko"))
        .map_err(kernel("start a connection thread"))?;
    let timeouts = |s: &UnixStream, t: Option<Duration>| {
        s.set_read_timeout(t)?;
        s.set_write_timeout(t)
    };
    timeouts(&client, Some(HANDSHAKE_TIMEOUT)).map_err(kernel("set the socket's timeouts"))?;
    let negotiated = handshake(&mut client)?;
    timeouts(&client, None).map_err(kernel("clear the socket's timeouts"))?;
    Ok(Link {
        client,
        negotiated,
        session,
    })
}

/// The client side of the handshake over `stream`, as nbd.ko needs it.
fn handshake(stream: &mut UnixStream) -> Result<ClientNegotiated, NbdError> {
    let options = ClientHandshakeOptions {
        structured_replies: false,
        extended_headers: false,
        base_allocation: false,
        ..ClientHandshakeOptions::default()
    };
    let failed = |e: std::io::Error| NbdError::Handshake(e.to_string());
    let mut hs = ClientHandshake::new(options);
    let mut input = vec![0u8; hs.input_bytes_max()];
    let mut have = 0;
    loop {
        let n = hs.pending_output().len();
        stream.write_all(hs.pending_output()).map_err(failed)?;
        hs.consume_output(n);
        match hs.status() {
            ClientHandshakeStatus::Done(negotiated) => return Ok(negotiated),
            ClientHandshakeStatus::Failed | ClientHandshakeStatus::StartTls => {
                return Err(NbdError::Handshake("the server ended it".into()))
            }
            ClientHandshakeStatus::NeedIo => {}
        }
        let used = hs
            .handle_input(&input[..have])
            .map_err(|e| NbdError::Handshake(e.to_string()))?;
        if used > 0 {
            input.copy_within(used..have, 0);
            have -= used;
            continue;
        }
        let Some(free) = input.get_mut(have..).filter(|f| !f.is_empty()) else {
            return Err(NbdError::Handshake("a server message too large".into()));
        };
        match stream.read(free) {
            Ok(0) => {
                return Err(NbdError::Handshake(
                    "the server closed the connection".into(),
                ))
            }
            Ok(n) => have += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(failed(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use zcnbd_proto::ReplyMode;

    use super::*;
    use crate::export::{Export, MemoryBackend, Stack};

    /// The handshake agrees on what nbd.ko reads (simple replies), and the connection then
    /// answers a request in the transmission phase, as the kernel will send it.
    #[test]
    fn a_link_negotiates_simple_replies_and_serves_a_read() {
        let backend = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let export = Export::new("", Stack::of(backend, false));
        let server = Server::new(vec![export], crate::server::Limits::default()).unwrap();
        let mut link = open(&server, 0).unwrap();
        assert_eq!(link.negotiated.mode, ReplyMode::Simple);
        assert_eq!(link.negotiated.size, 1 << 20);
        // NBD_CMD_READ of 512 bytes at 4096: magic, flags, type, cookie, offset, length.
        let mut req = Vec::new();
        req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&7u64.to_be_bytes());
        req.extend_from_slice(&4096u64.to_be_bytes());
        req.extend_from_slice(&512u32.to_be_bytes());
        link.client.write_all(&req).unwrap();
        let mut reply = [0u8; 16 + 512];
        link.client.read_exact(&mut reply).unwrap();
        assert_eq!(&reply[..4], &0x6744_6698u32.to_be_bytes(), "a simple reply");
        assert_eq!(&reply[4..8], &[0; 4], "no error");
        assert_eq!(&reply[8..16], &7u64.to_be_bytes());
        drop(link.client);
        link.session.join().unwrap();
    }
}
