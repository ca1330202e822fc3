//! Where a request's reply goes: the engine's half of [`Dispatcher::start`]
//! (the portable engine queues it for the connection's writer, the io_uring engine posts it
//! to the ring's mailbox). It is given exactly one reply, whatever happens on the way.
//!
//! [`Dispatcher::start`]: super::Dispatcher::start

use std::fmt;

use tracing::error;
use zcnbd_proto::{Errno, ReplyMode, RequestHeader};

use super::{error_reply, Failure, Reply};

/// What the engine does with the reply.
type Deliver = Box<dyn FnOnce(Reply) + Send>;

/// Takes one request's reply to its engine. Dropped without a reply (a job lost with the
/// worker pool, a panic while the reply was laid out, a completion lost with it), it
/// delivers an `EIO` error reply instead, so the engine always hears back about every
/// request it started and releases what the request holds.
pub struct ReplySink {
    deliver: Option<Deliver>,
    mode: ReplyMode,
    header: RequestHeader,
}

impl ReplySink {
    /// A sink for the reply to `header`, on a connection that replies in `mode`.
    pub(super) fn new(
        mode: ReplyMode,
        header: RequestHeader,
        deliver: impl FnOnce(Reply) + Send + 'static,
    ) -> Self {
        ReplySink {
            deliver: Some(Box::new(deliver)),
            mode,
            header,
        }
    }

    /// The request's cookie, for logs.
    pub(super) fn cookie(&self) -> u64 {
        self.header.cookie
    }

    /// Delivers the reply.
    pub(super) fn send(mut self, reply: Reply) {
        if let Some(deliver) = self.deliver.take() {
            deliver(reply);
        }
    }

    /// Delivers an error reply.
    pub(super) fn fail(self, (errno, message): Failure) {
        let reply = error_reply(self.mode, &self.header, errno, &message);
        self.send(reply);
    }
}

impl Drop for ReplySink {
    fn drop(&mut self) {
        if let Some(deliver) = self.deliver.take() {
            error!(
                cookie = self.header.cookie,
                "a request's reply was lost: answering EIO"
            );
            deliver(error_reply(
                self.mode,
                &self.header,
                Errno::Io,
                "internal server error",
            ));
        }
    }
}

impl fmt::Debug for ReplySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplySink")
            .field("cookie", &self.header.cookie)
            .field("pending", &self.deliver.is_some())
            .finish()
    }
}
