//! STARTTLS on the server side: the TLS policy (the spec's NOTLS, SELECTIVETLS and FORCEDTLS
//! modes), `NBD_OPT_STARTTLS` itself, and what a client that has not initiated TLS may see.
//!
//! The TLS handshake itself is the caller's: this module only says when it is due and learns
//! when it is done (see the [`handshake`](super) module documentation for the event flow).

use super::{HandshakeError, ServerHandshake, State};
use crate::consts::{opt, rep};
use crate::types::ExportInfo;

/// How the server offers TLS. It holds for the whole connection, since the server "MUST be
/// consistent in its mode of operation across the lifespan of a single TCP connection".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsPolicy {
    /// NOTLS, on a server that cannot do TLS at all: `NBD_OPT_STARTTLS` gets
    /// `NBD_REP_ERR_UNSUP` ("if it does not support the NBD_OPT_STARTTLS option at all").
    #[default]
    Unsupported,
    /// NOTLS by configuration: `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_POLICY` ("if it does not
    /// support TLS for policy reasons"), as nbdkit built with TLS answers under `--tls=off`.
    Off,
    /// SELECTIVETLS: TLS is offered; a plain-text client may use every export not marked
    /// [`ExportInfo::tls_only`].
    On,
    /// FORCEDTLS: before TLS, every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` is
    /// refused with `NBD_REP_ERR_TLS_REQD`.
    Require,
}

impl TlsPolicy {
    /// Whether a client's `NBD_OPT_STARTTLS` is acknowledged under this policy.
    pub fn offers_tls(self) -> bool {
        matches!(self, TlsPolicy::On | TlsPolicy::Require)
    }
}

impl ServerHandshake {
    /// The policy this handshake was built with.
    pub fn tls_policy(&self) -> TlsPolicy {
        self.policy
    }

    /// Whether the session runs under TLS: [`Self::tls_established`] was called.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// Tells the handshake the TLS handshake the last `NBD_OPT_STARTTLS` asked for succeeded:
    /// option haggling goes on, under TLS. It is only due once `status` said
    /// [`HandshakeStatus::StartTls`](super::HandshakeStatus::StartTls) and the pending output
    /// (the `NBD_REP_ACK`, which must go out in plain text) has all been consumed; otherwise
    /// nothing changes and [`HandshakeError::TlsNotDue`] is returned.
    pub fn tls_established(&mut self) -> Result<(), HandshakeError> {
        if self.state != State::StartTls || !self.out.is_empty() {
            return Err(HandshakeError::TlsNotDue);
        }
        self.tls = true;
        self.state = State::Options;
        Ok(())
    }

    /// Whether TLS is possible on this connection. "The server MUST operate in NOTLS mode
    /// unless the server set flag NBD_FLAG_FIXED_NEWSTYLE and the client replied with
    /// NBD_FLAG_C_FIXED_NEWSTYLE".
    pub(super) fn offers_tls(&self) -> bool {
        self.policy.offers_tls() && self.fixed_newstyle
    }

    /// `NBD_OPT_STARTTLS`.
    pub(super) fn opt_starttls(&mut self, data: &[u8]) {
        let option = opt::STARTTLS;
        // "The client MUST NOT send any additional data with the option. The server MUST
        // either reply with NBD_REP_ACK ... or an error reply explicitly permitted by this
        // document (for example, NBD_REP_ERR_INVALID if the client included data)." Checked
        // first: NBD_REP_ERR_POLICY is for an option that is "syntactically valid".
        if !data.is_empty() {
            return self.error(option, rep::ERR_INVALID, "NBD_OPT_STARTTLS carries no data");
        }
        if !self.offers_tls() {
            return match self.policy {
                TlsPolicy::Unsupported => self.error(option, rep::ERR_UNSUP, "TLS not supported"),
                _ => self.error(option, rep::ERR_POLICY, "TLS not offered"),
            };
        }
        // "If the server receives NBD_OPT_STARTTLS when TLS has already been negotiated, it
        // MUST reply with NBD_REP_ERR_INVALID."
        if self.tls {
            return self.error(option, rep::ERR_INVALID, "TLS already negotiated");
        }
        // "If the server receives NBD_OPT_STARTTLS prior to negotiating TLS, it MUST reply
        // with NBD_REP_ACK."
        self.reply(option, rep::ACK, &[]);
        // "When this command succeeds, the server MUST NOT preserve any negotiation state
        // (such as a request for NBD_OPT_STRUCTURED_REPLY, or metadata contexts from
        // NBD_OPT_SET_META_CONTEXT) issued before this command."
        self.structured = false;
        self.extended = false;
        self.meta = None;
        self.state = State::StartTls;
    }

    /// Whether FORCEDTLS refuses `option` now: before TLS, everything but `NBD_OPT_STARTTLS`
    /// and `NBD_OPT_ABORT`.
    pub(super) fn tls_forced(&self, option: u32) -> bool {
        self.policy == TlsPolicy::Require
            && self.offers_tls()
            && !self.tls
            && option != opt::STARTTLS
            && option != opt::ABORT
    }

    /// Refuses `option` under FORCEDTLS before TLS.
    pub(super) fn refuse_before_tls(
        &mut self,
        option: u32,
        data: &[u8],
    ) -> Result<(), HandshakeError> {
        // "If the server receives a request to enter transmission mode via
        // NBD_OPT_EXPORT_NAME when TLS has not been initiated, then as this request cannot
        // error, it MUST terminate the session."
        if option == opt::EXPORT_NAME {
            let name = String::from_utf8_lossy(data).into_owned();
            return Err(HandshakeError::ExportNameWithoutTls(name));
        }
        // "If the server receives any other option, including NBD_OPT_INFO and unsupported
        // options, it MUST reply with NBD_REP_ERR_TLS_REQD if TLS has not been initiated";
        // for NBD_OPT_GO too, "it MUST error with NBD_REP_ERR_TLS_REQD".
        self.error(option, rep::ERR_TLS_REQD, "TLS required");
        Ok(())
    }

    /// Whether `export` is out of this client's reach until TLS: a TLS-only export, or any
    /// export under FORCEDTLS (also when the client cannot do TLS, lacking fixed newstyle).
    pub(super) fn needs_tls(&self, export: &ExportInfo) -> bool {
        !self.tls && (export.tls_only || self.policy == TlsPolicy::Require)
    }

    /// The error reply to `NBD_OPT_INFO` / `NBD_OPT_GO` for an export that [`Self::needs_tls`].
    /// A SELECTIVETLS server "MUST reply with NBD_REP_ERR_TLS_REQD if that export is
    /// TLS-only"; in NOTLS mode it "MUST NOT respond to any option request with
    /// NBD_REP_ERR_TLS_REQD", so such an export is refused by policy.
    pub(super) fn needs_tls_reply(&self) -> u32 {
        if self.offers_tls() {
            rep::ERR_TLS_REQD
        } else {
            rep::ERR_POLICY
        }
    }
}
