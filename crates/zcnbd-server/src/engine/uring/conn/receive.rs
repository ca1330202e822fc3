//! Receiving requests: headers, payloads (in place or into a buffer), refused payloads, and
//! starting each request on the path the policy (`super::super::mechanism`) chooses.
use super::*;
use crate::engine::wait_trial::OVERLAP_REPLIES;

impl Conn {
    // ---- receive side ----

    /// Whether the budget has room for another request (its size is not known yet).
    pub(super) fn can_take_request(&self) -> bool {
        self.budget.has_room(0)
    }

    pub(super) fn post_recv(&mut self, cx: &mut Cx<'_>) {
        if self.rx.is_posted() || self.eof || self.broken || self.rx.parked.is_some() {
            return;
        }
        let fd = rx_fd(&self.tls_feed, &self.socket).as_raw_fd();
        let header_bytes = self.ctx.mode.request_header_bytes();
        let room = self.can_take_request();
        self.rx.posted_nowait = false;
        let op = match &self.rx.state {
            Recv::Header => {
                let Some((range, wait_all)) = self.rx.header_target(header_bytes, room) else {
                    return;
                };
                self.rx.posted_nowait = !wait_all;
                let mem = &mut self.rx.mem;
                Op::RecvStage {
                    fd,
                    mem,
                    range,
                    wait_all,
                }
            }
            Recv::Payload { .. } => return self.post_payload_recv(cx),
            Recv::Discard { remaining, .. } => {
                let len = (*remaining).min(DISCARD_BYTES);
                let mem = &mut self.rx.mem;
                Op::RecvScratch { fd, mem, len }
            }
            Recv::Piped(_) => return self.post_piped(cx),
        };
        let result = cx.submit(self.key.op(Tag::Recv, 0), op);
        self.submitted(result, 1);
    }

    /// Receives the rest of the payload; a short payload together with the next request's
    /// header, in one `recvmsg` (the stage is empty: staged bytes went to the payload first).
    fn post_payload_recv(&mut self, cx: &mut Cx<'_>) {
        let header_bytes = self.ctx.mode.request_header_bytes();
        let stage_empty = self.rx.stage_is_empty();
        // `got < len`: a complete payload leaves this state at once. Staged bytes went to
        // the payload first, so the stage is empty: a bulk receive may fill it.
        if stage_empty {
            self.rx.stage_start = 0;
            self.rx.stage_end = 0;
            if let Some(end) = self.rx.bulk_target(false, header_bytes) {
                // The payload (and what follows) goes to the stage, copied from there.
                self.rx.payload_bytes = 0;
                self.rx.posted_nowait = true;
                let fd = rx_fd(&self.tls_feed, &self.socket).as_raw_fd();
                let mem = &mut self.rx.mem;
                let op = Op::RecvStage {
                    fd,
                    mem,
                    range: 0..end,
                    wait_all: false,
                };
                let result = cx.submit(self.key.op(Tag::Recv, 0), op);
                self.submitted(result, 1);
                return;
            }
        }
        let Recv::Payload { dest, got, len, .. } = &mut self.rx.state else {
            return;
        };
        let (range, alone) = (
            *got..*len,
            *len > PAYLOAD_WITH_HEADER_MAX_BYTES || !stage_empty,
        );
        self.rx.payload_bytes = range.len();
        let fd = rx_fd(&self.tls_feed, &self.socket).as_raw_fd();
        let wait_all = self.rx.payload_wait_all;
        let mem = &mut self.rx.mem;
        let op = if alone {
            Op::RecvPayload {
                fd,
                dest,
                range,
                mem,
                wait_all,
            }
        } else {
            self.rx.stage_start = 0;
            self.rx.stage_end = 0;
            Op::RecvPayloadAndHeader {
                fd,
                dest,
                range,
                mem,
                header_bytes,
            }
        };
        let result = cx.submit(self.key.op(Tag::Recv, 0), op);
        self.submitted(result, 1);
    }

    pub(super) fn on_recv(&mut self, cx: &mut Cx<'_>, result: i32, sock_nonempty: bool) {
        self.rx.returned();
        self.rx.more_waiting = sock_nonempty && result > 0;
        if is_retry(result) {
            return;
        }
        if result <= 0 {
            self.end_of_requests(result);
            return;
        }
        let n = result as usize;
        match &mut self.rx.state {
            // Parsed by `pump`, which runs after every completion.
            Recv::Header => {
                self.rx.received(false);
                self.rx.stage_end += n;
            }
            Recv::Payload { .. } => {
                // Bytes past the payload are the start of the next header (see
                // post_payload_recv).
                let payload = n.min(self.rx.payload_bytes);
                self.rx.received(n > payload);
                self.rx.stage_end += n - payload;
                self.payload_received(cx, payload);
            }
            Recv::Discard { .. } => self.payload_received(cx, n),
            // Spliced writes post no receive.
            Recv::Piped(_) => {}
        }
    }

    /// `n` more bytes of the current payload (or refused payload) are in place.
    fn payload_received(&mut self, cx: &mut Cx<'_>, n: usize) {
        match &mut self.rx.state {
            Recv::Header | Recv::Piped(_) => {}
            Recv::Payload { got, len, .. } => {
                *got += n;
                self.rx.session.payload_received(n);
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
                    self.rx.state = Recv::Header;
                }
                if failed_write {
                    // The rest of an accepted write whose file write failed.
                    self.rx.session.payload_received(n);
                    if let Some(reply) = reply {
                        self.enqueue(Payload::Reply(reply), 0);
                    }
                    return;
                }
                // A refused request's payload: the session drops it (the bytes are in the
                // scratch or the stage; their content does not matter) and, after the last,
                // says the request was refused.
                let n = n.min(DISCARD_BYTES);
                let Some(mem) = self.rx.mem.get_mut() else {
                    return self.fail("a refused payload while the scratch space is lent");
                };
                let (_, event) = self.rx.session.handle_input(&mem.scratch[..n]);
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
            // A receive in flight writes into the stage (or leaves it empty): what it brings
            // is parsed after its completion. A parked request holds the stream.
            if self.eof || self.broken || self.rx.is_posted() || self.rx.parked.is_some() {
                return;
            }
            let staged = self.rx.stage_end - self.rx.stage_start;
            match &mut self.rx.state {
                Recv::Header => {
                    // Whole headers only, so the session never holds part of one (the next
                    // receive then takes exactly the rest, and a payload lands in place).
                    let missing = match self.rx.session.want() {
                        ServerWant::Header(missing) => missing,
                        _ => return,
                    };
                    if staged < missing || !self.can_take_request() {
                        return;
                    }
                    if cx.overlap && self.tx.outbox.queue.len() >= OVERLAP_REPLIES {
                        // The replies queued so far leave at the end of this turn, before
                        // the rest of the burst is started: the client works on them
                        // meanwhile. The send's completion starts the next ones (`pump`
                        // posts no receive while a whole header is staged).
                        if !self.tx.is_sending() {
                            self.dispatcher.stats.sent_overlapped();
                        }
                        return;
                    }
                    let Some(mem) = self.rx.mem.get_mut() else {
                        return;
                    };
                    let input = &mem.stage[self.rx.stage_start..self.rx.stage_start + missing];
                    let (used, event) = self.rx.session.handle_input(input);
                    self.rx.stage_start += used;
                    match event {
                        Some(event) => self.on_event(cx, event),
                        None => self.rx.start_discard(),
                    }
                }
                Recv::Payload { .. } => {
                    if !self.copy_staged_payload(cx, staged) {
                        return;
                    }
                }
                Recv::Discard { remaining, .. } => {
                    let take = staged.min(*remaining).min(DISCARD_BYTES);
                    if take == 0 {
                        return;
                    }
                    self.rx.stage_start += take;
                    self.payload_received(cx, take);
                }
                // Started only with an empty stage; the socket holds the payload.
                Recv::Piped(_) => return,
            }
        }
    }

    /// Copies the start of the current payload that arrived in the stage with the request
    /// headers into its destination; false if there was nothing to copy.
    fn copy_staged_payload(&mut self, cx: &mut Cx<'_>, staged: usize) -> bool {
        let Recv::Payload {
            dest,
            got,
            len,
            staged: copied,
            ..
        } = &mut self.rx.state
        else {
            return false;
        };
        let take = staged.min(*len - *got);
        // No receive is in flight, so the destination and the stage are ours.
        let (true, Some(dest), Some(mem)) = (take > 0, dest.get_mut(), self.rx.mem.get_mut())
        else {
            return false;
        };
        let from = self.rx.stage_start;
        if !dest.copy_in(*got, &mem.stage[from..from + take]) {
            self.fail("payload bytes from the stage do not fit their destination");
            return false;
        }
        self.dispatcher.stats.copied(take);
        *copied += take;
        self.rx.stage_start += take;
        self.payload_received(cx, take);
        true
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
        self.stop_receiving();
    }

    /// No more requests: the one being received, if any, is dropped unanswered.
    pub(super) fn stop_receiving(&mut self) {
        self.eof = true;
        if let Some(cut) = self.rx.session.close() {
            debug!("the connection ended inside a request: {cut:?}");
        }
        match std::mem::replace(&mut self.rx.state, Recv::Header) {
            Recv::Payload { held, .. } => {
                self.budget.retire(held);
            }
            // A refused request's payload holds nothing; a failed write's remainder does.
            Recv::Discard { reply: None, .. } | Recv::Header => {}
            Recv::Discard { reply: Some(_), .. } | Recv::Piped(_) => self.budget.retire(0),
        }
    }

    /// Starts a request the session accepted (and the server's memory has room for).
    fn start_request(&mut self, cx: &mut Cx<'_>, request: Parked) {
        let Parked {
            header,
            command,
            payload_bytes,
            ..
        } = request;
        self.budget.accept();
        match command {
            Command::Write => self.start_write(cx, header, payload_bytes),
            Command::Read => self.start_read(cx, header),
            _ => self.delegate(cx, header, command, None, 0),
        }
    }

    /// The ring calls this after memory was given back: a parked request starts if there is
    /// room for it now, else it waits on.
    pub fn resume(&mut self, cx: &mut Cx<'_>) {
        let Some(parked) = self.rx.parked.take() else {
            return;
        };
        if self.eof || self.broken {
            // Its connection ended: it is dropped unanswered, as a request cut short is.
            return self.budget.memory().stop_waiting();
        }
        if !self.budget.memory_room(parked.need) {
            self.rx.parked = Some(parked);
            return cx.park_later(self.key);
        }
        self.budget.memory().stop_waiting();
        self.start_request(cx, parked);
        self.pump(cx);
    }

    /// What the session made of the request stream.
    pub(super) fn on_event(&mut self, cx: &mut Cx<'_>, event: ServerEvent) {
        if !matches!(event, ServerEvent::End(_)) {
            *cx.started += 1;
            self.rx.parsed += 1;
        }
        match event {
            ServerEvent::Request {
                header,
                command,
                payload_bytes,
            } => {
                self.rx.count_plain(payload_bytes);
                let need = match command {
                    Command::Read => header.length as usize,
                    _ => payload_bytes,
                };
                let parked = Parked {
                    header,
                    command,
                    payload_bytes,
                    need,
                };
                if !self.budget.memory_room(need) {
                    // The server's buffer memory is taken: this request waits (and the
                    // connection reads nothing more) until some is given back.
                    self.budget.memory().start_waiting();
                    self.rx.parked = Some(parked);
                    return cx.park_later(self.key);
                }
                self.start_request(cx, parked);
            }
            ServerEvent::Rejected {
                header,
                rejection,
                payload_bytes,
            } => {
                self.rx.count_plain(payload_bytes);
                self.budget.accept();
                let reply = self.dispatcher.refused(&header, &rejection);
                self.enqueue(Payload::Reply(reply), 0);
            }
            ServerEvent::End(reason) => {
                if reason.is_violation() {
                    warn!("{reason}: disconnecting client");
                }
                self.eof = true;
            }
        }
    }

    /// A write: where the stack maps its range decides where the payload is received (in
    /// place, spliced into a file, into a registered run, or a pooled buffer) and how it is
    /// written. A FUA write to places a `RWF_DSYNC` write cannot make durable goes through
    /// the stack, as does anything the stack refuses (it answers the refusal).
    pub(super) fn start_write(&mut self, cx: &mut Cx<'_>, header: RequestHeader, len: usize) {
        if len == 0 {
            return self.enqueue_ok(&header, 0);
        }
        let fua = header.flags & cmd_flags::FUA != 0;
        let (place, lease) = match self.write_place(&header, len, fua) {
            Some((place, lease)) => (Some(place), lease),
            None => (None, Lease::none()),
        };
        let Some(medium) = place.as_ref().and_then(Place::medium) else {
            // Through the stack: a change there waits for leases, never for this one.
            drop(lease);
            return self.receive_payload(cx, header, len, None, (None, Lease::none()));
        };
        let facts = WriteFacts {
            medium,
            len,
            fua,
            stage_empty: self.rx.stage_is_empty(),
            socket_fionread: self.rx.socket_fionread,
            in_place_max: self.rx.in_place_max,
        };
        let dest = match (mechanism::choose_write(&cx.shared.options, facts), &place) {
            (WriteMechanism::Piped, Some(Place::File { fd, offset })) => {
                return self.start_piped_write(header, (*fd, *offset, lease), len);
            }
            (WriteMechanism::InPlace, Some(Place::Memory { range, .. })) => {
                Some(Dest::Mapped(range.clone()))
            }
            (WriteMechanism::Direct, Some(Place::Direct { offset, .. })) => self
                .fixed_buf(cx, 0, *offset, len)
                .map(|buf| Dest::Buf(IoBuf::Fixed(buf))),
            _ => None,
        };
        self.receive_payload(cx, header, len, dest, (place, lease));
    }

    /// The one place the stack maps a write's range to, and its lease, if the ring can write
    /// it there itself (`None`: through the stack).
    fn write_place(
        &mut self,
        header: &RequestHeader,
        len: usize,
        fua: bool,
    ) -> Option<(Place, Lease)> {
        self.medium?;
        let stack = &self.dispatcher.stack;
        let lease = stack
            .map(header.offset, len as u64, MapFor::Write, &mut self.map)
            .ok()?;
        let file = matches!(
            self.map.single()?.place,
            Place::File { .. } | Place::Direct { .. }
        );
        if fua && file && !self.map.dsync_is_fua {
            return None;
        }
        self.map.take_single().map(|s| (s.place, lease))
    }

    /// Receives a write's payload into `dest` (a pooled buffer if `None`), bound for `place`
    /// (held by its lease until the write is finished or dropped).
    fn receive_payload(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        len: usize,
        dest: Option<Dest>,
        (place, lease): (Option<Place>, Lease),
    ) {
        debug_assert!(lease.covers(header.offset, len as u64));
        self.rx.small_write_to_memory =
            self.rx.small_write && matches!(dest, Some(Dest::Mapped(_)));
        let (dest, held) = match dest {
            Some(dest @ Dest::Mapped(_)) => (dest, 0),
            Some(dest) => (dest, len),
            None => (Dest::Buf(IoBuf::Pooled(cx.shared.pool.get(len))), len),
        };
        self.budget.hold(held);
        self.rx.state = Recv::Payload {
            header,
            dest: Lent::new(dest),
            got: 0,
            len,
            held,
            staged: 0,
            place,
            lease,
        };
    }

    pub(super) fn on_payload(&mut self, cx: &mut Cx<'_>) {
        let Recv::Payload {
            header,
            dest,
            len,
            held,
            staged,
            place,
            lease,
            ..
        } = std::mem::replace(&mut self.rx.state, Recv::Header)
        else {
            return;
        };
        let dest = match dest.reclaim() {
            Ok(dest) => dest,
            Err(_still_lent) => {
                // A bug: dropping it leaks the buffer rather than free it under the kernel
                // (and the lease is kept for ever rather than end under the kernel's I/O).
                std::mem::forget(lease);
                self.budget.retire(held);
                return self.fail("a payload completed with its buffer still lent");
            }
        };
        let fua = header.flags & cmd_flags::FUA != 0;
        let stats = Arc::clone(&self.dispatcher.stats);
        let buf = match (dest, &place) {
            (Dest::Mapped(_), _) if fua => {
                // Received in place; the stack makes it durable (a flush, on the dispatcher).
                let landed = Landed { len, staged };
                return self.delegate_request(cx, header, Command::Write, None, Some(landed), held);
            }
            (Dest::Mapped(_), _) => {
                // A prefix that came with a batch of headers was copied (and counted) instead.
                self.dispatcher
                    .stack
                    .wrote_in_place(header.offset, len as u64);
                stats.write_done(WritePath::InPlace { staged }, len);
                return self.enqueue_ok(&header, held);
            }
            (Dest::Buf(buf @ IoBuf::Fixed(_)), &Some(Place::Direct { direct, offset, .. })) => {
                let at = FileAt {
                    fd: direct,
                    offset,
                    direct: true,
                };
                let at = (at, lease);
                return self.start_file_op(cx, FileOpKind::Write, header, at, buf, held);
            }
            (Dest::Buf(IoBuf::Pooled(buf)), _) => buf,
            (Dest::Buf(IoBuf::Fixed(_)), _) => {
                self.budget.retire(held);
                return self.fail("a registered run for a write to no O_DIRECT file");
            }
        };
        self.land_bounced(cx, header, place, lease, (buf, len), held);
    }

    /// A payload received into a bounce buffer (`buf`, `len` bytes): copied into memory,
    /// written to its file place (a ring write), or handed to the stack.
    fn land_bounced(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        place: Option<Place>,
        lease: Lease,
        (buf, len): (PooledBuf, usize),
        held: usize,
    ) {
        let fua = header.flags & cmd_flags::FUA != 0;
        match place {
            Some(Place::Memory { range, .. }) if !fua => {
                // The copy baseline: a bounce buffer, then memcpy into place.
                range.copy_in(0, &buf);
                self.dispatcher
                    .stack
                    .wrote_in_place(header.offset, len as u64);
                self.dispatcher.stats.write_done(WritePath::Copied, len);
                self.enqueue_ok(&header, held);
            }
            Some(Place::File { fd, offset }) => {
                let at = FileAt {
                    fd,
                    offset,
                    direct: false,
                };
                let buf = IoBuf::Pooled(buf);
                self.start_file_op(cx, FileOpKind::Write, header, (at, lease), buf, held);
            }
            Some(Place::Direct {
                direct,
                buffered,
                offset,
            }) => {
                let aligned = is_aligned(&buf) && self.direct_range_ok(offset, len);
                let fd = if aligned { direct } else { buffered };
                let at = FileAt {
                    fd,
                    offset,
                    direct: aligned,
                };
                let buf = IoBuf::Pooled(buf);
                self.start_file_op(cx, FileOpKind::Write, header, (at, lease), buf, held);
            }
            _ => {
                // Through the stack, whose change would wait for this lease: end it first.
                drop(lease);
                self.delegate(cx, header, Command::Write, Some(buf), held)
            }
        }
    }
}
