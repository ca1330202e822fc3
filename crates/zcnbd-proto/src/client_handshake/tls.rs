//! STARTTLS on the client side: whether to ask for TLS, the server's answer, and the stop
//! while the caller runs the TLS handshake.
//!
//! The TLS handshake itself is the caller's: this module only says when it is due and learns
//! when it is done (see the [`client_handshake`](super) module documentation).

use super::{ClientHandshake, ClientHandshakeError, State, Step};
use crate::client_option::{check_ack, error_message, OptionReply};
use crate::consts::rep;

/// Whether the client upgrades the session to TLS (libnbd's `nbd_set_tls` levels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientTls {
    /// Never asks for TLS (`LIBNBD_TLS_DISABLE`).
    #[default]
    Off,
    /// Asks for TLS first and goes on in plain text if the server refuses
    /// (`LIBNBD_TLS_ALLOW`): "the client MUST either continue the session without TLS, or
    /// terminate the session".
    Allow,
    /// Asks for TLS first and ends the handshake if the server refuses
    /// (`LIBNBD_TLS_REQUIRE`): "a client which only wishes to use TLS SHOULD terminate the
    /// session if the NBD_OPT_STARTTLS replies with an error".
    Require,
}

impl ClientHandshake {
    /// Whether the session runs under TLS: [`Self::tls_established`] was called.
    pub fn is_tls(&self) -> bool {
        self.under_tls
    }

    /// Tells the handshake the TLS handshake the server acknowledged succeeded: the options go
    /// on, under TLS, and the next one is pending output. It is only due while `status` says
    /// [`ClientHandshakeStatus::StartTls`](super::ClientHandshakeStatus::StartTls) with no
    /// output pending; otherwise nothing changes and [`ClientHandshakeError::TlsNotDue`] is
    /// returned.
    pub fn tls_established(&mut self) -> Result<(), ClientHandshakeError> {
        if self.state != State::StartTls || !self.out.is_empty() {
            return Err(ClientHandshakeError::TlsNotDue);
        }
        self.under_tls = true;
        self.send(self.next_step(None));
        Ok(())
    }

    /// The reply to `NBD_OPT_STARTTLS`.
    pub(super) fn on_starttls_reply(
        &mut self,
        reply: OptionReply<'_>,
    ) -> Result<(), ClientHandshakeError> {
        match reply.kind {
            // "If the client receives NBD_REP_ACK in response, it MUST immediately upgrade the
            // session to TLS."
            rep::ACK => {
                check_ack(reply)?;
                self.state = State::StartTls;
                Ok(())
            }
            // "If it receives NBD_REP_ERR_UNSUP, NBD_REP_ERR_POLICY or any other error in
            // response, it indicates that the server cannot or will not upgrade the session
            // to TLS".
            code if rep::is_error(code) => match self.tls {
                ClientTls::Require => {
                    let message = error_message(reply.data);
                    Err(self.abort(ClientHandshakeError::TlsRefused { code, message }))
                }
                _ => {
                    self.send(self.next_step(None));
                    Ok(())
                }
            },
            kind => Err(super::unexpected(Step::StartTls, kind)),
        }
    }
}
