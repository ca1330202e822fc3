//! The send side of a connection: the outbox of replies and the send in flight, the pipe
//! spliced replies pass through, and which send mechanisms still work on this socket.

use super::outbox::{Outbox, Sending};
use super::pipe::Pipe;
use crate::policy::mechanism;
use crate::policy::EngineOptions;

/// Everything a connection needs to send replies.
pub(super) struct SendSide {
    pub outbox: Outbox,
    /// The pipe spliced replies pass through (created on the first).
    pub pipe: Option<Pipe>,
    /// Zero-copy sends still worth trying (false once the kernel reported copying).
    pub zerocopy_ok: bool,
    /// The socket is nonblocking, so the ring thread may `sendfile` replies itself.
    pub sendfile_ok: bool,
}

impl SendSide {
    pub fn new(sendfile_ok: bool, zerocopy_ok: bool) -> SendSide {
        SendSide {
            outbox: Outbox::default(),
            pipe: None,
            zerocopy_ok,
            sendfile_ok,
        }
    }

    /// Whether a send is in flight.
    pub fn is_sending(&self) -> bool {
        self.outbox.current.is_some()
    }

    /// Whether replies wait and no send is in flight to carry them.
    pub fn has_idle_replies(&self) -> bool {
        !self.is_sending() && !self.outbox.queue.is_empty()
    }

    /// Whether the send in flight is a `sendfile` reply.
    pub fn is_sendfile(&self) -> bool {
        matches!(self.outbox.current, Some(Sending::Sendfile(_)))
    }

    /// Whether zero-copy sends are used for the next reply on this data path.
    pub fn zerocopy_pays(&self, options: &EngineOptions) -> bool {
        let Some(front) = self.outbox.queue.front() else {
            return false;
        };
        self.zerocopy_ok && mechanism::zerocopy_send_pays(options, front.data_bytes())
    }
}
