//! The server end of the in-memory transmission pair (see `transmission_pair_tests`), and
//! the [`Pipe`]s both ends talk over, which deliver bytes in short random pieces.
//!
//! The server runs each request on a small in-memory disk as soon as it is whole (so in the
//! client's order), receives write payloads straight into the disk as the engines receive
//! into the export's mapping, and sends the replies in shuffled order.

use crate::consts::transmission_flags as tf;
use crate::reply::ReplyTo;
use crate::request::RequestHeader;
use crate::server_session::{CutShort, EndReason, ServerEvent, ServerSession, ServerWant};
use crate::test_rng::XorShift;
use crate::types::{BlockSize, Command, ReplyMode};
use crate::validate::TransmissionContext;

/// Export size.
pub(crate) const DISK_BYTES: usize = 1 << 20;
/// Minimum block size: every valid offset and length is a multiple.
pub(crate) const BLOCK: usize = 512;
/// Advertised maximum payload.
pub(crate) const PAYLOAD_MAX: u32 = 64 * 1024;

/// What the server advertised to the client.
pub(crate) fn context(mode: ReplyMode) -> TransmissionContext {
    TransmissionContext {
        mode,
        size: DISK_BYTES as u64,
        flags: tf::HAS_FLAGS
            | tf::SEND_FLUSH
            | tf::SEND_FUA
            | tf::SEND_TRIM
            | tf::SEND_WRITE_ZEROES
            | tf::SEND_CACHE,
        block_size: BlockSize {
            minimum: BLOCK as u32,
            preferred: 4096,
            payload_max: PAYLOAD_MAX,
        },
        meta: crate::meta::MetaSelected::NONE,
    }
}

/// One direction of the connection. Once `end` is set the stream stops there: the sender
/// closed it, or the connection was cut there (bytes sent past it are lost).
#[derive(Default)]
pub(crate) struct Pipe {
    pub(crate) bytes: Vec<u8>,
    pub(crate) read: usize,
    pub(crate) end: Option<usize>,
}

impl Pipe {
    /// Bytes that have arrived and not been read.
    pub(crate) fn available(&self) -> &[u8] {
        let end = self.end.unwrap_or(usize::MAX).min(self.bytes.len());
        &self.bytes[self.read.min(end)..end]
    }

    /// Whether the receiver has read everything it will ever get.
    pub(crate) fn at_eof(&self) -> bool {
        self.end.is_some_and(|end| self.read >= end)
    }

    /// The sender closes its end: nothing sent from now on arrives.
    pub(crate) fn shut(&mut self) {
        let len = self.bytes.len();
        self.end = Some(self.end.map_or(len, |end| end.min(len)));
    }

    /// Whether the receiver has read all that was sent.
    pub(crate) fn all_read(&self) -> bool {
        self.read == self.bytes.len()
    }
}
/// The server's I/O layer: the session, a disk, and replies waiting to be sent.
pub(crate) struct Server {
    pub(crate) session: ServerSession,
    pub(crate) disk: Vec<u8>,
    pending: Vec<Vec<u8>>,
    write: Option<RequestHeader>,
    /// Whether the last receive found nothing to read.
    starved: bool,
    pub(crate) ended: Option<EndReason>,
    /// What `close()` said, once the client's stream ended before the session did.
    pub(crate) cut_short: Option<Option<CutShort>>,
    pub(crate) closed: bool,
}

impl Server {
    pub(crate) fn new(mode: ReplyMode) -> Self {
        Server {
            session: ServerSession::new(context(mode)),
            disk: vec![0; DISK_BYTES],
            pending: Vec::new(),
            write: None,
            starved: false,
            ended: None,
            cut_short: None,
            closed: false,
        }
    }

    /// Maybe sends one waiting reply, picked at random, once a few wait or there is nothing
    /// to read (so replies overtake each other even when requests trickle in byte by byte);
    /// once the requests have ended and every reply is out, closes the connection.
    pub(crate) fn send(&mut self, rng: &mut XorShift, to: &mut Pipe) {
        let ready = self.pending.len() > 3 || self.starved || self.session.is_ended();
        if ready && !self.pending.is_empty() && rng.one_in(2) {
            let reply = self.pending.swap_remove(rng.below(self.pending.len()));
            to.bytes.extend(reply);
        }
        if self.session.is_ended() && self.pending.is_empty() {
            self.closed = true;
            to.shut();
        }
    }

    /// Reads up to `piece` bytes of what the client sent, as `want()` asks.
    pub(crate) fn receive(&mut self, piece: usize, from: &mut Pipe) {
        if self.session.is_ended() {
            return;
        }
        let input = from.available();
        self.starved = input.is_empty();
        if input.is_empty() {
            if from.at_eof() {
                self.cut_short = Some(self.session.close());
            }
            return;
        }
        let n = piece.min(input.len());
        if let ServerWant::Payload {
            received,
            remaining,
        } = self.session.want()
        {
            // Straight into the disk, as the engines receive into the export's mapping.
            let n = n.min(remaining);
            let header = self.write.expect("a write waits for its payload");
            let at = header.offset as usize + received;
            self.disk[at..at + n].copy_from_slice(&input[..n]);
            from.read += n;
            if self.session.payload_received(n) {
                self.write = None;
                self.reply(&header, |to, out| to.encode_ok(out));
            }
            return;
        }
        let (used, event) = self.session.handle_input(&input[..n]);
        from.read += used;
        match event {
            Some(ServerEvent::Request {
                header,
                command,
                payload_bytes,
            }) => self.run(header, command, payload_bytes),
            Some(ServerEvent::Rejected {
                header, rejection, ..
            }) => self.reply(&header, |to, out| {
                to.encode_error(rejection.errno, rejection.reason, out)
            }),
            Some(ServerEvent::End(reason)) => self.ended = Some(reason),
            None => {}
        }
    }

    /// Runs a valid request at once (a write once its payload is in).
    fn run(&mut self, header: RequestHeader, command: Command, payload_bytes: usize) {
        let range = header.offset as usize..(header.offset + header.length) as usize;
        match command {
            Command::Read => {
                let data = &self.disk[range];
                let mut out = Vec::new();
                let to = self.session.reply_to(&header);
                to.encode_data_header(header.offset, header.length, true, &mut out);
                out.extend_from_slice(data);
                self.pending.push(out);
            }
            Command::Write if payload_bytes > 0 => self.write = Some(header),
            Command::WriteZeroes => {
                self.disk[range].fill(0);
                self.reply(&header, |to, out| to.encode_ok(out));
            }
            _ => self.reply(&header, |to, out| to.encode_ok(out)),
        }
    }

    fn reply(&mut self, header: &RequestHeader, encode: impl FnOnce(&ReplyTo, &mut Vec<u8>)) {
        let mut out = Vec::new();
        encode(&self.session.reply_to(header), &mut out);
        self.pending.push(out);
    }
}
