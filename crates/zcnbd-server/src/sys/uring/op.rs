//! The operations a connection asks the ring for, described safely: each names the memory it
//! uses by the [`Lent`] that holds it, and only the driver turns that into addresses - lending
//! the memory as it does, after checking the range is inside it - and into submission
//! entries. A connection has no other way to point an operation at memory.
//!
//! Descriptors are named by number: the connection's socket and pipes (descriptors it owns)
//! and its export's files (owned by the backend it holds). The connection is freed only once
//! none of its operations is in flight, so they stay open while the kernel uses them; a wrong
//! number could misdirect I/O, never make the kernel touch memory that is not lent.

use std::io;
use std::ops::Range;
use std::os::fd::RawFd;

use super::lent::Lent;
use super::memory::{Dest, IoBuf, RecvMem};
use super::msg_send::{SendLoan, SendTarget};
use super::prepared::Prepared;

/// One operation to submit, and the `user_data` its completions carry.
pub struct Sqe<'a> {
    pub user_data: u64,
    pub op: Op<'a>,
}

/// What an operation does, and the memory it may use until its last completion.
pub enum Op<'a> {
    /// `RECV` into `stage[range]` (`MSG_WAITALL` if `wait_all`).
    RecvStage {
        fd: RawFd,
        mem: &'a mut Lent<Box<RecvMem>>,
        range: Range<usize>,
        wait_all: bool,
    },
    /// `RECV` of up to `len` bytes into the scratch space (`MSG_WAITALL`).
    RecvScratch {
        fd: RawFd,
        mem: &'a mut Lent<Box<RecvMem>>,
        len: usize,
    },
    /// `RECV` into `dest[range]` (`MSG_WAITALL` if `wait_all`). The receive side's memory is
    /// lent along, so that it is lent exactly while one of its receives is in flight.
    RecvPayload {
        fd: RawFd,
        dest: &'a mut Lent<Dest>,
        range: Range<usize>,
        mem: &'a mut Lent<Box<RecvMem>>,
        wait_all: bool,
    },
    /// One `RECVMSG` of `dest[range]`, then up to `header_bytes` into the front of the stage.
    RecvPayloadAndHeader {
        fd: RawFd,
        dest: &'a mut Lent<Dest>,
        range: Range<usize>,
        mem: &'a mut Lent<Box<RecvMem>>,
        header_bytes: usize,
    },
    /// `READ` (`READ_FIXED` for a registered run) into `buf[from..]`, at file `offset`.
    Read {
        fd: RawFd,
        buf: &'a mut Lent<IoBuf>,
        from: usize,
        offset: u64,
    },
    /// `WRITE` (`WRITE_FIXED`) of `buf[from..]` at file `offset`; `RWF_DSYNC` if `dsync`.
    Write {
        fd: RawFd,
        buf: &'a mut Lent<IoBuf>,
        from: usize,
        offset: u64,
        dsync: bool,
    },
    /// `SENDMSG` (`SENDMSG_ZC` for a zero-copy send, `SEND_ZC` naming the registered buffer
    /// for a lone fixed run) of what is still to send.
    SendMsg {
        fd: RawFd,
        send: &'a mut dyn SendLoan,
    },
    /// `SEND` of `bytes[from..]`, with `MSG_MORE` if `more` (a spliced reply's header; a
    /// piped reply's tail, the reply's last bytes, without).
    SendMore {
        fd: RawFd,
        bytes: &'a mut Lent<Vec<u8>>,
        from: usize,
        more: bool,
    },
    /// `SPLICE` of `len` bytes (`None`: the descriptor's own position, as for pipes and
    /// sockets). Points at no memory.
    Splice {
        from: RawFd,
        from_offset: Option<u64>,
        to: RawFd,
        to_offset: Option<u64>,
        len: usize,
        flags: u32,
    },
    /// `POLL_ADD` for `events` (`POLLIN`, `POLLOUT`). Points at no memory.
    Poll { fd: RawFd, events: u32 },
}

fn outside() -> io::Error {
    io::Error::other("an operation outside the memory lent to it")
}

/// Lends `lent` to one more operation, which points at what `point` finds in it; if that is
/// nothing (a range outside the memory), the loan is taken back at once.
fn lend_with<T, R>(lent: &mut Lent<T>, point: impl FnOnce(&mut T) -> Option<R>) -> io::Result<R> {
    match lent.lend(point) {
        Some(r) => Ok(r),
        None => {
            lent.complete();
            Err(outside())
        }
    }
}

fn len32(len: usize) -> Option<u32> {
    u32::try_from(len).ok()
}

/// `None` (the descriptor's position) as io_uring spells it.
fn splice_offset(offset: Option<u64>) -> io::Result<i64> {
    offset.map_or(Ok(-1), |o| i64::try_from(o).map_err(|_| outside()))
}

/// `buf[from..]` of a file operation: its address, length and registered buffer.
fn file_range(buf: &mut IoBuf, from: usize) -> Option<(*mut u8, u32, Option<u16>)> {
    let len = buf.len().checked_sub(from)?;
    let (ptr, fixed) = buf.io_range(from..from + len)?;
    Some((ptr, len32(len)?, fixed))
}

impl Sqe<'_> {
    pub fn new(user_data: u64, op: Op<'_>) -> Sqe<'_> {
        Sqe { user_data, op }
    }

    /// Lends the operation's memory to it and says where the operation points; nothing is
    /// lent if that fails (a range outside the memory, a send still in flight).
    pub fn lend(&mut self) -> io::Result<Prepared> {
        match &self.op {
            Op::RecvStage { .. } | Op::RecvScratch { .. } => self.lend_recv(),
            Op::RecvPayload { .. } | Op::RecvPayloadAndHeader { .. } => self.lend_payload(),
            Op::Read { .. } | Op::Write { .. } => self.lend_file(),
            Op::SendMsg { .. } | Op::SendMore { .. } => self.lend_send(),
            Op::Splice { .. } | Op::Poll { .. } => self.memoryless(),
        }
    }

    fn lend_recv(&mut self) -> io::Result<Prepared> {
        let (fd, (ptr, len), wait_all) = match &mut self.op {
            Op::RecvStage {
                fd,
                mem,
                range,
                wait_all,
            } => {
                let point = |m: &mut Box<RecvMem>| {
                    let stage = m.stage.get_mut(range.clone())?;
                    Some((stage.as_mut_ptr(), len32(stage.len())?))
                };
                (*fd, lend_with(mem, point)?, *wait_all)
            }
            Op::RecvScratch { fd, mem, len } => {
                let point = |m: &mut Box<RecvMem>| {
                    let scratch = m.scratch.get_mut(..*len)?;
                    Some((scratch.as_mut_ptr(), len32(scratch.len())?))
                };
                (*fd, lend_with(mem, point)?, true)
            }
            _ => return Err(outside()),
        };
        let flags = if wait_all { libc::MSG_WAITALL } else { 0 };
        Ok(Prepared::Recv {
            fd,
            ptr,
            len,
            flags,
        })
    }

    fn lend_file(&mut self) -> io::Result<Prepared> {
        let (fd, buf, from, offset, dsync) = match &mut self.op {
            Op::Read {
                fd,
                buf,
                from,
                offset,
            } => (*fd, buf, *from, *offset, None),
            Op::Write {
                fd,
                buf,
                from,
                offset,
                dsync,
            } => (*fd, buf, *from, *offset, Some(*dsync)),
            _ => return Err(outside()),
        };
        let (ptr, len, fixed) = lend_with(buf, |b| file_range(b, from))?;
        let Some(dsync) = dsync else {
            return Ok(Prepared::Read {
                fd,
                ptr,
                len,
                offset,
                fixed,
            });
        };
        let rw_flags = if dsync { libc::RWF_DSYNC } else { 0 };
        Ok(Prepared::Write {
            fd,
            ptr,
            len,
            offset,
            fixed,
            rw_flags,
        })
    }

    fn lend_payload(&mut self) -> io::Result<Prepared> {
        let (fd, dest, range, mem, header_bytes, wait_all) = match &mut self.op {
            Op::RecvPayload {
                fd,
                dest,
                range,
                mem,
                wait_all,
            } => (*fd, dest, range.clone(), mem, None, *wait_all),
            Op::RecvPayloadAndHeader {
                fd,
                dest,
                range,
                mem,
                header_bytes,
            } => (*fd, dest, range.clone(), mem, Some(*header_bytes), false),
            _ => return Err(outside()),
        };
        let len = range.len();
        let ptr = lend_with(dest, |d| d.io_range(range).filter(|_| len32(len).is_some()))?;
        let Some(header_bytes) = header_bytes else {
            mem.lend(|_| ());
            let len = len as u32;
            let flags = if wait_all { libc::MSG_WAITALL } else { 0 };
            return Ok(Prepared::Recv {
                fd,
                ptr,
                len,
                flags,
            });
        };
        match lend_with(mem, |m| m.point_msg(ptr, len, header_bytes)) {
            Ok(msg) => Ok(Prepared::RecvMsg { fd, msg }),
            Err(e) => {
                dest.complete();
                Err(e)
            }
        }
    }

    fn lend_send(&mut self) -> io::Result<Prepared> {
        match &mut self.op {
            Op::SendMsg { fd, send } => {
                let fd = *fd;
                let why = "a send posted while its previous submission is in flight";
                let (target, zerocopy) = send.lend_target().ok_or_else(|| io::Error::other(why))?;
                Ok(match target {
                    SendTarget::Fixed { ptr, len, index } => {
                        let len = u32::try_from(len).unwrap_or(u32::MAX);
                        Prepared::SendFixed {
                            fd,
                            ptr,
                            len,
                            index,
                        }
                    }
                    SendTarget::One { ptr, len } => Prepared::Send {
                        fd,
                        ptr,
                        // A longer range goes out in several sends, as a short send would.
                        len: u32::try_from(len).unwrap_or(u32::MAX),
                        flags: libc::MSG_NOSIGNAL,
                    },
                    SendTarget::Msg(msg) => Prepared::SendMsg { fd, msg, zerocopy },
                })
            }
            Op::SendMore {
                fd,
                bytes,
                from,
                more,
            } => {
                let fd = *fd;
                let point = |b: &mut Vec<u8>| {
                    let rest = b.get(*from..)?;
                    Some((rest.as_ptr(), len32(rest.len())?))
                };
                let (ptr, len) = lend_with(bytes, point)?;
                let more = if *more { libc::MSG_MORE } else { 0 };
                let flags = more | libc::MSG_NOSIGNAL;
                Ok(Prepared::Send {
                    fd,
                    ptr,
                    len,
                    flags,
                })
            }
            _ => Err(outside()),
        }
    }

    fn memoryless(&self) -> io::Result<Prepared> {
        match self.op {
            Op::Splice {
                from,
                from_offset,
                to,
                to_offset,
                len,
                flags,
            } => Ok(Prepared::Splice {
                from,
                from_offset: splice_offset(from_offset)?,
                to,
                to_offset: splice_offset(to_offset)?,
                len: len32(len).ok_or_else(outside)?,
                flags,
            }),
            Op::Poll { fd, events } => Ok(Prepared::Poll { fd, events }),
            _ => Err(outside()),
        }
    }

    /// Takes back what [`Sqe::lend`] lent: the operation was never submitted.
    pub fn unlend(&mut self) {
        match &mut self.op {
            Op::RecvStage { mem, .. } | Op::RecvScratch { mem, .. } => mem.complete(),
            Op::RecvPayload { dest, mem, .. } | Op::RecvPayloadAndHeader { dest, mem, .. } => {
                dest.complete();
                mem.complete();
            }
            Op::Read { buf, .. } | Op::Write { buf, .. } => buf.complete(),
            Op::SendMsg { send, .. } => send.unlend(),
            Op::SendMore { bytes, .. } => bytes.complete(),
            Op::Splice { .. } | Op::Poll { .. } => {}
        }
    }
}

/// Lends every operation of `chain` its memory; if one cannot be lent, takes back what the
/// others were lent.
pub fn lend_chain(chain: &mut [Sqe<'_>]) -> io::Result<Vec<Prepared>> {
    let mut prepared = Vec::with_capacity(chain.len());
    for i in 0..chain.len() {
        match chain[i].lend() {
            Ok(p) => prepared.push(p),
            Err(e) => {
                chain[..i].iter_mut().for_each(Sqe::unlend);
                return Err(e);
            }
        }
    }
    Ok(prepared)
}

/// The way a connection reaches the kernel: the ring's submission side, or a test's stand-in.
pub trait Submit {
    /// Submits `chain`: one operation, or several linked (each starts once the one before
    /// it succeeded). On success each operation's memory is lent to it until its last
    /// completion; on failure nothing stays lent.
    fn submit(&mut self, chain: &mut [Sqe<'_>]) -> io::Result<()>;
}

#[cfg(test)]
#[path = "op_tests.rs"]
mod tests;
