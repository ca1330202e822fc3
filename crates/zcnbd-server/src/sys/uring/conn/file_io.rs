//! Reads and writes of the backend file through the ring, with a pooled buffer or (O_DIRECT)
//! a registered run.
use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum FileOpKind {
    Read,
    Write,
}

/// The memory a file operation reads into or writes from.
pub(super) enum FileBuf {
    /// A pooled buffer: plain `READ` / `WRITE`.
    Pooled(PooledBuf),
    /// A registered run: `READ_FIXED` / `WRITE_FIXED`.
    Fixed(FixedBuf),
}

impl FileBuf {
    fn len(&self) -> usize {
        match self {
            FileBuf::Pooled(buf) => buf.len(),
            FileBuf::Fixed(buf) => buf.len(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            FileBuf::Pooled(buf) => buf.as_mut_ptr(),
            FileBuf::Fixed(buf) => buf.data_ptr(),
        }
    }

    /// The registered buffer a fixed operation names, if this is a registered run.
    fn fixed_index(&self) -> Option<u16> {
        match self {
            FileBuf::Fixed(buf) => Some(buf.index()),
            FileBuf::Pooled(_) => None,
        }
    }
}

/// A read or write of the backend file in flight.
pub(super) struct FileOp {
    kind: FileOpKind,
    header: RequestHeader,
    fd: RawFd,
    /// Lent to the read or write in flight, if any.
    buf: Lent<FileBuf>,
    /// The buffer's length (the bytes to read or write).
    len: usize,
    done: usize,
    held: usize,
    direct: bool,
}

impl Conn {
    // ---- file reads and writes ----

    /// Whether this connection's aligned O_DIRECT requests use the ring's registered buffers
    /// (not on the `copy` data path, which keeps the classic bounce-buffer path as a baseline).
    pub fn wants_fixed_buffers(&self, options: &EngineOptions) -> bool {
        mechanism::uses_fixed_buffers(options, self.source.kind())
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_file_op(
        &mut self,
        cx: &mut Cx<'_>,
        kind: FileOpKind,
        header: RequestHeader,
        fd: RawFd,
        buf: FileBuf,
        held: usize,
        direct: bool,
    ) {
        let op = FileOp {
            kind,
            header,
            fd,
            len: buf.len(),
            buf: Lent::new(buf),
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

    pub(super) fn post_file_op(&mut self, cx: &mut Cx<'_>, index: usize) {
        let Some(op) = self.file_ops[index].as_mut() else {
            return;
        };
        let done = op.done;
        let len = (op.len - done) as u32;
        // A registered run is named by its buffer index; `ptr` stays inside it. The buffer
        // stays lent until this operation's completion (`on_file`).
        let (ptr, fixed) = op
            .buf
            .lend(|buf| (buf.as_mut_ptr().wrapping_add(done), buf.fixed_index()));
        let offset = op.header.offset + done as u64;
        let fd = types::Fd(op.fd);
        let fua = op.header.flags & cmd_flags::FUA != 0;
        let flags = if fua { libc::RWF_DSYNC } else { 0 };
        let (entry, tag) = match (op.kind, fixed) {
            (FileOpKind::Read, None) => {
                let read = opcode::Read::new(fd, ptr, len).offset(offset);
                (read.build(), Tag::FileRead)
            }
            (FileOpKind::Read, Some(index)) => {
                let read = opcode::ReadFixed::new(fd, ptr, len, index).offset(offset);
                (read.build(), Tag::FileRead)
            }
            (FileOpKind::Write, None) => {
                let write = opcode::Write::new(fd, ptr, len).offset(offset);
                (write.rw_flags(flags).build(), Tag::FileWrite)
            }
            (FileOpKind::Write, Some(index)) => {
                let write = opcode::WriteFixed::new(fd, ptr, len, index).offset(offset);
                (write.rw_flags(flags).build(), Tag::FileWrite)
            }
        };
        let entry = entry.user_data(self.key.op(tag, index as u16));
        if !self.push(cx, &[entry]) {
            // Never submitted: the buffer comes straight back.
            if let Some(op) = self.file_ops[index].as_mut() {
                op.buf.complete();
            }
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
        let buf = match op.buf.reclaim() {
            Ok(buf) => buf,
            Err(_still_lent) => {
                // A bug: dropping it leaks the buffer rather than free it under the kernel.
                self.fail("a file operation finished with its buffer still lent");
                let why = "buffer still lent to the kernel";
                return self.enqueue_error(&op.header, Errno::Io, why, op.held);
            }
        };
        if let Err((errno, why)) = result {
            return self.enqueue_error(&op.header, errno, &why, op.held);
        }
        // A registered run, O_DIRECT from a pooled buffer (no CPU copy), or through the page
        // cache with a bounce buffer (a copy beyond the socket's).
        let (read, write) = match (&buf, op.direct) {
            (FileBuf::Fixed(_), _) => (ReadPath::Fixed, WritePath::Fixed),
            (FileBuf::Pooled(_), true) => (ReadPath::Direct, WritePath::Direct),
            (FileBuf::Pooled(_), false) => (ReadPath::Copied, WritePath::Copied),
        };
        if op.kind == FileOpKind::Write {
            stats.write_done(write, op.len);
            return self.enqueue_ok(&op.header, op.held);
        }
        let header_bytes = self.data_header(&op.header, op.len);
        let payload = match buf {
            FileBuf::Fixed(mut buf) => {
                if !buf.set_header(&header_bytes) {
                    let why = "reply header larger than its room";
                    return self.enqueue_error(&op.header, Errno::Io, why, op.held);
                }
                Payload::Fixed(buf)
            }
            FileBuf::Pooled(buf) if op.direct && self.tx.zerocopy_ok => {
                Payload::ZeroCopy(Reply::with_data(header_bytes, buf))
            }
            FileBuf::Pooled(buf) => Payload::Reply(Reply::with_data(header_bytes, buf)),
        };
        stats.read_done(read, op.len);
        self.enqueue(payload, op.held);
    }
}
