//! One connection on a ring: receive headers and payloads, run reads and writes with the
//! cheapest mechanism the data path allows, hand everything else to the dispatcher, and send
//! replies.
//!
//! Ownership rule: every piece of memory an operation in flight uses is held in a [`Lent`]
//! the connection owns, and an operation reaches the kernel only as an [`Op`] naming that
//! `Lent` (the driver lends it and builds the entry): payload destinations ([`Dest`]) and
//! file buffers ([`IoBuf`]), the receive side's stage, scratch and `recvmsg` header
//! (`RecvMem`), a send's iovecs and items ([`MsgSend`]), and a spliced reply's header
//! (`SpliceSend`). The connection gives each loan back ([`Lent::complete`]) from the
//! operation's last completion, and is not freed until `ops` - its operations in flight - is
//! back to zero, so the descriptors they name stay open. The same goes for places in the
//! export: the [`Lease`] a map came with is kept beside its place in whatever holds the I/O
//! (`Recv::Payload`, `PipedWrite`, `FileOp`, the outbox's `Splice`, `Sendfile` and `Mapped`
//! payloads) and dropped only after the last completion, so the place stays the request's
//! (`export/lease.rs`).
//!
//! The parts, each with one job: [`RecvSide`] (`intake.rs`: stage, session, what is being
//! received), [`SendSide`] (`outbox.rs`: the replies waiting and in flight, send mechanisms),
//! the engines' [`Budget`] (requests in flight and the bytes they hold), [`Deadlines`] (write
//! and idle timeouts). [`Conn`] holds them, the socket and the export, and runs the steps that
//! span parts: `receive.rs` (headers and payloads, where each write goes), `reads.rs` (where
//! each read comes from; what goes to the dispatcher), `file_io.rs` and `piped_write.rs` (file
//! reads and writes), `send.rs` (sends and their completions).

mod deadlines;
#[cfg(test)]
mod fake;
mod file_io;
mod intake;
mod outbox;
mod piped_write;
mod reads;
mod receive;
mod send;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use zcnbd_proto::consts::cmd_flags;
use zcnbd_proto::{
    Command, Errno, ReplyMode, RequestHeader, ServerEvent, ServerWant, TransmissionContext,
};

use super::cx::Cx;
use super::key::{ConnKey, Tag};
use super::mailbox::{Attach, Inbox};
use super::mechanism::{self, ReadFacts, ReadMechanism, WriteFacts, WriteMechanism};
use super::shared::EngineShared;
use crate::buffer_pool::PooledBuf;
use crate::dispatch::{
    data_header, error_reply, ok_reply, Dispatcher, Landed, PipedData, Reply, Request,
};
use crate::engine::budget::Budget;
use crate::engine::options::DataPath;
use crate::engine::options::EngineOptions;
use crate::engine::{log_idle_timeout, log_payload_timeout, log_write_timeout, DISCARD_BYTES};
use crate::export::{errno_of, Lease, Map, MapFor, Medium, Place, DIRECT_ALIGN_BYTES};
use crate::pipe::Pipe;
use crate::stats::{ReadPath, SendPath, WritePath};
use crate::sys::uring::{Cqe, Dest, FixedBuf, IoBuf, Lent, MsgSend, Op, Sqe};
use deadlines::Deadlines;
use file_io::{FileAt, FileOp, FileOpKind};
use intake::{Parked, Recv, RecvSide, PAYLOAD_WITH_HEADER_MAX_BYTES};
use outbox::{InlineSend, Item, Payload, SendSide, Sending, SpliceSend};

/// Most operations in one splice chain (two per pipe-full).
const SPLICE_CHAIN_OPS_MAX: usize = 64;
/// Room asked for before a read's data in a registered run, for its reply header (at most 40
/// bytes: an extended-header `OFFSET_DATA` chunk); the run rounds it up to a whole page.
const READ_HEAD_ROOM_BYTES: usize = 64;

/// One connection: what it is (socket, export, the server's guard), its health, and its
/// parts, each with one job.
pub(super) struct Conn {
    key: ConnKey,
    socket: OwnedFd,
    /// Where requests come from when not from `socket`: a kTLS connection's plain text
    /// (see `Attach::tls_feed`).
    tls_feed: Option<OwnedFd>,
    ctx: TransmissionContext,
    /// Runs what the ring does not, and holds the export's stack, whose places (and the
    /// descriptors they name) stay valid while it is held.
    dispatcher: Arc<Dispatcher>,
    /// What kind of places the stack maps requests to (`None`: none; every request goes
    /// through the dispatcher).
    medium: Option<Medium>,
    /// The export's stack never waits (a memory or null export): what the ring does not
    /// answer by a mechanism of its own runs on the ring thread rather than a worker (see
    /// [`INLINE_BYTES_MAX`]).
    inline: bool,
    /// Where the request being started lives (reused for every request).
    map: Map,
    /// The server's guard for this client, dropped when the connection is closed.
    detach: Option<Box<dyn std::any::Any + Send>>,
    /// No more requests will be read (client closed, disconnect, or protocol violation).
    eof: bool,
    /// The socket is unusable: nothing more is sent.
    broken: bool,
    /// Operations in flight in the kernel.
    ops: usize,
    /// Receiving requests: stage, session, what is being received.
    rx: RecvSide,
    /// Sending replies: outbox, send mechanisms.
    tx: SendSide,
    /// Requests in flight and the bytes they hold.
    budget: Budget,
    /// The clocks of the write and idle timeouts.
    deadlines: Deadlines,
    /// File reads and writes in flight, by the index in their `user_data`.
    file_ops: Vec<Option<FileOp>>,
}

/// Where a connection receives requests from: its socket, or a kTLS connection's feed (a
/// function of the two fields, so it borrows neither the rest of the connection).
fn rx_fd<'a>(tls_feed: &'a Option<OwnedFd>, socket: &'a OwnedFd) -> &'a OwnedFd {
    tls_feed.as_ref().unwrap_or(socket)
}

/// The bytes of `more` pipes (each with the bytes it holds), in order, then `tail`: a piped
/// reply's data after its first pipe, for a send that splices from one pipe only.
fn fold_into_tail(more: Vec<(Pipe, usize)>, tail: Vec<u8>) -> std::io::Result<Vec<u8>> {
    let piped: usize = more.iter().map(|(_, n)| n).sum();
    let mut bytes = Vec::with_capacity(piped + tail.len());
    for (pipe, n) in more {
        pipe.read_exact_into(n, &mut bytes)?;
    }
    bytes.extend_from_slice(&tail);
    Ok(bytes)
}

/// Whether the connection's peer is on this host: a Unix socket, a loopback address, or
/// the connection's own address (a client that dialled one of this host's addresses).
/// Another address of this host, or a network namespace on it, looks like another host.
fn peer_on_this_host(socket: &OwnedFd) -> bool {
    let ip = |addr: Option<rustix::net::SocketAddrAny>| {
        addr.and_then(|a| std::net::SocketAddr::try_from(a).ok())
            .map(|a| a.ip().to_canonical())
    };
    let peer = ip(rustix::net::getpeername(socket).ok().flatten());
    let local = ip(rustix::net::getsockname(socket).ok());
    mechanism::is_same_host(peer, local)
}

fn is_retry(result: i32) -> bool {
    result == -libc::EINTR || result == -libc::EAGAIN
}

fn is_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
}

impl Conn {
    pub fn new(key: ConnKey, attach: Attach, shared: &EngineShared) -> Conn {
        let medium = attach.dispatcher.stack.medium();
        let stack = &attach.dispatcher.stack;
        // A stack whose reads come through a pipe (a plain-HTTP source, an NBD upstream)
        // answers them so here, where the ring splices the pipe on to the socket; not on the
        // copy baseline.
        let piped = stack.pipes_reads() && shared.options.data_path != DataPath::Copy;
        // Memory-export connections send with `sendfile` and piped ones splice their pipes,
        // both on the ring thread (never blocking: shmem pages need no I/O, and a piped
        // reply's bytes are already in its pipe); they need a nonblocking socket for it.
        // io_uring's own socket operations ignore O_NONBLOCK (they still wait for
        // readiness), but its splice to a socket honours it: no reply spliced by io_uring
        // goes over such a connection (a buffered file's would see EAGAIN; a stack that
        // pipes its reads never maps them to a file).
        // Not under kTLS: with the socket nonblocking (and shared with the feed thread) and
        // replies by `sendfile`, the VM lab's kernel client hung in 3 of 6 runs on Linux 6.1
        // (a request never answered, in reads and writes alike); with the socket left
        // blocking and reads sent from the mapping, 10 of 10 passed.
        let memory = medium == Some(Medium::Memory);
        let nonblocking = (memory || piped)
            && attach.tls_feed.is_none()
            && match rustix::io::ioctl_fionbio(&attach.socket, true) {
                Ok(()) => true,
                Err(e) => {
                    debug!("cannot make the socket nonblocking ({e}): replies spliced by io-wq");
                    false
                }
            };
        let sendfile_ok = memory && nonblocking;
        let on_this_host = peer_on_this_host(&attach.socket);
        let sendfile_min = mechanism::remote_splice_min(&shared.options, on_this_host);
        if sendfile_ok && sendfile_min != usize::MAX {
            debug!(
                "memory-export reads of {sendfile_min} bytes or more go by sendfile (peer {})",
                if on_this_host {
                    "on this host"
                } else {
                    "on another host"
                }
            );
        }
        // The kernel's TLS cannot send zero-copy (MSG_ZEROCOPY is refused): plain sends,
        // sendfile and splice it can.
        let zerocopy_ok = attach.tls_feed.is_none();
        // Spliced writes ask the socket (a kTLS connection's: its feed) how much it holds;
        // vsock on Linux 6.1 cannot say (EOPNOTSUPP), and its writes are then received into
        // buffers.
        let receives_from = rx_fd(&attach.tls_feed, &attach.socket);
        let socket_fionread = match rustix::io::ioctl_fionread(receives_from) {
            Ok(_) => true,
            Err(e) => {
                debug!("the socket does not answer FIONREAD ({e}): no spliced writes");
                false
            }
        };
        // vsock fails a MSG_WAITALL receive at least as long as its receive buffer (256 KiB
        // by default) with ENOMEM rather than wait: its payloads are received as they come.
        let payload_wait_all = rustix::net::getsockname(receives_from).map_or(true, |a| {
            a.address_family() != rustix::net::AddressFamily::VSOCK
        });
        let inline = stack.never_waits() && !stack.is_asynchronous();
        let dispatcher = match piped {
            true => {
                let mut with_pipes = (*attach.dispatcher).clone();
                // An NBD upstream's reads: spliced from the upstream's socket to a client on
                // another host, from the memory export's sendfile size
                // (`mechanism::remote_splice_min`); zerocopy: all.
                let min = match shared.options.data_path {
                    DataPath::ZeroCopy => 0,
                    _ => sendfile_min,
                };
                with_pipes.take_piped_reads(min);
                Arc::new(with_pipes)
            }
            false => attach.dispatcher,
        };
        Conn {
            key,
            socket: attach.socket,
            tls_feed: attach.tls_feed,
            ctx: attach.ctx,
            dispatcher,
            medium,
            inline,
            map: Map::default(),
            detach: Some(attach.detach),
            eof: false,
            broken: false,
            ops: 0,
            rx: RecvSide::new(
                attach.ctx,
                attach.leftover,
                mechanism::in_place_max(&shared.options),
                socket_fionread,
                payload_wait_all,
                shared.options.data_path == DataPath::Auto,
            ),
            tx: SendSide::new(
                nonblocking,
                sendfile_ok,
                (
                    sendfile_min,
                    mechanism::sendfile_tried(&shared.options, on_this_host),
                ),
                zerocopy_ok,
            ),
            budget: Budget::new(&shared.limits, Arc::clone(&shared.memory)),
            deadlines: Deadlines::new(Instant::now()),
            file_ops: Vec::new(),
        }
    }

    pub fn key(&self) -> ConnKey {
        self.key
    }

    /// Nothing more can happen on this connection.
    pub fn is_finished(&self) -> bool {
        let idle = self.budget.inflight() == 0 && self.ops == 0 && !self.rx.is_posted();
        (self.eof || self.broken) && idle
    }

    /// Closes the socket, then gives back what the server held for the client.
    pub fn close(mut self) {
        if self.rx.parked.take().is_some() {
            self.budget.memory().stop_waiting();
        }
        let detach = self.detach.take();
        if self.tls_feed.is_some() {
            // The feed thread may be waiting for the client's next record: wake it.
            hang_up(&self.socket);
        }
        drop(self.tls_feed);
        drop(self.socket);
        drop(detach);
    }

    pub fn start(&mut self, cx: &mut Cx<'_>) {
        self.pump(cx);
    }

    /// Accounts for `count` operations just submitted, or fails the connection if the
    /// submission failed (the driver has then taken back what it lent them).
    fn submitted(&mut self, result: std::io::Result<()>, count: usize) -> bool {
        match result {
            Ok(()) => {
                self.ops += count;
                true
            }
            Err(e) => {
                self.fail(&format!("cannot submit: {e}"));
                false
            }
        }
    }

    /// Posts whatever can run now: requests already received, the next receive, and (at the
    /// end of the ring's turn, so that every reply of the turn shares it) the next send.
    ///
    /// Replies that will not wait for the next receive go out before it is posted
    /// ([`Self::send_queued`] posts it): the reply then acknowledges every byte the receive
    /// takes, where a receive of more than one segment the kernel has not acknowledged yet
    /// sends an ACK of its own first - a segment to the client and its delivery, as dear as
    /// the reply. (Under fio at iodepth 16 the server sent 0.45 pure ACKs per request that
    /// way: docs/benchmarks/history.md, section 22.)
    fn pump(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            self.drop_queued();
            return;
        }
        self.parse_staged(cx);
        let replies = self.tx.has_idle_replies();
        if replies && !self.rx.may_hold_replies() {
            cx.send_later(self.key);
            return;
        }
        self.post_recv(cx);
        if replies && !self.rx.hold_replies() {
            cx.send_later(self.key);
        }
    }

    /// Whether the connection waits for its client's next request and nothing else: every
    /// request answered, nothing of its own in the kernel but the receive (what a ring may
    /// poll for, `engine/poll.rs`).
    pub fn awaits_client(&self) -> bool {
        self.budget.inflight() == 0 && self.ops <= 1
    }

    /// Whether the connection waits for its client's next request and for nothing else but
    /// its own replies' plain send (which the kernel finishes as it is submitted): what a
    /// ring that coalesces may wait for as for a client (`thread.rs`).
    pub fn awaits_client_or_send(&self) -> bool {
        let sending = match &self.tx.outbox.current {
            None => 0,
            Some(Sending::Msg(send)) if !send.zerocopy => send.count,
            Some(_) => return false,
        };
        self.tx.outbox.queue.is_empty()
            && self.budget.inflight() == sending
            && self.ops <= 1 + usize::from(sending > 0)
    }

    /// Sends the replies queued during the ring's turn (see [`Cx::send_later`]), then posts
    /// the next receive if [`Self::pump`] left it for after them.
    pub fn send_queued(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            return self.drop_queued();
        }
        loop {
            self.kick_send(cx);
            // While the ring overlaps, the rest of a burst waits for the replies queued
            // before it (`parse_staged`) and is started when their send completes. Replies
            // sent inline (`sendfile`, a pipe spliced on) may all be gone by now, with no
            // completion to come: start the rest here.
            if self.broken || self.tx.is_sending() {
                break;
            }
            let started = *cx.started;
            self.parse_staged(cx);
            if *cx.started == started {
                break;
            }
        }
        self.post_recv(cx);
    }

    /// Hard disconnect: nothing more is read or sent.
    fn fail(&mut self, why: &str) {
        if !self.broken {
            debug!("connection failed: {why}");
            self.broken = true;
            hang_up(&self.socket);
        }
    }

    /// A broken connection sends and reads nothing more: its queued replies are dropped, and
    /// once no receive or splice of its is in flight, the request it was receiving is dropped
    /// as one cut short is, so that what they held is given back and the connection can
    /// close. (A send that fails while a payload is half received breaks the connection with
    /// no receive posted: nothing else would end it.) The ring calls this after every call on
    /// a connection.
    pub fn settle_broken(&mut self) {
        if !self.broken {
            return;
        }
        self.drop_queued();
        if self.eof || self.rx.is_posted() {
            return;
        }
        if matches!(&self.rx.state, Recv::Piped(w) if w.is_busy()) {
            return; // its completion drops it (`on_piped`)
        }
        self.stop_receiving();
    }

    /// Hard disconnect that also drops what the kernel still holds to send: after a write
    /// timeout the client is not reading, and zero-copy buffers lent to its socket would
    /// otherwise stay lent until TCP gives up on it.
    fn abort(&mut self, why: &str) {
        crate::stream::reset(&self.socket);
        self.fail(why);
    }

    /// Requests of this connection being worked on or answered (not the one whose payload
    /// is being received): while there are any, a silent client is waiting, not idle.
    fn waiting_on_us(&self) -> bool {
        let receiving = usize::from(!matches!(self.rx.state, Recv::Header));
        self.budget.inflight() > receiving
    }

    /// The ring's timer: disconnects a client past its write or idle deadline.
    pub fn on_tick(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            return;
        }
        let limits = &cx.shared.limits;
        let write_timeout = Duration::from_millis(limits.write_timeout_ms);
        if self.tx.is_sending() && self.deadlines.send_stalled(cx.now, write_timeout) {
            log_write_timeout(limits.write_timeout_ms);
            return self.abort("write timeout");
        }
        let payload_timeout = Duration::from_millis(limits.payload_timeout_ms);
        let in_payload = matches!(self.rx.state, Recv::Payload { .. } | Recv::Piped(_));
        if in_payload && self.deadlines.recv_idle(cx.now, payload_timeout) {
            // Its place in the export is given back (what landed is told to the layers).
            log_payload_timeout(limits.payload_timeout_ms);
            return self.abort("payload timeout");
        }
        let Some(idle_ms) = limits.idle_timeout_ms else {
            return;
        };
        let idle_timeout = Duration::from_millis(idle_ms);
        if !self.waiting_on_us() && self.deadlines.recv_idle(cx.now, idle_timeout) {
            log_idle_timeout(idle_ms);
            self.fail("idle timeout");
        }
    }

    fn drop_queued(&mut self) {
        while let Some(item) = self.tx.outbox.queue.pop_front() {
            self.retire(item, false);
        }
    }

    /// Counts an answered request out; `sent` says whether it reached the socket.
    fn retire(&mut self, item: Item, sent: bool) {
        self.budget.retire(item.held);
        if !sent {
            return;
        }
        let how = match item.payload {
            Payload::Splice { .. } | Payload::Piped { .. } => SendPath::Splice,
            Payload::Sendfile { .. } => SendPath::Sendfile,
            Payload::Reply(_) | Payload::Mapped { .. } => SendPath::Plain,
            // Zero-copy-capable replies that went in a plain batch (a zero-copy send is
            // counted when it settles, `settle_msg`).
            Payload::ZeroCopy(_) | Payload::Fixed(_) => SendPath::Plain,
        };
        let stats = &self.dispatcher.stats;
        stats.replies_sent(how, 1, item.data_bytes());
        // Sent whole: its pipes are empty, and the next piped reads may take them.
        if let Payload::Piped { pipe, more, .. } = item.payload {
            pipe.recycle();
            more.into_iter().for_each(|(pipe, _)| pipe.recycle());
        }
    }

    fn enqueue(&mut self, payload: Payload, held: usize) {
        self.tx.outbox.queue.push_back(Item { payload, held });
    }

    /// Queues the dispatcher's reply: one whose data waits in pipes is spliced from them (and
    /// the data's last bytes that no pipe took sent after them). Only the ring thread's own
    /// splices (a nonblocking socket) go from one pipe to the next: elsewhere the bytes of
    /// the pipes after the first are read into the tail (a copy, as if no pipe had taken
    /// them).
    fn enqueue_reply(&mut self, reply: Reply, held: usize) {
        if !reply.is_piped() {
            return self.enqueue(Payload::Reply(reply), held);
        }
        let Some(data) = reply.into_piped() else {
            return;
        };
        let PipedData {
            header,
            pipe,
            len,
            more,
            mut tail,
        } = data;
        let more: VecDeque<(Pipe, usize)> = if self.tx.nonblocking || more.is_empty() {
            more.into()
        } else {
            let folded = more.iter().map(|(_, n)| n).sum::<usize>();
            match fold_into_tail(more, tail) {
                Ok(bytes) => tail = bytes,
                Err(e) => {
                    // The reply is dropped: the request gives back what it held, as one whose
                    // reply could not be sent does.
                    self.budget.retire(held);
                    return self.fail(&format!("cannot read a reply's pipe: {e}"));
                }
            }
            self.dispatcher.stats.copied(folded);
            VecDeque::new()
        };
        let piped = Payload::Piped {
            header,
            pipe,
            len,
            more,
            tail,
        };
        self.enqueue(piped, held);
    }

    fn enqueue_ok(&mut self, header: &RequestHeader, held: usize) {
        let reply = ok_reply(self.ctx.mode, header);
        self.enqueue(Payload::Reply(reply), held);
    }

    fn enqueue_error(&mut self, header: &RequestHeader, errno: Errno, why: &str, held: usize) {
        let reply = error_reply(self.ctx.mode, header, errno, why);
        self.enqueue(Payload::Reply(reply), held);
    }

    fn data_header(&self, header: &RequestHeader, len: usize) -> Vec<u8> {
        data_header(self.ctx.mode, header, len)
    }

    /// One completion for this connection.
    pub fn on_completion(&mut self, cx: &mut Cx<'_>, tag: Tag, index: u16, cqe: Cqe) {
        let result = cqe.result;
        if !cqe.more {
            self.ops -= 1;
        }
        if result > 0 {
            self.deadlines.on_progress(tag, cx.now);
        }
        match tag {
            Tag::Recv => self.on_recv(cx, result, cqe.sock_nonempty),
            Tag::Send => self.on_send(cx, cqe),
            Tag::SpliceHeader | Tag::SpliceIn | Tag::SpliceOut | Tag::SpliceTail => {
                self.on_splice(cx, tag, result)
            }
            Tag::FileRead | Tag::FileWrite => self.on_file(cx, usize::from(index), result),
            Tag::Writable => self.on_writable(cx, result),
            Tag::PipeIn | Tag::PipeOut => self.on_piped(cx, tag, result),
        }
        self.pump(cx);
    }
}

/// Hard-disconnects a socket (both directions), ignoring errors: it may already be closed.
pub(super) fn hang_up(socket: &OwnedFd) {
    let _ = rustix::net::shutdown(socket, rustix::net::Shutdown::Both);
}
