//! The callback submit API: an operation owns its buffer (any [`StableBuffer`]: a `Vec<u8>`,
//! a server's pooled buffer) until it is done, then a callback gets the buffer back with the
//! result. Nothing here waits: a thread of the caller's drives the client
//! ([`Client::drive`], [`Client::poll`], or [`Client::event_fd`] in an event loop) and the
//! callbacks run on it.
//!
//! No room: an operation that finds every request slot of its connection taken waits in the
//! connection's backlog and is sent as replies free slots, in the order operations were
//! started; the caller never retries. Only a full backlog
//! ([`ClientOptions::operations_queued_max`](crate::ClientOptions::operations_queued_max))
//! fails an operation, with [`Error::Busy`].
//!
//! Failure: every error (a request the export refuses, a lost connection, a full backlog)
//! reaches the callback, never the caller of `start_*`; one found before the operation was
//! queued runs the callback on the caller's thread before `start_*` returns.

use std::os::fd::AsFd;

use zcnbd_proto::consts::{cmd_flags, BASE_ALLOCATION};
use zcnbd_proto::{Command, Extent};

use crate::client::{fua, Client, WriteFlags, ZeroFlags};
use crate::conn::Completed;
use crate::error::{Error, Result};
use crate::plan;
use crate::sys::{lend_pipe, lend_stable, StableBuffer};

impl Client {
    /// Reads `buffer`'s length in bytes at `offset` into `buffer`; `done` gets it back,
    /// filled if the result is `Ok`.
    pub fn start_read<B: StableBuffer>(
        &self,
        buffer: B,
        offset: u64,
        done: impl FnOnce(B, Result<()>) + Send + 'static,
    ) {
        self.start_owned(Command::Read, 0, buffer, offset, done);
    }

    /// Reads `buffer`'s length in bytes at `offset`, its data spliced from the socket into
    /// `pipe` (a pipe's write end) as far as it can be, never through user memory: `done`
    /// gets both back and how many of the read's first bytes are in the pipe; the others
    /// are in `buffer` at their places. All of the read goes to `buffer` under TLS, on a
    /// socket that cannot splice, or for a read split into several requests; the pipe
    /// takes a prefix only while chunks come in order and it has room.
    pub fn start_read_to_pipe<P, B>(
        &self,
        pipe: P,
        buffer: B,
        offset: u64,
        done: impl FnOnce(P, B, Result<u64>) + Send + 'static,
    ) where
        P: AsFd + Send + 'static,
        B: StableBuffer,
    {
        let mut buffer = buffer;
        let lent = lend_stable(&mut buffer);
        let mut parts = match plan::read_write(self.geometry(), Command::Read, 0, offset, lent) {
            Ok(parts) => parts,
            Err(e) => return done(pipe, buffer, Err(e)),
        };
        if let [part] = parts.as_mut_slice() {
            part.pipe = Some(lend_pipe(&pipe));
        }
        // Both move into the completer: the pipe stays open, the bytes in place, until the
        // read is done.
        let completer = move |result: Result<Completed>| {
            done(pipe, buffer, result.map(|c| c.piped_bytes));
        };
        self.start_parts(parts, Box::new(completer));
    }

    /// Writes `buffer` at `offset` (durably first if `flags.fua`); `done` gets it back.
    pub fn start_write<B: StableBuffer>(
        &self,
        buffer: B,
        offset: u64,
        flags: WriteFlags,
        done: impl FnOnce(B, Result<()>) + Send + 'static,
    ) {
        self.start_owned(Command::Write, fua(flags.fua), buffer, offset, done);
    }

    /// Makes every completed write durable.
    pub fn start_flush(&self, done: impl FnOnce(Result<()>) + Send + 'static) {
        self.start_effect(plan::flush(self.geometry()), done);
    }

    /// Discards `length` bytes at `offset`.
    pub fn start_trim(
        &self,
        offset: u64,
        length: u64,
        flags: WriteFlags,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        let bits = fua(flags.fua);
        let parts = plan::effect(self.geometry(), Command::Trim, bits, offset, length);
        self.start_effect(parts, done);
    }

    /// Writes `length` zero bytes at `offset` without sending them.
    pub fn start_write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: ZeroFlags,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        let mut bits = fua(flags.fua);
        if flags.no_hole {
            bits |= cmd_flags::NO_HOLE;
        }
        if flags.fast {
            bits |= cmd_flags::FAST_ZERO;
        }
        let geometry = self.geometry();
        let parts = plan::effect(geometry, Command::WriteZeroes, bits, offset, length);
        self.start_effect(parts, done);
    }

    /// Asks the server to prefetch `length` bytes at `offset`.
    pub fn start_cache(
        &self,
        offset: u64,
        length: u64,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        let parts = plan::effect(self.geometry(), Command::Cache, 0, offset, length);
        self.start_effect(parts, done);
    }

    /// The `base:allocation` extents from `offset`, as [`Client::block_status`] gives them.
    pub fn start_block_status(
        &self,
        offset: u64,
        length: u64,
        done: impl FnOnce(Result<Vec<Extent>>) + Send + 'static,
    ) {
        if !self.geometry().base_allocation {
            return done(Err(Error::Unsupported(
                "base:allocation was not negotiated",
            )));
        }
        self.start_block_status_of(BASE_ALLOCATION, offset, length, done);
    }

    /// The extents of metadata context `name` from `offset`, as [`Client::block_status_of`]
    /// gives them (one request; the server may describe less than `length`, or a little
    /// more).
    pub fn start_block_status_of(
        &self,
        name: &str,
        offset: u64,
        length: u64,
        done: impl FnOnce(Result<Vec<Extent>>) + Send + 'static,
    ) {
        let Some(index) = self.context_index(name) else {
            let why = "the metadata context was not negotiated";
            return done(Err(Error::Unsupported(why)));
        };
        let parts = match plan::block_status(self.geometry(), offset, length, 0) {
            Ok(parts) if parts.is_empty() => return done(Ok(Vec::new())),
            Ok(parts) => parts,
            Err(e) => return done(Err(e)),
        };
        let completer = move |result: Result<Completed>| {
            done(result.and_then(|completed| crate::meta::take_extents_of(completed, index)));
        };
        self.start_parts(parts, Box::new(completer));
    }

    fn start_owned<B: StableBuffer>(
        &self,
        command: Command,
        flags: u16,
        mut buffer: B,
        offset: u64,
        done: impl FnOnce(B, Result<()>) + Send + 'static,
    ) {
        let lent = lend_stable(&mut buffer);
        let parts = match plan::read_write(self.geometry(), command, flags, offset, lent) {
            Ok(parts) => parts,
            // The lent pieces were dropped with the failed plan: nothing holds the bytes.
            Err(e) => return done(buffer, Err(e)),
        };
        // The buffer moves into the completer; its bytes, which the request uses, stay where
        // they are until the completer hands it back.
        let completer = move |result: Result<Completed>| done(buffer, result.map(drop));
        self.start_parts(parts, Box::new(completer));
    }

    fn start_effect(
        &self,
        parts: Result<Vec<crate::conn::PartSpec>>,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        match parts {
            Ok(parts) => self.start_parts(parts, Box::new(move |r| done(r.map(drop)))),
            Err(e) => done(Err(e)),
        }
    }
}
