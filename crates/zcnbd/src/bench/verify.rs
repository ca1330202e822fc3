//! The data a benchmark writes when it verifies: every 4 KiB block holds a fixed random
//! block stamped with its own offset, and reads are checked by the crc32c of each block
//! against a table computed once.

/// Verification granularity.
pub const VERIFY_BLOCK_BYTES: usize = 4096;

/// The block pattern and the crc32c of every block of the region.
pub struct Pattern {
    base: Vec<u8>,
    crcs: Vec<u32>,
}

impl Pattern {
    /// The pattern for `region` bytes.
    pub fn new(region: u64) -> Pattern {
        let mut x: u64 = 0x853c_49e6_748f_ea9b;
        let base: Vec<u8> = (0..VERIFY_BLOCK_BYTES)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) as u8
            })
            .collect();
        let blocks = region / VERIFY_BLOCK_BYTES as u64;
        let mut block = base.clone();
        let crcs = (0..blocks)
            .map(|i| {
                stamp(&mut block, i * VERIFY_BLOCK_BYTES as u64);
                crc32c::crc32c(&block)
            })
            .collect();
        Pattern { base, crcs }
    }

    /// Fills `buf` with the blocks that belong at `offset`.
    pub fn fill(&self, buf: &mut [u8], offset: u64) {
        for (i, chunk) in buf.chunks_mut(VERIFY_BLOCK_BYTES).enumerate() {
            chunk.copy_from_slice(&self.base[..chunk.len()]);
            stamp(chunk, offset + (i * VERIFY_BLOCK_BYTES) as u64);
        }
    }

    /// Counts the blocks of `buf` (read at `offset`) whose crc32c is not the expected one.
    pub fn check(&self, buf: &[u8], offset: u64) -> u64 {
        let first = offset / VERIFY_BLOCK_BYTES as u64;
        buf.chunks(VERIFY_BLOCK_BYTES)
            .enumerate()
            .filter(|(i, chunk)| {
                let expected = self.crcs.get(first as usize + i).copied();
                expected != Some(crc32c::crc32c(chunk))
            })
            .count() as u64
    }
}

fn stamp(block: &mut [u8], offset: u64) {
    let n = block.len().min(8);
    block[..n].copy_from_slice(&offset.to_le_bytes()[..n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_blocks_check_and_corruption_is_found() {
        let p = Pattern::new(1 << 20);
        let mut buf = vec![0u8; 65536];
        p.fill(&mut buf, 8192);
        assert_eq!(p.check(&buf, 8192), 0);
        assert_eq!(p.check(&buf, 0), 16, "blocks are stamped with their offset");
        buf[5000] ^= 1;
        assert_eq!(p.check(&buf, 8192), 1);
    }
}
