//! `validate_request`: the one place that maps each bad request to the errno the spec names.

use crate::consts::{cmd_flags as cf, transmission_flags as tf};
use crate::meta::MetaSelected;
use crate::request::RequestHeader;
use crate::types::{BlockSize, Command, Errno, ReplyMode};

/// What a connection's requests are checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransmissionContext {
    /// Reply framing negotiated.
    pub mode: ReplyMode,
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags advertised for the export.
    pub flags: u16,
    /// Size constraints advertised for the export.
    pub block_size: BlockSize,
    /// The metadata contexts the client selected.
    pub meta: MetaSelected,
}

/// A request refused with an error reply; the connection goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejection {
    /// The error to send.
    pub errno: Errno,
    /// Why, for the log and the error chunk's message.
    pub reason: &'static str,
}

fn reject<T>(errno: Errno, reason: &'static str) -> Result<T, Rejection> {
    Err(Rejection { errno, reason })
}

impl TransmissionContext {
    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    /// Flags the spec documents for `command`, given what this export advertised.
    fn allowed_flags(&self, command: Command) -> u16 {
        // "NBD_CMD_FLAG_FUA; This flag is valid for all commands, provided NBD_FLAG_SEND_FUA
        // has been negotiated".
        let mut allowed = if self.has(tf::SEND_FUA) { cf::FUA } else { 0 };
        match command {
            Command::Read if self.has(tf::SEND_DF) => allowed |= cf::DF,
            Command::Write if self.mode == ReplyMode::Extended => allowed |= cf::PAYLOAD_LEN,
            Command::WriteZeroes => {
                allowed |= cf::NO_HOLE;
                if self.has(tf::SEND_FAST_ZERO) {
                    allowed |= cf::FAST_ZERO;
                }
            }
            Command::BlockStatus => allowed |= cf::REQ_ONE,
            _ => {}
        }
        allowed
    }
}

/// Checks a request against the export and the negotiation. `Ok` carries the command to run.
pub fn validate_request(
    req: &RequestHeader,
    ctx: &TransmissionContext,
) -> Result<Command, Rejection> {
    // "The server SHOULD return NBD_EINVAL if it receives an unknown command."
    let Some(command) = Command::from_wire(req.kind) else {
        return reject(Errno::Inval, "unknown command");
    };
    // "There is no reply to an NBD_CMD_DISC": nothing to check or to refuse.
    if command == Command::Disc {
        return Ok(command);
    }
    check_flags(command, req, ctx)?;
    check_supported(command, ctx)?;
    check_range(command, req, ctx)?;
    Ok(command)
}

fn check_flags(
    command: Command,
    req: &RequestHeader,
    ctx: &TransmissionContext,
) -> Result<(), Rejection> {
    // "The command NBD_CMD_WRITE MUST use the flag NBD_CMD_FLAG_PAYLOAD_LEN in this mode" -
    // but QEMU's client omits it and QEMU's server accepts that, so a write is accepted with
    // or without it (see RequestHeader::payload_bytes).
    // "It also SHOULD return NBD_EINVAL if it receives a request with a flag not explicitly
    // documented as applicable to the given request."
    if req.flags & !ctx.allowed_flags(command) != 0 {
        return reject(Errno::Inval, "flag not valid for this command or export");
    }
    Ok(())
}

fn check_supported(command: Command, ctx: &TransmissionContext) -> Result<(), Rejection> {
    // "it SHOULD return NBD_EPERM if it receives a write or trim request on a read-only export"
    if command.is_write() && ctx.has(tf::READ_ONLY) {
        return reject(Errno::Perm, "export is read-only");
    }
    let needed = match command {
        Command::Flush => tf::SEND_FLUSH,
        Command::Trim => tf::SEND_TRIM,
        Command::WriteZeroes => tf::SEND_WRITE_ZEROES,
        _ => 0,
    };
    if needed != 0 && !ctx.has(needed) {
        return reject(Errno::Inval, "command not advertised for this export");
    }
    // "Servers SHOULD reply with NBD_EINVAL to clients sending NBD_CMD_BLOCK_STATUS without
    // selecting at least one metadata context."
    if command == Command::BlockStatus && ctx.meta.is_empty() {
        return reject(Errno::Inval, "no metadata context selected");
    }
    Ok(())
}

fn check_range(
    command: Command,
    req: &RequestHeader,
    ctx: &TransmissionContext,
) -> Result<(), Rejection> {
    if command == Command::Flush {
        // "For a flush request, length and offset are reserved, and MUST be set to all-zero."
        if req.offset != 0 || req.length != 0 {
            return reject(Errno::Inval, "flush with nonzero offset or length");
        }
        return Ok(());
    }
    let beyond_end = match req.offset.checked_add(req.length) {
        Some(end) => end > ctx.size,
        None => true,
    };
    if beyond_end {
        // "The server SHOULD return NBD_ENOSPC if it receives a write request including one
        // or more sectors beyond the size of the device ... NBD_EINVAL if it receives a read
        // or trim request including one or more sectors beyond the size of the device".
        return match command {
            Command::Write | Command::WriteZeroes => reject(Errno::NoSpc, "beyond end of export"),
            _ => reject(Errno::Inval, "beyond end of export"),
        };
    }
    // "the client MUST ensure that offset and length are integer multiples of any advertised
    // minimum block size" ... "The server SHOULD report an NBD_EINVAL error if the client's
    // request is not aligned to advertised minimum block size boundaries".
    let minimum = u64::from(ctx.block_size.minimum);
    if !req.offset.is_multiple_of(minimum) || !req.length.is_multiple_of(minimum) {
        return reject(Errno::Inval, "not aligned to the minimum block size");
    }
    let payload_max = u64::from(ctx.block_size.payload_max);
    match command {
        Command::Write if req.length > payload_max => {
            reject(Errno::Inval, "write larger than the maximum payload")
        }
        // Simple replies: "any client request with a length larger than the maximum payload
        // size will fail"; structured: "the server is also permitted to reject large read
        // requests up front with NBD_EOVERFLOW".
        Command::Read if req.length > payload_max => match ctx.mode {
            ReplyMode::Simple => reject(Errno::Inval, "read larger than the maximum payload"),
            _ => reject(Errno::Overflow, "read larger than the maximum payload"),
        },
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRITABLE: u16 = tf::HAS_FLAGS
        | tf::SEND_FLUSH
        | tf::SEND_FUA
        | tf::SEND_TRIM
        | tf::SEND_WRITE_ZEROES
        | tf::SEND_DF
        | tf::SEND_CACHE
        | tf::SEND_FAST_ZERO;

    fn ctx() -> TransmissionContext {
        TransmissionContext {
            mode: ReplyMode::Structured,
            size: 1 << 20,
            flags: WRITABLE,
            block_size: BlockSize::with_minimum(512),
            meta: MetaSelected::BASE_ALLOCATION,
        }
    }

    fn req(command: Command, flags: u16, offset: u64, length: u64) -> RequestHeader {
        RequestHeader {
            flags,
            kind: command.to_wire(),
            cookie: 1,
            offset,
            length,
        }
    }

    fn errno(r: Result<Command, Rejection>) -> Option<Errno> {
        r.err().map(|e| e.errno)
    }

    #[test]
    fn accepts_well_formed_requests() {
        let c = ctx();
        for (command, flags) in [
            (Command::Read, cf::DF | cf::FUA),
            (Command::Write, cf::FUA),
            (Command::Trim, 0),
            (Command::WriteZeroes, cf::NO_HOLE | cf::FAST_ZERO),
            (Command::Cache, 0),
            (Command::BlockStatus, cf::REQ_ONE),
        ] {
            assert_eq!(
                validate_request(&req(command, flags, 512, 4096), &c),
                Ok(command)
            );
        }
        assert_eq!(
            validate_request(&req(Command::Flush, 0, 0, 0), &c),
            Ok(Command::Flush)
        );
        // Zero-length requests are answered, not refused.
        assert_eq!(
            validate_request(&req(Command::Read, 0, 1024, 0), &c),
            Ok(Command::Read)
        );
    }

    #[test]
    fn bounds_give_einval_or_enospc() {
        let c = ctx();
        let end = c.size;
        assert_eq!(
            errno(validate_request(&req(Command::Read, 0, end, 512), &c)),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(&req(Command::Trim, 0, end, 512), &c)),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(&req(Command::Write, 0, end, 512), &c)),
            Some(Errno::NoSpc)
        );
        let wz = req(Command::WriteZeroes, 0, u64::MAX - 511, 512);
        assert_eq!(errno(validate_request(&wz, &c)), Some(Errno::NoSpc));
    }

    #[test]
    fn read_only_refuses_writes_with_eperm() {
        let c = TransmissionContext {
            flags: tf::HAS_FLAGS | tf::READ_ONLY | tf::SEND_DF,
            ..ctx()
        };
        for command in [Command::Write, Command::Trim, Command::WriteZeroes] {
            assert_eq!(
                errno(validate_request(&req(command, 0, 0, 512), &c)),
                Some(Errno::Perm)
            );
        }
        assert_eq!(
            validate_request(&req(Command::Read, cf::DF, 0, 512), &c),
            Ok(Command::Read)
        );
        // FUA was not advertised on this export, so it is an unknown flag here.
        assert_eq!(
            errno(validate_request(&req(Command::Read, cf::FUA, 0, 512), &c)),
            Some(Errno::Inval)
        );
    }

    #[test]
    fn unknown_commands_and_flags_give_einval() {
        let c = ctx();
        let unknown = RequestHeader {
            kind: 99,
            ..req(Command::Read, 0, 0, 512)
        };
        assert_eq!(errno(validate_request(&unknown, &c)), Some(Errno::Inval));
        assert_eq!(
            errno(validate_request(&req(Command::Read, 1 << 9, 0, 512), &c)),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(
                &req(Command::Read, cf::NO_HOLE, 0, 512),
                &c
            )),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(
                &req(Command::Write, cf::PAYLOAD_LEN, 0, 512),
                &c
            )),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(&req(Command::Flush, 0, 0, 512), &c)),
            Some(Errno::Inval)
        );
    }

    #[test]
    fn misaligned_requests_give_einval() {
        let c = ctx();
        assert_eq!(
            errno(validate_request(&req(Command::Read, 0, 100, 512), &c)),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(&req(Command::Write, 0, 512, 100), &c)),
            Some(Errno::Inval)
        );
    }

    #[test]
    fn oversized_payloads() {
        let c = TransmissionContext {
            size: 1 << 30,
            ..ctx()
        };
        let big = u64::from(BlockSize::PAYLOAD_BYTES_MAX) * 2;
        assert_eq!(
            errno(validate_request(&req(Command::Read, 0, 0, big), &c)),
            Some(Errno::Overflow)
        );
        let simple = TransmissionContext {
            mode: ReplyMode::Simple,
            ..c
        };
        assert_eq!(
            errno(validate_request(&req(Command::Read, 0, 0, big), &simple)),
            Some(Errno::Inval)
        );
        assert_eq!(
            errno(validate_request(&req(Command::Write, 0, 0, big), &c)),
            Some(Errno::Inval)
        );
        // Effect lengths may exceed the payload limit.
        assert_eq!(
            validate_request(&req(Command::Trim, 0, 0, big), &c),
            Ok(Command::Trim)
        );
    }

    #[test]
    fn payload_len_only_on_extended_writes_and_block_status_needs_context() {
        let ext = TransmissionContext {
            mode: ReplyMode::Extended,
            ..ctx()
        };
        assert_eq!(
            validate_request(&req(Command::Write, 0, 0, 512), &ext),
            Ok(Command::Write)
        );
        assert_eq!(
            validate_request(&req(Command::Write, cf::PAYLOAD_LEN, 0, 512), &ext),
            Ok(Command::Write)
        );
        assert_eq!(
            errno(validate_request(
                &req(Command::Trim, cf::PAYLOAD_LEN, 0, 512),
                &ext
            )),
            Some(Errno::Inval)
        );
        let none = TransmissionContext {
            meta: MetaSelected::NONE,
            ..ctx()
        };
        assert_eq!(
            errno(validate_request(
                &req(Command::BlockStatus, 0, 0, 512),
                &none
            )),
            Some(Errno::Inval)
        );
    }
}
