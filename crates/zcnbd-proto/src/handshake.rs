//! The server side of the fixed newstyle handshake, as a sans-IO state machine.
//!
//! The caller feeds received bytes to [`ServerHandshake::handle_input`], which consumes at
//! most one client message and returns how many bytes it used (0: needs more). Everything the
//! server must send accumulates in an internal buffer the caller drains with
//! [`ServerHandshake::pending_output`] / [`ServerHandshake::consume_output`]. When
//! [`ServerHandshake::status`] says `Done`, bytes the caller still holds belong to the
//! transmission phase.
//!
//! TLS ([`TlsPolicy`], built with [`ServerHandshake::with_tls`]) adds one stop. When a client's
//! `NBD_OPT_STARTTLS` is acknowledged, `status` says [`HandshakeStatus::StartTls`]: the caller
//! sends the pending output (the `NBD_REP_ACK`, in plain text), runs the TLS handshake on the
//! transport, handing the TLS library any bytes it still holds past the `STARTTLS` option
//! (they were sent after the option, so they are TLS bytes, never options), and then calls
//! [`ServerHandshake::tls_established`]; from there on it feeds decrypted bytes and encrypts
//! the output. Until then `handle_input` refuses input ([`HandshakeError::TlsPending`]), so
//! no plain-text byte can pass for an option sent under TLS. If the TLS handshake fails the
//! caller just closes: "it is too late to continue without TLS as the acknowledgement has been
//! sent".

use crate::consts::{
    client_flags, handshake_flags, opt, rep, transmission_flags, IHAVEOPT, NBD_MAGIC,
    OPTION_REPLY_MAGIC,
};
use crate::cursor::{PutBe, Reader};
use crate::meta::MetaSelected;
use crate::types::{ExportInfo, ReplyMode};

mod option_data;
mod options;
mod tls;

pub use tls::TlsPolicy;

/// Length of a client option header: magic, option, length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// The metadata context id given to `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Limits on what one client may make the server do during the handshake.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeLimits {
    /// Largest option payload accepted; larger ones get `NBD_REP_ERR_TOO_BIG` and a disconnect.
    pub option_bytes_max: u32,
    /// Most options one handshake may send before it is cut off.
    pub options_max: u32,
    /// Most queries in one `NBD_OPT_{LIST,SET}_META_CONTEXT`.
    pub meta_queries_max: u32,
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        HandshakeLimits {
            option_bytes_max: 64 * 1024,
            options_max: 1024,
            meta_queries_max: 128,
        }
    }
}

/// Why the server ends a handshake by hanging up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The client set flags this server does not know; the spec says to close.
    #[error("client sent unknown flags {0:#x}")]
    UnknownClientFlags(u32),
    /// An option did not start with `IHAVEOPT`.
    #[error("bad option magic {0:#x}")]
    BadOptionMagic(u64),
    /// An option's payload is larger than `option_bytes_max`.
    #[error("option {option} carries {len} bytes, limit {max}")]
    OptionTooLong { option: u32, len: u32, max: u32 },
    /// The client sent more than `options_max` options.
    #[error("more than {0} options in one handshake")]
    TooManyOptions(u32),
    /// `NBD_OPT_EXPORT_NAME` named an export that does not exist (no error reply is possible).
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    /// `NBD_OPT_EXPORT_NAME` after extended headers, which the spec forbids.
    #[error("NBD_OPT_EXPORT_NAME after extended headers were negotiated")]
    ExportNameWithExtendedHeaders,
    /// `NBD_OPT_EXPORT_NAME` named an export the server's admission refused (a limit on
    /// attached clients); like an unknown export, no error reply is possible.
    #[error("NBD_OPT_EXPORT_NAME for export {0:?} refused by admission")]
    Refused(String),
    /// `NBD_OPT_EXPORT_NAME` before TLS for an export that needs it (every export under
    /// [`TlsPolicy::Require`], a `tls_only` one otherwise); no error reply is possible.
    #[error("NBD_OPT_EXPORT_NAME for export {0:?} without TLS, which it requires")]
    ExportNameWithoutTls(String),
    /// A client without `NBD_FLAG_C_FIXED_NEWSTYLE`, which cannot do TLS, at a server that
    /// requires it.
    #[error("the client cannot do TLS (no fixed newstyle), which the server requires")]
    TlsRequiredWithoutFixedNewstyle,
    /// Input was offered between an acknowledged `NBD_OPT_STARTTLS` and
    /// [`ServerHandshake::tls_established`]: those bytes belong to the TLS layer.
    #[error("input offered while the TLS handshake is due")]
    TlsPending,
    /// [`ServerHandshake::tls_established`] was called with no TLS handshake due: no
    /// `NBD_OPT_STARTTLS` was acknowledged, or its `NBD_REP_ACK` has not been sent yet.
    #[error("no TLS handshake is due")]
    TlsNotDue,
    /// Input arrived after the handshake ended.
    #[error("handshake already finished")]
    Finished,
}

/// What the handshake agreed on, once the client entered transmission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Index of the chosen export in the slice given to `handle_input`.
    pub export: usize,
    /// Reply framing.
    pub mode: ReplyMode,
    /// The metadata contexts the client selected for this export (none under simple
    /// replies, which cannot carry block status).
    pub meta: MetaSelected,
    /// Whether the client asked for `NBD_INFO_BLOCK_SIZE`, promising to obey constraints.
    pub block_size_requested: bool,
    /// The transmission flags the client was told (the export's, adjusted to the negotiation).
    pub flags: u16,
    /// Whether the session runs under TLS (the options that chose the export did too).
    pub tls: bool,
}

/// Where the handshake stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeStatus {
    /// Still haggling.
    Negotiating,
    /// `NBD_OPT_STARTTLS` was acknowledged: send the pending output, run the TLS handshake,
    /// then call [`ServerHandshake::tls_established`] (see the module documentation).
    StartTls,
    /// Transmission starts after the pending output is sent.
    Done(Negotiated),
    /// The client aborted; close after the pending output is sent.
    Aborted,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    /// Between an acknowledged `NBD_OPT_STARTTLS` and `tls_established`.
    StartTls,
    Finished(HandshakeStatus),
}

/// Metadata contexts chosen by the last `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MetaSelection {
    export: Vec<u8>,
    selected: MetaSelected,
}

/// The server's handshake with one client.
#[derive(Debug)]
pub struct ServerHandshake {
    state: State,
    out: Vec<u8>,
    limits: HandshakeLimits,
    policy: TlsPolicy,
    /// The client set `NBD_FLAG_C_FIXED_NEWSTYLE`, without which there is no TLS.
    fixed_newstyle: bool,
    /// `tls_established` was called: everything since runs under TLS.
    tls: bool,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    meta: Option<MetaSelection>,
    options_seen: u32,
}

impl ServerHandshake {
    /// A handshake whose greeting is already pending output, on a server that cannot do TLS
    /// ([`TlsPolicy::Unsupported`]).
    pub fn new(limits: HandshakeLimits) -> Self {
        Self::with_tls(limits, TlsPolicy::Unsupported)
    }

    /// A handshake whose greeting is already pending output, offering TLS as `policy` says.
    pub fn with_tls(limits: HandshakeLimits, policy: TlsPolicy) -> Self {
        let mut out = Vec::with_capacity(256);
        out.put_u64(NBD_MAGIC);
        out.put_u64(IHAVEOPT);
        out.put_u16(handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES);
        ServerHandshake {
            state: State::ClientFlags,
            out,
            limits,
            policy,
            fixed_newstyle: false,
            tls: false,
            no_zeroes: false,
            structured: false,
            extended: false,
            meta: None,
            options_seen: 0,
        }
    }

    /// Bytes waiting to be sent to the client.
    pub fn pending_output(&self) -> &[u8] {
        &self.out
    }

    /// Marks `n` pending bytes as sent.
    pub fn consume_output(&mut self, n: usize) {
        self.out.drain(..n.min(self.out.len()));
    }

    /// Where the handshake stands.
    pub fn status(&self) -> HandshakeStatus {
        match &self.state {
            State::Finished(s) => s.clone(),
            State::StartTls => HandshakeStatus::StartTls,
            State::ClientFlags | State::Options => HandshakeStatus::Negotiating,
        }
    }

    /// The most bytes one message can need: the size a receive buffer must have.
    pub fn input_bytes_max(&self) -> usize {
        OPTION_HEADER_BYTES + self.limits.option_bytes_max as usize
    }

    /// Consumes at most one client message from `input`; returns the bytes used (0: need more).
    /// On error the caller sends the pending output (it may hold an error reply) and closes.
    /// Every export is admitted (see [`ServerHandshake::handle_input_admitting`]).
    pub fn handle_input(
        &mut self,
        input: &[u8],
        exports: &[ExportInfo],
    ) -> Result<usize, HandshakeError> {
        self.handle_input_admitting(input, exports, &mut |_| true)
    }

    /// As [`ServerHandshake::handle_input`], but before the handshake ends with an export
    /// (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) `admit` is asked whether that export may take
    /// one more client (the server's limits on attached clients). A refused `GO` gets
    /// `NBD_REP_ERR_POLICY` ("The option sent by the client is forbidden by server policy")
    /// with no detail (the server logs why) and the handshake goes on; a refused
    /// `EXPORT_NAME` ends it with [`HandshakeError::Refused`], since that option has no error
    /// reply. `admit` returning true means the caller has reserved the client's place.
    pub fn handle_input_admitting(
        &mut self,
        input: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
    ) -> Result<usize, HandshakeError> {
        match self.state {
            State::ClientFlags => self.handle_client_flags(input),
            State::Options => self.handle_option(input, exports, admit),
            State::StartTls => Err(HandshakeError::TlsPending),
            State::Finished(_) => Err(HandshakeError::Finished),
        }
    }

    fn handle_client_flags(&mut self, input: &[u8]) -> Result<usize, HandshakeError> {
        let Some(flags) = Reader::new(input).u32() else {
            return Ok(0);
        };
        // "If the client sends flags the server does not understand, the server MUST close."
        if flags & !client_flags::KNOWN != 0 {
            return Err(HandshakeError::UnknownClientFlags(flags));
        }
        self.no_zeroes = flags & client_flags::NO_ZEROES != 0;
        self.fixed_newstyle = flags & client_flags::FIXED_NEWSTYLE != 0;
        // Without fixed newstyle there is no TLS ("The server MUST operate in NOTLS mode
        // unless ... the client replied with NBD_FLAG_C_FIXED_NEWSTYLE"), so a server that
        // requires TLS has nothing to offer such a client: it is closed here, before any
        // option, as nbdkit does ("client does not support fixed newstyle, but TLS is
        // required"). Answering its options would let it tell which export names exist.
        if self.policy == TlsPolicy::Require && !self.fixed_newstyle {
            return Err(HandshakeError::TlsRequiredWithoutFixedNewstyle);
        }
        self.state = State::Options;
        Ok(4)
    }

    fn handle_option(
        &mut self,
        input: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
    ) -> Result<usize, HandshakeError> {
        let mut r = Reader::new(input);
        let (Some(magic), Some(option), Some(len)) = (r.u64(), r.u32(), r.u32()) else {
            return Ok(0);
        };
        if magic != IHAVEOPT {
            return Err(HandshakeError::BadOptionMagic(magic));
        }
        if len > self.limits.option_bytes_max {
            self.error(option, rep::ERR_TOO_BIG, "option data too long");
            let max = self.limits.option_bytes_max;
            return Err(HandshakeError::OptionTooLong { option, len, max });
        }
        let Some(data) = r.take(len as usize) else {
            return Ok(0);
        };
        self.options_seen += 1;
        if self.options_seen > self.limits.options_max {
            self.error(option, rep::ERR_TOO_BIG, "too many options");
            return Err(HandshakeError::TooManyOptions(self.limits.options_max));
        }
        self.dispatch_option(option, data, exports, admit)?;
        Ok(OPTION_HEADER_BYTES + data.len())
    }

    fn dispatch_option(
        &mut self,
        option: u32,
        data: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
    ) -> Result<(), HandshakeError> {
        if self.tls_forced(option) {
            return self.refuse_before_tls(option, data);
        }
        match option {
            opt::EXPORT_NAME => return self.opt_export_name(data, exports, admit),
            // "The server MUST reply with NBD_REP_ACK" and SHOULD ignore any data.
            opt::ABORT => {
                self.reply(option, rep::ACK, &[]);
                self.state = State::Finished(HandshakeStatus::Aborted);
            }
            opt::LIST => self.opt_list(data, exports),
            opt::STARTTLS => self.opt_starttls(data),
            opt::INFO | opt::GO => self.opt_info_go(option, data, exports, admit),
            opt::STRUCTURED_REPLY => self.opt_structured_reply(data),
            opt::EXTENDED_HEADERS => self.opt_extended_headers(data),
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                self.opt_meta_context(option, data, exports)
            }
            _ => self.error(option, rep::ERR_UNSUP, "unknown option"),
        }
        Ok(())
    }

    /// The export's transmission flags as this client may see them: `NBD_FLAG_SEND_DF` "MUST
    /// [be left] clear if neither structured replies nor extended headers have been
    /// negotiated".
    fn advertised_flags(&self, export: &ExportInfo) -> u16 {
        if self.structured || self.extended {
            export.flags
        } else {
            export.flags & !transmission_flags::SEND_DF
        }
    }

    fn finish(&mut self, export: usize, name: &[u8], block_size_requested: bool, flags: u16) {
        let mode = if self.extended {
            ReplyMode::Extended
        } else if self.structured {
            ReplyMode::Structured
        } else {
            ReplyMode::Simple
        };
        let meta = match &self.meta {
            Some(m) if m.export == name && mode != ReplyMode::Simple => m.selected,
            _ => MetaSelected::NONE,
        };
        let negotiated = Negotiated {
            export,
            mode,
            meta,
            block_size_requested,
            flags,
            tls: self.tls,
        };
        self.state = State::Finished(HandshakeStatus::Done(negotiated));
    }

    fn error(&mut self, option: u32, reply_type: u32, message: &str) {
        self.reply(option, reply_type, &[message.as_bytes()]);
    }

    fn reply(&mut self, option: u32, reply_type: u32, parts: &[&[u8]]) {
        // "The server MUST NOT send NBD_REP_ERR_TLS_REQD in reply to any option if TLS has
        // already been initiated", nor ever in NOTLS mode.
        debug_assert!(reply_type != rep::ERR_TLS_REQD || (!self.tls && self.offers_tls()));
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.out.put_u64(OPTION_REPLY_MAGIC);
        self.out.put_u32(option);
        self.out.put_u32(reply_type);
        // Every part is bounded by the option limit or by STRING_BYTES_MAX, so this fits.
        self.out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
        for part in parts {
            self.out.extend_from_slice(part);
        }
    }
}
