//! Why a device could not be made through the kernel NBD client, served or removed.

use std::io;

use super::netlink::NetlinkError;
use crate::server::ServerError;

/// Why a device could not be made, served or removed (the nbd driver).
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// The kernel has no `nbd` generic netlink family: nbd.ko is not loaded.
    #[error("no nbd driver: the kernel has no \"nbd\" netlink family (modprobe nbd)")]
    NoDriver,
    /// CONNECT, DISCONNECT and RECONFIGURE need CAP_SYS_ADMIN.
    #[error("nbd devices need root (CAP_SYS_ADMIN)")]
    NotPermitted,
    /// What was asked cannot be done with this export or device.
    #[error("{0}")]
    Unsupported(String),
    /// A message to or from the kernel was malformed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// The kernel refused, or a system call failed.
    #[error("{what}: {source}")]
    Kernel {
        what: &'static str,
        source: io::Error,
    },
    /// zcnbd's server could not be set up for the export.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// The handshake between the device's end and zcnbd's server failed.
    #[error("the handshake with zcnbd's own server failed: {0}")]
    Handshake(String),
    /// No device of zcnbd's by that name.
    #[error("no zcnbd device {0}")]
    UnknownDevice(String),
}

/// Wraps a system call's error with what was being done.
pub(super) fn kernel(what: &'static str) -> impl FnOnce(io::Error) -> NbdError {
    move |source| NbdError::Kernel { what, source }
}
