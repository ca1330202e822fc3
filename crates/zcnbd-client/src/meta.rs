//! Metadata contexts: which the server selected, and block status for each of them
//! (`base:allocation`, `qemu:allocation-depth`, `qemu:dirty-bitmap:NAME`, ...).
//!
//! Every connection of a client selects the same contexts by name; their ids are the
//! server's, per connection, so each connection routes the chunks of a reply to the client's
//! context by the id that connection was given (`conn.rs`).

use zcnbd_proto::consts::BASE_ALLOCATION;
use zcnbd_proto::{Extent, MetaContext, ReplyFailure};

use crate::client::Client;
use crate::conn::Completed;
use crate::error::{Error, Result};
use crate::plan;

/// `NBD_EIO`, for a reply that lacks a context it owed.
const NBD_EIO: u32 = 5;

impl Client {
    /// The metadata contexts the server selected, each with the id it gave it (on the first
    /// connection: ids are per connection). A context asked for and not listed is one the
    /// server does not have.
    pub fn meta_contexts(&self) -> &[MetaContext] {
        &self.meta_contexts
    }

    /// How many contexts the server listed (for
    /// [`ClientOptions::list_meta_contexts`](crate::ClientOptions::list_meta_contexts)) that
    /// were not asked for: more than one selection may ask for, or names no selection can
    /// name (wildcards, malformed).
    pub fn meta_contexts_left_out(&self) -> u32 {
        self.meta_left_out
    }

    /// Whether the server selected the metadata context `name`.
    pub fn has_meta_context(&self, name: &str) -> bool {
        self.context_index(name).is_some()
    }

    /// The `base:allocation` extents from `offset` (`state::HOLE`, `state::ZERO` flags). The
    /// server may describe less than `length`, or a little more.
    pub fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>> {
        if !self.geometry().base_allocation {
            return Err(Error::Unsupported("base:allocation was not negotiated"));
        }
        self.block_status_of(BASE_ALLOCATION, offset, length)
    }

    /// The extents of metadata context `name` from `offset`, with flags meaning what that
    /// context says (`qemu:dirty-bitmap:NAME`: bit 0 dirty; `qemu:allocation-depth`: the
    /// layer of the backing chain, 0 unallocated). The server may describe less than
    /// `length`, or a little more. One request: its reply carries a chunk for every context
    /// selected, and this one's is picked by its id.
    pub fn block_status_of(&self, name: &str, offset: u64, length: u64) -> Result<Vec<Extent>> {
        let Some(index) = self.context_index(name) else {
            return Err(Error::Unsupported(
                "the metadata context was not negotiated",
            ));
        };
        let done = self.status_request(offset, length)?;
        if length == 0 {
            return Ok(Vec::new());
        }
        take_extents_of(done, index)
    }

    /// The extents of every metadata context selected from `offset`, from one request: one
    /// list per context of [`Client::meta_contexts`], in that order.
    pub fn block_status_all(&self, offset: u64, length: u64) -> Result<Vec<Vec<Extent>>> {
        if self.meta_contexts.is_empty() {
            return Err(Error::Unsupported("no metadata context was negotiated"));
        }
        let done = self.status_request(offset, length)?;
        if length == 0 {
            return Ok(vec![Vec::new(); self.meta_contexts.len()]);
        }
        (0..self.meta_contexts.len())
            .map(|index| {
                let extents = done.extents_of(index).ok_or_else(|| missing(index))?;
                Ok(extents.to_vec())
            })
            .collect()
    }

    pub(crate) fn context_index(&self, name: &str) -> Option<usize> {
        self.meta_contexts.iter().position(|c| c.name == name)
    }

    /// One block status request (none for an empty range), waited for.
    fn status_request(&self, offset: u64, length: u64) -> Result<Completed> {
        let parts = plan::block_status(self.geometry(), offset, length, 0)?;
        self.blocking(parts)
    }
}

/// The extents of context `index` in `done`, moved out when they are all there is.
pub(crate) fn take_extents_of(mut done: Completed, index: usize) -> Result<Vec<Extent>> {
    if let [run] = &done.contexts[..] {
        if run.context == index && run.extents == (0..done.extents.len()) {
            return Ok(std::mem::take(&mut done.extents));
        }
    }
    let extents = done.extents_of(index).ok_or_else(|| missing(index))?;
    Ok(extents.to_vec())
}

/// A successful reply without the context's chunk: the session refuses those ("exactly one
/// status chunk per negotiated metadata context ID"), so this is only a safety net.
fn missing(index: usize) -> Error {
    Error::Server(ReplyFailure {
        errno: NBD_EIO,
        message: format!("no block status for metadata context {index}"),
        offset: None,
    })
}
