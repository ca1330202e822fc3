//! The AF_VSOCK address (`struct sockaddr_vm`, `vsock(7)`) a connect names, which rustix has
//! no type for. (The server crate has its own, with the listening side's needs.)

use std::mem::size_of;

use rustix::net::addr::{SocketAddrArg, SocketAddrLen, SocketAddrOpaque};

/// A vsock address: context id (the machine) and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VsockAddr {
    pub cid: u32,
    pub port: u32,
}

// SAFETY: `with_sockaddr` passes a pointer to a whole `sockaddr_vm` on its own stack frame,
// readable for the length it passes (that structure's size) for the duration of `f`, and the
// structure is a valid AF_VSOCK address (family set, reserved and padding fields zero).
unsafe impl SocketAddrArg for VsockAddr {
    unsafe fn with_sockaddr<R>(
        &self,
        f: impl FnOnce(*const SocketAddrOpaque, SocketAddrLen) -> R,
    ) -> R {
        let raw = libc::sockaddr_vm {
            svm_family: libc::AF_VSOCK as libc::sa_family_t,
            svm_reserved1: 0,
            svm_port: self.port,
            svm_cid: self.cid,
            svm_zero: [0; 4],
        };
        let len = size_of::<libc::sockaddr_vm>() as SocketAddrLen;
        f(std::ptr::from_ref(&raw).cast(), len)
    }
}
