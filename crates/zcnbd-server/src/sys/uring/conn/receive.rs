//! Receiving requests: headers, payloads (in place or into a buffer), refused payloads, and
//! starting each request on the path the policy (`crate::policy::mechanism`) chooses.
use super::*;

impl Conn {
    // ---- receive side ----

    pub(super) fn can_take_request(&self, cx: &Cx<'_>) -> bool {
        let limits = &cx.shared.limits;
        self.inflight < limits.requests_inflight_max && self.held < limits.inflight_bytes_max
    }

    pub(super) fn post_recv(&mut self, cx: &mut Cx<'_>) {
        if self.recv_posted || self.eof || self.broken {
            return;
        }
        let target = match &self.recv {
            Recv::Header => self.header_target(cx),
            Recv::Payload { .. } => self.payload_target(cx),
            Recv::Discard { remaining, .. } => {
                let len = (*remaining).min(self.scratch.len());
                Some((self.scratch.as_mut_ptr(), len, true))
            }
            Recv::Piped(_) => return self.post_piped(cx),
        };
        let Some((ptr, len, wait_all)) = target else {
            return;
        };
        let flags = if wait_all { libc::MSG_WAITALL } else { 0 };
        let entry = opcode::Recv::new(types::Fd(self.socket.as_raw_fd()), ptr, len as u32)
            .flags(flags)
            .build()
            .user_data(self.key.op(Tag::Recv, 0));
        self.recv_posted = true;
        if !self.push(cx, &[entry]) {
            self.recv_returned();
        }
    }

    /// Where the next header bytes go (pointer, length, whether to wait for all of them);
    /// `None` when there is no room for another request or a whole header is here already.
    fn header_target(&mut self, cx: &Cx<'_>) -> Option<(*mut u8, usize, bool)> {
        let header_bytes = self.ctx.mode.request_header_bytes();
        if !self.can_take_request(cx) || self.stage_end - self.stage_start >= header_bytes {
            // No room, or a whole header is already here (parsed once room frees).
            return None;
        }
        // Keep the partial header at the front of the stage.
        self.stage.copy_within(self.stage_start..self.stage_end, 0);
        self.stage_end -= self.stage_start;
        self.stage_start = 0;
        let (want, wait_all) = if self.plain_run >= BATCH_AFTER_PLAIN_REQUESTS {
            // Whatever has arrived, up to a stage full: many headers per receive.
            (HEADER_STAGE_BYTES, false)
        } else {
            // Exactly one header, so a write's payload is received in place.
            (header_bytes, true)
        };
        let ptr = self.stage[self.stage_end..want].as_mut_ptr();
        Some((ptr, want - self.stage_end, wait_all))
    }

    /// Where the rest of the payload goes; a short payload is received together with the
    /// next request's header, in one `recvmsg` posted here (then `None`).
    fn payload_target(&mut self, cx: &mut Cx<'_>) -> Option<(*mut u8, usize, bool)> {
        let Recv::Payload { dest, got, len, .. } = &mut self.recv else {
            return None;
        };
        // Lent to the receive posted next, until its completion (`on_recv`).
        let base = dest.lend(Dest::base_ptr);
        // `got < len`: a complete payload leaves this state at once.
        let (ptr, rest) = (base.wrapping_add(*got), *len - *got);
        self.recv_payload_bytes = rest;
        // The stage is empty here: staged bytes went to the payload first.
        if *len > PAYLOAD_WITH_HEADER_MAX_BYTES || self.stage_start != self.stage_end {
            return Some((ptr, rest, true));
        }
        self.post_payload_with_header(cx, ptr, rest);
        None
    }

    /// One `recvmsg` of two iovecs: the payload's `rest` bytes at `ptr`, then the next
    /// header into the (empty) stage.
    fn post_payload_with_header(&mut self, cx: &mut Cx<'_>, ptr: *mut u8, rest: usize) {
        self.stage_start = 0;
        self.stage_end = 0;
        let header_bytes = self.ctx.mode.request_header_bytes();
        let msg = &mut *self.recv_msg;
        msg.iov = [
            libc::iovec {
                iov_base: ptr.cast(),
                iov_len: rest,
            },
            libc::iovec {
                iov_base: self.stage.as_mut_ptr().cast(),
                iov_len: header_bytes,
            },
        ];
        msg.msg.msg_iov = msg.iov.as_mut_ptr();
        msg.msg.msg_iovlen = 2;
        let entry = opcode::RecvMsg::new(
            types::Fd(self.socket.as_raw_fd()),
            &mut msg.msg as *mut libc::msghdr,
        )
        .build()
        .user_data(self.key.op(Tag::Recv, 0));
        self.recv_posted = true;
        if !self.push(cx, &[entry]) {
            self.recv_returned();
        }
    }

    pub(super) fn on_recv(&mut self, cx: &mut Cx<'_>, result: i32) {
        self.recv_returned();
        if is_retry(result) {
            return;
        }
        if result <= 0 {
            self.end_of_requests(result);
            return;
        }
        let n = result as usize;
        match &mut self.recv {
            // Parsed by `pump`, which runs after every completion.
            Recv::Header => self.stage_end += n,
            Recv::Payload { .. } => {
                // Bytes past the payload are the start of the next header (see post_recv).
                let payload = n.min(self.recv_payload_bytes);
                self.stage_end += n - payload;
                self.payload_received(cx, payload);
            }
            Recv::Discard { .. } => self.payload_received(cx, n),
            // Spliced writes post no receive.
            Recv::Piped(_) => {}
        }
    }

    /// The posted receive completed (or was never submitted): the payload destination lent
    /// to it comes back.
    fn recv_returned(&mut self) {
        self.recv_posted = false;
        if let Recv::Payload { dest, .. } = &mut self.recv {
            dest.complete();
        }
    }

    /// `n` more bytes of the current payload (or refused payload) are in place.
    fn payload_received(&mut self, cx: &mut Cx<'_>, n: usize) {
        match &mut self.recv {
            Recv::Header | Recv::Piped(_) => {}
            Recv::Payload { got, len, .. } => {
                *got += n;
                self.session.payload_received(n);
                if *got == *len {
                    self.on_payload(cx);
                }
            }
            Recv::Discard { remaining, reply } => {
                *remaining -= n;
                let done = *remaining == 0;
                let failed_write = reply.is_some();
                let reply = if done { reply.take() } else { None };
                if done {
                    self.recv = Recv::Header;
                }
                if failed_write {
                    // The rest of an accepted write whose file write failed.
                    self.session.payload_received(n);
                    if let Some(reply) = reply {
                        self.enqueue(Payload::Reply(reply), 0);
                    }
                    return;
                }
                // A refused request's payload: the session drops it (the bytes are in the
                // scratch or the stage; their content does not matter) and, after the last,
                // says the request was refused.
                let n = n.min(self.scratch.len());
                let (_, event) = self.session.handle_input(&self.scratch[..n]);
                if let Some(event) = event {
                    self.on_event(cx, event);
                }
            }
        }
    }

    /// Starts every request whose header is in the stage, as long as there is room; a
    /// payload whose first bytes arrived with the headers gets them copied into place (rare:
    /// headers are received in batches only after a run of payload-less requests).
    pub(super) fn parse_staged(&mut self, cx: &mut Cx<'_>) {
        loop {
            if self.eof || self.broken {
                return;
            }
            let staged = self.stage_end - self.stage_start;
            match &mut self.recv {
                Recv::Header => {
                    // Whole headers only, so the session never holds part of one (the next
                    // receive then takes exactly the rest, and a payload lands in place).
                    let missing = match self.session.want() {
                        ServerWant::Header(missing) => missing,
                        _ => return,
                    };
                    if staged < missing || !self.can_take_request(cx) {
                        return;
                    }
                    let input = &self.stage[self.stage_start..self.stage_start + missing];
                    let (used, event) = self.session.handle_input(input);
                    self.stage_start += used;
                    match event {
                        Some(event) => self.on_event(cx, event),
                        None => self.start_discard(),
                    }
                }
                Recv::Payload {
                    dest,
                    got,
                    len,
                    staged: copied,
                    ..
                } => {
                    let take = staged.min(*len - *got);
                    if take == 0 {
                        return;
                    }
                    // A posted payload receive leaves the stage empty, so `take > 0` means
                    // none is in flight and the destination is ours.
                    let Some(dest) = dest.get_mut() else {
                        return;
                    };
                    let base = dest.base_ptr();
                    // SAFETY: `base` points at `len` writable bytes this request owns (the
                    // export mapping's range, checked by range_ptr, or its own buffer), and
                    // `got + take <= len`; the stage is separate memory.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.stage.as_ptr().add(self.stage_start),
                            base.add(*got),
                            take,
                        );
                    }
                    self.dispatcher.stats.copied_bytes.add(take as u64);
                    *copied += take;
                    self.stage_start += take;
                    self.payload_received(cx, take);
                }
                Recv::Discard { remaining, .. } => {
                    let take = staged.min(*remaining).min(self.scratch.len());
                    if take == 0 {
                        return;
                    }
                    self.stage_start += take;
                    self.payload_received(cx, take);
                }
                // Started only with an empty stage; the socket holds the payload.
                Recv::Piped(_) => return,
            }
        }
    }

    /// The client closed, reset, or the read failed: no more requests. A request whose
    /// payload was cut short is dropped (it can never be answered correctly).
    pub(super) fn end_of_requests(&mut self, result: i32) {
        if result < 0 {
            debug!(
                "receive failed: {}",
                std::io::Error::from_raw_os_error(-result)
            );
        }
        self.eof = true;
        if let Some(cut) = self.session.close() {
            debug!("the connection ended inside a request: {cut:?}");
        }
        match std::mem::replace(&mut self.recv, Recv::Header) {
            Recv::Payload { held, .. } => {
                self.inflight -= 1;
                self.held -= held;
            }
            // A refused request's payload holds nothing; a failed write's remainder does.
            Recv::Discard { reply: None, .. } | Recv::Header => {}
            Recv::Discard { reply: Some(_), .. } | Recv::Piped(_) => self.inflight -= 1,
        }
    }

    /// After a refused request's header the session drops its payload: receive that into
    /// scratch (the session tells the reply once the last byte is gone).
    fn start_discard(&mut self) {
        if let ServerWant::Discard { remaining } = self.session.want() {
            self.recv = Recv::Discard {
                remaining,
                reply: None,
            };
        }
    }

    /// What the session made of the request stream.
    pub(super) fn on_event(&mut self, cx: &mut Cx<'_>, event: ServerEvent) {
        match event {
            ServerEvent::Request {
                header,
                command,
                payload_bytes,
            } => {
                self.count_plain(payload_bytes);
                self.inflight += 1;
                match command {
                    Command::Write => self.start_write(cx, header, payload_bytes),
                    Command::Read => self.start_read(cx, header),
                    _ => self.delegate(cx, header, command, None, 0),
                }
            }
            ServerEvent::Rejected {
                header,
                rejection,
                payload_bytes,
            } => {
                debug!(cookie = header.cookie, "refused: {}", rejection.reason);
                self.count_plain(payload_bytes);
                self.inflight += 1;
                self.enqueue_error(&header, rejection.errno, rejection.reason, 0);
            }
            ServerEvent::End(reason) => {
                if reason.is_violation() {
                    warn!("{reason}: disconnecting client");
                }
                self.eof = true;
            }
        }
    }

    /// Counts a run of payload-less requests (see [`BATCH_AFTER_PLAIN_REQUESTS`]).
    fn count_plain(&mut self, payload_bytes: usize) {
        self.plain_run = if payload_bytes > 0 {
            0
        } else {
            self.plain_run.saturating_add(1)
        };
    }

    pub(super) fn start_write(&mut self, cx: &mut Cx<'_>, header: RequestHeader, len: usize) {
        if len == 0 {
            return self.enqueue_ok(&header, 0);
        }
        let facts = WriteFacts {
            source: self.source.kind(),
            len,
            fua: header.flags & cmd_flags::FUA != 0,
            stage_empty: self.stage_start == self.stage_end,
            in_place_max: self.in_place_max,
            in_place_when_cpu_bound: self.in_place_when_cpu_bound,
            cpu_bound: cx.shared.load.cpu_bound(),
        };
        let dest = match (
            mechanism::choose_write(&cx.shared.options, facts),
            &self.source,
        ) {
            (WriteMechanism::Piped, Source::PageCache { fd }) => {
                let fd = *fd;
                return self.start_piped_write(header, fd, len);
            }
            (WriteMechanism::InPlace, Source::Memory { map, .. }) => {
                map.range_ptr(header.offset, len).map(Dest::Mapped)
            }
            (WriteMechanism::Direct, Source::Direct { direct, .. }) => {
                let fd = *direct;
                self.fixed_buf(cx, 0, header.offset, len)
                    .map(|buf| Dest::Fixed { buf, fd })
            }
            _ => None,
        };
        let (dest, held) = match dest {
            Some(dest @ Dest::Mapped(_)) => (dest, 0),
            Some(dest) => (dest, len),
            None => (Dest::Buffer(cx.shared.pool.get(len)), len),
        };
        self.held += held;
        self.recv = Recv::Payload {
            header,
            dest: Lent::new(dest),
            got: 0,
            len,
            held,
            staged: 0,
        };
    }

    pub(super) fn on_payload(&mut self, cx: &mut Cx<'_>) {
        let Recv::Payload {
            header,
            dest,
            len,
            held,
            staged,
            ..
        } = std::mem::replace(&mut self.recv, Recv::Header)
        else {
            return;
        };
        let dest = match dest.reclaim() {
            Ok(dest) => dest,
            Err(_still_lent) => {
                // A bug: dropping it leaks the buffer rather than free it under the kernel.
                self.inflight -= 1;
                self.held -= held;
                return self.fail("a payload completed with its buffer still lent");
            }
        };
        let stats = Arc::clone(&self.dispatcher.stats);
        let buf = match dest {
            Dest::Mapped(_) => {
                // A prefix that came with a batch of headers was copied (and counted) instead.
                stats.received_in_place_bytes.add((len - staged) as u64);
                stats.write_bytes.add(len as u64);
                return self.enqueue_ok(&header, held);
            }
            Dest::Fixed { buf, fd } => {
                let buf = FileBuf::Fixed(buf);
                return self.start_file_op(cx, FileOpKind::Write, header, fd, buf, held, true);
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
                let (fd, buf) = (*fd, FileBuf::Pooled(buf));
                self.start_file_op(cx, FileOpKind::Write, header, fd, buf, held, false);
            }
            Source::Direct { direct, buffered } => {
                let aligned = is_aligned(&buf) && self.direct_range_ok(header.offset, len);
                let fd = if aligned { *direct } else { *buffered };
                let buf = FileBuf::Pooled(buf);
                self.start_file_op(cx, FileOpKind::Write, header, fd, buf, held, aligned);
            }
            Source::Synthetic => self.delegate(cx, header, Command::Write, Some(buf), held),
        }
    }

    // ---- requests ----

    /// Runs a request on the worker pool; the reply comes back through the mailbox.
    pub(super) fn delegate(
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
            let reply = dispatcher.execute_guarded(Request {
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
    pub(super) fn all_data(&self, header: &RequestHeader) -> bool {
        let mut extents = Vec::with_capacity(2);
        let backend = &self.dispatcher.backend;
        // A backend that panics here is answered by the worker pool (EIO), not on the ring.
        let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            backend.extents(header.offset, header.length, 2, &mut extents)
        }));
        if !matches!(asked, Ok(Ok(()))) {
            return false;
        }
        matches!(extents.as_slice(), [e] if e.flags == 0 && e.length >= header.length)
    }

    pub(super) fn start_read(&mut self, cx: &mut Cx<'_>, header: RequestHeader) {
        let len = header.length as usize;
        let facts = ReadFacts {
            source: self.source.kind(),
            len,
            sparse_allowed: self.ctx.mode != ReplyMode::Simple && header.flags & cmd_flags::DF == 0,
            sendfile_ok: self.sendfile_ok,
        };
        let mechanism =
            mechanism::choose_read(&cx.shared.options, facts, || self.all_data(&header));
        match (mechanism, &self.source) {
            (ReadMechanism::Mapped, Source::Memory { map, .. }) => {
                let map = Arc::clone(map);
                self.enqueue_read(header, |header, offset, len| Payload::Mapped {
                    header,
                    map,
                    offset,
                    len,
                });
            }
            (ReadMechanism::Sendfile, Source::Memory { fd, .. }) => {
                let fd = *fd;
                self.enqueue_read(header, |header, offset, len| Payload::Sendfile {
                    header,
                    fd,
                    offset,
                    len,
                });
            }
            (ReadMechanism::Splice, Source::PageCache { fd }) => {
                let fd = *fd;
                self.enqueue_read(header, |header, offset, len| Payload::Splice {
                    header,
                    fd,
                    offset,
                    len,
                });
            }
            (ReadMechanism::Bounce, Source::Memory { fd, .. } | Source::PageCache { fd }) => {
                let fd = *fd;
                let buf = FileBuf::Pooled(cx.shared.pool.get(len));
                self.held += len;
                self.start_file_op(cx, FileOpKind::Read, header, fd, buf, len, false);
            }
            (ReadMechanism::Direct, Source::Direct { direct, buffered }) => {
                let (direct, buffered) = (*direct, *buffered);
                self.start_direct_read(cx, header, direct, buffered);
            }
            _ => self.delegate(cx, header, Command::Read, None, len),
        }
    }

    /// Queues a read's reply whose data the send takes from the export itself (`payload`
    /// builds it from the data chunk's header, the offset and the length).
    fn enqueue_read(
        &mut self,
        header: RequestHeader,
        payload: impl FnOnce(Vec<u8>, u64, usize) -> Payload,
    ) {
        let len = header.length as usize;
        self.dispatcher.stats.read_bytes.add(len as u64);
        let chunk_header = self.data_header(&header, len);
        self.enqueue(payload(chunk_header, header.offset, len), 0);
    }

    /// An O_DIRECT read: into a registered run if one is free (the reply header goes just
    /// before the data), else into a pooled buffer, O_DIRECT when aligned.
    fn start_direct_read(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        direct: RawFd,
        buffered: RawFd,
    ) {
        let len = header.length as usize;
        self.held += len;
        if let Some(buf) = self.fixed_buf(cx, READ_HEAD_ROOM_BYTES, header.offset, len) {
            let buf = FileBuf::Fixed(buf);
            return self.start_file_op(cx, FileOpKind::Read, header, direct, buf, len, true);
        }
        let buf = cx.shared.pool.get(len);
        let aligned = is_aligned(&buf) && self.direct_range_ok(header.offset, len);
        let fd = if aligned { direct } else { buffered };
        let buf = FileBuf::Pooled(buf);
        self.start_file_op(cx, FileOpKind::Read, header, fd, buf, len, aligned);
    }
}
