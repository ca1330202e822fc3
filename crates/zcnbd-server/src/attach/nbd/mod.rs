//! `zcnbd attach --driver nbd`: an export as `/dev/nbdN` through the kernel's NBD client
//! (nbd.ko), where ublk is absent. The export is served by zcnbd's own server over Unix socket
//! pairs (`link.rs`: its handshake and engine on one end, the client handshake on the other),
//! and the client ends go to the kernel with generic netlink's NBD_CMD_CONNECT (`genl.rs`,
//! over `netlink.rs` and `family.rs`): what `qemu-nbd -c` and `nbd-client` do.
//!
//! The device's life: CONNECT (the kernel picks the index; the export's size, block size and
//! transmission flags; a dead-connection timeout, so that when this process dies the I/O
//! waits for `zcnbd attach --recover`, which hands new connections over with
//! NBD_CMD_RECONFIGURE; the backend identifier `zcnbd:...`, which marks the device as
//! zcnbd's in `/sys/block/nbdN/backend`), serve until a signal or `zcnbd detach` (which
//! sends NBD_CMD_DISCONNECT: the kernel closes the connections), then flush the export.

mod error;
mod family;
pub mod genl;
mod link;
pub mod netlink;
mod owner;
mod sysfs;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use zcnbd_proto::consts::transmission_flags::CAN_MULTI_CONN;

pub use error::NbdError;
use family::NbdFamily;
use link::Link;
use sysfs::{alive, connected_pid, device_index, ours, serving_pid, sys_attr};
pub use sysfs::{list, NbdDevice, BACKEND_PREFIX};

use crate::export::{Export, Stack};
use crate::server::{EngineOptions, Limits, Server};

/// The longest backend identifier given to the kernel (a long source is cut).
pub const BACKEND_BYTES_MAX: usize = 256;
/// How long I/O waits for `zcnbd attach --recover` after this process died, unless
/// `--dead-connection-timeout` says else.
pub const DEAD_CONN_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);
/// The largest request nbd.ko sends (its queue's `max_hw_sectors`, 65536 sectors): the
/// export's largest payload, so no request is refused.
pub const REQUEST_BYTES_MAX: u32 = 32 << 20;
/// Most connections (and so queues) of one device.
pub const CONNECTIONS_MAX: u16 = 64;
/// How long `zcnbd detach` and the end of an attach wait for the kernel to let go.
const RELEASE_WAIT: Duration = Duration::from_secs(30);

/// How the device is made.
#[derive(Debug, Clone)]
pub struct NbdOptions {
    /// Connections (each a queue of the device; more than one needs an export that allows
    /// multi-conn); `None`: one per CPU where it does, else one.
    pub connections: Option<u16>,
    /// How long I/O waits for new connections after this process died (0: it fails at once).
    pub dead_conn_timeout: Duration,
    /// The server's engine.
    pub engine: EngineOptions,
}

impl Default for NbdOptions {
    fn default() -> NbdOptions {
        NbdOptions {
            connections: None,
            dead_conn_timeout: DEAD_CONN_TIMEOUT_DEFAULT,
            engine: EngineOptions::default(),
        }
    }
}

/// Whether the kernel has the NBD client (the `nbd` netlink family resolves).
pub fn probe() -> Result<(), NbdError> {
    NbdFamily::open().map(drop)
}

/// A device being served.
pub struct NbdAttached {
    family: NbdFamily,
    index: u32,
    backend: String,
    sessions: Vec<JoinHandle<()>>,
    stack: Arc<Stack>,
    removed: bool,
}

/// nbd.ko's block size: the export's minimum, at least 512, a power of two up to a page.
fn block_size(minimum: u32) -> Result<u64, NbdError> {
    let logical = minimum.max(512);
    if !logical.is_power_of_two() || logical > 4096 {
        return Err(NbdError::Unsupported(format!(
            "a block device's sectors are 512 to 4096 bytes; this export's minimum block size is {minimum}"
        )));
    }
    Ok(u64::from(logical))
}

/// `zcnbd:recovery:SOURCE` or `zcnbd:no-recovery:SOURCE`, cut to [`BACKEND_BYTES_MAX`].
fn backend_identifier(source: &str, recovery: bool) -> String {
    let mode = if recovery { "recovery" } else { "no-recovery" };
    let mut id = format!("{BACKEND_PREFIX}{mode}:{source}");
    let mut cut = id.len().min(BACKEND_BYTES_MAX);
    while !id.is_char_boundary(cut) {
        cut -= 1;
    }
    id.truncate(cut);
    id
}

/// The server for `export` and its connections: the first, then as many more as wanted (or
/// one per CPU) where the export allows multi-conn. The server's threads are in the I/O path.
fn open_links(export: Export, options: &NbdOptions) -> Result<(Arc<Server>, Vec<Link>), NbdError> {
    super::io_path::join();
    let server = Server::with_engine(vec![export], Limits::default(), options.engine.clone())?;
    let first = link::open(&server, 0)?;
    let multi = first.negotiated.flags & CAN_MULTI_CONN != 0;
    let wanted = match options.connections {
        Some(0) => return Err(NbdError::Unsupported("a device needs a connection".into())),
        Some(n) if n > 1 && !multi => {
            return Err(NbdError::Unsupported(format!(
                "{n} connections asked for, but this export does not allow multi-conn (one queue)"
            )))
        }
        Some(n) if n > CONNECTIONS_MAX => {
            return Err(NbdError::Unsupported(format!(
                "at most {CONNECTIONS_MAX} connections (CONNECTIONS_MAX)"
            )))
        }
        Some(n) => n,
        None if multi => std::thread::available_parallelism()
            .map_or(1, |n| u16::try_from(n.get()).unwrap_or(CONNECTIONS_MAX))
            .min(CONNECTIONS_MAX),
        None => 1,
    };
    let mut links = vec![first];
    for n in 1..usize::from(wanted) {
        links.push(link::open(&server, n)?);
    }
    Ok((server, links))
}

/// Makes a device for `export` and starts serving it; returns once the kernel has it (and
/// has been asked for its partitions).
pub fn attach(export: Export, options: &NbdOptions) -> Result<NbdAttached, NbdError> {
    let block = block_size(export.block_size.minimum)?;
    let mut family = NbdFamily::open()?;
    let stack = Arc::clone(&export.stack);
    let backend = backend_identifier(&export.source, !options.dead_conn_timeout.is_zero());
    let (_server, links) = open_links(export, options)?;
    let fds: Vec<u32> = links.iter().map(Link::fd).collect();
    let agreed = &links[0].negotiated;
    let seq = family.next_seq();
    let connect = genl::Connect {
        index: None,
        size_bytes: agreed.size,
        block_size_bytes: block,
        server_flags: agreed.flags,
        // The server is this process: a slow request is no dead server.
        timeout_s: 0,
        dead_conn_timeout_s: options.dead_conn_timeout.as_secs(),
        sockets: &fds,
        backend: &backend,
    };
    let message = genl::connect(family.id(), seq, &connect)?;
    let answer = family.call(&message, seq, "connect the nbd device")?;
    let (_, reply) = answer
        .reply
        .ok_or(NbdError::Netlink(netlink::NetlinkError::Missing(
            genl::ATTR_INDEX,
        )))?;
    let index = genl::connected_index(&reply)?;
    tracing::info!(
        device = %format!("/dev/nbd{index}"),
        connections = fds.len(),
        size = agreed.size,
        flags = format_args!("{:#x}", agreed.flags),
        dead_conn_timeout_s = options.dead_conn_timeout.as_secs(),
        "nbd device connected"
    );
    // The kernel holds its own references to the client ends: ours go.
    let sessions = links.into_iter().map(|l| l.session).collect();
    let attached = NbdAttached {
        family,
        index,
        backend,
        sessions,
        stack,
        removed: false,
    };
    owner::claim(index);
    attached.scan_partitions();
    Ok(attached)
}

/// How long a recovery waits to see whether the kernel kept the connections it was given
/// (it drops those it has no dead connection for, and says nothing).
const TAKEN_WAIT: Duration = Duration::from_millis(500);

/// Gives zcnbd's device `device`, whose attach process died (its I/O waiting, for the
/// dead-connection timeout), new connections served from `export` (the same data: its size
/// must match) with NBD_CMD_RECONFIGURE: the waiting I/O goes on.
pub fn recover(
    device: &str,
    export: Export,
    options: &NbdOptions,
) -> Result<NbdAttached, NbdError> {
    let index = device_index(device)?;
    let mut family = NbdFamily::open()?;
    let backend = ours(index).ok_or_else(|| NbdError::UnknownDevice(device.to_string()))?;
    if let Some(pid) = serving_pid(index).filter(|p| alive(*p)) {
        return Err(NbdError::Unsupported(format!(
            "{device} is still served by its attach process {pid}"
        )));
    }
    let block = block_size(export.block_size.minimum)?;
    let want = export.stack.size() / block * block;
    let has = sys_attr(index, "size")
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0)
        << 9;
    if has != want {
        return Err(NbdError::Unsupported(format!(
            "{device} holds {has} bytes; this source has {want} (the same data is needed)"
        )));
    }
    let queues = std::fs::read_dir(format!("/sys/block/nbd{index}/mq")).map_or(1, |d| d.count());
    let options = NbdOptions {
        connections: Some(u16::try_from(queues).unwrap_or(CONNECTIONS_MAX)),
        ..options.clone()
    };
    let stack = Arc::clone(&export.stack);
    let (_server, links) = open_links(export, &options)?;
    let fds: Vec<u32> = links.iter().map(Link::fd).collect();
    let seq = family.next_seq();
    let message = genl::reconfigure(family.id(), seq, index, &fds, &backend)?;
    family.call(&message, seq, "give the nbd device new connections")?;
    let sessions: Vec<JoinHandle<()>> = links.into_iter().map(|l| l.session).collect();
    std::thread::sleep(TAKEN_WAIT);
    if sessions.iter().all(JoinHandle::is_finished) {
        return Err(NbdError::Unsupported(format!(
            "the kernel took no connection: {device} has none dead (was it made with --no-recovery, or is it served?)"
        )));
    }
    owner::claim(index);
    tracing::info!(device = %format!("/dev/nbd{index}"), connections = fds.len(), "nbd device given new connections: its waiting I/O goes on");
    Ok(NbdAttached {
        family,
        index,
        backend,
        sessions,
        stack,
        removed: false,
    })
}

impl NbdAttached {
    /// The block device, `/dev/nbdN`.
    pub fn device_path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/nbd{}", self.index))
    }

    /// Opens the device once: the kernel reads its partition table at the first open after
    /// CONNECT, so `/dev/nbdNp1` exists once udev settles.
    fn scan_partitions(&self) {
        if let Err(e) = std::fs::File::open(self.device_path()) {
            tracing::warn!(error = %e, device = %self.device_path().display(), "opening the device to read its partitions");
        }
    }

    /// Serves until `stop` is set (a signal) or the connections close (`zcnbd detach`), then
    /// disconnects the device and flushes the export.
    pub fn serve_until(mut self, stop: &AtomicBool) -> Result<(), NbdError> {
        while !stop.load(Ordering::Relaxed) && !self.sessions.iter().all(JoinHandle::is_finished) {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.remove()
    }

    /// NBD_CMD_DISCONNECT (if the device is still this one), the sessions' end, a flush.
    fn remove(&mut self) -> Result<(), NbdError> {
        if self.removed {
            return Ok(());
        }
        self.removed = true;
        let disconnected = match ours(self.index) {
            Some(b) if b == self.backend => disconnect(&mut self.family, self.index),
            _ => Ok(()),
        };
        let deadline = Instant::now() + RELEASE_WAIT;
        while !self.sessions.iter().all(JoinHandle::is_finished) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        for s in self.sessions.drain(..).filter(JoinHandle::is_finished) {
            let _ = s.join();
        }
        let flushed = self.stack.flush();
        owner::release(self.index);
        tracing::info!(device = %self.device_path().display(), "nbd device disconnected");
        disconnected?;
        flushed.map_err(error::kernel("flush the export"))
    }
}

impl Drop for NbdAttached {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            tracing::warn!(error = %e, device = %self.device_path().display(), "disconnecting the nbd device");
        }
    }
}

fn disconnect(family: &mut NbdFamily, index: u32) -> Result<(), NbdError> {
    let seq = family.next_seq();
    let message = genl::disconnect(family.id(), seq, index)?;
    family.call(&message, seq, "disconnect the nbd device")?;
    Ok(())
}

/// Disconnects zcnbd's device `device` (`/dev/nbdN`, `nbdN` or `N`): its attach process then
/// flushes the export and exits. Waits until the kernel and that process let go.
pub fn detach(device: &str) -> Result<(), NbdError> {
    let index = device_index(device)?;
    let mut family = NbdFamily::open()?;
    if ours(index).is_none() {
        return Err(NbdError::UnknownDevice(device.to_string()));
    }
    let owner = serving_pid(index);
    disconnect(&mut family, index)?;
    let deadline = Instant::now() + RELEASE_WAIT;
    while connected_pid(index).is_some() || owner.is_some_and(alive) {
        if Instant::now() > deadline {
            return Err(NbdError::Unsupported(format!(
                "/dev/nbd{index} was disconnected but is still held (mounted, or its attach process has not ended)"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identifier_names_the_mode_and_is_cut_on_a_character() {
        assert_eq!(
            backend_identifier("/tmp/a.raw", true),
            "zcnbd:recovery:/tmp/a.raw"
        );
        assert_eq!(backend_identifier("x", false), "zcnbd:no-recovery:x");
        let long = backend_identifier(&"é".repeat(300), true);
        assert!(long.len() <= BACKEND_BYTES_MAX && long.starts_with("zcnbd:recovery:é"));
    }

    #[test]
    fn block_sizes_are_sectors_up_to_a_page() {
        assert_eq!(block_size(1).unwrap(), 512);
        assert_eq!(block_size(4096).unwrap(), 4096);
        assert!(block_size(8192).is_err());
        assert!(block_size(1536).is_err());
    }
}
