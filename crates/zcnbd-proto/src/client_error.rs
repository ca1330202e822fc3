//! Why the client ends a handshake: the server refused (an error reply, after which the client
//! sends `NBD_OPT_ABORT`) or broke the protocol (the client just hangs up).

use crate::types::BlockSize;

/// Why the client ends a handshake.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientHandshakeError {
    /// The greeting did not start with `NBDMAGIC`: the peer is no NBD server.
    #[error("bad greeting magic {0:#x}, not an NBD server")]
    BadMagic(u64),
    /// The server speaks oldstyle negotiation, which this client does not.
    #[error("server uses oldstyle negotiation, which is not supported")]
    Oldstyle,
    /// The greeting's second magic was neither `IHAVEOPT` nor the oldstyle magic.
    #[error("bad newstyle magic {0:#x}")]
    BadNewstyleMagic(u64),
    /// The server's handshake flags lack `NBD_FLAG_FIXED_NEWSTYLE`.
    #[error("server does not support fixed newstyle negotiation (handshake flags {0:#x})")]
    NotFixedNewstyle(u16),
    /// The configured export name is longer than the spec's 4096-byte string limit.
    #[error("export name is {0} bytes, limit 4096")]
    ExportNameTooLong(usize),
    /// An option reply did not start with the option reply magic.
    #[error("bad option reply magic {0:#x}")]
    BadReplyMagic(u64),
    /// An option reply named another option than the one in flight.
    #[error("reply for option {got} while waiting for option {sent}")]
    WrongOption { sent: u32, got: u32 },
    /// An option reply's payload is larger than `option_reply_bytes_max`.
    #[error("reply to option {option} carries {len} bytes, limit {max}")]
    ReplyTooLong { option: u32, len: u32, max: u32 },
    /// The server sent more than `option_replies_max` replies to one option.
    #[error("more than {max} replies to option {option}")]
    TooManyReplies { option: u32, max: u32 },
    /// A reply type that makes no sense for the option in flight (and is no error).
    #[error("unexpected reply type {reply:#x} to option {option}")]
    UnexpectedReply { option: u32, reply: u32 },
    /// A reply whose data breaks the spec's layout.
    #[error("malformed reply: {0}")]
    Malformed(&'static str),
    /// `NBD_REP_ACK` to `NBD_OPT_GO` came before any `NBD_INFO_EXPORT`.
    #[error("NBD_OPT_GO succeeded without NBD_INFO_EXPORT")]
    MissingExportInfo,
    /// `NBD_INFO_BLOCK_SIZE` values break the spec's rules, so they cannot be obeyed.
    #[error("invalid block size constraints {0:?}")]
    InvalidBlockSize(BlockSize),
    /// `NBD_OPT_GO` failed with `NBD_REP_ERR_UNKNOWN`: no such export.
    #[error("server does not know the export: {message}")]
    ExportUnknown { message: String },
    /// An option failed with `NBD_REP_ERR_TLS_REQD` before TLS: the server requires TLS (for
    /// everything, or for this export); connect asking for it (`ClientTls::Require`).
    #[error("server requires TLS: {message}")]
    TlsRequired { message: String },
    /// TLS was required (`ClientTls::Require`) and the server answered `NBD_OPT_STARTTLS` with
    /// an error (`code` is the reply type: `NBD_REP_ERR_UNSUP`, `NBD_REP_ERR_POLICY`, ...).
    #[error("TLS required but the server refused it ({code:#x}): {message}")]
    TlsRefused { code: u32, message: String },
    /// Input was offered between the `NBD_REP_ACK` to `NBD_OPT_STARTTLS` and
    /// `ClientHandshake::tls_established`: those bytes belong to the TLS layer.
    #[error("input offered while the TLS handshake is due")]
    TlsPending,
    /// `ClientHandshake::tls_established` was called with no TLS handshake due.
    #[error("no TLS handshake is due")]
    TlsNotDue,
    /// An option failed with `NBD_REP_ERR_SHUTDOWN`: the server is shutting down.
    #[error("server is shutting down: {message}")]
    ServerShutdown { message: String },
    /// `NBD_OPT_GO` failed with another error reply (`code` is the reply type).
    #[error("server refused the export ({code:#x}): {message}")]
    GoRefused { code: u32, message: String },
    /// Input arrived after the handshake ended (done or failed).
    #[error("handshake already finished")]
    Finished,
}
