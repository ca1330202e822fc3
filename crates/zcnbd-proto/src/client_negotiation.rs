//! What the client asks for in the handshake, and what it ends up with.

use crate::client_meta::{context_id_of, MetaContext};
use crate::types::{BlockSize, ReplyMode};

/// What the client asks for, and the limits it holds the server to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHandshakeOptions {
    /// The export to select; "" is the default export. At most 4096 bytes.
    pub export_name: String,
    /// Ask for `NBD_OPT_STRUCTURED_REPLY` (when extended headers are off or refused).
    pub structured_replies: bool,
    /// Ask for `NBD_OPT_EXTENDED_HEADERS` first.
    pub extended_headers: bool,
    /// Select the `base:allocation` metadata context (only once replies can carry it). More
    /// contexts are asked for with
    /// [`ClientHandshake::with_meta_contexts`](crate::ClientHandshake::with_meta_contexts).
    pub base_allocation: bool,
    /// Largest option reply payload accepted; a larger one ends the handshake.
    pub option_reply_bytes_max: u32,
    /// Most replies accepted to one option (info items, contexts and the final reply).
    pub option_replies_max: u32,
}

impl Default for ClientHandshakeOptions {
    fn default() -> Self {
        ClientHandshakeOptions {
            export_name: String::new(),
            structured_replies: true,
            extended_headers: true,
            base_allocation: true,
            option_reply_bytes_max: 64 * 1024,
            option_replies_max: 64,
        }
    }
}

/// What the handshake agreed on, once the client entered transmission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientNegotiated {
    /// Size of the export in bytes.
    pub size: u64,
    /// Transmission flags, as the server sent them.
    pub flags: u16,
    /// Reply framing.
    pub mode: ReplyMode,
    /// The id the server gave `base:allocation`, if it selected it.
    pub base_allocation_id: Option<u32>,
    /// Every metadata context the server selected (`base:allocation` too), in the order it
    /// sent them; a context asked for and not listed is one the server does not have.
    pub meta_contexts: Vec<MetaContext>,
    /// Contexts a listing ([`ClientHandshake::with_meta_list`](crate::ClientHandshake::with_meta_list))
    /// found and did not ask for: more than one selection may ask for, or names that cannot
    /// be selected (wildcards, malformed).
    pub meta_left_out: u32,
    /// Size constraints from `NBD_INFO_BLOCK_SIZE`; the client promised to obey them.
    pub block_size: Option<BlockSize>,
    /// The export's description from `NBD_INFO_DESCRIPTION` (invalid UTF-8 replaced).
    pub description: Option<String>,
    /// Whether the session runs under TLS (the options that chose the export did too).
    pub tls: bool,
}

impl ClientNegotiated {
    /// The id the server gave context `name` on this connection, if it selected it.
    pub fn meta_context_id(&self, name: &str) -> Option<u32> {
        context_id_of(&self.meta_contexts, name)
    }
}

/// Where the handshake stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientHandshakeStatus {
    /// Still haggling: send the pending output, feed what arrives.
    NeedIo,
    /// The server acknowledged `NBD_OPT_STARTTLS`: run the TLS handshake on the transport
    /// (bytes held past the `NBD_REP_ACK` are the server's first TLS bytes), then call
    /// [`ClientHandshake::tls_established`](crate::ClientHandshake::tls_established). If TLS
    /// fails, close: "it is too late to continue without TLS".
    StartTls,
    /// Transmission starts after the pending output is sent.
    Done(ClientNegotiated),
    /// `handle_input` returned an error; send the pending output and close.
    Failed,
}
