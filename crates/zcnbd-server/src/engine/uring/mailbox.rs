//! Messages to a ring thread (a connection to serve, a reply the dispatcher finished, stop)
//! and its mailbox: a channel plus an eventfd the ring keeps a read posted on.

use std::any::Any;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use rustix::event::{eventfd, EventfdFlags};
use zcnbd_proto::TransmissionContext;

use crate::dispatch::{Dispatcher, Reply};

/// Messages to a ring thread.
pub(super) enum Inbox {
    /// Serve this connection; drop its `detach` guard when it is closed.
    Attach(Box<Attach>),
    /// A request the dispatcher ran for connection `key` is answered; it held `held` bytes
    /// of the connection's budget.
    Answered { key: u64, reply: Reply, held: usize },
    /// Exit once no connection is left.
    Stop,
}

pub(super) struct Attach {
    pub socket: OwnedFd,
    /// A kTLS connection's requests in plain text, from its TLS feed thread
    /// (`tls_feed.rs`); replies still go to `socket`, where the kernel encrypts them.
    pub tls_feed: Option<OwnedFd>,
    pub ctx: TransmissionContext,
    pub dispatcher: Arc<Dispatcher>,
    /// Request bytes that arrived with the handshake's last option: the first requests.
    pub leftover: Vec<u8>,
    /// Whatever the server keeps for the attached client (its admission ticket, its entry
    /// among the live sockets), given back by dropping it once the connection is closed.
    pub detach: Box<dyn Any + Send>,
}

/// A ring thread's mailbox: a channel plus an eventfd the ring keeps a read posted on.
#[derive(Clone)]
pub(super) struct Mailbox {
    sender: Sender<Inbox>,
    pub wake: Arc<OwnedFd>,
}

impl Mailbox {
    /// A mailbox and the receiving end of its channel.
    pub fn new() -> io::Result<(Mailbox, Receiver<Inbox>)> {
        let (sender, inbox) = crossbeam_channel::unbounded();
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        Ok((Mailbox { sender, wake }, inbox))
    }

    pub fn send(&self, message: Inbox) {
        if self.sender.send(message).is_ok() {
            self.wake();
        }
    }

    /// Wakes the ring without a message (it runs a turn).
    pub fn wake(&self) {
        // A failed write means the counter is saturated, which already wakes the ring.
        let _ = rustix::io::write(self.wake.as_fd(), &1u64.to_ne_bytes());
    }
}
