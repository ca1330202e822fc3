//! Which process serves an nbd device now. The kernel shows the process that connected it
//! (`/sys/block/nbdN/pid`), which a recovery does not change; so the serving process also
//! writes its pid to `/run/zcnbd/nbdN.pid` and removes it when it lets go.

use std::path::PathBuf;

/// Where the serving processes' records are.
pub const RUN_DIR: &str = "/run/zcnbd";

fn record(index: u32) -> PathBuf {
    PathBuf::from(format!("{RUN_DIR}/nbd{index}.pid"))
}

/// Records this process as device `index`'s server (logged, not fatal, where `/run` is not
/// writable: `zcnbd list` then goes by the kernel's pid).
pub fn claim(index: u32) {
    let written = std::fs::create_dir_all(RUN_DIR)
        .and_then(|()| std::fs::write(record(index), format!("{}\n", std::process::id())));
    if let Err(e) = written {
        tracing::warn!(error = %e, "cannot record the device's server in {RUN_DIR}");
    }
}

/// Removes this process's record of device `index` (not another's).
pub fn release(index: u32) {
    if recorded(index) == Some(std::process::id() as i32) {
        let _ = std::fs::remove_file(record(index));
    }
}

/// The pid recorded for device `index`.
pub fn recorded(index: u32) -> Option<i32> {
    std::fs::read_to_string(record(index))
        .ok()?
        .trim()
        .parse()
        .ok()
}
