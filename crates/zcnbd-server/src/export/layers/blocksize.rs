//! The blocksize layer (`--filter blocksize`, nbdkit-blocksize-filter): clients may send any
//! request, and the stack below sees only requests aligned to `minblock` and no larger than
//! `maxdata` (reads and writes) or `maxlen` (trim, zero, cache, block status) - for a source
//! that needs both (an NBD upstream with a minimum and a maximum block size, a device with
//! 4 KiB sectors). An unaligned read reads the blocks around it; an unaligned write reads,
//! changes and writes them back, one such at a time (two writes to different bytes of one
//! block never undo each other); an unaligned trim drops its edges (trim is advisory); an
//! unaligned zero writes zeroes into its edges (a fast zero with edges fails as not fast).
//! The export then advertises a minimum block size of 1.
//!
//! Options: `minblock` (a power of two up to 64K; default 1), `maxdata` (a multiple of
//! minblock; default 64M), `maxlen` (default 1G, rounded down to minblock); sizes take
//! K/M/G suffixes.

use std::io;
use std::sync::Mutex;

use zcnbd_proto::Extent;

use super::options::Options;
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// The largest `minblock`.
pub const MINBLOCK_MAX: u64 = 64 << 10;
/// The largest `maxdata` and `maxlen`.
pub const SPLIT_MAX: u64 = 1 << 30;

/// A request's unaligned head `(offset, len)`, its aligned body's start and length, and its
/// unaligned tail.
type Parts = (Option<(u64, u64)>, u64, u64, Option<(u64, u64)>);

/// A layer aligning and splitting requests.
#[derive(Debug)]
pub struct Blocksize {
    minblock: u64,
    maxdata: u64,
    maxlen: u64,
    /// Held across each read-modify-write.
    rmw: Mutex<()>,
}

fn size_option(o: &mut Options<'_>, key: &'static str, default: u64) -> Result<u64, String> {
    Ok(o.size(key, 1, SPLIT_MAX)?.unwrap_or(default))
}

impl Blocksize {
    /// The layer `options` describe.
    pub fn from_options(mut o: Options<'_>) -> Result<Blocksize, String> {
        let minblock = size_option(&mut o, "minblock", 1)?;
        if !minblock.is_power_of_two() || minblock > MINBLOCK_MAX {
            return Err(format!(
                "filter blocksize: minblock={minblock} must be a power of two up to {MINBLOCK_MAX}"
            ));
        }
        let maxdata = size_option(&mut o, "maxdata", 64 << 20)?;
        if maxdata % minblock != 0 {
            return Err(format!(
                "filter blocksize: maxdata={maxdata} must be a multiple of minblock={minblock}"
            ));
        }
        let maxlen = size_option(&mut o, "maxlen", SPLIT_MAX)? / minblock * minblock;
        if maxlen == 0 {
            return Err("filter blocksize: maxlen must be at least minblock".into());
        }
        o.finish()?;
        Ok(Blocksize {
            minblock,
            maxdata,
            maxlen,
            rmw: Mutex::new(()),
        })
    }

    fn down(&self, n: u64) -> u64 {
        n / self.minblock * self.minblock
    }

    fn up(&self, n: u64) -> u64 {
        n.div_ceil(self.minblock) * self.minblock
    }

    /// Reads `buf` at `offset`, both aligned, in pieces of at most `maxdata`.
    fn read_aligned(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        for (i, piece) in buf.chunks_mut(self.maxdata as usize).enumerate() {
            next.pread(piece, offset + i as u64 * self.maxdata)?;
        }
        Ok(())
    }

    /// Writes `buf` at `offset`, both aligned, in pieces of at most `maxdata`.
    fn write_aligned(
        &self,
        next: &dyn Backend,
        buf: &[u8],
        offset: u64,
        fua: bool,
    ) -> io::Result<()> {
        for (i, piece) in buf.chunks(self.maxdata as usize).enumerate() {
            next.pwrite(piece, offset + i as u64 * self.maxdata, fua)?;
        }
        Ok(())
    }

    /// Changes the one block at `block` (aligned): `edit` gets its bytes.
    fn rmw(
        &self,
        next: &dyn Backend,
        block: u64,
        fua: bool,
        edit: impl FnOnce(&mut [u8]),
    ) -> io::Result<()> {
        let _one = self.rmw.lock().unwrap_or_else(|p| p.into_inner());
        let mut bounce = vec![0u8; self.minblock as usize];
        next.pread(&mut bounce, block)?;
        edit(&mut bounce);
        next.pwrite(&bounce, block, fua)
    }

    /// Splits `[offset, offset + len)` into an unaligned head, an aligned body and an
    /// unaligned tail; a request inside one block is all head.
    fn parts(&self, offset: u64, len: u64) -> Parts {
        let end = offset + len;
        let (a, b) = (self.up(offset), self.down(end));
        if b < a {
            return (Some((offset, len)), offset, 0, None);
        }
        let head = (offset < a).then_some((offset, a - offset));
        let tail = (b < end).then_some((b, end - b));
        (head, a, b - a, tail)
    }
}

impl Layer for Blocksize {
    fn name(&self) -> &'static str {
        "blocksize"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn block_size_minimum(&self, _next: &dyn Backend) -> u32 {
        1
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let (head, body, body_len, tail) = self.parts(offset, buf.len() as u64);
        let mut bounce = Vec::new();
        for (at, len) in head.into_iter().chain(tail) {
            let block = self.down(at);
            let span = self.up(at + len) - block;
            bounce.resize(span as usize, 0);
            next.pread(&mut bounce, block)?;
            let from = (at - block) as usize;
            let into = (at - offset) as usize;
            buf[into..into + len as usize].copy_from_slice(&bounce[from..from + len as usize]);
        }
        let into = (body - offset) as usize;
        self.read_aligned(next, &mut buf[into..into + body_len as usize], body)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let (head, body, body_len, tail) = self.parts(offset, buf.len() as u64);
        for (at, len) in head.into_iter().chain(tail) {
            // At most two blocks (a head inside one block; else one block each side).
            let mut block = self.down(at);
            while block < at + len {
                let lo = at.max(block);
                let hi = (at + len).min(block + self.minblock);
                let src = &buf[(lo - offset) as usize..(hi - offset) as usize];
                self.rmw(next, block, fua, |b| {
                    b[(lo - block) as usize..(hi - block) as usize].copy_from_slice(src)
                })?;
                block += self.minblock;
            }
        }
        let from = (body - offset) as usize;
        self.write_aligned(next, &buf[from..from + body_len as usize], body, fua)
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let (start, end) = (self.up(offset), self.down(offset + len));
        let mut at = start;
        while at < end {
            let n = (end - at).min(self.maxlen);
            next.trim(at, n, fua)?;
            at += n;
        }
        Ok(())
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        let (head, body, body_len, tail) = self.parts(offset, len);
        if flags.fast && (head.is_some() || tail.is_some()) {
            return Err(ZeroError::NotFast);
        }
        for (at, n) in head.into_iter().chain(tail) {
            let mut block = self.down(at);
            while block < at + n {
                let lo = at.max(block);
                let hi = (at + n).min(block + self.minblock);
                self.rmw(next, block, flags.fua, |b| {
                    b[(lo - block) as usize..(hi - block) as usize].fill(0)
                })?;
                block += self.minblock;
            }
        }
        let mut at = body;
        while at < body + body_len {
            let n = (body + body_len - at).min(self.maxlen);
            next.zero(at, n, flags)?;
            at += n;
        }
        Ok(())
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        let (start, end) = (
            self.down(offset),
            self.up(offset + len).min(self.up(next.size())),
        );
        let mut at = start;
        while at < end {
            let n = (end - at).min(self.maxlen);
            next.cache(at, n)?;
            at += n;
        }
        Ok(())
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let start = self.down(offset);
        let n = (self.up(offset + len) - start)
            .min(self.maxlen)
            .max(self.minblock);
        let first = out.len();
        next.extents(start, n, extents_max, out)?;
        // The answer starts at the block's start: drop what lies before `offset`.
        let mut skip = offset - start;
        while skip > 0 && first < out.len() {
            if out[first].length > skip {
                out[first].length -= skip;
                skip = 0;
            } else {
                skip -= out[first].length;
                out.remove(first);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::{Layered, MemoryBackend};

    /// A backend that refuses what is not aligned to 4 KiB or larger than 64 KiB.
    #[derive(Debug)]
    struct Strict(MemoryBackend);

    impl Strict {
        fn check(offset: u64, len: usize) -> io::Result<()> {
            if !offset.is_multiple_of(4096) || !len.is_multiple_of(4096) || len > 65536 || len == 0
            {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            Ok(())
        }
    }

    impl Backend for Strict {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn capabilities(&self) -> crate::export::Capabilities {
            self.0.capabilities()
        }
        fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            Strict::check(offset, buf.len())?;
            self.0.pread(buf, offset)
        }
        fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            Strict::check(offset, buf.len())?;
            self.0.pwrite(buf, offset, fua)
        }
        fn flush(&self) -> io::Result<()> {
            self.0.flush()
        }
        fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
            Strict::check(offset, len as usize)?;
            self.0.trim(offset, len, fua)
        }
        fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
            Strict::check(offset, len as usize)?;
            self.0.zero(offset, len, flags)
        }
        fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
            self.0.cache(offset, len)
        }
        fn extents(
            &self,
            offset: u64,
            len: u64,
            extents_max: usize,
            out: &mut Vec<Extent>,
        ) -> io::Result<()> {
            self.0.extents(offset, len, extents_max, out)
        }
    }

    fn layered() -> (Layered, Arc<Strict>) {
        let (_, options) = split("blocksize:minblock=4K,maxdata=64K").unwrap();
        let strict = Arc::new(Strict(MemoryBackend::new(4 << 20).unwrap()));
        let layer = Arc::new(Blocksize::from_options(options).unwrap());
        (Layered::new(layer, strict.clone()), strict)
    }

    #[test]
    fn any_request_becomes_aligned_bounded_ones() {
        let (top, strict) = layered();
        let mut model = vec![0u8; 4 << 20];
        let mut state = 12345u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..400 {
            let len = match round % 4 {
                0 => 1,
                1 => next() % 9000 + 1,
                2 => (1 << 20) + next() % 5000,
                _ => next() % 200_000 + 1,
            } as usize;
            let offset = next() % ((4 << 20) - len as u64);
            if next() % 2 == 0 {
                let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                top.pwrite(&data, offset, false).unwrap();
                model[offset as usize..offset as usize + len].copy_from_slice(&data);
            } else {
                let mut got = vec![0u8; len];
                top.pread(&mut got, offset).unwrap();
                assert_eq!(
                    got,
                    &model[offset as usize..offset as usize + len],
                    "round {round}"
                );
            }
        }
        let mut all = vec![0u8; 4 << 20];
        for (i, chunk) in all.chunks_mut(65536).enumerate() {
            strict.pread(chunk, i as u64 * 65536).unwrap();
        }
        assert_eq!(all, model);
        assert_eq!(top.block_size_minimum(), 1);
    }

    #[test]
    fn options_are_checked() {
        for bad in [
            "blocksize:minblock=3000",
            "blocksize:minblock=128K",
            "blocksize:minblock=4K,maxdata=6K",
            "blocksize:maxdata=2G",
            "blocksize:size=1",
        ] {
            let (_, options) = split(bad).unwrap();
            assert!(Blocksize::from_options(options).is_err(), "{bad}");
        }
    }
}
