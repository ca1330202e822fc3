//! Reads and writes of the backend file through the ring, with a pooled buffer or (O_DIRECT)
//! a registered run.
use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum FileOpKind {
    Read,
    Write,
}

/// Where in a file an operation goes: the place the export's stack mapped the request to.
#[derive(Clone, Copy)]
pub(super) struct FileAt {
    pub fd: RawFd,
    /// The file offset of the request's first byte.
    pub offset: u64,
    /// `fd` is the O_DIRECT descriptor.
    pub direct: bool,
}

/// A read or write of a file the export's stack named, in flight.
pub(super) struct FileOp {
    kind: FileOpKind,
    header: RequestHeader,
    at: FileAt,
    /// Lent to the read or write in flight, if any.
    buf: Lent<IoBuf>,
    /// The place stays the request's until the operation is finished (dropped with it).
    lease: Lease,
    /// The buffer's length (the bytes to read or write).
    len: usize,
    done: usize,
    held: usize,
}

impl Conn {
    // ---- file reads and writes ----

    /// Whether this connection's aligned O_DIRECT requests use the ring's registered buffers
    /// (not on the `copy` data path, which keeps the classic bounce-buffer path as a baseline).
    pub fn wants_fixed_buffers(&self, options: &EngineOptions) -> bool {
        mechanism::uses_fixed_buffers(options, self.medium)
    }

    /// Whether `len` bytes at `offset` can go to the O_DIRECT descriptor (from an aligned
    /// buffer). Validation keeps the request inside the export, so an aligned request never
    /// reaches into an unaligned tail of the file.
    pub(super) fn direct_range_ok(&self, offset: u64, len: usize) -> bool {
        offset.is_multiple_of(DIRECT_ALIGN_BYTES) && (len as u64).is_multiple_of(DIRECT_ALIGN_BYTES)
    }

    /// A registered run with `head_bytes` of header room for an O_DIRECT request of `len`
    /// bytes at `offset`, if this connection uses them, the request can go direct, and a run
    /// is free. Never waits: `None` means "use a pooled buffer".
    pub(super) fn fixed_buf(
        &self,
        cx: &Cx<'_>,
        head_bytes: usize,
        offset: u64,
        len: usize,
    ) -> Option<FixedBuf> {
        if !self.wants_fixed_buffers(&cx.shared.options) || !self.direct_range_ok(offset, len) {
            return None;
        }
        let buf = cx.fixed?.take(head_bytes, len);
        if buf.is_none() {
            self.dispatcher.stats.fixed_buffer_missed();
        }
        buf
    }

    pub(super) fn start_file_op(
        &mut self,
        cx: &mut Cx<'_>,
        kind: FileOpKind,
        header: RequestHeader,
        (at, lease): (FileAt, Lease),
        buf: IoBuf,
        held: usize,
    ) {
        debug_assert!(lease.covers(header.offset, buf.len() as u64));
        let op = FileOp {
            kind,
            header,
            at,
            lease,
            len: buf.len(),
            buf: Lent::new(buf),
            done: 0,
            held,
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

    pub(super) fn post_file_op(&mut self, cx: &mut Cx<'_>, index: usize) {
        let Some(op) = self.file_ops[index].as_mut() else {
            return;
        };
        let (fd, from) = (op.at.fd, op.done);
        let offset = op.at.offset + from as u64;
        let buf = &mut op.buf;
        let (op, tag) = match op.kind {
            FileOpKind::Read => (
                Op::Read {
                    fd,
                    buf,
                    from,
                    offset,
                },
                Tag::FileRead,
            ),
            FileOpKind::Write => {
                let dsync = op.header.flags & cmd_flags::FUA != 0;
                let write = Op::Write {
                    fd,
                    buf,
                    from,
                    offset,
                    dsync,
                };
                (write, Tag::FileWrite)
            }
        };
        // The buffer stays lent until this operation's completion (`on_file`).
        let result = cx.submit(self.key.op(tag, index as u16), op);
        if !self.submitted(result, 1) {
            self.finish_file_op(index, Err((Errno::Io, "cannot submit".into())));
        }
    }

    pub(super) fn on_file(&mut self, cx: &mut Cx<'_>, index: usize, result: i32) {
        let Some(op) = self.file_ops.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        op.buf.complete();
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
        if op.done < op.len {
            return self.post_file_op(cx, index);
        }
        self.finish_file_op(index, Ok(()));
    }

    pub(super) fn finish_file_op(&mut self, index: usize, result: Result<(), (Errno, String)>) {
        let Some(op) = self.file_ops[index].take() else {
            return;
        };
        let stats = Arc::clone(&self.dispatcher.stats);
        if op.kind == FileOpKind::Write && op.done > 0 {
            // Landed (a failed write maybe in part): the stack's layers are told first.
            let len = if result.is_ok() { op.len } else { op.done };
            self.dispatcher
                .stack
                .wrote_in_place(op.header.offset, len as u64);
        }
        let buf = match op.buf.reclaim() {
            Ok(buf) => buf,
            Err(_still_lent) => {
                // A bug: dropping it leaks the buffer rather than free it under the kernel,
                // and the lease is kept for ever rather than end under the kernel's I/O.
                std::mem::forget(op.lease);
                self.fail("a file operation finished with its buffer still lent");
                let why = "buffer still lent to the kernel";
                return self.enqueue_error(&op.header, Errno::Io, why, op.held);
            }
        };
        if let Err((errno, why)) = result {
            if op.kind == FileOpKind::Write && op.header.flags & cmd_flags::FUA != 0 {
                // A failed RWF_DSYNC write is a failed sync: the export's later FLUSH and FUA
                // requests must not succeed on what it may have dropped.
                self.dispatcher.stack.durability_lost(&why);
            }
            return self.enqueue_error(&op.header, errno, &why, op.held);
        }
        // A registered run, O_DIRECT from a pooled buffer (no CPU copy), or through the page
        // cache with a bounce buffer (a copy beyond the socket's).
        let (read, write) = match (&buf, op.at.direct) {
            (IoBuf::Fixed(_), _) => (ReadPath::Fixed, WritePath::Fixed),
            (IoBuf::Pooled(_), true) => (ReadPath::Direct, WritePath::Direct),
            (IoBuf::Pooled(_), false) => (ReadPath::Copied, WritePath::Copied),
        };
        if op.kind == FileOpKind::Write {
            stats.write_done(write, op.len);
            return self.enqueue_ok(&op.header, op.held);
        }
        let header_bytes = self.data_header(&op.header, op.len);
        let payload = match buf {
            IoBuf::Fixed(mut buf) => {
                if !buf.set_header(&header_bytes) {
                    let why = "reply header larger than its room";
                    return self.enqueue_error(&op.header, Errno::Io, why, op.held);
                }
                Payload::Fixed(buf)
            }
            IoBuf::Pooled(buf) if op.at.direct && self.tx.zerocopy_ok => {
                Payload::ZeroCopy(Reply::with_data(header_bytes, buf))
            }
            IoBuf::Pooled(buf) => Payload::Reply(Reply::with_data(header_bytes, buf)),
        };
        stats.read_done(read, op.len);
        self.enqueue(payload, op.held);
    }
}
