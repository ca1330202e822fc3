//! Layers (nbdkit's filters): a part of an export's stack that sits over the rest of it. Every
//! method is given the layer below (`next`) and, unless the layer overrides it, forwards the
//! call unchanged, so a new layer is a small file that overrides only what it changes.
//! [`Layered`] makes a layer and the stack below it one [`Backend`], so layers compose.
//!
//! A layer that changes the data it passes (rather than only watching it) overrides `map` to
//! answer [`Place::Stack`](super::Place::Stack): else an engine would move the bytes of the
//! layers below it itself, around the layer's `pread` and `pwrite`. A layer that acts on
//! every request without changing its bytes (delays it, fails it, logs it) answers
//! `intercepts`: its layered backend then maps nothing, never claims not to wait, submits
//! nothing and reads holes like data, so every request reaches its methods, on the worker
//! pool.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use zcnbd_proto::Extent;

use super::async_op::{AsyncOp, Completion, Plug};
use super::backend::{Backend, PipedRead};
use super::durability::Durability;
use super::flags::{Capabilities, ZeroError, ZeroFlags};
use super::lease::Leases;
use super::place::{Map, MapFor, Medium, Place};
use crate::pipe::Pipe;

/// One layer of an export's stack. Each method's default forwards to `next`.
#[allow(unused_variables)]
pub trait Layer: Send + Sync + std::fmt::Debug {
    /// What the layer is called in logs and on the command line.
    fn name(&self) -> &'static str;

    /// Whether every request must go through this layer's methods (see the module's notes).
    fn intercepts(&self) -> bool {
        false
    }

    /// The alignment requests from above must have (the stack below's, unless the layer
    /// aligns them itself).
    fn block_size_minimum(&self, next: &dyn Backend) -> u32 {
        next.block_size_minimum()
    }

    /// Changes option `key` to `value` while the export serves (the control socket's `set`);
    /// a layer says which of its options can change. The default: none can.
    fn set(&self, key: &str, value: &str) -> Result<(), String> {
        Err(format!(
            "filter {}: {key:?} cannot be changed while serving",
            self.name()
        ))
    }

    /// Called once when the export opens, over the stack below it: a layer that reads
    /// something there first (a partition table) fails the start here.
    fn open(&self, next: &dyn Backend) -> io::Result<()> {
        Ok(())
    }

    fn size(&self, next: &dyn Backend) -> u64 {
        next.size()
    }
    fn capabilities(&self, next: &dyn Backend) -> Capabilities {
        next.capabilities()
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        next.pread(buf, offset)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        next.pwrite(buf, offset, fua)
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        next.flush()
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        next.trim(offset, len, fua)
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        next.zero(offset, len, flags)
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        next.cache(offset, len)
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        next.extents(offset, len, extents_max, out)
    }
    fn meta_contexts(&self, next: &dyn Backend) -> Vec<String> {
        next.meta_contexts()
    }
    fn meta_extents(
        &self,
        next: &dyn Backend,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        next.meta_extents(context, offset, len, extents_max, out)
    }
    fn map(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        how: MapFor,
        out: &mut Map,
    ) -> io::Result<()> {
        next.map(offset, len, how, out)
    }
    fn durability(&self, next: &dyn Backend) -> Option<Arc<Durability>> {
        next.durability()
    }
    /// A layer that remaps ranges (moves bytes elsewhere) must answer a table of its own.
    fn leases(&self, next: &dyn Backend) -> Option<Arc<Leases>> {
        next.leases()
    }
    fn wrote_in_place(&self, next: &dyn Backend, offset: u64, len: u64) {
        next.wrote_in_place(offset, len)
    }
    fn medium(&self, next: &dyn Backend) -> Option<Medium> {
        next.medium()
    }
    fn sparse_reads(&self, next: &dyn Backend) -> bool {
        next.sparse_reads()
    }
    fn never_waits(&self, next: &dyn Backend) -> bool {
        next.never_waits()
    }
    fn can_submit(&self, next: &dyn Backend) -> bool {
        next.can_submit()
    }
    fn submit(&self, next: &dyn Backend, op: AsyncOp, done: Completion) {
        next.submit(op, done)
    }
    fn reopen(&self, next: &dyn Backend) -> io::Result<()> {
        next.reopen()
    }
    fn poll_completions(&self, next: &dyn Backend) -> Option<Arc<OwnedFd>> {
        next.poll_completions()
    }
    fn run_completions(&self, next: &dyn Backend) -> usize {
        next.run_completions()
    }
    fn plug(&self, next: &dyn Backend) -> Option<Plug> {
        next.plug()
    }
    /// Whether reads may go to the stack below's `read_to_pipe`, around this layer's
    /// `pread`. Unlike the other methods, the default is no: only a layer that leaves reads'
    /// bytes and offsets as they are (and needs to see no read) says yes.
    fn pipes_reads(&self, next: &dyn Backend) -> bool {
        let _ = next;
        false
    }
    fn read_to_pipe(
        &self,
        next: &dyn Backend,
        pipe: &Pipe,
        offset: u64,
        len: usize,
    ) -> io::Result<PipedRead> {
        next.read_to_pipe(pipe, offset, len)
    }
}

/// A layer over the rest of the stack, as one backend.
#[derive(Debug)]
pub struct Layered {
    layer: Arc<dyn Layer>,
    next: Arc<dyn Backend>,
}

impl Layered {
    /// `layer` over `next`.
    pub fn new(layer: Arc<dyn Layer>, next: Arc<dyn Backend>) -> Layered {
        Layered { layer, next }
    }
}

impl Backend for Layered {
    fn size(&self) -> u64 {
        self.layer.size(&*self.next)
    }
    fn capabilities(&self) -> Capabilities {
        self.layer.capabilities(&*self.next)
    }
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.layer.pread(&*self.next, buf, offset)
    }
    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.layer.pwrite(&*self.next, buf, offset, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.layer.flush(&*self.next)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.layer.trim(&*self.next, offset, len, fua)
    }
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        self.layer.zero(&*self.next, offset, len, flags)
    }
    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.layer.cache(&*self.next, offset, len)
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.layer
            .extents(&*self.next, offset, len, extents_max, out)
    }
    fn meta_contexts(&self) -> Vec<String> {
        self.layer.meta_contexts(&*self.next)
    }
    fn meta_extents(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.layer
            .meta_extents(&*self.next, context, offset, len, extents_max, out)
    }
    fn map(&self, offset: u64, len: u64, how: MapFor, out: &mut Map) -> io::Result<()> {
        if self.layer.intercepts() {
            out.push(len, Place::Stack);
            return Ok(());
        }
        self.layer.map(&*self.next, offset, len, how, out)
    }
    fn durability(&self) -> Option<Arc<Durability>> {
        self.layer.durability(&*self.next)
    }
    fn leases(&self) -> Option<Arc<Leases>> {
        self.layer.leases(&*self.next)
    }
    fn wrote_in_place(&self, offset: u64, len: u64) {
        self.layer.wrote_in_place(&*self.next, offset, len)
    }
    fn medium(&self) -> Option<Medium> {
        match self.layer.intercepts() {
            true => None,
            false => self.layer.medium(&*self.next),
        }
    }
    fn sparse_reads(&self) -> bool {
        // A read of a hole must reach an intercepting layer's pread too.
        !self.layer.intercepts() && self.layer.sparse_reads(&*self.next)
    }
    fn block_size_minimum(&self) -> u32 {
        self.layer.block_size_minimum(&*self.next)
    }
    fn never_waits(&self) -> bool {
        !self.layer.intercepts() && self.layer.never_waits(&*self.next)
    }
    fn can_submit(&self) -> bool {
        !self.layer.intercepts() && self.layer.can_submit(&*self.next)
    }
    fn submit(&self, op: AsyncOp, done: Completion) {
        self.layer.submit(&*self.next, op, done)
    }
    fn reopen(&self) -> io::Result<()> {
        self.layer.reopen(&*self.next)
    }
    /// Only through a layer that submits nothing of its own: the completions are then the
    /// stack below's alone.
    fn poll_completions(&self) -> Option<Arc<OwnedFd>> {
        match self.can_submit() {
            true => self.layer.poll_completions(&*self.next),
            false => None,
        }
    }
    fn run_completions(&self) -> usize {
        self.layer.run_completions(&*self.next)
    }
    fn plug(&self) -> Option<Plug> {
        self.layer.plug(&*self.next)
    }
    fn pipes_reads(&self) -> bool {
        !self.layer.intercepts() && self.layer.pipes_reads(&*self.next)
    }
    fn read_to_pipe(&self, pipe: &Pipe, offset: u64, len: usize) -> io::Result<PipedRead> {
        if !self.pipes_reads() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        self.layer.read_to_pipe(&*self.next, pipe, offset, len)
    }
}
