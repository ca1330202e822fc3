//! Opening a connection: the socket, then the fixed-newstyle handshake driven by the sans-IO
//! `ClientHandshake` over blocking I/O with a timeout.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use zcnbd_proto::{
    ClientHandshake, ClientHandshakeOptions, ClientHandshakeStatus, ClientNegotiated,
};

use crate::error::{Error, Result};
use crate::uri::{Address, NbdUri};

/// A blocking stream of either kind.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn open(address: &Address, timeout: Duration) -> Result<Stream> {
        let stream = match address {
            Address::Tcp { host, port } => {
                let s = TcpStream::connect((host.as_str(), *port))
                    .map_err(|e| Error::io("connect", e))?;
                s.set_nodelay(true)
                    .map_err(|e| Error::io("TCP_NODELAY", e))?;
                Stream::Tcp(s)
            }
            Address::Unix(path) => {
                Stream::Unix(UnixStream::connect(path).map_err(|e| Error::io("connect", e))?)
            }
        };
        let t = Some(timeout);
        let set = match &stream {
            Stream::Tcp(s) => s.set_read_timeout(t).and(s.set_write_timeout(t)),
            Stream::Unix(s) => s.set_read_timeout(t).and(s.set_write_timeout(t)),
        };
        set.map_err(|e| Error::io("socket timeout", e))?;
        Ok(stream)
    }

    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Stream::Tcp(s) => s,
            Stream::Unix(s) => s,
        }
    }

    fn into_fd(self) -> Result<OwnedFd> {
        let clear = match &self {
            Stream::Tcp(s) => s.set_read_timeout(None).and(s.set_write_timeout(None)),
            Stream::Unix(s) => s.set_read_timeout(None).and(s.set_write_timeout(None)),
        };
        clear.map_err(|e| Error::io("socket timeout", e))?;
        Ok(match self {
            Stream::Tcp(s) => s.into(),
            Stream::Unix(s) => s.into(),
        })
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// Connects to `uri`'s server and negotiates; the socket is ready for transmission.
pub fn open(
    uri: &NbdUri,
    options: ClientHandshakeOptions,
    timeout: Duration,
) -> Result<(OwnedFd, ClientNegotiated)> {
    let mut stream = Stream::open(&uri.address, timeout)?;
    let mut handshake = ClientHandshake::new(options);
    let mut input = vec![0u8; handshake.input_bytes_max()];
    let mut have = 0;
    loop {
        let io = stream.io();
        while !handshake.pending_output().is_empty() {
            let n = io
                .write(handshake.pending_output())
                .map_err(|e| Error::io("handshake send", e))?;
            handshake.consume_output(n);
        }
        match handshake.status() {
            ClientHandshakeStatus::Done(negotiated) => return Ok((stream.into_fd()?, negotiated)),
            ClientHandshakeStatus::Failed => {
                return Err(Error::Handshake("the handshake failed".into()))
            }
            // Not reached: `ClientHandshake::new` does not ask for TLS (issue 12 will).
            ClientHandshakeStatus::StartTls => {
                return Err(Error::Handshake("TLS is not supported yet".into()))
            }
            ClientHandshakeStatus::NeedIo => {}
        }
        // Everything buffered is fed before reading more; the server sends nothing of the
        // transmission phase unasked, so reading ahead cannot take a reply's bytes.
        let used = handshake
            .handle_input(&input[..have])
            .map_err(|e| Error::Handshake(e.to_string()));
        let used = match used {
            Ok(used) => used,
            Err(e) => {
                let _ = io.write_all(handshake.pending_output());
                return Err(e);
            }
        };
        if used > 0 {
            input.copy_within(used..have, 0);
            have -= used;
            continue;
        }
        if have == input.len() {
            return Err(Error::Handshake(
                "server message larger than allowed".into(),
            ));
        }
        let n = io
            .read(&mut input[have..])
            .map_err(|e| Error::io("handshake receive", e))?;
        if n == 0 {
            return Err(Error::Handshake("the server closed the connection".into()));
        }
        have += n;
    }
}
