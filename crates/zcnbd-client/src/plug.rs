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
        self.plugs.fetch_add(1, Ordering::AcqRel);
        Plug { client: self }
    }
}

impl Drop for Plug<'_> {
    fn drop(&mut self) {
        let client = self.client;
        if client.plugs.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        for (index, cell) in client.cells.iter().enumerate() {
            let conn = lock(&cell.conn);
            if conn.wants_output() {
                client.send_queued(index, conn);
            }
        }
    }
}
