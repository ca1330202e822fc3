//! The client's half of option haggling on the wire: encoding the options it sends, and parsing
//! the server's option replies, `NBD_REP_META_CONTEXT` data and `NBD_REP_INFO` items.
//!
//! Every parse goes through [`Reader`]; every length the server sends is checked against a
//! limit before anything is taken.

use crate::client_handshake::ClientHandshakeError as Error;
use crate::consts::{info, opt, IHAVEOPT, OPTION_REPLY_MAGIC, STRING_BYTES_MAX};
use crate::cursor::{PutBe, Reader};
use crate::types::BlockSize;

/// Length of an option reply header: magic, option, reply type, length.
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;

/// One option reply, borrowed from the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReply<'a> {
    /// The reply type (`rep::*`).
    pub kind: u32,
    /// The reply's data, at most the limit given to [`parse_option_reply`].
    pub data: &'a [u8],
}

/// Parses the option reply to `sent` at the front of `input`. `Ok(None)` means it has not fully
/// arrived; `Ok(Some((reply, used)))` gives the reply and the bytes it took. A header announcing
/// more than `data_bytes_max` bytes is refused as soon as the header is in, so a receive buffer
/// of [`OPTION_REPLY_HEADER_BYTES`] + `data_bytes_max` never stalls.
pub fn parse_option_reply(
    input: &[u8],
    sent: u32,
    data_bytes_max: u32,
) -> Result<Option<(OptionReply<'_>, usize)>, Error> {
    let mut r = Reader::new(input);
    let (Some(magic), Some(option), Some(kind), Some(len)) = (r.u64(), r.u32(), r.u32(), r.u32())
    else {
        return Ok(None);
    };
    if magic != OPTION_REPLY_MAGIC {
        return Err(Error::BadReplyMagic(magic));
    }
    // "S: 32 bits, the option as sent by the client to which this is a reply"
    if option != sent {
        return Err(Error::WrongOption { sent, got: option });
    }
    let too_long = Error::ReplyTooLong {
        option,
        len,
        max: data_bytes_max,
    };
    if len > data_bytes_max {
        return Err(too_long);
    }
    let len = usize::try_from(len).map_err(|_| too_long)?;
    let Some(data) = r.take(len) else {
        return Ok(None);
    };
    Ok(Some((
        OptionReply { kind, data },
        OPTION_REPLY_HEADER_BYTES + data.len(),
    )))
}

/// Checks that an `NBD_REP_ACK` is empty: "NBD_REP_ACK (1) ... No data."
pub fn check_ack(reply: OptionReply<'_>) -> Result<(), Error> {
    if reply.data.is_empty() {
        Ok(())
    } else {
        Err(Error::Malformed("NBD_REP_ACK carries data"))
    }
}

/// The text of an error reply: "that data is an error message string suitable for display to
/// the user". Invalid UTF-8 is replaced rather than refused, and text past the spec's string
/// limit is cut off, since it is only ever shown.
pub fn error_message(data: &[u8]) -> String {
    let mut r = Reader::new(data);
    let shown = r.take(STRING_BYTES_MAX).unwrap_or(data);
    String::from_utf8_lossy(shown).into_owned()
}

/// Parses `NBD_REP_META_CONTEXT` data: "32 bits, NBD metadata context ID" then the context's
/// name, which the caller compares byte for byte.
pub fn parse_meta_context(data: &[u8]) -> Result<(u32, &[u8]), Error> {
    let mut r = Reader::new(data);
    let id = r
        .u32()
        .ok_or(Error::Malformed("NBD_REP_META_CONTEXT shorter than its id"))?;
    let name = r.rest();
    if name.len() > STRING_BYTES_MAX {
        return Err(Error::Malformed("metadata context name over 4096 bytes"));
    }
    Ok((id, name))
}

/// One `NBD_REP_INFO` item, as far as this client cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InfoItem<'a> {
    /// `NBD_INFO_EXPORT`: size and transmission flags.
    Export { size: u64, flags: u16 },
    /// `NBD_INFO_DESCRIPTION`: text for a human, not yet checked for UTF-8.
    Description(&'a [u8]),
    /// `NBD_INFO_BLOCK_SIZE`, already checked with [`BlockSize::is_valid`].
    BlockSize(BlockSize),
    /// A type this client does not use (`NBD_INFO_NAME`, or one it does not know).
    Ignored,
}

/// Parses the data of one `NBD_REP_INFO`.
pub fn parse_info(data: &[u8]) -> Result<InfoItem<'_>, Error> {
    let mut r = Reader::new(data);
    // The length "includes the 2 bytes for the type designator".
    let kind = r
        .u16()
        .ok_or(Error::Malformed("NBD_REP_INFO shorter than its type"))?;
    match kind {
        info::EXPORT => parse_export(r),
        info::BLOCK_SIZE => parse_block_size(r),
        info::DESCRIPTION => {
            let text = r.rest();
            // Strings "MUST be no longer than 4096 bytes".
            if text.len() > STRING_BYTES_MAX {
                return Err(Error::Malformed("NBD_INFO_DESCRIPTION over 4096 bytes"));
            }
            Ok(InfoItem::Description(text))
        }
        // "The client MUST ignore information replies it does not understand"; the canonical
        // name (NBD_INFO_NAME, "length MUST be at least 2") is not asked for and not kept.
        _ => Ok(InfoItem::Ignored),
    }
}

fn parse_export(mut r: Reader<'_>) -> Result<InfoItem<'_>, Error> {
    // "*length* MUST be 12": type, 64-bit size, 16-bit flags.
    let (Some(size), Some(flags)) = (r.u64(), r.u16()) else {
        return Err(Error::Malformed("NBD_INFO_EXPORT length is not 12"));
    };
    if !r.is_empty() {
        return Err(Error::Malformed("NBD_INFO_EXPORT length is not 12"));
    }
    Ok(InfoItem::Export { size, flags })
}

fn parse_block_size(mut r: Reader<'_>) -> Result<InfoItem<'_>, Error> {
    // "The *length* MUST be 14": type, minimum, preferred, maximum payload.
    let (Some(minimum), Some(preferred), Some(payload_max)) = (r.u32(), r.u32(), r.u32()) else {
        return Err(Error::Malformed("NBD_INFO_BLOCK_SIZE length is not 14"));
    };
    if !r.is_empty() {
        return Err(Error::Malformed("NBD_INFO_BLOCK_SIZE length is not 14"));
    }
    let block_size = BlockSize {
        minimum,
        preferred,
        payload_max,
    };
    // We asked for NBD_INFO_BLOCK_SIZE with NBD_OPT_GO, so "it MUST abide by the size
    // constraints it receives": constraints that break the spec's rules cannot be obeyed, and
    // ignoring them would break that promise silently, so they end the handshake.
    if !block_size.is_valid() {
        return Err(Error::InvalidBlockSize(block_size));
    }
    Ok(InfoItem::BlockSize(block_size))
}

/// Appends one option: `IHAVEOPT`, the option, the data's length, then the data in `parts`.
/// The caller keeps the data short (one export name of at most 4096 bytes and a few fields).
pub fn put_option(out: &mut Vec<u8>, option: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.put_u64(IHAVEOPT);
    out.put_u32(option);
    out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// Appends `NBD_OPT_SET_META_CONTEXT` for `export` with the single query `query`.
pub fn put_set_meta_context(out: &mut Vec<u8>, export: &[u8], query: &[u8]) {
    put_set_meta_contexts(out, export, &[query]);
}

/// Appends `NBD_OPT_SET_META_CONTEXT` for `export` with `queries` (see
/// [`put_meta_context_option`]).
pub fn put_set_meta_contexts(out: &mut Vec<u8>, export: &[u8], queries: &[&[u8]]) {
    put_meta_context_option(out, opt::SET_META_CONTEXT, export, queries);
}

/// Appends `option` (`NBD_OPT_SET_META_CONTEXT` or `NBD_OPT_LIST_META_CONTEXT`, which share
/// their layout) for `export` with `queries`: "32 bits, number of queries", then each as "32
/// bits, length of query" and the query. The caller bounds them (at most
/// [`META_CONTEXT_QUERIES_MAX`](crate::client_meta::META_CONTEXT_QUERIES_MAX) and
/// `base:allocation`, each at most 4096 bytes).
pub fn put_meta_context_option(out: &mut Vec<u8>, option: u32, export: &[u8], queries: &[&[u8]]) {
    let export_len = string_len(export);
    let count = u32::try_from(queries.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes();
    let list_len: usize = queries.iter().map(|q| 4 + q.len()).sum();
    let mut list = Vec::with_capacity(list_len);
    for query in queries {
        list.extend_from_slice(&string_len(query));
        list.extend_from_slice(query);
    }
    let parts = [&export_len[..], export, &count, &list];
    put_option(out, option, &parts);
}

/// Appends `NBD_OPT_GO` for `export`, asking for `items` (`info::*`).
pub fn put_go(out: &mut Vec<u8>, export: &[u8], items: &[u16]) {
    let export_len = string_len(export);
    let count = u16::try_from(items.len()).unwrap_or(u16::MAX);
    let mut list = Vec::with_capacity(items.len() * 2);
    for item in items.iter().take(usize::from(count)) {
        list.put_u16(*item);
    }
    put_option(
        out,
        opt::GO,
        &[&export_len, export, &count.to_be_bytes(), &list],
    );
}

/// The 32-bit length prefix of a string the client sends (at most 4096 bytes, checked by the
/// caller).
fn string_len(s: &[u8]) -> [u8; 4] {
    u32::try_from(s.len()).unwrap_or(u32::MAX).to_be_bytes()
}
