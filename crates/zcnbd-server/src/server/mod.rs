//! The server: its exports and shared machinery, and its connections (`connections.rs`: each
//! one's handshake, then its engine). Listeners and the accept loop are in `listener.rs`,
//! running from start to orderly shutdown in `lifecycle.rs`, the limits in `limits.rs`, the
//! exports offered now in `export_set.rs`, reloading them in `reload.rs`.

mod connections;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tracing::{info, warn};

use crate::buffer_pool::BufferPool;
use crate::engine::memory::MemoryBudget;
use crate::engine::portable::PortableEngine;
use crate::engine::uring::{EngineShared, UringEngine};
use crate::export::Export;
use crate::export_set::{Closing, ExportCell, ExportSet, Offered, SetError};
use crate::session::admission::Admission;
use crate::stats::Stats;
use crate::tls::ktls::{self, KernelTls};
use crate::tls::{KtlsMode, TlsConfig, TlsLoadError, TlsServer};
use crate::worker_pool::WorkerPool;
use connections::LiveSockets;

use crate::config::ReloadSource;
pub use crate::engine::options::{DataPath, EngineKind, EngineOptions};
pub use crate::limits::Limits;
use crate::listen_addr::ListenAddr;

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
    /// Manage dirty bitmaps on this Unix socket (`control.rs`).
    pub control: Option<PathBuf>,
    /// TLS settings, checked and loaded at start.
    pub tls: TlsConfig,
    /// The `--config` file `exports` came from, re-read on SIGHUP (`None`: SIGHUP is
    /// logged and ignored).
    pub reload: Option<ReloadSource>,
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Two exports share a name, or none is offered.
    #[error(transparent)]
    Exports(#[from] SetError),
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
    /// An export's largest payload does not fit the buffer memory the server may hold.
    #[error("export {name:?}: its payload_max ({payload} bytes) needs --buffers-max of at least {needed} bytes")]
    PayloadOverMemory {
        name: String,
        payload: u32,
        needed: usize,
    },
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
    /// Connections the io_uring engine does not take (or all, without it).
    portable: PortableEngine,
    /// The buffer memory all connections together may hold.
    pub(crate) memory: Arc<MemoryBudget>,
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
    /// Set at shutdown: handshakes and readers stop taking anything new.
    shutting_down: Arc<AtomicBool>,
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
        let shutting_down = Arc::new(AtomicBool::new(false));
        let memory = Arc::new(MemoryBudget::new(&limits));
        check_payloads(&set, &memory)?;
        check_tls_only(&set, tls.is_some())?;
        let pool = BufferPool::new(limits.pooled_bytes_max);
        let workers = Arc::new(WorkerPool::new(limits.worker_threads)?);
        let stats = Arc::new(Stats::default());
        let engine = start_engine(&options, &limits, &pool, &stats, &memory)?;
        let (kernel_tls, kernel_tls_why) = ktls::probe_once();
        let admission = Arc::new(Admission::new(
            limits.handshakes_max,
            limits.connections_max,
        ));
        Ok(Arc::new(Server {
            portable: PortableEngine::new(
                limits.clone(),
                Arc::clone(&memory),
                Arc::clone(&shutting_down),
                options.poll_max,
                options.coalesce_max,
            ),
            memory,
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
            shutting_down,
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

    /// One line at start (and at each reload): how TLS is offered and where its records are
    /// made.
    pub(crate) fn log_tls(&self, tls: &TlsServer) {
        let why = &self.kernel_tls_why;
        let records = match self.kernel_tls_for(tls) {
            Some(_) => format!(
                "records sent by the kernel (kTLS) where the cipher allows, read in user space \
                 ({why}); TLS connections run on the configured engine"
            ),
            None if tls.ktls() == KtlsMode::Off => "records made in user space (--tls-ktls=off); \
                 TLS connections run on the portable engine"
                .to_string(),
            None => format!(
                "records made in user space ({why}); TLS connections run on the portable engine"
            ),
        };
        info!(
            mode = %tls.mode(),
            credentials = ?tls.credentials(),
            "TLS offered: {records}"
        );
    }

    /// Offers `tls` to handshakes that start from now on.
    pub(crate) fn replace_tls(&self, tls: Option<TlsServer>) {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = tls.map(Arc::new);
    }

    /// Stops every session: no new requests are read, those in flight are answered, then
    /// every export is flushed once the caller has joined the session threads.
    pub(crate) fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
        // Readers see end-of-stream and stop taking requests; replies still go out.
        self.live.shut_reads();
    }
}

fn start_engine(
    options: &EngineOptions,
    limits: &Limits,
    pool: &Arc<BufferPool>,
    stats: &Arc<Stats>,
    memory: &Arc<MemoryBudget>,
) -> Result<Option<UringEngine>, ServerError> {
    if options.engine == EngineKind::Portable {
        return Ok(None);
    }
    let shared = EngineShared {
        options: options.clone(),
        limits: limits.clone(),
        pool: Arc::clone(pool),
        stats: Arc::clone(stats),
        memory: Arc::clone(memory),
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

/// Every export's largest request must fit the buffer memory a connection can get (its
/// reserve and the shared part, which twice the payload leaves room for): else such a request
/// would wait forever.
pub(crate) fn check_payloads(set: &ExportSet, memory: &MemoryBudget) -> Result<(), ServerError> {
    for offered in set.iter() {
        let payload = offered.info.block_size.payload_max;
        let needed = 2 * payload as usize;
        if memory.limit() < needed {
            return Err(ServerError::PayloadOverMemory {
                name: offered.name().to_owned(),
                payload,
                needed,
            });
        }
    }
    Ok(())
}
