//! Wire constants of the NBD protocol, named as in `nbd-proto.md` ("Values").

/// `NBDMAGIC`, the first 8 bytes a newstyle server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle greeting magic, and the magic before every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic that starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// `cliserv_magic`: what an oldstyle server sends where a newstyle one sends `IHAVEOPT`.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;

/// Compact (28-byte) request magic.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Extended (32-byte) request magic.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Simple (16-byte) reply magic.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Structured (20-byte) reply chunk magic.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Extended (32-byte) reply chunk magic.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flags (server, 16 bits).
pub mod handshake_flags {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags (32 bits).
pub mod client_flags {
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const NO_ZEROES: u32 = 1 << 1;
    /// Every flag this implementation understands.
    pub const KNOWN: u32 = FIXED_NEWSTYLE | NO_ZEROES;
}

/// Transmission flags (16 bits), per export.
pub mod transmission_flags {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
    pub const BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;
}

/// Option codes sent by the client during haggling.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    const ERR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERR + 1;
    pub const ERR_POLICY: u32 = ERR + 2;
    pub const ERR_INVALID: u32 = ERR + 3;
    pub const ERR_PLATFORM: u32 = ERR + 4;
    pub const ERR_TLS_REQD: u32 = ERR + 5;
    pub const ERR_UNKNOWN: u32 = ERR + 6;
    pub const ERR_SHUTDOWN: u32 = ERR + 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR + 8;
    pub const ERR_TOO_BIG: u32 = ERR + 9;
    pub const ERR_EXT_HEADER_REQD: u32 = ERR + 10;

    /// Whether `reply_type` is an error: "all of which are denoted by having bit 31 set".
    pub const fn is_error(reply_type: u32) -> bool {
        reply_type & ERR != 0
    }
}

/// Information types of `NBD_REP_INFO`.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command flags (16 bits) of a request.
pub mod cmd_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured/extended reply flags.
pub mod reply_flags {
    pub const DONE: u16 = 1 << 0;
}

/// Structured/extended reply chunk types.
pub mod chunk {
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const BLOCK_STATUS_EXT: u16 = 6;
    pub const ERROR: u16 = (1 << 15) + 1;
    pub const ERROR_OFFSET: u16 = (1 << 15) + 2;
    /// "All error chunk types have bit 15 set".
    pub const ERROR_BIT: u16 = 1 << 15;
}

/// `base:allocation` status flags.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

/// The metadata context every export offers (others: `meta`).
pub const BASE_ALLOCATION: &str = "base:allocation";

/// The longest string (export name, description, context name) the spec allows.
pub const STRING_BYTES_MAX: usize = 4096;
