//! Whether an export can still promise durability. After a failed `fdatasync` the kernel may
//! have dropped the dirty pages it could not write, and the next `fdatasync` returns 0 for
//! them (the error is reported once per file description): a later FLUSH would acknowledge
//! writes that are lost. So, as QEMU's file-posix does, the first failed sync of an export
//! (a FLUSH, or a FUA write, trim or zero, however it was made durable) fails every later
//! FLUSH and FUA request of that export with EIO until it is opened again; reads and plain
//! writes go on. Logged once, when it happens.
//!
//! A backend that keeps its descriptors across a reload of `--config` (a file, a disk image)
//! owns its [`Durability`] and answers it ([`Backend::durability`](super::Backend)), so a
//! reload does not forget a failure; the stack makes one for the others.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::error;

/// Whether every sync of an export has succeeded so far.
#[derive(Debug, Default)]
pub struct Durability {
    lost: AtomicBool,
}

/// The error every durable request gets once durability is lost.
fn lost_error() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl Durability {
    /// Whether a sync has failed.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// A sync failed (`why`): every later durable request fails. Logged the first time.
    pub fn lose(&self, why: &dyn std::fmt::Display) {
        if !self.lost.swap(true, Ordering::AcqRel) {
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
}
