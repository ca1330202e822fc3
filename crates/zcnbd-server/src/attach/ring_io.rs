//! Reads and writes a queue does itself, on its own ring: a request the export's stack maps
//! to places the ring reaches - a file through the page cache or with O_DIRECT, holes - is
//! one read or write per place between the file and the request's buffer (the tag's buffer
//! in copy mode; in zero-copy mode the request's own pages, registered as the ring's fixed
//! buffer, so no byte is copied by the CPU), with no other thread involved. A raw file is one
//! place; a qcow2 image's request one per run of contiguous clusters.
//!
//! A file in memory (tmpfs: `/tmp` on many systems, `/dev/shm`) is the exception for small
//! requests: io_uring hands every operation on such a file to a worker thread (tmpfs has no
//! non-blocking reads), two wake-ups for a copy of a few KiB, so a request of up to
//! [`INLINE_MAX_BYTES`] whose places are all in memory is copied by the queue thread itself
//! (`pread`/`pwrite` into the tag's buffer; in zero-copy mode in one `pwritev`/`preadv` on
//! `/dev/ublkcN` from or into the file's shared mapping, `windows.rs`, else through a queue
//! buffer and `/dev/ublkcN`), as the kernel's loop device does in its worker. Larger ones stay on the
//! ring in zero-copy mode, where the worker's copy into the request's pages runs beside the
//! queue thread; in copy mode they go to the queue's I/O threads, which run on any CPU
//! (io_uring's workers only on the queue thread's: `attach/placement.rs`).
//!
//! Ownership (the data-safety rule): the request holds the lease of its map until its last
//! read or write completes, so a cluster it was mapped to stays its own whatever other
//! requests do meanwhile; a write tells the stack's layers (dirty bitmaps) of its range
//! whatever became of it. A request the stack cannot map that way now (computed bytes, a
//! change of the range running) is answered through the stack as before.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::export::{Lease, Map, MapFor, Medium, Place, Stack, DIRECT_ALIGN_BYTES};
use crate::sys::place_io;
use crate::sys::ublk::{DataDone, DataOp, QueueRing};
use crate::sys::window_copy::{self, Piece};

use super::uapi::{io_desc, user_copy_pos, IoDesc};
use super::windows::{Window, Windows};

/// The largest request the queue thread copies itself when its places are files in memory
/// (a larger one goes to the ring, whose worker copies it beside the queue thread).
pub(super) const INLINE_MAX_BYTES: u64 = 64 << 10;

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

impl Drop for RingIo {
    fn drop(&mut self) {
        tracing::info!(
            queue = self.q_id,
            on_ring = self.on_ring,
            copied_by_queue_thread = self.copied_here,
            through_mappings = self.through_windows,
            to_io_threads = self.to_threads,
            "the queue's reads and writes of files"
        );
    }
}

impl Seg {
    /// The descriptor a copy on the queue thread uses (an O_DIRECT place's buffered twin:
    /// in memory the two are the same).
    fn inline_fd(&self) -> Option<RawFd> {
        self.buffered.or(self.fd)
    }
}

/// Reads `req`'s places into `buf` (holes as zeroes), or writes `buf` to them.
fn copy_places(req: &Mapped, buf: &mut [u8]) -> io::Result<()> {
    for seg in &req.segs {
        let part = buf
            .get_mut(seg.at as usize..(seg.at + seg.len) as usize)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        match (seg.inline_fd(), req.write) {
            (None, false) => part.fill(0),
            // A write is never mapped to a hole.
            (None, true) => return Err(io::Error::from_raw_os_error(libc::EIO)),
            (Some(fd), false) => place_io::read_exact_at(fd, part, seg.file_offset)?,
            (Some(fd), true) => place_io::write_all_at(fd, part, seg.file_offset, req.fua)?,
        }
    }
    Ok(())
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
    /// Which descriptors the places named are files in memory (asked once each).
    in_memory: Vec<(RawFd, bool)>,
    /// Zero-copy mode: the device's `/dev/ublkcN` and a buffer, for the requests the queue
    /// thread copies itself.
    user_copy: Option<(Arc<File>, Vec<u8>)>,
    /// Zero-copy mode: the device's mappings of its files in memory, and those this queue
    /// has asked for.
    windows: Option<Arc<Windows>>,
    known_windows: Vec<(RawFd, Option<Arc<Window>>)>,
    held_windows: Vec<Option<Arc<Window>>>,
    /// Requests copied through a mapping (logged at the end).
    through_windows: u64,
    q_id: u16,
    /// Requests started on the ring, and copied by the queue thread (logged at the end).
    on_ring: u64,
    copied_here: u64,
    /// Copy mode: larger requests in memory handed to the I/O threads.
    to_threads: u64,
}

impl RingIo {
    /// For queue `q_id` of `depth` tags serving `stack`, if the stack's places are files the
    /// ring reaches (`None`: every request goes through the stack); `zero_copy`: the device's
    /// `/dev/ublkcN` and its mappings of files in memory, in zero-copy mode.
    pub(super) fn new(
        stack: &Stack,
        depth: u16,
        zero_copy: Option<(&Arc<File>, &Arc<Windows>)>,
        q_id: u16,
    ) -> io::Result<Option<RingIo>> {
        if !reaches(stack) {
            return Ok(None);
        }
        let (zero, user_copy, windows) = match zero_copy {
            Some((cdev, windows)) => (
                Some(File::open("/dev/zero")?),
                Some((Arc::clone(cdev), vec![0; INLINE_MAX_BYTES as usize])),
                Some(Arc::clone(windows)),
            ),
            None => (None, None, None),
        };
        Ok(Some(RingIo {
            zero,
            map: Map::default(),
            reqs: (0..depth).map(|_| None).collect(),
            done: Vec::new(),
            spare: Vec::new(),
            in_memory: Vec::new(),
            user_copy,
            windows,
            known_windows: Vec::new(),
            held_windows: Vec::new(),
            through_windows: 0,
            q_id,
            on_ring: 0,
            copied_here: 0,
            to_threads: 0,
        }))
    }

    /// Sees every request of the queue before it is answered: a discard or write of zeroes
    /// may punch holes, after which reads no longer go through mappings (`windows.rs`).
    pub(super) fn note(&self, desc: &IoDesc) {
        if let (io_desc::OP_DISCARD | io_desc::OP_WRITE_ZEROES, Some(windows)) =
            (desc.op(), &self.windows)
        {
            windows.punched();
        }
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
        if self.all_in_memory(&req.segs) {
            if len <= INLINE_MAX_BYTES {
                self.copied_here += 1;
                if let Err(e) = self.copy_inline(queue, tag, &req) {
                    req.error = Some(-e.raw_os_error().unwrap_or(libc::EIO));
                }
                self.finish(queue, stack, tag, req)?;
                return Ok(true);
            }
            // Copy mode: a larger one goes to the queue's I/O threads, which copy it into
            // the tag's buffer on any CPU - io_uring's worker would copy it on the queue
            // thread's CPUs only (the kernel keeps a thread's workers on the CPUs it is
            // kept to: `--queue-placement`). In zero-copy mode the worker reads it into
            // the request's pages, one copy where the I/O threads would make two.
            if self.zero.is_none() {
                self.to_threads += 1;
                self.spare.push(req.segs);
                return Ok(false);
            }
        }
        self.on_ring += 1;
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

    /// Whether every file place of `segs` is a file in memory.
    fn all_in_memory(&mut self, segs: &[Seg]) -> bool {
        segs.iter().filter_map(Seg::inline_fd).all(|fd| {
            if let Some(&(_, known)) = self.in_memory.iter().find(|(f, _)| *f == fd) {
                return known;
            }
            let known = place_io::in_memory(fd);
            if known && self.q_id == 0 {
                tracing::info!(
                    max_bytes = INLINE_MAX_BYTES,
                    "a file of the source is in memory (tmpfs): smaller requests are copied by \
                     the queue thread, not handed to an io_uring worker"
                );
            }
            self.in_memory.push((fd, known));
            known
        })
    }

    /// Copies `req` (`tag`'s, at most [`INLINE_MAX_BYTES`]) between its places and the
    /// request on this thread: in the tag's buffer, or in zero-copy mode in the queue's
    /// buffer, from and to the request's pages through `/dev/ublkcN`.
    fn copy_inline(&mut self, queue: &mut QueueRing, tag: u16, req: &Mapped) -> io::Result<()> {
        let len = req.len as usize;
        if self.copy_through_windows(tag, req) {
            self.through_windows += 1;
            return Ok(());
        }
        match self.user_copy.as_mut() {
            Some((cdev, scratch)) => {
                let buf = &mut scratch[..len];
                let pos = user_copy_pos(self.q_id, tag, 0);
                if req.write {
                    cdev.read_exact_at(buf, pos)?;
                }
                copy_places(req, buf)?;
                if !req.write {
                    cdev.write_all_at(buf, pos)?;
                }
                Ok(())
            }
            None => {
                let buf = queue
                    .buffer(tag)
                    .and_then(|b| b.get_mut(..len))
                    .ok_or_else(|| io::Error::other(format!("tag {tag} has no buffer")))?;
                copy_places(req, buf)
            }
        }
    }

    /// Zero-copy mode: copies `req` (`tag`'s) between the request and its files' mappings in
    /// one call, if every place has one that may be used; `false`: copy it another way (a
    /// copy that failed or came up short is done again that way, whole).
    fn copy_through_windows(&mut self, tag: u16, req: &Mapped) -> bool {
        let (Some(windows), Some((cdev, _))) = (self.windows.as_ref(), self.user_copy.as_ref())
        else {
            return false;
        };
        // The mappings of the request's places, in order (`None`: a hole); kept for the
        // next request, so no allocation per request.
        let mut held = std::mem::take(&mut self.held_windows);
        held.clear();
        for seg in &req.segs {
            let Some(fd) = seg.inline_fd() else {
                held.push(None);
                continue;
            };
            let known = match self.known_windows.iter().find(|(f, _)| *f == fd) {
                Some((_, w)) => w.clone(),
                None => {
                    let w = windows.window(fd);
                    self.known_windows.push((fd, w.clone()));
                    w
                }
            };
            match known {
                Some(w) if req.write || windows.reads_through(&w) => held.push(Some(w)),
                _ => {
                    self.held_windows = held;
                    return false;
                }
            }
        }
        let pieces = req.segs.iter().zip(&held).map(|(seg, w)| match w {
            Some(w) => Piece::Mapped {
                map: &w.map,
                offset: seg.file_offset,
                len: seg.len as usize,
            },
            None => Piece::Zeroes(seg.len as usize),
        });
        let pos = user_copy_pos(self.q_id, tag, 0);
        let copied = match req.write {
            true => window_copy::take(cdev, pos, pieces),
            false => window_copy::give(cdev, pos, pieces),
        };
        self.held_windows = held;
        match copied {
            Ok(n) if n as u64 == req.len => true,
            other => {
                tracing::debug!(
                    tag,
                    result = ?other.map_err(|e| e.to_string()),
                    "a copy through a mapping failed or came up short: done by pread and pwrite"
                );
                false
            }
        }
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
