//! Sending replies: batched `sendmsg`, zero-copy sends and their notifications, and spliced
//! replies.
use super::*;

impl Conn {
    // ---- send side ----

    pub(super) fn kick_send(&mut self, cx: &mut Cx<'_>) {
        // Replies sent by `sendfile` usually finish here and now; then the next one goes.
        while !self.tx.is_sending() && !self.broken {
            if !self.start_next_send(cx) {
                return;
            }
        }
    }

    /// Starts the next send; true when it already finished (a `sendfile` reply the socket
    /// took whole), so the caller should start another.
    fn start_next_send(&mut self, cx: &mut Cx<'_>) -> bool {
        let zerocopy_ok = self.tx.zerocopy_pays(&cx.shared.options);
        let Some((mut items, zerocopy)) = self.tx.outbox.next_batch(zerocopy_ok) else {
            return false;
        };
        self.deadlines.send_started(cx.now);
        if matches!(items[0].payload, Payload::Sendfile { .. }) {
            let send = SendfileSend {
                item: items.remove(0),
                header_sent: 0,
                sent: 0,
            };
            self.tx.outbox.current = Some(Sending::Sendfile(Box::new(send)));
            return self.drive_sendfile(cx);
        }
        if matches!(items[0].payload, Payload::Splice { .. }) {
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
        let zerocopy = send.zerocopy;
        let Some(target) = send.lend() else {
            // A bug: the previous submission's result is still to come.
            return self.fail("a send posted while the previous one is in flight");
        };
        let fd = types::Fd(self.socket.as_raw_fd());
        let entry = match target {
            // A lone fixed reply: its header was written just before the data in the same
            // registered run, so one SEND_ZC naming that buffer carries header and data in
            // one submission, with no per-send page pinning. (SENDMSG_ZC cannot name a
            // registered buffer before Linux 6.15, nor through this io_uring crate; a linked
            // header send would be a second SQE and CQE per reply.)
            SendTarget::Fixed { ptr, len, index } => {
                let len = u32::try_from(len).unwrap_or(u32::MAX);
                opcode::SendZc::new(fd, ptr, len)
                    .buf_index(Some(index))
                    .zc_flags(SEND_ZC_REPORT_USAGE)
                    .flags(libc::MSG_NOSIGNAL)
                    .build()
            }
            SendTarget::Msg(msg) if zerocopy => opcode::SendMsgZc::new(fd, msg)
                .ioprio(SEND_ZC_REPORT_USAGE)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build(),
            SendTarget::Msg(msg) => opcode::SendMsg::new(fd, msg)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build(),
        };
        let entry = entry.user_data(self.key.op(Tag::Send, 0));
        if !self.push(cx, &[entry]) {
            if let Some(Sending::Msg(send)) = self.tx.outbox.current.as_mut() {
                send.not_submitted();
            }
            self.settle_msg();
        }
    }

    pub(super) fn on_send(&mut self, cx: &mut Cx<'_>, result: i32, flags: u32, more: bool) {
        let Some(Sending::Msg(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        if io_uring::cqueue::notif(flags) {
            send.on_notification();
            if (result as u32) & NOTIF_USAGE_ZC_COPIED != 0 {
                send.copied = true;
            }
            return self.settle_msg();
        }
        send.on_result(more);
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
        if self.tx.pipe.is_none() {
            match Pipe::new() {
                Ok(pipe) => self.tx.pipe = Some(pipe),
                Err(e) => {
                    self.fail(&format!("cannot create a pipe: {e}"));
                    return self.settle_splice();
                }
            }
        }
        let Some(pipe) = self.tx.pipe.as_ref() else {
            return;
        };
        let Some(Sending::Splice(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        let mut entries = splice_chain(self.key, self.socket.as_raw_fd(), pipe, send);
        if entries.is_empty() {
            return;
        }
        let last = entries.len() - 1;
        for entry in &mut entries[..last] {
            *entry = entry.clone().flags(squeue::Flags::IO_LINK);
        }
        send.pending = entries.len();
        send.mark = send.progress();
        if !self.push(cx, &entries) {
            if let Some(Sending::Splice(send)) = self.tx.outbox.current.as_mut() {
                send.not_submitted();
            }
            self.settle_splice();
        }
    }

    pub(super) fn on_splice(&mut self, cx: &mut Cx<'_>, tag: Tag, result: i32) {
        let Some(Sending::Splice(send)) = self.tx.outbox.current.as_mut() else {
            return;
        };
        send.pending -= 1;
        if tag == Tag::SpliceHeader {
            send.header_returned();
        }
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
        let Payload::Splice { len, .. } = &send.item.payload else {
            return;
        };
        let complete = send.header_sent == send.header_len && send.sent == *len;
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
        self.retire(send.item, complete);
    }

    // ---- sendfile ----

    /// Sends as much of the current `sendfile` reply as the socket takes now, on this thread
    /// (the socket is nonblocking). Returns true once the reply is retired; when the socket
    /// is full, a writability poll resumes it (`on_writable`).
    pub(super) fn drive_sendfile(&mut self, cx: &mut Cx<'_>) -> bool {
        let Some(Sending::Sendfile(send)) = self.tx.outbox.current.as_mut() else {
            return true;
        };
        let outcome = sendfile_some(&self.socket, send, &self.dispatcher.stats);
        match outcome {
            Ok(true) => {
                self.finish_sendfile(true);
                true
            }
            Ok(false) => {
                let entry =
                    opcode::PollAdd::new(types::Fd(self.socket.as_raw_fd()), libc::POLLOUT as u32)
                        .build()
                        .user_data(self.key.op(Tag::Writable, 0));
                if !self.push(cx, &[entry]) {
                    self.finish_sendfile(false);
                    return true;
                }
                false
            }
            Err(e) => {
                // Part of a reply may be on the wire: the stream cannot be resynchronised.
                self.fail(&format!("sendfile failed: {e}"));
                self.finish_sendfile(false);
                true
            }
        }
    }

    /// The socket may take more of the current `sendfile` reply (or was hung up).
    pub(super) fn on_writable(&mut self, cx: &mut Cx<'_>, _result: i32) {
        if !self.tx.is_sendfile() {
            return;
        }
        if self.broken {
            return self.finish_sendfile(false);
        }
        // A poll error shows up as the send's own error.
        self.drive_sendfile(cx);
    }

    fn finish_sendfile(&mut self, sent: bool) {
        if let Some(Sending::Sendfile(send)) = self.tx.outbox.current.take() {
            self.retire(send.item, sent);
        }
    }
}

/// The linked operations that move the rest of a spliced reply: the header's remainder
/// (`MSG_MORE`), what is already in the pipe, then pipe-fulls of file -> pipe -> socket, at
/// most [`SPLICE_CHAIN_OPS_MAX`] in one chain. Not yet linked (the caller links them).
fn splice_chain(
    key: ConnKey,
    sock: RawFd,
    pipe: &Pipe,
    send: &mut SpliceSend,
) -> Vec<squeue::Entry> {
    let Payload::Splice {
        fd, offset, len, ..
    } = &send.item.payload
    else {
        return Vec::new();
    };
    // Copied: the header is lent (mutably) next.
    let (fd, offset, len) = (*fd, *offset, *len);
    let mut entries: Vec<squeue::Entry> = Vec::with_capacity(8);
    if let Some((rest, bytes)) = send.lend_header() {
        let flags = libc::MSG_MORE | libc::MSG_NOSIGNAL;
        let e = opcode::Send::new(types::Fd(sock), rest, bytes as u32).flags(flags);
        entries.push(e.build().user_data(key.op(Tag::SpliceHeader, 0)));
    }
    let to_socket = |bytes: usize, end: usize| {
        // SPLICE_F_NONBLOCK makes a short fill show up as a short result rather than a wait
        // on a pipe nobody will write to; the socket side may still block (io-wq).
        let more = if end < len { libc::SPLICE_F_MORE } else { 0 };
        let pipe_out = types::Fd(pipe.read.as_raw_fd());
        opcode::Splice::new(pipe_out, -1, types::Fd(sock), -1, bytes as u32)
            .flags(libc::SPLICE_F_NONBLOCK | more)
            .build()
            .user_data(key.op(Tag::SpliceOut, 0))
    };
    let in_pipe = send.piped - send.sent;
    if in_pipe > 0 {
        entries.push(to_socket(in_pipe, send.piped));
    }
    let mut pos = send.piped;
    while pos < len && entries.len() + 2 <= SPLICE_CHAIN_OPS_MAX {
        let chunk = pipe.capacity.min(len - pos);
        let file_offset = (offset + pos as u64) as i64;
        let pipe_in = types::Fd(pipe.write.as_raw_fd());
        let fill = opcode::Splice::new(types::Fd(fd), file_offset, pipe_in, -1, chunk as u32)
            .flags(libc::SPLICE_F_MOVE);
        entries.push(fill.build().user_data(key.op(Tag::SpliceIn, 0)));
        entries.push(to_socket(chunk, pos + chunk));
        pos += chunk;
    }
    entries
}

/// Sends as much of a `sendfile` reply as the socket takes now, on the ring thread:
/// `Ok(true)` once all of it went, `Ok(false)` when the socket is full.
fn sendfile_some(
    socket: &OwnedFd,
    send: &mut SendfileSend,
    stats: &crate::stats::Stats,
) -> rustix::io::Result<bool> {
    use rustix::io::Errno;
    use rustix::net::SendFlags;
    let Payload::Sendfile {
        header,
        fd,
        offset,
        len,
    } = &send.item.payload
    else {
        return Ok(true);
    };
    // SAFETY: `fd` is the memory export's memfd, which stays open as long as the
    // dispatcher's backend, and the connection holds an Arc of the dispatcher.
    let file = unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) };
    loop {
        let step = if send.header_sent < header.len() {
            // MSG_MORE: the data follows at once, in the same segments where it fits.
            let flags = SendFlags::MORE | SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            rustix::net::send(socket, &header[send.header_sent..], flags)
                .map(|n| send.header_sent += n)
        } else if send.sent < *len {
            let mut position = *offset + send.sent as u64;
            match rustix::fs::sendfile(socket, file, Some(&mut position), len - send.sent) {
                // Validation keeps the range inside the export: 0 would repeat forever.
                Ok(0) => Err(Errno::IO),
                Ok(n) => {
                    send.sent += n;
                    Ok(())
                }
                Err(e) => Err(e),
            }
        } else {
            return Ok(true);
        };
        stats.syscall();
        match step {
            Ok(()) | Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}
