//! The connections to the web server: at most `connections_max` open at once (a request
//! takes an idle one, or opens one while there is room, or waits for one to be given back),
//! kept alive between requests. A slot given back without a connection (it failed, or the
//! response did not leave it reusable) frees its room for a new one.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::connection::{Connection, Connector};
use super::error::HttpError;
use super::url::Origin;

/// The pool.
pub struct Pool {
    state: Mutex<State>,
    freed: Condvar,
    connections_max: usize,
}

/// Invariant: `taken + idle.len() <= connections_max`, so at most that many connections are
/// open (each slot holds at most one).
struct State {
    idle: Vec<Connection>,
    taken: usize,
}

/// A place in the pool, held for one request: maybe a connection.
pub struct Slot<'a> {
    pool: &'a Pool,
    connection: Option<Connection>,
}

impl Pool {
    /// An empty pool of at most `connections_max` (at least 1) connections.
    pub fn new(connections_max: usize) -> Pool {
        Pool {
            state: Mutex::new(State {
                idle: Vec::with_capacity(connections_max),
                taken: 0,
            }),
            freed: Condvar::new(),
            connections_max: connections_max.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot, with an idle connection if there is one; waits while every slot is taken
    /// (each holder's requests are bounded by the timeouts).
    pub fn take(&self) -> Slot<'_> {
        let mut state = self.lock();
        while state.taken >= self.connections_max {
            state = self.freed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.taken += 1;
        let connection = state.idle.pop();
        debug_assert!(state.taken + state.idle.len() <= self.connections_max);
        Slot {
            pool: self,
            connection,
        }
    }

    fn give_back(&self, connection: Option<Connection>) {
        let mut state = self.lock();
        state.taken -= 1;
        state.idle.extend(connection);
        drop(state);
        self.freed.notify_one();
    }

    /// Connections open and idle now (for tests).
    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.lock().idle.len()
    }
}

impl Slot<'_> {
    /// The slot's connection to `origin`: the one it holds if it goes there, else a new one
    /// (one to another origin is closed).
    pub fn connection(
        &mut self,
        connector: &Connector,
        origin: &Origin,
    ) -> Result<&mut Connection, HttpError> {
        if self
            .connection
            .as_ref()
            .is_some_and(|c| c.origin() != origin)
        {
            self.connection = None;
        }
        let connection = match self.connection.take() {
            Some(connection) => connection,
            None => connector.open(origin)?,
        };
        Ok(self.connection.insert(connection))
    }

    /// Closes the connection (it failed, or its response left it unusable).
    pub fn discard(&mut self) {
        self.connection = None;
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        // A connection left inside a response (a request that failed after its head) is
        // closed: what is left of that response would be read as the next one's.
        let connection = self.connection.take();
        self.pool
            .give_back(connection.filter(Connection::is_between_responses));
    }
}
