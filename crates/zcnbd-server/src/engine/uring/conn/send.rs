//! Sending replies: batched `sendmsg`, zero-copy sends and their notifications, and spliced
//! replies.
use super::*;

impl Conn {
    // ---- send side ----

    pub(super) fn kick_send(&mut self, cx: &mut Cx<'_>) {
        // Replies sent inline usually finish here and now; then the next one goes.
        while !self.tx.is_sending() && !self.broken {
            if !self.start_next_send(cx) {
                return;
            }
        }
    }

    /// Starts the next send; true when it already finished (a reply sent inline that the
    /// socket took whole), so the caller should start another.
    fn start_next_send(&mut self, cx: &mut Cx<'_>) -> bool {
        let zerocopy_ok = self.tx.zerocopy_pays(&cx.shared.options);
        let Some((mut items, zerocopy)) = self.tx.outbox.next_batch(zerocopy_ok) else {
            return false;
        };
        self.deadlines.send_started(cx.now);
        let inline = match items[0].payload {
            Payload::Sendfile { .. } => true,
            // A piped reply's bytes are all in its pipe: the ring thread splices them on to
            // a nonblocking socket itself rather than hand the splice to an io-wq worker.
            Payload::Piped { .. } => self.tx.nonblocking,
            _ => false,
        };
        if inline {
            let send = InlineSend {
                item: items.remove(0),
                header_sent: 0,
                sent: 0,
                tail_sent: 0,
            };
            self.tx.outbox.current = Some(Sending::Inline(Box::new(send)));
            return self.drive_inline(cx);
        }
        if matches!(
            items[0].payload,
            Payload::Splice { .. } | Payload::Piped { .. }
        ) {
            let send = SpliceSend::new(items.remove(0));
            self.tx.outbox.current = Some(Sending::Splice(send));
            self.post_splice(cx);
            return false;
        }
        self.tx.outbox.current = Some(Sending::Msg(MsgSend::new(items, zerocopy)));
        self.post_msg(cx);
        false
    }

    pub(super) fn post_msg(&mut self, cx: &mut Cx<'_>) {
        let Some(Sending::Msg(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        let fd = self.socket.as_raw_fd();
        let op = Op::SendMsg {
            fd,
            send: &mut **send,
        };
        let result = cx.submit(self.key.op(Tag::Send, 0), op);
        if !self.submitted(result, 1) {
            self.settle_msg();
        }
    }

    pub(super) fn on_send(&mut self, cx: &mut Cx<'_>, cqe: Cqe) {
        let Some(Sending::Msg(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        let result = cqe.result;
        if cqe.notification {
            send.on_notification();
            if cqe.zc_copied() {
                send.copied = true;
            }
            return self.settle_msg();
        }
        send.on_result(cqe.more);
        if is_retry(result) {
            return self.post_msg(cx);
        }
        if send.zerocopy && matches!(-result, libc::EOPNOTSUPP | libc::ENOMEM | libc::ENOBUFS) {
            // Zero-copy send exists only for TCP/UDP (not Unix sockets), and without
            // CAP_IPC_LOCK the pages it pins count against RLIMIT_MEMLOCK (ENOMEM): an error
            // result means this send moved nothing (a notification may still come; settling
            // waits for it), so send the same bytes plainly and stop trying on this connection.
            send.zerocopy = false;
            self.tx.zerocopy_ok = false;
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
    pub(super) fn settle_msg(&mut self) {
        let Some(Sending::Msg(send)) = self.tx.outbox.current.as_ref() else {
            return;
        };
        let complete = send.sent >= send.total;
        if !send.is_settled() || (!complete && !self.broken) {
            return;
        }
        let Some(Sending::Msg(send)) = self.tx.outbox.current.take() else {
            return;
        };
        if send.zerocopy && send.copied {
            // "The completion says COPIED": on this path zero-copy costs more than it saves.
            self.tx.zerocopy_ok = false;
            debug!("kernel copied a zero-copy send; plain sends from now on");
        }
        let zerocopy = send.zerocopy;
        let copied = send.copied;
        let Ok(items) = (*send).into_items() else {
            // Unreachable (settled means nothing is lent); the items leak rather than be
            // freed under the kernel.
            return self.fail("a settled send still had its replies lent");
        };
        let stats = Arc::clone(&self.dispatcher.stats);
        for item in items {
            if zerocopy && complete {
                stats.replies_sent(SendPath::ZeroCopy { copied }, 1, item.data_bytes());
                self.budget.retire(item.held);
            } else {
                self.retire(item, complete);
            }
        }
    }

    // ---- splice ----

    pub(super) fn post_splice(&mut self, cx: &mut Cx<'_>) {
        let own_pipe = match self.tx.outbox.current.as_ref() {
            Some(Sending::Splice(send)) => match &send.item.payload {
                Payload::Piped { pipe, .. } => Some(PipeFds::of(pipe)),
                _ => None,
            },
            _ => None,
        };
        if own_pipe.is_none() && self.tx.pipe.is_none() {
            match Pipe::new() {
                Ok(pipe) => self.tx.pipe = Some(pipe),
                Err(e) => {
                    self.fail(&format!("cannot create a pipe: {e}"));
                    return self.settle_splice();
                }
            }
        }
        let Some(pipe) = own_pipe.or_else(|| self.tx.pipe.as_ref().map(PipeFds::of)) else {
            return;
        };
        let Some(Sending::Splice(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        let mark = send.progress();
        let mut chain = splice_chain(self.key, self.socket.as_raw_fd(), pipe, send);
        let count = chain.len();
        if count == 0 {
            return;
        }
        let result = cx.driver.submit(&mut chain);
        drop(chain);
        send.pending = if result.is_ok() { count } else { 0 };
        send.mark = mark;
        if !self.submitted(result, count) {
            self.settle_splice();
        }
    }

    pub(super) fn on_splice(&mut self, cx: &mut Cx<'_>, tag: Tag, result: i32) {
        let Some(Sending::Splice(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        send.pending -= 1;
        match tag {
            Tag::SpliceHeader => send.header_returned(),
            Tag::SpliceTail => send.tail_returned(),
            _ => {}
        }
        if result >= 0 {
            let n = result as usize;
            match tag {
                Tag::SpliceHeader => send.header_sent += n,
                Tag::SpliceIn => send.piped += n,
                Tag::SpliceTail => send.tail_sent += n,
                _ => send.sent += n,
            }
        } else if result != -libc::ECANCELED && !is_retry(result) {
            send.error.get_or_insert(result);
        }
        if send.pending > 0 {
            return;
        }
        let complete = send.is_complete();
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

    pub(super) fn settle_splice(&mut self) {
        let Some(Sending::Splice(send)) = self.tx.outbox.current.as_ref() else {
            return;
        };
        if !send.is_settled() {
            return;
        }
        let Some(Sending::Splice(send)) = self.tx.outbox.current.take() else {
            return;
        };
        let complete = !self.broken;
        if complete && send.tail_len > 0 {
            // A piped reply's tail left by a plain send (its pipe's bytes are counted as
            // spliced when the item retires).
            let stats = &self.dispatcher.stats;
            stats.replies_sent(SendPath::Plain, 0, send.tail_len);
        }
        self.retire(send.item, complete);
    }

    // ---- inline: sendfile, and piped replies on a nonblocking socket ----

    /// Sends as much of the current inline reply as the socket takes now, on this thread
    /// (the socket is nonblocking). Returns true once the reply is retired; when the socket
    /// is full, a writability poll resumes it (`on_writable`).
    pub(super) fn drive_inline(&mut self, cx: &mut Cx<'_>) -> bool {
        let Some(Sending::Inline(send)) = self.tx.outbox.current.as_mut() else {
            return true;
        };
        match send_inline_some(&self.socket, send, &self.dispatcher.stats) {
            Ok(true) => {
                self.finish_inline(true);
                true
            }
            Ok(false) => !self.await_writable(cx),
            Err(e) => {
                // Part of a reply may be on the wire: the stream cannot be resynchronised.
                self.fail(&format!("send failed: {e}"));
                self.finish_inline(false);
                true
            }
        }
    }

    /// Polls the full socket for room for the inline reply; true when the poll is posted. If
    /// it cannot be, the connection has failed and the reply is retired.
    fn await_writable(&mut self, cx: &mut Cx<'_>) -> bool {
        let poll = Op::Poll {
            fd: self.socket.as_raw_fd(),
            events: libc::POLLOUT as u32,
        };
        let result = cx.submit(self.key.op(Tag::Writable, 0), poll);
        if self.submitted(result, 1) {
            return true;
        }
        self.finish_inline(false);
        false
    }

    /// The socket may take more of the current inline reply (or was hung up).
    pub(super) fn on_writable(&mut self, cx: &mut Cx<'_>, _result: i32) {
        // A poll error shows up as the send's own error.
        match self.tx.outbox.current {
            Some(Sending::Inline(_)) if self.broken => self.finish_inline(false),
            Some(Sending::Inline(_)) => {
                self.drive_inline(cx);
            }
            _ => {}
        }
    }

    fn finish_inline(&mut self, sent: bool) {
        let Some(Sending::Inline(mut send)) = self.tx.outbox.current.take() else {
            return;
        };
        if let Payload::Piped { tail, .. } = &mut send.item.payload {
            // The tail went by a plain send; the pipe's bytes count as spliced on retiring.
            let tail = std::mem::take(tail);
            if sent && !tail.is_empty() {
                let stats = &self.dispatcher.stats;
                stats.replies_sent(SendPath::Plain, 0, tail.len());
            }
        }
        self.retire(send.item, sent);
    }
}

/// A pipe's ends, by number (the connection's, or a piped reply's own inside the send).
#[derive(Clone, Copy)]
struct PipeFds {
    read: RawFd,
    write: RawFd,
    capacity: usize,
}

impl PipeFds {
    fn of(pipe: &Pipe) -> PipeFds {
        PipeFds {
            read: pipe.read.as_raw_fd(),
            write: pipe.write.as_raw_fd(),
            capacity: pipe.capacity,
        }
    }
}

/// The linked operations that move the rest of a spliced reply: the header's remainder
/// (`MSG_MORE`), what is already in the pipe, then pipe-fulls of file -> pipe -> socket, at
/// most [`SPLICE_CHAIN_OPS_MAX`] in one chain.
fn splice_chain<'a>(
    key: ConnKey,
    sock: RawFd,
    pipe: PipeFds,
    send: &'a mut SpliceSend,
) -> Vec<Sqe<'a>> {
    // A file's reply fills the pipe from the file; a piped one's data is all in its pipe.
    let (fd, offset, len) = match &send.item.payload {
        Payload::Splice {
            fd, offset, len, ..
        } => (*fd, *offset, *len),
        Payload::Piped { len, .. } => (-1, 0, *len),
        _ => return Vec::new(),
    };
    let mut chain = Vec::with_capacity(8);
    if send.header_sent < send.header_len {
        let from = send.header_sent;
        let bytes = &mut send.header;
        let header = Op::SendMore {
            fd: sock,
            bytes,
            from,
            more: true,
        };
        chain.push(Sqe::new(key.op(Tag::SpliceHeader, 0), header));
    }
    let to_socket = |bytes: usize, end: usize| {
        // SPLICE_F_NONBLOCK makes a short fill show up as a short result rather than a wait
        // on a pipe nobody will write to; the socket side may still block (io-wq).
        let more = if end < len { libc::SPLICE_F_MORE } else { 0 };
        let op = Op::Splice {
            from: pipe.read,
            from_offset: None,
            to: sock,
            to_offset: None,
            len: bytes,
            flags: libc::SPLICE_F_NONBLOCK | more,
        };
        Sqe::new(key.op(Tag::SpliceOut, 0), op)
    };
    let in_pipe = send.piped - send.sent;
    if in_pipe > 0 {
        chain.push(to_socket(in_pipe, send.piped));
    }
    // A piped reply's tail goes in a chain of its own once the pipe is drained: a short
    // splice before it would otherwise let it overtake the pipe's bytes.
    if chain.is_empty() && send.sent == send.through && send.tail_sent < send.tail_len {
        let from = send.tail_sent;
        let bytes = &mut send.tail;
        let tail = Op::SendMore {
            fd: sock,
            bytes,
            from,
            more: false,
        };
        chain.push(Sqe::new(key.op(Tag::SpliceTail, 0), tail));
        return chain;
    }
    let mut pos = send.piped;
    while pos < len && chain.len() + 2 <= SPLICE_CHAIN_OPS_MAX {
        let chunk = pipe.capacity.min(len - pos);
        let fill = Op::Splice {
            from: fd,
            from_offset: Some(offset + pos as u64),
            to: pipe.write,
            to_offset: None,
            len: chunk,
            flags: libc::SPLICE_F_MOVE,
        };
        chain.push(Sqe::new(key.op(Tag::SpliceIn, 0), fill));
        chain.push(to_socket(chunk, pos + chunk));
        pos += chunk;
    }
    chain
}

/// Sends as much of an inline reply as the socket takes now, on the ring thread: `Ok(true)`
/// once all of it went, `Ok(false)` when the socket is full.
pub(super) fn send_inline_some(
    socket: &OwnedFd,
    send: &mut InlineSend,
    stats: &crate::stats::Stats,
) -> rustix::io::Result<bool> {
    use rustix::io::Errno;
    use rustix::net::SendFlags;
    let InlineSend {
        item,
        header_sent,
        sent,
        tail_sent,
    } = send;
    // MSG_MORE on the header: the data follows at once, in the same segments where it fits.
    let send_bytes = |bytes: &[u8], done: &mut usize, more: bool| {
        let mut flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        if more {
            flags |= SendFlags::MORE;
        }
        rustix::net::send(socket, &bytes[*done..], flags).map(|n| *done += n)
    };
    loop {
        if let Payload::Piped {
            pipe, len, more, ..
        } = &mut item.payload
        {
            if *sent == *len {
                // This pipe is drained: the next one's bytes follow (`len` counts the data of
                // every pipe taken so far, so `data_bytes` stays the same).
                if let Some((next, n)) = more.pop_front() {
                    std::mem::replace(pipe, next).recycle();
                    *len += n;
                }
            }
        }
        let step = match &item.payload {
            Payload::Sendfile {
                header,
                fd,
                offset,
                len,
                ..
            } => {
                if *header_sent < header.len() {
                    send_bytes(header, header_sent, true)
                } else if *sent < *len {
                    let mut position = *offset + *sent as u64;
                    match crate::sys::place_io::sendfile(socket, *fd, &mut position, len - *sent) {
                        // Validation keeps the range inside the export: 0 would repeat forever.
                        Ok(0) => Err(Errno::IO),
                        Ok(n) => {
                            *sent += n;
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                } else {
                    return Ok(true);
                }
            }
            Payload::Piped {
                header,
                pipe,
                len,
                more,
                tail,
            } => {
                if *header_sent < header.len() {
                    send_bytes(header, header_sent, true)
                } else if *sent < *len {
                    // The pipe holds exactly its share of the reply's bytes (`len - sent`):
                    // SPLICE_F_NONBLOCK only keeps a miscounted pipe from waiting for a writer
                    // that never comes.
                    let mut flags = rustix::pipe::SpliceFlags::NONBLOCK;
                    if !tail.is_empty() || !more.is_empty() {
                        flags |= rustix::pipe::SpliceFlags::MORE;
                    }
                    match rustix::pipe::splice(&pipe.read, None, socket, None, len - *sent, flags) {
                        // An empty pipe with its write end open is EAGAIN, not 0; a pipe
                        // that ended early cannot finish the reply.
                        Ok(0) => Err(Errno::IO),
                        Ok(n) => {
                            *sent += n;
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                } else if *tail_sent < tail.len() {
                    send_bytes(tail, tail_sent, false)
                } else {
                    return Ok(true);
                }
            }
            _ => return Ok(true),
        };
        stats.syscall();
        match step {
            Ok(()) | Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}
