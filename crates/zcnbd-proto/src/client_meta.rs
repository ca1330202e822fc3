//! The metadata contexts a client asks for (`NBD_OPT_SET_META_CONTEXT`) and the ones the
//! server selected, with the ids its block status chunks carry.
//!
//! A client names each context it wants (`base:allocation`, `qemu:allocation-depth`,
//! `qemu:dirty-bitmap:NAME`, ...). The server answers with one `NBD_REP_META_CONTEXT` per
//! context it selected; one it does not have is simply absent ("The server MAY ignore
//! queries that do not select a single metadata context"), which is no error. Ids are the
//! server's, per connection: "clients MUST therefore treat the ID as an opaque value and not
//! (for instance) cache it between connections".

use crate::consts::STRING_BYTES_MAX;

/// Most context names one client asks for (besides `base:allocation`, which
/// [`ClientHandshakeOptions::base_allocation`](crate::ClientHandshakeOptions) adds).
pub const META_CONTEXT_QUERIES_MAX: usize = 32;

/// Most contexts a server may select in one `NBD_OPT_SET_META_CONTEXT`: every query asked
/// for (and `base:allocation`) could select several under an implementation's query syntax,
/// so the bound is looser than the number of queries, and still small enough that a reply's
/// contexts fit one bitmask per request.
pub const META_CONTEXTS_SELECTED_MAX: usize = 64;

/// Most replies accepted to one `NBD_OPT_LIST_META_CONTEXT` (whatever
/// `option_replies_max` says, which may be less): a server may list many contexts, of which
/// the client keeps only as many as it can select (see
/// [`ClientHandshake::with_meta_list`](crate::ClientHandshake::with_meta_list)) and counts
/// the rest; past this many replies the listing is hostile and ends the handshake.
pub const META_CONTEXT_LIST_REPLIES_MAX: u32 = 4096;

/// A checked list of context names to ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetaQueries {
    names: Vec<String>,
}

/// Why a list of context names cannot be asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaQueryError {
    /// More names than [`META_CONTEXT_QUERIES_MAX`].
    #[error("more than {0} metadata contexts asked for")]
    TooMany(usize),
    /// A name longer than the spec's 4096-byte string limit.
    #[error("metadata context name of {0} bytes, limit 4096")]
    TooLong(usize),
    /// A name that does not start with a namespace and a colon (the spec: a query "MUST
    /// start with a namespace and a colon"), or holds a NUL byte.
    #[error("metadata context name {0:?} is not namespace:leaf")]
    Malformed(String),
    /// A name listed twice.
    #[error("metadata context {0:?} listed twice")]
    Duplicate(String),
}

impl MetaQueries {
    /// Checks `names`: at most [`META_CONTEXT_QUERIES_MAX`], each at most 4096 bytes,
    /// `namespace:leaf` (a non-empty namespace, then a colon), no NUL, none twice.
    pub fn new<I, S>(names: I) -> Result<MetaQueries, MetaQueryError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut checked: Vec<String> = Vec::new();
        for name in names {
            if checked.len() == META_CONTEXT_QUERIES_MAX {
                return Err(MetaQueryError::TooMany(META_CONTEXT_QUERIES_MAX));
            }
            let name = name.into();
            check_name(&name)?;
            if checked.contains(&name) {
                return Err(MetaQueryError::Duplicate(name));
            }
            checked.push(name);
        }
        Ok(MetaQueries { names: checked })
    }

    /// The names, in the order given.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// Whether `name` is listed.
    pub fn contains(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Whether no name is listed.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// How many names are listed.
    pub fn len(&self) -> usize {
        self.names.len()
    }
}

fn check_name(name: &str) -> Result<(), MetaQueryError> {
    // Strings "MUST be no longer than 4096 bytes" and "MUST NOT contain NUL".
    if name.len() > STRING_BYTES_MAX {
        return Err(MetaQueryError::TooLong(name.len()));
    }
    let namespace = name.split_once(':').map(|(ns, _)| ns);
    if namespace.is_none_or(str::is_empty) || name.contains('\0') {
        return Err(MetaQueryError::Malformed(name.to_string()));
    }
    Ok(())
}

/// A context the server selected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContext {
    /// Its name, as the server sent it (invalid UTF-8 replaced).
    pub name: String,
    /// The id its block status chunks carry on this connection.
    pub id: u32,
}

/// The id `contexts` gives `name`, if the server selected it.
pub fn context_id_of(contexts: &[MetaContext], name: &str) -> Option<u32> {
    contexts.iter().find(|c| c.name == name).map(|c| c.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        let q = MetaQueries::new(["base:allocation", "qemu:dirty-bitmap:b0"]).unwrap();
        assert_eq!(q.len(), 2);
        assert!(q.contains("qemu:dirty-bitmap:b0"));
        assert_eq!(
            MetaQueries::new(["noColon"]),
            Err(MetaQueryError::Malformed("noColon".into()))
        );
        assert!(MetaQueries::new([":leaf"]).is_err());
        assert!(MetaQueries::new([""]).is_err());
        assert!(MetaQueries::new(["a:\0"]).is_err());
        assert_eq!(
            MetaQueries::new(["a:b", "a:b"]),
            Err(MetaQueryError::Duplicate("a:b".into()))
        );
        let long = format!("x:{}", "y".repeat(STRING_BYTES_MAX - 1));
        assert_eq!(
            MetaQueries::new([long.clone()]),
            Err(MetaQueryError::TooLong(STRING_BYTES_MAX + 1))
        );
        assert!(MetaQueries::new([&long[..STRING_BYTES_MAX]]).is_ok());
    }

    #[test]
    fn the_count_is_bounded() {
        let names = |n: usize| (0..n).map(|i| format!("qemu:dirty-bitmap:{i}"));
        assert!(MetaQueries::new(names(META_CONTEXT_QUERIES_MAX)).is_ok());
        assert_eq!(
            MetaQueries::new(names(META_CONTEXT_QUERIES_MAX + 5)),
            Err(MetaQueryError::TooMany(META_CONTEXT_QUERIES_MAX))
        );
    }
}
