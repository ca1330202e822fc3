//! Which kernel driver makes the device: ublk (`/dev/ublkbN`, this process answers the
//! kernel's requests itself) where the kernel has it, else the kernel's NBD client
//! (`/dev/nbdN`, fed by zcnbd's own server over socket pairs: `attach::nbd`).

use std::path::Path;
use std::process::{Command, Stdio};

use super::nbd::{self, NbdError};
use crate::sys::ublk::CONTROL_PATH;

/// What `--driver` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Driver {
    /// ublk if the kernel has it (after `modprobe ublk_drv`), else nbd (after `modprobe nbd`).
    #[default]
    Auto,
    Ublk,
    Nbd,
}

impl Driver {
    /// `auto`, `ublk` or `nbd`.
    pub fn named(name: &str) -> Option<Driver> {
        match name {
            "auto" => Some(Driver::Auto),
            "ublk" => Some(Driver::Ublk),
            "nbd" => Some(Driver::Nbd),
            _ => None,
        }
    }
}

/// The driver that will make the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    Ublk,
    Nbd,
}

/// Why no driver could be chosen.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// `auto` found neither.
    #[error("no block device driver: {CONTROL_PATH} is missing (modprobe ublk_drv; Linux 6.0 or later) and the kernel has no \"nbd\" netlink family (modprobe nbd)")]
    Neither,
    /// Asking the kernel for the nbd family failed otherwise.
    #[error(transparent)]
    Nbd(#[from] NbdError),
}

/// Loads module `name` if it can be (quietly: where there is no modprobe, or no module, the
/// probe that follows says what is missing).
fn modprobe(name: &str) {
    let _ = Command::new("modprobe")
        .args(["-q", name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Whether ublk's control device is there, loading the module first if it is not.
fn ublk_present() -> bool {
    if !Path::new(CONTROL_PATH).exists() {
        modprobe("ublk_drv");
    }
    Path::new(CONTROL_PATH).exists()
}

/// Whether the kernel has the nbd netlink family, loading the module first if it has not.
fn nbd_present() -> Result<bool, NbdError> {
    match nbd::probe() {
        Err(NbdError::NoDriver) => modprobe("nbd"),
        other => return other.map(|()| true),
    }
    match nbd::probe() {
        Err(NbdError::NoDriver) => Ok(false),
        other => other.map(|()| true),
    }
}

/// The driver for `driver`: what was asked for (its module loaded if it can be: a missing
/// one is the attach's error, which names it), or for `auto` the first the kernel has.
pub fn choose(driver: Driver) -> Result<Chosen, DriverError> {
    match driver {
        Driver::Ublk => {
            ublk_present();
            Ok(Chosen::Ublk)
        }
        Driver::Nbd => {
            nbd_present()?;
            Ok(Chosen::Nbd)
        }
        Driver::Auto if ublk_present() => Ok(Chosen::Ublk),
        Driver::Auto if nbd_present()? => Ok(Chosen::Nbd),
        Driver::Auto => Err(DriverError::Neither),
    }
}

/// The driver of an existing device, by its name (`/dev/nbdN`, `nbdN`: nbd; else ublk).
pub fn of_device(device: &str) -> Chosen {
    match device.trim_start_matches("/dev/").starts_with("nbd") {
        true => Chosen::Nbd,
        false => Chosen::Ublk,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drivers_by_name() {
        assert_eq!(Driver::named("auto"), Some(Driver::Auto));
        assert_eq!(Driver::named("nbd"), Some(Driver::Nbd));
        assert_eq!(Driver::named("ublk"), Some(Driver::Ublk));
        assert_eq!(Driver::named("loop"), None);
    }

    #[test]
    fn a_device_name_says_its_driver() {
        assert_eq!(of_device("/dev/nbd0"), Chosen::Nbd);
        assert_eq!(of_device("nbd3"), Chosen::Nbd);
        assert_eq!(of_device("/dev/ublkb1"), Chosen::Ublk);
        assert_eq!(of_device("2"), Chosen::Ublk);
    }
}
