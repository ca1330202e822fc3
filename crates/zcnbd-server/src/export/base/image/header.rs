//! What the first bytes of a file say it is (`qemu-img`'s probe, for the formats imago
//! reads), and the qcow2 header fields checked before imago opens an image, so that an image
//! it must not open is refused with a reason - and before a writable open, which clears the
//! autoclear bits, could change it (QEMU's docs/interop/qcow2.txt gives the layout).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// The bytes the probe reads: a qcow2 version 3 header's fixed part.
const HEADER_BYTES: usize = 104;
const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";
/// A VMDK descriptor file starts with this line; a sparse VMDK with the magic "KDMV".
const VMDK_DESCRIPTOR: &[u8] = b"# Disk DescriptorFile";
const VMDK_SPARSE_MAGIC: &[u8; 4] = b"KDMV";

/// The smallest and largest qcow2 cluster sizes (QEMU's: 512 B and 2 MiB).
const CLUSTER_BITS_MIN: u32 = 9;
const CLUSTER_BITS_MAX: u32 = 21;

/// qcow2 incompatible feature bits (header offset 72, version 3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
/// Every bit the qcow2 specification defines.
const INCOMPAT_KNOWN: u64 = INCOMPAT_DIRTY
    | INCOMPAT_CORRUPT
    | INCOMPAT_DATA_FILE
    | INCOMPAT_COMPRESSION
    | INCOMPAT_EXTENDED_L2;

/// A disk image format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// The bytes are the disk (served by the file backend, not through imago).
    Raw,
    /// QEMU's qcow2, versions 2 and 3.
    Qcow2,
    /// VMware's VMDK with flat extents (read-only).
    Vmdk,
}

impl ImageFormat {
    /// The name `--format` and logs use.
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Vmdk => "vmdk",
        }
    }

    /// The format called `name` (`--format`).
    pub fn named(name: &str) -> Option<ImageFormat> {
        [ImageFormat::Raw, ImageFormat::Qcow2, ImageFormat::Vmdk]
            .into_iter()
            .find(|f| f.name() == name)
    }
}

/// The qcow2 header fields zcnbd looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qcow2Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub crypt_method: u32,
    /// Version 3 only (0 for version 2).
    pub incompatible_features: u64,
    /// Entries of the L1 table, and where it is.
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    /// log2 of a refcount's bits (version 2: always 4, 16-bit refcounts).
    pub refcount_order: u32,
}

impl Qcow2Header {
    /// Bytes per cluster.
    pub fn cluster_bytes(&self) -> u64 {
        1u64.checked_shl(self.cluster_bits).unwrap_or(0)
    }

    /// Whether the guest data is in an external data file.
    pub fn has_data_file(&self) -> bool {
        self.incompatible_features & INCOMPAT_DATA_FILE != 0
    }

    /// Whether clusters can be marked as reading zeroes (version 3).
    pub fn has_zero_clusters(&self) -> bool {
        self.version >= 3
    }

    /// Why imago must not open the image, if it must not: what QEMU would need and imago
    /// lacks, and what would be served wrong (imago reads an encrypted image's ciphertext
    /// as if it were the disk).
    pub fn refusal(&self) -> Option<String> {
        if !(2..=3).contains(&self.version) {
            return Some(format!("qcow2 version {} is not supported", self.version));
        }
        if !(CLUSTER_BITS_MIN..=CLUSTER_BITS_MAX).contains(&self.cluster_bits) {
            return Some(format!(
                "cluster_bits {} is out of range",
                self.cluster_bits
            ));
        }
        if self.crypt_method != 0 {
            let how = if self.crypt_method == 1 {
                "AES"
            } else {
                "LUKS"
            };
            return Some(format!(
                "the image is encrypted ({how}), which zcnbd cannot serve"
            ));
        }
        let f = self.incompatible_features;
        let why = if f & INCOMPAT_DIRTY != 0 {
            "the image is dirty (QEMU stopped without closing it): repair it with `qemu-img check -r all`"
        } else if f & INCOMPAT_CORRUPT != 0 {
            "the image is marked corrupt: repair it with `qemu-img check -r all`"
        } else if f & INCOMPAT_COMPRESSION != 0 {
            "compression types other than zlib (compression_type=zstd) are not supported"
        } else if f & INCOMPAT_EXTENDED_L2 != 0 {
            "extended L2 entries (extended_l2=on, subclusters) are not supported"
        } else if f & !INCOMPAT_KNOWN != 0 {
            return Some(format!("unknown incompatible features {f:#x}"));
        } else {
            return None;
        };
        Some(why.to_owned())
    }
}

/// The header extension naming features (qcow2: "feature name table"), whose entries are 48
/// bytes each.
const EXT_FEATURE_NAME_TABLE: u32 = 0x6803_f857;
const FEATURE_NAME_BYTES: u32 = 48;

/// Why a version 3 header's extensions (after the fixed header, up to the end of the first
/// cluster) must not be given to imago, if they must not: a feature name table whose last
/// entry is a single byte makes imago 0.2.6 index past it (a panic the image fuzz target
/// found). The walk stops where imago's does: at the end marker, or where an extension would
/// leave the cluster (imago refuses that itself).
pub fn extensions_refusal(file: &File, h: &Qcow2Header) -> io::Result<Option<String>> {
    if h.version < 3 {
        return Ok(None);
    }
    let mut cluster = vec![0u8; h.cluster_bytes() as usize];
    let got = read_prefix(file, &mut cluster)?;
    cluster.truncate(got);
    let mut at = be32(&cluster, 100).unwrap_or(0) as usize;
    while let (Some(kind), Some(len)) = (be32(&cluster, at), be32(&cluster, at + 4)) {
        if kind == 0 {
            break;
        }
        if kind == EXT_FEATURE_NAME_TABLE && len % FEATURE_NAME_BYTES == 1 {
            return Ok(Some(
                "malformed header extension: a feature name table entry of 1 byte".to_owned(),
            ));
        }
        at = match (at + 8).checked_add((len as usize).next_multiple_of(8)) {
            Some(next) => next,
            None => break,
        };
    }
    Ok(None)
}

/// Reads the start of `file` into `buf`: how many bytes it has.
fn read_prefix(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// What the start of a file says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probed {
    /// A qcow2 image, with its header.
    Qcow2(Qcow2Header),
    /// A VMDK descriptor or sparse VMDK.
    Vmdk,
    /// Anything else: raw bytes.
    Raw,
}

impl Probed {
    /// The format it names.
    pub fn format(&self) -> ImageFormat {
        match self {
            Probed::Qcow2(_) => ImageFormat::Qcow2,
            Probed::Vmdk => ImageFormat::Vmdk,
            Probed::Raw => ImageFormat::Raw,
        }
    }
}

/// Reads the start of `file` and says what it is.
pub fn probe(file: &File) -> io::Result<Probed> {
    let mut buf = [0u8; HEADER_BYTES];
    let got = read_prefix(file, &mut buf)?;
    Ok(probe_bytes(&buf[..got]))
}

/// What `bytes`, a file's first bytes, say it is.
pub fn probe_bytes(bytes: &[u8]) -> Probed {
    if bytes.starts_with(QCOW2_MAGIC) {
        return match qcow2_header(bytes) {
            Some(h) => Probed::Qcow2(h),
            // Too short to be one: the bytes of a disk that happen to start so.
            None => Probed::Raw,
        };
    }
    if bytes.starts_with(VMDK_DESCRIPTOR) || bytes.starts_with(VMDK_SPARSE_MAGIC) {
        return Probed::Vmdk;
    }
    Probed::Raw
}

fn be32(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at + 4)?;
    Some(u32::from_be_bytes(b.try_into().ok()?))
}

fn be64(bytes: &[u8], at: usize) -> Option<u64> {
    let b = bytes.get(at..at + 8)?;
    Some(u64::from_be_bytes(b.try_into().ok()?))
}

/// The fields of a qcow2 header (a version 2 header is 72 bytes, version 3 at least 104).
fn qcow2_header(bytes: &[u8]) -> Option<Qcow2Header> {
    let version = be32(bytes, 4)?;
    let (incompatible_features, refcount_order) = if version >= 3 {
        (be64(bytes, 72)?, be32(bytes, 96)?)
    } else {
        (0, 4)
    };
    Some(Qcow2Header {
        version,
        cluster_bits: be32(bytes, 20)?,
        crypt_method: be32(bytes, 32)?,
        incompatible_features,
        l1_size: be32(bytes, 36)?,
        l1_table_offset: be64(bytes, 40)?,
        refcount_table_offset: be64(bytes, 48)?,
        refcount_table_clusters: be32(bytes, 56)?,
        refcount_order,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(version: u32, crypt: u32, incompat: u64) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_BYTES];
        h[..4].copy_from_slice(QCOW2_MAGIC);
        h[4..8].copy_from_slice(&version.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[32..36].copy_from_slice(&crypt.to_be_bytes());
        h[72..80].copy_from_slice(&incompat.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h
    }

    fn refusal(bytes: &[u8]) -> Option<String> {
        match probe_bytes(bytes) {
            Probed::Qcow2(h) => h.refusal(),
            other => panic!("not qcow2: {other:?}"),
        }
    }

    #[test]
    fn formats_are_told_apart() {
        assert_eq!(probe_bytes(b"").format(), ImageFormat::Raw);
        assert_eq!(probe_bytes(b"QFI\xfb").format(), ImageFormat::Raw);
        assert_eq!(probe_bytes(&header(3, 0, 0)).format(), ImageFormat::Qcow2);
        assert_eq!(
            probe_bytes(b"# Disk DescriptorFile\nversion=1\n").format(),
            ImageFormat::Vmdk
        );
        assert_eq!(ImageFormat::named("qcow2"), Some(ImageFormat::Qcow2));
        assert_eq!(ImageFormat::named("qed"), None);
    }

    #[test]
    fn a_feature_table_imago_would_index_past_is_refused() {
        let mut bytes = header(3, 0, 0);
        bytes.resize(1 << 16, 0);
        bytes[100..104].copy_from_slice(&104u32.to_be_bytes());
        let mut ext = |len: u32| {
            bytes[104..108].copy_from_slice(&EXT_FEATURE_NAME_TABLE.to_be_bytes());
            bytes[108..112].copy_from_slice(&len.to_be_bytes());
            let f = tempfile::tempfile().unwrap();
            std::os::unix::fs::FileExt::write_all_at(&f, &bytes, 0).unwrap();
            let Probed::Qcow2(h) = probe(&f).unwrap() else {
                panic!("not qcow2")
            };
            extensions_refusal(&f, &h).unwrap()
        };
        assert!(ext(49).unwrap().contains("feature name table"));
        assert_eq!(ext(48), None);
        assert_eq!(ext(0), None);
    }

    #[test]
    fn what_imago_cannot_serve_is_refused_with_a_reason() {
        assert_eq!(refusal(&header(3, 0, 0)), None);
        assert_eq!(refusal(&header(2, 0, 0)[..72]), None);
        assert_eq!(refusal(&header(3, 0, INCOMPAT_DATA_FILE)), None);
        assert!(refusal(&header(3, 2, 0)).unwrap().contains("LUKS"));
        assert!(refusal(&header(2, 1, 0)).unwrap().contains("AES"));
        assert!(refusal(&header(1, 0, 0)).unwrap().contains("version 1"));
        assert!(refusal(&header(3, 0, INCOMPAT_EXTENDED_L2))
            .unwrap()
            .contains("extended L2"));
        assert!(refusal(&header(3, 0, INCOMPAT_DIRTY))
            .unwrap()
            .contains("qemu-img check"));
        assert!(refusal(&header(3, 0, 1 << 20)).unwrap().contains("unknown"));
        let mut big = header(3, 0, 0);
        big[20..24].copy_from_slice(&30u32.to_be_bytes());
        assert!(refusal(&big).unwrap().contains("cluster_bits"));
    }
}
