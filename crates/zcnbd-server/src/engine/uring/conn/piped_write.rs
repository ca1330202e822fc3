//! Buffered-file writes spliced from the socket through a pipe into the file: the payload
//! goes socket → pipe (page references, no copy) → page cache (the one kernel copy), never
//! through userspace. Measured against recv + pwrite in docs/benchmarks/history.md.
//!
//! The socket half runs on the ring thread, and never waits: it splices only what the
//! socket already holds (`FIONREAD`) into a nonblocking pipe, and polls the socket when
//! nothing is there yet. The file half is an io_uring `SPLICE` (run by an io-wq worker,
//! since writing the page cache may wait for reads or writeback).
use super::*;

/// A spliced write in progress.
pub(super) struct PipedWrite {
    header: RequestHeader,
    fd: RawFd,
    /// The file offset of the payload's first byte (where the stack mapped it).
    offset: u64,
    len: usize,
    /// Payload bytes taken off the socket into the pipe.
    piped: usize,
    /// Payload bytes written from the pipe into the file.
    written: usize,
    /// A socket poll or a file splice is in flight.
    busy: bool,
    /// The first failure writing the file: the rest of the payload is still taken off the
    /// socket (and dropped), then the request gets this error.
    error: Option<(Errno, String)>,
    /// The socket ended (or failed) before the whole payload came.
    cut_short: bool,
    /// The last poll said the socket was readable (data or end of stream).
    readable: bool,
    /// The file place stays the request's until the write is finished or dropped (never
    /// while a splice into the file is in flight: `busy`).
    lease: Lease,
}

/// Splices up to `want` bytes the socket already holds into the pipe, without waiting for
/// either: `FIONREAD` bounds the socket side, `SPLICE_F_NONBLOCK` the pipe side (whose slots
/// may run out before its bytes do). Ok(0): nothing was there. Counts its syscalls.
fn take_from_socket(
    socket: &OwnedFd,
    pipe: &Pipe,
    want: usize,
    stats: &crate::stats::Stats,
) -> std::io::Result<usize> {
    stats.syscall();
    let queued = usize::try_from(rustix::io::ioctl_fionread(socket)?).unwrap_or(usize::MAX);
    let n = want.min(queued);
    if n == 0 {
        return Ok(0);
    }
    stats.syscall();
    let flags = rustix::pipe::SpliceFlags::MOVE | rustix::pipe::SpliceFlags::NONBLOCK;
    match rustix::pipe::splice(socket, None, &pipe.write, None, n, flags) {
        Ok(n) => Ok(n),
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// Whether the stream on `socket` has ended (a peek finds its end rather than a byte or
/// nothing yet).
fn stream_ended(socket: &OwnedFd) -> bool {
    let mut byte = [0u8; 1];
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    match rustix::net::recv(socket, &mut byte[..], flags) {
        Ok((taken, _)) => taken == 0,
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => false,
        Err(e) => {
            debug!("peeking at the socket of a spliced write failed: {e}");
            true
        }
    }
}

impl PipedWrite {
    /// A socket poll or a splice into the file is in flight.
    pub(super) fn is_busy(&self) -> bool {
        self.busy
    }
}

impl Conn {
    pub(super) fn start_piped_write(
        &mut self,
        header: RequestHeader,
        (fd, offset, lease): (RawFd, u64, Lease),
        len: usize,
    ) {
        debug_assert!(lease.covers(header.offset, len as u64));
        // The splice takes bytes off the socket: what the last receive saw waiting there
        // says nothing about what will be left (no reply may wait on it).
        self.rx.more_waiting = false;
        self.rx.state = Recv::Piped(Box::new(PipedWrite {
            header,
            fd,
            offset,
            len,
            piped: 0,
            written: 0,
            busy: false,
            error: None,
            cut_short: false,
            readable: false,
            lease,
        }));
    }

    /// Posts the next step of a spliced write, or finishes it.
    pub(super) fn post_piped(&mut self, cx: &mut Cx<'_>) {
        if self.rx.pipe.is_none() {
            match Pipe::new() {
                Ok(pipe) => self.rx.pipe = Some(pipe),
                Err(e) => return self.fail(&format!("cannot create a pipe: {e}")),
            }
        }
        let (Some(pipe), Recv::Piped(w)) = (self.rx.pipe.as_ref(), &mut self.rx.state) else {
            return;
        };
        if w.busy {
            return;
        }
        let in_pipe = w.piped - w.written;
        if w.error.is_some() && in_pipe > 0 {
            // Nothing more goes to the file: empty the pipe.
            let Some(mem) = self.rx.mem.get_mut() else {
                return self.fail("the write pipe needs the scratch space while it is lent");
            };
            if !empty_pipe(pipe, in_pipe, &mut mem.scratch) {
                return self.fail("cannot empty the write pipe");
            }
            w.written = w.piped;
        }
        if w.error.is_some() || w.written == w.len {
            return self.finish_piped();
        }
        let mut in_pipe = in_pipe;
        let want = (w.len - w.piped).min(pipe.capacity - in_pipe);
        if want > 0 {
            match take_from_socket(
                rx_fd(&self.tls_feed, &self.socket),
                pipe,
                want,
                &self.dispatcher.stats,
            ) {
                Ok(0) if w.readable && in_pipe == 0 => {
                    // Readable with nothing taken: the stream ended mid-payload - if a
                    // peek says so. A splice may also find nothing it can take yet (the
                    // bytes still in the socket's backlog, a signal): then poll again.
                    w.readable = false;
                    w.cut_short = stream_ended(rx_fd(&self.tls_feed, &self.socket));
                }
                Ok(0) => {}
                Ok(n) => {
                    w.piped += n;
                    in_pipe += n;
                    w.readable = false;
                }
                Err(e) => {
                    debug!("splicing a write payload off the socket failed: {e}");
                    w.cut_short = true;
                }
            }
        }
        if w.cut_short {
            return self.drop_piped();
        }
        let sqe = next_piped_op(
            self.key,
            rx_fd(&self.tls_feed, &self.socket).as_raw_fd(),
            pipe,
            w,
            in_pipe,
        );
        w.busy = true;
        let result = cx.driver.submit(&mut [sqe]);
        if !self.submitted(result, 1) {
            if let Recv::Piped(w) = &mut self.rx.state {
                w.busy = false;
            }
        }
    }

    /// The payload can never be complete: the request is dropped unanswered.
    fn drop_piped(&mut self) {
        self.rx.state = Recv::Header;
        self.budget.retire(0);
        self.eof = true;
    }

    pub(super) fn on_piped(&mut self, cx: &mut Cx<'_>, tag: Tag, result: i32) {
        let Recv::Piped(w) = &mut self.rx.state else {
            return;
        };
        w.busy = false;
        match (tag, result) {
            (_, r) if is_retry(r) => {}
            // The socket poll: readable (data, or the end of the stream), or failed.
            (Tag::PipeIn, r) if r > 0 => w.readable = true,
            (Tag::PipeIn, _) => w.cut_short = true,
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
        if w.cut_short || self.broken || self.eof {
            return self.drop_piped();
        }
        self.post_piped(cx);
    }

    /// The whole payload is off the socket: answer the request.
    fn finish_piped(&mut self) {
        let Recv::Piped(w) = std::mem::replace(&mut self.rx.state, Recv::Header) else {
            return;
        };
        // What came off the socket; a failed write's rest is drained (and told) as a discard.
        self.rx.session.payload_received(w.piped);
        if w.piped > 0 {
            self.dispatcher
                .stack
                .wrote_in_place(w.header.offset, w.piped as u64);
        }
        match w.error {
            Some((errno, why)) => {
                let rest = w.len - w.piped;
                if rest == 0 {
                    return self.enqueue_error(&w.header, errno, &why, 0);
                }
                let reply = error_reply(self.ctx.mode, &w.header, errno, &why);
                self.rx.state = Recv::Discard {
                    remaining: rest,
                    reply: Some(reply),
                };
            }
            None => {
                let stats = &self.dispatcher.stats;
                stats.write_done(WritePath::Spliced, w.len);
                self.enqueue_ok(&w.header, 0);
            }
        }
    }
}

/// Reads and drops the `bytes` a pipe holds (they are there, so the reads do not wait);
/// false if they could not all be read.
fn empty_pipe(pipe: &Pipe, bytes: usize, scratch: &mut [u8]) -> bool {
    let mut left = bytes;
    while left > 0 {
        let take = left.min(scratch.len());
        match rustix::io::read(&pipe.read, &mut scratch[..take]) {
            Ok(n) if n > 0 => left -= n,
            Err(rustix::io::Errno::INTR) => {}
            _ => return false,
        }
    }
    true
}

/// The next step of a spliced write: the pipe's `in_pipe` bytes into the file, or, with
/// nothing in the pipe yet, a wait until the socket has more (or the stream ends).
fn next_piped_op(
    key: ConnKey,
    socket: RawFd,
    pipe: &Pipe,
    w: &PipedWrite,
    in_pipe: usize,
) -> Sqe<'static> {
    if in_pipe == 0 {
        let poll = Op::Poll {
            fd: socket,
            events: libc::POLLIN as u32,
        };
        return Sqe::new(key.op(Tag::PipeIn, 0), poll);
    }
    let at = w.header.offset + w.written as u64;
    debug_assert!(w.lease.covers(at, in_pipe as u64));
    // SPLICE_F_NONBLOCK: if the pipe holds less than asked (it should not), a short result
    // rather than a wait on a pipe nobody else writes to.
    let splice = Op::Splice {
        from: pipe.read.as_raw_fd(),
        from_offset: None,
        to: w.fd,
        to_offset: Some(w.offset + w.written as u64),
        len: in_pipe,
        flags: libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
    };
    Sqe::new(key.op(Tag::PipeOut, 0), splice)
}
