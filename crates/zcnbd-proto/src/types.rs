//! Protocol value types shared by the handshake and transmission phases.

/// A request type (`NBD_CMD_*`) this implementation knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
}

impl Command {
    /// Maps a wire request type to a command; `None` for unknown or unsupported types.
    pub fn from_wire(kind: u16) -> Option<Command> {
        Some(match kind {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disc,
            3 => Command::Flush,
            4 => Command::Trim,
            5 => Command::Cache,
            6 => Command::WriteZeroes,
            7 => Command::BlockStatus,
            _ => return None,
        })
    }

    /// The wire request type.
    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disc => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::Cache => 5,
            Command::WriteZeroes => 6,
            Command::BlockStatus => 7,
        }
    }

    /// Whether this command may change the export's contents.
    pub fn is_write(self) -> bool {
        matches!(self, Command::Write | Command::Trim | Command::WriteZeroes)
    }
}

/// The error values the spec allows in a reply (`NBD_E*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Errno {
    /// Operation not permitted (write to a read-only export).
    Perm = 1,
    /// Input/output error.
    Io = 5,
    /// Cannot allocate memory.
    NoMem = 12,
    /// Invalid argument.
    Inval = 22,
    /// No space left on device (write past the end).
    NoSpc = 28,
    /// Value too large (read too big to send unfragmented).
    Overflow = 75,
    /// Operation not supported (fast zero that is not fast).
    NotSup = 95,
    /// Server is shutting down.
    Shutdown = 108,
}

impl Errno {
    /// Maps a host `errno` to the nearest value the spec allows: `EDQUOT` and `EFBIG` become
    /// `ENOSPC` as the spec says, unknown values become `EIO`.
    pub fn from_host(errno: i32) -> Errno {
        match errno {
            1 | 13 => Errno::Perm,         // EPERM, EACCES
            12 => Errno::NoMem,            // ENOMEM
            22 => Errno::Inval,            // EINVAL
            27 | 28 | 122 => Errno::NoSpc, // EFBIG, ENOSPC, EDQUOT
            75 => Errno::Overflow,         // EOVERFLOW
            95 => Errno::NotSup,           // EOPNOTSUPP
            108 => Errno::Shutdown,        // ESHUTDOWN
            _ => Errno::Io,
        }
    }

    /// The wire value.
    pub fn to_wire(self) -> u32 {
        self as u32
    }
}

/// How replies are framed, fixed by the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    /// Only simple replies (no structured replies negotiated); compact requests.
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY` negotiated; compact requests.
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS` negotiated; 32-byte requests and replies.
    Extended,
}

impl ReplyMode {
    /// Size of a request header in this mode.
    pub fn request_header_bytes(self) -> usize {
        match self {
            ReplyMode::Extended => crate::request::EXTENDED_REQUEST_BYTES,
            _ => crate::request::COMPACT_REQUEST_BYTES,
        }
    }
}

/// An export's size constraints (`NBD_INFO_BLOCK_SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize {
    /// Minimum block size: alignment every offset and length must have.
    pub minimum: u32,
    /// Preferred block size.
    pub preferred: u32,
    /// Maximum payload of one request.
    pub payload_max: u32,
}

impl BlockSize {
    /// Default payload limit: 32 MiB, the largest the spec says is never a denial of service.
    pub const PAYLOAD_BYTES_MAX: u32 = 32 * 1024 * 1024;

    /// Constraints with the given minimum, 4 KiB preferred (or the minimum, if larger), 32 MiB max.
    pub fn with_minimum(minimum: u32) -> BlockSize {
        BlockSize {
            minimum,
            preferred: minimum.max(4096),
            payload_max: Self::PAYLOAD_BYTES_MAX,
        }
    }

    /// Whether these values obey the spec: powers of two, minimum <= 64 KiB,
    /// preferred >= max(minimum, 512), payload_max >= preferred.
    pub fn is_valid(&self) -> bool {
        self.minimum.is_power_of_two()
            && self.minimum <= 65536
            && self.preferred.is_power_of_two()
            && self.preferred >= self.minimum.max(512)
            && self.payload_max >= self.preferred
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize::with_minimum(1)
    }
}

/// What the handshake needs to know about one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Name clients select it by ("" is the default export).
    pub name: String,
    /// Human-readable description ("" for none).
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags, including `HAS_FLAGS`.
    pub flags: u16,
    /// Size constraints.
    pub block_size: BlockSize,
    /// Only reachable under TLS (nbd-server's `tlsonly`): before TLS it is left out of
    /// `NBD_OPT_LIST` and refused to `NBD_OPT_INFO`, `NBD_OPT_GO` and `NBD_OPT_EXPORT_NAME`.
    pub tls_only: bool,
    /// Metadata contexts it offers besides `base:allocation` (`qemu:allocation-depth`, ...),
    /// at most [`META_CONTEXTS_MAX`](crate::meta::META_CONTEXTS_MAX) - 1 of them counted.
    pub meta_contexts: Vec<String>,
}

/// One block status extent (`base:allocation`: `flags` are `state::*`; other contexts give
/// `flags` their own meaning, e.g. a depth): `length` bytes with `flags` (`state::*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub flags: u32,
}
