//! Synthetic qcow2 images for the bitmap tests: a version 3 header with a bitmaps extension,
//! then the directory, the tables and the data clusters, each cluster aligned - and no L1 or
//! refcount table, which the bitmap reader never looks at. The builder records where each
//! part went, so a test can damage exactly one field.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// One bitmap to write.
#[derive(Debug, Clone)]
pub struct TestBitmap {
    pub name: String,
    pub granularity_bits: u8,
    pub flags: u32,
    pub kind: u8,
    pub extra: Vec<u8>,
    /// Byte ranges of the disk (offset, length) whose granules are dirty.
    pub dirty: Vec<(u64, u64)>,
    /// Table entries written as "all ones" (offset 0, bit 0) instead of a data cluster.
    pub all_ones: Vec<usize>,
}

impl TestBitmap {
    /// An enabled (`auto`) dirty tracking bitmap with nothing dirty.
    pub fn new(name: &str, granularity_bits: u8) -> TestBitmap {
        TestBitmap {
            name: name.to_owned(),
            granularity_bits,
            flags: 1 << 1,
            kind: 1,
            extra: Vec::new(),
            dirty: Vec::new(),
            all_ones: Vec::new(),
        }
    }

    pub fn dirty(mut self, ranges: &[(u64, u64)]) -> TestBitmap {
        self.dirty.extend_from_slice(ranges);
        self
    }

    /// Bits of a disk of `virtual_bytes`.
    pub fn bits(&self, virtual_bytes: u64) -> u64 {
        virtual_bytes.div_ceil(1 << self.granularity_bits)
    }

    /// Whether granule `i` is dirty, by the ranges.
    pub fn granule_dirty(&self, i: u64) -> bool {
        let g = 1u64 << self.granularity_bits;
        self.dirty
            .iter()
            .any(|&(at, len)| len > 0 && at / g <= i && i <= (at + len - 1) / g)
    }
}

/// An image to build.
#[derive(Debug, Clone)]
pub struct TestImage {
    pub cluster_bits: u32,
    pub virtual_bytes: u64,
    pub autoclear: u64,
    pub bitmaps: Vec<TestBitmap>,
}

/// A built image and where its parts are.
#[derive(Debug, Clone)]
pub struct Built {
    pub bytes: Vec<u8>,
    /// The bitmaps extension's header (type, length; its data 8 bytes on).
    pub ext_at: usize,
    pub dir_at: usize,
    /// Each bitmap's directory entry and table.
    pub entry_at: Vec<usize>,
    pub table_at: Vec<usize>,
}

impl Built {
    pub fn put_u16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }

    pub fn put_u32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }

    pub fn put_u64(&mut self, at: usize, v: u64) {
        self.bytes[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }

    /// The image in a file.
    pub fn file(&self) -> File {
        file_of(&self.bytes)
    }
}

/// `bytes` in a temporary file.
pub fn file_of(bytes: &[u8]) -> File {
    let f = tempfile::tempfile().unwrap();
    f.write_all_at(bytes, 0).unwrap();
    f
}

impl TestImage {
    /// A 64 MiB disk with 64 KiB clusters and the bitmaps extension's autoclear bit set.
    pub fn new(bitmaps: Vec<TestBitmap>) -> TestImage {
        TestImage {
            cluster_bits: 16,
            virtual_bytes: 64 << 20,
            autoclear: 1,
            bitmaps,
        }
    }

    pub fn build(&self) -> Built {
        let c = 1usize << self.cluster_bits;
        let mut out = vec![0u8; c];
        out[..4].copy_from_slice(b"QFI\xfb");
        out[4..8].copy_from_slice(&3u32.to_be_bytes());
        out[20..24].copy_from_slice(&self.cluster_bits.to_be_bytes());
        out[24..32].copy_from_slice(&self.virtual_bytes.to_be_bytes());
        out[88..96].copy_from_slice(&self.autoclear.to_be_bytes());
        out[96..100].copy_from_slice(&4u32.to_be_bytes());
        out[100..104].copy_from_slice(&104u32.to_be_bytes());
        let dir = self.directory_bytes();
        let dir_at = c;
        let mut at = dir_at + dir.len().next_multiple_of(c);
        let mut entry_at = Vec::new();
        let mut table_at = Vec::new();
        let mut entry = dir_at;
        let mut tables = Vec::new();
        for b in &self.bitmaps {
            entry_at.push(entry);
            entry += 24 + (b.extra.len() + b.name.len()).next_multiple_of(8);
            let entries = self.table_entries(b);
            table_at.push(at);
            tables.push((at, entries));
            at += (entries * 8).next_multiple_of(c).max(c);
        }
        out.resize(at, 0);
        out[dir_at..dir_at + dir.len()].copy_from_slice(&dir);
        for (i, b) in self.bitmaps.iter().enumerate() {
            let (table, entries) = tables[i];
            for t in 0..entries {
                let entry = self.data_cluster(b, t, &mut out);
                out[table + t * 8..table + t * 8 + 8].copy_from_slice(&entry.to_be_bytes());
            }
            // The table offset in the directory entry.
            let e = entry_at[i];
            out[e..e + 8].copy_from_slice(&(table as u64).to_be_bytes());
        }
        let ext_at = 104;
        let ext = &mut out[ext_at..ext_at + 32];
        ext[..4].copy_from_slice(&0x2385_2875u32.to_be_bytes());
        ext[4..8].copy_from_slice(&24u32.to_be_bytes());
        ext[8..12].copy_from_slice(&(self.bitmaps.len() as u32).to_be_bytes());
        ext[16..24].copy_from_slice(&(dir.len() as u64).to_be_bytes());
        ext[24..32].copy_from_slice(&(dir_at as u64).to_be_bytes());
        Built {
            bytes: out,
            ext_at,
            dir_at,
            entry_at,
            table_at,
        }
    }

    fn table_entries(&self, b: &TestBitmap) -> usize {
        let data = b.bits(self.virtual_bytes).div_ceil(8);
        data.div_ceil(1 << self.cluster_bits) as usize
    }

    /// The directory, with table offsets still 0.
    fn directory_bytes(&self) -> Vec<u8> {
        let mut dir = Vec::new();
        for b in &self.bitmaps {
            dir.extend_from_slice(&0u64.to_be_bytes());
            dir.extend_from_slice(&(self.table_entries(b) as u32).to_be_bytes());
            dir.extend_from_slice(&b.flags.to_be_bytes());
            dir.push(b.kind);
            dir.push(b.granularity_bits);
            dir.extend_from_slice(&(b.name.len() as u16).to_be_bytes());
            dir.extend_from_slice(&(b.extra.len() as u32).to_be_bytes());
            dir.extend_from_slice(&b.extra);
            dir.extend_from_slice(b.name.as_bytes());
            dir.resize(dir.len().next_multiple_of(8), 0);
        }
        dir
    }

    /// Table entry `t` of bitmap `b`: 0 for a clean cluster, 1 for an all-ones one, or the
    /// offset of a data cluster appended to `out`.
    fn data_cluster(&self, b: &TestBitmap, t: usize, out: &mut Vec<u8>) -> u64 {
        if b.all_ones.contains(&t) {
            return 1;
        }
        let c = 1usize << self.cluster_bits;
        let bits = b.bits(self.virtual_bytes);
        let first = (t * c * 8) as u64;
        let mut data = vec![0u8; c];
        for i in first..(first + c as u64 * 8).min(bits) {
            if b.granule_dirty(i) {
                let j = (i - first) as usize;
                data[j / 8] |= 1 << (j % 8);
            }
        }
        if data.iter().all(|&x| x == 0) {
            return 0;
        }
        let at = out.len();
        out.extend_from_slice(&data);
        at as u64
    }
}
