//! One connection on a ring: receive headers and payloads, run reads and writes with the
//! cheapest mechanism the data path allows, hand everything else to the worker pool, and send
//! replies.
//!
//! Ownership rule: any memory an operation in flight points to (the header buffer, a payload
//! buffer, a send's iovecs, the pipe) is heap-allocated and owned by the connection, which is
//! not freed until `ops` - the operations in flight - is back to zero. A connection may move
//! inside the ring's table; the memory the kernel sees does not.

mod file_io;
mod outgoing;
mod piped_write;
mod receive;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types};
use tracing::{debug, info, warn};
use zcnbd_proto::consts::cmd_flags;
use zcnbd_proto::{
    Command, Errno, ReplyMode, ReplyTo, RequestHeader, ServerEvent, ServerSession, ServerWant,
    TransmissionContext,
};

use super::fixed::FixedBuf;
use super::lent::Lent;
use super::ring::{ConnKey, Cx, Tag};
use super::send::{Item, MsgSend, Outbox, Payload, SendfileSend, Sending, SpliceSend};
use super::{hang_up, Attach, EngineOptions, EngineShared, Inbox};
use crate::buffer_pool::PooledBuf;
use crate::dispatch::{error_reply, Dispatcher, Reply, Request};
use crate::export::{errno_of, DataSource, DIRECT_ALIGN_BYTES};
use crate::policy::mechanism::{
    self, ReadFacts, ReadMechanism, SourceKind, WriteFacts, WriteMechanism,
};
use crate::sys::mapping::Mapping;
use piped_write::PipedWrite;

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied anyway.
const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;
/// Most operations in one splice chain (two per pipe-full).
const SPLICE_CHAIN_OPS_MAX: usize = 64;
/// Pipe size asked for (Linux's default limit for unprivileged processes).
const PIPE_BYTES: usize = 1 << 20;
/// Request headers one receive may take while the client sends no writes (16 extended
/// headers): a run of reads costs one receive, not one per request.
const HEADER_STAGE_BYTES: usize = 16 * 32;
/// Payload-less requests in a row after which headers are received in batches. After a
/// write the receive goes back to one exact header, so the next payload lands in place
/// rather than in the stage (from where it would have to be copied).
const BATCH_AFTER_PLAIN_REQUESTS: u32 = 16;
/// Payloads up to this long are received together with the next request's header, in one
/// `recvmsg` of two iovecs (payload in place, then the header into the stage): a stream of
/// small writes costs one receive per request rather than two. Such a receive cannot wait
/// for all its bytes (the next request may never come), so larger payloads, which would
/// then arrive in many pieces, are received alone with `MSG_WAITALL`.
const PAYLOAD_WITH_HEADER_MAX_BYTES: usize = 64 * 1024;
/// Scratch space for discarding refused payloads.
const DISCARD_BYTES: usize = 16 * 1024;
/// Room asked for before a read's data in a registered run, for its reply header (at most 40
/// bytes: an extended-header `OFFSET_DATA` chunk); the run rounds it up to a whole page.
const READ_HEAD_ROOM_BYTES: usize = 64;

/// Where the export's bytes are, as the engine uses them. Descriptors stay open as long as
/// the dispatcher's backend, which the connection holds.
enum Source {
    Memory { fd: RawFd, map: Arc<Mapping> },
    PageCache { fd: RawFd },
    Direct { direct: RawFd, buffered: RawFd },
    Synthetic,
}

/// Where a write payload is being received.
enum Dest {
    /// Straight into the memory export's mapping.
    Mapped(*mut u8),
    /// Into a buffer.
    Buffer(PooledBuf),
    /// Into a registered run, then written to the O_DIRECT descriptor `fd` with `WRITE_FIXED`.
    Fixed { buf: FixedBuf, fd: RawFd },
}

impl Dest {
    /// Where the payload's first byte goes.
    fn base_ptr(&mut self) -> *mut u8 {
        match self {
            Dest::Mapped(ptr) => *ptr,
            Dest::Buffer(buf) => buf.as_mut_ptr(),
            Dest::Fixed { buf, .. } => buf.data_ptr(),
        }
    }
}

/// What the receive side is doing.
enum Recv {
    /// Between requests: headers are received into the connection's stage.
    Header,
    Payload {
        header: RequestHeader,
        /// Lent to the receive posted for the payload, if any.
        dest: Lent<Dest>,
        got: usize,
        len: usize,
        held: usize,
        /// Bytes that arrived in the header stage and were copied into place.
        staged: usize,
    },
    Discard {
        remaining: usize,
        reply: Option<Reply>,
    },
    /// A buffered-file write spliced from the socket through a pipe into the file.
    Piped(Box<PipedWrite>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FileOpKind {
    Read,
    Write,
}

/// The memory a file operation reads into or writes from.
enum FileBuf {
    /// A pooled buffer: plain `READ` / `WRITE`.
    Pooled(PooledBuf),
    /// A registered run: `READ_FIXED` / `WRITE_FIXED`.
    Fixed(FixedBuf),
}

impl FileBuf {
    fn len(&self) -> usize {
        match self {
            FileBuf::Pooled(buf) => buf.len(),
            FileBuf::Fixed(buf) => buf.len(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            FileBuf::Pooled(buf) => buf.as_mut_ptr(),
            FileBuf::Fixed(buf) => buf.data_ptr(),
        }
    }

    /// The registered buffer a fixed operation names, if this is a registered run.
    fn fixed_index(&self) -> Option<u16> {
        match self {
            FileBuf::Fixed(buf) => Some(buf.index()),
            FileBuf::Pooled(_) => None,
        }
    }
}

/// A read or write of the backend file in flight.
struct FileOp {
    kind: FileOpKind,
    header: RequestHeader,
    fd: RawFd,
    /// Lent to the read or write in flight, if any.
    buf: Lent<FileBuf>,
    /// The buffer's length (the bytes to read or write).
    len: usize,
    done: usize,
    held: usize,
    direct: bool,
}

/// The `msghdr` and iovecs of a payload-plus-header receive, boxed so the kernel's pointers
/// stay valid while the connection moves.
struct RecvMsg {
    msg: libc::msghdr,
    iov: [libc::iovec; 2],
}

impl RecvMsg {
    fn new() -> Box<RecvMsg> {
        // SAFETY: msghdr and iovec are plain C structs of integers and pointers (plus, on some
        // libcs, padding), for all of which zero is a valid value.
        unsafe { Box::new(std::mem::zeroed()) }
    }
}

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

impl Pipe {
    fn new() -> std::io::Result<Pipe> {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // A smaller pipe only means more steps per reply.
        let capacity = rustix::pipe::fcntl_setpipe_size(&write, PIPE_BYTES).unwrap_or(65536);
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }
}

pub(super) struct Conn {
    key: ConnKey,
    socket: OwnedFd,
    ctx: TransmissionContext,
    /// The request stream's meaning: what each header asks, and what to read next.
    session: ServerSession,
    dispatcher: Arc<Dispatcher>,
    source: Source,
    /// The server's guard for this client, dropped when the connection is closed.
    detach: Option<Box<dyn std::any::Any + Send>>,
    /// Received request bytes not yet parsed: `stage[stage_start..stage_end]`. At least
    /// [`HEADER_STAGE_BYTES`] long; longer when the handshake handed over more.
    stage: Box<[u8]>,
    stage_start: usize,
    stage_end: usize,
    /// Payload-less requests since the last write (see [`BATCH_AFTER_PLAIN_REQUESTS`]).
    plain_run: u32,
    recv: Recv,
    recv_posted: bool,
    /// The iovecs of a payload receive that also takes the next header.
    recv_msg: Box<RecvMsg>,
    /// Bytes of the posted receive that go to the payload; any beyond go to the stage.
    recv_payload_bytes: usize,
    /// No more requests will be read (client closed, disconnect, or protocol violation).
    eof: bool,
    /// The socket is unusable: nothing more is sent.
    broken: bool,
    /// Requests accepted and not yet answered (sent, or dropped because broken).
    inflight: usize,
    /// Buffer bytes those requests hold.
    held: usize,
    /// Operations in flight in the kernel.
    ops: usize,
    file_ops: Vec<Option<FileOp>>,
    outbox: Outbox,
    pipe: Option<Pipe>,
    /// The pipe spliced writes pass through (the send side has its own).
    recv_pipe: Option<Pipe>,
    /// Zero-copy sends still worth trying (false once the kernel reported copying).
    zerocopy_ok: bool,
    /// The socket is nonblocking, so the ring thread may `sendfile` replies itself.
    sendfile_ok: bool,
    /// `auto`: memory-export writes up to this long are received in place.
    in_place_max: usize,
    /// `auto`: memory-export writes of every size are received in place while the engine is
    /// CPU-bound ([`super::EngineLoad::cpu_bound`]).
    in_place_when_cpu_bound: bool,
    scratch: Box<[u8]>,
    /// When the client last sent a byte (for `--idle-timeout`).
    last_recv_at: Instant,
    /// When the send in progress last moved bytes, or began (for `--write-timeout`).
    send_progress_at: Instant,
}

impl Source {
    fn kind(&self) -> SourceKind {
        match self {
            Source::Memory { .. } => SourceKind::Memory,
            Source::PageCache { .. } => SourceKind::PageCache,
            Source::Direct { .. } => SourceKind::Direct,
            Source::Synthetic => SourceKind::Synthetic,
        }
    }
}

fn source_of(backend: &dyn crate::export::Backend) -> Source {
    match backend.data_source() {
        DataSource::Memory { fd, mapping } => Source::Memory {
            fd: fd.as_raw_fd(),
            map: Arc::clone(mapping),
        },
        DataSource::PageCache { fd } => Source::PageCache { fd: fd.as_raw_fd() },
        DataSource::Direct { direct, buffered } => Source::Direct {
            direct: direct.as_raw_fd(),
            buffered: buffered.as_raw_fd(),
        },
        DataSource::Synthetic => Source::Synthetic,
    }
}

/// The header stage, holding the request bytes that arrived with the handshake.
fn stage_with(mut leftover: Vec<u8>) -> Box<[u8]> {
    let len = leftover.len().max(HEADER_STAGE_BYTES);
    leftover.resize(len, 0);
    leftover.into_boxed_slice()
}

fn is_retry(result: i32) -> bool {
    result == -libc::EINTR || result == -libc::EAGAIN
}

fn is_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
}

impl Conn {
    pub fn new(key: ConnKey, attach: Attach, shared: &EngineShared) -> Conn {
        let source = source_of(attach.dispatcher.backend.as_ref());
        // Only memory-export connections send with `sendfile` (never blocking: shmem pages
        // need no I/O); they need a nonblocking socket for it. io_uring's own socket
        // operations ignore O_NONBLOCK (they still wait for readiness), but its splice to a
        // socket honours it, which the buffered-file path relies on: that stays blocking.
        let sendfile_ok = matches!(source, Source::Memory { .. })
            && match rustix::io::ioctl_fionbio(&attach.socket, true) {
                Ok(()) => true,
                Err(e) => {
                    debug!("cannot make the socket nonblocking ({e}): no sendfile");
                    false
                }
            };
        let congestion = rustix::net::sockopt::tcp_congestion(&attach.socket).ok();
        let (in_place_max, in_place_when_cpu_bound) =
            mechanism::in_place_limit(&shared.options, congestion.as_deref());
        Conn {
            key,
            socket: attach.socket,
            session: ServerSession::new(attach.ctx),
            ctx: attach.ctx,
            dispatcher: attach.dispatcher,
            source,
            detach: Some(attach.detach),
            stage_end: attach.leftover.len(),
            stage: stage_with(attach.leftover),
            stage_start: 0,
            plain_run: 0,
            recv: Recv::Header,
            recv_posted: false,
            recv_msg: RecvMsg::new(),
            recv_payload_bytes: 0,
            eof: false,
            broken: false,
            inflight: 0,
            held: 0,
            ops: 0,
            file_ops: Vec::new(),
            outbox: Outbox::default(),
            pipe: None,
            recv_pipe: None,
            zerocopy_ok: true,
            sendfile_ok,
            in_place_max,
            in_place_when_cpu_bound,
            scratch: vec![0u8; DISCARD_BYTES].into_boxed_slice(),
            last_recv_at: Instant::now(),
            send_progress_at: Instant::now(),
        }
    }

    pub fn key(&self) -> ConnKey {
        self.key
    }

    /// Nothing more can happen on this connection.
    pub fn is_finished(&self) -> bool {
        (self.eof || self.broken) && self.inflight == 0 && self.ops == 0 && !self.recv_posted
    }

    /// Closes the socket, then gives back what the server held for the client.
    pub fn close(mut self) {
        let detach = self.detach.take();
        drop(self.socket);
        drop(detach);
    }

    pub fn start(&mut self, cx: &mut Cx<'_>) {
        self.pump(cx);
    }

    /// Queues the kernel operations for one entry list, accounting for them.
    fn push(&mut self, cx: &mut Cx<'_>, entries: &[squeue::Entry]) -> bool {
        // SAFETY: every entry built by this connection points only at memory the connection
        // owns on the heap (header stage, payload buffers, boxed sends, the pipe) or at the
        // export mapping it holds an Arc of; none of it is freed or moved before `ops` is back
        // to zero, which is_finished() requires before the connection is dropped.
        match unsafe { cx.push(entries) } {
            Ok(()) => {
                self.ops += entries.len();
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
    fn pump(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            self.drop_queued();
            return;
        }
        self.parse_staged(cx);
        self.post_recv(cx);
        if self.outbox.current.is_none() && !self.outbox.queue.is_empty() {
            cx.send_later(self.key);
        }
    }

    /// Sends the replies queued during the ring's turn (see [`Cx::send_later`]).
    pub fn send_queued(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            return self.drop_queued();
        }
        self.kick_send(cx);
    }

    /// Hard disconnect: nothing more is read or sent.
    fn fail(&mut self, why: &str) {
        if !self.broken {
            debug!("connection failed: {why}");
            self.broken = true;
            hang_up(&self.socket);
        }
    }

    /// Hard disconnect that also drops what the kernel still holds to send: after a write
    /// timeout the client is not reading, and zero-copy buffers lent to its socket would
    /// otherwise stay lent until TCP gives up on it.
    fn abort(&mut self, why: &str) {
        // connect(AF_UNSPEC) resets a TCP connection and purges its send queue (Unix sockets
        // refuse it, harmlessly: their queue goes with the socket).
        let _ = rustix::net::connect_unspec(&self.socket);
        self.fail(why);
    }

    /// Requests of this connection being worked on or answered (not the one whose payload
    /// is being received): while there are any, a silent client is waiting, not idle.
    fn waiting_on_us(&self) -> bool {
        let receiving = usize::from(!matches!(self.recv, Recv::Header));
        self.inflight > receiving
    }

    /// The ring's timer: disconnects a client past its write or idle deadline.
    pub fn on_tick(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            return;
        }
        let limits = &cx.shared.limits;
        let since = |t: Instant| cx.now.saturating_duration_since(t);
        let write_timeout = Duration::from_millis(limits.write_timeout_ms);
        if self.outbox.current.is_some() && since(self.send_progress_at) >= write_timeout {
            warn!(
                write_timeout_ms = limits.write_timeout_ms,
                "client read no reply bytes within the write timeout: disconnecting"
            );
            return self.abort("write timeout");
        }
        let Some(idle_ms) = limits.idle_timeout_ms else {
            return;
        };
        if !self.waiting_on_us() && since(self.last_recv_at) >= Duration::from_millis(idle_ms) {
            info!(idle_timeout_ms = idle_ms, "client idle: disconnecting");
            self.fail("idle timeout");
        }
    }

    fn drop_queued(&mut self) {
        while let Some(item) = self.outbox.queue.pop_front() {
            self.retire(item, false);
        }
    }

    /// Counts an answered request out; `sent` says whether it reached the socket.
    fn retire(&mut self, item: Item, sent: bool) {
        self.inflight -= 1;
        self.held -= item.held;
        if !sent {
            return;
        }
        let stats = &self.dispatcher.stats;
        stats.requests.add(1);
        let bytes = item.data_bytes() as u64;
        match item.payload {
            Payload::Reply(_) | Payload::Mapped { .. } => stats.sent_plain_bytes.add(bytes),
            Payload::Splice { .. } | Payload::Sendfile { .. } => stats.sent_splice_bytes.add(bytes),
            Payload::ZeroCopy(_) | Payload::Fixed(_) => stats.sent_plain_bytes.add(bytes),
        }
    }

    fn enqueue(&mut self, payload: Payload, held: usize) {
        self.outbox.queue.push_back(Item { payload, held });
    }

    fn reply_to(&self, header: &RequestHeader) -> ReplyTo {
        ReplyTo {
            mode: self.ctx.mode,
            cookie: header.cookie,
            offset: header.offset,
        }
    }

    fn enqueue_ok(&mut self, header: &RequestHeader, held: usize) {
        let mut bytes = Vec::with_capacity(32);
        self.reply_to(header).encode_ok(&mut bytes);
        self.enqueue(Payload::Reply(Reply::header_only(bytes)), held);
    }

    fn enqueue_error(&mut self, header: &RequestHeader, errno: Errno, why: &str, held: usize) {
        let reply = error_reply(self.ctx.mode, header, errno, why);
        self.enqueue(Payload::Reply(reply), held);
    }

    fn data_header(&self, header: &RequestHeader, len: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(40);
        self.reply_to(header)
            .encode_data_header(header.offset, len as u64, true, &mut bytes);
        bytes
    }

    /// One completion for this connection.
    pub fn on_completion(
        &mut self,
        cx: &mut Cx<'_>,
        tag: Tag,
        index: u16,
        result: i32,
        flags: u32,
        more: bool,
    ) {
        if !more {
            self.ops -= 1;
        }
        if result > 0 {
            match tag {
                Tag::Recv | Tag::PipeIn => self.last_recv_at = cx.now,
                Tag::Send | Tag::SpliceHeader | Tag::SpliceOut | Tag::Writable => {
                    self.send_progress_at = cx.now
                }
                _ => {}
            }
        }
        match tag {
            Tag::Recv => self.on_recv(cx, result),
            Tag::Send => self.on_send(cx, result, flags, more),
            Tag::SpliceHeader | Tag::SpliceIn | Tag::SpliceOut => self.on_splice(cx, tag, result),
            Tag::FileRead | Tag::FileWrite => self.on_file(cx, usize::from(index), result),
            Tag::Writable => self.on_writable(cx, result),
            Tag::PipeIn | Tag::PipeOut => self.on_piped(cx, tag, result),
            Tag::Wake | Tag::Tick => {}
        }
        self.pump(cx);
    }
}
