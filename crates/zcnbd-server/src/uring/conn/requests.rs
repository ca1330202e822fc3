//! Requests the ring does not receive a payload for: reads (on the mechanism the policy
//! chooses) and everything handed to the dispatcher.
use super::*;

impl Conn {
    /// Hands a request to the dispatcher (the worker pool, or an asynchronous backend); the
    /// reply comes back through the mailbox.
    pub(super) fn delegate(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        command: Command,
        payload: Option<PooledBuf>,
        held: usize,
    ) {
        let mailbox = cx.mailbox.clone();
        let key = self.key.packed();
        self.budget
            .hold(held.saturating_sub(payload.as_ref().map_or(0, |p| p.len())));
        let request = Request {
            header,
            command,
            landed: None,
            payload,
        };
        self.dispatcher.start(request, move |reply| {
            mailbox.send(Inbox::Answered { key, reply, held });
        });
    }

    /// A reply from the dispatcher.
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
            sendfile_ok: self.tx.sendfile_ok,
        };
        let mechanism =
            mechanism::choose_read(&cx.shared.options, facts, || self.all_data(&header));
        match (mechanism, &self.source) {
            (ReadMechanism::Mapped, Source::Memory { map, .. }) => {
                // Validation put the range inside the export, which the mapping covers.
                let Some(range) = Mapping::range(map, header.offset, len) else {
                    return self.delegate(cx, header, Command::Read, None, len);
                };
                self.enqueue_read(header, |header, _, _| Payload::Mapped { header, range });
            }
            (ReadMechanism::Sendfile, Source::Memory { .. }) => {
                self.enqueue_read(header, |header, offset, len| Payload::Sendfile {
                    header,
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
                let buf = IoBuf::Pooled(cx.shared.pool.get(len));
                self.budget.hold(len);
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
        self.dispatcher.stats.read_done(ReadPath::Export, len);
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
        self.budget.hold(len);
        if let Some(buf) = self.fixed_buf(cx, READ_HEAD_ROOM_BYTES, header.offset, len) {
            let buf = IoBuf::Fixed(buf);
            return self.start_file_op(cx, FileOpKind::Read, header, direct, buf, len, true);
        }
        let buf = cx.shared.pool.get(len);
        let aligned = is_aligned(&buf) && self.direct_range_ok(header.offset, len);
        let fd = if aligned { direct } else { buffered };
        let buf = IoBuf::Pooled(buf);
        self.start_file_op(cx, FileOpKind::Read, header, fd, buf, len, aligned);
    }
}
