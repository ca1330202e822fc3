//! The server's side of the real handshake, for scripted servers that misbehave after it.

use std::io::{Read, Write};

use zcnbd_proto::{ExportInfo, HandshakeLimits, HandshakeStatus, Negotiated, ServerHandshake};

/// Runs the handshake on `stream` offering `exports`; what was negotiated.
pub fn handshake(stream: &mut (impl Read + Write), exports: &[ExportInfo]) -> Negotiated {
    let mut hs = ServerHandshake::new(HandshakeLimits::default());
    let mut input = Vec::new();
    loop {
        stream.write_all(hs.pending_output()).expect("send");
        let n = hs.pending_output().len();
        hs.consume_output(n);
        if let HandshakeStatus::Done(negotiated) = hs.status() {
            return negotiated;
        }
        let used = hs.handle_input(&input, exports).expect("handshake");
        if used > 0 {
            input.drain(..used);
            continue;
        }
        let mut buf = [0u8; 4096];
        let n = stream.read(&mut buf).expect("receive");
        assert!(n > 0, "client left during the handshake");
        input.extend_from_slice(&buf[..n]);
    }
}
