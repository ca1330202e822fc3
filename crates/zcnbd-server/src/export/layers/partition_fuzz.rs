//! The `partition_table` fuzz target's body (`fuzz/fuzz_targets/partition_table.rs`), which
//! the unit tests also run over mangled MBR, extended and GPT tables: partition N looked up
//! on a disk whose first bytes are the input. Nothing may panic; every read stays inside the
//! disk and within the table's bounds (one sector at a time, no more than the MBR and
//! [`LOGICAL_PARTITIONS_MAX`] extended boot records); a partition found is inside the disk.

use super::partition_table::{find, Span, TableError, LOGICAL_PARTITIONS_MAX, SECTOR};

/// The most reads one lookup may make: the MBR, then one extended boot record per logical
/// partition followed (a GPT lookup makes three).
const READS_MAX: usize = 1 + LOGICAL_PARTITIONS_MAX as usize;

/// `data`: one byte choosing the partition (0 to 140, past the logical and GPT limits), four
/// bytes of disk size beyond the input (little-endian sectors, below 2^20), then the disk's
/// first bytes; the rest of the disk reads as zeroes.
pub fn run(data: &[u8]) {
    let (params, image) = data.split_at(data.len().min(5));
    let mut p = [0u8; 5];
    p[..params.len()].copy_from_slice(params);
    let n = u32::from(p[0]) % 141;
    let beyond = u32::from_le_bytes([p[1], p[2], p[3], p[4]]) % (1 << 20);
    let disk = image.len() as u64 + u64::from(beyond) * SECTOR;
    let mut reads = 0;
    let found = find(disk, n, |offset, buf| {
        reads += 1;
        assert!(
            reads <= READS_MAX,
            "read {reads} is past the table's bounds"
        );
        assert!(buf.len() as u64 <= SECTOR, "a read of {} bytes", buf.len());
        let end = offset.checked_add(buf.len() as u64);
        assert!(
            end.is_some_and(|end| end <= disk),
            "a read at {offset} (+{}) outside a disk of {disk} bytes",
            buf.len()
        );
        buf.fill(0);
        if let Some(have) = usize::try_from(offset).ok().and_then(|at| image.get(at..)) {
            let k = have.len().min(buf.len());
            buf[..k].copy_from_slice(&have[..k]);
        }
        Ok(())
    });
    match found {
        Ok(Span { offset, len }) => {
            assert!(n >= 1, "partition 0 found");
            assert!(len > 0, "an empty partition {n}");
            let end = offset.checked_add(len);
            assert!(
                end.is_some_and(|end| end <= disk),
                "partition {n} at {offset} (+{len}) outside a disk of {disk} bytes"
            );
        }
        Err(TableError::Io(e)) => panic!("no read failed, yet: {e}"),
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::SECTOR;

    /// A disk's first 24 sectors with an MBR: partition 1 (sectors 40-47), an extended
    /// partition (8-23) whose chain holds logical 5 and 6.
    fn mbr_seed() -> Vec<u8> {
        let mut disk = vec![0u8; 24 * SECTOR as usize];
        let mut entry = |sector: usize, i: usize, kind: u8, first: u32, sectors: u32| {
            let at = sector * SECTOR as usize + 446 + 16 * i;
            disk[at + 4] = kind;
            disk[at + 8..at + 12].copy_from_slice(&first.to_le_bytes());
            disk[at + 12..at + 16].copy_from_slice(&sectors.to_le_bytes());
            let sig = sector * SECTOR as usize + 510;
            disk[sig..sig + 2].copy_from_slice(&[0x55, 0xaa]);
        };
        entry(0, 0, 0x83, 40, 8);
        entry(0, 1, 0x05, 8, 16);
        entry(8, 0, 0x83, 1, 3);
        entry(8, 1, 0x05, 8, 8);
        entry(16, 0, 0x83, 1, 7);
        disk
    }

    /// A protective MBR, a GPT header at sector 1 naming four 128-byte entries at sector 2,
    /// and entry 1 (sectors 34-40) and 3 (41-41) in use.
    fn gpt_seed() -> Vec<u8> {
        let mut disk = vec![0u8; 4 * SECTOR as usize];
        disk[446 + 4] = 0xee;
        disk[510..512].copy_from_slice(&[0x55, 0xaa]);
        let h = SECTOR as usize;
        disk[h..h + 8].copy_from_slice(b"EFI PART");
        disk[h + 72..h + 80].copy_from_slice(&2u64.to_le_bytes());
        disk[h + 80..h + 84].copy_from_slice(&4u32.to_le_bytes());
        disk[h + 84..h + 88].copy_from_slice(&128u32.to_le_bytes());
        for (slot, first, last) in [(0usize, 34u64, 40u64), (2, 41, 41)] {
            let e = 2 * SECTOR as usize + slot * 128;
            disk[e] = 0xaf;
            disk[e + 32..e + 40].copy_from_slice(&first.to_le_bytes());
            disk[e + 40..e + 48].copy_from_slice(&last.to_le_bytes());
        }
        disk
    }

    fn input(n: u8, beyond: u32, image: &[u8]) -> Vec<u8> {
        let mut input = vec![n];
        input.extend_from_slice(&beyond.to_le_bytes());
        input.extend_from_slice(image);
        input
    }

    #[test]
    fn the_seeds_partitions_are_found() {
        use super::super::partition_table::{find, Span};
        let read = |image: Vec<u8>| {
            move |offset: u64, buf: &mut [u8]| {
                let at = offset as usize;
                buf.copy_from_slice(&image[at..at + buf.len()]);
                Ok(())
            }
        };
        let span = |first: u64, sectors: u64| Span {
            offset: first * SECTOR,
            len: sectors * SECTOR,
        };
        let disk = 64 * SECTOR;
        assert_eq!(find(disk, 1, read(mbr_seed())).unwrap(), span(40, 8));
        assert_eq!(find(disk, 5, read(mbr_seed())).unwrap(), span(9, 3));
        assert_eq!(find(disk, 6, read(mbr_seed())).unwrap(), span(17, 7));
        assert_eq!(find(disk, 1, read(gpt_seed())).unwrap(), span(34, 7));
        assert_eq!(find(disk, 3, read(gpt_seed())).unwrap(), span(41, 1));
        for n in 0..=8 {
            super::run(&input(n, 40, &mbr_seed()));
            super::run(&input(n, 40, &gpt_seed()));
        }
    }

    #[test]
    fn a_gpt_entry_over_every_sector_is_refused() {
        // Found by the fuzzer: first 0, last 2^64 - 1 overflowed the sector count.
        let mut image = gpt_seed();
        let e = 2 * SECTOR as usize;
        image[e + 32..e + 40].copy_from_slice(&0u64.to_le_bytes());
        image[e + 40..e + 48].copy_from_slice(&u64::MAX.to_le_bytes());
        super::run(&input(1, 40, &image));
    }

    #[test]
    fn mangled_tables_are_found_or_refused_within_bounds() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let seeds = [mbr_seed(), gpt_seed()];
        // Where the tables live: the MBR's entries, the EBRs' (sectors 8 and 16), the GPT
        // header's fields and its entries.
        let hot = [
            446..512,
            8 * 512 + 446..8 * 512 + 512,
            16 * 512 + 446..16 * 512 + 512,
        ];
        let gpt_hot = [446..512, 512..600, 1024..1536];
        for round in 0..6000 {
            let gpt = round % 2 == 1;
            let mut image = seeds[usize::from(gpt)].clone();
            let ranges = if gpt { &gpt_hot } else { &hot };
            for _ in 0..1 + next() % 6 {
                let r = next();
                let range = ranges[(r % 3) as usize].clone();
                let at = range.start + (r >> 8) as usize % range.len();
                image[at] = match (r >> 40) % 4 {
                    0 => 0,
                    1 => 0xff,
                    _ => (r >> 48) as u8,
                };
            }
            if round % 10 == 0 {
                image.truncate(next() as usize % (image.len() + 1));
            }
            let beyond = match next() % 3 {
                0 => 0,
                1 => next() as u32 % 64,
                _ => next() as u32,
            };
            super::run(&input(next() as u8, beyond, &image));
        }
    }
}
