//! The top of an export's stack: the one checked layer every request of both engines goes
//! through (nbdkit's `server/backend.c`), whether its bytes move through a method or through
//! a place an engine reaches itself. It owns, once: range and read-only checks, the
//! capabilities (asked once and cached), FUA emulated by a flush where the layers below have
//! no FUA of their own, advisory commands that the layers cannot do, and the sanity of what the
//! layers answer (extents that cover the range, a map whose segments add up). Below it: zero
//! or more [`Layer`]s over one base backend.

use std::io;
use std::os::fd::OwnedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tracing::{error, warn};
use zcnbd_proto::consts::BASE_ALLOCATION;
use zcnbd_proto::meta::META_CONTEXTS_MAX;
use zcnbd_proto::Extent;

use super::async_op::{AsyncOp, Completion, Plug};
use super::backend::Backend;
use super::durability::Durability;
use super::flags::{Capabilities, ZeroError, ZeroFlags};
use super::layer::{Layer, Layered};
use super::lease::{Change, Lease, Leases};
use super::place::{Map, MapFor, Medium, Place};
use crate::worker_pool::Lane;

/// An export's stack: a base backend, the layers over it, and the checks on top.
#[derive(Debug)]
pub struct Stack {
    /// The base backend (kept apart so that a reload can keep it open under new settings).
    base: Arc<dyn Backend>,
    /// The layers over the base, bottom first (their names, for logs).
    layers: Vec<&'static str>,
    /// The same layers, for options changed while serving.
    layer_objects: Vec<Arc<dyn Layer>>,
    /// The top of the layers: every call goes here.
    top: Arc<dyn Backend>,
    size: u64,
    caps: Capabilities,
    read_only: bool,
    sparse_reads: bool,
    never_waits: bool,
    asynchronous: bool,
    medium: Option<Medium>,
    /// Whether there are layers to tell of writes landed in place.
    tells_writes: bool,
    /// The lease table of a stack whose maps can change (see `lease.rs`).
    leases: Option<Arc<Leases>>,
    /// Whether FLUSH and FUA may still succeed (see `durability.rs`).
    durability: Arc<Durability>,
    /// Where the stack's jobs wait beyond the base's bound on operations at once, when
    /// nothing but `passthrough` is over it (a filter may answer some without the base).
    lane: Option<Arc<Lane>>,
}

/// An error with errno `code` (which the reply carries) saying `why`.
fn errno(code: i32, why: &'static str) -> io::Error {
    Refusal { errno: code, why }.into()
}

/// A request the stack refuses (or a layer's wrong answer), with the errno its reply
/// carries ([`errno_of`](super::errno_of) finds it) and why.
#[derive(Debug, Clone, Copy)]
pub struct Refusal {
    pub errno: i32,
    pub why: &'static str,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.why)
    }
}

impl std::error::Error for Refusal {}

impl From<Refusal> for io::Error {
    fn from(r: Refusal) -> io::Error {
        io::Error::new(io::Error::from_raw_os_error(r.errno).kind(), r)
    }
}

impl Stack {
    /// `layers` (bottom first) over `base`; a `read_only` stack refuses every write whatever
    /// the layers could do.
    pub fn new(base: Arc<dyn Backend>, layers: Vec<Arc<dyn Layer>>, read_only: bool) -> Stack {
        let names: Vec<&'static str> = layers.iter().map(|l| l.name()).collect();
        let layer_objects = layers.clone();
        let top = layers.into_iter().fold(Arc::clone(&base), |next, layer| {
            Arc::new(Layered::new(layer, next)) as Arc<dyn Backend>
        });
        let caps = top.capabilities();
        let leases = top.leases();
        let durability = top
            .durability()
            .unwrap_or_else(|| Arc::new(Durability::per_request()));
        let thin = names.iter().all(|name| *name == "passthrough");
        let lane = match (thin, base.concurrency_max()) {
            (true, Some(bound)) => Some(Arc::new(Lane::new(bound))),
            _ => None,
        };
        Stack {
            lane,
            size: top.size(),
            caps,
            read_only: read_only || !caps.write,
            sparse_reads: top.sparse_reads(),
            // A change may wait for leases: never on an engine's thread.
            never_waits: top.never_waits() && leases.is_none(),
            asynchronous: top.can_submit(),
            medium: top.medium(),
            tells_writes: !Arc::ptr_eq(&top, &base),
            leases,
            durability,
            base,
            layers: names,
            layer_objects,
            top,
        }
    }

    /// Changes option `key` of every layer named `filter` to `value` while serving (see
    /// [`Layer::set`]).
    pub fn set_layer_option(&self, filter: &str, key: &str, value: &str) -> Result<(), String> {
        let mut named = self
            .layer_objects
            .iter()
            .filter(|l| l.name() == filter)
            .peekable();
        if named.peek().is_none() {
            return Err(format!(
                "the export has no filter {filter:?} (it has: {})",
                self.layers.join(", ")
            ));
        }
        named.try_for_each(|layer| layer.set(key, value))
    }

    /// Like [`Stack::new`], each layer first opened over the stack below it (see
    /// [`Layer::open`]): the first that fails fails the stack.
    pub fn open(
        base: Arc<dyn Backend>,
        layers: Vec<Arc<dyn Layer>>,
        read_only: bool,
    ) -> io::Result<Stack> {
        let mut below = Arc::clone(&base);
        for layer in &layers {
            layer.open(&*below)?;
            below = Arc::new(Layered::new(Arc::clone(layer), below));
        }
        Ok(Stack::new(base, layers, read_only))
    }

    /// The alignment the stack's top needs of requests (a layer may lift the base's).
    pub fn block_size_minimum(&self) -> u32 {
        self.top.block_size_minimum()
    }

    /// A stack of `base` alone.
    pub fn of(base: Arc<dyn Backend>, read_only: bool) -> Stack {
        Stack::new(base, Vec::new(), read_only)
    }

    /// The base backend.
    pub fn base(&self) -> &Arc<dyn Backend> {
        &self.base
    }

    /// The layers' names, bottom first.
    pub fn layer_names(&self) -> &[&'static str] {
        &self.layers
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What the layers can do (asked once).
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Whether writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// See [`Backend::sparse_reads`].
    pub fn sparse_reads(&self) -> bool {
        self.sparse_reads
    }

    /// See [`Backend::never_waits`].
    pub fn never_waits(&self) -> bool {
        self.never_waits
    }

    /// See [`Backend::can_submit`].
    pub fn is_asynchronous(&self) -> bool {
        self.asynchronous
    }

    /// On an asynchronous stack, hands the running of its completions to the caller (see
    /// [`Backend::poll_completions`]): the descriptor to poll, or `None` if they keep
    /// running where they run.
    pub fn poll_completions(&self) -> Option<Arc<OwnedFd>> {
        self.asynchronous
            .then(|| self.top.poll_completions())
            .flatten()
    }

    /// Runs the completions that wait now (see [`Stack::poll_completions`]); how many ran.
    pub fn run_completions(&self) -> usize {
        self.top.run_completions()
    }

    /// Holds back the sending of what is submitted until the value is dropped (see
    /// [`Backend::plug`]).
    pub fn plug(&self) -> Option<Plug> {
        self.asynchronous.then(|| self.top.plug()).flatten()
    }

    /// See [`Backend::nbd_stream`]: only on a stack of no layers (a layer's work would be
    /// bypassed).
    pub fn nbd_stream(&self) -> Option<super::NbdStream> {
        match self.layers.is_empty() {
            true => self.base.nbd_stream(),
            false => None,
        }
    }

    /// See [`Backend::medium`].
    pub fn medium(&self) -> Option<Medium> {
        self.medium
    }

    /// `[offset, offset+len)` lies inside the export.
    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(errno(libc::EINVAL, "range outside the export")),
        }
    }

    /// A write to `[offset, offset+len)` is allowed.
    fn check_write(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only {
            return Err(errno(libc::EPERM, "the export is read-only"));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(errno(libc::ENOSPC, "write past the end of the export")),
        }
    }

    /// Whether a FUA request needs a flush after it (the layers have no FUA of their own).
    fn emulates_fua(&self, fua: bool) -> bool {
        fua && !self.caps.fua
    }

    /// Registers a change of `[offset, offset+len)` where maps can change, waiting for the
    /// leases in its way (at once inside the dispatcher's [`Stack::when_changeable`]).
    fn change(&self, offset: u64, len: u64) -> Change {
        match &self.leases {
            Some(leases) => leases.change(offset, len),
            None => Change::none(),
        }
    }

    /// Whether a write, trim or zero of this stack may have to wait for leases: the
    /// dispatcher then starts it with [`Stack::when_changeable`].
    pub fn changes_wait(&self) -> bool {
        self.leases.is_some()
    }

    /// Runs `job` once a write, trim or zero of `[offset, offset+len)` may start: at once
    /// where maps never change, else when no engine's lease and no other change overlaps it
    /// (on the thread that ends the last one in its way: `job` must not block). The job runs
    /// the operation inside the [`Change`] it is given ([`Change::enter`]).
    pub fn when_changeable(
        &self,
        offset: u64,
        len: u64,
        job: impl FnOnce(Change) + Send + 'static,
    ) {
        match &self.leases {
            Some(leases) => leases.when_changeable(offset, len, job),
            None => job(Change::none()),
        }
    }

    /// Fills `buf` from `offset`.
    pub fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.top.pread(buf, offset)
    }

    /// Where the stack's jobs run on workers, if the base bounds its operations at once
    /// ([`Backend::concurrency_max`]).
    pub fn lane(&self) -> Option<&Arc<Lane>> {
        self.lane.as_ref()
    }

    /// Whether reads can be answered through a pipe ([`Backend::read_to_pipe`]).
    pub fn pipes_reads(&self) -> bool {
        self.top.pipes_reads()
    }

    /// Puts the `len` bytes at `offset` into `pipe` (see [`Backend::read_to_pipe`]); how
    /// many were copied through user memory.
    pub fn read_to_pipe(
        &self,
        pipe: &crate::pipe::Pipe,
        offset: u64,
        len: usize,
    ) -> io::Result<super::PipedRead> {
        self.check_range(offset, len as u64)?;
        self.top.read_to_pipe(pipe, offset, len)
    }

    /// Writes `buf` at `offset`, durably if `fua`.
    pub fn write(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.check_write(offset, buf.len() as u64)?;
        let _change = self.change(offset, buf.len() as u64);
        if self.emulates_fua(fua) {
            self.top.pwrite(buf, offset, false)?;
            return self.flush();
        }
        self.durably(fua, || self.top.pwrite(buf, offset, fua))
    }

    /// Runs `op`; with `fua`, as a sync (see `durability.rs`): refused once durability is
    /// lost, and losing it if it fails.
    fn durably(&self, fua: bool, op: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        match fua {
            true => self.durability.sync(op),
            false => op(),
        }
    }

    /// An engine's own durable write (`RWF_DSYNC`) failed: every later FLUSH and FUA
    /// request of the export fails (see `durability.rs`).
    pub fn durability_lost(&self, why: &dyn std::fmt::Display) {
        self.durability.lose(why);
    }

    /// Makes every completed write durable (nothing to do where the layers cannot flush:
    /// then nothing is ever volatile, or durability was not offered).
    pub fn flush(&self) -> io::Result<()> {
        if !self.caps.flush {
            return Ok(());
        }
        self.durability.sync(|| self.top.flush())
    }

    /// Discards a range; advisory, so a stack that cannot trim succeeds doing nothing.
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.check_write(offset, len)?;
        if !self.caps.trim {
            return Ok(());
        }
        let _change = self.change(offset, len);
        if self.emulates_fua(fua) {
            self.top.trim(offset, len, false)?;
            return self.flush();
        }
        self.durably(fua, || self.top.trim(offset, len, fua))
    }

    /// Makes a range read as zeroes.
    pub fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        self.check_write(offset, len)?;
        if !self.caps.zero {
            return Err(errno(libc::EOPNOTSUPP, "the export cannot write zeroes").into());
        }
        if flags.fast && !self.caps.fast_zero {
            return Err(ZeroError::NotFast);
        }
        let _change = self.change(offset, len);
        if self.emulates_fua(flags.fua) {
            let flags = ZeroFlags {
                fua: false,
                ..flags
            };
            self.top.zero(offset, len, flags)?;
            return Ok(self.flush()?);
        }
        if !flags.fua {
            return self.top.zero(offset, len, flags);
        }
        let mut result = Ok(());
        let synced = self
            .durability
            .sync(|| match self.top.zero(offset, len, flags) {
                Err(ZeroError::NotFast) => {
                    result = Err(ZeroError::NotFast);
                    Ok(())
                }
                other => other.map_err(io::Error::from),
            });
        result.and(synced.map_err(ZeroError::from))
    }

    /// Prefetches a range; advisory.
    pub fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        if !self.caps.cache {
            return Ok(());
        }
        self.top.cache(offset, len)
    }

    /// Appends up to `extents_max` extents of `[offset, offset+len)`, from `offset` on, to
    /// `out`: never a zero-length one, none past the range, at least one (the layers' silence
    /// is data).
    pub fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.check_range(offset, len)?;
        let first = out.len();
        self.top.extents(offset, len, extents_max.max(1), out)?;
        tidy_extents(out, first, len, extents_max.max(1));
        Ok(())
    }

    /// The metadata contexts offered now besides `base:allocation`, as the handshake lists
    /// them (a connection keeps the list it negotiated from: bitmaps come and go).
    pub fn meta_contexts(&self) -> Vec<String> {
        offered_contexts(&*self.top)
    }

    /// Up to `extents_max` extents of `context` (`base:allocation`, or one that
    /// [`Stack::meta_contexts`] named) covering `[offset, offset+len)`. A context that is no
    /// longer offered (a bitmap removed since) is an error.
    pub fn meta_extents(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        if context == BASE_ALLOCATION {
            return self.extents(offset, len, extents_max, out);
        }
        self.check_range(offset, len)?;
        let first = out.len();
        let max = extents_max.max(1);
        self.top.meta_extents(context, offset, len, max, out)?;
        tidy_extents(out, first, len, max);
        Ok(())
    }

    /// Runs `op` with the checked blocking methods (how the dispatcher runs the commands
    /// without data of a blocking stack).
    pub fn run(&self, op: &mut AsyncOp) -> io::Result<()> {
        match op {
            AsyncOp::Read { buf, offset } => self.read(buf, *offset),
            AsyncOp::ReadPiped {
                buf,
                offset,
                in_pipe,
                ..
            } => {
                *in_pipe = 0;
                self.read(buf, *offset)
            }
            AsyncOp::Write { buf, offset, fua } => self.write(buf, *offset, *fua),
            AsyncOp::Flush => self.flush(),
            AsyncOp::Trim { offset, len, fua } => self.trim(*offset, *len, *fua),
            AsyncOp::Zero { offset, len, flags } => Ok(self.zero(*offset, *len, *flags)?),
            AsyncOp::Cache { offset, len } => self.cache(*offset, *len),
            AsyncOp::Extents {
                offset,
                len,
                extents_max,
                out,
            } => self.extents(*offset, *len, *extents_max, out),
        }
    }

    /// Where the bytes of `[offset, offset+len)` live, for an engine that moves them itself
    /// (`out` is cleared first), and the lease the engine holds until its I/O on those places
    /// has completed (see `lease.rs`): the places stay the request's while it lives, and for
    /// a write the layers are told of the range when it ends, whatever became of the write.
    /// While a change of an overlapping range runs or waits, the range is "not mappable now":
    /// all of it the stack's, so the request goes through the dispatcher. A layer that
    /// panics, or answers segments that do not add up to the range, is an error (logged),
    /// never a place outside what it named.
    pub fn map(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<Lease> {
        match how {
            MapFor::Read { .. } => self.check_range(offset, len)?,
            MapFor::Write => self.check_write(offset, len)?,
        }
        out.clear();
        let hold = match &self.leases {
            Some(leases) => match leases.lease(offset, len) {
                Some(hold) => Some(hold),
                None => {
                    out.push_stack(len);
                    return Ok(Lease::none());
                }
            },
            None => None,
        };
        self.map_layers(offset, len, how, out)?;
        // Once a sync failed, a FUA write goes through the stack, which refuses it.
        out.dsync_is_fua &= !self.durability.is_lost();
        // Zeroes and the stack's bytes need no lease.
        let reachable = out.segments().iter().any(|s| s.place.medium().is_some());
        let hold = hold.filter(|_| reachable);
        let told = (how == MapFor::Write && self.tells_writes).then(|| Arc::clone(&self.top));
        Ok(Lease::new(hold, told, offset, len))
    }

    /// Asks the layers where `[offset, offset+len)` lives, checking the answer.
    fn map_layers(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<()> {
        let top = &self.top;
        let asked = catch_unwind(AssertUnwindSafe(|| top.map(offset, len, how, out)));
        let answered = match asked {
            Ok(result) => result,
            Err(_) => {
                error!(offset, len, "a layer panicked mapping a range");
                Err(errno(libc::EIO, "the export's layers failed"))
            }
        };
        if answered.is_ok() && !map_is_sane(out, len, how) {
            error!(offset, len, "a layer mapped a range wrongly: {out:?}");
            out.clear();
            return Err(errno(libc::EIO, "the export's layers failed"));
        }
        answered
    }

    /// An engine wrote `[offset, offset+len)` into places of a map itself, and the bytes
    /// landed: the layers are told (see [`Backend::wrote_in_place`]), before the write is
    /// acknowledged. Every engine calls this (or [`Stack::written_in_place`]) for every
    /// write it lands in place, failed ones included (part of the range may have changed).
    pub fn wrote_in_place(&self, offset: u64, len: u64) {
        if self.tells_writes {
            self.top.wrote_in_place(offset, len);
        }
    }

    /// An engine wrote a payload into places of a map itself: the layers are told, and it
    /// is made durable if `fua` (places have no FUA of their own, unless the map says a
    /// `RWF_DSYNC` write was enough and `dsync` says it was one).
    pub fn written_in_place(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        dsync_enough: bool,
    ) -> io::Result<()> {
        self.wrote_in_place(offset, len);
        if fua && !dsync_enough {
            return self.flush();
        }
        if fua && self.durability.is_lost() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Starts `op` on an asynchronous stack (see [`Backend::submit`]), checked first; FUA is
    /// emulated by a flush submitted once the operation completes.
    pub fn submit(&self, op: AsyncOp, done: Completion) {
        if let Err(e) = self.check_op(&op) {
            return done.complete(op, Err(e));
        }
        let fua = match &op {
            AsyncOp::Write { fua, .. } | AsyncOp::Trim { fua, .. } => *fua,
            AsyncOp::Zero { flags, .. } => flags.fua,
            _ => false,
        };
        let syncs = fua || matches!(op, AsyncOp::Flush);
        if syncs && self.durability.is_lost() {
            return done.complete(op, Err(io::Error::from_raw_os_error(libc::EIO)));
        }
        if !self.emulates_fua(fua) {
            let done = self.watched(syncs, done);
            return self.top.submit(op, done);
        }
        let top = Arc::clone(&self.top);
        let durability = Arc::clone(&self.durability);
        let then = Completion::new(move |op, result| match (op, result) {
            (Some(op), Ok(())) => {
                let flushed = Completion::new(move |_, result: io::Result<()>| {
                    if let Err(e) = &result {
                        durability.lose(e);
                    }
                    done.complete(op, result)
                });
                top.submit(AsyncOp::Flush, flushed);
            }
            (Some(op), Err(e)) => done.complete(op, Err(e)),
            // Dropped by the layer: dropping `done` answers EIO.
            (None, _) => drop(done),
        });
        self.top.submit(without_fua(op), then);
    }

    /// `done`, losing durability if it completes a sync (`syncs`) with an error.
    fn watched(&self, syncs: bool, done: Completion) -> Completion {
        if !syncs {
            return done;
        }
        let durability = Arc::clone(&self.durability);
        Completion::new(move |op, result: io::Result<()>| {
            if let Err(e) = &result {
                durability.lose(e);
            }
            match op {
                Some(op) => done.complete(op, result),
                None => drop(done),
            }
        })
    }

    /// The checks the blocking methods make, for an asynchronous operation.
    fn check_op(&self, op: &AsyncOp) -> io::Result<()> {
        match op {
            AsyncOp::Read { buf, offset } | AsyncOp::ReadPiped { buf, offset, .. } => {
                self.check_range(*offset, buf.len() as u64)
            }
            AsyncOp::Write { buf, offset, .. } => self.check_write(*offset, buf.len() as u64),
            AsyncOp::Trim { offset, len, .. } | AsyncOp::Zero { offset, len, .. } => {
                self.check_write(*offset, *len)
            }
            AsyncOp::Cache { offset, len } | AsyncOp::Extents { offset, len, .. } => {
                self.check_range(*offset, *len)
            }
            AsyncOp::Flush => Ok(()),
        }
    }
}

/// `op` with its FUA flag cleared (the stack flushes after it instead).
fn without_fua(op: AsyncOp) -> AsyncOp {
    match op {
        AsyncOp::Write { buf, offset, .. } => AsyncOp::Write {
            buf,
            offset,
            fua: false,
        },
        AsyncOp::Trim { offset, len, .. } => AsyncOp::Trim {
            offset,
            len,
            fua: false,
        },
        AsyncOp::Zero { offset, len, flags } => AsyncOp::Zero {
            offset,
            len,
            flags: ZeroFlags {
                fua: false,
                ..flags
            },
        },
        other => other,
    }
}

/// The contexts `top` answers besides `base:allocation`, as many as a selection can number
/// (the rest are left out, and the log says so).
fn offered_contexts(top: &dyn Backend) -> Vec<String> {
    let mut contexts = top.meta_contexts();
    let room = META_CONTEXTS_MAX - 1;
    if contexts.len() > room {
        warn!(
            offered = contexts.len(),
            kept = room,
            "more metadata contexts than one selection can number (META_CONTEXTS_MAX): the rest are not offered"
        );
        contexts.truncate(room);
    }
    contexts
}

/// Makes `out[first..]` describe at most `len` bytes in at most `max` extents, none empty,
/// at least one (a stack that said nothing: all data).
pub(crate) fn tidy_extents(out: &mut Vec<Extent>, first: usize, len: u64, max: usize) {
    let mut covered = 0u64;
    let mut kept = first;
    for i in first..out.len() {
        let e = out[i];
        let length = e.length.min(len - covered);
        if length == 0 {
            continue;
        }
        if kept - first == max {
            break;
        }
        out[kept] = Extent {
            length,
            flags: e.flags,
        };
        kept += 1;
        covered += length;
    }
    out.truncate(kept);
    if kept == first && len > 0 {
        out.push(Extent {
            length: len,
            flags: 0,
        });
    }
}

/// Whether `map` is a valid answer for `len` bytes asked `how`: segments that add up to the
/// range, none empty, a memory place exactly its segment's length, and no zeroes to write to.
fn map_is_sane(map: &Map, len: u64, how: MapFor) -> bool {
    let segments_ok = map.segments().iter().all(|s| {
        s.len > 0
            && match &s.place {
                Place::Memory { range, .. } => range.len() as u64 == s.len,
                Place::Zero => how != MapFor::Write,
                Place::File { offset, .. } | Place::Direct { offset, .. } => {
                    offset.checked_add(s.len).is_some()
                }
                Place::Stack => true,
            }
    });
    segments_ok && map.covered() == len
}

#[cfg(test)]
#[path = "stack_tests.rs"]
mod tests;
