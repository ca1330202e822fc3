//! Reloading the exports from the `--config` file (on SIGHUP, as nbd-server does): the file
//! is read and every new export opened first, and only if all of that works is the new set
//! offered, in one swap (`export_set.rs`); otherwise the reason is logged and the running
//! configuration is kept whole.
//!
//! Export by export, by name:
//! - **kept**: the same backend definition (the same memory size, null size, or file opened
//!   the same way) keeps its open backend: a memory export's data survives, a file is not
//!   reopened. Changed settings (description, `read_only`, `block_size_min`,
//!   `connections_max`, `tls_only`, `rotational`) apply to clients that attach from now on;
//!   attached clients keep what they negotiated. The export's count of attached clients
//!   carries over, so a lowered `connections_max` refuses new clients until enough leave.
//! - **replaced**: a new backend definition under the same name is a removal plus an
//!   addition: new clients get the newly opened backend, attached ones stay on the old one.
//! - **removed**: new clients no longer see it; attached clients carry on, and the last one
//!   to leave flushes and closes it.
//!
//! TLS: a reload loads the TLS settings in effect again - the file's `[tls]` table, or the
//! `--tls*` options that replace it - re-reading the certificates, key or PSK file, so
//! renewed credentials (or a new `[tls]` table) apply to handshakes that start from then on;
//! TLS sessions already up keep theirs. Credentials that do not load refuse the whole reload.
//! Listen addresses, the engine and the limits come from the command line, which a reload
//! does not re-read.

use std::sync::Arc;

use tracing::{info, warn};

use crate::config::{load_config, ConfigError, ExportSpec, ReloadSource};
use crate::export_set::{ExportSet, Offered};
use crate::server::{check_payloads, check_tls_only, Server, ServerError};

/// Why a reload was refused (the running configuration is kept whole).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    /// The file could not be read or parsed, or an export could not be opened.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The exports it lists cannot be served together (none, a name twice, `tls_only`
    /// without TLS), or the TLS credentials do not load.
    #[error(transparent)]
    Exports(#[from] ServerError),
}

/// What a reload did, by export name.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Summary {
    /// New names, opened.
    pub(crate) added: Vec<String>,
    /// Gone from the file: no new clients; closed when the last attached one leaves.
    pub(crate) removed: Vec<String>,
    /// Unchanged: the same open backend and settings.
    pub(crate) kept: Vec<String>,
    /// The same open backend, new settings for new clients.
    pub(crate) updated: Vec<String>,
    /// A new backend under an old name: opened anew; attached clients stay on the old one.
    pub(crate) replaced: Vec<String>,
}

/// The set `wanted` describes, reusing the backends `running` (built from `running_specs`)
/// has open; nothing in `running` changes. On error, whatever this opened is closed again.
pub(crate) fn plan(
    running: &ExportSet,
    running_specs: &[ExportSpec],
    wanted: &[ExportSpec],
) -> Result<(ExportSet, Summary), ReloadError> {
    let mut summary = Summary::default();
    let mut offered = Vec::with_capacity(wanted.len());
    for spec in wanted {
        let before = running_specs.iter().find(|s| s.name == spec.name);
        let open = running.find(&spec.name);
        let name = spec.name.clone();
        let next = match (before, open) {
            (Some(before), Some(open)) if before.same_backend(spec) => {
                if before == spec {
                    summary.kept.push(name);
                } else {
                    summary.updated.push(name);
                }
                let (base, bitmaps) = (open.export.stack.base(), open.export.bitmaps.clone());
                // A kept backend has been written: its file as it is now.
                let export = spec.with_backend(Arc::clone(base), bitmaps, spec.served_file())?;
                Offered::continuing(export, Arc::clone(&open.attached))
            }
            (before, open) => {
                match open {
                    Some(_) => summary.replaced.push(name),
                    None => summary.added.push(name),
                }
                // The same data opened another way keeps its bitmaps (and their files).
                let same_data = before.is_some_and(|b| b.backend == spec.backend);
                let bitmaps = open
                    .filter(|_| same_data)
                    .and_then(|o| o.export.bitmaps.clone());
                Offered::new(spec.build_keeping(bitmaps)?)
            }
        };
        offered.push(next);
    }
    summary.removed = running
        .iter()
        .map(|o| o.name())
        .filter(|name| !wanted.iter().any(|s| s.name == *name))
        .map(str::to_owned)
        .collect();
    let set = ExportSet::new(offered).map_err(ServerError::from)?;
    Ok((set, summary))
}

/// Re-reads a server's `--config` file on request (the accept loop calls it on SIGHUP).
#[derive(Debug)]
pub(crate) struct Reloader {
    /// The file, and what the running exports were built from.
    source: ReloadSource,
}

impl Reloader {
    pub(crate) fn new(source: ReloadSource) -> Reloader {
        Reloader { source }
    }

    /// Re-reads the file and offers what it says, or logs why not and keeps everything.
    pub(crate) fn reload(&mut self, server: &Server) {
        let path = self.source.path.display().to_string();
        info!(%path, "SIGHUP: re-reading the configuration");
        match self.try_reload(server) {
            Ok(s) => info!(
                added = ?s.added,
                removed = ?s.removed,
                kept = ?s.kept,
                updated = ?s.updated,
                replaced = ?s.replaced,
                "configuration reloaded"
            ),
            Err(e) => warn!(%path, "configuration not reloaded, the running one is kept: {e}"),
        }
    }

    fn try_reload(&mut self, server: &Server) -> Result<Summary, ReloadError> {
        let config = load_config(&self.source.path)?.with_defaults(&self.source.defaults);
        // Nobody else makes a set while this one is made, so `running` stays current until
        // the swap.
        let _writer = server.exports.writer();
        let running = server.exports.load();
        let (set, summary) = plan(&running, &self.source.config.exports, &config.exports)?;
        let tls = if self.source.tls_from_command_line {
            &self.source.config.tls
        } else {
            &config.tls
        };
        let tls = tls
            .clone()
            .unwrap_or_default()
            .load()
            .map_err(ServerError::from)?;
        check_tls_only(&set, tls.is_some())?;
        check_payloads(&set, &server.memory)?;
        // A handshake keeps the context it started with while the exports may change under
        // it; any mix is safe, as it checks tls_only against its own context.
        match (&tls, server.tls().is_some()) {
            (Some(tls), _) => server.log_tls(tls),
            (None, true) => info!("TLS turned off"),
            (None, false) => {}
        }
        server.replace_tls(tls);
        let old = server.exports.swap(set);
        for export in old.iter() {
            let name = export.name();
            if summary
                .removed
                .iter()
                .chain(&summary.replaced)
                .any(|n| n == name)
            {
                export.retire(&server.closing);
            }
        }
        self.source.config.exports = config.exports;
        if !self.source.tls_from_command_line {
            self.source.config.tls = config.tls;
        }
        // `old` goes here: a retired export no client holds is flushed and closed now.
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BackendSpec, ExportDefaults};
    use crate::export_set::SetError;
    use crate::Limits;
    use std::sync::atomic::Ordering;

    fn memory(name: &str, bytes: u64) -> ExportSpec {
        ExportSpec {
            name: name.to_owned(),
            description: String::new(),
            backend: BackendSpec::Memory(bytes),
            read_only: false,
            min_block_size: 1,
            clients_max: None,
            tls_only: false,
            rotational: false,
            filters: Vec::new(),
            payload_max: None,
            image: Default::default(),
            bitmaps: Default::default(),
        }
    }

    fn running(specs: &[ExportSpec]) -> ExportSet {
        let offered = specs.iter().map(|s| Offered::new(s.build().unwrap()));
        ExportSet::new(offered.collect()).unwrap()
    }

    fn names(set: &ExportSet) -> Vec<&str> {
        set.infos().iter().map(|i| i.name.as_str()).collect()
    }

    fn strings(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn a_kept_export_keeps_its_backend_and_data_while_others_come_and_go() {
        let before = [memory("a", 1 << 20), memory("b", 1 << 20)];
        let old = running(&before);
        let a = Arc::clone(old.find("a").unwrap());
        a.export.stack.write(b"survives", 4096, false).unwrap();
        let wanted = [memory("a", 1 << 20), memory("c", 2 << 20)];
        let (new, summary) = plan(&old, &before, &wanted).unwrap();
        assert_eq!(names(&new), ["a", "c"]);
        let expected = Summary {
            added: strings(&["c"]),
            removed: strings(&["b"]),
            kept: strings(&["a"]),
            ..Summary::default()
        };
        assert_eq!(summary, expected);
        let kept = new.find("a").unwrap();
        assert!(Arc::ptr_eq(kept.export.stack.base(), a.export.stack.base()));
        assert!(Arc::ptr_eq(&kept.attached, &a.attached));
        let mut data = [0u8; 8];
        kept.export.stack.read(&mut data, 4096).unwrap();
        assert_eq!(&data, b"survives");
        assert_eq!(new.find("c").unwrap().info.size, 2 << 20);
        // The running set is untouched until the caller swaps.
        assert_eq!(names(&old), ["a", "b"]);
    }

    #[test]
    fn new_settings_keep_the_backend_and_the_count_of_attached_clients() {
        let before = [memory("a", 1 << 20)];
        let old = running(&before);
        let a = Arc::clone(old.find("a").unwrap());
        let admission = Arc::new(crate::session::admission::Admission::new(4, 4));
        let _one = admission.attach(&a.attached, a.export.clients_max).unwrap();
        let _two = admission.attach(&a.attached, a.export.clients_max).unwrap();
        let mut changed = memory("a", 1 << 20);
        changed.read_only = true;
        changed.clients_max = Some(2);
        changed.description = "now read-only".into();
        let (new, summary) = plan(&old, &before, &[changed]).unwrap();
        assert_eq!(summary.updated, strings(&["a"]));
        let a2 = new.find("a").unwrap();
        assert!(Arc::ptr_eq(a2.export.stack.base(), a.export.stack.base()));
        assert_eq!(a2.info.description, "now read-only");
        assert_ne!(
            a2.info.flags & zcnbd_proto::consts::transmission_flags::READ_ONLY,
            0
        );
        // The two clients of the old version count against the new limit.
        let refused = admission.attach(&a2.attached, a2.export.clients_max);
        assert!(refused.is_err());
        assert_eq!(a2.attached.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_new_backend_definition_is_a_new_export() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0u8; 1 << 16]).unwrap();
        let file = |read_only| ExportSpec {
            read_only,
            backend: BackendSpec::File {
                path: path.clone(),
                direct: false,
            },
            ..memory("f", 0)
        };
        let before = [memory("a", 1 << 20), file(false)];
        let old = running(&before);
        // A new size, and a file now opened read-only.
        let wanted = [memory("a", 4 << 20), file(true)];
        let (new, summary) = plan(&old, &before, &wanted).unwrap();
        assert_eq!(summary.replaced, strings(&["a", "f"]));
        for name in ["a", "f"] {
            let (was, is) = (old.find(name).unwrap(), new.find(name).unwrap());
            assert!(!Arc::ptr_eq(
                was.export.stack.base(),
                is.export.stack.base()
            ));
            assert!(!Arc::ptr_eq(&was.attached, &is.attached));
        }
        // A read-only memory export is the same disk behind a policy.
        let mut read_only = memory("a", 1 << 20);
        read_only.read_only = true;
        assert!(read_only.same_backend(&memory("a", 1 << 20)));
        assert!(!file(true).same_backend(&file(false)));
    }

    #[test]
    fn a_config_that_cannot_be_served_changes_nothing() {
        let before = [memory("a", 1 << 20)];
        let old = running(&before);
        let missing = ExportSpec {
            backend: BackendSpec::File {
                path: "/nonexistent/zcnbd-reload.img".into(),
                direct: false,
            },
            ..memory("m", 0)
        };
        let wanted = [memory("a", 1 << 20), missing];
        let err = plan(&old, &before, &wanted).unwrap_err();
        assert!(err.to_string().contains("zcnbd-reload.img"), "{err}");
        let twice = [memory("a", 1 << 20), memory("a", 1 << 20)];
        let err = plan(&old, &before, &twice).unwrap_err();
        assert!(matches!(
            err,
            ReloadError::Exports(ServerError::Exports(SetError::DuplicateExport(_)))
        ));
        let err = plan(&old, &before, &[]).unwrap_err();
        assert!(matches!(
            err,
            ReloadError::Exports(ServerError::Exports(SetError::NoExports))
        ));
        assert_eq!(names(&old), ["a"]);
    }

    fn write_config(path: &std::path::Path, exports: &[(&str, &str)]) {
        let text: String = exports
            .iter()
            .map(|(name, size)| format!("[[export]]\nname = \"{name}\"\nmemory = \"{size}\"\n"))
            .collect();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn a_reload_swaps_the_servers_set_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("zcnbd.toml");
        write_config(&path, &[("a", "1M"), ("b", "1M")]);
        let config = load_config(&path).unwrap();
        let exports = config.exports.iter().map(|s| s.build().unwrap()).collect();
        let limits = Limits {
            worker_threads: 1,
            ..Limits::default()
        };
        let server = Server::new(exports, limits).unwrap();
        // A client attached to b before the reload holds b.
        let attached_b = Arc::clone(server.exports.load().find("b").unwrap());
        let mut reloader = Reloader::new(ReloadSource {
            path: path.clone(),
            config,
            tls_from_command_line: false,
            defaults: ExportDefaults::default(),
        });
        write_config(&path, &[("a", "1M"), ("c", "1M")]);
        reloader.reload(&server);
        assert_eq!(names(&server.exports.load()), ["a", "c"]);
        assert!(attached_b.is_retired());
        attached_b.export.stack.write(b"x", 0, false).unwrap();
        // Neither a file that does not parse nor one with a missing file changes anything.
        std::fs::write(&path, "[[export]]\nname = \"d\"\n").unwrap();
        reloader.reload(&server);
        let missing = "[[export]]\nname = \"a\"\nmemory = \"1M\"\n\
                       [[export]]\nname = \"e\"\nfile = \"/nonexistent/zcnbd.img\"\n";
        std::fs::write(&path, missing).unwrap();
        reloader.reload(&server);
        assert_eq!(names(&server.exports.load()), ["a", "c"]);
        // A tls_only export needs TLS, which this server does not offer.
        let tls_only = "[[export]]\nname = \"t\"\nmemory = \"1M\"\ntls_only = true\n";
        std::fs::write(&path, tls_only).unwrap();
        reloader.reload(&server);
        assert_eq!(names(&server.exports.load()), ["a", "c"]);
    }
}
