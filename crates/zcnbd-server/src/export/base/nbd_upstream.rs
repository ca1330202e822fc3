//! The connection to an upstream NBD server (`nbd.rs`) and its replacement when it is lost:
//! one reconnection at a time, with backoff, for up to the reconnect time. The blocking
//! methods run a call again on the new connection (`with_client`); the asynchronous ones
//! park their operations until the driver thread has a new connection (`nbd_async.rs`).

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use rustix::event::epoll;
use zcnbd_client::{Client, ClientOptions};

use super::nbd_async::Pending;
use crate::export::Plug;

/// The first wait between two attempts to reach a lost upstream, doubled up to the next.
const RECONNECT_WAIT_FIRST: Duration = Duration::from_millis(100);
pub(super) const RECONNECT_WAIT_MAX: Duration = Duration::from_secs(5);
/// A connection lost sooner than this after it was made is churn (an upstream that breaks
/// the protocol on some request, which is sent again on every new connection): the next
/// reconnection waits first, that wait doubling up to `RECONNECT_WAIT_MAX`, and is logged
/// at debug level, the count told when a connection lasts.
const CHURN_WINDOW: Duration = Duration::from_secs(1);

/// Reconnections in a row whose connection was soon lost again.
#[derive(Default)]
struct Churn {
    /// When the last reconnection was made.
    last: Option<Instant>,
    /// How long the next reconnection waits first, if it is churn.
    wait: Duration,
    /// Reconnections logged at debug level since the last warning.
    quiet: u64,
}

/// An upstream export and the connection to it now.
pub(super) struct Upstream {
    pub uri: String,
    /// What a reconnection asks for (the contexts found at connect, by name).
    options: ClientOptions,
    /// How long a lost upstream is retried before its requests fail (zero: never).
    pub reconnect: Duration,
    pub size: u64,
    /// The upstream's metadata contexts besides `base:allocation`, as listed at connect:
    /// every connection, a reconnection too, asks for these names.
    pub contexts: Vec<String>,
    /// The connection now, and how many times it was replaced.
    current: RwLock<(u64, Arc<Client>)>,
    /// One reconnection at a time; how the last ones went.
    reconnecting: Mutex<Churn>,
    /// Asynchronous operations whose connection was lost, waiting for a new one.
    pub(super) parked: Mutex<Vec<Pending>>,
    /// Wakes a reconnection's backoff when the backend stops, and (when polled) the driver
    /// thread when an operation is parked.
    stop_cv: Condvar,
    stopping: AtomicBool,
    /// Once an engine runs the completions itself ([`Upstream::poll_here`]): an epoll set
    /// holding the current connection's event descriptor (the one it polls, which outlives
    /// reconnections), and the driver thread only reconnects.
    polled: Mutex<Option<Arc<OwnedFd>>>,
    is_polled: AtomicBool,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here is left half-updated by a panic: a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Adds `client`'s event descriptor, of connection `generation`, to the epoll set `events`.
fn watch(events: &OwnedFd, client: &Client, generation: u64) -> io::Result<()> {
    let data = epoll::EventData::new_u64(generation);
    epoll::add(events, client.event_fd(), data, epoll::EventFlags::IN)?;
    Ok(())
}

/// Whether `e` means the connection is gone (as opposed to the upstream refusing a request).
pub(super) fn connection_lost(e: &zcnbd_client::Error) -> bool {
    use zcnbd_client::Error as E;
    matches!(
        e,
        E::Disconnected(_) | E::Closed | E::Io { .. } | E::Protocol(_)
    )
}

/// The upstream's errno, for the caller (the stack and the block layer map errnos).
pub(super) fn errno(e: zcnbd_client::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

impl Upstream {
    /// The upstream of `client`, just connected with options whose reconnection form is
    /// `options`.
    pub fn new(
        uri: &str,
        client: Client,
        options: ClientOptions,
        reconnect: Duration,
        contexts: Vec<String>,
    ) -> Upstream {
        Upstream {
            uri: uri.to_owned(),
            options,
            reconnect,
            size: client.size(),
            contexts,
            current: RwLock::new((0, Arc::new(client))),
            reconnecting: Mutex::new(Churn::default()),
            parked: Mutex::new(Vec::new()),
            stop_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            polled: Mutex::new(None),
            is_polled: AtomicBool::new(false),
        }
    }

    /// What every connection to the upstream asks for.
    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// The connection now, and its generation (how many times it was replaced).
    pub fn current(&self) -> (u64, Arc<Client>) {
        let now = self.current.read().unwrap_or_else(|p| p.into_inner());
        (now.0, Arc::clone(&now.1))
    }

    /// From now on the caller runs the completions ([`Upstream::run_ready`], on any thread)
    /// when the returned descriptor is readable; the driver thread only reconnects.
    pub fn poll_here(&self) -> io::Result<Arc<OwnedFd>> {
        // The connection's lock first (as `replace` takes them): a replacement adds its
        // descriptor after this one is in.
        let now = self.current.write().unwrap_or_else(|p| p.into_inner());
        let mut polled = lock(&self.polled);
        if let Some(events) = polled.as_ref() {
            return Ok(Arc::clone(events));
        }
        let events = Arc::new(epoll::create(epoll::CreateFlags::CLOEXEC)?);
        watch(&events, &now.1, now.0)?;
        *polled = Some(Arc::clone(&events));
        self.is_polled.store(true, Ordering::Release);
        drop(polled);
        drop(now);
        // A driver thread waiting on the connection moves to waiting for parked operations.
        self.current().1.wake();
        Ok(events)
    }

    /// Whether an engine runs the completions ([`Upstream::poll_here`]).
    pub fn is_polled(&self) -> bool {
        self.is_polled.load(Ordering::Acquire)
    }

    /// Runs the completions that wait now, on the caller's thread; how many ran.
    pub fn run_ready(&self) -> usize {
        self.current().1.run_ready()
    }

    /// Holds back the current connection's sends until the plug is dropped (a reconnection
    /// meanwhile: the new connection is not held, the old one's hold goes with it).
    pub fn plug(&self) -> Plug {
        struct Held(Arc<Client>);
        impl Drop for Held {
            fn drop(&mut self) {
                self.0.release();
            }
        }
        let (_, client) = self.current();
        client.hold();
        Plug::new(Held(client))
    }

    /// The polled driver thread's wait: until an operation is parked, the backend stops, or
    /// `slice` passes.
    pub fn wait_for_parked(&self, slice: Duration) {
        let parked = lock(&self.parked);
        if parked.is_empty() && !self.is_stopping() {
            let _ = self.stop_cv.wait_timeout(parked, slice);
        }
    }

    /// Wakes the driver thread to reconnect for an operation just parked.
    pub fn parked_one(&self, client: &Client) {
        match self.is_polled() {
            true => self.stop_cv.notify_all(),
            false => client.wake(),
        }
    }

    /// Whether the backend is going away (the driver thread ends, nothing reconnects).
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Stops reconnecting and wakes the driver thread, which ends.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        drop(lock(&self.parked));
        self.stop_cv.notify_all();
        self.current().1.wake();
    }

    /// Whether an operation that failed with `e` is tried again on a new connection.
    pub fn may_retry(&self, e: &zcnbd_client::Error) -> bool {
        !self.reconnect.is_zero() && connection_lost(e)
    }

    /// Runs `op` on the connection; if the connection is lost, reconnects and runs it again,
    /// for up to the reconnect time from its first failure: an operation that keeps failing
    /// on new connections (an upstream that breaks the protocol answering it) fails then.
    pub fn with_client<T>(
        &self,
        mut op: impl FnMut(&Client) -> Result<T, zcnbd_client::Error>,
    ) -> Result<T, zcnbd_client::Error> {
        let mut deadline = None;
        loop {
            let (generation, client) = self.current();
            match op(&client) {
                Err(e) if self.may_retry(&e) => {
                    let deadline = *deadline.get_or_insert_with(|| Instant::now() + self.reconnect);
                    if Instant::now() >= deadline || !self.reconnect_after(generation, deadline, &e)
                    {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
    }

    /// Replaces connection `failed` (unless another thread did already) by a new one, trying
    /// with backoff until `deadline`; whether there is a new one.
    pub fn reconnect_after(
        &self,
        failed: u64,
        deadline: Instant,
        why: &dyn std::fmt::Display,
    ) -> bool {
        let mut churn = lock(&self.reconnecting);
        if self.current().0 != failed {
            return true;
        }
        if churn.last.is_some_and(|t| t.elapsed() < CHURN_WINDOW) {
            let wait = churn.wait.max(RECONNECT_WAIT_FIRST);
            churn.wait = (wait * 2).min(RECONNECT_WAIT_MAX);
            churn.quiet += 1;
            tracing::debug!(uri = %self.uri, why = %why, wait_ms = wait.as_millis(),
                "the new upstream connection was lost at once: waiting, then reconnecting");
            let now = Instant::now();
            if now >= deadline || self.is_stopping() {
                return false;
            }
            self.pause(wait.min(deadline - now));
        } else {
            let quiet = std::mem::take(&mut churn.quiet);
            churn.wait = RECONNECT_WAIT_FIRST;
            tracing::warn!(uri = %self.uri, why = %why, lost_at_once_before = quiet,
                "reconnecting to the upstream NBD server");
        }
        let mut wait = RECONNECT_WAIT_FIRST;
        loop {
            match Client::connect_with(&self.uri, &self.options) {
                Ok(client) if client.size() == self.size => {
                    self.warn_lost_contexts(&client);
                    self.replace(failed + 1, client);
                    if churn.quiet == 0 {
                        tracing::info!(uri = %self.uri, "reconnected to the upstream NBD server");
                    }
                    churn.last = Some(Instant::now());
                    return true;
                }
                Ok(client) => {
                    tracing::warn!(uri = %self.uri, was = self.size, now = client.size(),
                        "the upstream's export changed size: its requests fail");
                    return false;
                }
                Err(e) => tracing::debug!(uri = %self.uri, error = %e, "reconnect failed"),
            }
            let now = Instant::now();
            if now >= deadline || self.is_stopping() {
                tracing::warn!(uri = %self.uri, "the upstream NBD server did not come back: its requests fail");
                return false;
            }
            self.pause(wait.min(deadline - now));
            wait = (wait * 2).min(RECONNECT_WAIT_MAX);
        }
    }

    /// Makes `client` the connection of generation `generation`; the one it replaces is
    /// woken (the driver thread moves on) and dropped outside the lock (closing it fails
    /// what is still in flight on it, whose callbacks look at the connection).
    fn replace(&self, generation: u64, client: Client) {
        let mut now = self.current.write().unwrap_or_else(|p| p.into_inner());
        if let Some(events) = lock(&self.polled).as_ref() {
            // The engine's poll moves to the new connection (the old one's operations fail
            // as it is dropped, on this thread).
            let _ = epoll::delete(&**events, now.1.event_fd());
            if let Err(e) = watch(events, &client, generation) {
                tracing::error!(uri = %self.uri, error = %e, "cannot poll the new upstream connection");
            }
        }
        let old = std::mem::replace(&mut *now, (generation, Arc::new(client)));
        drop(now);
        old.1.wake();
    }

    /// Waits `wait`, or less if the backend stops.
    fn pause(&self, wait: Duration) {
        let parked = lock(&self.parked);
        let stopping = |_: &mut Vec<Pending>| !self.is_stopping();
        let _ = self.stop_cv.wait_timeout_while(parked, wait, stopping);
    }

    /// Logs each passed context that a new connection `client` did not select: its block
    /// status fails from now on.
    fn warn_lost_contexts(&self, client: &Client) {
        for lost in self.contexts.iter().filter(|c| !client.has_meta_context(c)) {
            tracing::warn!(uri = %self.uri, context = %lost,
                "the upstream no longer offers this metadata context: its block status fails with EIO");
        }
    }
}
