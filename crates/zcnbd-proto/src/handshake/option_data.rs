//! The data of the options that carry some: `NBD_OPT_INFO` / `NBD_OPT_GO` and
//! `NBD_OPT_{LIST,SET}_META_CONTEXT`, parsed with one bounds-checked cursor.

use crate::consts::STRING_BYTES_MAX;
use crate::cursor::Reader;
use crate::meta::{self, MetaSelected};
use crate::types::ExportInfo;

/// The index of the export called `name`.
pub(super) fn find_export(exports: &[ExportInfo], name: &[u8]) -> Option<usize> {
    exports.iter().position(|e| e.name.as_bytes() == name)
}

/// The data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub(super) struct InfoRequest<'a> {
    pub(super) name: &'a [u8],
    items: &'a [u8],
}

impl InfoRequest<'_> {
    pub(super) fn wants(&self, kind: u16) -> bool {
        self.items.chunks_exact(2).any(|c| c == kind.to_be_bytes())
    }
}

pub(super) fn parse_info_request(data: &[u8]) -> Option<InfoRequest<'_>> {
    let mut r = Reader::new(data);
    let name = r.string_u32(STRING_BYTES_MAX)?;
    let count = usize::from(r.u16()?);
    let items = r.take(count * 2)?;
    r.is_empty().then_some(InfoRequest { name, items })
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
pub(super) struct MetaRequest<'a> {
    pub(super) export: &'a [u8],
    queries: Vec<&'a [u8]>,
}

pub(super) enum MetaParseError {
    /// The data breaks the layout.
    Malformed,
    /// More queries than `meta_queries_max`.
    TooManyQueries,
}

impl MetaRequest<'_> {
    /// The contexts of `export` the queries name: for a listing, every context when there
    /// are none ("If zero queries are sent, then the server MUST return all the metadata
    /// contexts") and every context under a namespace query such as `base:` ("the server
    /// MUST support" it); for a selection, the contexts named exactly.
    pub(super) fn named(&self, export: &ExportInfo, listing: bool) -> MetaSelected {
        meta::select(export, &self.queries, listing)
    }
}

pub(super) fn parse_meta_request(
    data: &[u8],
    queries_max: u32,
) -> Result<MetaRequest<'_>, MetaParseError> {
    let mut r = Reader::new(data);
    let export = r
        .string_u32(STRING_BYTES_MAX)
        .ok_or(MetaParseError::Malformed)?;
    let count = r.u32().ok_or(MetaParseError::Malformed)?;
    if count > queries_max {
        return Err(MetaParseError::TooManyQueries);
    }
    let mut queries = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let query = r
            .string_u32(STRING_BYTES_MAX)
            .ok_or(MetaParseError::Malformed)?;
        queries.push(query);
    }
    if !r.is_empty() {
        return Err(MetaParseError::Malformed);
    }
    Ok(MetaRequest { export, queries })
}
