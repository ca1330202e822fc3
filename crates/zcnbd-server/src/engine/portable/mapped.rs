//! A memory export's bytes on the portable engine: reads answered from its mapping (sent from
//! its pages, or copied out of them), write payloads received straight into it. What the
//! export's stack maps each request to decides; anything else goes through the dispatcher.

use zcnbd_proto::RequestHeader;

use crate::dispatch::{data_header, Dispatcher, Reply};
use crate::export::{Lease, Map, MapFor, Medium, Place, Stack};
use crate::session::channel::Channel;
use crate::stats::ReadPath;
use crate::sys::mapping::MappedRange;

/// Whether the stack maps requests to a memory export's mapping.
pub(super) fn is_memory(stack: &Stack) -> bool {
    stack.medium() == Some(Medium::Memory)
}

/// The shortest read sent from the mapping on `channel`: every read in plain text; under
/// user-space TLS those of a record or more (a shorter reply shares a record with its
/// neighbours, copied, where a mapped one would be a record of its own); none under kTLS,
/// where the socket is written plain bytes. `None` too when the stack is not a memory export.
pub(super) fn min_len(channel: &Channel, stack: &Stack) -> Option<usize> {
    if !is_memory(stack) {
        return None;
    }
    match channel {
        Channel::Plain(_) => Some(0),
        Channel::Tls(t) if t.kernel_sends() => None,
        Channel::Tls(_) => Some(crate::tls::RECORD_PLAINTEXT_BYTES),
    }
}

/// A read of data (no holes) answered from the mapping: long ones point into it, short ones
/// are copied out of it. `None` when the range has holes (a hole's page sent from the
/// mapping would be allocated) or the stack maps it elsewhere: the dispatcher reads it.
pub(super) fn read(
    dispatcher: &Dispatcher,
    h: &RequestHeader,
    min_len: usize,
    map: &mut Map,
) -> Option<Reply> {
    if h.length == 0 {
        return None;
    }
    let holes = MapFor::Read { holes: true };
    let lease = dispatcher.stack.map(h.offset, h.length, holes, map).ok()?;
    let Place::Memory { range, .. } = map.take_single()?.place else {
        return None;
    };
    let (len, stats) = (range.len(), &dispatcher.stats);
    let headers = data_header(dispatcher.ctx.mode, h, len);
    if len >= min_len {
        stats.read_done(ReadPath::Export, len);
        return Some(Reply::mapped(headers, range, lease));
    }
    let mut data = dispatcher.pool.get(len);
    if !range.copy_out(0, &mut data) {
        return None;
    }
    drop(lease);
    stats.copied(len);
    stats.read_done(ReadPath::Copied, len);
    Some(Reply::with_data(headers, data))
}

/// Where a write's `payload` bytes are received straight into the export, and its lease
/// (kept until the payload is in, or the connection ends), or `None`.
pub(super) fn landing(
    stack: &Stack,
    h: &RequestHeader,
    payload: usize,
    map: &mut Map,
) -> Option<(MappedRange, Lease)> {
    if payload == 0 {
        return None;
    }
    let lease = stack
        .map(h.offset, payload as u64, MapFor::Write, map)
        .ok()?;
    match map.take_single()?.place {
        Place::Memory { range, .. } => Some((range, lease)),
        _ => None,
    }
}
