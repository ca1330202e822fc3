//! Whether one reply correctly answers one request: the right errno for a refused request,
//! and for an accepted one the chunks its command calls for (a read's chunks cover its range
//! exactly; a block status chunk describes the selected context).

use zcnbd_proto::consts::{chunk, cmd_flags, state};
use zcnbd_proto::cursor::Reader;
use zcnbd_proto::{Command, Errno, ReplyMode, RequestHeader, TransmissionContext};

use super::reply::ERRNOS;
use super::transcript::{Chunk, Owed, Reply};

/// Whether `reply` is a correct answer to `debt`, and if not, why.
pub fn answers(ctx: &TransmissionContext, debt: &Owed, reply: &Reply<'_>) -> Result<(), String> {
    let h = &debt.header;
    let chunks = match reply {
        Reply::Simple { error, .. } => return simple_answers(debt.verdict, *error),
        Reply::Chunks { chunks, .. } => chunks,
    };
    if ctx.mode == ReplyMode::Extended {
        if let Some(c) = chunks.iter().find(|c| c.offset != h.offset) {
            return Err(format!(
                "chunk offset {} for request offset {}",
                c.offset, h.offset
            ));
        }
    }
    let single_error = chunks.len() == 1 && chunks[0].kind == chunk::ERROR;
    match debt.verdict {
        Err(errno) if single_error => error_chunk(chunks[0].payload, Some(errno)),
        Err(errno) => Err(format!("{errno:?} owed, got {chunks:?}")),
        Ok(_) if single_error => error_chunk(chunks[0].payload, None),
        Ok(Command::Read) => read_chunks(h, chunks),
        Ok(Command::BlockStatus) => block_status_chunk(ctx, h, chunks),
        Ok(command) => match chunks[..] {
            [Chunk {
                kind: chunk::NONE,
                payload: [],
                ..
            }] => Ok(()),
            _ => Err(format!("{command:?} answered with {chunks:?}")),
        },
    }
}

fn simple_answers(verdict: Result<Command, Errno>, error: u32) -> Result<(), String> {
    match verdict {
        Err(errno) if errno.to_wire() == error => Ok(()),
        Ok(_) if error == 0 || ERRNOS.iter().any(|e| e.to_wire() == error) => Ok(()),
        _ => Err(format!("{verdict:?} answered with error {error}")),
    }
}

/// An `ERROR` chunk: errno, message length, message; with `errno` if validation named one.
fn error_chunk(payload: &[u8], errno: Option<Errno>) -> Result<(), String> {
    let mut r = Reader::new(payload);
    let (Some(error), Some(len)) = (r.u32(), r.u16()) else {
        return Err(format!("short error chunk {payload:02x?}"));
    };
    let known = ERRNOS.iter().any(|e| e.to_wire() == error);
    if !known || errno.is_some_and(|e| e.to_wire() != error) {
        return Err(format!("error {error}, owed {errno:?}"));
    }
    if usize::from(len) != r.remaining() {
        return Err(format!("message length {len} in {payload:02x?}"));
    }
    Ok(())
}

/// Read chunks cover the request's range exactly, without overlap; `DF` allows one.
fn read_chunks(h: &RequestHeader, chunks: &[Chunk<'_>]) -> Result<(), String> {
    if h.length == 0 {
        return match chunks {
            [Chunk {
                kind: chunk::NONE,
                payload: [],
                ..
            }] => Ok(()),
            _ => Err(format!("zero-length read answered with {chunks:?}")),
        };
    }
    if h.flags & cmd_flags::DF != 0 && chunks.len() != 1 {
        return Err(format!("DF read in {} chunks", chunks.len()));
    }
    let mut ranges = Vec::with_capacity(chunks.len());
    for c in chunks {
        let mut r = Reader::new(c.payload);
        let (at, len) = match c.kind {
            chunk::OFFSET_DATA => (r.u64(), Some(r.rest().len() as u64)),
            chunk::OFFSET_HOLE if c.payload.len() == 12 => (r.u64(), r.u32().map(u64::from)),
            _ => (None, None),
        };
        let (Some(at), Some(len @ 1..)) = (at, len) else {
            return Err(format!("bad read chunk {c:?}"));
        };
        ranges.push((at, at.checked_add(len).ok_or("chunk range overflows")?));
    }
    ranges.sort_unstable();
    let mut next = h.offset;
    for (start, end) in ranges {
        if start != next {
            return Err(format!(
                "read of {}+{} has a gap or overlap at {start}",
                h.offset, h.length
            ));
        }
        next = end;
    }
    if next != h.offset + h.length {
        return Err(format!(
            "read of {}+{} covered up to {next}",
            h.offset, h.length
        ));
    }
    Ok(())
}

/// One block status chunk for the selected context, with nonzero extents starting inside the
/// request's range; exactly one with `REQ_ONE`.
fn block_status_chunk(
    ctx: &TransmissionContext,
    h: &RequestHeader,
    chunks: &[Chunk<'_>],
) -> Result<(), String> {
    let extended = ctx.mode == ReplyMode::Extended;
    let kind = if extended {
        chunk::BLOCK_STATUS_EXT
    } else {
        chunk::BLOCK_STATUS
    };
    let [c] = chunks else {
        return Err(format!("block status in {} chunks", chunks.len()));
    };
    let mut r = Reader::new(c.payload);
    // The fixture's exports offer base:allocation alone.
    let id = ctx.meta.ids().next().map(|(id, _)| id);
    if c.kind != kind || r.u32() != id {
        return Err(format!("block status chunk {c:?}"));
    }
    let extents = if extended {
        let count = r.u32().map(|n| n as usize);
        let extents = extents_of(&mut r, 16, |r| (r.u64(), r.u64()));
        (count == Some(extents.len())).then_some(extents)
    } else {
        Some(extents_of(&mut r, 8, |r| {
            (r.u32().map(u64::from), r.u32().map(u64::from))
        }))
    };
    let Some(extents) = extents.filter(|e| !e.is_empty() && r.is_empty()) else {
        return Err(format!("malformed extents in {c:?}"));
    };
    if h.flags & cmd_flags::REQ_ONE != 0 && extents.len() != 1 {
        return Err(format!("REQ_ONE answered with {} extents", extents.len()));
    }
    let known = u64::from(state::HOLE | state::ZERO);
    let mut start = 0u64;
    for (length, flags) in extents {
        if length == 0 || flags & !known != 0 || start >= h.length {
            return Err(format!(
                "extent ({length}, {flags:#x}) at +{start} of {}",
                h.length
            ));
        }
        start = start.saturating_add(length);
    }
    Ok(())
}

/// Reads `(length, flags)` descriptors of `size` bytes while whole ones remain.
fn extents_of(
    r: &mut Reader<'_>,
    size: usize,
    read: impl Fn(&mut Reader<'_>) -> (Option<u64>, Option<u64>),
) -> Vec<(u64, u64)> {
    let mut extents = Vec::new();
    while r.remaining() >= size {
        if let (Some(length), Some(flags)) = read(r) {
            extents.push((length, flags));
        }
    }
    extents
}
