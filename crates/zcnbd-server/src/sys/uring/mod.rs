//! The io_uring driver: the one place the engine (`crate::uring`) reaches the kernel's ring,
//! and the only code of the engine that needs `unsafe`.
//!
//! What it owns:
//! - [`Ring`] (`ring.rs`): one thread's io_uring - built and probed, its own wake-up read and
//!   timer, its registered region (`fixed/`), one `io_uring_enter` per turn, completions
//!   reaped into [`Cqe`]s.
//! - The submission API (`op.rs`, `prepared.rs`): a connection describes each operation
//!   ([`Op`], in a [`Sqe`]) naming its memory by the [`Lent`] that holds it, and submits it
//!   through [`Submit`] (`Submitter` on a real ring, a recording stand-in in tests). Only
//!   the driver lends that memory (after checking the range is inside it), turns it into
//!   addresses and pushes the entries; it takes the loans back if the push fails.
//! - The memory operations point at (`memory.rs`: [`IoBuf`], [`Dest`], [`RecvMem`]; a
//!   send's iovecs and items, `msg_send.rs`: [`MsgSend`]), and [`Lent`] itself (`lent.rs`).
//!
//! The invariant the `unsafe` rests on: every address the kernel gets points into memory
//! held by a [`Lent`] that was lent to that operation, and a [`Lent`] neither frees, moves
//! nor hands out that memory until [`Lent::complete`] has been called once per loan - which
//! the connection does from each operation's last completion (for a zero-copy send, its
//! notification). The connection is freed only once none of its operations is in flight, so
//! the descriptors the operations name stay open.

mod fixed;
mod lent;
mod memory;
mod msg_send;
mod op;
mod prepared;
mod ring;

pub use fixed::{FixedBuf, FixedPool};
pub use lent::Lent;
pub use memory::{Dest, IoBuf, RecvMem};
pub use msg_send::{MsgSend, Wire, WirePiece};
#[cfg(test)]
pub use op::lend_chain;
pub use op::{Op, Sqe, Submit};
pub use prepared::Cqe;
#[cfg(test)]
pub use prepared::Prepared;
pub use ring::{Reaped, Ring};
