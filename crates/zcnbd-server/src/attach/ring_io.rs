//! Reads and writes a queue does itself, on its own ring: a request the export's stack maps
//! to places the ring reaches - a file through the page cache or with O_DIRECT, holes - is
//! one read or write per place between the file and the request's buffer (the tag's buffer
//! in copy mode; in zero-copy mode the request's own pages, registered as the ring's fixed
//! buffer, so no byte is copied by the CPU), with no other thread involved. A raw file is one
//! place; a qcow2 image's request one per run of contiguous clusters.
//!
//! Ownership (the data-safety rule): the request holds the lease of its map until its last
//! read or write completes, so a cluster it was mapped to stays its own whatever other
//! requests do meanwhile; a write tells the stack's layers (dirty bitmaps) of its range
//! whatever became of it. A request the stack cannot map that way now (computed bytes, a
//! change of the range running) is answered through the stack as before.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use crate::export::{Lease, Map, MapFor, Medium, Place, Stack, DIRECT_ALIGN_BYTES};
use crate::sys::ublk::{DataDone, DataOp, QueueRing};

use super::uapi::{io_desc, IoDesc};

/// Whether a queue serving `stack` does its reads and writes itself (its places are files).
pub(super) fn reaches(stack: &Stack) -> bool {
    !stack.is_asynchronous() && matches!(stack.medium(), Some(Medium::PageCache | Medium::Direct))
}

/// One place of a request: `len` bytes of the request's buffer from `at`, at `file_offset`
/// of `fd` (`None`: a hole, read as zeroes).
struct Seg {
    fd: Option<RawFd>,
    /// The buffered twin of an O_DIRECT descriptor, for a request the device refuses
    /// unaligned (EINVAL).
    buffered: Option<RawFd>,
    file_offset: u64,
    at: u32,
    len: u32,
    done: u32,
}

/// A request whose reads or writes are in the ring.
struct Mapped {
    write: bool,
    offset: u64,
    len: u64,
    fua: bool,
    /// Its places stay its own until it is finished (dropped after the last completion).
    lease: Lease,
    segs: Vec<Seg>,
    /// Operations in the ring.
    pending: usize,
    /// The first failure (a negative errno).
    error: Option<i32>,
}

/// A queue's reads and writes on its ring, per tag.
pub(super) struct RingIo {
    /// `/dev/zero`: in zero-copy mode a hole is read from it into the request's pages.
    zero: Option<File>,
    map: Map,
    reqs: Vec<Option<Mapped>>,
    done: Vec<DataDone>,
    /// Segment lists of finished requests, for the next ones (no allocation per request).
    spare: Vec<Vec<Seg>>,
}

impl RingIo {
    /// For a queue of `depth` tags serving `stack`, if the stack's places are files the
    /// ring reaches (`None`: every request goes through the stack).
    pub(super) fn new(stack: &Stack, depth: u16, zero_copy: bool) -> io::Result<Option<RingIo>> {
        if !reaches(stack) {
            return Ok(None);
        }
        let zero = match zero_copy {
            true => Some(File::open("/dev/zero")?),
            false => None,
        };
        Ok(Some(RingIo {
            zero,
            map: Map::default(),
            reqs: (0..depth).map(|_| None).collect(),
            done: Vec::new(),
            spare: Vec::new(),
        }))
    }

    /// Starts `tag`'s request on the ring if it is a read or write the stack maps to places
    /// the ring reaches; `false`: answer it another way (nothing was started).
    pub(super) fn start(
        &mut self,
        queue: &mut QueueRing,
        stack: &Stack,
        tag: u16,
        desc: &IoDesc,
    ) -> io::Result<bool> {
        let write = match desc.op() {
            io_desc::OP_READ => false,
            io_desc::OP_WRITE => true,
            _ => return Ok(false),
        };
        let (offset, len) = (desc.offset(), desc.bytes());
        let fua = write && desc.op_flags & io_desc::F_FUA != 0;
        if len == 0 || len > u64::from(u32::MAX) || self.reqs.get(tag as usize).is_none() {
            return Ok(false);
        }
        let how = match write {
            true => MapFor::Write,
            false => MapFor::Read { holes: false },
        };
        let Ok(lease) = stack.map(offset, len, how, &mut self.map) else {
            // The stack's own path gives the request its error.
            return Ok(false);
        };
        // A FUA write whose places need more than RWF_DSYNC (an image's metadata) goes
        // through the stack, which flushes.
        if fua && !self.map.dsync_is_fua {
            return Ok(false);
        }
        let mut segs = self.spare.pop().unwrap_or_default();
        segs.clear();
        let mut at = 0u32;
        for s in self.map.segments() {
            let n = s.len as u32;
            let (fd, buffered, file_offset) = match s.place {
                Place::File { fd, offset } => (Some(fd), None, offset),
                Place::Direct {
                    direct,
                    buffered,
                    offset,
                } => {
                    let aligned = offset.is_multiple_of(DIRECT_ALIGN_BYTES)
                        && u64::from(n).is_multiple_of(DIRECT_ALIGN_BYTES)
                        && u64::from(at).is_multiple_of(DIRECT_ALIGN_BYTES);
                    match aligned {
                        true => (Some(direct), Some(buffered), offset),
                        false => (Some(buffered), None, offset),
                    }
                }
                Place::Zero if !write => (None, None, 0),
                _ => {
                    self.spare.push(segs);
                    return Ok(false);
                }
            };
            segs.push(Seg {
                fd,
                buffered,
                file_offset,
                at,
                len: n,
                done: 0,
            });
            at += n;
        }
        let mut req = Mapped {
            write,
            offset,
            len,
            fua,
            lease,
            segs,
            pending: 0,
            error: None,
        };
        // Copy mode: a hole is zeroes in the tag's buffer, no I/O (first: the buffer is
        // handed out only while no read or write of the tag is in the ring).
        if self.zero.is_none() {
            for seg in req.segs.iter().filter(|s| s.fd.is_none()) {
                let buf = queue
                    .buffer(tag)
                    .ok_or_else(|| io::Error::other(format!("tag {tag} has no buffer")))?;
                buf[seg.at as usize..(seg.at + seg.len) as usize].fill(0);
            }
        }
        for slot in 0..req.segs.len() {
            if req.segs[slot].fd.is_none() && self.zero.is_none() {
                continue;
            }
            self.submit(queue, tag, slot, &req)?;
            req.pending += 1;
        }
        if req.pending == 0 {
            self.finish(queue, stack, tag, req)?;
        } else {
            self.reqs[tag as usize] = Some(req);
        }
        Ok(true)
    }

    /// Sends the rest of segment `slot` of `req` (`tag`'s).
    fn submit(&self, queue: &mut QueueRing, tag: u16, slot: usize, req: &Mapped) -> io::Result<()> {
        let seg = &req.segs[slot];
        let zero = self.zero.as_ref().map(AsRawFd::as_raw_fd);
        let op = DataOp {
            write: req.write,
            // A hole (zero-copy mode): /dev/zero reads as zeroes from any offset.
            fd: seg.fd.or(zero).unwrap_or(-1),
            file_offset: seg.file_offset + u64::from(seg.done),
            at: seg.at + seg.done,
            len: seg.len - seg.done,
            dsync: req.fua,
            link: false,
        };
        queue.push_data(tag, slot as u16, op)
    }

    /// Runs the reads and writes that completed; answers each request whose last one it was.
    pub(super) fn complete(&mut self, queue: &mut QueueRing, stack: &Stack) -> io::Result<()> {
        queue.take_data_done(&mut self.done);
        let done = std::mem::take(&mut self.done);
        for d in &done {
            let Some(mut req) = self.reqs.get_mut(d.tag as usize).and_then(Option::take) else {
                continue;
            };
            if self.resubmits(queue, d, &mut req)? {
                self.reqs[d.tag as usize] = Some(req);
                continue;
            }
            req.pending -= 1;
            if d.result <= 0 && req.error.is_none() {
                // 0: the file ended inside the export (it shrank): an I/O error.
                req.error = Some(if d.result < 0 { d.result } else { -libc::EIO });
            }
            if req.pending == 0 {
                self.finish(queue, stack, d.tag, req)?;
            } else {
                self.reqs[d.tag as usize] = Some(req);
            }
        }
        self.done = done;
        self.done.clear();
        Ok(())
    }

    /// Whether the segment of completion `d` goes on (sent again): a short read or write, an
    /// interrupted one, or an O_DIRECT one the device refused unaligned (then buffered).
    fn resubmits(&self, queue: &mut QueueRing, d: &DataDone, req: &mut Mapped) -> io::Result<bool> {
        let slot = d.slot as usize;
        let Some(seg) = req.segs.get_mut(slot) else {
            return Ok(false);
        };
        match d.result {
            r if r == -libc::EAGAIN || r == -libc::EINTR => {}
            r if r == -libc::EINVAL && seg.buffered.is_some() => {
                seg.fd = seg.buffered.take();
            }
            r if r > 0 && seg.done + (r as u32) < seg.len => seg.done += r as u32,
            _ => return Ok(false),
        }
        self.submit(queue, d.tag, slot, req)?;
        Ok(true)
    }

    /// Answers a request whose reads or writes are all done.
    fn finish(
        &mut self,
        queue: &mut QueueRing,
        stack: &Stack,
        tag: u16,
        req: Mapped,
    ) -> io::Result<()> {
        let mut result = req.error;
        if req.write {
            match result {
                None => {
                    // Durable already if FUA (RWF_DSYNC, which the map said is enough).
                    let landed = stack.written_in_place(req.offset, req.len, req.fua, true);
                    if let Err(e) = landed {
                        result = Some(-e.raw_os_error().unwrap_or(libc::EIO));
                    }
                }
                Some(errno) => {
                    // Part of the range may have changed: the layers are told all the same.
                    stack.wrote_in_place(req.offset, req.len);
                    if req.fua {
                        let e = io::Error::from_raw_os_error(-errno);
                        stack.durability_lost(&format_args!("a FUA write through ublk: {e}"));
                    }
                }
            }
        }
        // The places stop being this request's only now, after its last I/O.
        drop(req.lease);
        self.spare.push(req.segs);
        let answer = match result {
            Some(errno) => errno,
            None => req.len as i32,
        };
        queue.commit(tag, answer)
    }
}
