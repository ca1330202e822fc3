//! What the kernel shows of nbd devices in `/sys/block/nbdN`: which are zcnbd's (their
//! backend identifier), who serves them, their size and queues, for `zcnbd list`,
//! `zcnbd detach` and `--recover`.

use super::error::NbdError;
use super::owner;

/// What `/sys/block/nbdN/backend` starts with on zcnbd's devices.
pub const BACKEND_PREFIX: &str = "zcnbd:";

/// `/dev/nbdN`, `nbdN` or `N`: N.
pub(super) fn device_index(device: &str) -> Result<u32, NbdError> {
    device
        .trim_start_matches("/dev/")
        .trim_start_matches("nbd")
        .parse()
        .map_err(|_| NbdError::UnknownDevice(device.to_string()))
}

/// What `/sys/block/nbdN/NAME` says, trimmed (`None`: no such file).
pub(super) fn sys_attr(index: u32, name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/block/nbd{index}/{name}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Device `index`'s backend identifier, if it is zcnbd's.
pub(super) fn ours(index: u32) -> Option<String> {
    sys_attr(index, "backend").filter(|b| b.starts_with(BACKEND_PREFIX))
}

/// The process that connected device `index`, while it is connected.
pub(super) fn connected_pid(index: u32) -> Option<i32> {
    sys_attr(index, "pid")?.parse().ok()
}

/// The process serving device `index`: the one that recorded itself (a recovery), else the
/// one that connected it.
pub(super) fn serving_pid(index: u32) -> Option<i32> {
    owner::recorded(index)
        .filter(|p| alive(*p))
        .or_else(|| connected_pid(index))
}

/// Whether process `pid` runs.
pub(super) fn alive(pid: i32) -> bool {
    pid > 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A zcnbd nbd device the kernel has, for `zcnbd list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdDevice {
    pub device: String,
    pub size_bytes: u64,
    pub read_only: bool,
    /// Connections (the device's queues).
    pub connections: u16,
    /// Requests in flight per queue.
    pub queue_depth: u16,
    /// Its attach process runs (else its I/O waits for `zcnbd attach --recover`, or fails).
    pub live: bool,
    /// Made with a dead-connection timeout, for `--recover`.
    pub recovery: bool,
    pub pid: i32,
}

/// zcnbd's nbd devices that are connected now (`/sys/block/nbd*` with a `zcnbd:` backend).
pub fn list() -> Vec<NbdDevice> {
    let Ok(dir) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut indexes: Vec<u32> = dir
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("nbd")?
                .parse()
                .ok()
        })
        .collect();
    indexes.sort_unstable();
    indexes.into_iter().filter_map(describe).collect()
}

fn describe(index: u32) -> Option<NbdDevice> {
    let backend = ours(index)?;
    connected_pid(index)?;
    let pid = serving_pid(index)?;
    let number = |name: &str| sys_attr(index, name).and_then(|s| s.parse::<u64>().ok());
    let queues = std::fs::read_dir(format!("/sys/block/nbd{index}/mq")).map_or(0, |d| d.count());
    Some(NbdDevice {
        device: format!("/dev/nbd{index}"),
        size_bytes: number("size").unwrap_or(0) << 9,
        read_only: number("ro") == Some(1),
        connections: u16::try_from(queues).unwrap_or(u16::MAX),
        queue_depth: number("mq/0/nr_tags").map_or(0, |n| u16::try_from(n).unwrap_or(u16::MAX)),
        live: alive(pid),
        recovery: backend
            .strip_prefix(BACKEND_PREFIX)
            .is_some_and(|mode| mode.starts_with("recovery:")),
        pid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_named_as_for_nbd_client() {
        assert_eq!(device_index("/dev/nbd3").unwrap(), 3);
        assert_eq!(device_index("nbd12").unwrap(), 12);
        assert_eq!(device_index("7").unwrap(), 7);
        assert!(device_index("/dev/ublkb0").is_err());
    }
}
