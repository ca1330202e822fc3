//! The server's answer to each option but `NBD_OPT_ABORT`: choosing an export, listing
//! exports, the reply framing features and metadata contexts.

use super::option_data::{find_export, parse_info_request, parse_meta_request, MetaParseError};
use super::{HandshakeError, MetaSelection, ServerHandshake};
use crate::consts::{info, opt, rep};
use crate::cursor::PutBe;
use crate::meta;
use crate::types::ExportInfo;

impl ServerHandshake {
    /// `NBD_OPT_EXPORT_NAME`: enters transmission or, having no error reply, closes.
    pub(super) fn opt_export_name(
        &mut self,
        data: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
    ) -> Result<(), HandshakeError> {
        // "a client that has used NBD_OPT_EXTENDED_HEADERS ... MUST NOT use this option."
        if self.extended {
            return Err(HandshakeError::ExportNameWithExtendedHeaders);
        }
        // "If the chosen export does not exist ... the server MUST terminate the session."
        let Some(index) = find_export(exports, data) else {
            let name = String::from_utf8_lossy(data).into_owned();
            return Err(HandshakeError::UnknownExport(name));
        };
        // "If the server receives a request to enter transmission mode via
        // NBD_OPT_EXPORT_NAME on a TLS-only export when TLS has not been initiated, then as
        // this request cannot error, it MUST terminate the session."
        if self.needs_tls(&exports[index]) {
            let name = String::from_utf8_lossy(data).into_owned();
            return Err(HandshakeError::ExportNameWithoutTls(name));
        }
        if !admit(index) {
            let name = String::from_utf8_lossy(data).into_owned();
            return Err(HandshakeError::Refused(name));
        }
        let export = &exports[index];
        self.out.put_u64(export.size);
        self.out.put_u16(self.advertised_flags(export));
        if !self.no_zeroes {
            self.out.extend_from_slice(&[0u8; 124]);
        }
        let flags = self.advertised_flags(export);
        self.finish(index, data, false, flags);
        Ok(())
    }

    /// `NBD_OPT_LIST`: one `NBD_REP_SERVER` per export this client may see, then the ACK.
    pub(super) fn opt_list(&mut self, data: &[u8], exports: &[ExportInfo]) {
        // "the server SHOULD reject a request that includes data with NBD_REP_ERR_INVALID"
        if !data.is_empty() {
            return self.error(opt::LIST, rep::ERR_INVALID, "NBD_OPT_LIST carries no data");
        }
        // "The server MAY omit entries from this list if TLS has not been negotiated, the
        // server is operating in SELECTIVETLS mode, and the entry concerned is a TLS-only
        // export." In NOTLS mode such an export is out of reach for good, so it is left out too.
        for export in exports {
            if self.needs_tls(export) {
                continue;
            }
            let name = export.name.as_bytes();
            let len = (name.len() as u32).to_be_bytes();
            let parts = [&len[..], name, export.description.as_bytes()];
            self.reply(opt::LIST, rep::SERVER, &parts);
        }
        self.reply(opt::LIST, rep::ACK, &[]);
    }

    /// `NBD_OPT_INFO` / `NBD_OPT_GO`: the export's information; `GO` then enters transmission.
    pub(super) fn opt_info_go(
        &mut self,
        option: u32,
        data: &[u8],
        exports: &[ExportInfo],
        admit: &mut dyn FnMut(usize) -> bool,
    ) {
        let Some(request) = parse_info_request(data) else {
            return self.error(option, rep::ERR_INVALID, "malformed NBD_OPT_INFO/GO");
        };
        let Some(index) = find_export(exports, request.name) else {
            return self.error(option, rep::ERR_UNKNOWN, "no such export");
        };
        // No NBD_REP_INFO first: a SELECTIVETLS server "SHOULD NOT send NBD_REP_INFO replies
        // for a TLS-only export".
        if self.needs_tls(&exports[index]) {
            return self.error(option, self.needs_tls_reply(), "export requires TLS");
        }
        // Refusals say why in the server's log, not to the peer.
        if option == opt::GO && !admit(index) {
            return self.error(option, rep::ERR_POLICY, "refused by server policy");
        }
        let export = &exports[index];
        let mut item = Vec::with_capacity(16);
        item.put_u16(info::EXPORT);
        item.put_u64(export.size);
        item.put_u16(self.advertised_flags(export));
        self.reply(option, rep::INFO, &[&item]);
        if request.wants(info::NAME) {
            let kind = info::NAME.to_be_bytes();
            self.reply(option, rep::INFO, &[&kind, export.name.as_bytes()]);
        }
        if request.wants(info::DESCRIPTION) && !export.description.is_empty() {
            let kind = info::DESCRIPTION.to_be_bytes();
            self.reply(option, rep::INFO, &[&kind, export.description.as_bytes()]);
        }
        // Sent even when not asked for: the spec lets the server volunteer it, and a client
        // that ignores it gets the default-compatible minimum of 1 unless configured otherwise.
        let bs = export.block_size;
        item.clear();
        item.put_u16(info::BLOCK_SIZE);
        item.put_u32(bs.minimum);
        item.put_u32(bs.preferred);
        item.put_u32(bs.payload_max);
        self.reply(option, rep::INFO, &[&item]);
        self.reply(option, rep::ACK, &[]);
        if option == opt::GO {
            let asked = request.wants(info::BLOCK_SIZE);
            let flags = self.advertised_flags(export);
            self.finish(index, request.name, asked, flags);
        }
    }

    /// `NBD_OPT_STRUCTURED_REPLY`.
    pub(super) fn opt_structured_reply(&mut self, data: &[u8]) {
        let option = opt::STRUCTURED_REPLY;
        if !data.is_empty() {
            return self.error(option, rep::ERR_INVALID, "option carries no data");
        }
        // "NBD_REP_ERR_EXT_HEADER_REQD: The client has already successfully negotiated
        // extended headers, which takes precedence over this option."
        if self.extended {
            return self.error(option, rep::ERR_EXT_HEADER_REQD, "extended headers in use");
        }
        self.structured = true;
        self.reply(option, rep::ACK, &[]);
    }

    /// `NBD_OPT_EXTENDED_HEADERS`.
    pub(super) fn opt_extended_headers(&mut self, data: &[u8]) {
        let option = opt::EXTENDED_HEADERS;
        if !data.is_empty() {
            return self.error(option, rep::ERR_INVALID, "option carries no data");
        }
        self.extended = true;
        self.reply(option, rep::ACK, &[]);
    }

    /// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: `base:allocation` and the
    /// export's own contexts (`meta`).
    pub(super) fn opt_meta_context(&mut self, option: u32, data: &[u8], exports: &[ExportInfo]) {
        let set = option == opt::SET_META_CONTEXT;
        if set {
            // "Issuing this command replaces all previously-set metadata contexts (including
            // when this command fails)".
            self.meta = None;
        }
        // "This option MUST NOT be requested unless structured replies or extended headers
        // have been negotiated first ... a server SHOULD send NBD_REP_ERR_INVALID".
        if !self.structured && !self.extended {
            return self.error(
                option,
                rep::ERR_INVALID,
                "negotiate structured replies first",
            );
        }
        let max = self.limits.meta_queries_max;
        let request = match parse_meta_request(data, max) {
            Ok(request) => request,
            Err(MetaParseError::TooManyQueries) => {
                return self.error(option, rep::ERR_TOO_BIG, "too many queries")
            }
            Err(MetaParseError::Malformed) => {
                return self.error(option, rep::ERR_INVALID, "malformed meta context request")
            }
        };
        let Some(index) = find_export(exports, request.export) else {
            return self.error(option, rep::ERR_UNKNOWN, "no such export");
        };
        // Contexts are of no use on an export the client cannot reach, and STARTTLS forgets
        // them; NBD_REP_ERR_TLS_REQD is only for NBD_OPT_INFO, NBD_OPT_GO and
        // NBD_OPT_EXPORT_NAME ("The server MUST NOT send NBD_REP_ERR_TLS_REQD in response to
        // any option other than ...").
        if self.needs_tls(&exports[index]) {
            return self.error(option, rep::ERR_POLICY, "export requires TLS");
        }
        let export = &exports[index];
        let selected = request.named(export, !set);
        for (id, number) in selected.ids() {
            // "The metadata context ID in these replies is reserved and SHOULD be set to zero"
            // for LIST; SET returns the id BLOCK_STATUS replies will carry.
            let id = if set { id } else { 0 }.to_be_bytes();
            let name = meta::context_name(export, number).unwrap_or_default();
            self.reply(option, rep::META_CONTEXT, &[&id, name.as_bytes()]);
        }
        if set {
            let export = request.export.to_vec();
            self.meta = Some(MetaSelection { export, selected });
        }
        self.reply(option, rep::ACK, &[]);
    }
}
