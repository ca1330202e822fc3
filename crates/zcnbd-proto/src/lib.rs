//! Sans-IO NBD protocol: the wire constants, the server and client handshake state machines,
//! request and reply codecs, request validation, and the client and server transmission
//! sessions. No sockets, no clock, no unsafe: everything here runs in a unit test.
#![forbid(unsafe_code)]

pub mod client_error;
pub mod client_handshake;
pub mod client_meta;
pub mod client_negotiation;
pub mod client_option;
pub mod client_reply;
pub mod client_session;
pub mod consts;
pub mod cursor;
pub mod handshake;
pub mod meta;
pub mod reply;
pub mod request;
pub mod server_event;
pub mod server_session;
pub mod types;
pub mod validate;

#[cfg(test)]
mod client_handshake_tests;
#[cfg(test)]
mod client_meta_list_tests;
#[cfg(test)]
mod client_meta_tests;
#[cfg(test)]
mod client_option_tests;
#[cfg(test)]
mod client_pair;
#[cfg(test)]
mod client_pair_tests;
#[cfg(test)]
mod client_pair_tls_tests;
#[cfg(test)]
mod client_session_tests;
#[cfg(test)]
mod client_tls_tests;
#[cfg(test)]
mod handshake_harness;
#[cfg(test)]
mod handshake_tests;
#[cfg(test)]
mod handshake_tls_tests;
#[cfg(test)]
mod server_session_end_tests;
#[cfg(test)]
mod server_session_sweep_tests;
#[cfg(test)]
mod server_session_tests;
#[cfg(test)]
mod test_rng;
#[cfg(test)]
mod transmission_pair_client;
#[cfg(test)]
mod transmission_pair_server;
#[cfg(test)]
mod transmission_pair_tests;

pub use client_handshake::{
    ClientHandshake, ClientHandshakeError, ClientHandshakeOptions, ClientHandshakeStatus,
    ClientNegotiated, ClientTls,
};
pub use client_meta::{MetaContext, MetaQueries, MetaQueryError};
pub use client_session::{
    ClientSession, ReplyEvent, ReplyFailure, Request, SessionError, SessionLimits, Violation, Want,
};
pub use handshake::{
    HandshakeError, HandshakeLimits, HandshakeStatus, Negotiated, ServerHandshake, TlsPolicy,
};
pub use reply::{ReplyHeader, ReplyTo};
pub use request::{RequestError, RequestHeader};
pub use server_session::{CutShort, EndReason, ServerEvent, ServerSession, ServerWant};
pub use types::{BlockSize, Command, Errno, ExportInfo, Extent, ReplyMode};
pub use validate::{validate_request, Rejection, TransmissionContext};
