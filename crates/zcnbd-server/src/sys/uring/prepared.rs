//! An operation as the kernel sees it ([`Prepared`]: addresses into memory lent to it, made
//! by `Sqe::lend`), the submission entry built from it, and what a completion says ([`Cqe`]).

use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied anyway.
const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;

/// An operation as the kernel sees it: addresses into memory lent to it.
#[derive(Debug, Clone, Copy)]
pub enum Prepared {
    Recv {
        fd: RawFd,
        ptr: *mut u8,
        len: u32,
        flags: i32,
    },
    RecvMsg {
        fd: RawFd,
        msg: *mut libc::msghdr,
    },
    Read {
        fd: RawFd,
        ptr: *mut u8,
        len: u32,
        offset: u64,
        fixed: Option<u16>,
    },
    Write {
        fd: RawFd,
        ptr: *mut u8,
        len: u32,
        offset: u64,
        fixed: Option<u16>,
        rw_flags: i32,
    },
    SendMsg {
        fd: RawFd,
        msg: *const libc::msghdr,
        zerocopy: bool,
    },
    SendFixed {
        fd: RawFd,
        ptr: *const u8,
        len: u32,
        index: u16,
    },
    Send {
        fd: RawFd,
        ptr: *const u8,
        len: u32,
        flags: i32,
    },
    Splice {
        from: RawFd,
        from_offset: i64,
        to: RawFd,
        to_offset: i64,
        len: u32,
        flags: u32,
    },
    Poll {
        fd: RawFd,
        events: u32,
    },
}

/// One completion, as the ring reaped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    pub user_data: u64,
    pub result: i32,
    /// More completions will come for this operation (`IORING_CQE_F_MORE`).
    pub more: bool,
    /// A zero-copy send's notification (`IORING_CQE_F_NOTIF`): the kernel no longer holds
    /// its pages.
    pub notification: bool,
    /// A receive left bytes in the socket (`IORING_CQE_F_SOCK_NONEMPTY`).
    pub sock_nonempty: bool,
}

impl Cqe {
    /// Whether a zero-copy notification says the kernel copied the data anyway.
    pub fn zc_copied(&self) -> bool {
        self.notification && (self.result as u32) & NOTIF_USAGE_ZC_COPIED != 0
    }
}

impl Prepared {
    /// The submission entry.
    pub(super) fn entry(&self, user_data: u64) -> squeue::Entry {
        use types::Fd;
        let entry = match *self {
            Prepared::Recv {
                fd,
                ptr,
                len,
                flags,
            } => opcode::Recv::new(Fd(fd), ptr, len).flags(flags).build(),
            Prepared::RecvMsg { fd, msg } => opcode::RecvMsg::new(Fd(fd), msg).build(),
            Prepared::Read {
                fd,
                ptr,
                len,
                offset,
                fixed,
            } => read_entry(Fd(fd), ptr, len, offset, fixed),
            Prepared::Write {
                fd,
                ptr,
                len,
                offset,
                fixed,
                rw_flags,
            } => write_entry(Fd(fd), ptr, len, offset, fixed, rw_flags),
            Prepared::SendMsg { fd, msg, zerocopy } => send_msg_entry(Fd(fd), msg, zerocopy),
            Prepared::SendFixed {
                fd,
                ptr,
                len,
                index,
            } => send_fixed_entry(Fd(fd), ptr, len, index),
            Prepared::Send {
                fd,
                ptr,
                len,
                flags,
            } => opcode::Send::new(Fd(fd), ptr, len).flags(flags).build(),
            Prepared::Splice {
                from,
                from_offset,
                to,
                to_offset,
                len,
                flags,
            } => opcode::Splice::new(Fd(from), from_offset, Fd(to), to_offset, len)
                .flags(flags)
                .build(),
            Prepared::Poll { fd, events } => opcode::PollAdd::new(Fd(fd), events).build(),
        };
        entry.user_data(user_data)
    }
}

fn read_entry(
    fd: types::Fd,
    ptr: *mut u8,
    len: u32,
    offset: u64,
    fixed: Option<u16>,
) -> squeue::Entry {
    match fixed {
        None => opcode::Read::new(fd, ptr, len).offset(offset).build(),
        Some(index) => opcode::ReadFixed::new(fd, ptr, len, index)
            .offset(offset)
            .build(),
    }
}

fn write_entry(
    fd: types::Fd,
    ptr: *mut u8,
    len: u32,
    offset: u64,
    fixed: Option<u16>,
    rw_flags: i32,
) -> squeue::Entry {
    match fixed {
        None => opcode::Write::new(fd, ptr, len)
            .offset(offset)
            .rw_flags(rw_flags)
            .build(),
        Some(index) => opcode::WriteFixed::new(fd, ptr, len, index)
            .offset(offset)
            .rw_flags(rw_flags)
            .build(),
    }
}

fn send_msg_entry(fd: types::Fd, msg: *const libc::msghdr, zerocopy: bool) -> squeue::Entry {
    let flags = libc::MSG_NOSIGNAL as u32;
    if zerocopy {
        return opcode::SendMsgZc::new(fd, msg)
            .ioprio(SEND_ZC_REPORT_USAGE)
            .flags(flags)
            .build();
    }
    opcode::SendMsg::new(fd, msg).flags(flags).build()
}

/// A lone fixed reply: its header was written just before the data in the same registered
/// run, so one `SEND_ZC` naming that buffer carries header and data in one submission, with
/// no per-send page pinning. (`SENDMSG_ZC` cannot name a registered buffer before Linux 6.15,
/// nor through this io_uring crate; a linked header send would be a second SQE and CQE per
/// reply.)
fn send_fixed_entry(fd: types::Fd, ptr: *const u8, len: u32, index: u16) -> squeue::Entry {
    opcode::SendZc::new(fd, ptr, len)
        .buf_index(Some(index))
        .zc_flags(SEND_ZC_REPORT_USAGE)
        .flags(libc::MSG_NOSIGNAL)
        .build()
}

/// Standing in for the kernel, in tests: what the operation's memory holds, and filling it.
#[cfg(test)]
impl Prepared {
    /// The memory the operation points at, as (address, length) ranges in order.
    fn ranges(&self) -> Vec<(*mut u8, usize)> {
        match *self {
            Prepared::Recv { ptr, len, .. }
            | Prepared::Read { ptr, len, .. }
            | Prepared::Write { ptr, len, .. } => vec![(ptr, len as usize)],
            Prepared::SendFixed { ptr, len, .. } | Prepared::Send { ptr, len, .. } => {
                vec![(ptr.cast_mut(), len as usize)]
            }
            Prepared::RecvMsg { msg, .. } => iovecs(msg),
            Prepared::SendMsg { msg, .. } => iovecs(msg),
            Prepared::Splice { .. } | Prepared::Poll { .. } => Vec::new(),
        }
    }

    /// Receives `bytes` where a receive or read points, as far as they fit; returns how
    /// many did. The test delivers the completion afterwards, as the kernel would.
    pub fn fill(&self, bytes: &[u8]) -> usize {
        let mut done = 0;
        for (ptr, len) in self.ranges() {
            let n = len.min(bytes.len() - done);
            // SAFETY: `ptr..ptr + len` is memory lent to this operation until its completion,
            // which the test has not delivered yet, so nothing else uses it; `bytes` is a
            // separate buffer of the test's.
            unsafe { std::ptr::copy_nonoverlapping(bytes[done..].as_ptr(), ptr, n) };
            done += n;
        }
        done
    }

    /// The bytes a send or write would put out.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (ptr, len) in self.ranges() {
            // SAFETY: `ptr..ptr + len` is memory lent to this operation until its
            // completion, which the test has not delivered yet: valid, and not written.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
        }
        out
    }
}

/// The (address, length) of each iovec of the `msghdr` at `msg`.
#[cfg(test)]
fn iovecs(msg: *const libc::msghdr) -> Vec<(*mut u8, usize)> {
    // SAFETY: `msg` points at the msghdr lent to an operation whose completion the test has
    // not delivered; its `msg_iov` points at `msg_iovlen` iovecs lent along with it.
    let iov = unsafe {
        let msg = &*msg;
        // `msg_iovlen` is a `c_int` on some libcs.
        #[allow(clippy::unnecessary_cast)]
        let len = msg.msg_iovlen as usize;
        std::slice::from_raw_parts(msg.msg_iov, len)
    };
    iov.iter()
        .map(|v| (v.iov_base.cast::<u8>(), v.iov_len))
        .collect()
}
