//! Running a server from start to orderly exit: listeners first (so "server ready" means
//! clients can connect), the caller's start-up step once they accept (write a pid file, tell
//! a parent, start a captive command), then the accept loop until a signal or a
//! [`StopHandle`] stops it.
//!
//! SIGINT/SIGTERM and [`StopHandle::stop`] wake the accept loop through a socket pair (signal-hook
//! writes a byte into it). Shutdown then stops accepting, tells every connection to stop
//! reading new requests, waits for the requests in flight to be answered, flushes every
//! export and returns. SIGHUP wakes it through another pair: the accept loop's thread then
//! re-reads the `--config` file (`reload.rs`), or, without one, logs that it ignores it.

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use tracing::{info, warn};

use crate::engine::Engine;
use crate::listen_addr::ListenAddr;
use crate::listener::{accept_loop, Listeners, Wake};
use crate::reload::Reloader;
use crate::server::{Server, ServerConfig, ServerError};
use crate::tls::{TlsConfig, TlsMode};

/// What the start-up step learns once the server accepts clients.
#[derive(Debug)]
pub struct Ready {
    /// Where it listens (ports resolved).
    pub addrs: Vec<ListenAddr>,
    /// Stops the server as SIGTERM would.
    pub stop: StopHandle,
}

/// Stops a running server in order, from any thread (as SIGTERM does).
#[derive(Debug)]
pub struct StopHandle(UnixStream);

impl StopHandle {
    /// Begins the orderly shutdown; `serve_on` returns once it is done.
    pub fn stop(&self) {
        // The accept loop only waits for the socket to be readable: one byte is enough, and
        // if the buffer is full a wake-up is already pending.
        let _ = (&self.0).write(&[1]);
    }

    /// Another handle on the same server.
    pub fn try_clone(&self) -> io::Result<StopHandle> {
        self.0.try_clone().map(StopHandle)
    }
}

/// Set by SIGINT/SIGTERM (`stop`) and SIGHUP (`reload`) once [`catch_stop_signals`] ran.
struct Caught {
    stop: Arc<AtomicBool>,
    reload: Arc<AtomicBool>,
}

static CAUGHT: OnceLock<Caught> = OnceLock::new();

/// Catches SIGINT and SIGTERM from now on (call it before binding listeners): one that
/// arrives once clients can connect but before [`serve_on`] waits for signals still stops
/// the server in order, instead of killing the process. SIGHUP too: one that arrives then
/// makes [`serve_on`] reload the `--config` file once it runs, instead of killing the
/// process. Installs handlers only (no thread, no descriptor), so it may run before a fork;
/// calling it again does nothing.
pub fn catch_stop_signals() -> io::Result<()> {
    let mut result = Ok(());
    CAUGHT.get_or_init(|| {
        let caught = Caught {
            stop: Arc::new(AtomicBool::new(false)),
            reload: Arc::new(AtomicBool::new(false)),
        };
        let mut register = |signal, flag: &Arc<AtomicBool>| {
            if let Err(e) = signal_hook::flag::register(signal, Arc::clone(flag)) {
                result = Err(e);
            }
        };
        register(signal_hook::consts::SIGINT, &caught.stop);
        register(signal_hook::consts::SIGTERM, &caught.stop);
        register(signal_hook::consts::SIGHUP, &caught.reload);
        caught
    });
    result
}

fn stop_requested() -> bool {
    CAUGHT
        .get()
        .is_some_and(|caught| caught.stop.load(Ordering::SeqCst))
}

/// Whether a SIGHUP came since the last call.
fn reload_requested() -> bool {
    CAUGHT
        .get()
        .is_some_and(|caught| caught.reload.swap(false, Ordering::SeqCst))
}

/// The read end (nonblocking) of a socket pair that SIGHUP writes a byte into.
fn reload_wake() -> io::Result<UnixStream> {
    let (rx, tx) = UnixStream::pair()?;
    rx.set_nonblocking(true)?;
    tx.set_nonblocking(true)?;
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGHUP, tx.try_clone()?)?;
    // A SIGHUP caught before the pipe was registered.
    if reload_requested() {
        let _ = (&tx).write(&[1]);
    }
    Ok(rx)
}

/// Listens on `config.listen` and serves until SIGINT or SIGTERM, then shuts down in order
/// and returns `Ok`.
pub fn serve(config: ServerConfig) -> Result<(), ServerError> {
    catch_stop_signals()?;
    let listeners = Listeners::bind(&config.listen)?;
    serve_on(config, listeners, |_| Ok(()))
}

/// Serves on `listeners` (`config.listen` is not used) until SIGINT, SIGTERM or the stop
/// handle, then shuts down in order and returns. `on_ready` runs once, as soon as the
/// listeners accept clients and before the first is accepted; if it fails, the server shuts
/// down and returns its error.
pub fn serve_on(
    config: ServerConfig,
    listeners: Listeners,
    on_ready: impl FnOnce(Ready) -> io::Result<()>,
) -> Result<(), ServerError> {
    let tls = config.tls.load()?;
    let server = Server::with_tls(config.exports, config.limits, config.engine, tls)?;
    match server.tls() {
        Some(tls) => server.log_tls(&tls),
        None => info!("TLS off: clients connect in plain text (--tls)"),
    }
    if let Some(addr) = config.metrics {
        crate::metrics::spawn(addr, Arc::clone(&server.stats))?;
    }
    // Removed (the socket file) when the server has shut down.
    let _control = match &config.control {
        Some(path) => Some(crate::control::spawn(path, &server).map_err(|e| {
            ServerError::Setup(io::Error::new(e.kind(), format!("--control: {e}")))
        })?),
        None => None,
    };
    let (wake_rx, wake_tx) = UnixStream::pair()?;
    // Nonblocking (the flag is the socket's, so every clone has it): a writer never waits,
    // and a full buffer already means a wake-up is pending.
    wake_tx.set_nonblocking(true)?;
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::low_level::pipe::register(signal, wake_tx.try_clone()?)?;
    }
    // A signal caught before the pipe was registered.
    if stop_requested() {
        let _ = (&wake_tx).write(&[1]);
    }
    let reload_rx = reload_wake()?;
    let mut reloader = config.reload.map(Reloader::new);
    let tls_settings = config.tls;
    let mut on_reload = || match &mut reloader {
        Some(reloader) => reloader.reload(&server),
        // Without --config only the TLS credentials are read again (renewed certificates,
        // a new revocation list), for handshakes that start from now on.
        None if tls_settings.mode != TlsMode::Off => reload_tls(&server, &tls_settings),
        None => info!("SIGHUP: no --config file to re-read and no TLS; ignored"),
    };
    let addrs = listeners.addrs();
    for addr in &addrs {
        info!("listening on {addr}");
    }
    for offered in server.exports.load().iter() {
        log_export(&offered.export);
    }
    info!(engine = server.engine_name(), "server ready");
    let ready = on_ready(Ready {
        addrs,
        stop: StopHandle(wake_tx),
    });
    let threads = match &ready {
        Ok(()) => {
            let wake = Wake {
                stop: &wake_rx,
                reload: &reload_rx,
                on_reload: &mut on_reload,
            };
            accept_loop(&server, &listeners.0, wake)?
        }
        Err(_) => Vec::new(),
    };
    drop(listeners);
    shut_down(&server, threads, config.print_stats);
    ready.map_err(ServerError::Ready)
}

/// One line per export at start: what a client gets when it asks for it.
fn log_export(export: &crate::export::Export) {
    let stack = &export.stack;
    let bitmaps: Vec<String> = export
        .bitmaps
        .as_ref()
        .map(|b| b.list().into_iter().map(|i| i.name).collect())
        .unwrap_or_default();
    info!(
        export = %export.name,
        source = %export.source,
        size = stack.size(),
        read_only = stack.is_read_only(),
        bitmaps = ?bitmaps,
        filters = ?stack.layer_names(),
        "serving export {:?}",
        export.name
    );
}

/// Stops every session, waits for them, flushes every export.
fn shut_down(server: &Arc<Server>, threads: Vec<JoinHandle<()>>, print_stats: bool) {
    server.begin_shutdown();
    for t in threads {
        let _ = t.join();
    }
    // Connections on the io_uring engine hold no thread: wait for the rings instead.
    if let Some(engine) = &server.engine {
        engine.stop();
    }
    // Exports a reload removed are flushed as their last client leaves.
    server.closing.wait();
    for offered in server.exports.load().iter() {
        if let Err(e) = offered.export.stack.flush() {
            warn!(export = %offered.name(), "final flush failed: {e}");
        }
        if let Some(bitmaps) = &offered.export.bitmaps {
            bitmaps.save();
        }
    }
    if print_stats {
        eprint!("{}", server.stats.render_table());
    }
    info!("shut down cleanly");
}

/// SIGHUP without `--config`: the TLS context is loaded again from `settings`, or (if it no
/// longer loads) the running one is kept, and the log says which.
fn reload_tls(server: &Server, settings: &TlsConfig) {
    info!("SIGHUP: re-reading the TLS credentials");
    match settings.load() {
        Ok(tls) => {
            if let Some(tls) = &tls {
                server.log_tls(tls);
            }
            server.replace_tls(tls);
        }
        Err(e) => warn!("TLS credentials not reloaded, the running ones are kept: {e}"),
    }
}
