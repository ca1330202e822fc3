//! A connection's replies on their way out, and the memory they must keep alive; the send
//! side's state ([`SendSide`]: the outbox, the pipe spliced replies pass through, which send
//! mechanisms still work on this socket). The sends themselves are in `send.rs`.
//!
//! Replies leave one send at a time (so bytes of two replies never interleave on the
//! socket), but a send carries every plain reply waiting: one `sendmsg` for many replies.
//! A `sendmsg` in flight (the driver's `MsgSend`) holds its iovecs, `msghdr` and items
//! in `Lent`s: the items (and the buffers they own) come back only after its last
//! completion - for a zero-copy send, after the notification that the kernel is done with
//! the pages.

use std::collections::VecDeque;
use std::os::fd::RawFd;

use crate::dispatch::Reply;
use crate::engine::options::EngineOptions;
use crate::engine::uring::mechanism;
use crate::export::Lease;
use crate::pipe::Pipe;
use crate::sys::mapped_io::OutPiece;
use crate::sys::mapping::MappedRange;
use crate::sys::uring::{FixedBuf, Lent, MsgSend, Wire, WirePiece};

/// Most replies batched into one `sendmsg`.
pub(super) const BATCH_REPLIES_MAX: usize = 64;
/// No reply joins a batch that already carries this much data: large replies go out one
/// per `sendmsg`, so a finished reply never waits behind megabytes of others.
pub(super) const BATCH_DATA_BYTES_MAX: usize = 256 * 1024;

/// How a reply's payload goes out.
pub(super) enum Payload {
    /// Headers and owned data (a buffer, or nothing), sent with `sendmsg`.
    Reply(Reply),
    /// A header, then data sent straight from the memory export's mapping.
    Mapped {
        header: Vec<u8>,
        range: MappedRange,
        /// The place stays the request's until the send is done (dropped with the item).
        #[allow(dead_code)]
        lease: Lease,
    },
    /// A header, then data spliced from a page-cache file through the connection's pipe.
    Splice {
        header: Vec<u8>,
        fd: RawFd,
        offset: u64,
        len: usize,
        /// The file place stays the request's until the splices are done.
        #[allow(dead_code)]
        lease: Lease,
    },
    /// A header, then data that waits in a pipe of its own (`len` bytes of an upstream's the
    /// stack spliced into it), spliced on to the socket, then the data in the `more` pipes
    /// (where the first filled early: each with its bytes; only on the inline path, which
    /// moves each into `pipe` and `len` in turn), then `tail`: the data's last bytes, which
    /// no pipe took (usually none).
    Piped {
        header: Vec<u8>,
        pipe: Pipe,
        len: usize,
        more: VecDeque<(Pipe, usize)>,
        tail: Vec<u8>,
    },
    /// A header, then data sent by `sendfile(2)` from the memory export's memfd `fd` on the
    /// ring thread itself: the socket takes references to the page-cache pages (no copy), and
    /// shmem pages never wait for I/O, so the call never blocks (the socket is
    /// nonblocking). io_uring would run the same splice on an io-wq worker instead.
    Sendfile {
        header: Vec<u8>,
        fd: RawFd,
        offset: u64,
        len: usize,
        #[allow(dead_code)]
        lease: Lease,
    },
    /// Headers and an owned buffer sent with `SENDMSG_ZC`.
    ZeroCopy(Reply),
    /// A registered run holding the header and, right after it, the data: one contiguous
    /// range, sent with `SEND_ZC` naming the registered buffer, or in a plain batch.
    Fixed(FixedBuf),
}

/// One reply queued or in flight, with what its request holds.
pub(super) struct Item {
    pub payload: Payload,
    /// Bytes of the connection's in-flight budget this request holds.
    pub held: usize,
}

impl Item {
    /// Payload bytes (not headers).
    pub fn data_bytes(&self) -> usize {
        match &self.payload {
            Payload::Reply(r) | Payload::ZeroCopy(r) => r.data_bytes(),
            Payload::Mapped { range, .. } => range.len(),
            Payload::Splice { len, .. } | Payload::Sendfile { len, .. } => *len,
            // The tail moves into the send when it starts (and is counted there).
            Payload::Piped {
                len, more, tail, ..
            } => len + more.iter().map(|(_, n)| n).sum::<usize>() + tail.len(),
            Payload::Fixed(buf) => buf.len(),
        }
    }

    /// Whether this item can ride in a plain `sendmsg` batch.
    pub fn is_plain(&self) -> bool {
        matches!(self.payload, Payload::Reply(_) | Payload::Mapped { .. })
    }

    /// Whether this item is sent alone with a zero-copy send when zero-copy pays, and in a
    /// plain batch otherwise.
    pub fn is_zerocopy_capable(&self) -> bool {
        matches!(self.payload, Payload::ZeroCopy(_) | Payload::Fixed(_))
    }
}

impl Wire for Item {
    fn pieces<'a>(&'a self, visit: &mut dyn FnMut(WirePiece<'a>)) {
        match &self.payload {
            Payload::Reply(r) | Payload::ZeroCopy(r) => r.pieces().for_each(|p| {
                visit(match p {
                    OutPiece::Bytes(b) => WirePiece::Bytes(b),
                    OutPiece::Mapped(m) => WirePiece::Mapped(m),
                })
            }),
            Payload::Mapped { header, range, .. } => {
                visit(WirePiece::Bytes(header));
                visit(WirePiece::Mapped(range));
            }
            Payload::Splice { header, .. }
            | Payload::Sendfile { header, .. }
            | Payload::Piped { header, .. } => visit(WirePiece::Bytes(header)),
            Payload::Fixed(buf) => visit(WirePiece::Fixed(buf)),
        }
    }
}

/// A spliced reply in flight: header send, then file → pipe → socket in pipe-sized steps (or,
/// for a piped reply, only pipe → socket: its data is in its pipe already).
pub(super) struct SpliceSend {
    /// The reply, less its header (moved into `header`).
    pub item: Item,
    /// The reply's header, lent to the chain's header send until that send completes.
    pub header: Lent<Vec<u8>>,
    pub header_len: usize,
    pub header_sent: usize,
    /// A piped reply's last data bytes (after the pipe's), lent likewise to their send.
    pub tail: Lent<Vec<u8>>,
    pub tail_len: usize,
    pub tail_sent: usize,
    /// Bytes the reply moves through the pipe to the socket.
    pub through: usize,
    /// Bytes moved file → pipe.
    pub piped: usize,
    /// Bytes moved pipe → socket.
    pub sent: usize,
    /// Operations of the current chain still to complete.
    pub pending: usize,
    /// The first real error of the chain (not a cancellation).
    pub error: Option<i32>,
    /// header_sent + piped + sent when the current chain was posted (to detect a chain
    /// that moved nothing, which would otherwise be retried forever).
    pub mark: usize,
}

impl SpliceSend {
    /// A spliced reply, nothing of it sent yet.
    pub fn new(mut item: Item) -> Box<SpliceSend> {
        let (header, tail, through, piped) = match &mut item.payload {
            Payload::Splice { header, len, .. } => (std::mem::take(header), Vec::new(), *len, 0),
            Payload::Piped {
                header, len, tail, ..
            } => (std::mem::take(header), std::mem::take(tail), *len, *len),
            _ => (Vec::new(), Vec::new(), 0, 0),
        };
        Box::new(SpliceSend {
            item,
            header_len: header.len(),
            header: Lent::new(header),
            header_sent: 0,
            tail_len: tail.len(),
            tail: Lent::new(tail),
            tail_sent: 0,
            through,
            piped,
            sent: 0,
            pending: 0,
            error: None,
            mark: 0,
        })
    }

    /// The chain's header send completed (whatever its result).
    pub fn header_returned(&mut self) {
        self.header.complete();
    }

    /// The chain's tail send completed (whatever its result).
    pub fn tail_returned(&mut self) {
        self.tail.complete();
    }

    /// Whether every byte of the reply went out.
    pub fn is_complete(&self) -> bool {
        self.header_sent == self.header_len
            && self.sent == self.through
            && self.tail_sent == self.tail_len
    }

    /// Whether nothing more will complete for this reply: no operation pending, nothing
    /// lent.
    pub fn is_settled(&self) -> bool {
        self.pending == 0 && !self.header.is_lent() && !self.tail.is_lent()
    }

    /// Bytes moved by every step so far.
    pub fn progress(&self) -> usize {
        self.header_sent + self.piped + self.sent + self.tail_sent
    }
}

/// A reply the ring thread sends with its own nonblocking calls (the socket is nonblocking):
/// a memory export's data by `sendfile`, a piped reply's by `splice` from its pipe. When the
/// socket is full it waits for a writability poll.
pub(super) struct InlineSend {
    pub item: Item,
    pub header_sent: usize,
    /// Data bytes sent (from the memfd, or from the pipe).
    pub sent: usize,
    /// A piped reply's tail bytes sent.
    pub tail_sent: usize,
}

/// What is being sent now.
pub(super) enum Sending {
    Msg(Box<MsgSend<Item>>),
    Splice(Box<SpliceSend>),
    Inline(Box<InlineSend>),
}

/// The queue of replies and the send in flight.
#[derive(Default)]
pub(super) struct Outbox {
    pub queue: VecDeque<Item>,
    pub current: Option<Sending>,
}

impl Outbox {
    /// Takes the next send's items: a splice or zero-copy reply alone, or a batch of plain
    /// ones. `zerocopy_ok` false turns zero-copy items into plain ones.
    pub fn next_batch(&mut self, zerocopy_ok: bool) -> Option<(Vec<Item>, bool)> {
        let front = self.queue.pop_front()?;
        let alone = match &front.payload {
            Payload::Splice { .. } | Payload::Sendfile { .. } | Payload::Piped { .. } => {
                Some(false)
            }
            Payload::ZeroCopy(_) | Payload::Fixed(_) if zerocopy_ok => Some(true),
            _ => None,
        };
        if let Some(zerocopy) = alone {
            return Some((vec![front], zerocopy));
        }
        let mut data_bytes = front.data_bytes();
        let mut batch = vec![front];
        while batch.len() < BATCH_REPLIES_MAX && data_bytes < BATCH_DATA_BYTES_MAX {
            let plain = match self.queue.front() {
                Some(item) => item.is_plain() || (!zerocopy_ok && item.is_zerocopy_capable()),
                None => false,
            };
            if !plain {
                break;
            }
            if let Some(item) = self.queue.pop_front() {
                data_bytes += item.data_bytes();
                batch.push(item);
            }
        }
        Some((batch, false))
    }
}

/// A header-only reply item, for tests.
/// Everything a connection needs to send replies.
pub(super) struct SendSide {
    pub outbox: Outbox,
    /// The pipe spliced replies pass through (created on the first).
    pub pipe: Option<Pipe>,
    /// Zero-copy sends still worth trying (false once the kernel reported copying).
    pub zerocopy_ok: bool,
    /// The socket is nonblocking, so the ring thread may send piped replies itself, and
    /// `sendfile` a memory export's.
    pub nonblocking: bool,
    /// The socket is nonblocking and the export is in memory: reads may go by `sendfile`.
    pub sendfile_ok: bool,
    /// `auto`: memory-export reads this long or longer are sent by `sendfile`
    /// ([`mechanism::remote_splice_min`](crate::engine::uring::mechanism::remote_splice_min)).
    pub sendfile_min: usize,
    /// Reads of `sendfile_min` or more go the way the ring's trials say (`sendfile_trial.rs`):
    /// `auto`'s threshold for a peer on another host, `--splice-min-bytes` not given.
    pub sendfile_tried: bool,
}

impl SendSide {
    pub fn new(
        nonblocking: bool,
        sendfile_ok: bool,
        (sendfile_min, sendfile_tried): (usize, bool),
        zerocopy_ok: bool,
    ) -> SendSide {
        let sendfile_ok = sendfile_ok && nonblocking;
        SendSide {
            outbox: Outbox::default(),
            pipe: None,
            zerocopy_ok,
            nonblocking,
            sendfile_ok,
            sendfile_min,
            sendfile_tried: sendfile_ok && sendfile_tried,
        }
    }

    /// Whether a send is in flight.
    pub fn is_sending(&self) -> bool {
        self.outbox.current.is_some()
    }

    /// Whether replies wait and no send is in flight to carry them.
    pub fn has_idle_replies(&self) -> bool {
        !self.is_sending() && !self.outbox.queue.is_empty()
    }

    /// Whether zero-copy sends are used for the next reply on this data path.
    pub fn zerocopy_pays(&self, options: &EngineOptions) -> bool {
        let Some(front) = self.outbox.queue.front() else {
            return false;
        };
        self.zerocopy_ok && mechanism::zerocopy_send_pays(options, front.data_bytes())
    }
}

#[cfg(test)]
pub(super) fn header_item(bytes: &[u8]) -> Item {
    Item {
        payload: Payload::Reply(Reply::header_only(bytes.to_vec())),
        held: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_plain_replies_and_isolates_splices() {
        let mut out = Outbox::default();
        out.queue.push_back(header_item(b"a"));
        out.queue.push_back(header_item(b"b"));
        let splice = Payload::Splice {
            header: vec![1],
            fd: 0,
            offset: 0,
            len: 10,
            lease: Lease::none(),
        };
        out.queue.push_back(Item {
            payload: splice,
            held: 10,
        });
        out.queue.push_back(header_item(b"c"));
        let (batch, zc) = out.next_batch(true).unwrap();
        assert_eq!((batch.len(), zc), (2, false));
        let (batch, _) = out.next_batch(true).unwrap();
        assert!(matches!(batch[0].payload, Payload::Splice { .. }));
        assert_eq!(out.next_batch(true).unwrap().0.len(), 1);
        assert!(out.next_batch(true).is_none());
    }
}
