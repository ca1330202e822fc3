//! A stand-in for the ring, to drive one connection in unit tests: [`FakeDriver`] records
//! what is submitted, lending memory exactly as the real driver does, and the test plays the
//! kernel - filling receives, reading sends, delivering completions - through [`Harness`].

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;
use zcnbd_proto::consts::{transmission_flags, SIMPLE_REPLY_MAGIC};
use zcnbd_proto::{BlockSize, Command, ReplyMode, RequestHeader, TransmissionContext};

use super::super::cx::Cx;
use super::super::key::{ConnKey, Tag};
use super::super::mailbox::{Attach, Inbox, Mailbox};
use super::super::sendfile_trial::SendfileTrial;
use super::super::shared::EngineShared;
use super::Conn;
use crate::buffer_pool::BufferPool;
use crate::dispatch::Dispatcher;
use crate::engine::memory::MemoryBudget;
use crate::engine::options::EngineOptions;
use crate::export::{MemoryBackend, Stack};
use crate::limits::Limits;
use crate::stats::Stats;
use crate::sys::uring::{lend_chain, Cqe, Prepared, Sqe, Submit};
use crate::worker_pool::WorkerPool;

/// Size of the memory export the harness serves.
pub const EXPORT_BYTES: u64 = 1 << 20;

/// Records submissions; while `refuse` is set, lends their memory then gives it back and
/// fails, as a ring whose queue cannot take them.
#[derive(Default)]
pub struct FakeDriver {
    /// Operations submitted and not yet taken by the test, in order.
    pub pending: Vec<(u64, Prepared)>,
    pub refuse: bool,
}

impl Submit for FakeDriver {
    fn submit(&mut self, chain: &mut [Sqe<'_>]) -> io::Result<()> {
        let prepared = lend_chain(chain)?;
        if self.refuse {
            // As the ring does when it cannot queue what was lent.
            chain.iter_mut().for_each(Sqe::unlend);
            return Err(io::Error::other("refused by the test"));
        }
        let user_data = chain.iter().map(|sqe| sqe.user_data);
        self.pending.extend(user_data.zip(prepared));
        Ok(())
    }
}

/// One connection to a memory export, on a fake ring; the other end of its socket is
/// `client`.
pub struct Harness {
    pub conn: Conn,
    pub driver: FakeDriver,
    pub shared: EngineShared,
    pub backend: Arc<MemoryBackend>,
    pub client: UnixStream,
    pub now: Instant,
    /// The ring overlaps (see [`Cx::overlap`]).
    pub overlap: bool,
    /// The ring's large-read trials (see [`Cx::sendfile_trial`]).
    pub sendfile_trial: SendfileTrial,
    mailbox: Mailbox,
    _inbox: Receiver<Inbox>,
    /// The dispatcher's worker pool (it holds the pool weakly).
    _workers: Arc<WorkerPool>,
}

impl Harness {
    /// A started connection (its first receive posted) on an engine with `options`.
    pub fn memory(options: EngineOptions, limits: Limits) -> Harness {
        let (server, client) = UnixStream::pair().expect("socketpair");
        let backend = Arc::new(MemoryBackend::new(EXPORT_BYTES).expect("memory export"));
        let stats = Arc::new(Stats::default());
        let pool = BufferPool::new(1 << 20);
        let ctx = TransmissionContext {
            mode: ReplyMode::Simple,
            size: EXPORT_BYTES,
            flags: transmission_flags::HAS_FLAGS,
            block_size: BlockSize::with_minimum(1),
            meta: zcnbd_proto::meta::MetaSelected::NONE,
        };
        let workers = Arc::new(WorkerPool::new(1).expect("worker pool"));
        let stack = Stack::of(Arc::clone(&backend) as _, false);
        let dispatcher = Dispatcher::new(
            Arc::new(stack),
            ctx,
            Arc::clone(&pool),
            Arc::clone(&stats),
            &workers,
            Vec::new(),
        );
        let memory = Arc::new(MemoryBudget::new(&limits));
        let shared = EngineShared {
            options,
            limits,
            pool,
            stats,
            memory,
        };
        let attach = Attach {
            socket: OwnedFd::from(server),
            tls_feed: None,
            ctx,
            dispatcher: Arc::new(dispatcher),
            leftover: Vec::new(),
            detach: Box::new(()),
        };
        let key = ConnKey {
            slot: 0,
            generation: 1,
        };
        let (mailbox, inbox) = Mailbox::new().expect("mailbox");
        let mut h = Harness {
            conn: Conn::new(key, attach, &shared),
            driver: FakeDriver::default(),
            shared,
            backend,
            client,
            now: Instant::now(),
            overlap: false,
            sendfile_trial: SendfileTrial::default(),
            mailbox,
            _inbox: inbox,
            _workers: workers,
        };
        h.turn(|conn, cx| conn.start(cx));
        h
    }

    /// One turn of the ring: `f` on the connection, then the sends it queued.
    pub fn turn(&mut self, f: impl FnOnce(&mut Conn, &mut Cx<'_>)) {
        let (mut sends, mut parked, mut started) = (Vec::new(), Vec::new(), 0);
        let mut cx = Cx {
            driver: &mut self.driver,
            shared: &self.shared,
            mailbox: &self.mailbox,
            fixed: None,
            sends: &mut sends,
            parked: &mut parked,
            now: self.now,
            started: &mut started,
            overlap: self.overlap,
            sendfile_trial: &mut self.sendfile_trial,
        };
        f(&mut self.conn, &mut cx);
        if !cx.sends.is_empty() {
            self.conn.send_queued(&mut cx);
        }
        // As the ring does after every call on a connection (`thread.rs`).
        self.conn.settle_broken();
    }

    /// Whether an operation tagged `tag` is pending.
    pub fn has_pending(&self, tag: Tag) -> bool {
        self.driver.pending.iter().any(|(ud, _)| tag_of(*ud) == tag)
    }

    /// Takes the first pending operation tagged `tag`: the kernel works on it now.
    pub fn take(&mut self, tag: Tag) -> (u64, Prepared) {
        let pending = &mut self.driver.pending;
        let Some(i) = pending.iter().position(|(ud, _)| tag_of(*ud) == tag) else {
            panic!("no {tag:?} pending: {pending:?}");
        };
        pending.remove(i)
    }

    /// Delivers `cqe`.
    pub fn deliver(&mut self, cqe: Cqe) {
        let (_, tag, index) = ConnKey::unpack_op(cqe.user_data);
        let tag = tag.expect("a connection's operation");
        self.turn(|conn, cx| conn.on_completion(cx, tag, index, cqe));
    }

    /// Delivers the last completion of `user_data`, with `result`.
    pub fn complete(&mut self, user_data: u64, result: i32) {
        self.deliver(Cqe {
            user_data,
            result,
            more: false,
            notification: false,
            sock_nonempty: false,
        });
    }

    /// The client's `bytes` arrive: the posted receive takes what fits and completes with
    /// that count (saying whether bytes were left in the socket), which is returned.
    pub fn client_sends(&mut self, bytes: &[u8]) -> usize {
        let (user_data, recv) = self.take(Tag::Recv);
        let n = recv.fill(bytes);
        self.deliver(Cqe {
            user_data,
            result: n as i32,
            more: false,
            notification: false,
            sock_nonempty: n < bytes.len(),
        });
        n
    }

    /// Takes the send in flight: its `user_data` and the bytes it would send.
    pub fn sent(&mut self) -> (u64, Vec<u8>) {
        let (user_data, send) = self.take(Tag::Send);
        (user_data, send.bytes())
    }

    /// The value of the counter `name`.
    pub fn counter(&self, name: &str) -> u64 {
        let snapshot = self.shared.stats.snapshot();
        let found = snapshot.iter().find(|(n, _, _)| *n == name);
        found.map(|c| c.2).expect("a counter of that name")
    }
}

fn tag_of(user_data: u64) -> Tag {
    ConnKey::unpack_op(user_data)
        .1
        .expect("a connection's operation")
}

/// A compact request header.
pub fn request(command: Command, cookie: u64, offset: u64, length: u64) -> Vec<u8> {
    let header = RequestHeader {
        flags: 0,
        kind: command.to_wire(),
        cookie,
        offset,
        length,
    };
    let mut out = Vec::new();
    header.encode(ReplyMode::Simple, &mut out);
    out
}

/// A successful simple reply's header.
pub fn simple_reply(cookie: u64) -> Vec<u8> {
    let mut out = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out
}
