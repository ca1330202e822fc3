//! Reads and writes of the backend file through the ring, with a buffer.
use super::*;

impl Conn {
    // ---- file reads and writes ----

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_file_op(
        &mut self,
        cx: &mut Cx<'_>,
        kind: FileOpKind,
        header: RequestHeader,
        fd: RawFd,
        buf: PooledBuf,
        held: usize,
        direct: bool,
    ) {
        let op = FileOp {
            kind,
            header,
            fd,
            buf,
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
        let rest = op.buf.len() - op.done;
        let ptr = op.buf.as_mut_ptr().wrapping_add(op.done);
        let offset = op.header.offset + op.done as u64;
        let fd = types::Fd(op.fd);
        let (entry, tag) = match op.kind {
            FileOpKind::Read => (
                opcode::Read::new(fd, ptr, rest as u32)
                    .offset(offset)
                    .build(),
                Tag::FileRead,
            ),
            FileOpKind::Write => {
                let fua = op.header.flags & cmd_flags::FUA != 0;
                let flags = if fua { libc::RWF_DSYNC } else { 0 };
                let write = opcode::Write::new(fd, ptr, rest as u32)
                    .offset(offset)
                    .rw_flags(flags);
                (write.build(), Tag::FileWrite)
            }
        };
        let entry = entry.user_data(self.key.op(tag, index as u16));
        if !self.push(cx, &[entry]) {
            self.finish_file_op(index, Err((Errno::Io, "cannot submit".into())));
        }
    }

    pub(super) fn on_file(&mut self, cx: &mut Cx<'_>, index: usize, result: i32) {
        let Some(op) = self.file_ops.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
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
        if op.done < op.buf.len() {
            return self.post_file_op(cx, index);
        }
        self.finish_file_op(index, Ok(()));
    }

    pub(super) fn finish_file_op(&mut self, index: usize, result: Result<(), (Errno, String)>) {
        let Some(op) = self.file_ops[index].take() else {
            return;
        };
        let stats = Arc::clone(&self.dispatcher.stats);
        let len = op.buf.len() as u64;
        if let Err((errno, why)) = result {
            return self.enqueue_error(&op.header, errno, &why, op.held);
        }
        if !op.direct {
            // Through the page cache with a bounce buffer: a copy beyond the socket's.
            stats.copied_bytes.add(len);
        }
        match op.kind {
            FileOpKind::Write => {
                stats.write_bytes.add(len);
                self.enqueue_ok(&op.header, op.held);
            }
            FileOpKind::Read => {
                stats.read_bytes.add(len);
                let header_bytes = self.data_header(&op.header, op.buf.len());
                let reply = Reply::with_data(header_bytes, op.buf);
                let payload = if op.direct && self.zerocopy_ok {
                    Payload::ZeroCopy(reply)
                } else {
                    Payload::Reply(reply)
                };
                self.enqueue(payload, op.held);
            }
        }
    }
}
