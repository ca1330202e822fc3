//! AF_VSOCK addresses (`struct sockaddr_vm`, `vsock(7)`), which rustix has no type for:
//! [`VsockAddr`] is one rustix can bind to, and can be read back from a `SocketAddrAny`.
//! Everything else about vsock sockets (create, listen, accept, read, write) is rustix's
//! safe API, outside `sys`.

use std::mem::size_of;

use rustix::net::addr::{SocketAddrArg, SocketAddrLen, SocketAddrOpaque};
use rustix::net::{AddressFamily, SocketAddrAny};

/// `VMADDR_CID_ANY`: bind to whatever context ids this machine has.
pub const CID_ANY: u32 = libc::VMADDR_CID_ANY;
/// `VMADDR_PORT_ANY`: bind to a port the kernel picks.
pub const PORT_ANY: u32 = libc::VMADDR_PORT_ANY;

/// A vsock address: a context id (the machine: 1 is the local one through
/// `vsock_loopback`, 2 the hypervisor's host, guests 3 and up) and a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VsockAddr {
    pub cid: u32,
    pub port: u32,
}

impl VsockAddr {
    /// The C structure, zeroed but for family, port and cid (`svm_flags` and the padding
    /// must be zero).
    fn raw(&self) -> libc::sockaddr_vm {
        libc::sockaddr_vm {
            svm_family: libc::AF_VSOCK as libc::sa_family_t,
            svm_reserved1: 0,
            svm_port: self.port,
            svm_cid: self.cid,
            svm_zero: [0; 4],
        }
    }

    /// The vsock address in `any` (`None`: another family, or too short to be one).
    pub fn from_any(any: &SocketAddrAny) -> Option<VsockAddr> {
        if any.address_family() != AddressFamily::VSOCK
            || (any.addr_len() as usize) < size_of::<libc::sockaddr_vm>()
        {
            return None;
        }
        // SAFETY: `any` holds `addr_len()` initialized bytes at `as_ptr()`, which is at least
        // one `sockaddr_vm` (checked above), and the kernel wrote them as one (the family
        // says so). `read_unaligned` asks nothing of the pointer's alignment.
        let raw = unsafe { any.as_ptr().cast::<libc::sockaddr_vm>().read_unaligned() };
        Some(VsockAddr {
            cid: raw.svm_cid,
            port: raw.svm_port,
        })
    }
}

// SAFETY: `with_sockaddr` passes a pointer to a whole `sockaddr_vm` on its own stack frame,
// readable for the length it passes (that structure's size) for the duration of `f`, and the
// structure is a valid AF_VSOCK address (family set, reserved and padding fields zero).
unsafe impl SocketAddrArg for VsockAddr {
    unsafe fn with_sockaddr<R>(
        &self,
        f: impl FnOnce(*const SocketAddrOpaque, SocketAddrLen) -> R,
    ) -> R {
        let raw = self.raw();
        let len = size_of::<libc::sockaddr_vm>() as SocketAddrLen;
        f(std::ptr::from_ref(&raw).cast(), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_survives_the_round_trip_through_sockaddr_vm() {
        let addr = VsockAddr {
            cid: 3,
            port: 10809,
        };
        let any = addr.as_any();
        assert_eq!(any.address_family(), AddressFamily::VSOCK);
        assert_eq!(VsockAddr::from_any(&any), Some(addr));
        let tcp = rustix::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 1).as_any();
        assert_eq!(VsockAddr::from_any(&tcp), None);
    }
}
