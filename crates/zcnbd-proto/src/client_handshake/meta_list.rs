//! `NBD_OPT_LIST_META_CONTEXT` on the client side: which contexts the server has under the
//! queries given to [`ClientHandshake::with_meta_list`] (namespaces such as `qemu:`), so that
//! the `NBD_OPT_SET_META_CONTEXT` that follows selects them by their exact names.
//!
//! A server's listing is bounded twice: the names kept (with the names asked for by name, at
//! most [`META_CONTEXT_QUERIES_MAX`] besides `base:allocation`: what one selection may ask
//! for), the rest only counted ([`ClientNegotiated::meta_left_out`]); and the replies taken
//! (at most [`META_CONTEXT_LIST_REPLIES_MAX`]), past which the listing is hostile and ends
//! the handshake. Memory never grows with what the server sends.
//!
//! [`ClientNegotiated::meta_left_out`]: crate::ClientNegotiated::meta_left_out

use super::{unexpected, ClientHandshake, ClientHandshakeError, Step};
use crate::client_meta::{MetaQueries, META_CONTEXT_LIST_REPLIES_MAX, META_CONTEXT_QUERIES_MAX};
use crate::client_option::{check_ack, parse_meta_context, OptionReply};
use crate::consts::{rep, BASE_ALLOCATION};

impl Listing {
    /// The queries of the `NBD_OPT_SET_META_CONTEXT` to send: `base:allocation` if
    /// `base_allocation` or listed, the names in `meta`, then those listed; each once.
    pub(super) fn set_queries<'a>(
        &'a self,
        base_allocation: bool,
        meta: &'a MetaQueries,
    ) -> Vec<&'a str> {
        let listed = &self.names;
        let base_listed = listed.iter().any(|n| n == BASE_ALLOCATION);
        let base = (base_allocation || base_listed) && !meta.contains(BASE_ALLOCATION);
        let mut queries: Vec<&str> = base.then_some(BASE_ALLOCATION).into_iter().collect();
        queries.extend(meta.names());
        let more = listed.iter().map(String::as_str);
        queries.extend(more.filter(|n| *n != BASE_ALLOCATION));
        queries
    }
}

/// What the listing in flight found so far, and what it gave once acknowledged.
#[derive(Debug, Default)]
pub(super) struct Listing {
    /// Names found under the queries that the selection will ask for, in the server's order;
    /// `base:allocation` included (it does not count against the room).
    pub(super) pending: Vec<String>,
    /// Names the listing found that do not fit the selection, or cannot be selected.
    pub(super) pending_left_out: u32,
    /// The acknowledged listing's names.
    pub(super) names: Vec<String>,
    /// The acknowledged listing's names left out.
    pub(super) left_out: u32,
}

impl ClientHandshake {
    /// Also lists the contexts `queries` name (`NBD_OPT_LIST_META_CONTEXT`; a query may be a
    /// namespace such as `qemu:` or `base:`, whose contexts a server lists, though only exact
    /// names select), then asks for every context listed with `NBD_OPT_SET_META_CONTEXT`,
    /// after those [`ClientHandshake::with_meta_contexts`] names. Only as many are kept as
    /// one selection may ask for ([`META_CONTEXT_QUERIES_MAX`] besides `base:allocation`,
    /// names asked for by name first); the rest are counted in
    /// [`ClientNegotiated::meta_left_out`](crate::ClientNegotiated::meta_left_out). A server
    /// that refuses the listing (an error reply) is asked for the named contexts alone.
    pub fn with_meta_list(mut self, queries: MetaQueries) -> Self {
        self.list = queries;
        self
    }

    /// The most replies the option in flight may have.
    pub(super) fn replies_max(&self, step: Step) -> u32 {
        match step {
            Step::ListMetaContext => self
                .opts
                .option_replies_max
                .max(META_CONTEXT_LIST_REPLIES_MAX),
            _ => self.opts.option_replies_max,
        }
    }

    /// A reply to `NBD_OPT_LIST_META_CONTEXT`.
    pub(super) fn on_list_reply(
        &mut self,
        reply: OptionReply<'_>,
    ) -> Result<(), ClientHandshakeError> {
        match reply.kind {
            rep::META_CONTEXT => return self.on_listed_context(reply.data),
            rep::ACK => {
                check_ack(reply)?;
                self.listing.names = std::mem::take(&mut self.listing.pending);
                self.listing.left_out = self.listing.pending_left_out;
            }
            // "If an error is returned, the client MUST disregard any context replies that may
            // have been sent": the contexts asked for by name are still asked for.
            kind if rep::is_error(kind) => self.listing.pending.clear(),
            kind => return Err(unexpected(Step::ListMetaContext, kind)),
        }
        self.listing.pending_left_out = 0;
        self.send(Step::SetMetaContext);
        Ok(())
    }

    /// One `NBD_REP_META_CONTEXT` of a listing: its id "is not meaningful" here; its name is
    /// kept if it can be selected, is new, and there is room.
    fn on_listed_context(&mut self, data: &[u8]) -> Result<(), ClientHandshakeError> {
        let (_id, name) = parse_meta_context(data)?;
        let Some(name) = selectable(name) else {
            self.listing.pending_left_out = self.listing.pending_left_out.saturating_add(1);
            return Ok(());
        };
        let pending = &self.listing.pending;
        if self.meta.contains(name) || pending.iter().any(|n| n == name) {
            return Ok(());
        }
        let taken = self.meta.names().filter(|n| *n != BASE_ALLOCATION).count()
            + pending.iter().filter(|n| *n != BASE_ALLOCATION).count();
        if name != BASE_ALLOCATION && taken >= META_CONTEXT_QUERIES_MAX {
            self.listing.pending_left_out = self.listing.pending_left_out.saturating_add(1);
            return Ok(());
        }
        self.listing.pending.push(name.to_owned());
        Ok(())
    }
}

/// `name` if a `NBD_OPT_SET_META_CONTEXT` can ask for it: UTF-8 (a name "MUST be valid UTF-8
/// data"), `namespace:leaf` with neither empty, no NUL. A listing "may include wildcards that
/// require a further NBD_OPT_LIST_META_CONTEXT", such as `qemu:dirty-bitmap:`: those end in a
/// colon, and are not selected.
fn selectable(name: &[u8]) -> Option<&str> {
    let name = std::str::from_utf8(name).ok()?;
    let (namespace, leaf) = name.split_once(':')?;
    let whole = !namespace.is_empty() && !leaf.is_empty() && !name.ends_with(':');
    (whole && !name.contains('\0')).then_some(name)
}
