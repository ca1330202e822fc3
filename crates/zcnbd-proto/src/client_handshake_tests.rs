//! The client handshake against scripted servers: hand-written byte sequences for greetings and
//! option paths a `ServerHandshake` never takes. The helpers serve `client_reply_tests` too.

use crate::client_handshake::*;
use crate::client_meta::MetaContext;
use crate::consts::{
    handshake_flags as hf, info, opt, rep, transmission_flags as tf, IHAVEOPT, NBD_MAGIC,
    OLDSTYLE_MAGIC, OPTION_REPLY_MAGIC,
};
use crate::cursor::{PutBe, Reader};
use crate::types::{BlockSize, ReplyMode};

pub(crate) type E = ClientHandshakeError;

pub(crate) const BOTH: u16 = hf::FIXED_NEWSTYLE | hf::NO_ZEROES;

pub(crate) fn greeting(flags: u16) -> Vec<u8> {
    let mut g = Vec::new();
    g.put_u64(NBD_MAGIC);
    g.put_u64(IHAVEOPT);
    g.put_u16(flags);
    g
}

pub(crate) fn reply(option: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.put_u64(OPTION_REPLY_MAGIC);
    m.put_u32(option);
    m.put_u32(kind);
    m.put_u32(data.len() as u32);
    m.extend_from_slice(data);
    m
}

pub(crate) fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut d = Vec::new();
    d.put_u16(info::EXPORT);
    d.put_u64(size);
    d.put_u16(flags);
    reply(opt::GO, rep::INFO, &d)
}

pub(crate) fn info_block_size(minimum: u32, preferred: u32, payload_max: u32) -> Vec<u8> {
    let mut d = Vec::new();
    d.put_u16(info::BLOCK_SIZE);
    [minimum, preferred, payload_max]
        .iter()
        .for_each(|v| d.put_u32(*v));
    reply(opt::GO, rep::INFO, &d)
}

pub(crate) fn meta_context(id: u32, name: &str) -> Vec<u8> {
    let data = [&id.to_be_bytes()[..], name.as_bytes()].concat();
    reply(opt::SET_META_CONTEXT, rep::META_CONTEXT, &data)
}

pub(crate) const FLAGS: u16 = tf::HAS_FLAGS | tf::SEND_FLUSH;

/// A client under test and everything it has sent.
pub(crate) struct Script {
    pub(crate) c: ClientHandshake,
    pub(crate) sent: Vec<u8>,
}

impl Script {
    pub(crate) fn new(opts: ClientHandshakeOptions) -> Self {
        Script {
            c: ClientHandshake::new(opts),
            sent: Vec::new(),
        }
    }

    /// A client that has sent `NBD_OPT_GO` for "disk" straight after the greeting.
    pub(crate) fn at_go(greeting_flags: u16) -> Self {
        let mut s = Script::new(ClientHandshakeOptions {
            export_name: "disk".into(),
            extended_headers: false,
            structured_replies: false,
            ..ClientHandshakeOptions::default()
        });
        s.feed(&greeting(greeting_flags)).unwrap();
        assert_eq!(s.last_option().0, opt::GO);
        s
    }

    /// Feeds `bytes` one at a time, as the shortest reads would; all must be consumed.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<(), E> {
        let mut pending = Vec::new();
        let result = bytes.iter().try_for_each(|&b| {
            pending.push(b);
            let used = self.c.handle_input(&pending)?;
            pending.drain(..used);
            Ok(())
        });
        let out = self.c.pending_output().to_vec();
        self.c.consume_output(out.len());
        self.sent.extend(out);
        result?;
        assert!(pending.is_empty(), "unconsumed input {pending:?}");
        Ok(())
    }

    pub(crate) fn client_flags(&self) -> u32 {
        Reader::new(&self.sent).u32().unwrap()
    }

    /// Every option sent so far: (option, data).
    pub(crate) fn options(&self) -> Vec<(u32, Vec<u8>)> {
        let mut r = Reader::new(self.sent.get(4..).unwrap_or_default());
        let mut options = Vec::new();
        while !r.is_empty() {
            assert_eq!(r.u64(), Some(IHAVEOPT));
            let option = r.u32().unwrap();
            let len = r.u32().unwrap() as usize;
            options.push((option, r.take(len).unwrap().to_vec()));
        }
        options
    }

    pub(crate) fn last_option(&self) -> (u32, Vec<u8>) {
        self.options().pop().unwrap()
    }

    pub(crate) fn negotiated(&self) -> ClientNegotiated {
        match self.c.status() {
            ClientHandshakeStatus::Done(n) => n,
            other => panic!("not done: {other:?}"),
        }
    }

    /// Checks the handshake failed with `err` and whether it queued `NBD_OPT_ABORT`.
    pub(crate) fn assert_failed(&self, result: Result<(), E>, err: E, aborted: bool) {
        assert_eq!(result, Err(err));
        assert_eq!(self.c.status(), ClientHandshakeStatus::Failed);
        let last = self.options().pop().map(|o| o.0);
        assert_eq!(last == Some(opt::ABORT), aborted, "{:?}", self.options());
    }
}

#[test]
fn greeting_without_fixed_newstyle_or_with_bad_magic_is_refused() {
    let mut s = Script::new(ClientHandshakeOptions::default());
    let result = s.feed(&greeting(hf::NO_ZEROES));
    assert_eq!(result, Err(E::NotFixedNewstyle(hf::NO_ZEROES)));
    assert!(s.sent.is_empty());
    assert_eq!(s.c.handle_input(&[0; 18]), Err(E::Finished));

    // A wrong first magic is refused as soon as its 8 bytes are in.
    let mut s = Script::new(ClientHandshakeOptions::default());
    assert_eq!(s.feed(b"HTTP/1.1"), Err(E::BadMagic(0x4854_5450_2f31_2e31)));

    let mut oldstyle = Vec::new();
    oldstyle.put_u64(NBD_MAGIC);
    oldstyle.put_u64(OLDSTYLE_MAGIC);
    let mut s = Script::new(ClientHandshakeOptions::default());
    assert_eq!(s.feed(&oldstyle), Err(E::Oldstyle));

    let mut s = Script::new(ClientHandshakeOptions::default());
    let mut bad = greeting(BOTH);
    bad[15] ^= 1;
    assert_eq!(s.feed(&bad), Err(E::BadNewstyleMagic(IHAVEOPT ^ 1)));
    assert_eq!(s.c.status(), ClientHandshakeStatus::Failed);
}

#[test]
fn client_flags_follow_the_server_and_unknown_flags_are_ignored() {
    for (server, client) in [(hf::FIXED_NEWSTYLE, 1), (BOTH, 3), (0x8000 | BOTH, 3)] {
        let mut s = Script::new(ClientHandshakeOptions::default());
        s.feed(&greeting(server)).unwrap();
        assert_eq!(s.client_flags(), client);
        assert_eq!(s.options(), [(opt::EXTENDED_HEADERS, vec![])]);
    }
}

#[test]
fn full_negotiation_with_every_info_item() {
    let mut s = Script::new(ClientHandshakeOptions {
        export_name: "disk".into(),
        ..ClientHandshakeOptions::default()
    });
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ACK, &[]))
        .unwrap();
    let mut meta = Vec::new();
    meta.put_u32(4);
    meta.extend_from_slice(b"disk");
    meta.put_u32(1);
    meta.put_u32(15);
    meta.extend_from_slice(b"base:allocation");
    assert_eq!(s.last_option(), (opt::SET_META_CONTEXT, meta));
    s.feed(&meta_context(9, "other:context")).unwrap();
    s.feed(&meta_context(7, "base:allocation")).unwrap();
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ACK, &[]))
        .unwrap();
    let go = [&[0, 0, 0, 4][..], b"disk", &[0, 2, 0, 3, 0, 2]].concat();
    assert_eq!(s.last_option(), (opt::GO, go));
    s.feed(&info_block_size(512, 4096, 1 << 25)).unwrap();
    let name = [&info::NAME.to_be_bytes()[..], b"canonical"].concat();
    s.feed(&reply(opt::GO, rep::INFO, &name)).unwrap();
    let description = [&info::DESCRIPTION.to_be_bytes()[..], b"a \xffdisk"].concat();
    s.feed(&reply(opt::GO, rep::INFO, &description)).unwrap();
    s.feed(&reply(opt::GO, rep::INFO, &[0, 99, 1, 2, 3]))
        .unwrap();
    s.feed(&info_export(1 << 40, FLAGS)).unwrap();
    assert_eq!(s.c.status(), ClientHandshakeStatus::NeedIo);
    // The ACK and the first transmission bytes arrive together: only the ACK is consumed.
    let mut tail = reply(opt::GO, rep::ACK, &[]);
    tail.extend_from_slice(&[0x67, 0x44]);
    assert_eq!(s.c.handle_input(&tail), Ok(20));
    assert_eq!(
        s.negotiated(),
        ClientNegotiated {
            size: 1 << 40,
            flags: FLAGS,
            mode: ReplyMode::Extended,
            base_allocation_id: Some(7),
            // A context not asked for is kept: the server selected it.
            meta_contexts: vec![
                MetaContext {
                    name: "other:context".into(),
                    id: 9
                },
                MetaContext {
                    name: "base:allocation".into(),
                    id: 7
                },
            ],
            meta_left_out: 0,
            block_size: Some(BlockSize {
                minimum: 512,
                preferred: 4096,
                payload_max: 1 << 25
            }),
            description: Some("a \u{fffd}disk".into()),
            tls: false,
        }
    );
    assert_eq!(s.c.handle_input(&tail[20..]), Err(E::Finished));
}

#[test]
fn extended_headers_refused_then_structured_replies_accepted() {
    let mut s = Script::new(ClientHandshakeOptions::default());
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ERR_UNSUP, b"old server"))
        .unwrap();
    assert_eq!(s.last_option(), (opt::STRUCTURED_REPLY, vec![]));
    s.feed(&reply(opt::STRUCTURED_REPLY, rep::ACK, &[]))
        .unwrap();
    assert_eq!(s.last_option().0, opt::SET_META_CONTEXT);
    // A failed SET_META_CONTEXT leaves no context, whatever it sent first, and GO goes on.
    s.feed(&meta_context(7, "base:allocation")).unwrap();
    s.feed(&reply(opt::SET_META_CONTEXT, rep::ERR_POLICY, &[]))
        .unwrap();
    assert_eq!(s.last_option().0, opt::GO);
    s.feed(&info_export(4096, FLAGS)).unwrap();
    s.feed(&reply(opt::GO, rep::ACK, &[])).unwrap();
    let n = s.negotiated();
    assert_eq!(
        (n.mode, n.base_allocation_id),
        (ReplyMode::Structured, None)
    );
    assert_eq!((n.block_size, n.description), (None, None));
}

#[test]
fn nothing_agreed_skips_the_metadata_context() {
    let mut s = Script::new(ClientHandshakeOptions {
        structured_replies: false,
        ..ClientHandshakeOptions::default()
    });
    s.feed(&greeting(BOTH)).unwrap();
    s.feed(&reply(opt::EXTENDED_HEADERS, rep::ERR_INVALID, &[]))
        .unwrap();
    assert_eq!(s.last_option().0, opt::GO);
    s.feed(&info_export(4096, FLAGS)).unwrap();
    s.feed(&reply(opt::GO, rep::ACK, &[])).unwrap();
    assert_eq!(s.negotiated().mode, ReplyMode::Simple);
}
