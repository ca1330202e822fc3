//! The server: its exports and shared machinery and its sessions (listeners and the accept
//! loop are in `listener.rs`, running from start to orderly shutdown in `lifecycle.rs`, the
//! limits in `limits.rs`, the exports offered now in `export_set.rs`, reloading them in
//! `reload.rs`).

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tracing::warn;
use zcnbd_proto::TlsPolicy;

use crate::admission::Admission;
use crate::buffer_pool::BufferPool;
use crate::connection::serve_client;
use crate::export::Export;
use crate::export_set::{Closing, ExportCell, ExportSet, Offered};
pub use crate::limits::Limits;
pub use crate::listener::ListenAddr;
pub use crate::reload::ReloadSource;
use crate::stats::Stats;
use crate::stream::Stream;
use crate::tls::ktls::{self, KernelTls};
use crate::tls::{KtlsMode, TlsConfig, TlsLoadError, TlsMode, TlsServer};
pub use crate::uring::{DataPath, EngineKind, EngineOptions};
use crate::uring::{EngineShared, UringEngine};
use crate::worker_pool::WorkerPool;

/// Everything to run a server.
#[derive(Debug)]
pub struct ServerConfig {
    pub exports: Vec<Export>,
    pub listen: Vec<ListenAddr>,
    pub limits: Limits,
    pub engine: EngineOptions,
    /// Print the data-path counters at shutdown.
    pub print_stats: bool,
    /// Serve the counters in Prometheus format here.
    pub metrics: Option<SocketAddr>,
    /// TLS settings, checked and loaded at start.
    pub tls: TlsConfig,
    /// The `--config` file `exports` came from, re-read on SIGHUP (`None`: SIGHUP is
    /// logged and ignored).
    pub reload: Option<ReloadSource>,
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// No export was configured.
    #[error("no export configured")]
    NoExports,
    /// Two exports share a name.
    #[error("export name {0:?} is used twice")]
    DuplicateExport(String),
    /// A listener could not be set up.
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: ListenAddr, source: io::Error },
    /// A socket passed by the service manager (socket activation) cannot be served.
    #[error("passed socket (descriptor {fd}): {source}")]
    Passed { fd: i32, source: io::Error },
    /// The caller's start-up step (`serve_on`'s `on_ready`) failed.
    #[error("{0}")]
    Ready(io::Error),
    /// `--engine uring` was asked for and io_uring cannot be used.
    #[error("io_uring engine unavailable: {0}")]
    Engine(io::Error),
    /// Signal handling or threads could not be set up.
    #[error("server setup failed: {0}")]
    Setup(#[from] io::Error),
    /// The TLS settings or credentials are unusable.
    #[error("TLS: {0}")]
    Tls(#[from] TlsLoadError),
    /// An export is `tls_only` but the server offers no TLS.
    #[error("export {0:?} is tls_only, but TLS is off (set --tls on or require)")]
    TlsOnlyWithoutTls(String),
}

/// A server's exports and shared machinery, without listeners: sessions can be served on any
/// connected socket with [`Server::serve_stream`] (the accept loop, tests and fuzzing do).
pub struct Server {
    /// Dropped first (fields drop in order): the rings stop once their connections are
    /// closed, while the worker pool still runs those connections' requests.
    pub(crate) engine: Option<UringEngine>,
    /// The exports offered to new clients (a reload replaces the set).
    pub(crate) exports: ExportCell,
    /// Exports a reload removed, being closed once their last client left.
    pub(crate) closing: Arc<Closing>,
    pub(crate) pool: Arc<BufferPool>,
    /// The pool's owner: a dispatcher holds it weakly, and strongly only during a `start`.
    pub(crate) workers: Arc<WorkerPool>,
    pub(crate) limits: Limits,
    pub(crate) stats: Arc<Stats>,
    pub(crate) admission: Arc<Admission>,
    /// The TLS context, when TLS is on or required (a reload may replace it; a handshake
    /// takes one for its whole life).
    tls: RwLock<Option<Arc<TlsServer>>>,
    /// Whether this kernel lets TLS connections send through it (probed once at start,
    /// used where the TLS context's `--tls-ktls` is `auto`).
    pub(crate) kernel_tls: Option<KernelTls>,
    /// What the probe found (for the log lines).
    pub(crate) kernel_tls_why: String,
    shutting_down: AtomicBool,
    /// A handle to each live connection's socket, to stop it at shutdown.
    live: Arc<LiveSockets>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("exports", &self.exports.load().infos())
            .finish_non_exhaustive()
    }
}

impl Server {
    /// A server for `exports` (names must be unique) on the portable engine.
    pub fn new(exports: Vec<Export>, limits: Limits) -> Result<Arc<Server>, ServerError> {
        let options = EngineOptions {
            engine: EngineKind::Portable,
            ..EngineOptions::default()
        };
        Self::with_engine(exports, limits, options)
    }

    /// A server for `exports` on the engine `options` ask for (falling back to the portable
    /// engine, with one log line, where io_uring cannot be used and `auto` was asked).
    pub fn with_engine(
        exports: Vec<Export>,
        limits: Limits,
        options: EngineOptions,
    ) -> Result<Arc<Server>, ServerError> {
        Self::with_tls(exports, limits, options, None)
    }

    /// As [`Server::with_engine`], offering TLS with `tls` (see [`TlsConfig::load`]).
    pub fn with_tls(
        exports: Vec<Export>,
        limits: Limits,
        options: EngineOptions,
        tls: Option<TlsServer>,
    ) -> Result<Arc<Server>, ServerError> {
        let set = ExportSet::new(exports.into_iter().map(Offered::new).collect())?;
        check_tls_only(&set, tls.is_some())?;
        let pool = BufferPool::new(limits.pooled_bytes_max);
        let workers = Arc::new(WorkerPool::new(limits.worker_threads)?);
        let stats = Arc::new(Stats::default());
        let engine = start_engine(&options, &limits, &pool, &stats)?;
        let (kernel_tls, kernel_tls_why) = ktls::probe_once();
        let admission = Arc::new(Admission::new(
            limits.handshakes_max,
            limits.connections_max,
        ));
        Ok(Arc::new(Server {
            admission,
            exports: ExportCell::new(set),
            closing: Arc::default(),
            pool,
            workers,
            stats,
            engine,
            limits,
            tls: RwLock::new(tls.map(Arc::new)),
            kernel_tls,
            kernel_tls_why,
            shutting_down: AtomicBool::new(false),
            live: Arc::default(),
            next_id: AtomicU64::new(0),
        }))
    }

    /// The data-path counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Which engine serves transmission.
    pub fn engine_name(&self) -> &'static str {
        if self.engine.is_some() {
            "io_uring"
        } else {
            "portable"
        }
    }

    /// The TLS context offered now (`None`: TLS off).
    pub(crate) fn tls(&self) -> Option<Arc<TlsServer>> {
        // Held only to clone or replace the pointer.
        self.tls.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The kTLS hook for a handshake under `tls`: where the kernel has kTLS and the
    /// context's `--tls-ktls` is `auto`.
    pub(crate) fn kernel_tls_for(&self, tls: &TlsServer) -> Option<KernelTls> {
        self.kernel_tls.filter(|_| tls.ktls() == KtlsMode::Auto)
    }

    /// Offers `tls` to handshakes that start from now on.
    pub(crate) fn replace_tls(&self, tls: Option<TlsServer>) {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = tls.map(Arc::new);
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Serves one client on `stream`, from handshake to close; returns once it is closed.
    /// The connection takes a place in the handshake budget first (see
    /// [`Limits::handshakes_max`]).
    pub fn serve_stream(self: &Arc<Self>, stream: Stream, peer: &str) {
        let (done, closed) = crossbeam_channel::bounded(1);
        self.start_session(stream, peer, Some(done));
        // Sent, or dropped unsent, once the connection is closed.
        let _ = closed.recv();
    }

    /// Runs one client's handshake in the calling thread, then its transmission phase here
    /// (portable engine) or on a ring (io_uring engine: this returns once the connection is
    /// handed over). `done` is signalled once the connection is closed.
    pub(crate) fn start_session(
        self: &Arc<Self>,
        stream: Stream,
        peer: &str,
        done: Option<crossbeam_channel::Sender<()>>,
    ) {
        let (Ok(handle), Ok(budget_handle)) = (stream.try_clone(), stream.try_clone()) else {
            warn!(%peer, "cannot duplicate the socket: closing");
            return;
        };
        let ticket = self.admission.begin_handshake(budget_handle, peer);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.live.lock().insert(id, handle);
        let closed = Closed {
            live: Arc::clone(&self.live),
            id,
            done,
        };
        serve_client(Arc::clone(self), stream, peer, ticket, closed);
    }

    /// Stops every session: no new requests are read, those in flight are answered, then
    /// every export is flushed once the caller has joined the session threads.
    pub(crate) fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
        // Readers see end-of-stream and stop taking requests; replies still go out.
        for stream in self.live.lock().values() {
            let _ = stream.shutdown(Shutdown::Read);
        }
    }
}

/// How a handshake offers TLS with the context `tls`.
pub(crate) fn tls_policy(tls: Option<&TlsServer>) -> TlsPolicy {
    match tls.map(TlsServer::mode) {
        Some(TlsMode::Require) => TlsPolicy::Require,
        Some(TlsMode::On) => TlsPolicy::On,
        Some(TlsMode::Off) | None => TlsPolicy::Off,
    }
}

/// Every live connection's socket, by connection id.
#[derive(Debug, Default)]
pub(crate) struct LiveSockets(Mutex<HashMap<u64, Stream>>);

impl LiveSockets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Stream>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connection's entry among the live sockets, removed (and `done` signalled) when this is
/// dropped: when the connection is closed, on whichever thread closes it.
pub(crate) struct Closed {
    live: Arc<LiveSockets>,
    id: u64,
    done: Option<crossbeam_channel::Sender<()>>,
}

impl Drop for Closed {
    fn drop(&mut self) {
        self.live.lock().remove(&self.id);
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
    }
}

fn start_engine(
    options: &EngineOptions,
    limits: &Limits,
    pool: &Arc<BufferPool>,
    stats: &Arc<Stats>,
) -> Result<Option<UringEngine>, ServerError> {
    if options.engine == EngineKind::Portable {
        return Ok(None);
    }
    let shared = EngineShared {
        options: options.clone(),
        limits: limits.clone(),
        pool: Arc::clone(pool),
        stats: Arc::clone(stats),
        load: Arc::default(),
    };
    match UringEngine::start(shared) {
        Ok(engine) => Ok(Some(engine)),
        Err(e) if options.engine == EngineKind::Auto => {
            warn!("io_uring unavailable ({e}); using the portable engine");
            Ok(None)
        }
        Err(e) => Err(ServerError::Engine(e)),
    }
}

/// A `tls_only` export needs a server that offers TLS.
pub(crate) fn check_tls_only(set: &ExportSet, tls: bool) -> Result<(), ServerError> {
    match set.iter().find(|o| o.export.tls_only) {
        Some(o) if !tls => Err(ServerError::TlsOnlyWithoutTls(o.name().to_owned())),
        _ => Ok(()),
    }
}
