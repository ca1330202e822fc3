//! Requests on an asynchronous backend: each of a request's operations goes to
//! [`Backend::submit`](crate::export::Backend::submit) with a completion, and the next step
//! runs on whichever thread completes it. What the request does and how its reply is laid
//! out are the blocking path's own functions (`dispatch.rs`); only who waits differs: here,
//! nobody.
//!
//! Submitting runs on the engine's thread; completions on the backend's. A read with
//! structured replies takes two operations, the extents and then the data.

use std::io;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use tracing::error;
use zcnbd_proto::handshake::BASE_ALLOCATION_ID;
use zcnbd_proto::meta::MetaSelected;
use zcnbd_proto::{Command, Errno, Extent, RequestHeader};

use super::{
    block_status_max, cover_read, effect_op, fua, op_failure, panic_message, Dispatcher, Failure,
    Reply, ReplyData, ReplySink, Request, READ_CHUNKS_MAX,
};
use crate::export::{AsyncOp, Completion};
use crate::pipe::Pipe;
use crate::stats::ReadPath;

/// How an operation ended: done (handed back), or failed (handed back with the error).
type Ended = Result<AsyncOp, (AsyncOp, io::Error)>;

/// The answer to a backend that handed back an operation other than the one it was given.
fn mismatch(op: &AsyncOp) -> Failure {
    error!(
        "the backend completed a {} it was not given: answering EIO",
        op.what()
    );
    (Errno::Io, "internal server error".to_owned())
}

impl Dispatcher {
    /// Starts `req` on the asynchronous backend; `sink` gets its reply when the last of its
    /// operations completes (at once if it needs none).
    pub(super) fn submit_request(self: &Arc<Self>, req: Request, sink: ReplySink) {
        let h = req.header;
        match req.command {
            Command::Read => self.submit_read(h, sink),
            Command::Write => match req.payload.filter(|p| !p.is_empty()) {
                Some(buf) => {
                    let len = buf.len();
                    let op = AsyncOp::Write {
                        buf,
                        offset: h.offset,
                        fua: fua(&h),
                    };
                    self.submit_then(op, sink, move |this, _, sink| {
                        this.wrote(len);
                        sink.send(this.ok(&h));
                    });
                }
                None => sink.send(self.ok(&h)),
            },
            Command::BlockStatus => self.submit_block_status(h, sink),
            command => match effect_op(command, &h) {
                Some(op) => self.submit_then(op, sink, move |this, _, sink| {
                    sink.send(this.ok(&h));
                }),
                None => sink.send(self.ok(&h)),
            },
        }
    }

    fn submit_block_status(self: &Arc<Self>, h: RequestHeader, sink: ReplySink) {
        if self.ctx.meta != MetaSelected::BASE_ALLOCATION {
            // Contexts of the export's own (dirty bitmaps: RBD snapshots' diffs, tracked
            // bitmaps): their questions block, so the whole request runs on a worker.
            let Some(workers) = self.workers.upgrade() else {
                return;
            };
            let this = Arc::clone(self);
            return workers.submit(Box::new(move || {
                let reply = this
                    .block_status(&h)
                    .unwrap_or_else(|failure| this.failed(&h, failure));
                sink.send(reply);
            }));
        }
        let extents_max = match block_status_max(&h) {
            Ok(max) => max,
            Err(failure) => return sink.fail(failure),
        };
        let op = AsyncOp::Extents {
            offset: h.offset,
            len: h.length,
            extents_max,
            out: Vec::new(),
        };
        self.submit_then(op, sink, move |this, op, sink| match op {
            AsyncOp::Extents { out, .. } => {
                sink.send(this.block_status_reply(&h, vec![(BASE_ALLOCATION_ID, out)]))
            }
            other => sink.fail(mismatch(&other)),
        });
    }

    /// A read: its extents first (unless it is one data chunk anyway), then its data.
    fn submit_read(self: &Arc<Self>, h: RequestHeader, sink: ReplySink) {
        if h.length == 0 {
            return sink.send(self.ok(&h));
        }
        if self.read_is_one_chunk(&h) {
            return self.submit_read_data(h, &cover_read(&h, Vec::new()), sink);
        }
        let op = AsyncOp::Extents {
            offset: h.offset,
            len: h.length,
            extents_max: READ_CHUNKS_MAX,
            out: Vec::new(),
        };
        self.submit_op(op, sink, move |this, ended, sink| {
            // As on the blocking path, extents the backend cannot give make it all data.
            let extents = match ended {
                Ok(AsyncOp::Extents { out, .. }) => out,
                _ => Vec::new(),
            };
            this.submit_read_data(h, &cover_read(&h, extents), sink);
        });
    }

    /// A read's data: the reply is laid out from `extents`, then the whole range is read in
    /// one operation, holes included - one round trip to a remote store costs more than
    /// reading a hole's zeroes - unless it is all holes.
    fn submit_read_data(self: &Arc<Self>, h: RequestHeader, extents: &[Extent], sink: ReplySink) {
        let mut reply = self.read_layout(&h, extents);
        if reply.data_ranges().next().is_none() {
            self.stats.read_done(ReadPath::Sparse, h.length as usize);
            return sink.send(reply);
        }
        let len = h.length as usize;
        let buf = self.pool.get(len);
        let op = match self.read_pipe(len, &reply) {
            Some(pipe) => AsyncOp::ReadPiped {
                pipe,
                buf,
                offset: h.offset,
                in_pipe: 0,
            },
            None => AsyncOp::Read {
                buf,
                offset: h.offset,
            },
        };
        self.submit_then(op, sink, move |this, op, sink| match op {
            AsyncOp::Read { buf, .. } if buf.len() == len => {
                this.stats.read_done(ReadPath::Copied, len);
                reply.data = Some(ReplyData::Pooled(buf));
                sink.send(reply);
            }
            AsyncOp::ReadPiped { buf, in_pipe, .. } if buf.len() == len && in_pipe == 0 => {
                this.stats.read_done(ReadPath::Copied, len);
                reply.data = Some(ReplyData::Pooled(buf));
                sink.send(reply);
            }
            AsyncOp::ReadPiped {
                pipe, buf, in_pipe, ..
            } if buf.len() == len && in_pipe <= len => {
                // The bytes the pipe did not take follow it (usually none).
                let tail = buf[in_pipe..].to_vec();
                let copied = tail.len();
                this.stats.copied(copied);
                this.stats.read_done(ReadPath::Piped { copied }, len);
                reply.data = Some(ReplyData::Piped(pipe, Vec::new(), tail));
                sink.send(reply);
            }
            other => sink.fail(mismatch(&other)),
        });
    }

    /// A pipe for a read of `len` bytes laid out as `reply`, where the engine takes piped
    /// replies of this length, the stack pipes reads, the reply is one data chunk, and a pipe
    /// that holds it can be had (a process over its pipe allowance gets small pipes).
    fn read_pipe(&self, len: usize, reply: &Reply) -> Option<Pipe> {
        let wanted = self.piped_reads
            && len >= self.piped_read_min_bytes
            && reply.data_bytes() == len
            && self.stack.pipes_reads();
        let pipe = wanted.then(|| Pipe::spare(len).ok());
        pipe.flatten().filter(|p| p.capacity >= len)
    }

    /// Submits `op`; when it completes, `then` takes the operation handed back and `sink`,
    /// on the completing thread. A failed operation is answered with its error.
    fn submit_then(
        self: &Arc<Self>,
        op: AsyncOp,
        sink: ReplySink,
        then: impl FnOnce(&Arc<Self>, AsyncOp, ReplySink) + Send + 'static,
    ) {
        self.submit_op(op, sink, move |this, ended, sink| match ended {
            Ok(op) => then(this, op, sink),
            Err((op, e)) => sink.fail(op_failure(&op, &e)),
        });
    }

    /// Submits `op`; when it ends, `then` takes how and `sink`. A completion the backend
    /// drops, or a panic in `submit`, is answered `EIO` (logged) and `then` never runs.
    fn submit_op(
        self: &Arc<Self>,
        op: AsyncOp,
        sink: ReplySink,
        then: impl FnOnce(&Arc<Self>, Ended, ReplySink) + Send + 'static,
    ) {
        let (what, cookie) = (op.what(), sink.cookie());
        let dispatcher = Arc::clone(self);
        let done = Completion::new(move |op, result| match (op, result) {
            (Some(op), Ok(())) => then(&dispatcher, Ok(op), sink),
            (Some(op), Err(e)) => then(&dispatcher, Err((op, e)), sink),
            (None, _) => {
                error!(
                    cookie,
                    "the backend dropped a {what} uncompleted: answering EIO"
                );
                sink.fail((Errno::Io, format!("{what}: lost by the backend")));
            }
        });
        let stack = &self.stack;
        // A panic drops `done` on the way out (unless the backend kept it), answering EIO.
        if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| stack.submit(op, done))) {
            let message = panic_message(panic.as_ref());
            error!(cookie, "backend panicked submitting a {what} ({message})");
        }
    }
}
