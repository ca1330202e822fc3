//! Entering transmission: the replies to `NBD_OPT_GO` (information items, then the final
//! reply) and to `NBD_OPT_EXPORT_NAME`, its fallback.

use super::{unexpected, ClientHandshake, ClientHandshakeError, State, Step};
use super::{EXPORT_NAME_REPLY_BYTES, EXPORT_NAME_ZEROES_BYTES};
use crate::client_meta::context_id_of;
use crate::client_negotiation::ClientNegotiated;
use crate::client_option::{
    check_ack, error_message, parse_info, put_option, InfoItem, OptionReply,
};
use crate::consts::{opt, rep, BASE_ALLOCATION};
use crate::cursor::Reader;
use crate::types::{BlockSize, ReplyMode};

/// What the replies to the `NBD_OPT_GO` in flight said so far.
#[derive(Debug, Default)]
pub(super) struct GoInfo {
    pub(super) export: Option<(u64, u16)>,
    pub(super) block_size: Option<BlockSize>,
    pub(super) description: Option<String>,
}

impl ClientHandshake {
    /// A reply to `NBD_OPT_GO`.
    pub(super) fn on_go_reply(
        &mut self,
        reply: OptionReply<'_>,
    ) -> Result<(), ClientHandshakeError> {
        match reply.kind {
            rep::INFO => self.on_info(reply.data),
            rep::ACK => {
                check_ack(reply)?;
                self.finish_go()
            }
            // "clients SHOULD be prepared to also handle NBD_REP_ERR_UNSUP by falling back to
            // using NBD_OPT_EXPORT_NAME; however, if the server has acknowledged a client's
            // request for NBD_OPT_EXTENDED_HEADERS, the server MUST NOT fail NBD_OPT_GO with
            // NBD_REP_ERR_UNSUP" (and such a client "MUST NOT use" EXPORT_NAME).
            rep::ERR_UNSUP if self.mode != ReplyMode::Extended => {
                let name = self.opts.export_name.as_bytes();
                put_option(&mut self.out, opt::EXPORT_NAME, &[name]);
                self.state = State::ExportName;
                Ok(())
            }
            kind if rep::is_error(kind) => {
                let message = error_message(reply.data);
                let err = match kind {
                    rep::ERR_UNKNOWN => ClientHandshakeError::ExportUnknown { message },
                    code => ClientHandshakeError::GoRefused { code, message },
                };
                Err(self.abort(err))
            }
            kind => Err(unexpected(Step::Go, kind)),
        }
    }

    pub(super) fn on_info(&mut self, data: &[u8]) -> Result<(), ClientHandshakeError> {
        // "A particular information type SHOULD only appear once": if one repeats, the last
        // one counts.
        match parse_info(data)? {
            InfoItem::Export { size, flags } => self.go.export = Some((size, flags)),
            InfoItem::BlockSize(block_size) => self.go.block_size = Some(block_size),
            InfoItem::Description(text) => {
                self.go.description = Some(String::from_utf8_lossy(text).into_owned());
            }
            InfoItem::Ignored => {}
        }
        Ok(())
    }

    pub(super) fn finish_go(&mut self) -> Result<(), ClientHandshakeError> {
        // "The server MUST send an NBD_INFO_EXPORT information type at some point before
        // sending an NBD_REP_ACK".
        let Some((size, flags)) = self.go.export else {
            return Err(ClientHandshakeError::MissingExportInfo);
        };
        let go = std::mem::take(&mut self.go);
        self.state = State::Done(self.negotiated(size, flags, go.block_size, go.description));
        Ok(())
    }

    /// What the handshake agreed on, with the export's size and flags and what `NBD_OPT_GO`
    /// said of it.
    fn negotiated(
        &mut self,
        size: u64,
        flags: u16,
        block_size: Option<BlockSize>,
        description: Option<String>,
    ) -> ClientNegotiated {
        let meta_contexts = std::mem::take(&mut self.meta_contexts);
        ClientNegotiated {
            size,
            flags,
            mode: self.mode,
            base_allocation_id: context_id_of(&meta_contexts, BASE_ALLOCATION),
            meta_contexts,
            meta_left_out: self.listing.left_out,
            block_size,
            description,
            tls: self.under_tls,
        }
    }

    /// The reply to `NBD_OPT_EXPORT_NAME`: "64 bits, size of the export in bytes (unsigned);
    /// 16 bits, transmission flags; 124 bytes, zeroes (reserved) (unless
    /// NBD_FLAG_C_NO_ZEROES was negotiated by the client)". Reserved bytes are not checked.
    pub(super) fn handle_export_name(
        &mut self,
        input: &[u8],
    ) -> Result<usize, ClientHandshakeError> {
        let zeroes = if self.no_zeroes {
            0
        } else {
            EXPORT_NAME_ZEROES_BYTES
        };
        let mut r = Reader::new(input);
        let (Some(size), Some(flags), Some(_reserved)) = (r.u64(), r.u16(), r.take(zeroes)) else {
            return Ok(0);
        };
        // Structured replies and a metadata context agreed before still hold: the spec ties
        // block status only to a final NBD_OPT_SET_META_CONTEXT that "referred to the same
        // export name that was ultimately selected for transmission phase", not to GO.
        self.state = State::Done(self.negotiated(size, flags, None, None));
        Ok(EXPORT_NAME_REPLY_BYTES + zeroes)
    }
}
