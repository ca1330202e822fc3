//! Whether an export can still promise durability. After a failed `fdatasync` the kernel may
//! have dropped the dirty pages it could not write, and the next `fdatasync` returns 0 for
//! them (the error is reported once per file description): a later FLUSH would acknowledge
//! writes that are lost. So, as QEMU's file-posix does, the first failed sync of an export
//! (a FLUSH, or a FUA write, trim or zero, however it was made durable) fails every later
//! FLUSH and FUA request of that export with EIO until it is opened again; reads and plain
//! writes go on. Logged once, when it happens.
//!
//! The rule is the page cache's: a backend whose syncs are `fdatasync` of a file (a file or
//! block device, a disk image) owns its [`Durability`] and answers it
//! ([`Backend::durability`](super::Backend)), so a reload that keeps its descriptors does not
//! forget a failure. The others (memory, null, Ceph RBD, whose librbd reports a failed
//! write or flush to the request that made it, and answers later ones afresh: a stopped
//! OSD's requests fail, and the next succeed once it is back) get one that never refuses.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::error;

/// Whether every sync of an export has succeeded so far.
#[derive(Debug)]
pub struct Durability {
    lost: AtomicBool,
    /// Whether a failed sync refuses later ones (the page cache's rule), or is only that
    /// request's failure.
    enforced: bool,
}

impl Default for Durability {
    /// The page cache's rule: a failed sync fails every later one.
    fn default() -> Self {
        Durability {
            lost: AtomicBool::new(false),
            enforced: true,
        }
    }
}

/// The error every durable request gets once durability is lost.
fn lost_error() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl Durability {
    /// For a backend whose failed syncs are each only their own request's.
    pub fn per_request() -> Durability {
        Durability {
            lost: AtomicBool::new(false),
            enforced: false,
        }
    }

    /// Whether a sync has failed.
    pub fn is_lost(&self) -> bool {
        self.enforced && self.lost.load(Ordering::Acquire)
    }

    /// A sync failed (`why`): every later durable request fails (where the rule is
    /// enforced). Logged the first time.
    pub fn lose(&self, why: &dyn std::fmt::Display) {
        if self.enforced && !self.lost.swap(true, Ordering::AcqRel) {
            error!(
                "a sync failed ({why}): writes may be lost; every FLUSH and FUA request of \
                 this export fails with EIO until it is opened again (reads go on)"
            );
        }
    }

    /// Runs `sync` (something that makes writes durable), unless durability is lost
    /// already; a failure loses it.
    pub fn sync(&self, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        if self.is_lost() {
            return Err(lost_error());
        }
        sync().inspect_err(|e| self.lose(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_sync_fails_every_later_one_even_a_successful_one() {
        let d = Durability::default();
        assert!(d.sync(|| Ok(())).is_ok());
        let err = d.sync(|| Err(io::Error::from_raw_os_error(libc::ENOSPC)));
        assert_eq!(err.unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        assert!(d.is_lost());
        let mut ran = false;
        let later = d.sync(|| {
            ran = true;
            Ok(())
        });
        assert_eq!(later.unwrap_err().raw_os_error(), Some(libc::EIO));
        assert!(!ran, "nothing is claimed durable any more");
    }

    #[test]
    fn per_request_failures_are_only_their_own() {
        let d = Durability::per_request();
        assert!(d
            .sync(|| Err(io::Error::from_raw_os_error(libc::EIO)))
            .is_err());
        assert!(!d.is_lost());
        assert!(d.sync(|| Ok(())).is_ok());
    }
}
