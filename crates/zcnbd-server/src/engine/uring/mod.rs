//! The io_uring engine: thread-per-core rings that run the transmission phase of every
//! connection handed to them after the (blocking, portable) handshake.
//!
//! Safe code: it reaches the kernel only through the driver, `crate::sys::uring`, which
//! owns the ring and is the only way to submit an operation. Here: the engine handle (this
//! file), what the rings share (`shared.rs`), their mailboxes (`mailbox.rs`), the ring
//! thread's loop (`thread.rs`), what a connection gets from its ring for one event (`cx.rs`),
//! what a completion's `user_data` names (`key.rs`), one connection (`conn/`), the choice of
//! mechanism per request (`mechanism.rs`), the trials that choose how large reads go to
//! clients on other hosts (`sendfile_trial.rs`) and a kTLS connection's request feed
//! (`tls_feed.rs`).
//!
//! What it does per request, by data path (`--data-path`):
//!
//! | request | `zerocopy` | `auto` (default) | `copy` (the classic path) |
//! | --- | --- | --- | --- |
//! | read, memory export | header by `send(MSG_MORE)`, payload by `sendfile` from the memfd, both on the ring thread (nonblocking socket; a `POLL_ADD` resumes a reply the socket could not take whole) | one `sendmsg` of header + payload straight from the memfd mapping (`sendfile` at or above `--splice-min-bytes`; not given, reads of 256 KiB or more to a client on another host go by `sendfile` or from the mapping as the ring's trials find pays, `sendfile_trial.rs`) | `read` into a buffer, then `sendmsg` |
//! | read, buffered file | spliced page cache → pipe → socket in one linked chain of `SPLICE`s (io-wq: a page-cache miss may block) | `read` into a buffer, then `sendmsg` (splice at or above `--splice-min-bytes`) | same |
//! | read, O_DIRECT file | `READ_FIXED` into a registered run (header written just before the data), then one `SEND_ZC` of header + data from it; the run returns to its ring's region only on the notification; plain sends once the kernel reports it copied. No free run: `read` into a pooled buffer and `SENDMSG_ZC` | the same, zero-copy sends at or above `--zerocopy-send-min-bytes` | `read`, then plain `sendmsg` |
//! | read, piped source (plain HTTP, NBD upstream) | the body waits in a pipe of its own (a worker or the client library spliced it there); header by `send(MSG_MORE)`, then the pipe spliced to the socket and the pipe's overflow (tail) sent, all on the ring thread (nonblocking socket; a `POLL_ADD` resumes); under kTLS, whose socket stays blocking, one linked chain of io_uring `SPLICE`s (io-wq) | the same (an NBD upstream's reads from `--splice-min-bytes`: by default 256 KiB to a client on another host, never on this host) | read into a buffer, then `sendmsg` |
//! | write, memory export | payload received straight into the memfd mapping at its offset | in place (at most `--receive-in-place-max-bytes` when given; longer ones through a buffer) | received into a buffer, then copied into the mapping |
//! | write, O_DIRECT file | received into a registered run, one `WRITE_FIXED` (`RWF_DSYNC` for FUA); no free run: as a buffered file | same | as a buffered file |
//! | write, buffered file | received into a buffer, one `write` (`RWF_DSYNC` for FUA) | same | same |
//! | other commands, sparse reads, null export, asynchronous backends | the engine-independent dispatcher runs them (a blocking backend on the worker pool); the reply comes back to the ring | same | same |
//!
//! The `auto` defaults follow measurements on this project's 2-vCPU loopback VMs
//! (docs/benchmarks/history.md): sending from the mapping beat both splice and the bounce buffer in
//! MiB/s at every read size (`sendfile` needs a third of the server's CPU per GiB at 1 MiB,
//! but the client on the same CPUs needs more to receive it); receiving in place beat the
//! bounce buffer only for small writes.
//!
//! After 16 payload-less requests in a row, one receive takes up to 16 request headers;
//! after a write it takes one exact header again, so payloads still land in place - except
//! after a small write (at most 16 KiB) to a memory export, when the next receive takes the
//! header with up to 16 KiB more, or whatever has arrived (up to 64 KiB) while the client
//! pipelines, and small payloads are copied from there: one receive per request, not two.
//! The replies a ring turn produces for a connection leave together at the end of the turn,
//! in one send (at most 64 replies or 256 KiB of data), before the connection's next
//! receive is posted; submissions from all connections of a thread go to the kernel in one
//! `io_uring_enter`.
//!
//! vsock connections (Linux 6.1, `tests/vm/guest.d/60-vsock.sh`) take `sendfile`, spliced
//! reads and in-place receives as TCP does, but two mechanisms step aside, found out when the
//! connection attaches: spliced writes, which need `FIONREAD` (vsock answers `EOPNOTSUPP`),
//! and `MSG_WAITALL` payload receives (vsock fails them with `ENOMEM` from its receive
//! buffer's size up; the payload is received as it comes). Zero-copy sends meet the
//! `EOPNOTSUPP` fallback Unix sockets already take (not exercised on vsock: the guest's
//! tmpfs has no O_DIRECT).

mod conn;
mod cx;
mod key;
mod mailbox;
pub mod mechanism;
mod sendfile_trial;
mod shared;
mod thread;
pub mod tls_feed;

use std::any::Any;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tracing::warn;
use zcnbd_proto::TransmissionContext;

use super::{Attachment, Engine};
use crate::dispatch::Dispatcher;
use crate::session::channel::Channel;
use crate::stream::Stream;
use mailbox::{Attach, Inbox, Mailbox};

pub use shared::EngineShared;

/// The running engine: one ring thread per CPU.
pub struct UringEngine {
    rings: Vec<Mailbox>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next: AtomicUsize,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("rings", &self.rings.len())
            .finish()
    }
}

impl UringEngine {
    /// Starts the ring threads; fails if io_uring or an opcode the engine needs is missing.
    pub fn start(shared: EngineShared) -> io::Result<UringEngine> {
        let count = match shared.options.ring_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let mut rings = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for i in 0..count {
            let (mailbox, handle) = thread::spawn(i, shared.clone())?;
            rings.push(mailbox);
            threads.push(handle);
        }
        Ok(UringEngine {
            rings,
            threads: Mutex::new(threads),
            next: AtomicUsize::new(0),
        })
    }

    /// Hands one connection's transmission phase to a ring and returns at once: no thread
    /// waits for the connection. Requests are received from `tls_feed` if given (a kTLS
    /// connection's, decrypted by its feed thread), else from `stream`; replies are sent on
    /// `stream`. `detach` is dropped (on the ring thread) once the connection is closed.
    fn hand_over(&self, stream: Stream, tls_feed: Option<OwnedFd>, conn: Taken) {
        let socket = match stream {
            Stream::Tcp(s) => OwnedFd::from(s),
            Stream::Unix(s) => OwnedFd::from(s),
            Stream::Vsock(s) => OwnedFd::from(s),
        };
        let attach = Attach {
            socket,
            tls_feed,
            ctx: conn.ctx,
            dispatcher: Arc::new(conn.dispatcher),
            leftover: conn.leftover,
            detach: conn.detach,
        };
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len();
        // A ring that already stopped drops the message, and with it the socket and guard.
        self.rings[index].send(Inbox::Attach(Box::new(attach)));
    }

    /// Stops the rings once their connections are closed, and waits for them.
    fn stop_rings(&self) {
        for mailbox in &self.rings {
            mailbox.send(Inbox::Stop);
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for handle in threads {
            let _ = handle.join();
        }
    }
}

/// What a ring takes of an [`Attachment`] besides its socket.
struct Taken {
    ctx: TransmissionContext,
    dispatcher: Dispatcher,
    leftover: Vec<u8>,
    detach: Box<dyn Any + Send>,
}

impl Engine for UringEngine {
    /// Plain connections, and kTLS ones (the kernel encrypts what the ring sends; a feed
    /// thread decrypts the requests for it); a TLS session whose records are made in user
    /// space is given back (the ring sends plain bytes only).
    fn attach(&self, conn: Attachment) -> Result<(), Box<Attachment>> {
        let Attachment {
            peer,
            channel,
            ctx,
            dispatcher,
            leftover,
            detach,
        } = conn;
        let taken = Taken {
            ctx,
            dispatcher,
            leftover,
            detach,
        };
        match channel {
            Channel::Plain(stream) => self.hand_over(stream, None, taken),
            Channel::Tls(halves) if halves.kernel_sends() => {
                let (stream, reader, tally) = halves.into_kernel_parts();
                match tls_feed::start(reader, tally, &peer) {
                    Ok(feed) => self.hand_over(stream, Some(feed), taken),
                    // Dropping the connection closes it.
                    Err(e) => warn!(%peer, "cannot start the TLS feed thread: {e}"),
                }
            }
            channel => {
                return Err(Box::new(Attachment {
                    peer,
                    channel,
                    ctx: taken.ctx,
                    dispatcher: taken.dispatcher,
                    leftover: taken.leftover,
                    detach: taken.detach,
                }))
            }
        }
        Ok(())
    }

    fn stop(&self) {
        self.stop_rings();
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.stop_rings();
    }
}
