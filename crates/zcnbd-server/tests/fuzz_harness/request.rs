//! The `request` target: `RequestHeader::decode` and `validate_request` on a stream of
//! arbitrary headers, in every reply mode, against every fixture export.
//!
//! A decoded header must encode back to the same bytes, and a request `validate_request`
//! accepts must be safe to run: in range, aligned, within the payload limit, and carrying a
//! payload only if it is a write (the reader would otherwise lose its place in the stream).

use zcnbd_proto::consts::{cmd_flags as cf, transmission_flags as tf};
use zcnbd_proto::meta::MetaSelected;
use zcnbd_proto::{
    validate_request, Command, Errno, Rejection, ReplyMode, RequestHeader, TransmissionContext,
};

use super::fixture::fixture;
use super::handshake::advertised_flags;

/// Every reply mode.
pub const MODES: [ReplyMode; 3] = [
    ReplyMode::Simple,
    ReplyMode::Structured,
    ReplyMode::Extended,
];

/// Every command flag the protocol defines.
const KNOWN_FLAGS: u16 =
    cf::FUA | cf::NO_HOLE | cf::DF | cf::REQ_ONE | cf::FAST_ZERO | cf::PAYLOAD_LEN;

/// Runs the target.
pub fn run(data: &[u8]) {
    for mode in MODES {
        let contexts = contexts(mode);
        let mut rest = data;
        while let Some((header, size)) = decode(rest, mode) {
            for ctx in &contexts {
                check(&header, ctx);
            }
            rest = &rest[size..];
        }
    }
}

/// Decodes one header, checking it encodes back to the bytes it came from.
fn decode(input: &[u8], mode: ReplyMode) -> Option<(RequestHeader, usize)> {
    let size = mode.request_header_bytes();
    let header = match RequestHeader::decode(input, mode) {
        Ok(Some(header)) => header,
        Ok(None) => {
            assert!(input.len() < size, "{} bytes but no header", input.len());
            return None;
        }
        Err(_) => return None,
    };
    let mut wire = Vec::new();
    header.encode(mode, &mut wire);
    assert_eq!(wire, input[..size], "{header:?} does not round-trip");
    Some((header, size))
}

/// What the fixture's exports look like after a handshake in `mode`, with and without
/// `base:allocation` selected.
fn contexts(mode: ReplyMode) -> Vec<TransmissionContext> {
    let infos = &fixture().infos;
    let with_context = |meta| {
        infos.iter().map(move |info| TransmissionContext {
            mode,
            size: info.size,
            flags: advertised_flags(info, mode),
            block_size: info.block_size,
            meta,
        })
    };
    with_context(MetaSelected::NONE)
        .chain(with_context(MetaSelected::BASE_ALLOCATION))
        .collect()
}

/// Checks one validation result.
pub fn check(header: &RequestHeader, ctx: &TransmissionContext) {
    match validate_request(header, ctx) {
        Ok(command) => check_accepted(command, header, ctx),
        Err(rejection) => check_rejected(&rejection, ctx),
    }
}

fn check_accepted(command: Command, h: &RequestHeader, ctx: &TransmissionContext) {
    assert_eq!(Command::from_wire(h.kind), Some(command));
    if command == Command::Disc {
        return;
    }
    let payload = h.payload_bytes(ctx.mode);
    let payload_max = u64::from(ctx.block_size.payload_max);
    match command {
        Command::Write => assert!(payload == h.length && payload <= payload_max, "{h:?}"),
        _ => assert_eq!(payload, 0, "accepted {command:?} carries a payload: {h:?}"),
    }
    if command == Command::Read {
        assert!(
            h.length <= payload_max,
            "read over the payload limit: {h:?}"
        );
    }
    assert_eq!(h.flags & !KNOWN_FLAGS, 0, "unknown flags accepted: {h:?}");
    if command.is_write() {
        assert_eq!(ctx.flags & tf::READ_ONLY, 0, "write to read-only: {h:?}");
    }
    if command == Command::BlockStatus {
        assert!(!ctx.meta.is_empty(), "block status without context");
    }
    if command == Command::Flush {
        assert_eq!((h.offset, h.length), (0, 0), "flush range");
        return;
    }
    let end = h.offset.checked_add(h.length);
    assert!(
        end.is_some_and(|end| end <= ctx.size),
        "out of range: {h:?}"
    );
    let minimum = u64::from(ctx.block_size.minimum);
    assert!(
        h.offset.is_multiple_of(minimum) && h.length.is_multiple_of(minimum),
        "unaligned: {h:?}"
    );
}

fn check_rejected(rejection: &Rejection, ctx: &TransmissionContext) {
    assert!(!rejection.reason.is_empty());
    match rejection.errno {
        Errno::Perm | Errno::Inval | Errno::NoSpc => {}
        Errno::Overflow => assert_ne!(ctx.mode, ReplyMode::Simple, "EOVERFLOW in simple mode"),
        errno => panic!("validation gave {errno:?}"),
    }
}
