//! `zcnbd attach`: an export as a local block device, `/dev/ublkbN`, through the kernel's
//! ublk driver (Linux 6.0+): the kernel hands each block request to a queue thread of this
//! process over io_uring, which answers it through the export's stack.
//!
//! The device's life: ADD_DEV (the kernel picks the id and says which features it kept),
//! SET_PARAMS (size, block sizes, read-only, flush/FUA, discard and write-zeroes from the
//! export's capabilities), one thread per queue that maps its descriptors and fetches every
//! tag, START_DEV (from this thread, while the queues serve: the kernel reads the partition
//! table through them before it returns, so `/dev/ublkbNp1` exists when it does), then serve
//! until STOP_DEV (ours, on a signal, or `zcnbd detach`'s) aborts every tag, and DEL_DEV.
//!
//! Two modes, chosen per device and logged (and in `zcnbd list`):
//! - zero copy, where the kernel offers it (`uapi::ZERO_COPY_FEATURES`: 6.16+, asked with
//!   GET_FEATURES and checked in the flags ADD_DEV returns, since a kernel drops bits it does
//!   not know) and the source is files the queue's ring reaches (a raw file or device, an
//!   image's data clusters): each request's pages are a fixed buffer of its queue's ring, read
//!   into and written from the file in place (`ring_io.rs`); the rare request the stack
//!   answers itself copies its data through `/dev/ublkcN` (`queue::UserCopy`);
//! - copy mode otherwise (6.12, the VM lab's default kernel; memory, NBD, RBD sources): the
//!   kernel copies a request's data once between its pages and the tag's buffer, which the
//!   stack - or the queue's ring, for files - reads into or writes from.

mod async_request;
pub mod driver;
pub mod in_use;
mod io_path;
pub mod nbd;
pub mod placement;
mod queue;
mod ring_io;
mod ring_nbd;
pub mod uapi;
mod windows;

use windows::Windows;

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::export::{Capabilities, Stack};
use crate::sys::ublk::{open_char_device, Control, QueueRing};
use placement::{cpu_list, cpus_of_mask, Placement};
use queue::Pool;
use rustix::thread::CpuSet;

use uapi::{
    attr, ctrl_op, feature, CtrlCmd, DevInfo, Params, PARAM_TYPE_BASIC, PARAM_TYPE_DISCARD,
    ZERO_COPY_FEATURES,
};

/// Marks zcnbd's devices (`ublksrv_flags`, which the kernel keeps for the device's owner).
pub const DEVICE_MARK: u64 = u64::from_be_bytes(*b"zcnbd\0a1");

/// Requests in flight per queue unless `--queue-depth` says else.
pub const QUEUE_DEPTH_DEFAULT: u16 = 128;
/// The largest request the device takes unsplit (`max_io_buf_bytes`), and each tag's buffer.
pub const IO_BUF_BYTES_DEFAULT: u32 = 1 << 20;
/// The largest `--io-buf-bytes` accepted (the driver's user-copy window).
pub const IO_BUF_BYTES_MAX: u32 = 32 << 20;
/// Threads per queue answering requests of a source that waits (an NBD or RBD export's round
/// trips, a file read with O_DIRECT), unless `--io-threads` says else: enough for requests
/// to overlap at a fio-like depth of 32 spread over queues. A source that answers from
/// memory or the page cache gets 0 - each request on its queue's thread, in order - as
/// handing requests to other threads cost more than it gained there (the attach section of
/// docs/benchmarks/).
pub const IO_THREADS_WAITING_DEFAULT: u16 = 16;
pub use queue::IO_THREADS_MAX;
/// How long a new `/dev/ublkcN` may take to appear.
const NODE_WAIT: Duration = Duration::from_secs(5);

/// How the device is made.
#[derive(Debug, Clone)]
pub struct AttachOptions {
    /// Queues (threads); the kernel allows at most one per CPU.
    pub queues: u16,
    /// Requests in flight per queue.
    pub queue_depth: u16,
    /// The largest request, and each tag's buffer (a multiple of 4096).
    pub io_buf_bytes: u32,
    /// Advertise the device as rotational.
    pub rotational: bool,
    /// Ask the kernel to keep the device, its I/O waiting, if this process dies
    /// (`UBLK_F_USER_RECOVERY` with re-issue), for `recover` to take over.
    pub recovery: bool,
    /// Threads per queue answering requests (0: the queue's own thread, one at a time).
    pub io_threads: u16,
    /// Zero-copy mode where the kernel and the source allow it (else copy mode).
    pub zero_copy: bool,
    /// Where each queue's thread runs.
    pub placement: Placement,
}

impl Default for AttachOptions {
    fn default() -> AttachOptions {
        AttachOptions {
            queues: std::thread::available_parallelism()
                .map_or(1, |n| u16::try_from(n.get()).unwrap_or(u16::MAX)),
            queue_depth: QUEUE_DEPTH_DEFAULT,
            io_buf_bytes: IO_BUF_BYTES_DEFAULT,
            rotational: false,
            recovery: true,
            io_threads: 0,
            zero_copy: true,
            placement: Placement::default(),
        }
    }
}

/// Why a device could not be made, served or removed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("no ublk driver: {path} is missing (modprobe ublk_drv; Linux 6.0 or later)", path = crate::sys::ublk::CONTROL_PATH)]
    NoDriver,
    #[error("ublk devices need root (CAP_SYS_ADMIN)")]
    NotPermitted,
    #[error("{0}")]
    Unsupported(String),
    #[error("{what}: {source}")]
    Kernel {
        what: &'static str,
        source: io::Error,
    },
    #[error("no zcnbd device {0}")]
    UnknownDevice(String),
}

fn kernel(what: &'static str) -> impl FnOnce(io::Error) -> AttachError {
    move |source| AttachError::Kernel { what, source }
}

fn open_control() -> Result<Control, AttachError> {
    Control::open().map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => AttachError::NoDriver,
        io::ErrorKind::PermissionDenied => AttachError::NotPermitted,
        _ => kernel("open the ublk control device")(e),
    })
}

/// A device being served.
pub struct Attached {
    control: Control,
    info: DevInfo,
    queues: Vec<JoinHandle<io::Result<()>>>,
    /// Kept open while the queues serve; closed before DEL_DEV (which waits for it).
    cdev: Option<Arc<File>>,
    stop_fd: Arc<OwnedFd>,
    deleted: bool,
    /// Dropped now, the device stays (a recovery that did not finish).
    keep: bool,
}

/// The ublk parameters for `stack`.
fn params(stack: &Stack, options: &AttachOptions, minimum: u32) -> Result<Params, AttachError> {
    let logical = minimum.max(512);
    if !logical.is_power_of_two() || logical > 4096 {
        return Err(AttachError::Unsupported(format!(
            "a block device's sectors are 512 to 4096 bytes; this export's minimum block size is {minimum}"
        )));
    }
    let caps: Capabilities = stack.capabilities();
    let physical = logical.max(4096);
    let mut attrs = 0;
    if stack.is_read_only() {
        attrs |= attr::READ_ONLY;
    }
    if caps.flush {
        attrs |= attr::VOLATILE_CACHE | attr::FUA;
    }
    if options.rotational {
        attrs |= attr::ROTATIONAL;
    }
    let writable = !stack.is_read_only();
    let big = (1u32 << 30) >> 9;
    let discard = writable && caps.trim;
    let zeroes = writable && caps.zero;
    let size = stack.size();
    if !size.is_multiple_of(u64::from(logical)) {
        tracing::warn!(size, logical, "the export's size is not a whole number of sectors: the device ends at the last whole one");
    }
    Ok(Params {
        types: PARAM_TYPE_BASIC
            | if discard || zeroes {
                PARAM_TYPE_DISCARD
            } else {
                0
            },
        attrs,
        logical_bs_shift: logical.trailing_zeros() as u8,
        physical_bs_shift: physical.trailing_zeros() as u8,
        io_min_shift: physical.trailing_zeros() as u8,
        io_opt_shift: options.io_buf_bytes.trailing_zeros() as u8,
        max_sectors: options.io_buf_bytes >> 9,
        dev_sectors: ((size / u64::from(logical)) * u64::from(logical)) >> 9,
        discard_granularity: if discard || zeroes { physical } else { 0 },
        max_discard_sectors: if discard { big } else { 0 },
        max_write_zeroes_sectors: if zeroes { big } else { 0 },
        max_discard_segments: u16::from(discard || zeroes),
    })
}

/// Makes a device for `stack` (whose minimum block size is `minimum`) and starts serving it;
/// returns once the kernel has it (and its partitions).
pub fn attach(
    stack: Arc<Stack>,
    minimum: u32,
    options: &AttachOptions,
) -> Result<Attached, AttachError> {
    if !options.io_buf_bytes.is_multiple_of(4096)
        || options.io_buf_bytes < 4096
        || options.io_buf_bytes > IO_BUF_BYTES_MAX
    {
        return Err(AttachError::Unsupported(format!(
            "the largest request must be a multiple of 4096 from 4096 to {IO_BUF_BYTES_MAX} (IO_BUF_BYTES_MAX)"
        )));
    }
    check_io_threads(options.io_threads)?;
    if options.queue_depth == 0
        || options.queue_depth > uapi::MAX_QUEUE_DEPTH
        || options.queues == 0
    {
        return Err(AttachError::Unsupported(format!(
            "queues and queue depth go from 1 (depth up to {})",
            uapi::MAX_QUEUE_DEPTH
        )));
    }
    let params = params(&stack, options, minimum)?;
    let mut control = open_control()?;
    // From here on this thread, and every thread and io_uring worker it starts (the control
    // ring's, the queues'), is in the I/O path; after the driver check, so that a host
    // without ublk gets its one line.
    io_path::join();
    let kernel_zero_copy = features(&mut control)? & ZERO_COPY_FEATURES == ZERO_COPY_FEATURES;
    let zero_copy = options.zero_copy && on_ring(&stack) && kernel_zero_copy;
    let mut buf = DevInfo {
        nr_hw_queues: options.queues,
        queue_depth: options.queue_depth,
        max_io_buf_bytes: options.io_buf_bytes,
        dev_id: u32::MAX,
        ublksrv_pid: -1,
        flags: if options.recovery { RECOVERY } else { 0 }
            | if zero_copy { ZERO_COPY_FEATURES } else { 0 },
        ublksrv_flags: DEVICE_MARK,
        state: 0,
    }
    .encode();
    let add = CtrlCmd {
        dev_id: u32::MAX,
        queue_id: u16::MAX,
        ..CtrlCmd::default()
    };
    control
        .command(ctrl_op::ADD_DEV, add, Some(&mut buf))
        .map_err(kernel("add a ublk device"))?;
    let info = DevInfo::decode(&buf);
    let io_threads = io_threads_beside_ring(&stack, options.io_threads);
    let mut attached = Attached::new(control, info)?;
    // From here on, a failure deletes the device (Attached's Drop).
    let kept = info.flags & ZERO_COPY_FEATURES;
    if kept != 0 && kept != ZERO_COPY_FEATURES {
        return Err(AttachError::Unsupported(format!(
            "the kernel kept only part of zero-copy mode's features ({kept:#x}): attach with \
--no-zero-copy"
        )));
    }
    tracing::info!(
        device = %attached.device_path().display(),
        queues = info.nr_hw_queues,
        depth = info.queue_depth,
        io_threads,
        max_request = info.max_io_buf_bytes,
        features = format_args!("{:#x}", info.flags),
        mode = mode_of(info.flags),
        why = why_mode(options, &stack, info.flags),
        recovery = info.flags & RECOVERY == RECOVERY,
        queue_placement = options.placement.name(),
        "ublk device added"
    );
    if options.recovery && info.flags & RECOVERY != RECOVERY {
        tracing::warn!(
            "this kernel keeps no ublk device for a new process: the device goes with this one"
        );
    }
    let mut p = params.encode();
    attached
        .control
        .command(ctrl_op::SET_PARAMS, attached.cmd(), Some(&mut p))
        .map_err(kernel("set the ublk device's parameters"))?;
    let cdev = Arc::new(wait_for_char_device(info.dev_id)?);
    attached.cdev = Some(Arc::clone(&cdev));
    attached.spawn_queues(&cdev, &stack, io_threads, options.placement)?;
    let start = CtrlCmd {
        data: u64::from(std::process::id()),
        ..attached.cmd()
    };
    attached
        .control
        .command(ctrl_op::START_DEV, start, None)
        .map_err(kernel("start the ublk device"))?;
    Ok(attached)
}

/// The device features this kernel's driver knows (GET_FEATURES, 6.5+; 0 before).
fn features(control: &mut Control) -> Result<u64, AttachError> {
    let cmd = CtrlCmd {
        dev_id: u32::MAX,
        queue_id: u16::MAX,
        ..CtrlCmd::default()
    };
    let mut buf = [0u8; uapi::FEATURES_BYTES];
    match control.command(ctrl_op::GET_FEATURES, cmd, Some(&mut buf)) {
        Ok(_) => Ok(u64::from_ne_bytes(buf)),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(0),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(0),
        Err(e) => Err(kernel("ask the ublk driver's features")(e)),
    }
}

/// I/O threads per queue at least, where the queue's ring does a file's reads and writes
/// (`ring_io.rs`): a request through the stack may wait for the lease of one of the ring's
/// requests in flight (a write to an image's cluster being read), which only the queue's
/// thread can end - so such a request never runs on that thread.
pub const IO_THREADS_BESIDE_RING: u16 = 2;

/// The I/O threads a queue serving `stack` gets when `asked` for.
fn io_threads_beside_ring(stack: &Stack, asked: u16) -> u16 {
    match on_ring(stack) {
        true => asked.max(IO_THREADS_BESIDE_RING),
        false => asked,
    }
}

/// Whether a queue's ring does the reads and writes of `stack` itself (in zero-copy mode,
/// in the request's pages): a file's (`ring_io.rs`), or a plain NBD upstream's over a
/// connection of the queue's own (`ring_nbd.rs`).
fn on_ring(stack: &Stack) -> bool {
    ring_io::reaches(stack) || stack.nbd_stream().is_some()
}

/// A device's mode, from its flags.
fn mode_of(flags: u64) -> &'static str {
    match flags & ZERO_COPY_FEATURES == ZERO_COPY_FEATURES {
        true => "zero-copy",
        false => "copy",
    }
}

/// Why a new device runs in its mode (for the log).
fn why_mode(options: &AttachOptions, stack: &Stack, flags: u64) -> &'static str {
    if flags & ZERO_COPY_FEATURES == ZERO_COPY_FEATURES {
        "the kernel registers each request's pages for the queue's ring"
    } else if !options.zero_copy {
        "--no-zero-copy"
    } else if !on_ring(stack) {
        "the source is neither files nor a plain multi-conn NBD upstream the queue's ring \
reads and writes (memory, RBD, nbds://, a filter)"
    } else {
        "this kernel's ublk has no automatic buffer registration (6.16+)"
    }
}

fn check_io_threads(threads: u16) -> Result<(), AttachError> {
    if threads > IO_THREADS_MAX {
        return Err(AttachError::Unsupported(format!(
            "I/O threads per queue go from 0 to {IO_THREADS_MAX} (IO_THREADS_MAX)"
        )));
    }
    Ok(())
}

/// The features that keep a device, its I/O waiting and then re-issued, for a new process.
const RECOVERY: u64 = feature::USER_RECOVERY | feature::USER_RECOVERY_REISSUE;
/// How long a recovery waits for the kernel to let go of the dead process's device.
const RECOVERY_WAIT: Duration = Duration::from_secs(30);

/// Takes over zcnbd's device `device`, whose attach process died, serving it from `stack`
/// (the same data: its size must match): the I/O that waited is re-issued to this process,
/// answered by `io_threads` threads per queue, each queue's thread placed by `placement`.
pub fn recover(
    device: &str,
    stack: Arc<Stack>,
    minimum: u32,
    io_threads: u16,
    placement: Placement,
) -> Result<Attached, AttachError> {
    check_io_threads(io_threads)?;
    let id = device_id(device)?;
    let mut control = open_control()?;
    // From here on this thread, and every thread and io_uring worker it starts (the control
    // ring's, the queues'), is in the I/O path; after the driver check, so that a host
    // without ublk gets its one line.
    io_path::join();
    let (info, params) = match query(&mut control, id)? {
        Some(found) => found,
        None => return Err(AttachError::UnknownDevice(device.to_string())),
    };
    if info.state != uapi::state::QUIESCED {
        return Err(AttachError::Unsupported(format!(
            "{device} is not waiting for a server (its attach process {} still serves it, or it \
was made without recovery)",
            info.ublksrv_pid
        )));
    }
    let want = stack.size() >> params.logical_bs_shift << params.logical_bs_shift >> 9;
    if params.dev_sectors != want
        || u32::from(params.logical_bs_shift) < minimum.max(512).trailing_zeros()
    {
        return Err(AttachError::Unsupported(format!(
            "{device} holds {} bytes; this source has {} (the same data is needed)",
            params.dev_sectors << 9,
            stack.size()
        )));
    }
    let cmd = CtrlCmd {
        dev_id: id,
        queue_id: u16::MAX,
        ..CtrlCmd::default()
    };
    // EBUSY while the kernel still tears down the dead process's queues.
    let deadline = Instant::now() + RECOVERY_WAIT;
    loop {
        match control.command(ctrl_op::START_USER_RECOVERY, cmd, None) {
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(kernel("start recovering the ublk device")(e)),
        }
    }
    let mut attached = Attached::new(control, info)?;
    // A recovery that fails leaves the device waiting for another try, not deleted.
    attached.keep = true;
    let cdev = Arc::new(wait_for_char_device(id)?);
    attached.cdev = Some(Arc::clone(&cdev));
    attached.spawn_queues(
        &cdev,
        &stack,
        io_threads_beside_ring(&stack, io_threads),
        placement,
    )?;
    let end = CtrlCmd {
        data: u64::from(std::process::id()),
        ..cmd
    };
    attached
        .control
        .command(ctrl_op::END_USER_RECOVERY, end, None)
        .map_err(kernel("end recovering the ublk device"))?;
    attached.keep = false;
    tracing::info!(
        device = %attached.device_path().display(),
        mode = mode_of(info.flags),
        queue_placement = placement.name(),
        "ublk device taken over: its waiting I/O goes on"
    );
    Ok(attached)
}

/// `/dev/ublkbN`, `ublkbN` or `N`: N.
fn device_id(device: &str) -> Result<u32, AttachError> {
    device
        .trim_start_matches("/dev/")
        .trim_start_matches("ublkb")
        .parse()
        .map_err(|_| AttachError::UnknownDevice(device.to_string()))
}

/// Opens `/dev/ublkcN`, which devtmpfs (or udev) makes shortly after ADD_DEV.
fn wait_for_char_device(dev_id: u32) -> Result<File, AttachError> {
    let deadline = Instant::now() + NODE_WAIT;
    loop {
        match open_char_device(dev_id) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(kernel("open the ublk character device")(e)),
        }
    }
}

impl Attached {
    fn new(control: Control, info: DevInfo) -> Result<Attached, AttachError> {
        let stop_fd = Arc::new(
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
                .map_err(|e| kernel("make an eventfd")(e.into()))?,
        );
        Ok(Attached {
            control,
            info,
            queues: Vec::new(),
            cdev: None,
            stop_fd,
            deleted: false,
            keep: false,
        })
    }

    fn cmd(&self) -> CtrlCmd {
        CtrlCmd {
            dev_id: self.info.dev_id,
            queue_id: u16::MAX,
            ..CtrlCmd::default()
        }
    }

    /// The CPUs queue `q`'s thread is kept to by `placement`, and those the process may use
    /// (for the threads that help it); `None`: every thread where it may run now.
    fn queue_cpus(&mut self, q: u16, placement: Placement) -> Option<(CpuSet, CpuSet)> {
        if placement == Placement::Any {
            return None;
        }
        let mut mask = [0u8; CpuSet::MAX_CPU / 8];
        let cmd = CtrlCmd {
            data: u64::from(q),
            ..self.cmd()
        };
        let served = match self
            .control
            .command(ctrl_op::GET_QUEUE_AFFINITY, cmd, Some(&mut mask))
        {
            Ok(_) => cpus_of_mask(&mask),
            Err(e) => {
                tracing::warn!(
                    queue = q,
                    error = %e,
                    "the kernel did not say which CPUs the queue serves: its thread runs \
                     where the scheduler puts it"
                );
                return None;
            }
        };
        let allowed = rustix::thread::sched_getaffinity(None).ok()?;
        let cpus = placement.cpus(&served, &allowed);
        tracing::debug!(
            queue = q,
            serves = %cpu_list(&served),
            runs_on = %cpus.as_ref().map_or_else(|| cpu_list(&allowed), cpu_list),
            "the queue's thread"
        );
        cpus.map(|cpus| (cpus, allowed))
    }

    /// One thread per queue (each with `io_threads` I/O threads), placed by `placement`;
    /// returns once each has fetched its tags (or one failed).
    fn spawn_queues(
        &mut self,
        cdev: &Arc<File>,
        stack: &Arc<Stack>,
        io_threads: u16,
        placement: Placement,
    ) -> Result<(), AttachError> {
        let (ready_tx, ready_rx) = mpsc::channel::<io::Result<()>>();
        let windows = Arc::new(Windows::default());
        for q in 0..self.info.nr_hw_queues {
            let cpus = self.queue_cpus(q, placement);
            let wake = match io_threads {
                0 => None,
                _ => Some(Arc::new(
                    rustix::event::eventfd(
                        0,
                        rustix::event::EventfdFlags::CLOEXEC
                            | rustix::event::EventfdFlags::NONBLOCK,
                    )
                    .map_err(|e| kernel("make an eventfd")(e.into()))?,
                )),
            };
            let pool = wake.clone().map(|w| Pool {
                threads: io_threads,
                wake: w,
                cpus: cpus.map(|(_, allowed)| allowed),
            });
            let (cdev, stack, stop, windows) = (
                Arc::clone(cdev),
                Arc::clone(stack),
                Arc::clone(&self.stop_fd),
                Arc::clone(&windows),
            );
            let (depth, buf_bytes) = (self.info.queue_depth, self.info.max_io_buf_bytes as usize);
            let zero_copy = self.info.flags & ZERO_COPY_FEATURES == ZERO_COPY_FEATURES;
            let ready = ready_tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ublk-q{q}"))
                .spawn(move || {
                    // (Its I/O threads go back to every CPU the process may use;
                    // io_uring's workers stay on the thread's, as the kernel keeps them.)
                    if let Some((cpus, _)) = &cpus {
                        if let Err(e) = rustix::thread::sched_setaffinity(None, cpus) {
                            tracing::warn!(queue = q, error = %e, "could not place the queue's thread");
                        }
                    }
                    let started = QueueRing::new(&cdev, q, depth, buf_bytes, stop, wake, zero_copy)
                        .and_then(|mut ring| {
                            ring.fetch_all()?;
                            ring.submit()?;
                            Ok(ring)
                        });
                    let mut ring = match started {
                        Ok(ring) => {
                            let _ = ready.send(Ok(()));
                            ring
                        }
                        Err(e) => {
                            let _ = ready.send(Err(io::Error::new(e.kind(), e.to_string())));
                            return Err(e);
                        }
                    };
                    queue::serve(&mut ring, &stack, depth, pool, &cdev, &windows)
                })
                .map_err(kernel("start a queue thread"))?;
            self.queues.push(handle);
        }
        for _ in 0..self.info.nr_hw_queues {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(kernel("set up a ublk queue")(e)),
                Err(_) => return Err(AttachError::Unsupported("a queue thread ended".into())),
            }
        }
        Ok(())
    }

    /// The block device, `/dev/ublkbN`.
    pub fn device_path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.info.dev_id))
    }

    /// The device's id (the N of `/dev/ublkbN`).
    pub fn dev_id(&self) -> u32 {
        self.info.dev_id
    }

    /// Whether every queue has ended (the device was stopped, by us or by `zcnbd detach`).
    pub fn stopped(&self) -> bool {
        self.queues.iter().all(JoinHandle::is_finished)
    }

    /// Serves until `stop` is set (a signal) or someone else stops the device, then removes
    /// it; the first queue's error, if any.
    pub fn serve_until(mut self, stop: &AtomicBool) -> Result<(), AttachError> {
        while !stop.load(Ordering::Relaxed) && !self.stopped() {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.remove()
    }

    /// STOP_DEV (every tag aborted, the disk gone), the queues joined, DEL_DEV.
    fn remove(&mut self) -> Result<(), AttachError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        let stop = self.control.command(ctrl_op::STOP_DEV, self.cmd(), None);
        // A started device's queues end once STOP_DEV has aborted their tags; a device that
        // never started (an attach that failed) aborts nothing: wake its queues.
        let deadline = Instant::now() + Duration::from_secs(2);
        while stop.is_ok() && !self.stopped() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = rustix::io::write(&*self.stop_fd, &1u64.to_ne_bytes());
        let mut first_error = None;
        for q in self.queues.drain(..) {
            match q.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "a ublk queue failed");
                    first_error.get_or_insert(kernel("serve a ublk queue")(e));
                }
                Err(_) => {
                    first_error
                        .get_or_insert(AttachError::Unsupported("a queue thread panicked".into()));
                }
            }
        }
        self.cdev = None;
        match self.control.command(ctrl_op::DEL_DEV, self.cmd(), None) {
            // Deleted already (zcnbd detach of a device it took for ownerless).
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
            other => {
                other.map_err(kernel("delete the ublk device"))?;
            }
        }
        tracing::info!(device = %self.device_path().display(), "ublk device removed");
        stop.map_err(kernel("stop the ublk device"))?;
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if self.keep {
            let _ = rustix::io::write(&*self.stop_fd, &1u64.to_ne_bytes());
            for q in self.queues.drain(..) {
                let _ = q.join();
            }
            return;
        }
        if let Err(e) = self.remove() {
            tracing::warn!(error = %e, device = %self.device_path().display(), "removing the ublk device");
        }
    }
}

/// A zcnbd device the kernel has, for `zcnbd list`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    pub device: String,
    pub size_bytes: u64,
    pub read_only: bool,
    pub queues: u16,
    pub queue_depth: u16,
    pub state: &'static str,
    /// Kept for a new process if its attach process dies (`zcnbd attach --recover`).
    pub recovery: bool,
    /// How a request's data moves: "zero-copy" (the request's pages used in place) or "copy".
    pub mode: &'static str,
    pub pid: i32,
}

/// The devices zcnbd made that the kernel has now (ublk's character devices in
/// `/sys/class/ublk-char`, asked one by one).
pub fn list() -> Result<Vec<DeviceInfo>, AttachError> {
    let mut ids: Vec<u32> = match std::fs::read_dir("/sys/class/ublk-char") {
        Ok(dir) => dir
            .filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()?
                    .strip_prefix("ublkc")?
                    .parse()
                    .ok()
            })
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(kernel("read /sys/class/ublk-char")(e)),
    };
    ids.sort_unstable();
    let mut control = open_control()?;
    let mut devices = Vec::new();
    for id in ids {
        if let Some(d) = describe(&mut control, id)? {
            devices.push(d);
        }
    }
    Ok(devices)
}

/// Device `id`'s information and parameters, if it is zcnbd's.
fn query(control: &mut Control, id: u32) -> Result<Option<(DevInfo, Params)>, AttachError> {
    let cmd = CtrlCmd {
        dev_id: id,
        queue_id: u16::MAX,
        ..CtrlCmd::default()
    };
    let mut buf = [0u8; uapi::DEV_INFO_BYTES];
    match control.command(ctrl_op::GET_DEV_INFO, cmd, Some(&mut buf)) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(None),
        Err(e) => return Err(kernel("ask a ublk device")(e)),
    }
    let info = DevInfo::decode(&buf);
    if info.ublksrv_flags != DEVICE_MARK {
        return Ok(None);
    }
    let mut p = [0u8; uapi::PARAMS_BYTES];
    p[0..4].copy_from_slice(&(uapi::PARAMS_BYTES as u32).to_ne_bytes());
    control
        .command(ctrl_op::GET_PARAMS, cmd, Some(&mut p))
        .map_err(kernel("ask a ublk device's parameters"))?;
    Ok(Some((info, Params::decode(&p))))
}

/// Device `id`, if it is zcnbd's, for `zcnbd list`.
fn describe(control: &mut Control, id: u32) -> Result<Option<DeviceInfo>, AttachError> {
    let Some((info, params)) = query(control, id)? else {
        return Ok(None);
    };
    Ok(Some(DeviceInfo {
        device: format!("/dev/ublkb{id}"),
        size_bytes: params.dev_sectors << 9,
        read_only: params.attrs & attr::READ_ONLY != 0,
        queues: info.nr_hw_queues,
        queue_depth: info.queue_depth,
        state: match info.state {
            uapi::state::LIVE => "live",
            uapi::state::QUIESCED => "waiting",
            _ => "stopped",
        },
        recovery: info.flags & RECOVERY == RECOVERY,
        mode: mode_of(info.flags),
        pid: info.ublksrv_pid,
    }))
}

/// Stops zcnbd's device `device` (`/dev/ublkbN`, `ublkbN` or `N`): its attach process then
/// removes it and exits. Waits until it is gone.
pub fn detach(device: &str) -> Result<(), AttachError> {
    let id = device_id(device)?;
    let mut control = open_control()?;
    // Its owner, asked before STOP_DEV (which forgets it).
    let Some(found) = describe(&mut control, id)? else {
        return Err(AttachError::UnknownDevice(device.to_string()));
    };
    let owner_alive =
        found.pid > 0 && std::path::Path::new(&format!("/proc/{}", found.pid)).exists();
    let cmd = CtrlCmd {
        dev_id: id,
        queue_id: u16::MAX,
        ..CtrlCmd::default()
    };
    control
        .command(ctrl_op::STOP_DEV, cmd, None)
        .map_err(kernel("stop the ublk device"))?;
    if !owner_alive {
        // Its attach process is gone (killed): nobody else will delete it.
        control
            .command(ctrl_op::DEL_DEV, cmd, None)
            .map_err(kernel("delete the ublk device"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let node = PathBuf::from(format!("/sys/class/ublk-char/ublkc{id}"));
    while node.exists() {
        if Instant::now() > deadline {
            return Err(AttachError::Unsupported(format!(
                "/dev/ublkb{id} was stopped but its attach process has not removed it"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
