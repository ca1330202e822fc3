//! One ublk queue's thread: fetch every tag, then answer each request the kernel hands over
//! through the export's stack, in the tag's buffer, until the device stops (every tag
//! aborted) or the attach is called off (the stop eventfd).

use std::io;

use crate::export::{Stack, ZeroFlags};
use crate::sys::ublk::{QueueRing, Woken};

use super::uapi::{io_desc, IoDesc, IO_RES_ABORT};

/// Serves `queue` until the device goes away; `depth` tags were fetched.
pub(super) fn serve(queue: &mut QueueRing, stack: &Stack, depth: u16) -> io::Result<()> {
    let mut done = Vec::with_capacity(depth as usize);
    let mut aborted = 0u16;
    while aborted < depth {
        done.clear();
        if queue.wait(&mut done)? == Woken::Stop {
            return Ok(());
        }
        for &(tag, res) in &done {
            if res == IO_RES_ABORT {
                aborted += 1;
                continue;
            }
            if res < 0 {
                return Err(io::Error::from_raw_os_error(-res));
            }
            let desc = queue.desc(tag);
            let result = match queue.buffer(tag) {
                Some(buf) => answer(stack, &desc, buf),
                None => -libc::EIO,
            };
            queue.commit(tag, result)?;
        }
    }
    Ok(())
}

/// Does one request; its COMMIT result: the bytes of a read or write, 0 for the others, or a
/// negative errno (which the block layer reports as an I/O error, "not supported", ...).
pub(super) fn answer(stack: &Stack, desc: &IoDesc, buf: &mut [u8]) -> i32 {
    let (offset, len) = (desc.offset(), desc.bytes());
    let fua = desc.op_flags & io_desc::F_FUA != 0;
    let data = usize::try_from(len).ok().and_then(|n| buf.get_mut(..n));
    let done = match (desc.op(), data) {
        (io_desc::OP_READ, Some(b)) => stack.read(b, offset).map(|()| len),
        (io_desc::OP_WRITE, Some(b)) => stack.write(b, offset, fua).map(|()| len),
        (io_desc::OP_READ | io_desc::OP_WRITE, None) => {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        }
        (io_desc::OP_FLUSH, _) => stack.flush().map(|()| 0),
        (io_desc::OP_DISCARD, _) => stack.trim(offset, len, fua).map(|()| 0),
        (io_desc::OP_WRITE_ZEROES, _) => {
            let flags = ZeroFlags {
                may_trim: desc.op_flags & io_desc::F_NOUNMAP == 0,
                fast: false,
                fua,
            };
            stack
                .zero(offset, len, flags)
                .map(|()| 0)
                .map_err(io::Error::from)
        }
        _ => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
    };
    match done {
        // A request is at most the device's largest (1 MiB by default, far below i32::MAX).
        Ok(n) => i32::try_from(n).unwrap_or(-libc::EINVAL),
        Err(e) => -e.raw_os_error().filter(|&c| c > 0).unwrap_or(libc::EIO),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::MemoryBackend;

    fn desc(op: u8, flags: u32, sector: u64, sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: u32::from(op) | flags,
            nr_sectors: sectors,
            start_sector: sector,
            addr: 0,
        }
    }

    #[test]
    fn requests_go_through_the_stack() {
        let backend = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let stack = Stack::of(backend, false);
        let mut buf = vec![0x5au8; 8192];
        assert_eq!(
            answer(
                &stack,
                &desc(io_desc::OP_WRITE, io_desc::F_FUA, 8, 16),
                &mut buf
            ),
            8192
        );
        let mut back = vec![0u8; 8192];
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_READ, 0, 8, 16), &mut back),
            8192
        );
        assert_eq!(back, buf);
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_WRITE_ZEROES, 0, 8, 8), &mut back),
            0
        );
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_READ, 0, 8, 16), &mut back),
            8192
        );
        assert!(back[..4096].iter().all(|&b| b == 0) && back[4096..].iter().all(|&b| b == 0x5a));
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_FLUSH, 0, 0, 0), &mut back),
            0
        );
        // Larger than the tag's buffer, past the end, an operation zcnbd does not offer.
        assert_eq!(
            answer(&stack, &desc(io_desc::OP_READ, 0, 0, 32), &mut back),
            -libc::EINVAL
        );
        assert!(answer(&stack, &desc(io_desc::OP_READ, 0, 2047, 16), &mut back) < 0);
        assert_eq!(
            answer(&stack, &desc(10, 0, 0, 0), &mut back),
            -libc::EOPNOTSUPP
        );
    }

    #[test]
    fn a_read_only_stack_refuses_writes() {
        let backend = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let stack = Stack::of(backend, true);
        let mut buf = vec![0u8; 4096];
        assert!(answer(&stack, &desc(io_desc::OP_WRITE, 0, 0, 8), &mut buf) < 0);
    }
}
