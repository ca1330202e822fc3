//! An export another NBD server serves (`nbd://`, `nbds://`, `nbd+unix://`, `nbd+vsock://`),
//! reached through zcnbd's client library: reads land straight in the caller's buffer (the
//! client reads the reply's payload into it), writes leave from it, and the upstream's
//! flags say what the export can do. `zcnbd attach nbd://...` uses it (a remote export as a
//! local disk, replacing nbd-client); errors come back as the upstream's errno.
//!
//! Requests are asynchronous ([`Backend::submit`], `nbd_async.rs`): the engines hand each
//! operation to the client library with a completion and no server thread waits for the
//! upstream; one driver thread per upstream runs the completions, or an engine's own event
//! loop does ([`Backend::poll_completions`]: `zcnbd attach`'s queues). The blocking methods
//! (the flush at shutdown, layers, block status of the passed contexts) share the
//! connection, and the connection's loss and replacement (`nbd_upstream.rs`).
//!
//! Metadata contexts pass through: at connect the upstream's `base:` and `qemu:` namespaces
//! are listed (qemu-nbd's `qemu:allocation-depth` and `qemu:dirty-bitmap:NAME`), every
//! connection selects what was listed, by name, and the export offers those contexts as its
//! own, answering their block status with the upstream's. A reconnection asks for the same
//! names; one the upstream no longer has fails its requests with EIO (logged at the
//! reconnection) rather than answering for another context.

use std::io::{self, IoSlice};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use zcnbd_client::{Address, Client, ClientOptions, NbdUri, WriteFlags, META_CONTEXT_QUERIES_MAX};
use zcnbd_proto::consts::{transmission_flags as tf, BASE_ALLOCATION};
use zcnbd_proto::{Extent, MetaQueries};

use super::nbd_async::Pending;
use super::nbd_upstream::{errno, lock, Upstream, RECONNECT_WAIT_MAX};
use crate::export::backend::{Backend, NbdStream};
use crate::export::flags::{Capabilities, ZeroError, ZeroFlags};
use crate::export::{AsyncOp, Completion, Plug};

/// The most connections to one upstream (`--connections`), as nbdcopy and libnbd allow.
pub const UPSTREAM_CONNECTIONS_MAX: usize = 16;

/// The namespaces whose contexts are listed at connect and passed through: the spec's own
/// and QEMU's (`qemu:allocation-depth`, `qemu:dirty-bitmap:NAME`). Each connection selects
/// at most `META_CONTEXT_QUERIES_MAX` of them; the export offers fewer than
/// `META_CONTEXTS_MAX` (the stack logs any it leaves out).
const PASSED_NAMESPACES: [&str; 2] = ["base:", "qemu:"];

/// An upstream NBD export.
pub struct NbdBackend {
    upstream: Arc<Upstream>,
    /// The thread that runs the client's completions (`nbd_async.rs`), joined on drop;
    /// started by the first `submit`, not at connect: `zcnbd attach` and `--fork` fork after
    /// opening the source, which only a process of one thread may do.
    driver: Mutex<Option<JoinHandle<()>>>,
    /// Whether `driver` was started (read without its lock on every `submit`).
    driving: AtomicBool,
    minimum: u32,
    flags: u16,
    base_allocation: bool,
    /// Reads may be spliced from the upstream's socket: plain TCP or a Unix socket.
    splices: bool,
}

impl std::fmt::Debug for NbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdBackend")
            .field("uri", &self.upstream.uri)
            .field("size", &self.upstream.size)
            .field("flags", &self.flags)
            .finish()
    }
}

/// A connection that failed, naming the upstream (its URI names only files, never keys).
fn connect_error(uri: &str, e: zcnbd_client::Error) -> io::Error {
    let kind = io::Error::from_raw_os_error(e.errno()).kind();
    io::Error::new(kind, format!("upstream {uri}: {e}"))
}

impl NbdBackend {
    /// Connects to `uri` with `connections` connections (more than one only if the upstream
    /// allows multi-conn); a connection lost later is made again for up to `reconnect`,
    /// its requests sent again (a block write may be repeated, which is safe), before they
    /// fail. A driver thread runs the completions of requests submitted asynchronously.
    pub fn connect(uri: &str, connections: usize, reconnect: Duration) -> io::Result<NbdBackend> {
        if connections == 0 || connections > UPSTREAM_CONNECTIONS_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("connections: 1 to {UPSTREAM_CONNECTIONS_MAX} (UPSTREAM_CONNECTIONS_MAX)"),
            ));
        }
        let listing = ClientOptions {
            connections,
            base_allocation: true,
            list_meta_contexts: PASSED_NAMESPACES.map(String::from).to_vec(),
            ..ClientOptions::default()
        };
        let client = Client::connect_with(uri, &listing).map_err(|e| connect_error(uri, e))?;
        let contexts = passed_contexts(uri, &client);
        // A reconnection asks for what was found, by name: the same contexts or fewer.
        let options = ClientOptions {
            list_meta_contexts: Vec::new(),
            meta_contexts: contexts.clone(),
            ..listing
        };
        let geometry = client.geometry();
        let (flags, base_allocation, minimum) =
            (geometry.flags, geometry.base_allocation, geometry.minimum);
        tracing::info!(
            %uri,
            size = client.size(),
            connections = client.connections(),
            flags = format_args!("{flags:#x}"),
            reconnect_s = reconnect.as_secs_f64(),
            "connected to the upstream NBD server"
        );
        let upstream = Arc::new(Upstream::new(uri, client, options, reconnect, contexts));
        Ok(NbdBackend {
            upstream,
            driver: Mutex::new(None),
            driving: AtomicBool::new(false),
            minimum,
            flags,
            base_allocation,
            splices: splices(uri),
        })
    }

    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    /// Starts the driver thread unless it runs.
    fn start_driver(&self) -> io::Result<()> {
        if self.driving.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut driver = lock(&self.driver);
        if driver.is_none() {
            let upstream = Arc::clone(&self.upstream);
            let thread = thread::Builder::new()
                .name("nbd-upstream".to_owned())
                .spawn(move || upstream.drive())?;
            *driver = Some(thread);
        }
        self.driving.store(true, Ordering::Release);
        Ok(())
    }

    fn with_client<T>(
        &self,
        op: impl FnMut(&Client) -> Result<T, zcnbd_client::Error>,
    ) -> Result<T, zcnbd_client::Error> {
        self.upstream.with_client(op)
    }
}

impl Drop for NbdBackend {
    fn drop(&mut self) {
        self.upstream.stop();
        let driver = self.driver.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(driver) = driver.take() {
            // The last reference may go in a completion, on the driver thread itself: it
            // ends on its own once the completion returns.
            if driver.thread().id() != thread::current().id() && driver.join().is_err() {
                tracing::warn!(uri = %self.upstream.uri, "the upstream's driver thread panicked");
            }
        }
        // What is still in flight fails now (EIO: nothing reconnects any more), rather than
        // keep the upstream alive through its callbacks.
        self.upstream.current().1.close();
    }
}

/// Whether reads from `uri` can be spliced: a plain TCP or Unix socket's.
fn splices(uri: &str) -> bool {
    NbdUri::parse(uri).is_ok_and(|u| u.tls.is_none() && !matches!(u.address, Address::Vsock { .. }))
}

/// The contexts `client` (just connected, after listing) selected besides
/// `base:allocation`, as many as a reconnection can ask for by name (a server may select
/// more than it was asked for: those are not passed); those it listed and could not ask
/// for are logged.
fn passed_contexts(uri: &str, client: &Client) -> Vec<String> {
    let askable = |name: &String| MetaQueries::new([name.as_str()]).is_ok();
    let contexts: Vec<String> = client
        .meta_contexts()
        .iter()
        .map(|c| c.name.clone())
        .filter(|name| name != BASE_ALLOCATION && askable(name))
        .take(META_CONTEXT_QUERIES_MAX)
        .collect();
    let left_out = client.meta_contexts_left_out();
    if left_out > 0 {
        tracing::warn!(%uri, left_out, "the upstream lists more metadata contexts than one selection can ask for (META_CONTEXT_QUERIES_MAX), or names none can: those are not passed through");
    }
    if !contexts.is_empty() {
        tracing::info!(%uri, contexts = ?contexts, "metadata contexts passed through from the upstream");
    }
    contexts
}

/// Appends to `out` the extents `found` (from `offset`) says of `[offset, offset+len)`: at
/// most `extents_max`, clipped to the range, at least one (the rest as flags 0, which the
/// stack tidies).
pub(super) fn clip_into(found: Vec<Extent>, len: u64, extents_max: usize, out: &mut Vec<Extent>) {
    let first = out.len();
    let mut left = len;
    for e in found {
        if left == 0 || out.len() - first >= extents_max.max(1) {
            break;
        }
        let length = e.length.min(left);
        out.push(Extent {
            length,
            flags: e.flags,
        });
        left -= length;
    }
    if out.len() == first {
        out.push(Extent {
            length: len,
            flags: 0,
        });
    }
}

impl Backend for NbdBackend {
    fn size(&self) -> u64 {
        self.upstream.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            write: !self.has(tf::READ_ONLY),
            flush: self.has(tf::SEND_FLUSH),
            fua: self.has(tf::SEND_FUA),
            trim: self.has(tf::SEND_TRIM),
            zero: self.has(tf::SEND_WRITE_ZEROES),
            fast_zero: self.has(tf::SEND_FAST_ZERO),
            cache: self.has(tf::SEND_CACHE),
            multi_conn: self.has(tf::CAN_MULTI_CONN),
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.with_client(|c| c.read_at(buf, offset))
            .map(drop)
            .map_err(errno)
    }

    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.with_client(|c| c.write_vectored_at(&[IoSlice::new(buf)], offset, WriteFlags { fua }))
            .map(drop)
            .map_err(errno)
    }

    fn flush(&self) -> io::Result<()> {
        self.with_client(|c| c.flush()).map_err(errno)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.with_client(|c| c.trim(offset, len, WriteFlags { fua }))
            .map_err(errno)
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        let asked = zcnbd_client::ZeroFlags {
            fua: flags.fua,
            no_hole: !flags.may_trim,
            fast: flags.fast,
        };
        match self.with_client(|c| c.write_zeroes(offset, len, asked)) {
            Ok(()) => Ok(()),
            Err(e) if flags.fast && e.errno() == libc::EOPNOTSUPP => Err(ZeroError::NotFast),
            Err(e) => Err(ZeroError::Io(errno(e))),
        }
    }

    fn reopen(&self) -> io::Result<()> {
        let failed = self.upstream.current().0;
        let deadline = Instant::now() + self.upstream.reconnect.max(RECONNECT_WAIT_MAX);
        let why = "a retry asked for a new connection";
        match self.upstream.reconnect_after(failed, deadline, &why) {
            true => Ok(()),
            false => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.has(tf::SEND_CACHE) {
            true => self.with_client(|c| c.cache(offset, len)).map_err(errno),
            false => Ok(()),
        }
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if !self.base_allocation {
            out.push(Extent {
                length: len,
                flags: 0,
            });
            return Ok(());
        }
        let found = self.with_client(|c| c.block_status(offset, len));
        clip_into(found.map_err(errno)?, len, extents_max, out);
        Ok(())
    }

    fn meta_contexts(&self) -> Vec<String> {
        self.upstream.contexts.clone()
    }

    fn meta_extents(
        &self,
        context: &str,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        if !self.upstream.contexts.iter().any(|c| c == context) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        if len == 0 {
            return Ok(());
        }
        // A connection made since may lack the context (the upstream dropped a bitmap): its
        // answer would be no answer for this context, so the request fails.
        let found = self.with_client(|c| match c.has_meta_context(context) {
            true => c.block_status_of(context, offset, len).map(Some),
            false => Ok(None),
        });
        let Some(found) = found.map_err(errno)? else {
            tracing::debug!(uri = %self.upstream.uri, %context, "block status of a context the upstream no longer offers");
            return Err(io::Error::from_raw_os_error(libc::EIO));
        };
        clip_into(found, len, extents_max, out);
        Ok(())
    }

    fn block_size_minimum(&self) -> u32 {
        self.minimum
    }

    /// Finding holes costs a round trip to the upstream: every read is one read.
    fn sparse_reads(&self) -> bool {
        false
    }

    /// Large reads' payloads are spliced from the upstream's socket into a pipe by the
    /// client library, and from there to the client's socket by the engine, never through
    /// user memory (not under TLS, whose records are decrypted in memory anyway, nor on
    /// vsock, which cannot splice).
    fn pipes_reads(&self) -> bool {
        self.splices
    }

    fn can_submit(&self) -> bool {
        true
    }

    fn nbd_stream(&self) -> Option<NbdStream> {
        // Another connection is as good as this backend's own only with multi-conn; TLS
        // needs the TLS library's hands on every byte.
        let plain = zcnbd_client::NbdUri::parse(&self.upstream.uri).is_ok_and(|u| u.tls.is_none());
        (plain && self.has(tf::CAN_MULTI_CONN)).then(|| NbdStream {
            uri: self.upstream.uri.clone(),
            options: ClientOptions {
                connections: 1,
                base_allocation: false,
                meta_contexts: Vec::new(),
                list_meta_contexts: Vec::new(),
                ..self.upstream.options().clone()
            },
        })
    }

    fn poll_completions(&self) -> Option<Arc<OwnedFd>> {
        match self.upstream.poll_here() {
            Ok(events) => Some(events),
            Err(e) => {
                tracing::warn!(uri = %self.upstream.uri, error = %e, "cannot poll the upstream's completions: its driver thread runs them");
                None
            }
        }
    }

    fn run_completions(&self) -> usize {
        self.upstream.run_ready()
    }

    /// The connection's own plug: what is submitted meanwhile leaves in one `sendmsg`.
    fn plug(&self) -> Option<Plug> {
        Some(self.upstream.plug())
    }

    fn submit(&self, op: AsyncOp, done: Completion) {
        if let Err(e) = self.start_driver() {
            tracing::error!(uri = %self.upstream.uri, error = %e, "cannot start the upstream's driver thread");
            return done.complete(op, Err(io::Error::from_raw_os_error(libc::EAGAIN)));
        }
        match op {
            AsyncOp::Cache { .. } if !self.has(tf::SEND_CACHE) => done.complete(op, Ok(())),
            AsyncOp::Extents { len: 0, .. } => done.complete(op, Ok(())),
            AsyncOp::Extents {
                offset,
                len,
                extents_max,
                mut out,
            } if !self.base_allocation => {
                out.push(Extent {
                    length: len,
                    flags: 0,
                });
                let op = AsyncOp::Extents {
                    offset,
                    len,
                    extents_max,
                    out,
                };
                done.complete(op, Ok(()))
            }
            op => self.upstream.start(Pending::new(op, done)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(length: u64, flags: u32) -> Extent {
        Extent { length, flags }
    }

    #[test]
    fn an_upstreams_extents_are_clipped_to_the_range_and_the_count() {
        let found = || vec![e(4096, 1), e(8192, 0), e(1 << 20, 1)];
        let mut out = vec![e(7, 7)];
        clip_into(found(), 10_000, 64, &mut out);
        assert_eq!(out, [e(7, 7), e(4096, 1), e(10_000 - 4096, 0)]);
        let mut out = Vec::new();
        clip_into(found(), 1 << 30, 2, &mut out);
        assert_eq!(out, [e(4096, 1), e(8192, 0)]);
        // extents_max 0 still answers one.
        let mut out = Vec::new();
        clip_into(found(), 1 << 30, 0, &mut out);
        assert_eq!(out, [e(4096, 1)]);
        // Nothing said: the range, flags 0.
        let mut out = vec![e(7, 7)];
        clip_into(Vec::new(), 512, 64, &mut out);
        assert_eq!(out, [e(7, 7), e(512, 0)]);
    }
}
