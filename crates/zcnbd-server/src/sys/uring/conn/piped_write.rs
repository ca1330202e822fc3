//! Buffered-file writes spliced from the socket through a pipe into the file: the payload
//! goes socket → pipe (page references, no copy) → page cache (the one kernel copy), never
//! through userspace. Measured against recv + pwrite in docs/BENCHMARKS.md.
//!
//! Each step is a linked pair `SPLICE socket → pipe` then `SPLICE pipe → file`, run by
//! io_uring's workers. A socket splice returns what has arrived; a short one fails the link,
//! so its file half is cancelled and the next step writes what the pipe holds.
use super::*;

/// A spliced write in progress.
pub(super) struct PipedWrite {
    header: RequestHeader,
    fd: RawFd,
    len: usize,
    /// Payload bytes taken off the socket into the pipe.
    piped: usize,
    /// Payload bytes written from the pipe into the file.
    written: usize,
    /// Splices in flight.
    pending: usize,
    /// The first failure writing the file: the rest of the payload is still taken off the
    /// socket (and dropped), then the request gets this error.
    error: Option<(Errno, String)>,
    /// The socket ended (or failed) before the whole payload came.
    cut_short: bool,
}

impl Conn {
    /// Whether this write's payload goes socket → pipe → file.
    pub(super) fn pipes_write(&self, cx: &Cx<'_>, header: &RequestHeader, len: usize) -> bool {
        let options = &cx.shared.options;
        let pays = match options.data_path {
            DataPath::Copy => false,
            DataPath::ZeroCopy => true,
            DataPath::Auto => len >= options.receive_splice_min_bytes,
        };
        // FUA needs RWF_DSYNC, which only the write path carries.
        pays && header.flags & cmd_flags::FUA == 0
            && matches!(self.source, Source::PageCache { .. })
    }

    pub(super) fn start_piped_write(&mut self, header: RequestHeader, fd: RawFd, len: usize) {
        self.recv = Recv::Piped(Box::new(PipedWrite {
            header,
            fd,
            len,
            piped: 0,
            written: 0,
            pending: 0,
            error: None,
            cut_short: false,
        }));
    }

    /// Posts the next step of a spliced write, or finishes it.
    pub(super) fn post_piped(&mut self, cx: &mut Cx<'_>) {
        if self.recv_pipe.is_none() {
            match Pipe::new() {
                Ok(pipe) => self.recv_pipe = Some(pipe),
                Err(e) => return self.fail(&format!("cannot create a pipe: {e}")),
            }
        }
        let (Some(pipe), Recv::Piped(w)) = (self.recv_pipe.as_ref(), &mut self.recv) else {
            return;
        };
        if w.pending > 0 {
            return;
        }
        let in_pipe = w.piped - w.written;
        if w.error.is_some() && in_pipe > 0 {
            // Nothing more goes to the file: empty the pipe (the bytes are there, so the
            // read does not wait).
            let mut left = in_pipe;
            while left > 0 {
                let take = left.min(self.scratch.len());
                match rustix::io::read(&pipe.read, &mut self.scratch[..take]) {
                    Ok(n) if n > 0 => left -= n,
                    Err(rustix::io::Errno::INTR) => {}
                    _ => break,
                }
            }
            if left > 0 {
                return self.fail("cannot empty the write pipe");
            }
            w.written = w.piped;
        }
        if w.error.is_some() || w.written == w.len {
            return self.finish_piped(cx);
        }
        let sock = self.socket.as_raw_fd();
        let fill = (w.len - w.piped).min(pipe.capacity - in_pipe);
        let mut entries = Vec::with_capacity(2);
        if fill > 0 {
            let e = opcode::Splice::new(
                types::Fd(sock),
                -1,
                types::Fd(pipe.write.as_raw_fd()),
                -1,
                fill as u32,
            )
            .flags(libc::SPLICE_F_MOVE)
            .build()
            .flags(squeue::Flags::IO_LINK);
            entries.push(e.user_data(self.key.op(Tag::PipeIn, 0)));
        }
        // SPLICE_F_NONBLOCK: if the pipe holds less than asked (it should not), a short
        // result rather than a wait on a pipe nobody else writes to.
        let offset = (w.header.offset + w.written as u64) as i64;
        let e = opcode::Splice::new(
            types::Fd(pipe.read.as_raw_fd()),
            -1,
            types::Fd(w.fd),
            offset,
            (in_pipe + fill) as u32,
        )
        .flags(libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK);
        entries.push(e.build().user_data(self.key.op(Tag::PipeOut, 0)));
        w.pending = entries.len();
        if !self.push(cx, &entries) {
            if let Recv::Piped(w) = &mut self.recv {
                w.pending = 0;
            }
        }
    }

    pub(super) fn on_piped(&mut self, cx: &mut Cx<'_>, tag: Tag, result: i32) {
        let Recv::Piped(w) = &mut self.recv else {
            return;
        };
        w.pending -= 1;
        match (tag, result) {
            // The file half of a step whose socket half came up short.
            (_, r) if r == -libc::ECANCELED => {}
            (_, r) if is_retry(r) => {}
            (Tag::PipeIn, r) if r > 0 => w.piped += r as usize,
            (Tag::PipeIn, r) => {
                if r < 0 {
                    let e = std::io::Error::from_raw_os_error(-r);
                    debug!("splicing a write payload off the socket failed: {e}");
                }
                w.cut_short = true;
            }
            (_, r) if r > 0 => w.written += r as usize,
            (_, r) => {
                let (errno, why) = if r < 0 {
                    let e = std::io::Error::from_raw_os_error(-r);
                    (errno_of(&e), e.to_string())
                } else {
                    (Errno::Io, "splice into the file wrote nothing".to_string())
                };
                w.error.get_or_insert((errno, why));
            }
        }
        if w.pending > 0 {
            return;
        }
        if w.cut_short || self.broken || self.eof {
            // The payload can never be complete: the request is dropped unanswered.
            self.recv = Recv::Header;
            self.inflight -= 1;
            self.eof = true;
            return;
        }
        self.post_piped(cx);
    }

    /// The whole payload is off the socket: answer the request.
    fn finish_piped(&mut self, _cx: &mut Cx<'_>) {
        let Recv::Piped(w) = std::mem::replace(&mut self.recv, Recv::Header) else {
            return;
        };
        match w.error {
            Some((errno, why)) => {
                let rest = w.len - w.piped;
                if rest == 0 {
                    return self.enqueue_error(&w.header, errno, &why, 0);
                }
                let reply = error_reply(self.ctx.mode, &w.header, errno, &why);
                self.recv = Recv::Discard {
                    remaining: rest,
                    reply: Some(reply),
                };
            }
            None => {
                let stats = &self.dispatcher.stats;
                stats.received_splice_bytes.add(w.len as u64);
                stats.write_bytes.add(w.len as u64);
                self.enqueue_ok(&w.header, 0);
            }
        }
    }
}
