//! The exports the handshake offers, as one snapshot that a reload (`reload.rs`) replaces
//! whole.
//!
//! A handshake reads one snapshot per batch of options it handles, so `NBD_OPT_LIST`,
//! `NBD_OPT_INFO` and `NBD_OPT_GO` each see either the old set or the new one, never a mix,
//! and the index a `GO` chose is an index into the set it was chosen from. An attached client
//! holds its [`Offered`] export (and through it the backend), not the set: a reload never
//! touches a connection that already attached.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use tracing::{info, warn};
use zcnbd_proto::ExportInfo;

use crate::export::Export;
use crate::server::ServerError;

/// One export as offered to new clients, and held by the clients attached to it.
#[derive(Debug)]
pub(crate) struct Offered {
    pub(crate) export: Export,
    /// What the handshake tells clients (computed once: the backend is asked only here).
    pub(crate) info: ExportInfo,
    /// Clients attached now. A reload that keeps the export hands this counter to the new
    /// version, so the export's `clients_max` counts the clients of every version.
    pub(crate) attached: Arc<AtomicUsize>,
    /// Set once a reload removed or replaced the export: when its last holder (the old set,
    /// or its last attached client) lets go, it is flushed and closed.
    retired: AtomicBool,
}

impl Offered {
    /// A new export, no client attached yet.
    pub(crate) fn new(export: Export) -> Arc<Offered> {
        Offered::continuing(export, Arc::default())
    }

    /// A new version of an export whose attached clients `attached` counts.
    pub(crate) fn continuing(export: Export, attached: Arc<AtomicUsize>) -> Arc<Offered> {
        Arc::new(Offered {
            info: export.info(),
            export,
            attached,
            retired: AtomicBool::new(false),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.export.name
    }

    /// New clients can no longer find it; it closes when its last client leaves.
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    #[cfg(test)]
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
}

impl Drop for Offered {
    fn drop(&mut self) {
        if !self.retired.load(Ordering::Acquire) {
            return;
        }
        // The backend may still be shared with a dispatcher that is being torn down; a
        // flush here is what the shutdown flush would have been for this export.
        if let Err(e) = self.export.backend.flush() {
            warn!(export = %self.export.name, "flush of a removed export failed: {e}");
        }
        info!(export = %self.export.name, "removed export closed: its last client left");
    }
}

/// The exports offered at one moment: names unique, at least one.
#[derive(Debug)]
pub(crate) struct ExportSet {
    offered: Vec<Arc<Offered>>,
    /// `offered[i].info` for every `i`: the slice the handshake takes.
    infos: Vec<ExportInfo>,
}

impl ExportSet {
    /// A set of `offered`, or why it cannot be served (none, or a name used twice).
    pub(crate) fn new(offered: Vec<Arc<Offered>>) -> Result<ExportSet, ServerError> {
        if offered.is_empty() {
            return Err(ServerError::NoExports);
        }
        for (i, e) in offered.iter().enumerate() {
            if offered[..i].iter().any(|o| o.name() == e.name()) {
                return Err(ServerError::DuplicateExport(e.name().to_owned()));
            }
        }
        let infos = offered.iter().map(|o| o.info.clone()).collect();
        Ok(ExportSet { offered, infos })
    }

    /// What the handshake offers, in the order of [`ExportSet::get`]'s indexes.
    pub(crate) fn infos(&self) -> &[ExportInfo] {
        &self.infos
    }

    /// The export at `index` of [`ExportSet::infos`].
    pub(crate) fn get(&self, index: usize) -> Option<&Arc<Offered>> {
        self.offered.get(index)
    }

    /// The export named `name`.
    pub(crate) fn find(&self, name: &str) -> Option<&Arc<Offered>> {
        self.offered.iter().find(|o| o.name() == name)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<Offered>> {
        self.offered.iter()
    }
}

/// The current set: read by every handshake, replaced by a reload.
#[derive(Debug)]
pub(crate) struct ExportCell(RwLock<Arc<ExportSet>>);

impl ExportCell {
    pub(crate) fn new(set: ExportSet) -> ExportCell {
        ExportCell(RwLock::new(Arc::new(set)))
    }

    /// The set offered now; it stays whole however long the caller holds it.
    pub(crate) fn load(&self) -> Arc<ExportSet> {
        // The lock only guards the pointer swap: nothing can panic while holding it, and a
        // poisoned pointer is still a whole set.
        Arc::clone(&self.0.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Offers `set` from now on; returns the set it replaced.
    pub(crate) fn swap(&self, set: ExportSet) -> Arc<ExportSet> {
        let mut current = self.0.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *current, Arc::new(set))
    }
}
