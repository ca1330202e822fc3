//! The NBD upstream's asynchronous side: each operation goes to the client library's
//! callback API with the memory it owns (a read lands in the buffer its reply is sent from,
//! a write leaves from the buffer its payload was received into), and one driver thread per
//! upstream runs the client's completions. `submit` never waits: an operation that finds no
//! request slot waits in the client's backlog, and one whose connection is lost is parked
//! here until the driver thread has made a new connection, then started on it (a block
//! write may be repeated, which is safe); after the reconnect time it fails with EIO.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zcnbd_client::{Client, WriteFlags};

use super::nbd::clip_into;
use super::nbd_upstream::{errno, lock, Upstream};
use crate::export::{AsyncOp, Completion};
use crate::pipe::Pipe;

/// Longest the driver thread waits for a completion before it looks at parked operations
/// and at whether the connection was replaced or the backend is stopping.
const DRIVE_SLICE: Duration = Duration::from_millis(100);

/// An operation started on the upstream, with what starting it again needs.
pub(super) struct Pending {
    op: AsyncOp,
    done: Completion,
    /// The connection it was last started on.
    generation: u64,
    /// When it fails if no new connection took it: set when it is first parked.
    deadline: Option<Instant>,
}

impl Pending {
    /// `op` and its completion, not yet started.
    pub fn new(op: AsyncOp, done: Completion) -> Pending {
        Pending {
            op,
            done,
            generation: 0,
            deadline: None,
        }
    }
}

/// A pipe lent to the client library for a read: its write end is what the read splices
/// into.
struct WriteEnd(Pipe);

impl AsFd for WriteEnd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.write.as_fd()
    }
}

/// Fails `pending` with EIO (its connection did not come back, or the backend stops).
fn fail(pending: Pending) {
    let eio = io::Error::from_raw_os_error(libc::EIO);
    pending.done.complete(pending.op, Err(eio));
}

impl Upstream {
    /// Starts `pending` on the connection now.
    pub fn start(self: &Arc<Self>, pending: Pending) {
        let (generation, client) = self.current();
        self.start_on(generation, &client, pending);
    }

    /// Starts `pending` on `client`, of generation `generation`: its callback ends it.
    fn start_on(self: &Arc<Self>, generation: u64, client: &Client, pending: Pending) {
        let Pending {
            op, done, deadline, ..
        } = pending;
        let upstream = Arc::clone(self);
        let end = move |op: AsyncOp, result| {
            let pending = Pending {
                op,
                done,
                generation,
                deadline,
            };
            upstream.ended(pending, result);
        };
        match op {
            AsyncOp::Read { buf, offset } => client.start_read(buf, offset, move |buf, r| {
                end(AsyncOp::Read { buf, offset }, r)
            }),
            // Started again after its connection was lost: the pipe may hold bytes of the
            // first try, so this one goes to memory (nothing in the pipe counts).
            AsyncOp::ReadPiped {
                pipe, buf, offset, ..
            } if deadline.is_some() => client.start_read(buf, offset, move |buf, r| {
                let op = AsyncOp::ReadPiped {
                    pipe,
                    buf,
                    offset,
                    in_pipe: 0,
                };
                end(op, r)
            }),
            AsyncOp::ReadPiped {
                pipe, buf, offset, ..
            } => client.start_read_to_pipe(WriteEnd(pipe), buf, offset, move |pipe, buf, r| {
                let in_pipe = r.as_ref().map_or(0, |&n| n as usize);
                let op = AsyncOp::ReadPiped {
                    pipe: pipe.0,
                    buf,
                    offset,
                    in_pipe,
                };
                end(op, r.map(drop))
            }),
            AsyncOp::Write { buf, offset, fua } => {
                let flags = WriteFlags { fua };
                client.start_write(buf, offset, flags, move |buf, r| {
                    end(AsyncOp::Write { buf, offset, fua }, r)
                })
            }
            AsyncOp::Flush => client.start_flush(move |r| end(op, r)),
            AsyncOp::Trim { offset, len, fua } => {
                let flags = WriteFlags { fua };
                client.start_trim(offset, len, flags, move |r| end(op, r))
            }
            AsyncOp::Zero { offset, len, flags } => {
                let asked = zcnbd_client::ZeroFlags {
                    fua: flags.fua,
                    no_hole: !flags.may_trim,
                    fast: flags.fast,
                };
                client.start_write_zeroes(offset, len, asked, move |r| end(op, r))
            }
            AsyncOp::Cache { offset, len } => client.start_cache(offset, len, move |r| end(op, r)),
            AsyncOp::Extents {
                offset,
                len,
                extents_max,
                mut out,
            } => client.start_block_status(offset, len, move |found| {
                let result = found.map(|found| clip_into(found, len, extents_max, &mut out));
                let op = AsyncOp::Extents {
                    offset,
                    len,
                    extents_max,
                    out,
                };
                end(op, result)
            }),
        }
    }

    /// An operation's callback: done, failed, or (its connection lost) parked.
    fn ended(self: &Arc<Self>, pending: Pending, result: Result<(), zcnbd_client::Error>) {
        match result {
            Err(e) if self.may_retry(&e) => self.park(pending, &e),
            // A fast zero the upstream refuses is EOPNOTSUPP, as `ZeroError::NotFast` is.
            result => pending.done.complete(pending.op, result.map_err(errno)),
        }
    }

    /// Keeps `pending` for the next connection (at once on one made since it was started),
    /// and wakes the driver thread to make it; EIO once its deadline has passed.
    fn park(self: &Arc<Self>, mut pending: Pending, why: &zcnbd_client::Error) {
        let deadline = *pending
            .deadline
            .get_or_insert_with(|| Instant::now() + self.reconnect);
        if Instant::now() >= deadline || self.is_stopping() {
            return fail(pending);
        }
        let mut parked = lock(&self.parked);
        let (generation, client) = self.current();
        if generation != pending.generation {
            drop(parked);
            return self.start_on(generation, &client, pending);
        }
        if parked.is_empty() {
            tracing::debug!(uri = %self.uri, why = %why, "operations wait for a new upstream connection");
        }
        parked.push(pending);
        drop(parked);
        self.parked_one(&client);
    }

    /// The driver thread: runs completions until the backend stops (unless an engine runs
    /// them, `poll_here`), and makes a new connection for parked operations.
    pub fn drive(self: &Arc<Self>) {
        while !self.is_stopping() {
            if self.is_polled() {
                self.wait_for_parked(DRIVE_SLICE);
            } else {
                let (_, client) = self.current();
                client.drive(DRIVE_SLICE);
            }
            self.resume();
        }
        let parked = std::mem::take(&mut *lock(&self.parked));
        parked.into_iter().for_each(fail);
    }

    /// Starts the parked operations on a new connection, made now unless another thread
    /// made one since they were parked; fails them if none can be made in time.
    fn resume(self: &Arc<Self>) {
        let (failed, deadline) = {
            let parked = lock(&self.parked);
            let failed = parked.iter().map(|p| p.generation).max();
            let deadline = parked.iter().filter_map(|p| p.deadline).min();
            match (failed, deadline) {
                (Some(failed), Some(deadline)) => (failed, deadline),
                _ => return,
            }
        };
        let why = "a request's connection was lost";
        let reconnected = self.reconnect_after(failed, deadline, &why);
        let parked = std::mem::take(&mut *lock(&self.parked));
        if !reconnected {
            // Those whose time is not up yet wait for the next attempt.
            let now = Instant::now();
            let stopping = self.is_stopping();
            let (expired, waiting): (Vec<_>, Vec<_>) = parked
                .into_iter()
                .partition(|p| stopping || p.deadline.is_none_or(|d| d <= now));
            lock(&self.parked).extend(waiting);
            return expired.into_iter().for_each(fail);
        }
        // Taken after the new connection is current: an operation parked since saw it and
        // started itself (see `park`).
        let (generation, client) = self.current();
        for pending in parked {
            self.start_on(generation, &client, pending);
        }
    }
}
