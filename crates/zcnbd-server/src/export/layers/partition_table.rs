//! Finding partition N of a disk: an MBR's primary partitions (1-4) and the logical ones in
//! its extended partition (5 on), or a GPT's entries (1-128, behind a protective MBR).
//! 512-byte sectors, as nbdkit's partition filter assumes. Every number read from the disk is
//! checked against the disk's size before use; a table that points outside the disk, loops,
//! or names an empty slot is refused with the reason. Sans-IO: the caller reads for it.

use std::io;

/// Bytes per sector of the tables this reads.
pub const SECTOR: u64 = 512;
/// The most logical partitions followed down an extended partition's chain.
pub const LOGICAL_PARTITIONS_MAX: u32 = 128;
/// The most GPT entries looked at (the usual table has 128).
pub const GPT_ENTRIES_MAX: u32 = 128;
/// The largest GPT entry accepted (the usual one is 128 bytes).
const GPT_ENTRY_BYTES_MAX: u32 = 4096;

/// Where a partition is, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub offset: u64,
    pub len: u64,
}

/// Why no partition was found.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("the disk has no partition table (no MBR signature)")]
    NoTable,
    #[error("partition {0} does not exist ({1})")]
    Missing(u32, String),
    #[error("the partition table is damaged: {0}")]
    Damaged(String),
    #[error("reading the partition table: {0}")]
    Io(#[from] io::Error),
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// One MBR entry: (type, first sector, sectors).
fn mbr_entry(sector: &[u8], i: usize) -> (u8, u64, u64) {
    let at = 446 + 16 * i;
    (
        sector[at + 4],
        u64::from(le32(sector, at + 8)),
        u64::from(le32(sector, at + 12)),
    )
}

fn is_extended(kind: u8) -> bool {
    matches!(kind, 0x05 | 0x0f | 0x85)
}

/// `sectors` sectors from `first`, checked to lie inside a disk of `disk` bytes.
fn span(first: u64, sectors: u64, disk: u64, what: &str) -> Result<Span, TableError> {
    let offset = first.checked_mul(SECTOR);
    let len = sectors.checked_mul(SECTOR);
    match (offset, len) {
        (Some(offset), Some(len))
            if len > 0 && offset.checked_add(len).is_some_and(|e| e <= disk) =>
        {
            Ok(Span { offset, len })
        }
        _ => Err(TableError::Damaged(format!(
            "{what} (sectors {first} + {sectors}) lies outside the disk's {disk} bytes"
        ))),
    }
}

/// Partition `n` (from 1) of a disk of `disk` bytes, `read(offset, buf)` filling `buf`.
pub fn find(
    disk: u64,
    n: u32,
    mut read: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Span, TableError> {
    if disk < SECTOR {
        return Err(TableError::NoTable);
    }
    let mut mbr = [0u8; SECTOR as usize];
    read(0, &mut mbr)?;
    if mbr[510..512] != [0x55, 0xaa] {
        return Err(TableError::NoTable);
    }
    if (0..4).any(|i| mbr_entry(&mbr, i).0 == 0xee) {
        return gpt(disk, n, &mut read);
    }
    match n {
        1..=4 => {
            let (kind, first, sectors) = mbr_entry(&mbr, n as usize - 1);
            if kind == 0 || sectors == 0 {
                return Err(TableError::Missing(n, "its MBR slot is empty".into()));
            }
            if is_extended(kind) {
                return Err(TableError::Missing(
                    n,
                    "it is the extended partition, a container: logical partitions are 5 on".into(),
                ));
            }
            span(first, sectors, disk, &format!("partition {n}"))
        }
        0 => Err(TableError::Missing(0, "partitions count from 1".into())),
        _ => logical(disk, n, &mbr, &mut read),
    }
}

/// Logical partition `n` (5 on): down the chain of extended boot records.
fn logical(
    disk: u64,
    n: u32,
    mbr: &[u8],
    read: &mut impl FnMut(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Span, TableError> {
    let Some((_, ext_first, ext_sectors)) =
        (0..4).map(|i| mbr_entry(mbr, i)).find(|e| is_extended(e.0))
    else {
        return Err(TableError::Missing(
            n,
            "the MBR has no extended partition".into(),
        ));
    };
    let extended = span(ext_first, ext_sectors, disk, "the extended partition")?;
    let mut ebr_sector = ext_first;
    let mut ebr = [0u8; SECTOR as usize];
    for number in 5..5 + LOGICAL_PARTITIONS_MAX {
        let at = ebr_sector * SECTOR;
        if at < extended.offset || at + SECTOR > extended.offset + extended.len {
            return Err(TableError::Damaged(format!(
                "an extended boot record at sector {ebr_sector} lies outside the extended partition"
            )));
        }
        read(at, &mut ebr)?;
        if ebr[510..512] != [0x55, 0xaa] {
            return Err(TableError::Damaged(format!(
                "no signature in the extended boot record at sector {ebr_sector}"
            )));
        }
        let (kind, first, sectors) = mbr_entry(&ebr, 0);
        if number == n {
            if kind == 0 || sectors == 0 {
                return Err(TableError::Missing(n, "its slot is empty".into()));
            }
            let first = ebr_sector
                .checked_add(first)
                .ok_or_else(|| TableError::Damaged(format!("partition {n}'s start overflows")))?;
            let found = span(first, sectors, disk, &format!("partition {n}"))?;
            if found.offset < extended.offset
                || found.offset + found.len > extended.offset + extended.len
            {
                return Err(TableError::Damaged(format!(
                    "partition {n} lies outside the extended partition"
                )));
            }
            return Ok(found);
        }
        let (next_kind, next, _) = mbr_entry(&ebr, 1);
        if next_kind == 0 || next == 0 {
            return Err(TableError::Missing(
                n,
                format!("the disk has logical partitions 5 to {number}"),
            ));
        }
        // Links are relative to the extended partition's start; each must move on.
        let following = ext_first.checked_add(next).ok_or_else(|| {
            TableError::Damaged("an extended boot record's link overflows".into())
        })?;
        if following <= ebr_sector {
            return Err(TableError::Damaged(
                "the extended boot records loop back".into(),
            ));
        }
        ebr_sector = following;
    }
    Err(TableError::Missing(
        n,
        format!("logical partitions are followed up to {LOGICAL_PARTITIONS_MAX} (LOGICAL_PARTITIONS_MAX)"),
    ))
}

/// Partition `n` of a GPT disk.
fn gpt(
    disk: u64,
    n: u32,
    read: &mut impl FnMut(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Span, TableError> {
    if disk < 2 * SECTOR {
        return Err(TableError::Damaged(
            "a protective MBR but no room for a GPT".into(),
        ));
    }
    let mut header = [0u8; SECTOR as usize];
    read(SECTOR, &mut header)?;
    if &header[0..8] != b"EFI PART" {
        return Err(TableError::Damaged(
            "a protective MBR but no GPT header at sector 1".into(),
        ));
    }
    let (entries_lba, count, entry_bytes) =
        (le64(&header, 72), le32(&header, 80), le32(&header, 84));
    if !(128..=GPT_ENTRY_BYTES_MAX).contains(&entry_bytes) || entry_bytes % 8 != 0 {
        return Err(TableError::Damaged(format!(
            "GPT entries of {entry_bytes} bytes"
        )));
    }
    if n == 0 || n > count.min(GPT_ENTRIES_MAX) {
        return Err(TableError::Missing(
            n,
            format!("the GPT has entries 1 to {}", count.min(GPT_ENTRIES_MAX)),
        ));
    }
    let at = u64::from(n - 1)
        .checked_mul(u64::from(entry_bytes))
        .and_then(|rel| entries_lba.checked_mul(SECTOR)?.checked_add(rel))
        .filter(|&at| {
            at.checked_add(u64::from(entry_bytes))
                .is_some_and(|e| e <= disk)
        })
        .ok_or_else(|| TableError::Damaged("the GPT's entries lie outside the disk".into()))?;
    let mut entry = [0u8; 128];
    read(at, &mut entry)?;
    if entry[0..16].iter().all(|&b| b == 0) {
        return Err(TableError::Missing(n, "its GPT entry is unused".into()));
    }
    let (first, last) = (le64(&entry, 32), le64(&entry, 40));
    if last < first {
        return Err(TableError::Damaged(format!(
            "partition {n} ends before it starts"
        )));
    }
    // last - first + 1 sectors: the last sector of a 2^64-sector range has no count.
    let sectors = (last - first).checked_add(1).ok_or_else(|| {
        TableError::Damaged(format!(
            "partition {n} spans more sectors than can be counted"
        ))
    })?;
    span(first, sectors, disk, &format!("partition {n}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn put_mbr_entry(disk: &mut [u8], sector: u64, i: usize, kind: u8, first: u32, sectors: u32) {
        let at = (sector * SECTOR) as usize + 446 + 16 * i;
        disk[at + 4] = kind;
        disk[at + 8..at + 12].copy_from_slice(&first.to_le_bytes());
        disk[at + 12..at + 16].copy_from_slice(&sectors.to_le_bytes());
        let sig = (sector * SECTOR) as usize + 510;
        disk[sig..sig + 2].copy_from_slice(&[0x55, 0xaa]);
    }

    fn reader(disk: &[u8]) -> impl FnMut(u64, &mut [u8]) -> io::Result<()> + '_ {
        move |offset, buf| {
            let at = offset as usize;
            buf.copy_from_slice(&disk[at..at + buf.len()]);
            Ok(())
        }
    }

    fn mbr_disk() -> Vec<u8> {
        let mut disk = vec![0u8; 8 * MIB as usize];
        put_mbr_entry(&mut disk, 0, 0, 0x83, 2048, 2048);
        put_mbr_entry(&mut disk, 0, 1, 0x05, 4096, 8192);
        // Logical 5 at 4096+2048, then a link to the next EBR at 4096+4096, logical 6 there.
        put_mbr_entry(&mut disk, 4096, 0, 0x83, 2048, 1024);
        put_mbr_entry(&mut disk, 4096, 1, 0x05, 4096, 2048);
        put_mbr_entry(&mut disk, 8192, 0, 0x83, 2048, 512);
        disk
    }

    #[test]
    fn mbr_primary_and_logical_partitions() {
        let disk = mbr_disk();
        let size = disk.len() as u64;
        assert_eq!(
            find(size, 1, reader(&disk)).unwrap(),
            Span {
                offset: 2048 * 512,
                len: 2048 * 512
            }
        );
        assert_eq!(
            find(size, 5, reader(&disk)).unwrap(),
            Span {
                offset: 6144 * 512,
                len: 1024 * 512
            }
        );
        assert_eq!(
            find(size, 6, reader(&disk)).unwrap(),
            Span {
                offset: 10240 * 512,
                len: 512 * 512
            }
        );
        assert!(matches!(
            find(size, 2, reader(&disk)),
            Err(TableError::Missing(2, _))
        ));
        assert!(matches!(
            find(size, 3, reader(&disk)),
            Err(TableError::Missing(3, _))
        ));
        assert!(matches!(
            find(size, 7, reader(&disk)),
            Err(TableError::Missing(7, _))
        ));
        assert!(matches!(
            find(size, 0, reader(&disk)),
            Err(TableError::Missing(0, _))
        ));
    }

    #[test]
    fn tables_that_point_outside_the_disk_or_loop_are_refused() {
        let mut disk = mbr_disk();
        put_mbr_entry(&mut disk, 0, 2, 0x83, 16000, 1000);
        let size = disk.len() as u64;
        assert!(matches!(
            find(size, 3, reader(&disk)),
            Err(TableError::Damaged(_))
        ));
        // The second EBR links back to the first.
        let mut looping = mbr_disk();
        put_mbr_entry(&mut looping, 8192, 1, 0x05, 0, 2048);
        put_mbr_entry(&mut looping, 8192, 1, 0x05, 1, 2048);
        assert!(find(size, 9, reader(&looping)).is_err());
        assert!(matches!(
            find(size, 1, reader(&[0u8; 4096])),
            Err(TableError::NoTable)
        ));
        assert!(matches!(
            find(100, 1, reader(&[0u8; 100])),
            Err(TableError::NoTable)
        ));
    }

    fn gpt_disk() -> Vec<u8> {
        let mut disk = vec![0u8; 8 * MIB as usize];
        put_mbr_entry(&mut disk, 0, 0, 0xee, 1, 16383);
        let h = 512;
        disk[h..h + 8].copy_from_slice(b"EFI PART");
        disk[h + 72..h + 80].copy_from_slice(&2u64.to_le_bytes());
        disk[h + 80..h + 84].copy_from_slice(&128u32.to_le_bytes());
        disk[h + 84..h + 88].copy_from_slice(&128u32.to_le_bytes());
        for (i, (first, last)) in [(2048u64, 4095u64), (4096, 10239)].into_iter().enumerate() {
            let e = 1024 + 128 * i;
            disk[e] = 0xaf;
            disk[e + 32..e + 40].copy_from_slice(&first.to_le_bytes());
            disk[e + 40..e + 48].copy_from_slice(&last.to_le_bytes());
        }
        disk
    }

    #[test]
    fn gpt_entries() {
        let disk = gpt_disk();
        let size = disk.len() as u64;
        assert_eq!(
            find(size, 2, reader(&disk)).unwrap(),
            Span {
                offset: 4096 * 512,
                len: 6144 * 512
            }
        );
        assert!(matches!(
            find(size, 3, reader(&disk)),
            Err(TableError::Missing(3, _))
        ));
        assert!(matches!(
            find(size, 129, reader(&disk)),
            Err(TableError::Missing(129, _))
        ));
        let mut bad = gpt_disk();
        bad[1024 + 40..1024 + 48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            find(size, 1, reader(&bad)),
            Err(TableError::Damaged(_))
        ));
    }

    /// Random damage to real tables: every answer is a span inside the disk or an error,
    /// never a panic, and no read outside the disk is asked for.
    #[test]
    fn damaged_tables_never_panic_or_read_outside_the_disk() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for base in [mbr_disk(), gpt_disk()] {
            for _ in 0..3000 {
                let mut disk = base.clone();
                for _ in 0..(next() % 8 + 1) {
                    // Mostly the table sectors, sometimes anywhere in the first 5 MiB.
                    let at = if next() % 4 == 0 {
                        next() % (5 * MIB)
                    } else {
                        next() % 2048 + 446
                    };
                    disk[at as usize] = next() as u8;
                }
                let size = disk.len() as u64;
                let n = (next() % 10) as u32;
                let checked = |offset: u64, buf: &mut [u8]| {
                    assert!(offset + buf.len() as u64 <= size, "read outside the disk");
                    buf.copy_from_slice(&disk[offset as usize..offset as usize + buf.len()]);
                    Ok(())
                };
                if let Ok(span) = find(size, n, checked) {
                    assert!(span.len > 0 && span.offset + span.len <= size);
                }
            }
        }
    }
}
