//! `zcnbd detach` and `zcnbd list`: the devices `zcnbd attach` made, through either driver
//! (ublk's `/dev/ublkbN`, the kernel NBD client's `/dev/nbdN`).

use std::process::ExitCode;

use zcnbd_server::attach::driver::{self, Chosen};
use zcnbd_server::attach::nbd::{self, NbdDevice};
use zcnbd_server::attach::{self, DeviceInfo};

/// Arguments of `zcnbd detach`.
#[derive(Debug, clap::Args)]
pub struct DetachArgs {
    /// /dev/ublkbN (or ublkbN, or N), or /dev/nbdN (or nbdN).
    #[arg(value_name = "DEVICE", required_unless_present = "all")]
    devices: Vec<String>,
    /// Every device zcnbd attached.
    #[arg(long, conflicts_with = "devices")]
    all: bool,
    /// Detach a device even while it is in use (a filesystem mounted from it or its
    /// partitions, a device-mapper device on it): their I/O then fails.
    #[arg(long)]
    force: bool,
}

/// Arguments of `zcnbd list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// One JSON array instead of the table.
    #[arg(long)]
    json: bool,
}

/// Every device zcnbd attached: ublk's, then nbd's.
fn all_devices() -> Result<Vec<DeviceInfo>, Box<dyn std::error::Error>> {
    let mut devices = attach::list()?;
    devices.extend(nbd::list().into_iter().map(described));
    Ok(devices)
}

/// An nbd device in `zcnbd list`'s columns (its connections are its queues).
fn described(d: NbdDevice) -> DeviceInfo {
    DeviceInfo {
        device: d.device,
        size_bytes: d.size_bytes,
        read_only: d.read_only,
        queues: d.connections,
        queue_depth: d.queue_depth,
        state: if d.live { "live" } else { "waiting" },
        recovery: d.recovery,
        // The kernel's NBD client: its requests' data goes through the socket.
        mode: "nbd",
        pid: d.pid,
    }
}

/// `zcnbd detach`.
pub fn detach(args: &DetachArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let devices: Vec<String> = match args.all {
        true => all_devices()?.into_iter().map(|d| d.device).collect(),
        false => args.devices.clone(),
    };
    for d in &devices {
        let name = d.trim_start_matches("/dev/");
        let users = attach::in_use::users(name);
        if !users.is_empty() {
            if !args.force {
                return Err(format!(
                    "{d} is in use ({}): unmount it first, or detach --force",
                    users.join(", ")
                )
                .into());
            }
            tracing::warn!(device = %d, users = %users.join(", "), "detaching a device in use (--force)");
        }
        match driver::of_device(d) {
            Chosen::Ublk => attach::detach(d)?,
            Chosen::Nbd => nbd::detach(d)?,
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `zcnbd list`.
pub fn list(args: &ListArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let devices = all_devices()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&devices)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<14} {:>12} {:<3} {:>6} {:>6} {:<8} {:<9} {:<24} {:>8}",
        "DEVICE", "SIZE", "RO", "QUEUES", "DEPTH", "RECOVERY", "MODE", "STATE", "PID"
    );
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    for d in devices {
        println!(
            "{:<14} {:>12} {:<3} {:>6} {:>6} {:<8} {:<9} {:<24} {:>8}",
            d.device,
            d.size_bytes,
            yes_no(d.read_only),
            d.queues,
            d.queue_depth,
            yes_no(d.recovery),
            d.mode,
            d.state,
            d.pid
        );
    }
    Ok(ExitCode::SUCCESS)
}
