//! Deterministic inputs for the fuzz targets, random but shaped like the protocol: real
//! magics and option codes, lengths that agree with their data (mostly), offsets and lengths
//! at the edges that matter. A tiny PRNG keeps every run identical and needs no dependency.

use zcnbd_proto::consts::{
    cmd_flags, opt, EXTENDED_REPLY_MAGIC, EXTENDED_REQUEST_MAGIC, IHAVEOPT, REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};
use zcnbd_proto::cursor::PutBe;
use zcnbd_proto::ReplyMode;

/// xorshift64*: small, fast, and the same sequence on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn chance(&mut self, numerator: u64, denominator: u64) -> bool {
        self.below(denominator) < numerator
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Offsets and lengths at the edges that matter: zero, block sizes, the exports' sizes, the
/// 32- and 64-bit limits.
const EDGES: [u64; 13] = [
    0,
    1,
    511,
    512,
    4096,
    65536,
    (1 << 20) - 4096,
    1 << 20,
    (1 << 20) + 512,
    u32::MAX as u64,
    1 << 32,
    !4095,
    u64::MAX,
];

fn gen_u64(rng: &mut Rng) -> u64 {
    match rng.below(4) {
        0 => rng.next(),
        1 => rng.below(1 << 20) & !511,
        _ => rng.pick(&EDGES),
    }
}

fn gen_string(rng: &mut Rng) -> Vec<u8> {
    match rng.below(8) {
        0 => {
            let len = rng.below(16) as usize;
            rng.bytes(len)
        }
        1 => b"base:".to_vec(),
        2 => b"base:allocation".to_vec(),
        3 => b"qemu:dirty-bitmap:x".to_vec(),
        _ => rng
            .pick(&["", "ro", "null", "b512", "nope"])
            .as_bytes()
            .to_vec(),
    }
}

fn put_string(rng: &mut Rng, out: &mut Vec<u8>) {
    let s = gen_string(rng);
    let len = if rng.chance(1, 16) {
        rng.next() as u32
    } else {
        s.len() as u32
    };
    out.put_u32(len);
    out.extend_from_slice(&s);
}

/// Appends one option, usually well formed, with data shaped for its code.
pub fn gen_option(rng: &mut Rng, out: &mut Vec<u8>) {
    let codes = [
        opt::EXPORT_NAME,
        opt::ABORT,
        opt::LIST,
        opt::STARTTLS,
        opt::INFO,
        opt::GO,
        opt::STRUCTURED_REPLY,
        opt::LIST_META_CONTEXT,
        opt::SET_META_CONTEXT,
        opt::EXTENDED_HEADERS,
        0,
        12,
        rng.next() as u32,
    ];
    let code = rng.pick(&codes);
    let mut data = Vec::new();
    match code {
        opt::INFO | opt::GO => {
            put_string(rng, &mut data);
            let count = rng.below(5);
            data.put_u16(if rng.chance(1, 8) {
                rng.next() as u16
            } else {
                count as u16
            });
            for _ in 0..count {
                data.put_u16(rng.below(5) as u16);
            }
        }
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
            put_string(rng, &mut data);
            let count = rng.below(7);
            data.put_u32(if rng.chance(1, 8) {
                rng.next() as u32
            } else {
                count as u32
            });
            for _ in 0..count {
                put_string(rng, &mut data);
            }
        }
        opt::EXPORT_NAME => data = gen_string(rng),
        _ if rng.chance(1, 4) => {
            let len = rng.pick(&[1, 8, 1025]);
            data = rng.bytes(len);
        }
        _ => {}
    }
    if rng.chance(1, 20) {
        out.put_u64(rng.next());
    } else {
        out.put_u64(IHAVEOPT);
    }
    out.put_u32(code);
    out.put_u32(match rng.below(16) {
        0 => rng.next() as u32,
        1 => (data.len() as u32).saturating_sub(1),
        2 => data.len() as u32 + 1,
        _ => data.len() as u32,
    });
    out.extend_from_slice(&data);
}

/// Appends one request header for `mode`, and with `payloads` the payload a write carries.
pub fn gen_request(rng: &mut Rng, mode: ReplyMode, payloads: bool, out: &mut Vec<u8>) {
    let extended = mode == ReplyMode::Extended;
    let magic = match rng.below(32) {
        0 => rng.next() as u32,
        1 => REQUEST_MAGIC,
        2 => EXTENDED_REQUEST_MAGIC,
        _ if extended => EXTENDED_REQUEST_MAGIC,
        _ => REQUEST_MAGIC,
    };
    let flags = match rng.below(8) {
        0 => rng.next() as u16,
        1..=3 => 0,
        _ => rng.next() as u16 & 0x3f,
    };
    let kind = if rng.chance(1, 16) {
        rng.next() as u16
    } else {
        rng.below(9) as u16
    };
    let (offset, length) = (gen_u64(rng), gen_u64(rng));
    out.put_u32(magic);
    out.put_u16(flags);
    out.put_u16(kind);
    out.put_u64(rng.below(4));
    out.put_u64(offset);
    let length = if extended {
        out.put_u64(length);
        length
    } else {
        out.put_u32(length as u32);
        u64::from(length as u32)
    };
    let carries = kind == 1 || (extended && flags & cmd_flags::PAYLOAD_LEN != 0);
    if payloads && carries {
        // Whole payloads when small; a truncated one ends the stream early.
        let len = if length <= 8192 {
            length
        } else {
            rng.below(64)
        };
        out.extend(rng.bytes(len as usize));
    }
}

/// Appends one reply header (and a chunk's payload) for `mode`.
pub fn gen_reply(rng: &mut Rng, mode: ReplyMode, out: &mut Vec<u8>) {
    let any = rng.next();
    let magic = match (rng.below(8), mode) {
        (0, _) => rng.pick(&[
            SIMPLE_REPLY_MAGIC,
            STRUCTURED_REPLY_MAGIC,
            EXTENDED_REPLY_MAGIC,
            any as u32,
        ]),
        (_, ReplyMode::Simple) => SIMPLE_REPLY_MAGIC,
        (1, ReplyMode::Structured) => SIMPLE_REPLY_MAGIC,
        (_, ReplyMode::Structured) => STRUCTURED_REPLY_MAGIC,
        (_, ReplyMode::Extended) => EXTENDED_REPLY_MAGIC,
    };
    out.put_u32(magic);
    if magic == SIMPLE_REPLY_MAGIC {
        out.put_u32(rng.pick(&[0, 1, 22, any as u32]));
        out.put_u64(rng.next());
        return;
    }
    out.put_u16(rng.below(4) as u16);
    out.put_u16(rng.pick(&[0, 1, 2, 5, 6, 0x8001, 0x8002, any as u16]));
    out.put_u64(rng.next());
    let small = rng.below(64);
    let length = rng.pick(&[0, 8, 12, 20, small, any]);
    if magic == EXTENDED_REPLY_MAGIC {
        out.put_u64(gen_u64(rng));
        out.put_u64(length);
    } else {
        out.put_u32(length as u32);
    }
    let len = length.min(64) as usize;
    out.extend(rng.bytes(len));
}

/// Sometimes cuts the input short or flips a few bytes.
pub fn mutate(rng: &mut Rng, input: &mut Vec<u8>) {
    if input.is_empty() {
        return;
    }
    if rng.chance(1, 4) {
        let at = rng.below(input.len() as u64) as usize;
        input.truncate(at);
    }
    if rng.chance(1, 4) {
        for _ in 0..1 + rng.below(3) {
            if let Some(len) = std::num::NonZeroUsize::new(input.len()) {
                let at = rng.below(len.get() as u64) as usize;
                input[at] ^= 1 << rng.below(8);
            }
        }
    }
}
