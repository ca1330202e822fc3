//! One connection on a ring: receive headers and payloads, run reads and writes with the
//! cheapest mechanism the data path allows, hand everything else to the worker pool, and send
//! replies.
//!
//! Ownership rule: any memory an operation in flight points to (the header buffer, a payload
//! buffer, a send's iovecs, the pipe) is heap-allocated and owned by the connection, which is
//! not freed until `ops` - the operations in flight - is back to zero. A connection may move
//! inside the ring's table; the memory the kernel sees does not.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crossbeam_channel::Sender;
use io_uring::{opcode, squeue, types};
use tracing::{debug, warn};
use zcnbd_proto::consts::cmd_flags;
use zcnbd_proto::{
    validate_request, Command, Errno, ReplyMode, ReplyTo, RequestHeader, TransmissionContext,
};

use super::ring::{ConnKey, Cx, Tag};
use super::send::{Item, MsgSend, Outbox, Payload, Sending, SpliceSend};
use super::{hang_up, Attach, DataPath, EngineShared, Inbox};
use crate::buffer_pool::PooledBuf;
use crate::dispatch::{error_reply, Dispatcher, Reply, Request};
use crate::export::{errno_of, DataSource, DIRECT_ALIGN_BYTES};
use crate::sys::mapping::Mapping;

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied anyway.
const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;
/// Most operations in one splice chain (two per pipe-full).
const SPLICE_CHAIN_OPS_MAX: usize = 64;
/// Pipe size asked for (Linux's default limit for unprivileged processes).
const PIPE_BYTES: usize = 1 << 20;
/// Scratch space for discarding refused payloads.
const DISCARD_BYTES: usize = 16 * 1024;

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
}

/// What the receive side is doing.
enum Recv {
    Header {
        filled: usize,
    },
    Payload {
        header: RequestHeader,
        dest: Dest,
        got: usize,
        len: usize,
        held: usize,
    },
    Discard {
        remaining: usize,
        reply: Option<Reply>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FileOpKind {
    Read,
    Write,
}

/// A read or write of the backend file in flight.
struct FileOp {
    kind: FileOpKind,
    header: RequestHeader,
    fd: RawFd,
    buf: PooledBuf,
    done: usize,
    held: usize,
    direct: bool,
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
    dispatcher: Arc<Dispatcher>,
    source: Source,
    done: Option<Sender<()>>,
    header: Box<[u8; 32]>,
    recv: Recv,
    recv_posted: bool,
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
    /// Zero-copy sends still worth trying (false once the kernel reported copying).
    zerocopy_ok: bool,
    scratch: Box<[u8]>,
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

fn is_retry(result: i32) -> bool {
    result == -libc::EINTR || result == -libc::EAGAIN
}

fn is_aligned(buf: &[u8], offset: u64) -> bool {
    (buf.as_ptr() as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
        && offset.is_multiple_of(DIRECT_ALIGN_BYTES)
        && (buf.len() as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
}

impl Conn {
    pub fn new(key: ConnKey, attach: Attach, _shared: &EngineShared) -> Conn {
        let source = source_of(attach.dispatcher.backend.as_ref());
        Conn {
            key,
            socket: attach.socket,
            ctx: attach.ctx,
            dispatcher: attach.dispatcher,
            source,
            done: Some(attach.done),
            header: Box::new([0; 32]),
            recv: Recv::Header { filled: 0 },
            recv_posted: false,
            eof: false,
            broken: false,
            inflight: 0,
            held: 0,
            ops: 0,
            file_ops: Vec::new(),
            outbox: Outbox::default(),
            pipe: None,
            zerocopy_ok: true,
            scratch: vec![0u8; DISCARD_BYTES].into_boxed_slice(),
        }
    }

    pub fn key(&self) -> ConnKey {
        self.key
    }

    /// Nothing more can happen on this connection.
    pub fn is_finished(&self) -> bool {
        (self.eof || self.broken) && self.inflight == 0 && self.ops == 0 && !self.recv_posted
    }

    /// Closes the socket and tells the handshake thread.
    pub fn close(mut self) {
        if let Some(done) = self.done.take() {
            drop(self.socket);
            let _ = done.send(());
        }
    }

    pub fn start(&mut self, cx: &mut Cx<'_>) {
        self.pump(cx);
    }

    /// Queues the kernel operations for one entry list, accounting for them.
    fn push(&mut self, cx: &mut Cx<'_>, entries: &[squeue::Entry]) -> bool {
        // SAFETY: every entry built by this connection points only at memory the connection
        // owns on the heap (header box, payload buffers, boxed sends, the pipe) or at the
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

    /// Posts whatever can run now: the next receive and the next send.
    fn pump(&mut self, cx: &mut Cx<'_>) {
        if self.broken {
            self.drop_queued();
            return;
        }
        self.post_recv(cx);
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
            Payload::Splice { .. } => stats.sent_splice_bytes.add(bytes),
            Payload::ZeroCopy(_) => stats.sent_plain_bytes.add(bytes),
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

    // ---- receive side ----

    fn can_take_request(&self, cx: &Cx<'_>) -> bool {
        let limits = &cx.shared.limits;
        self.inflight < limits.requests_inflight_max && self.held < limits.inflight_bytes_max
    }

    fn post_recv(&mut self, cx: &mut Cx<'_>) {
        if self.recv_posted || self.eof || self.broken {
            return;
        }
        let header_bytes = self.ctx.mode.request_header_bytes();
        let room = self.can_take_request(cx);
        let (ptr, len) = match &mut self.recv {
            Recv::Header { filled } => {
                if !room {
                    return;
                }
                (
                    self.header[*filled..header_bytes].as_mut_ptr(),
                    header_bytes - *filled,
                )
            }
            Recv::Payload { dest, got, len, .. } => {
                let base = match dest {
                    Dest::Mapped(ptr) => *ptr,
                    Dest::Buffer(buf) => buf.as_mut_ptr(),
                };
                // `got < len`: a complete payload leaves this state at once.
                (base.wrapping_add(*got), *len - *got)
            }
            Recv::Discard { remaining, .. } => (
                self.scratch.as_mut_ptr(),
                (*remaining).min(self.scratch.len()),
            ),
        };
        let entry = opcode::Recv::new(types::Fd(self.socket.as_raw_fd()), ptr, len as u32)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(self.key.op(Tag::Recv, 0));
        if self.push(cx, &[entry]) {
            self.recv_posted = true;
        }
    }

    fn on_recv(&mut self, cx: &mut Cx<'_>, result: i32) {
        self.recv_posted = false;
        if is_retry(result) {
            return;
        }
        if result <= 0 {
            self.end_of_requests(result);
            return;
        }
        let n = result as usize;
        match &mut self.recv {
            Recv::Header { filled } => {
                *filled += n;
                if *filled == self.ctx.mode.request_header_bytes() {
                    self.recv = Recv::Header { filled: 0 };
                    self.on_header(cx);
                }
            }
            Recv::Payload { got, len, .. } => {
                *got += n;
                if *got == *len {
                    self.on_payload(cx);
                }
            }
            Recv::Discard { remaining, reply } => {
                *remaining -= n;
                if *remaining == 0 {
                    let reply = reply.take();
                    self.recv = Recv::Header { filled: 0 };
                    if let Some(reply) = reply {
                        self.enqueue(Payload::Reply(reply), 0);
                    }
                }
            }
        }
    }

    /// The client closed, reset, or the read failed: no more requests. A request whose
    /// payload was cut short is dropped (it can never be answered correctly).
    fn end_of_requests(&mut self, result: i32) {
        if result < 0 {
            debug!(
                "receive failed: {}",
                std::io::Error::from_raw_os_error(-result)
            );
        }
        self.eof = true;
        match std::mem::replace(&mut self.recv, Recv::Header { filled: 0 }) {
            Recv::Payload { held, .. } => {
                self.inflight -= 1;
                self.held -= held;
            }
            Recv::Discard { .. } => self.inflight -= 1,
            Recv::Header { .. } => {}
        }
    }

    fn on_header(&mut self, cx: &mut Cx<'_>) {
        let mode = self.ctx.mode;
        let raw = &self.header[..mode.request_header_bytes()];
        let header = match RequestHeader::decode(raw, mode) {
            Ok(Some(h)) => h,
            Ok(None) => return,
            Err(e) => {
                warn!("{e}: disconnecting client");
                self.eof = true;
                return;
            }
        };
        let payload = header.payload_bytes(mode);
        // Hard disconnect for a payload over the advertised maximum, as in the portable
        // engine (see connection.rs for the spec's words).
        if payload > u64::from(self.ctx.block_size.payload_max) {
            warn!(
                payload,
                "payload over the advertised maximum: disconnecting"
            );
            self.eof = true;
            return;
        }
        let payload = payload as usize;
        match validate_request(&header, &self.ctx) {
            Err(rejection) => {
                debug!(cookie = header.cookie, "refused: {}", rejection.reason);
                self.inflight += 1;
                let reply = error_reply(mode, &header, rejection.errno, rejection.reason);
                if payload > 0 {
                    self.recv = Recv::Discard {
                        remaining: payload,
                        reply: Some(reply),
                    };
                } else {
                    self.enqueue(Payload::Reply(reply), 0);
                }
            }
            Ok(Command::Disc) => self.eof = true,
            Ok(command) => {
                self.inflight += 1;
                match command {
                    Command::Write => self.start_write(cx, header, payload),
                    Command::Read => self.start_read(cx, header),
                    _ => self.delegate(cx, header, command, None, 0),
                }
            }
        }
    }

    fn start_write(&mut self, cx: &mut Cx<'_>, header: RequestHeader, len: usize) {
        if len == 0 {
            return self.enqueue_ok(&header, 0);
        }
        let options = &cx.shared.options;
        let in_place_pays = match options.data_path {
            DataPath::Copy => false,
            DataPath::ZeroCopy => true,
            DataPath::Auto => len <= options.receive_in_place_max_bytes,
        };
        let in_place = match &self.source {
            Source::Memory { map, .. } if in_place_pays => map.range_ptr(header.offset, len),
            _ => None,
        };
        let (dest, held) = match in_place {
            Some(ptr) => (Dest::Mapped(ptr), 0),
            None => (Dest::Buffer(cx.shared.pool.get(len)), len),
        };
        self.held += held;
        self.recv = Recv::Payload {
            header,
            dest,
            got: 0,
            len,
            held,
        };
    }

    fn on_payload(&mut self, cx: &mut Cx<'_>) {
        let Recv::Payload {
            header,
            dest,
            len,
            held,
            ..
        } = std::mem::replace(&mut self.recv, Recv::Header { filled: 0 })
        else {
            return;
        };
        let stats = Arc::clone(&self.dispatcher.stats);
        let buf = match dest {
            Dest::Mapped(_) => {
                stats.received_in_place_bytes.add(len as u64);
                stats.write_bytes.add(len as u64);
                return self.enqueue_ok(&header, held);
            }
            Dest::Buffer(buf) => buf,
        };
        match &self.source {
            Source::Memory { map, .. } => {
                // The copy baseline: a bounce buffer, then memcpy into place.
                map.copy_in(header.offset, &buf);
                stats.copied_bytes.add(len as u64);
                stats.write_bytes.add(len as u64);
                self.enqueue_ok(&header, held);
            }
            Source::PageCache { fd } => {
                let fd = *fd;
                self.start_file_op(cx, FileOpKind::Write, header, fd, buf, held, false);
            }
            Source::Direct { direct, buffered } => {
                let aligned = is_aligned(&buf, header.offset);
                let fd = if aligned { *direct } else { *buffered };
                self.start_file_op(cx, FileOpKind::Write, header, fd, buf, held, aligned);
            }
            Source::Synthetic => self.delegate(cx, header, Command::Write, Some(buf), held),
        }
    }

    // ---- requests ----

    /// Runs a request on the worker pool; the reply comes back through the mailbox.
    fn delegate(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        command: Command,
        payload: Option<PooledBuf>,
        held: usize,
    ) {
        let dispatcher = Arc::clone(&self.dispatcher);
        let mailbox = cx.mailbox.clone();
        let key = self.key.packed();
        self.held += held.saturating_sub(payload.as_ref().map_or(0, |p| p.len()));
        cx.shared.workers.submit(Box::new(move || {
            let reply = dispatcher.execute(Request {
                header,
                command,
                payload,
            });
            mailbox.send(Inbox::Answered { key, reply, held });
        }));
    }

    /// A reply from the worker pool.
    pub fn on_answered(&mut self, cx: &mut Cx<'_>, reply: Reply, held: usize) {
        self.enqueue(Payload::Reply(reply), held);
        self.pump(cx);
    }

    /// Whether `[offset, offset+length)` is all data, so one content chunk can answer it.
    fn all_data(&self, header: &RequestHeader) -> bool {
        let mut extents = Vec::with_capacity(2);
        let backend = &self.dispatcher.backend;
        if backend
            .extents(header.offset, header.length, 2, &mut extents)
            .is_err()
        {
            return false;
        }
        matches!(extents.as_slice(), [e] if e.flags == 0 && e.length >= header.length)
    }

    fn start_read(&mut self, cx: &mut Cx<'_>, header: RequestHeader) {
        let len = header.length as usize;
        let sparse_allowed =
            self.ctx.mode != ReplyMode::Simple && header.flags & cmd_flags::DF == 0;
        if len == 0
            || matches!(self.source, Source::Synthetic)
            || (sparse_allowed && !self.all_data(&header))
        {
            return self.delegate(cx, header, Command::Read, None, len);
        }
        let options = &cx.shared.options;
        let splice = match options.data_path {
            DataPath::Copy => false,
            DataPath::ZeroCopy => true,
            DataPath::Auto => len >= options.splice_min_bytes,
        };
        let copy = options.data_path == DataPath::Copy;
        match &self.source {
            Source::Memory { fd, map } if !copy => {
                self.dispatcher.stats.read_bytes.add(len as u64);
                let header_bytes = self.data_header(&header, len);
                let payload = if splice {
                    Payload::Splice {
                        header: header_bytes,
                        fd: *fd,
                        offset: header.offset,
                        len,
                    }
                } else {
                    let map = Arc::clone(map);
                    Payload::Mapped {
                        header: header_bytes,
                        map,
                        offset: header.offset,
                        len,
                    }
                };
                self.enqueue(payload, 0);
            }
            Source::PageCache { fd } if splice => {
                self.dispatcher.stats.read_bytes.add(len as u64);
                let header_bytes = self.data_header(&header, len);
                let fd = *fd;
                self.enqueue(
                    Payload::Splice {
                        header: header_bytes,
                        fd,
                        offset: header.offset,
                        len,
                    },
                    0,
                );
            }
            Source::Memory { fd, .. } | Source::PageCache { fd } => {
                let fd = *fd;
                let buf = cx.shared.pool.get(len);
                self.held += len;
                self.start_file_op(cx, FileOpKind::Read, header, fd, buf, len, false);
            }
            Source::Direct { direct, buffered } => {
                let (direct, buffered) = (*direct, *buffered);
                let buf = cx.shared.pool.get(len);
                let aligned = is_aligned(&buf, header.offset);
                let fd = if aligned { direct } else { buffered };
                self.held += len;
                self.start_file_op(cx, FileOpKind::Read, header, fd, buf, len, aligned);
            }
            Source::Synthetic => unreachable!("null reads are delegated above"),
        }
    }

    // ---- file reads and writes ----

    #[allow(clippy::too_many_arguments)]
    fn start_file_op(
        &mut self,
        cx: &mut Cx<'_>,
        kind: FileOpKind,
        header: RequestHeader,
        fd: RawFd,
        buf: PooledBuf,
        held: usize,
        direct: bool,
    ) {
        let op = FileOp {
            kind,
            header,
            fd,
            buf,
            done: 0,
            held,
            direct,
        };
        let index = match self.file_ops.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.file_ops.push(None);
                self.file_ops.len() - 1
            }
        };
        self.file_ops[index] = Some(op);
        self.post_file_op(cx, index);
    }

    fn post_file_op(&mut self, cx: &mut Cx<'_>, index: usize) {
        let Some(op) = self.file_ops[index].as_mut() else {
            return;
        };
        let rest = op.buf.len() - op.done;
        let ptr = op.buf.as_mut_ptr().wrapping_add(op.done);
        let offset = op.header.offset + op.done as u64;
        let fd = types::Fd(op.fd);
        let (entry, tag) = match op.kind {
            FileOpKind::Read => (
                opcode::Read::new(fd, ptr, rest as u32)
                    .offset(offset)
                    .build(),
                Tag::FileRead,
            ),
            FileOpKind::Write => {
                let fua = op.header.flags & cmd_flags::FUA != 0;
                let flags = if fua { libc::RWF_DSYNC } else { 0 };
                let write = opcode::Write::new(fd, ptr, rest as u32)
                    .offset(offset)
                    .rw_flags(flags);
                (write.build(), Tag::FileWrite)
            }
        };
        let entry = entry.user_data(self.key.op(tag, index as u16));
        if !self.push(cx, &[entry]) {
            self.finish_file_op(index, Err((Errno::Io, "cannot submit".into())));
        }
    }

    fn on_file(&mut self, cx: &mut Cx<'_>, index: usize, result: i32) {
        let Some(op) = self.file_ops.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if is_retry(result) {
            return self.post_file_op(cx, index);
        }
        if result < 0 {
            let e = std::io::Error::from_raw_os_error(-result);
            return self.finish_file_op(index, Err((errno_of(&e), format!("{e}"))));
        }
        if result == 0 {
            return self.finish_file_op(index, Err((Errno::Io, "unexpected end of file".into())));
        }
        op.done += result as usize;
        if op.done < op.buf.len() {
            return self.post_file_op(cx, index);
        }
        self.finish_file_op(index, Ok(()));
    }

    fn finish_file_op(&mut self, index: usize, result: Result<(), (Errno, String)>) {
        let Some(op) = self.file_ops[index].take() else {
            return;
        };
        let stats = Arc::clone(&self.dispatcher.stats);
        let len = op.buf.len() as u64;
        if let Err((errno, why)) = result {
            return self.enqueue_error(&op.header, errno, &why, op.held);
        }
        if !op.direct {
            // Through the page cache with a bounce buffer: a copy beyond the socket's.
            stats.copied_bytes.add(len);
        }
        match op.kind {
            FileOpKind::Write => {
                stats.write_bytes.add(len);
                self.enqueue_ok(&op.header, op.held);
            }
            FileOpKind::Read => {
                stats.read_bytes.add(len);
                let header_bytes = self.data_header(&op.header, op.buf.len());
                let reply = Reply::with_data(header_bytes, op.buf);
                let payload = if op.direct && self.zerocopy_ok {
                    Payload::ZeroCopy(reply)
                } else {
                    Payload::Reply(reply)
                };
                self.enqueue(payload, op.held);
            }
        }
    }

    // ---- send side ----

    fn kick_send(&mut self, cx: &mut Cx<'_>) {
        if self.outbox.current.is_some() || self.broken {
            return;
        }
        let zerocopy_ok = self.zerocopy_ok && self.zerocopy_pays(cx);
        let Some((mut items, zerocopy)) = self.outbox.next_batch(zerocopy_ok) else {
            return;
        };
        if matches!(items[0].payload, Payload::Splice { .. }) {
            let item = items.remove(0);
            let send = SpliceSend {
                item,
                header_sent: 0,
                piped: 0,
                sent: 0,
                pending: 0,
                error: None,
                mark: 0,
            };
            self.outbox.current = Some(Sending::Splice(Box::new(send)));
            return self.post_splice(cx);
        }
        self.outbox.current = Some(Sending::Msg(MsgSend::new(items, zerocopy)));
        self.post_msg(cx);
    }

    /// Whether zero-copy sends are used for the next reply on this data path.
    fn zerocopy_pays(&self, cx: &Cx<'_>) -> bool {
        let options = &cx.shared.options;
        let Some(front) = self.outbox.queue.front() else {
            return false;
        };
        match options.data_path {
            DataPath::Copy => false,
            DataPath::ZeroCopy => true,
            DataPath::Auto => front.data_bytes() >= options.zerocopy_send_min_bytes,
        }
    }

    fn post_msg(&mut self, cx: &mut Cx<'_>) {
        let Some(Sending::Msg(send)) = self.outbox.current.as_mut() else {
            return;
        };
        let msg = send.prepare();
        let fd = types::Fd(self.socket.as_raw_fd());
        let entry = if send.zerocopy {
            opcode::SendMsgZc::new(fd, msg)
                .ioprio(SEND_ZC_REPORT_USAGE)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build()
        } else {
            opcode::SendMsg::new(fd, msg)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build()
        };
        send.awaiting_result = true;
        let entry = entry.user_data(self.key.op(Tag::Send, 0));
        if !self.push(cx, &[entry]) {
            if let Some(Sending::Msg(send)) = self.outbox.current.as_mut() {
                send.awaiting_result = false;
            }
            self.settle_msg();
        }
    }

    fn on_send(&mut self, cx: &mut Cx<'_>, result: i32, flags: u32, more: bool) {
        let Some(Sending::Msg(send)) = self.outbox.current.as_mut() else {
            return;
        };
        if io_uring::cqueue::notif(flags) {
            send.notifications -= 1;
            if (result as u32) & NOTIF_USAGE_ZC_COPIED != 0 {
                send.copied = true;
            }
            return self.settle_msg();
        }
        send.awaiting_result = false;
        if more {
            send.notifications += 1;
        }
        if is_retry(result) {
            return self.post_msg(cx);
        }
        if send.zerocopy && result == -libc::EOPNOTSUPP {
            // Zero-copy send exists only for TCP/UDP (not Unix sockets): nothing was sent (a
            // notification may still come; settling waits for it), so
            // send the same bytes plainly and stop trying on this connection.
            send.zerocopy = false;
            self.zerocopy_ok = false;
            return self.post_msg(cx);
        }
        if result < 0 {
            let e = std::io::Error::from_raw_os_error(-result);
            self.fail(&format!("send failed: {e}"));
            return self.settle_msg();
        }
        if !send.advance(result as usize) {
            return self.post_msg(cx);
        }
        self.settle_msg();
    }

    /// Retires a send once everything about it has completed.
    fn settle_msg(&mut self) {
        let Some(Sending::Msg(send)) = self.outbox.current.as_ref() else {
            return;
        };
        let complete = send.sent >= send.total;
        if !send.is_settled() || (!complete && !self.broken) {
            return;
        }
        let Some(Sending::Msg(send)) = self.outbox.current.take() else {
            return;
        };
        if send.zerocopy && send.copied {
            // "The completion says COPIED": on this path zero-copy costs more than it saves.
            self.zerocopy_ok = false;
            debug!("kernel copied a zero-copy send; plain sends from now on");
        }
        let stats = Arc::clone(&self.dispatcher.stats);
        for item in send.items {
            if send.zerocopy && complete {
                let bytes = item.data_bytes() as u64;
                if send.copied {
                    stats.sent_zerocopy_copied_bytes.add(bytes);
                } else {
                    stats.sent_zerocopy_bytes.add(bytes);
                }
                stats.requests.add(1);
                self.inflight -= 1;
                self.held -= item.held;
            } else {
                self.retire(item, complete);
            }
        }
    }

    // ---- splice ----

    fn post_splice(&mut self, cx: &mut Cx<'_>) {
        if self.pipe.is_none() {
            match Pipe::new() {
                Ok(pipe) => self.pipe = Some(pipe),
                Err(e) => {
                    self.fail(&format!("cannot create a pipe: {e}"));
                    return self.settle_splice();
                }
            }
        }
        let Some(pipe) = self.pipe.as_ref() else {
            return;
        };
        let Some(Sending::Splice(send)) = self.outbox.current.as_mut() else {
            return;
        };
        let Payload::Splice {
            header,
            fd,
            offset,
            len,
        } = &send.item.payload
        else {
            return;
        };
        let sock = self.socket.as_raw_fd();
        let key = self.key;
        let mut entries: Vec<squeue::Entry> = Vec::with_capacity(8);
        if send.header_sent < header.len() {
            let rest = &header[send.header_sent..];
            let flags = libc::MSG_MORE | libc::MSG_NOSIGNAL;
            let e =
                opcode::Send::new(types::Fd(sock), rest.as_ptr(), rest.len() as u32).flags(flags);
            entries.push(e.build().user_data(key.op(Tag::SpliceHeader, 0)));
        }
        let out_flags = |end: usize| {
            // SPLICE_F_NONBLOCK makes a short fill show up as a short result rather than a
            // wait on a pipe nobody will write to; the socket side may still block (io-wq).
            let more = if end < *len { libc::SPLICE_F_MORE } else { 0 };
            libc::SPLICE_F_NONBLOCK | more
        };
        let in_pipe = send.piped - send.sent;
        if in_pipe > 0 {
            let e = opcode::Splice::new(
                types::Fd(pipe.read.as_raw_fd()),
                -1,
                types::Fd(sock),
                -1,
                in_pipe as u32,
            )
            .flags(out_flags(send.piped));
            entries.push(e.build().user_data(key.op(Tag::SpliceOut, 0)));
        }
        let mut pos = send.piped;
        while pos < *len && entries.len() + 2 <= SPLICE_CHAIN_OPS_MAX {
            let chunk = pipe.capacity.min(*len - pos);
            let file_offset = (*offset + pos as u64) as i64;
            let fill = opcode::Splice::new(
                types::Fd(*fd),
                file_offset,
                types::Fd(pipe.write.as_raw_fd()),
                -1,
                chunk as u32,
            )
            .flags(libc::SPLICE_F_MOVE);
            entries.push(fill.build().user_data(key.op(Tag::SpliceIn, 0)));
            let drain = opcode::Splice::new(
                types::Fd(pipe.read.as_raw_fd()),
                -1,
                types::Fd(sock),
                -1,
                chunk as u32,
            )
            .flags(out_flags(pos + chunk));
            entries.push(drain.build().user_data(key.op(Tag::SpliceOut, 0)));
            pos += chunk;
        }
        let last = entries.len() - 1;
        for entry in &mut entries[..last] {
            *entry = entry.clone().flags(squeue::Flags::IO_LINK);
        }
        send.pending = entries.len();
        send.mark = send.progress();
        if !self.push(cx, &entries) {
            if let Some(Sending::Splice(send)) = self.outbox.current.as_mut() {
                send.pending = 0;
            }
            self.settle_splice();
        }
    }

    fn on_splice(&mut self, cx: &mut Cx<'_>, tag: Tag, result: i32) {
        let Some(Sending::Splice(send)) = self.outbox.current.as_mut() else {
            return;
        };
        send.pending -= 1;
        if result >= 0 {
            let n = result as usize;
            match tag {
                Tag::SpliceHeader => send.header_sent += n,
                Tag::SpliceIn => send.piped += n,
                _ => send.sent += n,
            }
        } else if result != -libc::ECANCELED && !is_retry(result) {
            send.error.get_or_insert(result);
        }
        if send.pending > 0 {
            return;
        }
        let Payload::Splice { header, len, .. } = &send.item.payload else {
            return;
        };
        let complete = send.header_sent == header.len() && send.sent == *len;
        if let Some(error) = send.error {
            // Part of a reply may be on the wire: the stream cannot be resynchronised.
            let e = std::io::Error::from_raw_os_error(-error);
            self.fail(&format!("splice failed: {e}"));
        } else if !complete && send.progress() == send.mark {
            self.fail("splice moved no data");
        } else if !complete {
            return self.post_splice(cx);
        }
        self.settle_splice();
    }

    fn settle_splice(&mut self) {
        let Some(Sending::Splice(send)) = self.outbox.current.as_ref() else {
            return;
        };
        if send.pending > 0 {
            return;
        }
        let Some(Sending::Splice(send)) = self.outbox.current.take() else {
            return;
        };
        let complete = !self.broken;
        self.retire(send.item, complete);
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
        match tag {
            Tag::Recv => self.on_recv(cx, result),
            Tag::Send => self.on_send(cx, result, flags, more),
            Tag::SpliceHeader | Tag::SpliceIn | Tag::SpliceOut => self.on_splice(cx, tag, result),
            Tag::FileRead | Tag::FileWrite => self.on_file(cx, usize::from(index), result),
            Tag::Wake => {}
        }
        self.pump(cx);
    }
}
