//! ublk's two devices, with their `unsafe`: `/dev/ublk-control` (commands on a ring of 128-byte
//! entries, one in flight at a time) and a device's `/dev/ublkcN`, whose request descriptors
//! are mapped read-only and whose FETCH / COMMIT commands go on one ring per queue, owned by
//! that queue's thread (the kernel takes I/O commands only from the thread that fetched).
//!
//! Copy mode: each tag has a buffer in this process; the kernel copies a write's data into it
//! before the tag's FETCH completes and a read's data out of it when the COMMIT arrives. So a
//! tag's buffer is the kernel's while its command is in flight and this process's from its
//! completion to its COMMIT ([`QueueRing::buffer`] hands it out only then, or
//! [`QueueRing::lend`] as a [`LentBuffer`] another thread may fill until it comes back with
//! [`QueueRing::commit_lent`]).
//!
//! Zero-copy mode (`uapi::ZERO_COPY_FEATURES`, 6.16+): the kernel copies nothing; it registers
//! each request's pages as fixed buffer `tag` of the queue's ring before the FETCH completes
//! and unregisters them at the COMMIT. Reads and writes the queue submits itself
//! ([`QueueRing::push_data`]) use them in place (`READ_FIXED`/`WRITE_FIXED`); a request the
//! stack answers from the tag's buffer copies its data with `pread`/`pwrite` on `/dev/ublkcN`
//! (USER_COPY, `attach::uapi::user_copy_pos`).
//!
//! Either mode: [`QueueRing::push_data`] reads or writes a file (a place the export's stack
//! mapped the request to) between it and the request's buffer, on the queue's ring; the tag is
//! Busy until the last of them completes (the kernel may use the tag's buffer meanwhile).
//! Descriptors are named by number, as in the engine's ring (`sys::uring::op`): they are the
//! export's files, which the stack the queue serves keeps open; a wrong number could misdirect
//! I/O, never make the kernel touch memory that is not the tag's.
//! The interface itself is `attach::uapi`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use rustix::mm::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};

use super::lent_memory::LentMemory;
use crate::attach::uapi::{
    auto_buf_reg, desc_area_len, desc_area_offset, io_op, CtrlCmd, IoCmd, IoDesc, IO_DESC_BYTES,
};

/// Where the control device is.
pub const CONTROL_PATH: &str = "/dev/ublk-control";

/// `/dev/ublk-control` and a ring to send it commands.
pub struct Control {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    file: File,
}

impl Control {
    /// Opens the control device (ENOENT: no ublk driver loaded).
    pub fn open() -> io::Result<Control> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(CONTROL_PATH)?;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(4)?;
        Ok(Control { ring, file })
    }

    /// Sends control command `op` with `cmd`, `buf` as its buffer (its address and length go
    /// into the command), and waits for the answer: the kernel's result, or its errno.
    pub fn command(
        &mut self,
        op: u32,
        mut cmd: CtrlCmd,
        buf: Option<&mut [u8]>,
    ) -> io::Result<i32> {
        if let Some(b) = &buf {
            cmd.addr = b.as_ptr() as u64;
            cmd.len =
                u16::try_from(b.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        }
        let encoded = cmd.encode();
        let mut area = [0u8; 80];
        area[..encoded.len()].copy_from_slice(&encoded);
        let entry = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op)
            .cmd(area)
            .build()
            .user_data(1);
        // SAFETY: the entry names `buf` (through cmd.addr), which this call borrows until it
        // returns; and it returns only after the command's completion is reaped below (one
        // command in flight at a time: `&mut self`), so the kernel is done with the buffer.
        unsafe {
            self.ring
                .submission()
                .push(&entry)
                .map_err(|_| io::Error::other("control ring full"))?;
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if let Some(cqe) = self.ring.completion().next() {
                let res = cqe.result();
                return if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else {
                    Ok(res)
                };
            }
        }
    }
}

/// Opens device `dev_id`'s character device, `/dev/ublkcN` (exclusive: EBUSY while another
/// process has it open).
pub fn open_char_device(dev_id: u32) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/dev/ublkc{dev_id}"))
}

/// Where a tag stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TagState {
    /// Not fetched yet, or aborted: no command in flight.
    Idle,
    /// A FETCH or COMMIT_AND_FETCH is in flight: the kernel may use the buffer.
    InKernel,
    /// Its request arrived: the buffer is this process's until the COMMIT.
    Ours,
    /// Ours, and lent out as a [`LentBuffer`] until [`QueueRing::commit_lent`].
    Lent,
    /// Ours, with reads or writes of its buffer in the ring ([`QueueRing::push_data`]).
    Busy,
}

/// A read or write of a file between it and part of a request's buffer, which the queue does
/// itself on its ring ([`QueueRing::push_data`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataOp {
    /// To the file (a write request's data); else from it.
    pub write: bool,
    /// The file (see the module's note on descriptors).
    pub fd: RawFd,
    pub file_offset: u64,
    /// Where in the request's buffer.
    pub at: u32,
    pub len: u32,
    /// `RWF_DSYNC` (a write that must be durable when it completes).
    pub dsync: bool,
    /// Linked to the next entry pushed (`IOSQE_IO_LINK`): that one starts only after this
    /// one completes in full, and is cancelled if it did not (a chain of sends on a socket).
    pub link: bool,
}

/// A send or receive of the queue's own memory on a stream socket (an NBD connection's
/// request and reply headers), which the queue does on its ring ([`QueueRing::push_stream`]):
/// `len` bytes from byte `at` of the send area ([`QueueRing::send_area`]) or into the receive
/// area ([`QueueRing::recv_area`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOp {
    pub fd: RawFd,
    pub send: bool,
    pub at: u32,
    pub len: u32,
    /// As [`DataOp::link`].
    pub link: bool,
    /// The caller's name for it, given back with its completion.
    pub id: u16,
}

/// A [`StreamOp`] that completed: its id, direction, and result (bytes moved, or a negative
/// errno).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamDone {
    pub id: u16,
    pub send: bool,
    pub result: i32,
}

/// Bytes of a queue's send area for stream headers and small writes' payloads copied after
/// them (a chain's worth; more than the largest such write with its header).
pub const STREAM_SEND_AREA_BYTES: usize = 64 * 1024;
/// Bytes of a queue's receive area for stream headers (and the small reads' data that comes
/// with them).
pub const STREAM_RECV_AREA_BYTES: usize = 64 * 1024;

/// A [`DataOp`] that completed: its tag, the caller's slot number, and its result (bytes
/// moved, or a negative errno).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataDone {
    pub tag: u16,
    pub slot: u16,
    pub result: i32,
}

/// The tags' buffers: one private anonymous mapping, unmapped when the queue and every
/// [`LentBuffer`] are gone.
struct BufferArea {
    ptr: NonNull<u8>,
    len: usize,
    /// Tags whose [`LentBuffer`] was dropped without coming back ([`QueueRing::commit_orphans`]
    /// answers them), and the eventfd that wakes the queue for them.
    orphans: Mutex<Vec<u16>>,
    wake: Option<Arc<OwnedFd>>,
}

impl Drop for BufferArea {
    fn drop(&mut self) {
        // SAFETY: the mapping is this area's alone; the last reference to it is going, so no
        // slice of it is left (slices borrow a queue or a LentBuffer, each holding the Arc),
        // and a queue with commands in flight leaks its reference instead (QueueRing::drop).
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: the area is plain memory; who may touch which tag's part is decided by the tag
// states of its one queue (a tag's bytes reachable through at most one of the queue or a
// LentBuffer at a time).
unsafe impl Send for BufferArea {}
// SAFETY: shared references to the area hand out nothing by themselves; every access goes
// through a queue (`&mut self`) or a LentBuffer (`&mut self`), as above.
unsafe impl Sync for BufferArea {}

/// A tag's buffer lent to another thread for one request (between the request's arrival and
/// its COMMIT); back to the queue with [`QueueRing::commit_lent`].
pub struct LentBuffer {
    area: Arc<BufferArea>,
    tag: u16,
    at: usize,
    len: usize,
    /// Back with its queue (`commit_lent`): not an orphan.
    returned: bool,
}

impl Drop for LentBuffer {
    /// A lent buffer dropped anywhere but in `commit_lent` (an operation that held it was
    /// dropped unfinished) leaves its request unanswered: the queue answers it with EIO.
    fn drop(&mut self) {
        if self.returned {
            return;
        }
        self.area
            .orphans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.tag);
        if let Some(wake) = &self.area.wake {
            let _ = rustix::io::write(&**wake, &1u64.to_ne_bytes());
        }
    }
}

// SAFETY: the bytes are the tag's part of the buffer mapping, which the LentBuffer's Arc
// keeps mapped wherever the value moves; while it is Lent neither the kernel nor the queue
// touches them (see `as_mut_slice`).
unsafe impl LentMemory for LentBuffer {
    fn bytes(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; `&self` makes the slice shared.
        unsafe { std::slice::from_raw_parts(self.area.ptr.as_ptr().add(self.at), self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl AsMut<[u8]> for LentBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl LentBuffer {
    /// The tag whose buffer this is.
    pub fn tag(&self) -> u16 {
        self.tag
    }

    /// The buffer (the tag's whole buffer, as long as the device's largest request).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `at..at + len` is within the area (checked when lent); the tag is Lent, so
        // neither the kernel (no command in flight for it) nor the queue (it hands out no
        // slice of a Lent tag) touches these bytes until this value comes back, and
        // `&mut self` makes the slice the only one; the Arc keeps the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.area.ptr.as_ptr().add(self.at), self.len) }
    }
}

/// One queue of a device: its ring, its descriptors and its tags' buffers. Owned by one
/// thread: create it on the thread that serves the queue.
pub struct QueueRing {
    /// Declared first, so it goes first: its commands are cancelled before the memory goes.
    ring: IoUring,
    descs: NonNull<u8>,
    descs_len: usize,
    buffers: Arc<BufferArea>,
    buf_bytes: usize,
    q_id: u16,
    tags: Vec<TagState>,
    /// Readable when the queue must stop at once (a start that failed elsewhere): polled
    /// on the ring, so a thread waiting for requests wakes.
    _stop: Arc<OwnedFd>,
    /// Readable when lent buffers have come back with answers (polled likewise).
    wake: Option<Arc<OwnedFd>>,
    /// Readable when an asynchronous stack has completions for this thread to run (polled
    /// while `events.wanted`).
    events: Events,
    /// Zero-copy mode: each request's pages are fixed buffer `tag` of the ring.
    zero_copy: bool,
    /// Per tag: its [`DataOp`]s in the ring.
    busy: Vec<u16>,
    /// Completed [`DataOp`]s, until [`QueueRing::take_data_done`].
    data_done: Vec<DataDone>,
    /// The memory [`StreamOp`]s send from and receive into, and how many of each are in
    /// the ring (while any is, its area is the kernel's).
    send_area: Box<[u8]>,
    recv_area: Box<[u8]>,
    sends: usize,
    recvs: usize,
    stream_done: Vec<StreamDone>,
}

/// The poll on a stack's completion descriptor ([`QueueRing::poll_events`]).
#[derive(Default)]
struct Events {
    fd: Option<Arc<OwnedFd>>,
    /// Whether the next wait should include it (the queue has operations in flight).
    wanted: bool,
    /// A poll is in the ring.
    armed: bool,
    /// It completed since [`QueueRing::take_events`] last said so.
    fired: bool,
}

/// `user_data` of the poll on the stop eventfd (tags are below 4096).
const STOP: u64 = u64::MAX;
/// `user_data` of the poll on the wake eventfd.
const WAKE: u64 = u64::MAX - 1;
/// `user_data` of the poll on the stack's completion descriptor.
const EVENTS: u64 = u64::MAX - 2;
/// Marks a [`DataOp`]'s `user_data` (tag in bits 16..32, slot in 0..16).
const DATA: u64 = 1 << 48;
/// Marks a [`StreamOp`]'s `user_data` (id in bits 0..16, [`SENT`] for a send).
const STREAM: u64 = 1 << 47;
const SENT: u64 = 1 << 32;

/// What [`QueueRing::wait`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// Completions (in `out`).
    Completions,
    /// The stop eventfd was written.
    Stop,
}

fn poll_in(fd: &OwnedFd, user_data: u64) -> squeue::Entry {
    opcode::PollAdd::new(types::Fd(fd.as_raw_fd()), libc::POLLIN as u32)
        .build()
        .user_data(user_data)
}

/// A queue's ring of `entries`, made on the queue's thread, the only one that submits to it
/// and waits on it (as ublk requires). Where it is safe (see [`defers_safely`]), the kernel's
/// completions for it - a request arriving, a read done - are run when that thread next
/// enters the ring (`DEFER_TASKRUN`), so a burst of requests wakes it once and never
/// interrupts it while it works; elsewhere they are run by the thread as it next returns from
/// the kernel (`COOP_TASKRUN`: no interrupt either), or by the kernel once it is gone.
fn queue_ring(entries: u32) -> io::Result<IoUring> {
    let mut builder = IoUring::builder();
    builder.setup_coop_taskrun().setup_single_issuer();
    let release = rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned();
    if defers_safely(&release) {
        builder.setup_defer_taskrun();
    }
    match builder.build(entries) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::builder().build(entries),
        made => made,
    }
}

/// Whether a ring that carries ublk's commands may defer its work to its thread
/// (`DEFER_TASKRUN`) on the kernel `release` (`uname -r`): from Linux 6.19 on. Before (fixed
/// upstream by "io_uring: move local task_work in exit cancel loop", 6.19), when the thread of
/// such a ring dies - the server killed - a request the block layer hands the queue between
/// the kernel's one move of the ring's deferred work and ublk's cancel is run by no one: the
/// kernel's exit of the ring then spins forever, the character device is never released, and
/// the device never leaves `LIVE` for a new server to take it over (its I/O hangs). A CI run
/// of the lab's 6.17 kernel saw it once (`attach/recover-after-kill-copy`).
fn defers_safely(release: &str) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    match (numbers.next(), numbers.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= (6, 19),
        _ => false,
    }
}

impl QueueRing {
    /// Queue `q_id` of the device whose character device is `cdev`, `depth` tags of
    /// `buf_bytes` each; `stop` an eventfd that, once written, ends every wait; `wake` a
    /// non-blocking eventfd that, once written, ends the current wait (threads with lent
    /// buffers write it when they have answers); `zero_copy` as the device was made (its
    /// flags have `uapi::ZERO_COPY_FEATURES`).
    pub fn new(
        cdev: &File,
        q_id: u16,
        depth: u16,
        buf_bytes: usize,
        stop: Arc<OwnedFd>,
        wake: Option<Arc<OwnedFd>>,
        zero_copy: bool,
    ) -> io::Result<QueueRing> {
        let mut ring = queue_ring((u32::from(depth) + 2).next_power_of_two().max(2))?;
        ring.submitter().register_files(&[cdev.as_raw_fd()])?;
        if zero_copy {
            // The slots the kernel registers each tag's request pages at (tag = slot).
            ring.submitter().register_buffers_sparse(u32::from(depth))?;
        }
        let mut polls = vec![poll_in(&stop, STOP)];
        polls.extend(wake.as_ref().map(|w| poll_in(w, WAKE)));
        for poll in &polls {
            // SAFETY: a poll names only its eventfd, which the queue keeps open (`_stop`,
            // `wake`) for as long as its ring lives.
            unsafe { ring.submission().push(poll) }
                .map_err(|_| io::Error::other("queue ring full"))?;
        }
        let descs_len = desc_area_len(depth) as usize;
        // SAFETY: a new read-only shared mapping of the driver's descriptor area for this
        // queue, at the offset and length the driver requires; nothing else refers to it.
        let descs = unsafe {
            mmap(
                std::ptr::null_mut(),
                descs_len,
                ProtFlags::READ,
                MapFlags::SHARED | MapFlags::POPULATE,
                cdev,
                desc_area_offset(q_id),
            )?
        };
        let descs =
            NonNull::new(descs.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?;
        let buffers_len = buf_bytes * depth as usize;
        // SAFETY: a new private anonymous mapping (page-aligned, so every tag's buffer is);
        // MAP_NORESERVE: a tag's pages are only touched as large as its requests are.
        let buffers = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                buffers_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        };
        let buffers = match buffers {
            Ok(p) => Arc::new(BufferArea {
                ptr: NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap at 0"))?,
                len: buffers_len,
                orphans: Mutex::new(Vec::new()),
                wake: wake.clone(),
            }),
            Err(e) => {
                // SAFETY: the descriptor mapping made above, not used by anything yet.
                let _ = unsafe { munmap(descs.as_ptr().cast(), descs_len) };
                return Err(e.into());
            }
        };
        Ok(QueueRing {
            ring,
            descs,
            descs_len,
            buffers,
            buf_bytes,
            q_id,
            tags: vec![TagState::Idle; depth as usize],
            _stop: stop,
            wake,
            events: Events::default(),
            zero_copy,
            busy: vec![0; depth as usize],
            data_done: Vec::new(),
            send_area: vec![0; STREAM_SEND_AREA_BYTES].into_boxed_slice(),
            recv_area: vec![0; STREAM_RECV_AREA_BYTES].into_boxed_slice(),
            sends: 0,
            recvs: 0,
            stream_done: Vec::new(),
        })
    }

    /// Whether the queue runs in zero-copy mode.
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// The queue's id.
    pub fn q_id(&self) -> u16 {
        self.q_id
    }

    fn buffer_addr(&self, tag: u16) -> u64 {
        self.buffers.ptr.as_ptr() as u64 + tag as u64 * self.buf_bytes as u64
    }

    fn push(&mut self, op: u32, tag: u16, result: i32) -> io::Result<()> {
        // Copy mode names the tag's buffer; zero-copy mode none (the kernel refuses one), but
        // the slot to register the request's pages at, in the entry's own address field.
        let cmd = IoCmd {
            q_id: self.q_id,
            tag,
            result,
            addr: if self.zero_copy {
                0
            } else {
                self.buffer_addr(tag)
            },
        };
        let mut entry = opcode::UringCmd16::new(types::Fixed(0), op).cmd(cmd.encode());
        if self.zero_copy {
            entry = entry.addr(Some(auto_buf_reg(tag)));
        }
        let entry = entry.build().user_data(u64::from(tag));
        // SAFETY: the command names the tag's buffer, which lives as long as `self`; the tag
        // is marked InKernel, so no slice of it is handed out until its completion, and Drop
        // keeps the buffers mapped while any tag is InKernel.
        unsafe {
            while self.ring.submission().push(&entry).is_err() {
                self.ring.submit()?;
            }
        }
        self.tags[tag as usize] = TagState::InKernel;
        Ok(())
    }

    /// Queues a FETCH for every tag (sent with the next [`QueueRing::wait`]).
    pub fn fetch_all(&mut self) -> io::Result<()> {
        for tag in 0..self.tags.len() as u16 {
            self.push(io_op::FETCH_REQ, tag, 0)?;
        }
        Ok(())
    }

    /// Reads or writes part of `tag`'s request buffer from or to a file (sent with the next
    /// [`QueueRing::wait`]); its completion comes back through
    /// [`QueueRing::take_data_done`] with `slot`. The tag must be this process's (not lent);
    /// it is Busy until its last such operation completes, and cannot be committed before.
    pub fn push_data(&mut self, tag: u16, slot: u16, op: DataOp) -> io::Result<()> {
        let state = self.tags.get(tag as usize).copied();
        if !matches!(state, Some(TagState::Ours | TagState::Busy)) {
            return Err(io::Error::other(format!(
                "tag {tag} has no request to serve"
            )));
        }
        let end = u64::from(op.at) + u64::from(op.len);
        if end > self.buf_bytes as u64 || op.len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let fd = types::Fd(op.fd);
        let flags = if op.dsync { libc::RWF_DSYNC } else { 0 };
        let entry = match (self.zero_copy, op.write) {
            // The request's pages, registered at slot `tag`, from byte `at` (a kernel
            // buffer's addresses start at 0).
            (true, false) => opcode::ReadFixed::new(fd, u64::from(op.at) as *mut u8, op.len, tag)
                .offset(op.file_offset)
                .build(),
            (true, true) => opcode::WriteFixed::new(fd, u64::from(op.at) as *const u8, op.len, tag)
                .offset(op.file_offset)
                .rw_flags(flags)
                .build(),
            (false, false) => {
                let ptr = (self.buffer_addr(tag) + u64::from(op.at)) as *mut u8;
                opcode::Read::new(fd, ptr, op.len)
                    .offset(op.file_offset)
                    .build()
            }
            (false, true) => {
                let ptr = (self.buffer_addr(tag) + u64::from(op.at)) as *const u8;
                opcode::Write::new(fd, ptr, op.len)
                    .offset(op.file_offset)
                    .rw_flags(flags)
                    .build()
            }
        };
        let mut entry = entry.user_data(DATA | (u64::from(tag) << 16) | u64::from(slot));
        if op.link {
            entry = entry.flags(squeue::Flags::IO_LINK);
        }
        // SAFETY: copy mode: the entry names `at..at+len` of the tag's buffer (checked above
        // to be inside it), which lives as long as `self`; the tag is Busy from here until
        // its last data operation completes, so no slice of it is handed out meanwhile, and
        // Drop keeps the buffers mapped while any tag is Busy. Zero-copy mode: it names the
        // ring's fixed buffer slot, which the kernel checks (a read or write past the
        // request's pages fails with EFAULT). The descriptor: see the module's note.
        unsafe {
            while self.ring.submission().push(&entry).is_err() {
                self.ring.submit()?;
            }
        }
        self.tags[tag as usize] = TagState::Busy;
        self.busy[tag as usize] += 1;
        Ok(())
    }

    /// The data operations completed since the last call, into `out`.
    pub fn take_data_done(&mut self, out: &mut Vec<DataDone>) {
        out.append(&mut self.data_done);
    }

    /// Free entries in the submission queue now: a chain of linked entries must be pushed
    /// whole between two submissions (one split by a submission is two chains). Submits
    /// what is queued first if fewer than `wanted` are free.
    pub fn make_room(&mut self, wanted: usize) -> io::Result<usize> {
        let free = |ring: &mut IoUring| {
            let sq = ring.submission();
            sq.capacity() - sq.len()
        };
        if free(&mut self.ring) < wanted {
            self.ring.submit()?;
        }
        Ok(free(&mut self.ring))
    }

    /// The send area, while no [`StreamOp`] send is in the ring.
    pub fn send_area(&mut self) -> Option<&mut [u8]> {
        (self.sends == 0).then_some(&mut self.send_area[..])
    }

    /// The receive area, while no [`StreamOp`] receive is in the ring.
    pub fn recv_area(&self) -> Option<&[u8]> {
        (self.recvs == 0).then_some(&self.recv_area[..])
    }

    /// Sends from the send area or receives into the receive area (sent with the next
    /// [`QueueRing::wait`]); its completion comes back through
    /// [`QueueRing::take_stream_done`]. The area is the kernel's until every such
    /// operation on it has completed.
    pub fn push_stream(&mut self, op: StreamOp) -> io::Result<()> {
        let area = match op.send {
            true => self.send_area.len(),
            false => self.recv_area.len(),
        };
        if op.len == 0 || u64::from(op.at) + u64::from(op.len) > area as u64 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let fd = types::Fd(op.fd);
        let entry = match op.send {
            true => {
                let ptr = self.send_area[op.at as usize..].as_ptr();
                opcode::Send::new(fd, ptr, op.len)
                    .flags(libc::MSG_NOSIGNAL | libc::MSG_WAITALL)
                    .build()
                    .user_data(STREAM | SENT | u64::from(op.id))
            }
            false => {
                let ptr = self.recv_area[op.at as usize..].as_mut_ptr();
                opcode::Recv::new(fd, ptr, op.len)
                    .build()
                    .user_data(STREAM | u64::from(op.id))
            }
        };
        let entry = match op.link {
            true => entry.flags(squeue::Flags::IO_LINK),
            false => entry,
        };
        // SAFETY: the entry names `at..at+len` of one of the queue's areas (checked above to
        // be inside it), boxed, so it stays put while the queue lives; the area is handed
        // out (`send_area`, `recv_area`) only while no operation on it is in the ring, and
        // Drop leaks both areas while any is. The descriptor: see the module's note.
        unsafe {
            while self.ring.submission().push(&entry).is_err() {
                self.ring.submit()?;
            }
        }
        match op.send {
            true => self.sends += 1,
            false => self.recvs += 1,
        }
        Ok(())
    }

    /// The stream operations completed since the last call, into `out`.
    pub fn take_stream_done(&mut self, out: &mut Vec<StreamDone>) {
        out.append(&mut self.stream_done);
    }

    /// Answers `tag`'s request with `result` (bytes done, or a negative errno) and fetches
    /// its next one (sent with the next [`QueueRing::wait`]).
    pub fn commit(&mut self, tag: u16, result: i32) -> io::Result<()> {
        if self.tags.get(tag as usize) != Some(&TagState::Ours) {
            return Err(io::Error::other(format!(
                "tag {tag} has no request to answer"
            )));
        }
        self.push(io_op::COMMIT_AND_FETCH_REQ, tag, result)
    }

    /// Sends what is queued without waiting (the FETCHes, before the device starts).
    pub fn submit(&mut self) -> io::Result<()> {
        self.ring.submit().map(|_| ())
    }

    /// Makes waits also end when `fd` (an asynchronous stack's completion descriptor) is
    /// readable, while [`QueueRing::want_events`] says so. Once: a later call is ignored.
    pub fn poll_events(&mut self, fd: Arc<OwnedFd>) {
        self.events.fd.get_or_insert(fd);
    }

    /// Whether the next waits include the completion descriptor (the queue has operations
    /// in flight on the stack; a poll already in the ring stays until it fires).
    pub fn want_events(&mut self, wanted: bool) {
        self.events.wanted = wanted;
    }

    /// Whether the completion descriptor became readable since this last said so.
    pub fn take_events(&mut self) -> bool {
        std::mem::take(&mut self.events.fired)
    }

    /// Sends what is queued and waits for at least one completion: `(tag, result)` pairs into
    /// `out` (0: a request is in the tag's descriptor; `uapi::IO_RES_ABORT`: the device is
    /// going away and the tag is done), or the stop eventfd.
    pub fn wait(&mut self, out: &mut Vec<(u16, i32)>) -> io::Result<Woken> {
        if let (true, false, Some(fd)) = (self.events.wanted, self.events.armed, &self.events.fd) {
            // Armed before each wait rather than right after it fires: its completions are
            // run between the two, so a level-triggered poll does not fire again for them.
            let poll = poll_in(fd, EVENTS);
            // SAFETY: the poll names only the descriptor the queue keeps open (`events.fd`,
            // never replaced once set) for as long as its ring lives.
            unsafe {
                while self.ring.submission().push(&poll).is_err() {
                    self.ring.submit()?;
                }
            }
            self.events.armed = true;
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let mut woken = Woken::Completions;
        let mut rearm = false;
        for cqe in self.ring.completion() {
            if cqe.user_data() == STOP {
                woken = Woken::Stop;
                continue;
            }
            if cqe.user_data() == WAKE {
                rearm = true;
                continue;
            }
            if cqe.user_data() == EVENTS {
                self.events.armed = false;
                self.events.fired = true;
                continue;
            }
            if cqe.user_data() & DATA != 0 && cqe.user_data() < EVENTS {
                let tag = (cqe.user_data() >> 16) as u16;
                let slot = cqe.user_data() as u16;
                if let Some(n) = self.busy.get_mut(tag as usize) {
                    *n = n.saturating_sub(1);
                    if *n == 0 && self.tags[tag as usize] == TagState::Busy {
                        self.tags[tag as usize] = TagState::Ours;
                    }
                }
                self.data_done.push(DataDone {
                    tag,
                    slot,
                    result: cqe.result(),
                });
                continue;
            }
            if cqe.user_data() & STREAM != 0 && cqe.user_data() < DATA {
                let send = cqe.user_data() & SENT != 0;
                match send {
                    true => self.sends = self.sends.saturating_sub(1),
                    false => self.recvs = self.recvs.saturating_sub(1),
                }
                self.stream_done.push(StreamDone {
                    id: cqe.user_data() as u16,
                    send,
                    result: cqe.result(),
                });
                continue;
            }
            let tag = cqe.user_data() as u16;
            let res = cqe.result();
            if let Some(state) = self.tags.get_mut(tag as usize) {
                *state = if res == 0 {
                    TagState::Ours
                } else {
                    TagState::Idle
                };
            }
            out.push((tag, res));
        }
        if let (true, Some(wake)) = (rearm, &self.wake) {
            // Reset the count (non-blocking: nothing to read is fine), then poll again; an
            // answer that came after the read makes the new poll ready at once.
            let mut count = [0u8; 8];
            let _ = rustix::io::read(&**wake, &mut count);
            let poll = poll_in(wake, WAKE);
            // SAFETY: as in `new`: the poll names only the eventfd the queue keeps open.
            unsafe {
                while self.ring.submission().push(&poll).is_err() {
                    self.ring.submit()?;
                }
            }
        }
        Ok(woken)
    }

    /// The request in `tag`'s descriptor.
    pub fn desc(&self, tag: u16) -> IoDesc {
        let mut bytes = [0u8; IO_DESC_BYTES];
        let at = tag as usize * IO_DESC_BYTES;
        assert!(
            at + IO_DESC_BYTES <= self.descs_len,
            "tag {tag} beyond the queue"
        );
        // SAFETY: within the read-only mapping (checked above); the kernel wrote this tag's
        // descriptor before completing its FETCH and leaves it alone until the COMMIT, and
        // a volatile byte copy reads it without forming a reference to shared memory.
        unsafe {
            let src = self.descs.as_ptr().add(at);
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = std::ptr::read_volatile(src.add(i));
            }
        }
        IoDesc::decode(&bytes)
    }

    /// `tag`'s buffer, while its request is this process's (between its completion and its
    /// COMMIT); `None` otherwise.
    pub fn buffer(&mut self, tag: u16) -> Option<&mut [u8]> {
        if self.tags.get(tag as usize) != Some(&TagState::Ours) {
            return None;
        }
        // SAFETY: the tag's slice of the buffer mapping; the kernel does not touch it while
        // the tag is Ours (no command in flight for it), and `&mut self` keeps the slice
        // the only reference until the COMMIT, which needs `&mut self` again.
        Some(unsafe {
            std::slice::from_raw_parts_mut(
                self.buffers.ptr.as_ptr().add(tag as usize * self.buf_bytes),
                self.buf_bytes,
            )
        })
    }

    /// `tag`'s buffer for another thread, while its request is this process's; `None`
    /// otherwise (or if it is lent already).
    pub fn lend(&mut self, tag: u16) -> Option<LentBuffer> {
        let state = self.tags.get_mut(tag as usize)?;
        if *state != TagState::Ours {
            return None;
        }
        *state = TagState::Lent;
        Some(LentBuffer {
            area: Arc::clone(&self.buffers),
            tag,
            at: tag as usize * self.buf_bytes,
            len: self.buf_bytes,
            returned: false,
        })
    }

    /// Answers the request of a lent buffer's tag with `result` and fetches its next one.
    pub fn commit_lent(&mut self, mut lent: LentBuffer, result: i32) -> io::Result<()> {
        let tag = lent.tag;
        if !Arc::ptr_eq(&lent.area, &self.buffers)
            || self.tags.get(tag as usize) != Some(&TagState::Lent)
        {
            return Err(io::Error::other(format!(
                "tag {tag}'s buffer was not lent by this queue"
            )));
        }
        lent.returned = true;
        drop(lent);
        self.tags[tag as usize] = TagState::Ours;
        self.commit(tag, result)
    }

    /// Answers with EIO the requests whose lent buffers were dropped without coming back
    /// (see `LentBuffer`'s `Drop`); how many.
    pub fn commit_orphans(&mut self) -> io::Result<usize> {
        let orphans = std::mem::take(
            &mut *self
                .buffers
                .orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let mut answered = 0;
        for tag in orphans {
            if self.tags.get(tag as usize) == Some(&TagState::Lent) {
                self.tags[tag as usize] = TagState::Ours;
                self.commit(tag, -libc::EIO)?;
                answered += 1;
            }
        }
        Ok(answered)
    }

    /// Whether any tag still has a command or a data operation in flight.
    pub fn in_kernel(&self) -> bool {
        self.tags
            .iter()
            .any(|t| matches!(t, TagState::InKernel | TagState::Busy))
    }
}

impl Drop for QueueRing {
    fn drop(&mut self) {
        // SAFETY: the descriptor mapping is this queue's alone; nothing reads it after this.
        let _ = unsafe { munmap(self.descs.as_ptr().cast(), self.descs_len) };
        if self.in_kernel() {
            // The ring's teardown cancels the commands, but the kernel may still copy into a
            // tag's buffer before it does: leaving the buffers mapped is the safe side.
            tracing::warn!(
                queue = self.q_id,
                "ublk queue closed with requests in flight: its buffers stay mapped"
            );
            std::mem::forget(Arc::clone(&self.buffers));
        }
        if self.sends + self.recvs > 0 {
            // Likewise for the stream areas: the kernel may still be sending from or
            // receiving into them.
            std::mem::forget(std::mem::take(&mut self.send_area));
            std::mem::forget(std::mem::take(&mut self.recv_area));
        }
        // Otherwise the buffers go with the last of this queue and its lent buffers.
    }
}

// SAFETY: the mappings are owned by the queue and reached only through `&mut self` (or `&self`
// for the read-only descriptors); moving the queue to its thread before first use is fine.
unsafe impl Send for QueueRing {}

#[cfg(test)]
mod tests {
    use super::defers_safely;

    #[test]
    fn deferred_work_only_where_the_exit_of_a_ring_cannot_spin() {
        assert!(!defers_safely("6.12.111+deb12-amd64"));
        assert!(!defers_safely("6.17.13+deb13-amd64"));
        assert!(!defers_safely("6.18.15"));
        assert!(defers_safely("6.19.0"));
        assert!(defers_safely("6.19-rc1"));
        assert!(defers_safely("7.0.2-arch1-1"));
        assert!(!defers_safely("5.15.0"));
        assert!(!defers_safely("weird"));
        assert!(!defers_safely(""));
    }
}
