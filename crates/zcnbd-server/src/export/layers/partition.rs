//! The partition layer (`--filter partition:partition=N`, nbdkit-partition-filter): serves
//! partition N of an MBR or GPT disk as the whole export (see `partition_table.rs` for the
//! tables read and how they are checked). The table is read when the export opens; one that is
//! damaged, or has no partition N, refuses the start with the reason. Requests are moved by
//! the partition's offset; none reaches outside it (the stack's own bounds check holds at the
//! partition's size).

use std::io;
use std::sync::OnceLock;

use zcnbd_proto::Extent;

use super::options::Options;
use super::partition_table::{self, Span};
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// A layer serving one partition of the disk below.
#[derive(Debug)]
pub struct Partition {
    number: u32,
    span: OnceLock<Span>,
}

impl Partition {
    /// The layer `options` describe (`partition=N`, from 1).
    pub fn from_options(mut options: Options<'_>) -> Result<Partition, String> {
        let text = options
            .get("partition")
            .ok_or("filter partition: give partition=N (from 1)")?;
        let number = text
            .parse::<u32>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                format!("filter partition: partition={text:?} is not a number from 1")
            })?;
        options.finish()?;
        Ok(Partition {
            number,
            span: OnceLock::new(),
        })
    }

    /// Reads the table below (once): where the partition is.
    fn span(&self, next: &dyn Backend) -> io::Result<Span> {
        if let Some(span) = self.span.get() {
            return Ok(*span);
        }
        let found = partition_table::find(next.size(), self.number, |offset, buf| {
            next.pread(buf, offset)
        })
        .map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidData, format!("filter partition: {e}"))
        })?;
        Ok(*self.span.get_or_init(|| found))
    }

    /// `offset` in the disk below, for a request of `len` bytes checked to stay inside the
    /// partition.
    fn moved(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<u64> {
        let span = self.span(next)?;
        match offset.checked_add(len) {
            Some(end) if end <= span.len => Ok(span.offset + offset),
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}

impl Layer for Partition {
    fn name(&self) -> &'static str {
        "partition"
    }
    fn open(&self, next: &dyn Backend) -> io::Result<()> {
        self.span(next).map(drop)
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn size(&self, next: &dyn Backend) -> u64 {
        self.span(next).map_or(0, |s| s.len)
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let at = self.moved(next, offset, buf.len() as u64)?;
        next.pread(buf, at)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let at = self.moved(next, offset, buf.len() as u64)?;
        next.pwrite(buf, at, fua)
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let at = self.moved(next, offset, len)?;
        next.trim(at, len, fua)
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        let at = self.moved(next, offset, len)?;
        next.zero(at, len, flags)
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        let at = self.moved(next, offset, len)?;
        next.cache(at, len)
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let at = self.moved(next, offset, len)?;
        next.extents(at, len, extents_max, out)
    }
    fn meta_contexts(&self, _next: &dyn Backend) -> Vec<String> {
        // A context's extents (a dirty bitmap's) are the whole disk's: not offered.
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::{Layered, MemoryBackend};

    #[test]
    fn serves_the_partition_and_nothing_outside_it() {
        let disk = Arc::new(MemoryBackend::new(4 << 20).unwrap());
        let mut mbr = [0u8; 512];
        mbr[446 + 4] = 0x83;
        mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        mbr[446 + 12..446 + 16].copy_from_slice(&2048u32.to_le_bytes());
        mbr[510..512].copy_from_slice(&[0x55, 0xaa]);
        disk.pwrite(&mbr, 0, false).unwrap();
        disk.pwrite(b"inside", 2048 * 512, false).unwrap();
        let (_, options) = split("partition:partition=1").unwrap();
        let layer = Arc::new(Partition::from_options(options).unwrap());
        layer.open(&*disk).unwrap();
        let top = Layered::new(layer, disk.clone());
        assert_eq!(top.size(), 1 << 20);
        let mut buf = [0u8; 6];
        top.pread(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"inside");
        top.pwrite(b"end", (1 << 20) - 3, false).unwrap();
        disk.pread(&mut buf[..3], 2048 * 512 + (1 << 20) - 3)
            .unwrap();
        assert_eq!(&buf[..3], b"end");
        assert!(top.pread(&mut buf, (1 << 20) - 3).is_err());
        let (_, options) = split("partition:partition=2").unwrap();
        let missing = Partition::from_options(options).unwrap();
        assert!(missing
            .open(&*disk)
            .unwrap_err()
            .to_string()
            .contains("partition 2"));
    }

    #[test]
    fn options_need_a_partition_number() {
        for bad in [
            "partition",
            "partition:partition=0",
            "partition:partition=x",
            "partition:n=1",
        ] {
            let (_, options) = split(bad).unwrap();
            assert!(Partition::from_options(options).is_err(), "{bad}");
        }
    }
}
