//! The client side of the fixed newstyle handshake, as a sans-IO state machine.
//!
//! It mirrors [`ServerHandshake`](crate::handshake::ServerHandshake): the caller feeds received
//! bytes to [`ClientHandshake::handle_input`], which consumes at most one server message and
//! returns how many bytes it used (0: needs more), and drains what the client must send with
//! [`ClientHandshake::pending_output`] / [`ClientHandshake::consume_output`]. Since "the client
//! MUST NOT send any option until it has received a final reply to any option it has sent", the
//! options go one at a time:
//!
//! 0. `NBD_OPT_STARTTLS`, if TLS is wanted ([`ClientTls`], built with
//!    [`ClientHandshake::with_tls`]): "A client that prefers to use TLS irrespective of whether
//!    the server makes TLS mandatory SHOULD send NBD_OPT_STARTTLS as the first option". On
//!    `NBD_REP_ACK` the status says [`ClientHandshakeStatus::StartTls`]: the caller runs the
//!    TLS handshake on the transport (bytes it holds past the ACK are the server's first TLS
//!    bytes), calls [`ClientHandshake::tls_established`], and from there on feeds decrypted
//!    bytes and encrypts the output. An error reply ends the handshake under
//!    [`ClientTls::Require`] and is passed over under [`ClientTls::Allow`];
//! 1. `NBD_OPT_EXTENDED_HEADERS`, if wanted; any error reply falls back to
//! 2. `NBD_OPT_STRUCTURED_REPLY`, if wanted and extended headers were not agreed;
//! 3. `NBD_OPT_LIST_META_CONTEXT` with the queries given to
//!    [`ClientHandshake::with_meta_list`] (such as `qemu:`), if any and either was agreed:
//!    what it lists is selected next (bounded: see `meta_list.rs`);
//! 4. `NBD_OPT_SET_META_CONTEXT` selecting `base:allocation`, the contexts given to
//!    [`ClientHandshake::with_meta_contexts`] and those listed, if any is wanted and either
//!    was agreed. Every context the server selects is kept with its id
//!    ([`ClientNegotiated::meta_contexts`]); one it does not have is absent, which is no
//!    error;
//! 5. `NBD_OPT_GO` asking for `NBD_INFO_BLOCK_SIZE` and `NBD_INFO_DESCRIPTION`, falling back
//!    to `NBD_OPT_EXPORT_NAME` if the server answers `NBD_REP_ERR_UNSUP`.
//!
//! `NBD_REP_ERR_TLS_REQD` and `NBD_REP_ERR_SHUTDOWN` end the handshake at whichever option
//! they answer: the first means the server "is unwilling to continue negotiation unless TLS is
//! initiated first", which is too late once options went out in plain text (the client asks
//! for TLS first or not at all), and the second "MUST" end it.
//!
//! When [`ClientHandshake::status`] says `Done`, bytes the caller still holds belong to the
//! transmission phase.

use crate::client_meta::{MetaContext, MetaQueries, META_CONTEXTS_SELECTED_MAX};
use crate::client_option::{
    check_ack, error_message, parse_meta_context, parse_option_reply, put_go,
    put_meta_context_option, put_option, OptionReply, OPTION_REPLY_HEADER_BYTES,
};
use crate::consts::{
    client_flags, handshake_flags, info, opt, rep, IHAVEOPT, NBD_MAGIC, OLDSTYLE_MAGIC,
    STRING_BYTES_MAX,
};
use crate::cursor::{PutBe, Reader};
use crate::types::ReplyMode;

pub use crate::client_error::ClientHandshakeError;
pub use crate::client_negotiation::{
    ClientHandshakeOptions, ClientHandshakeStatus, ClientNegotiated,
};
pub use tls::ClientTls;

/// Length of the server's greeting: `NBDMAGIC`, `IHAVEOPT`, 16-bit handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Length of the reply to `NBD_OPT_EXPORT_NAME` without the zeroes: size and flags.
pub const EXPORT_NAME_REPLY_BYTES: usize = 10;
/// The reserved zeroes after that reply unless `NBD_FLAG_C_NO_ZEROES` was agreed.
pub const EXPORT_NAME_ZEROES_BYTES: usize = 124;
/// The information `NBD_OPT_GO` asks for.
const GO_INFO_REQUESTS: [u16; 2] = [info::BLOCK_SIZE, info::DESCRIPTION];

mod go;
mod meta_list;
mod tls;

use go::GoInfo;
use meta_list::Listing;

/// The option in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    StartTls,
    ExtendedHeaders,
    StructuredReply,
    ListMetaContext,
    SetMetaContext,
    Go,
}

impl Step {
    fn option(self) -> u32 {
        match self {
            Step::StartTls => opt::STARTTLS,
            Step::ExtendedHeaders => opt::EXTENDED_HEADERS,
            Step::StructuredReply => opt::STRUCTURED_REPLY,
            Step::ListMetaContext => opt::LIST_META_CONTEXT,
            Step::SetMetaContext => opt::SET_META_CONTEXT,
            Step::Go => opt::GO,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Greeting,
    Option(Step),
    /// `NBD_OPT_STARTTLS` acknowledged: waiting for `tls_established`.
    StartTls,
    /// `NBD_OPT_EXPORT_NAME` sent: waiting for size, flags and perhaps zeroes.
    ExportName,
    Done(ClientNegotiated),
    Failed,
}

/// The client's handshake with one server.
#[derive(Debug)]
pub struct ClientHandshake {
    opts: ClientHandshakeOptions,
    tls: ClientTls,
    /// `tls_established` was called: everything since runs under TLS.
    under_tls: bool,
    state: State,
    out: Vec<u8>,
    mode: ReplyMode,
    no_zeroes: bool,
    /// Contexts asked for besides `base:allocation` (`opts.base_allocation`).
    meta: MetaQueries,
    /// Queries to list before selecting (`opts.base_allocation` aside, nothing is selected
    /// that is neither named in `meta` nor listed).
    list: MetaQueries,
    /// What the listing found.
    listing: Listing,
    /// The contexts the server selected, once it acknowledged `NBD_OPT_SET_META_CONTEXT`.
    meta_contexts: Vec<MetaContext>,
    /// Replies received to the option in flight, bounded by `option_replies_max`.
    replies_seen: u32,
    /// Contexts from the `NBD_OPT_SET_META_CONTEXT` in flight, kept on ACK; at most
    /// [`META_CONTEXTS_SELECTED_MAX`].
    meta_pending: Vec<MetaContext>,
    go: GoInfo,
}

impl ClientHandshake {
    /// A handshake waiting for the server's greeting; nothing is sent before it arrives. It
    /// does not ask for TLS ([`ClientTls::Off`]).
    pub fn new(opts: ClientHandshakeOptions) -> Self {
        Self::with_tls(opts, ClientTls::Off)
    }

    /// As [`ClientHandshake::new`], asking for TLS as `tls` says.
    pub fn with_tls(opts: ClientHandshakeOptions, tls: ClientTls) -> Self {
        ClientHandshake {
            opts,
            tls,
            under_tls: false,
            state: State::Greeting,
            out: Vec::with_capacity(256),
            mode: ReplyMode::Simple,
            no_zeroes: false,
            meta: MetaQueries::default(),
            list: MetaQueries::default(),
            listing: Listing::default(),
            meta_contexts: Vec::new(),
            replies_seen: 0,
            meta_pending: Vec::new(),
            go: GoInfo::default(),
        }
    }

    /// Also asks for the metadata contexts `queries` names (besides `base:allocation`, which
    /// `opts.base_allocation` asks for; naming it here asks for it too). Called before the
    /// greeting arrives: the list goes out with `NBD_OPT_SET_META_CONTEXT`.
    pub fn with_meta_contexts(mut self, queries: MetaQueries) -> Self {
        self.meta = queries;
        self
    }

    /// Bytes waiting to be sent to the server.
    pub fn pending_output(&self) -> &[u8] {
        &self.out
    }

    /// Marks `n` pending bytes as sent.
    pub fn consume_output(&mut self, n: usize) {
        self.out.drain(..n.min(self.out.len()));
    }

    /// Where the handshake stands.
    pub fn status(&self) -> ClientHandshakeStatus {
        match &self.state {
            State::Done(n) => ClientHandshakeStatus::Done(n.clone()),
            State::Failed => ClientHandshakeStatus::Failed,
            State::StartTls => ClientHandshakeStatus::StartTls,
            State::Greeting | State::Option(_) | State::ExportName => ClientHandshakeStatus::NeedIo,
        }
    }

    /// The most bytes one server message can need: the size a receive buffer must have.
    pub fn input_bytes_max(&self) -> usize {
        let reply_data = usize::try_from(self.opts.option_reply_bytes_max).unwrap_or(usize::MAX);
        let reply = OPTION_REPLY_HEADER_BYTES.saturating_add(reply_data);
        let export_name = EXPORT_NAME_REPLY_BYTES + EXPORT_NAME_ZEROES_BYTES;
        reply.max(export_name).max(GREETING_BYTES)
    }

    /// Consumes at most one server message from `input`; returns the bytes used (0: need more).
    ///
    /// On error the caller sends the pending output and closes: when the server refused
    /// politely (an error reply) that output ends with `NBD_OPT_ABORT`, because a client that
    /// ends the session "MUST use soft disconnect"; when the server broke the protocol there
    /// is nothing more to send. Input after `Done` or an error is refused with `Finished`.
    pub fn handle_input(&mut self, input: &[u8]) -> Result<usize, ClientHandshakeError> {
        let result = match self.state {
            State::Greeting => self.handle_greeting(input),
            State::Option(step) => self.handle_reply(step, input),
            State::ExportName => self.handle_export_name(input),
            State::StartTls => Err(ClientHandshakeError::TlsPending),
            State::Done(_) | State::Failed => return Err(ClientHandshakeError::Finished),
        };
        if result.is_err() {
            self.state = State::Failed;
        }
        result
    }

    fn handle_greeting(&mut self, input: &[u8]) -> Result<usize, ClientHandshakeError> {
        // Strings "MUST be no longer than 4096 bytes. This applies to export names".
        let name_len = self.opts.export_name.len();
        if name_len > STRING_BYTES_MAX {
            return Err(ClientHandshakeError::ExportNameTooLong(name_len));
        }
        // Each magic is checked as soon as it is in, so a peer that is no NBD server is
        // refused without waiting for the whole greeting.
        let mut r = Reader::new(input);
        let Some(magic) = r.u64() else { return Ok(0) };
        if magic != NBD_MAGIC {
            return Err(ClientHandshakeError::BadMagic(magic));
        }
        let Some(magic) = r.u64() else { return Ok(0) };
        if magic == OLDSTYLE_MAGIC {
            return Err(ClientHandshakeError::Oldstyle);
        }
        if magic != IHAVEOPT {
            return Err(ClientHandshakeError::BadNewstyleMagic(magic));
        }
        let Some(flags) = r.u16() else { return Ok(0) };
        // "NBD_FLAG_FIXED_NEWSTYLE; MUST be set by servers that support the fixed newstyle
        // protocol": this client speaks nothing older. "The client SHOULD ignore any
        // handshake flags it does not recognize."
        if flags & handshake_flags::FIXED_NEWSTYLE == 0 {
            return Err(ClientHandshakeError::NotFixedNewstyle(flags));
        }
        // "NBD_FLAG_C_NO_ZEROES; MUST NOT be set if the server did not set NBD_FLAG_NO_ZEROES."
        self.no_zeroes = flags & handshake_flags::NO_ZEROES != 0;
        let mut client = client_flags::FIXED_NEWSTYLE;
        if self.no_zeroes {
            client |= client_flags::NO_ZEROES;
        }
        self.out.put_u32(client);
        // "The client MUST NOT issue NBD_OPT_STARTTLS unless the server set flag
        // NBD_FLAG_FIXED_NEWSTYLE and the client replied with NBD_FLAG_C_FIXED_NEWSTYLE":
        // both are set by now.
        let first = match self.tls {
            ClientTls::Off => self.next_step(None),
            ClientTls::Allow | ClientTls::Require => Step::StartTls,
        };
        self.send(first);
        Ok(GREETING_BYTES)
    }

    /// The option to send after `done` (`None`: the first one after STARTTLS, if any).
    fn next_step(&self, done: Option<Step>) -> Step {
        let simple = self.mode == ReplyMode::Simple;
        // "This option MUST NOT be requested unless structured replies or extended headers
        // have been negotiated first" (NBD_OPT_SET_META_CONTEXT).
        let wanted = self.opts.base_allocation || !self.meta.is_empty() || !self.list.is_empty();
        let meta = wanted && !simple;
        let list = meta && !self.list.is_empty();
        match done {
            None if self.opts.extended_headers => Step::ExtendedHeaders,
            None | Some(Step::ExtendedHeaders) if self.opts.structured_replies && simple => {
                Step::StructuredReply
            }
            None | Some(Step::ExtendedHeaders | Step::StructuredReply) if list => {
                Step::ListMetaContext
            }
            None | Some(Step::ExtendedHeaders | Step::StructuredReply) if meta => {
                Step::SetMetaContext
            }
            _ => Step::Go,
        }
    }

    fn send(&mut self, step: Step) {
        self.replies_seen = 0;
        let name = self.opts.export_name.as_bytes();
        match step {
            Step::StartTls | Step::ExtendedHeaders | Step::StructuredReply => {
                put_option(&mut self.out, step.option(), &[]);
            }
            Step::ListMetaContext => {
                self.listing.pending.clear();
                let queries: Vec<&[u8]> = self.list.names().map(str::as_bytes).collect();
                put_meta_context_option(&mut self.out, step.option(), name, &queries);
            }
            Step::SetMetaContext => {
                self.meta_pending.clear();
                let queries = self
                    .listing
                    .set_queries(self.opts.base_allocation, &self.meta);
                let queries: Vec<&[u8]> = queries.into_iter().map(str::as_bytes).collect();
                put_meta_context_option(&mut self.out, step.option(), name, &queries);
            }
            Step::Go => {
                self.go = GoInfo::default();
                put_go(&mut self.out, name, &GO_INFO_REQUESTS);
            }
        }
        self.state = State::Option(step);
    }

    fn handle_reply(&mut self, step: Step, input: &[u8]) -> Result<usize, ClientHandshakeError> {
        let option = step.option();
        let max = self.opts.option_reply_bytes_max;
        let Some((reply, used)) = parse_option_reply(input, option, max)? else {
            return Ok(0);
        };
        self.replies_seen = self.replies_seen.saturating_add(1);
        if self.replies_seen > self.replies_max(step) {
            let max = self.replies_max(step);
            return Err(ClientHandshakeError::TooManyReplies { option, max });
        }
        self.check_refusal(step, reply)?;
        match step {
            Step::StartTls => self.on_starttls_reply(reply)?,
            Step::ExtendedHeaders => self.on_feature_reply(step, reply, ReplyMode::Extended)?,
            Step::StructuredReply => self.on_feature_reply(step, reply, ReplyMode::Structured)?,
            Step::ListMetaContext => self.on_list_reply(reply)?,
            Step::SetMetaContext => self.on_meta_reply(reply)?,
            Step::Go => self.on_go_reply(reply)?,
        }
        Ok(used)
    }

    /// Error replies that end the handshake whatever the option.
    fn check_refusal(
        &mut self,
        step: Step,
        reply: OptionReply<'_>,
    ) -> Result<(), ClientHandshakeError> {
        let message = || error_message(reply.data);
        match reply.kind {
            // "The server MUST NOT send NBD_REP_ERR_TLS_REQD in reply to any option if TLS has
            // already been initiated."
            rep::ERR_TLS_REQD if self.under_tls => Err(unexpected(step, reply.kind)),
            // "The server is unwilling to continue negotiation unless TLS is initiated first."
            rep::ERR_TLS_REQD => {
                Err(self.abort(ClientHandshakeError::TlsRequired { message: message() }))
            }
            // "If the client receives NBD_REP_ERR_SHUTDOWN it MUST initiate a soft disconnect."
            rep::ERR_SHUTDOWN => {
                Err(self.abort(ClientHandshakeError::ServerShutdown { message: message() }))
            }
            _ => Ok(()),
        }
    }

    /// The reply to `NBD_OPT_EXTENDED_HEADERS` or `NBD_OPT_STRUCTURED_REPLY`.
    fn on_feature_reply(
        &mut self,
        step: Step,
        reply: OptionReply<'_>,
        mode: ReplyMode,
    ) -> Result<(), ClientHandshakeError> {
        match reply.kind {
            rep::ACK => {
                check_ack(reply)?;
                self.mode = mode;
            }
            // "clients SHOULD be prepared to also handle NBD_REP_ERR_UNSUP; in this case, only
            // the compact transmission headers will be used": any other error means as much.
            kind if rep::is_error(kind) => {}
            kind => return Err(unexpected(step, kind)),
        }
        self.send(self.next_step(Some(step)));
        Ok(())
    }

    /// A reply to `NBD_OPT_SET_META_CONTEXT`.
    fn on_meta_reply(&mut self, reply: OptionReply<'_>) -> Result<(), ClientHandshakeError> {
        match reply.kind {
            rep::META_CONTEXT => return self.on_meta_context(reply.data),
            rep::ACK => {
                check_ack(reply)?;
                self.meta_contexts = std::mem::take(&mut self.meta_pending);
            }
            // "If an error is returned, the client MUST disregard any context replies that may
            // have been sent"; the export is still usable without block status.
            kind if rep::is_error(kind) => self.meta_pending.clear(),
            kind => return Err(unexpected(Step::SetMetaContext, kind)),
        }
        self.send(Step::Go);
        Ok(())
    }

    /// One `NBD_REP_META_CONTEXT`: kept whether or not its name is one asked for, since the
    /// query syntax "is implementation-defined" and block status will carry its id.
    fn on_meta_context(&mut self, data: &[u8]) -> Result<(), ClientHandshakeError> {
        let (id, name) = parse_meta_context(data)?;
        // "one for each selected metadata context, each with a unique metadata context ID".
        let pending = &self.meta_pending;
        if pending
            .iter()
            .any(|c| c.id == id || c.name.as_bytes() == name)
        {
            return Err(ClientHandshakeError::Malformed(
                "metadata context id or name selected twice",
            ));
        }
        if pending.len() >= META_CONTEXTS_SELECTED_MAX {
            return Err(ClientHandshakeError::Malformed(
                "more than 64 metadata contexts selected",
            ));
        }
        let name = String::from_utf8_lossy(name).into_owned();
        self.meta_pending.push(MetaContext { name, id });
        Ok(())
    }

    /// Queues `NBD_OPT_ABORT` (the soft disconnect) and hands `err` back.
    fn abort(&mut self, err: ClientHandshakeError) -> ClientHandshakeError {
        put_option(&mut self.out, opt::ABORT, &[]);
        err
    }
}

fn unexpected(step: Step, reply: u32) -> ClientHandshakeError {
    ClientHandshakeError::UnexpectedReply {
        option: step.option(),
        reply,
    }
}
