//! Runs one validated request against an export and lays out its reply. Engine-independent:
//! an engine only moves bytes in and out; what a request does to the backend, holes versus
//! data, the reply's layout, errors and counters are decided here, for blocking and
//! asynchronous backends alike.
//!
//! [`Dispatcher::start`] is the entry point: the engine gives a request and where its reply
//! goes, and gets the reply exactly once, from whichever thread finishes the request
//! ([`ReplySink`]). A blocking backend's request runs on the worker pool
//! ([`Dispatcher::execute_guarded`], here); an asynchronous backend gets each operation with a
//! completion (`submitted.rs`), and no thread waits while it is in flight. Both lay out
//! their replies with the same functions here; the reply's shape is in `reply.rs`.

mod reply;
mod sink;
mod submitted;

pub use reply::{data_header, error_reply, ok_reply, reply_to, PipedData, Reply, ReplyData};
pub use sink::ReplySink;

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Weak};

use tracing::{debug, error};

use zcnbd_proto::consts::{cmd_flags, state, BASE_ALLOCATION};
use zcnbd_proto::{
    Command, Errno, Extent, Rejection, ReplyMode, ReplyTo, RequestHeader, TransmissionContext,
};

use crate::buffer_pool::{BufferPool, PooledBuf};
use crate::export::{connection, errno_of, AsyncOp, Change, Stack, ZeroFlags};
use crate::pipe::Pipe;
use crate::stats::{ReadPath, Stats, WritePath};
use crate::worker_pool::{panic_message, WorkerPool};

/// Most extents one block status reply describes (the spec allows far more; clients ask again
/// from where the reply ended).
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 1024;
/// Most content chunks one read reply is split into; past that the rest is sent as data.
pub const READ_CHUNKS_MAX: usize = 64;

/// A request ready to run: validated, with its payload (writes) received.
#[derive(Debug)]
pub struct Request {
    pub header: RequestHeader,
    pub command: Command,
    pub payload: Option<PooledBuf>,
    /// A write whose payload the engine received straight into a place the stack mapped it
    /// to (a memory export's mapping): nothing is left to do but make it durable (FUA).
    pub landed: Option<Landed>,
}

/// A write payload received in place.
#[derive(Debug, Clone, Copy)]
pub struct Landed {
    /// Payload bytes.
    pub len: usize,
    /// Of those, bytes that had arrived before (with the handshake) and were copied in.
    pub staged: usize,
}

/// Runs requests for one connection's export.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    /// The export's stack: every operation goes through its checks.
    pub stack: Arc<Stack>,
    pub ctx: TransmissionContext,
    pub pool: Arc<BufferPool>,
    pub stats: Arc<Stats>,
    /// Where a blocking backend's requests run. Weak: the server owns the pool, and a job
    /// that drops the last dispatcher must not drop (and join) the pool it runs on.
    workers: Weak<WorkerPool>,
    /// The stack takes operations through `submit`.
    asynchronous: bool,
    /// Structured reads ask the stack's extents first.
    sparse_reads: bool,
    /// The export's metadata contexts besides `base:allocation` when the connection
    /// negotiated (what its context numbers name, whatever the export offers since).
    contexts: Vec<String>,
    /// The connection's number, for layers that keep something per connection.
    connection: u64,
    /// The engine takes replies whose data waits in a pipe ([`ReplyData::Piped`]).
    piped_reads: bool,
    /// On an asynchronous stack that pipes reads, the shortest read that goes through a pipe
    /// (`--splice-min-bytes`).
    piped_read_min_bytes: usize,
}

/// A failed request: the errno and a message for the error chunk.
type Failure = (Errno, String);

fn io_failure(what: &str, e: &std::io::Error) -> Failure {
    (errno_of(e), format!("{what}: {e}"))
}

/// How a failed operation is answered: its errno, and what it was.
fn op_failure(op: &AsyncOp, e: &std::io::Error) -> Failure {
    if matches!(op, AsyncOp::Zero { flags, .. } if flags.fast)
        && e.raw_os_error() == Some(libc::EOPNOTSUPP)
    {
        return (Errno::NotSup, "zeroing would not be fast".to_owned());
    }
    io_failure(op.what(), e)
}

/// Whether the client asked for durability before the reply.
fn fua(h: &RequestHeader) -> bool {
    h.flags & cmd_flags::FUA != 0
}

/// What a command without data does to the backend (`None`: nothing, as for a zero-length
/// trim, cache or zeroing).
fn effect_op(command: Command, h: &RequestHeader) -> Option<AsyncOp> {
    let (offset, len) = (h.offset, h.length);
    match command {
        Command::Flush => Some(AsyncOp::Flush),
        Command::Trim if len > 0 => Some(AsyncOp::Trim {
            offset,
            len,
            fua: fua(h),
        }),
        Command::Cache if len > 0 => Some(AsyncOp::Cache { offset, len }),
        Command::WriteZeroes if len > 0 => Some(AsyncOp::Zero {
            offset,
            len,
            flags: ZeroFlags {
                may_trim: h.flags & cmd_flags::NO_HOLE == 0,
                fast: h.flags & cmd_flags::FAST_ZERO != 0,
                fua: fua(h),
            },
        }),
        _ => None,
    }
}

/// The range a request may change the maps of (a write through the stack, trim, zeroing),
/// if any: such a request waits for the engines' leases on it.
fn changed_range(req: &Request) -> Option<(u64, u64)> {
    let h = &req.header;
    match req.command {
        Command::Write if req.landed.is_none() => {
            let len = req.payload.as_ref().map_or(0, |p| p.len() as u64);
            (len > 0).then_some((h.offset, len))
        }
        Command::Trim | Command::WriteZeroes if h.length > 0 => Some((h.offset, h.length)),
        _ => None,
    }
}

/// Most extents a block status reply to `h` carries; a zero-length query is refused.
fn block_status_max(h: &RequestHeader) -> Result<usize, Failure> {
    // A status chunk must hold at least one extent of nonzero length, which a zero-length
    // query cannot give.
    if h.length == 0 {
        return Err((Errno::Inval, "zero-length block status".to_owned()));
    }
    Ok(if h.flags & cmd_flags::REQ_ONE != 0 {
        1
    } else {
        BLOCK_STATUS_EXTENTS_MAX
    })
}

/// A read's extents made to cover exactly its range: no extents (the backend could not
/// say) is all data, the tail past the last extent is data, an extent past the end is cut.
fn cover_read(h: &RequestHeader, mut extents: Vec<Extent>) -> Vec<Extent> {
    let mut covered = 0u64;
    extents.retain_mut(|e| {
        e.length = e.length.min(h.length - covered);
        covered += e.length;
        e.length > 0
    });
    if covered < h.length {
        extents.push(Extent {
            length: h.length - covered,
            flags: 0,
        });
    }
    extents
}

impl Dispatcher {
    /// Runs requests against `stack`: a blocking stack's on `workers`.
    pub fn new(
        stack: Arc<Stack>,
        ctx: TransmissionContext,
        pool: Arc<BufferPool>,
        stats: Arc<Stats>,
        workers: &Arc<WorkerPool>,
        contexts: Vec<String>,
    ) -> Self {
        let asynchronous = stack.is_asynchronous();
        let sparse_reads = stack.sparse_reads();
        Dispatcher {
            stack,
            ctx,
            pool,
            stats,
            workers: Arc::downgrade(workers),
            asynchronous,
            sparse_reads,
            contexts,
            connection: connection::new_connection_id(),
            piped_reads: false,
            piped_read_min_bytes: usize::MAX,
        }
    }

    /// Says that the engine takes replies whose data waits in a pipe (it splices them to
    /// the socket): reads of a stack that pipes reads come back so - a blocking stack's (a
    /// web server's bodies) every one, an asynchronous stack's (an NBD upstream's) those of
    /// at least `min_bytes`.
    pub fn take_piped_reads(&mut self, min_bytes: usize) {
        self.piped_reads = true;
        self.piped_read_min_bytes = min_bytes;
    }

    /// The name of the connection's context `number`.
    fn context_name(&self, number: usize) -> &str {
        match number {
            0 => BASE_ALLOCATION,
            n => self.contexts.get(n - 1).map_or("", String::as_str),
        }
    }

    /// Starts `req`; `deliver` gets its reply exactly once, from whichever thread finishes
    /// it (a worker, or the thread an asynchronous backend completes on). If the reply is
    /// lost on the way (a panic, a completion the backend dropped), `deliver` gets an `EIO`
    /// reply instead, so the engine's accounting for the request is always released.
    pub fn start(self: &Arc<Self>, req: Request, deliver: impl FnOnce(Reply) + Send + 'static) {
        let sink = ReplySink::new(self.ctx.mode, req.header, deliver);
        if self.asynchronous {
            return self.submit_request(req, sink);
        }
        let changed = changed_range(&req);
        let dispatcher = Arc::clone(self);
        let workers = self.workers.clone();
        let run = move |change: Change| {
            // The pool is gone only once the server is: then the sink answers EIO as it
            // drops.
            let Some(workers) = workers.upgrade() else {
                return;
            };
            let lane = dispatcher.stack.lane().cloned();
            let job: crate::worker_pool::Job = Box::new(move || {
                let reply = change.enter(|| dispatcher.execute_guarded(req));
                drop(change);
                sink.send(reply);
            });
            match lane {
                Some(lane) => workers.submit_in(&lane, job),
                None => workers.submit(job),
            }
        };
        match changed {
            // A request that may change maps waits, without a thread, for the engines'
            // leases in its way (see `export/lease.rs`).
            Some((offset, len)) if self.stack.changes_wait() => {
                self.stack.when_changeable(offset, len, run)
            }
            _ => run(Change::none()),
        }
    }

    /// Runs `req` and returns its reply; a panic in the backend becomes an `EIO` reply for
    /// this request (logged), so the connection's accounting is released as for any reply
    /// and the server goes on serving.
    pub fn execute_guarded(&self, req: Request) -> Reply {
        let header = req.header;
        match std::panic::catch_unwind(AssertUnwindSafe(|| {
            connection::within(self.connection, || self.execute(req))
        })) {
            Ok(reply) => reply,
            Err(panic) => {
                let what = panic_message(panic.as_ref());
                error!(
                    cookie = header.cookie,
                    "backend panicked ({what}): answering EIO"
                );
                error_reply(self.ctx.mode, &header, Errno::Io, "internal server error")
            }
        }
    }

    /// Runs `req` with the backend's blocking methods and returns its reply.
    pub fn execute(&self, req: Request) -> Reply {
        let h = req.header;
        let result = match req.command {
            Command::Read => self.read(&h),
            Command::Write => match req.landed {
                Some(landed) => self.landed(&h, landed),
                None => self.write(&h, req.payload),
            },
            Command::BlockStatus => self.block_status(&h),
            command => self.effect(command, &h),
        };
        result.unwrap_or_else(|failure| self.failed(&h, failure))
    }

    fn reply_to(&self, h: &RequestHeader) -> ReplyTo {
        reply_to(self.ctx.mode, h)
    }

    fn ok(&self, h: &RequestHeader) -> Reply {
        ok_reply(self.ctx.mode, h)
    }

    /// The reply to a request the session refused (validation, or a payload over the
    /// limit): the errno the spec names. Logged here, once for both engines.
    pub fn refused(&self, h: &RequestHeader, rejection: &Rejection) -> Reply {
        debug!(
            cookie = h.cookie,
            kind = h.kind,
            "refused: {}",
            rejection.reason
        );
        error_reply(self.ctx.mode, h, rejection.errno, rejection.reason)
    }

    fn failed(&self, h: &RequestHeader, (errno, message): Failure) -> Reply {
        let to = self.reply_to(h);
        Reply::single(|out| to.encode_error(errno, &message, out))
    }

    /// Counts `len` bytes written from one of our buffers.
    fn wrote(&self, len: usize) {
        // pwrite from our buffer into the page cache is a copy beyond the socket's.
        self.stats.write_done(WritePath::Copied, len);
    }

    fn write(&self, h: &RequestHeader, payload: Option<PooledBuf>) -> Result<Reply, Failure> {
        if let Some(data) = payload.as_deref().filter(|d| !d.is_empty()) {
            self.stack
                .write(data, h.offset, fua(h))
                .map_err(|e| io_failure("write", &e))?;
            self.wrote(data.len());
        }
        Ok(self.ok(h))
    }

    /// A write whose payload is already in the export: counted, then made durable if the
    /// client asked (FUA).
    fn landed(&self, h: &RequestHeader, landed: Landed) -> Result<Reply, Failure> {
        self.stats.copied(landed.staged);
        self.stats.write_done(
            WritePath::InPlace {
                staged: landed.staged,
            },
            landed.len,
        );
        self.stack
            .written_in_place(h.offset, landed.len as u64, fua(h), false)
            .map_err(|e| io_failure("write (FUA)", &e))?;
        Ok(self.ok(h))
    }

    fn effect(&self, command: Command, h: &RequestHeader) -> Result<Reply, Failure> {
        if let Some(mut op) = effect_op(command, h) {
            self.stack.run(&mut op).map_err(|e| op_failure(&op, &e))?;
        }
        Ok(self.ok(h))
    }

    /// A chunk for each selected context, in the order of their ids.
    fn block_status(&self, h: &RequestHeader) -> Result<Reply, Failure> {
        let max = block_status_max(h)?;
        let mut chunks = Vec::with_capacity(self.ctx.meta.count());
        for (id, number) in self.ctx.meta.ids() {
            let mut extents = Vec::new();
            let context = self.context_name(number);
            self.stack
                .meta_extents(context, h.offset, h.length, max, &mut extents)
                .map_err(|e| io_failure("block status", &e))?;
            chunks.push((id, extents));
        }
        Ok(self.block_status_reply(h, chunks))
    }

    /// A block status reply with a chunk of `extents` for each context id (no extents: the
    /// whole range as one extent with no flags set).
    fn block_status_reply(&self, h: &RequestHeader, chunks: Vec<(u32, Vec<Extent>)>) -> Reply {
        let to = self.reply_to(h);
        let last = chunks.len().saturating_sub(1);
        Reply::single(|out| {
            for (i, (id, mut extents)) in chunks.into_iter().enumerate() {
                if extents.is_empty() {
                    extents.push(Extent {
                        length: h.length,
                        flags: 0,
                    });
                }
                to.encode_block_status_chunk(id, &extents, i == last, out);
            }
        })
    }

    /// Whether a read is answered with one data chunk whatever its extents: simple replies
    /// have no other, and `NBD_CMD_FLAG_DF` asks for it.
    fn read_is_one_chunk(&self, h: &RequestHeader) -> bool {
        self.ctx.mode == ReplyMode::Simple || h.flags & cmd_flags::DF != 0 || !self.sparse_reads
    }

    fn read(&self, h: &RequestHeader) -> Result<Reply, Failure> {
        if h.length == 0 {
            return Ok(self.ok(h));
        }
        let mut extents = Vec::new();
        if !self.read_is_one_chunk(h)
            && self
                .stack
                .extents(h.offset, h.length, READ_CHUNKS_MAX, &mut extents)
                .is_err()
        {
            extents.clear();
        }
        let mut reply = self.read_layout(h, &cover_read(h, extents));
        if let Some(read) = self.read_piped(h, &mut reply) {
            return read.map(|()| reply);
        }
        // Validation bounded the length by the 32 MiB payload limit.
        let mut data = self.pool.get(h.length as usize);
        // Only the data chunks are read: holes are not.
        for range in reply.data_ranges() {
            let at = h.offset + range.start as u64;
            self.stack
                .read(&mut data[range.clone()], at)
                .map_err(|e| io_failure("read", &e))?;
            self.stats.copied(range.len());
        }
        reply.data = Some(ReplyData::Pooled(data));
        self.stats.read_done(ReadPath::Sparse, h.length as usize);
        Ok(reply)
    }

    /// A read in one data chunk put into a pipe by the stack, where the engine takes piped
    /// replies and the stack pipes reads; `None`: read it into a buffer instead (the pipe
    /// would be too small, or none could be made).
    fn read_piped(&self, h: &RequestHeader, reply: &mut Reply) -> Option<Result<(), Failure>> {
        let len = h.length as usize;
        if !self.piped_reads || reply.data_bytes() != len || !self.stack.pipes_reads() {
            return None;
        }
        let pipe = Pipe::spare(len).ok().filter(|p| p.capacity >= len)?;
        match self.stack.read_to_pipe(&pipe, h.offset, len) {
            Ok(read) if read.tail.len() + read.more_bytes() <= len => {
                let copied = read.copied;
                self.stats.copied(copied);
                self.stats.read_done(ReadPath::Piped { copied }, len);
                reply.data = Some(ReplyData::Piped(pipe, read.more, read.tail));
                Some(Ok(()))
            }
            Ok(_) => {
                let e = std::io::Error::from_raw_os_error(libc::EIO);
                Some(Err(io_failure(
                    "read (pipes and tail longer than the read)",
                    &e,
                )))
            }
            Err(e) => Some(Err(io_failure("read", &e))),
        }
    }

    /// A read's reply over `extents` (covering the read): one data chunk if they are all
    /// data (the common case for written ranges), else a hole chunk for each zero extent
    /// and a data chunk for each other. The data buffer is the whole range, attached later.
    fn read_layout(&self, h: &RequestHeader, extents: &[Extent]) -> Reply {
        let to = self.reply_to(h);
        let len = h.length as usize;
        let mut reply = Reply::new();
        if extents.iter().all(|e| e.flags & state::ZERO == 0) {
            to.encode_data_header(h.offset, len as u64, true, &mut reply.headers);
            reply.push_header(0, Some(0..len));
            return reply;
        }
        let mut rel = 0usize;
        for (i, e) in extents.iter().enumerate() {
            let done = i + 1 == extents.len();
            let pos = h.offset + rel as u64;
            let n = e.length as usize;
            let start = reply.headers.len();
            if e.flags & state::ZERO != 0 {
                to.encode_hole(pos, n as u32, done, &mut reply.headers);
                reply.push_header(start, None);
            } else {
                to.encode_data_header(pos, n as u64, done, &mut reply.headers);
                reply.push_header(start, Some(rel..rel + n));
            }
            rel += n;
        }
        reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(length: u64) -> RequestHeader {
        RequestHeader {
            flags: 0,
            kind: 0,
            cookie: 1,
            offset: 4096,
            length,
        }
    }

    fn extent(length: u64, flags: u32) -> Extent {
        Extent { length, flags }
    }

    #[test]
    fn no_extents_is_all_data() {
        assert_eq!(cover_read(&header(100), Vec::new()), [extent(100, 0)]);
    }

    #[test]
    fn the_tail_past_the_extents_is_data() {
        let hole = state::HOLE | state::ZERO;
        let got = cover_read(&header(100), vec![extent(30, hole)]);
        assert_eq!(got, [extent(30, hole), extent(70, 0)]);
    }

    #[test]
    fn extents_past_the_end_are_cut() {
        let hole = state::HOLE | state::ZERO;
        let got = cover_read(
            &header(100),
            vec![extent(60, 0), extent(60, hole), extent(10, 0)],
        );
        assert_eq!(got, [extent(60, 0), extent(40, hole)]);
    }
}
