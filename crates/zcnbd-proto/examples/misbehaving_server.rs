//! An NBD server that breaks the protocol on purpose, for the VM lab's checks of a client
//! facing a hostile upstream (`tests/vm/guest.d/17-attach.sh`): a memory export that answers
//! every request correctly, except reads that touch the poisoned MiB in the middle of the
//! export, which get the misbehaviour named on the command line:
//!
//! - `unknown-cookie`: the reply names a request that was never sent;
//! - `oversize-chunk`: a data chunk twice the request's length, reaching past it;
//! - `hang-up`: half the reply's payload, then the connection closed.
//!
//! It serves any number of connections at once and offers multi-conn, so a client may open
//! several (zcnbd attach's zero-copy queues each do).
//!
//! Usage: `misbehaving_server PORT SIZE_MIB unknown-cookie|oversize-chunk|hang-up`

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use zcnbd_proto::consts::transmission_flags as tf;
use zcnbd_proto::{
    BlockSize, Command, ExportInfo, HandshakeLimits, HandshakeStatus, Negotiated, ReplyTo,
    RequestHeader, ServerHandshake,
};

/// The poisoned range's length (it starts in the middle of the export).
const POISON_BYTES: u64 = 1 << 20;
/// The largest request this server takes (larger ones end the connection).
const REQUEST_MAX_BYTES: u64 = 32 << 20;

#[derive(Clone, Copy)]
enum Misbehaviour {
    UnknownCookie,
    OversizeChunk,
    HangUp,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: misbehaving_server PORT SIZE_MIB unknown-cookie|oversize-chunk|hang-up";
    let (Some(port), Some(mib), Some(how)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let how = match how.as_str() {
        "unknown-cookie" => Misbehaviour::UnknownCookie,
        "oversize-chunk" => Misbehaviour::OversizeChunk,
        "hang-up" => Misbehaviour::HangUp,
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let (Ok(port), Ok(mib)) = (port.parse::<u16>(), mib.parse::<u64>()) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let size = mib << 20;
    let data = Arc::new(Mutex::new(vec![0u8; size as usize]));
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let data = Arc::clone(&data);
        std::thread::spawn(move || {
            if let Err(e) = serve(stream, &data, size, how) {
                eprintln!("misbehaving_server: a connection ended: {e}");
            }
        });
    }
}

fn serve(
    mut stream: TcpStream,
    data: &Mutex<Vec<u8>>,
    size: u64,
    how: Misbehaviour,
) -> std::io::Result<()> {
    let negotiated = handshake(&mut stream, size)?;
    let mode = negotiated.mode;
    let poison = size / 2..size / 2 + POISON_BYTES;
    let mut header = vec![0u8; mode.request_header_bytes()];
    loop {
        stream.read_exact(&mut header)?;
        let Ok(Some(r)) = RequestHeader::decode(&header, mode) else {
            return Err(std::io::Error::other("a malformed request"));
        };
        let (offset, len) = (r.offset, r.length);
        if len > REQUEST_MAX_BYTES || offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(std::io::Error::other("a request out of bounds"));
        }
        let to = ReplyTo {
            mode,
            cookie: r.cookie,
            offset,
        };
        let range = offset as usize..(offset + len) as usize;
        let mut out = Vec::new();
        match Command::from_wire(r.kind) {
            Some(Command::Read) if offset < poison.end && offset + len > poison.start => {
                let payload = vec![0x5au8; len as usize];
                return misbehave(&mut stream, how, &to, &payload);
            }
            Some(Command::Read) => {
                let bytes = data.lock().unwrap_or_else(|p| p.into_inner())[range].to_vec();
                to.encode_data_header(offset, len, true, &mut out);
                out.extend_from_slice(&bytes);
            }
            Some(Command::Write) => {
                let mut payload = vec![0u8; r.payload_bytes(mode) as usize];
                stream.read_exact(&mut payload)?;
                data.lock().unwrap_or_else(|p| p.into_inner())[range].copy_from_slice(&payload);
                to.encode_ok(&mut out);
            }
            Some(Command::Disc) => return Ok(()),
            _ => to.encode_ok(&mut out),
        }
        stream.write_all(&out)?;
    }
}

/// Answers a read of the poisoned range as `how` says, and ends the connection.
fn misbehave(
    stream: &mut TcpStream,
    how: Misbehaviour,
    to: &ReplyTo,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut out = Vec::new();
    let len = payload.len() as u64;
    match how {
        Misbehaviour::UnknownCookie => {
            let stranger = ReplyTo {
                cookie: to.cookie ^ 0x5eed_0000_0000,
                ..*to
            };
            stranger.encode_data_header(to.offset, len, true, &mut out);
            out.extend_from_slice(payload);
        }
        Misbehaviour::OversizeChunk => {
            // (Simple replies have no chunks: there the client reads the whole read's
            // length and then finds the rest where the next reply's magic should be.)
            to.encode_data_header(to.offset, len * 2, true, &mut out);
            out.extend_from_slice(payload);
            out.extend_from_slice(payload);
        }
        Misbehaviour::HangUp => {
            to.encode_data_header(to.offset, len, true, &mut out);
            out.extend_from_slice(&payload[..payload.len() / 2]);
        }
    }
    // The client may hang up first on what it was sent: its error is no news here.
    let _ = stream.write_all(&out);
    // Whatever the client makes of it, this connection is over.
    let _ = stream.shutdown(Shutdown::Both);
    Ok(())
}

/// The real server handshake (one export, multi-conn) on `stream`.
fn handshake(stream: &mut TcpStream, size: u64) -> std::io::Result<Negotiated> {
    let exports = [ExportInfo {
        name: String::new(),
        description: String::new(),
        size,
        flags: tf::HAS_FLAGS | tf::SEND_FLUSH | tf::SEND_FUA | tf::CAN_MULTI_CONN,
        block_size: BlockSize::default(),
        tls_only: false,
        meta_contexts: Vec::new(),
    }];
    let mut hs = ServerHandshake::new(HandshakeLimits::default());
    let mut input = Vec::new();
    loop {
        stream.write_all(hs.pending_output())?;
        let n = hs.pending_output().len();
        hs.consume_output(n);
        match hs.status() {
            HandshakeStatus::Done(negotiated) => return Ok(negotiated),
            HandshakeStatus::Aborted => return Err(std::io::Error::other("the client aborted")),
            _ => {}
        }
        let used = hs
            .handle_input(&input, &exports)
            .map_err(|e| std::io::Error::other(format!("handshake: {e}")))?;
        if used > 0 {
            input.drain(..used);
            continue;
        }
        let mut buf = [0u8; 4096];
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::other(
                "the client left during the handshake",
            ));
        }
        input.extend_from_slice(&buf[..n]);
    }
}
