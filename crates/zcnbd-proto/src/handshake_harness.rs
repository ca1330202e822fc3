//! A client stand-in for the server handshake tests: it feeds options byte by byte, as the
//! shortest reads would deliver them, and parses the replies as a client would.

use crate::consts::{client_flags, transmission_flags as tf, IHAVEOPT, NBD_MAGIC};
use crate::cursor::{PutBe, Reader};
use crate::handshake::*;
use crate::types::{BlockSize, ExportInfo};

pub(crate) fn exports() -> Vec<ExportInfo> {
    vec![
        ExportInfo {
            name: String::new(),
            description: "default disk".into(),
            size: 1 << 30,
            flags: tf::HAS_FLAGS | tf::SEND_FLUSH,
            block_size: BlockSize::default(),
            tls_only: false,
            meta_contexts: Vec::new(),
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size: 4096,
            flags: tf::HAS_FLAGS | tf::READ_ONLY,
            block_size: BlockSize::with_minimum(512),
            tls_only: false,
            meta_contexts: Vec::new(),
        },
    ]
}

/// One option reply as parsed by a client.
#[derive(Debug, PartialEq)]
pub(crate) struct OptReply {
    pub(crate) option: u32,
    pub(crate) kind: u32,
    pub(crate) data: Vec<u8>,
}

pub(crate) struct Harness {
    pub(crate) hs: ServerHandshake,
    pub(crate) exports: Vec<ExportInfo>,
    pub(crate) output: Vec<u8>,
    /// Exports admission refuses (a server's limit on attached clients), and the asks seen.
    pub(crate) refused: Vec<usize>,
    pub(crate) admissions_asked: Vec<usize>,
}

impl Harness {
    pub(crate) fn new(flags: u32) -> Self {
        Self::with_tls(flags, TlsPolicy::Unsupported)
    }

    /// A handshake under `policy` that has taken the client's `flags`.
    pub(crate) fn with_tls(flags: u32, policy: TlsPolicy) -> Self {
        let mut h = Harness {
            hs: ServerHandshake::with_tls(HandshakeLimits::default(), policy),
            exports: exports(),
            output: Vec::new(),
            refused: Vec::new(),
            admissions_asked: Vec::new(),
        };
        let greeting = h.drain();
        let mut r = Reader::new(&greeting);
        assert_eq!(r.u64(), Some(NBD_MAGIC));
        assert_eq!(r.u64(), Some(IHAVEOPT));
        assert_eq!(r.u16(), Some(3));
        assert_eq!(h.feed(&flags.to_be_bytes()), Ok(()));
        h
    }

    pub(crate) fn drain(&mut self) -> Vec<u8> {
        let out = self.hs.pending_output().to_vec();
        self.hs.consume_output(out.len());
        out
    }

    /// Feeds bytes one at a time, as the shortest possible reads would deliver them.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<(), HandshakeError> {
        let mut pending = Vec::new();
        for &b in bytes {
            pending.push(b);
            let (refused, asked) = (&self.refused, &mut self.admissions_asked);
            let mut admit = |export: usize| {
                asked.push(export);
                !refused.contains(&export)
            };
            let used = self
                .hs
                .handle_input_admitting(&pending, &self.exports, &mut admit)?;
            pending.drain(..used);
        }
        assert!(pending.is_empty(), "unconsumed input {pending:?}");
        let out = self.drain();
        self.output.extend(out);
        Ok(())
    }

    pub(crate) fn option(&mut self, option: u32, data: &[u8]) -> Result<(), HandshakeError> {
        let mut msg = Vec::new();
        msg.put_u64(IHAVEOPT);
        msg.put_u32(option);
        msg.put_u32(data.len() as u32);
        msg.extend_from_slice(data);
        self.feed(&msg)
    }

    pub(crate) fn replies(&mut self) -> Vec<OptReply> {
        let out = std::mem::take(&mut self.output);
        let mut r = Reader::new(&out);
        let mut replies = Vec::new();
        while !r.is_empty() {
            assert_eq!(r.u64(), Some(crate::consts::OPTION_REPLY_MAGIC));
            let option = r.u32().unwrap();
            let kind = r.u32().unwrap();
            let len = r.u32().unwrap() as usize;
            replies.push(OptReply {
                option,
                kind,
                data: r.take(len).unwrap().to_vec(),
            });
        }
        replies
    }
}

pub(crate) fn info_request(name: &str, items: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    d.put_u32(name.len() as u32);
    d.extend_from_slice(name.as_bytes());
    d.put_u16(items.len() as u16);
    for i in items {
        d.put_u16(*i);
    }
    d
}

pub(crate) fn meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    d.put_u32(name.len() as u32);
    d.extend_from_slice(name.as_bytes());
    d.put_u32(queries.len() as u32);
    for q in queries {
        d.put_u32(q.len() as u32);
        d.extend_from_slice(q.as_bytes());
    }
    d
}

pub(crate) const FIXED: u32 = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
