//! Requests the ring does not receive a payload for: reads (on the mechanism the policy
//! chooses) and everything handed to the dispatcher.
use super::*;
use crate::engine::uring::sendfile_trial::LargeReads;
use crate::sys::process::thread_cpu_time;

/// Requests to a stack that never waits run on the ring thread when they cover at most this
/// many bytes (a flush, whatever its length): no hand-off to a worker and back. Longer ones
/// (zeroing or trimming a large range, block status over one) go to a worker, so one
/// request never holds up the ring's other connections for long.
pub(super) const INLINE_BYTES_MAX: u64 = 1 << 20;

impl Conn {
    /// Hands a request to the dispatcher (the worker pool, or an asynchronous backend); the
    /// reply comes back through the mailbox. A stack that never waits runs it here (see
    /// [`INLINE_BYTES_MAX`]).
    pub(super) fn delegate(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        command: Command,
        payload: Option<PooledBuf>,
        held: usize,
    ) {
        self.delegate_request(cx, header, command, payload, None, held);
    }

    /// [`Conn::delegate`] for a request whose payload may have been received in place.
    pub(super) fn delegate_request(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        command: Command,
        payload: Option<PooledBuf>,
        landed: Option<Landed>,
        held: usize,
    ) {
        self.budget
            .hold(held.saturating_sub(payload.as_ref().map_or(0, |p| p.len())));
        let request = Request {
            header,
            command,
            landed,
            payload,
        };
        if self.inline && (command == Command::Flush || header.length <= INLINE_BYTES_MAX) {
            let reply = self.dispatcher.execute_guarded(request);
            return self.enqueue_reply(reply, held);
        }
        let mailbox = cx.mailbox.clone();
        let key = self.key.packed();
        self.dispatcher.start(request, move |reply| {
            mailbox.send(Inbox::Answered { key, reply, held });
        });
    }

    /// A reply from the dispatcher.
    pub fn on_answered(&mut self, cx: &mut Cx<'_>, reply: Reply, held: usize) {
        self.enqueue_reply(reply, held);
        self.pump(cx);
    }

    /// A read: where the stack maps its range decides the mechanism. One place the ring can
    /// reach is answered here with the cheapest mechanism the data path allows; anything
    /// else (a zero length, holes a sparse reply leaves out, several runs, bytes only the
    /// stack computes, a refusal) goes to the dispatcher, which reads through the stack.
    pub(super) fn start_read(&mut self, cx: &mut Cx<'_>, header: RequestHeader) {
        let len = header.length as usize;
        let holes = self.ctx.mode != ReplyMode::Simple && header.flags & cmd_flags::DF == 0;
        let how = MapFor::Read { holes };
        let one = match (len, self.medium) {
            (0, _) | (_, None) => None,
            _ => self
                .dispatcher
                .stack
                .map(header.offset, header.length, how, &mut self.map)
                .ok()
                .and_then(|lease| Some((self.map.take_single()?, lease))),
        };
        let Some(medium) = one.as_ref().and_then(|(s, _)| s.place.medium()) else {
            return self.delegate(cx, header, Command::Read, None, len);
        };
        let (place, lease) = match one {
            Some((s, lease)) => (Some(s.place), lease),
            None => (None, Lease::none()),
        };
        debug_assert!(lease.covers(header.offset, header.length));
        let mut sendfile_min = self.tx.sendfile_min;
        if self.tx.sendfile_tried && medium == Medium::Memory && len >= sendfile_min {
            let trial = &mut *cx.sendfile_trial;
            if trial.current() == LargeReads::Mapped {
                sendfile_min = usize::MAX;
            }
            trial.count(cx.now, len, thread_cpu_time);
        }
        let facts = ReadFacts {
            medium,
            len,
            sendfile_ok: self.tx.sendfile_ok,
            sendfile_min,
        };
        let mechanism = mechanism::choose_read(&cx.shared.options, facts);
        // The lease goes with the place into whatever holds the I/O until it completes.
        match (mechanism, place) {
            (ReadMechanism::Mapped, Some(Place::Memory { range, .. })) => {
                self.enqueue_read(header, |header, _| Payload::Mapped {
                    header,
                    range,
                    lease,
                });
            }
            (ReadMechanism::Sendfile, Some(Place::Memory { fd, range })) => {
                let offset = range.offset();
                self.enqueue_read(header, |header, len| Payload::Sendfile {
                    header,
                    fd,
                    offset,
                    len,
                    lease,
                });
            }
            (ReadMechanism::Splice, Some(Place::File { fd, offset })) => {
                self.enqueue_read(header, |header, len| Payload::Splice {
                    header,
                    fd,
                    offset,
                    len,
                    lease,
                });
            }
            (ReadMechanism::Bounce, Some(Place::Memory { fd, range })) => {
                self.start_bounce_read(cx, header, fd, range.offset(), lease);
            }
            (ReadMechanism::Bounce, Some(Place::File { fd, offset })) => {
                self.start_bounce_read(cx, header, fd, offset, lease);
            }
            (
                ReadMechanism::Direct,
                Some(Place::Direct {
                    direct,
                    buffered,
                    offset,
                }),
            ) => self.start_direct_read(cx, header, (direct, buffered, offset), lease),
            _ => {
                drop(lease);
                self.delegate(cx, header, Command::Read, None, len)
            }
        }
    }

    /// A read into a pooled buffer from `fd` at `offset`, then sent.
    fn start_bounce_read(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        fd: RawFd,
        offset: u64,
        lease: Lease,
    ) {
        let len = header.length as usize;
        let buf = IoBuf::Pooled(cx.shared.pool.get(len));
        self.budget.hold(len);
        let at = FileAt {
            fd,
            offset,
            direct: false,
        };
        self.start_file_op(cx, FileOpKind::Read, header, (at, lease), buf, len);
    }

    /// Queues a read's reply whose data the send takes from the export itself (`payload`
    /// builds it from the data chunk's header and the length).
    fn enqueue_read(
        &mut self,
        header: RequestHeader,
        payload: impl FnOnce(Vec<u8>, usize) -> Payload,
    ) {
        let len = header.length as usize;
        self.dispatcher.stats.read_done(ReadPath::Export, len);
        let chunk_header = self.data_header(&header, len);
        self.enqueue(payload(chunk_header, len), 0);
    }

    /// An O_DIRECT read: into a registered run if one is free (the reply header goes just
    /// before the data), else into a pooled buffer, O_DIRECT when aligned.
    fn start_direct_read(
        &mut self,
        cx: &mut Cx<'_>,
        header: RequestHeader,
        (direct, buffered, offset): (RawFd, RawFd, u64),
        lease: Lease,
    ) {
        let len = header.length as usize;
        self.budget.hold(len);
        if let Some(buf) = self.fixed_buf(cx, READ_HEAD_ROOM_BYTES, offset, len) {
            let (buf, at) = (
                IoBuf::Fixed(buf),
                FileAt {
                    fd: direct,
                    offset,
                    direct: true,
                },
            );
            return self.start_file_op(cx, FileOpKind::Read, header, (at, lease), buf, len);
        }
        let buf = cx.shared.pool.get(len);
        let aligned = is_aligned(&buf) && self.direct_range_ok(offset, len);
        let fd = if aligned { direct } else { buffered };
        let at = FileAt {
            fd,
            offset,
            direct: aligned,
        };
        let buf = IoBuf::Pooled(buf);
        self.start_file_op(cx, FileOpKind::Read, header, (at, lease), buf, len);
    }
}
