//! A throwaway Ceph cluster for checks against an RBD export: the repository's
//! `tests/ceph/cluster.sh`, started for one server and stopped (by its recorded PIDs) when
//! dropped; or the running cluster `ZCNBD_CEPH_CONF` names, left alone.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A cluster with pool `rbd`.
pub struct Cluster {
    pub conf: PathBuf,
    /// Ours to stop (`None`: `ZCNBD_CEPH_CONF`'s).
    dir: Option<tempfile::TempDir>,
}

fn cluster_sh() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/ceph/cluster.sh")
}

impl Cluster {
    /// Starts one (or uses `ZCNBD_CEPH_CONF`'s); the error says why not.
    pub fn start() -> Result<Cluster, String> {
        if let Ok(conf) = std::env::var("ZCNBD_CEPH_CONF") {
            return Ok(Cluster {
                conf: conf.into(),
                dir: None,
            });
        }
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let out = Command::new(cluster_sh())
            .arg("start")
            .arg(dir.path())
            .output()
            .map_err(|e| format!("tests/ceph/cluster.sh: {e}"))?;
        let cluster = Cluster {
            conf: dir.path().join("ceph.conf"),
            dir: Some(dir),
        };
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).into_owned();
            return Err(format!("the test Ceph cluster did not start: {why}"));
        }
        Ok(cluster)
    }

    /// A fresh image of `bytes` in pool `rbd`: `rbd/NAME`.
    pub fn new_image(&self, bytes: u64) -> Result<String, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("rbd/client-{}-{n}", std::process::id());
        let status = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(["create", &name, "--size", &format!("{}M", bytes >> 20)])
            .status()
            .map_err(|e| format!("rbd create: {e}"))?;
        status
            .success()
            .then_some(name)
            .ok_or_else(|| "rbd create failed".to_owned())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = Command::new(cluster_sh())
                .arg("stop")
                .arg(dir.path())
                .status();
        }
    }
}
