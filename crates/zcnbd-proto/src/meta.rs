//! Metadata contexts (`NBD_OPT_{LIST,SET}_META_CONTEXT`, `NBD_CMD_BLOCK_STATUS`): which an
//! export offers, which a query names, and which a client selected.
//!
//! An export's contexts are numbered: 0 is `base:allocation`, which every export offers, and
//! 1.. are the export's own ([`ExportInfo::meta_contexts`], e.g. `qemu:allocation-depth`).
//! The id a `NBD_OPT_SET_META_CONTEXT` reply gives a context, and block status chunks carry,
//! is its number plus one (so `base:allocation` keeps [`BASE_ALLOCATION_ID`]).
//!
//! [`BASE_ALLOCATION_ID`]: crate::handshake::BASE_ALLOCATION_ID

use crate::consts::BASE_ALLOCATION;
use crate::types::ExportInfo;

/// Most contexts one export offers, `base:allocation` included (the selection is a bitmask).
/// An export with more offers the first ones; the server says so when it builds the export.
pub const META_CONTEXTS_MAX: usize = 32;

/// `qemu:allocation-depth` (QEMU's `qemu-nbd -A`): for each extent, the layer of a backing
/// chain that holds it (0 unallocated, 1 the top image, 2 its backing file, ...).
pub const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";

/// The prefix of QEMU's dirty bitmap contexts, `qemu:dirty-bitmap:NAME`.
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";

/// The contexts a client selected for its export, by number (bit `n`: context `n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetaSelected(u32);

impl MetaSelected {
    /// Nothing selected.
    pub const NONE: MetaSelected = MetaSelected(0);
    /// Only `base:allocation`.
    pub const BASE_ALLOCATION: MetaSelected = MetaSelected(1);

    /// Whether nothing is selected (block status is then refused).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether context `number` is selected.
    pub fn contains(self, number: usize) -> bool {
        number < META_CONTEXTS_MAX && self.0 & (1 << number) != 0
    }

    /// Whether any context but `base:allocation` is selected.
    pub fn has_export_contexts(self) -> bool {
        self.0 & !1 != 0
    }

    fn with(self, number: usize) -> MetaSelected {
        debug_assert!(number < META_CONTEXTS_MAX);
        MetaSelected(self.0 | 1 << number)
    }

    /// The selected contexts in order: (id on the wire, number).
    pub fn ids(self) -> impl Iterator<Item = (u32, usize)> {
        (0..META_CONTEXTS_MAX)
            .filter(move |&n| self.contains(n))
            .map(|n| (context_id(n), n))
    }

    /// How many are selected.
    pub fn count(self) -> usize {
        self.0.count_ones() as usize
    }
}

/// The id of context `number`.
pub fn context_id(number: usize) -> u32 {
    number as u32 + 1
}

/// The name of context `number` of `export` (0: `base:allocation`).
pub fn context_name(export: &ExportInfo, number: usize) -> Option<&str> {
    match number {
        0 => Some(BASE_ALLOCATION),
        n if n < META_CONTEXTS_MAX => export.meta_contexts.get(n - 1).map(String::as_str),
        _ => None,
    }
}

/// The contexts `export` offers, numbered.
pub(crate) fn offered(export: &ExportInfo) -> impl Iterator<Item = (usize, &str)> {
    (0..META_CONTEXTS_MAX).map_while(move |n| context_name(export, n).map(|name| (n, name)))
}

/// Whether `query` names context `name`. A `NBD_OPT_SET_META_CONTEXT` query must name it
/// exactly; a `NBD_OPT_LIST_META_CONTEXT` query may also end in ':' and name every context
/// under it: a namespace (`base:` - which the spec says a server MUST support - or `qemu:`)
/// or, as QEMU has it, `qemu:dirty-bitmap:` for every bitmap.
pub(crate) fn query_names(query: &[u8], name: &str, listing: bool) -> bool {
    let name = name.as_bytes();
    if query == name {
        return true;
    }
    listing && query.last() == Some(&b':') && name.starts_with(query)
}

/// The contexts of `export` that `queries` name (all of them for a listing with none, as
/// "the server MUST return all the metadata contexts" then).
pub(crate) fn select(export: &ExportInfo, queries: &[&[u8]], listing: bool) -> MetaSelected {
    let mut selected = MetaSelected::NONE;
    for (n, name) in offered(export) {
        let named = if listing && queries.is_empty() {
            true
        } else {
            queries.iter().any(|q| query_names(q, name, listing))
        };
        if named {
            selected = selected.with(n);
        }
    }
    selected
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BlockSize;

    fn export(extra: &[&str]) -> ExportInfo {
        ExportInfo {
            name: "e".into(),
            description: String::new(),
            size: 1 << 20,
            flags: 1,
            block_size: BlockSize::default(),
            tls_only: false,
            meta_contexts: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn set_needs_exact_names() {
        let e = export(&[ALLOCATION_DEPTH, "qemu:dirty-bitmap:b0"]);
        let q: [&[u8]; 2] = [b"qemu:", b"qemu:dirty-bitmap:"];
        assert!(select(&e, &q, false).is_empty());
        let q: [&[u8]; 2] = [b"qemu:allocation-depth", b"base:allocation"];
        let s = select(&e, &q, false);
        assert_eq!(s.ids().collect::<Vec<_>>(), [(1, 0), (2, 1)]);
        assert!(s.has_export_contexts());
    }

    #[test]
    fn listing_takes_namespaces_and_the_bitmap_prefix() {
        let e = export(&[
            ALLOCATION_DEPTH,
            "qemu:dirty-bitmap:b0",
            "qemu:dirty-bitmap:b1",
        ]);
        assert_eq!(select(&e, &[], true).count(), 4);
        assert_eq!(select(&e, &[b"base:"], true), MetaSelected::BASE_ALLOCATION);
        assert_eq!(select(&e, &[b"qemu:"], true).count(), 3);
        let bitmaps = select(&e, &[b"qemu:dirty-bitmap:"], true);
        assert_eq!(bitmaps.ids().map(|(_, n)| n).collect::<Vec<_>>(), [2, 3]);
        assert!(select(&e, &[b"qemu"], true).is_empty());
        assert!(select(&e, &[b"other:"], true).is_empty());
    }

    #[test]
    fn numbers_past_the_limit_are_never_offered() {
        let names: Vec<String> = (0..40).map(|i| format!("qemu:dirty-bitmap:{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let e = export(&refs);
        assert_eq!(offered(&e).count(), META_CONTEXTS_MAX);
        assert_eq!(select(&e, &[], true).count(), META_CONTEXTS_MAX);
        assert!(context_name(&e, META_CONTEXTS_MAX).is_none());
    }
}
