//! The exports the handshake offers, as one snapshot that a reload (`reload.rs`) replaces
//! whole.
//!
//! A handshake reads one snapshot per batch of options it handles, so `NBD_OPT_LIST`,
//! `NBD_OPT_INFO` and `NBD_OPT_GO` each see either the old set or the new one, never a mix,
//! and the index a `GO` chose is an index into the set it was chosen from. An attached client
//! holds its [`Offered`] export (and through it the backend), not the set: a reload never
//! touches a connection that already attached.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread::JoinHandle;

use tracing::{info, warn};
use zcnbd_proto::ExportInfo;

use crate::export::Export;

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
    /// or its last attached client) lets go, it is flushed and closed there.
    retired: OnceLock<Arc<Closing>>,
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
            retired: OnceLock::new(),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.export.name
    }

    /// New clients can no longer find it; when its last client leaves, `closing` flushes
    /// and closes it.
    pub(crate) fn retire(&self, closing: &Arc<Closing>) {
        let _ = self.retired.set(Arc::clone(closing));
    }

    #[cfg(test)]
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.get().is_some()
    }
}

impl Drop for Offered {
    fn drop(&mut self) {
        if let Some(closing) = self.retired.get() {
            closing.close(&self.export);
        }
    }
}

/// Retired exports being flushed and closed, each on a thread of its own: the last holder
/// may be a ring thread, which must not wait for an fsync. Shutdown waits for them.
#[derive(Debug, Default)]
pub(crate) struct Closing(Mutex<Vec<JoinHandle<()>>>);

impl Closing {
    /// Flushes `export` (what the shutdown flush would have done for it), then lets it go;
    /// a dispatcher still being torn down may hold it a moment longer. Its dirty bitmaps
    /// are saved when the last export holding them lets go (a reload may have kept them).
    fn close(&self, export: &Export) {
        let flush = |export: &Export| {
            let name = &export.name;
            if let Err(e) = export.stack.flush() {
                warn!(export = %name, "flush of a removed export failed: {e}");
            }
            info!(export = %name, "removed export closed: its last client left");
        };
        let (owned, spare) = (export.clone(), export.clone());
        let name = &export.name;
        let spawned = std::thread::Builder::new()
            .name("export-close".into())
            .spawn(move || flush(&owned));
        let mut threads = self.0.lock().unwrap_or_else(|e| e.into_inner());
        threads.retain(|t| !t.is_finished());
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                warn!(export = %name, "cannot start a thread to close the export ({e}): closing here");
                flush(&spare);
            }
        }
    }

    /// Waits until every export retired so far is closed.
    pub(crate) fn wait(&self) {
        let threads = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// Why exports cannot be offered together.
#[derive(Debug, thiserror::Error)]
pub enum SetError {
    /// No export was configured.
    #[error("no export configured")]
    NoExports,
    /// Two exports share a name.
    #[error("export name {0:?} is used twice")]
    DuplicateExport(String),
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
    pub(crate) fn new(offered: Vec<Arc<Offered>>) -> Result<ExportSet, SetError> {
        if offered.is_empty() {
            return Err(SetError::NoExports);
        }
        for (i, e) in offered.iter().enumerate() {
            if offered[..i].iter().any(|o| o.name() == e.name()) {
                return Err(SetError::DuplicateExport(e.name().to_owned()));
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

/// The current set: read by every handshake, replaced by a reload (or by a change to an
/// export's bitmaps, which changes what the handshake offers).
#[derive(Debug)]
pub(crate) struct ExportCell {
    set: RwLock<Arc<ExportSet>>,
    /// Held by whoever makes the next set from the current one (a reload, the control
    /// socket), so that neither loses the other's change.
    writer: Mutex<()>,
}

impl ExportCell {
    pub(crate) fn new(set: ExportSet) -> ExportCell {
        ExportCell {
            set: RwLock::new(Arc::new(set)),
            writer: Mutex::new(()),
        }
    }

    /// The set offered now; it stays whole however long the caller holds it.
    pub(crate) fn load(&self) -> Arc<ExportSet> {
        // The lock only guards the pointer swap: nothing can panic while holding it, and a
        // poisoned pointer is still a whole set.
        Arc::clone(&self.set.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The right to make the next set: hold it from [`ExportCell::load`] to
    /// [`ExportCell::swap`].
    pub(crate) fn writer(&self) -> MutexGuard<'_, ()> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Offers `set` from now on; returns the set it replaced.
    pub(crate) fn swap(&self, set: ExportSet) -> Arc<ExportSet> {
        let mut current = self.set.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *current, Arc::new(set))
    }

    /// Offers export `name` again as it is now (its metadata contexts changed): new
    /// handshakes see the change, attached clients keep what they negotiated.
    pub(crate) fn reoffer(&self, name: &str) {
        let _writer = self.writer();
        let current = self.load();
        let offered = current
            .iter()
            .map(|o| match o.name() == name {
                true => Offered::continuing(o.export.clone(), Arc::clone(&o.attached)),
                false => Arc::clone(o),
            })
            .collect();
        // Names are those of a valid set: this cannot fail.
        if let Ok(set) = ExportSet::new(offered) {
            self.swap(set);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{NullBackend, Stack};
    use zcnbd_proto::BlockSize;

    fn offered(name: &str) -> Arc<Offered> {
        Offered::new(Export {
            name: name.to_owned(),
            description: String::new(),
            block_size: BlockSize::with_minimum(1),
            stack: Arc::new(Stack::of(Arc::new(NullBackend::new(1 << 20)), false)),
            clients_max: None,
            tls_only: false,
            rotational: false,
            bitmaps: None,
            source: String::new(),
        })
    }

    #[test]
    fn a_set_has_exports_with_unique_names_and_a_swap_replaces_it_whole() {
        assert!(matches!(ExportSet::new(vec![]), Err(SetError::NoExports)));
        let twice = vec![offered("a"), offered("a")];
        assert!(matches!(
            ExportSet::new(twice),
            Err(SetError::DuplicateExport(name)) if name == "a"
        ));
        let cell = ExportCell::new(ExportSet::new(vec![offered("a"), offered("b")]).unwrap());
        let held = cell.load();
        let old = cell.swap(ExportSet::new(vec![offered("c")]).unwrap());
        assert!(Arc::ptr_eq(&held, &old));
        assert_eq!(held.infos().len(), 2, "a holder keeps its whole set");
        assert_eq!(held.get(1).unwrap().name(), "b");
        assert_eq!(cell.load().infos()[0].name, "c");
        assert!(cell.load().find("a").is_none());
    }

    #[test]
    fn a_retired_export_closes_when_its_last_holder_lets_go() {
        let closing = Arc::new(Closing::default());
        let export = offered("gone");
        let backend = Arc::clone(&export.export.stack);
        let client = Arc::clone(&export);
        export.retire(&closing);
        drop(export);
        // The attached client still holds it: nothing is closing.
        assert!(closing.0.lock().unwrap().is_empty());
        assert_eq!(Arc::strong_count(&backend), 2);
        drop(client);
        closing.wait();
        assert_eq!(Arc::strong_count(&backend), 1, "the backend was let go");
        // An export that was not retired (a kept one's old version) is not closed.
        let kept = offered("kept");
        drop(kept);
        assert!(closing.0.lock().unwrap().is_empty());
    }
}
