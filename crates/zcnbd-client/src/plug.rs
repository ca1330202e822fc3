//! Holding requests back while a caller submits several, so they leave together: one
//! `sendmsg` for all of them and, under TLS, records filled with several requests rather
//! than one record and one socket call each (Linux's block layer plugs a task's bios the
//! same way). A caller that refills its queue depth after a batch of completions
//! (`zcnbd bench` does) plugs around the refill.

use std::sync::atomic::Ordering;

use crate::client::Client;
use crate::wait::lock;

/// While a `Plug` of a client lives, its submissions (from any thread) are queued without
/// being sent; they go out when the last plug is dropped, or earlier if a thread drives the
/// connections meanwhile ([`Client::complete`], [`Client::poll`] or a blocking call send
/// what is queued, so holding a plug across a wait cannot stall its requests).
#[must_use = "requests are sent when the plug is dropped"]
pub struct Plug<'a> {
    client: &'a Client,
}

impl Client {
    /// Holds submissions back until the returned [`Plug`] is dropped (plugs nest).
    pub fn plug(&self) -> Plug<'_> {
        self.hold();
        Plug { client: self }
    }

    /// Holds submissions back until as many [`Client::release`] calls: the unscoped form
    /// of [`Client::plug`], for callers that cannot keep a guard (the C ABI's
    /// `zcnbd_plug`).
    pub fn hold(&self) {
        self.plugs.fetch_add(1, Ordering::AcqRel);
    }

    /// Ends one [`Client::hold`]: the last sends what was held back. False (and nothing
    /// changes) if nothing was held.
    pub fn release(&self) -> bool {
        let released = self
            .plugs
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        match released {
            Ok(1) => {
                self.send_all_queued();
                true
            }
            Ok(_) => true,
            Err(_) => false,
        }
    }

    fn send_all_queued(&self) {
        for (index, cell) in self.cells.iter().enumerate() {
            let conn = lock(&cell.conn);
            if conn.wants_output() {
                self.send_queued(index, conn);
            }
        }
    }
}

impl Drop for Plug<'_> {
    fn drop(&mut self) {
        self.client.release();
    }
}
