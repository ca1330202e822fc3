//! A ublk request started on an asynchronous stack (an NBD upstream, RBD): the queue thread
//! hands it to [`Stack::submit`] and goes on; the completion, on whichever thread completes
//! the operation, hands the tag's buffer and the COMMIT result back (`queue.rs` sends them
//! to the queue thread and wakes it). No I/O thread waits for the request.
//!
//! The stack's operations own pooled buffers ([`AsyncOp`]), not a tag's: a write's data is
//! copied from the tag's buffer into one before it is submitted, and a read's copied out of
//! one into the tag's buffer when it completes (one copy in user space, against two thread
//! hand-offs per request on the I/O threads' path).

use std::io;
use std::sync::Arc;

use crate::buffer_pool::BufferPool;
use crate::export::{AsyncOp, Completion, Stack, ZeroFlags};

use super::uapi::{io_desc, IoDesc};

/// Starts the request `desc` on `stack` with the tag's buffer `buf`; `answer` gets `buf`
/// back with the request's COMMIT result (as `queue.rs`'s `answer` computes it on the
/// blocking path): at once for a request that cannot be started.
pub(super) fn start<B>(
    stack: &Stack,
    pool: &Arc<BufferPool>,
    desc: &IoDesc,
    mut buf: B,
    answer: impl FnOnce(B, i32) + Send + 'static,
) where
    B: AsMut<[u8]> + Send + 'static,
{
    let (offset, len) = (desc.offset(), desc.bytes());
    let fua = desc.op_flags & io_desc::F_FUA != 0;
    let Some(bytes) = usize::try_from(len)
        .ok()
        .filter(|&n| n <= buf.as_mut().len())
    else {
        return answer(buf, -libc::EINVAL);
    };
    let op = match desc.op() {
        io_desc::OP_READ => AsyncOp::Read {
            buf: pool.get(bytes),
            offset,
        },
        io_desc::OP_WRITE => {
            let mut data = pool.get(bytes);
            data.copy_from_slice(&buf.as_mut()[..bytes]);
            AsyncOp::Write {
                buf: data,
                offset,
                fua,
            }
        }
        io_desc::OP_FLUSH => AsyncOp::Flush,
        io_desc::OP_DISCARD => AsyncOp::Trim { offset, len, fua },
        io_desc::OP_WRITE_ZEROES => AsyncOp::Zero {
            offset,
            len,
            flags: ZeroFlags {
                may_trim: desc.op_flags & io_desc::F_NOUNMAP == 0,
                fast: false,
                fua,
            },
        },
        _ => return answer(buf, -libc::EOPNOTSUPP),
    };
    let done = Completion::new(move |op, result: io::Result<()>| {
        let result = match (op, result) {
            (Some(AsyncOp::Read { buf: data, .. }), Ok(())) if data.len() == bytes => {
                buf.as_mut()[..bytes].copy_from_slice(&data);
                Ok(bytes)
            }
            // Handed back with another buffer than it was given: a backend bug.
            (Some(AsyncOp::Read { .. }), Ok(())) => Err(io::Error::from_raw_os_error(libc::EIO)),
            (Some(AsyncOp::Write { .. }), Ok(())) => Ok(bytes),
            (Some(_), Ok(())) => Ok(0),
            (_, Err(e)) => Err(e),
            // Dropped uncompleted: the error the stack's contract names.
            (None, Ok(())) => Err(io::Error::from_raw_os_error(libc::EIO)),
        };
        answer(buf, commit_result(result));
    });
    stack.submit(op, done);
}

/// A COMMIT result: the bytes of a read or write, 0 for the others, or a negative errno.
pub(super) fn commit_result(done: io::Result<usize>) -> i32 {
    match done {
        // A request is at most the device's largest (1 MiB by default, far below i32::MAX).
        Ok(n) => i32::try_from(n).unwrap_or(-libc::EINVAL),
        Err(e) => -e.raw_os_error().filter(|&c| c > 0).unwrap_or(libc::EIO),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use zcnbd_proto::Extent;

    use super::*;
    use crate::export::{run_blocking, Backend, Capabilities, MemoryBackend, ZeroError};

    /// A memory disk that completes every operation on a thread of its own.
    #[derive(Debug)]
    struct Submitting(Arc<MemoryBackend>);

    impl Backend for Submitting {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn capabilities(&self) -> Capabilities {
            self.0.capabilities()
        }
        fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.0.pread(buf, offset)
        }
        fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            self.0.pwrite(buf, offset, fua)
        }
        fn flush(&self) -> io::Result<()> {
            self.0.flush()
        }
        fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
            self.0.trim(offset, len, fua)
        }
        fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
            self.0.zero(offset, len, flags)
        }
        fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
            self.0.cache(offset, len)
        }
        fn extents(&self, o: u64, l: u64, max: usize, out: &mut Vec<Extent>) -> io::Result<()> {
            self.0.extents(o, l, max, out)
        }
        fn can_submit(&self) -> bool {
            true
        }
        fn submit(&self, mut op: AsyncOp, done: Completion) {
            let disk = Arc::clone(&self.0);
            std::thread::spawn(move || {
                let result = run_blocking(&*disk, &mut op);
                done.complete(op, result);
            });
        }
    }

    fn desc(op: u8, flags: u32, sector: u64, sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: u32::from(op) | flags,
            nr_sectors: sectors,
            start_sector: sector,
            addr: 0,
        }
    }

    /// Runs `desc` with `buf` as the tag's buffer; the buffer back and the COMMIT result.
    fn run(stack: &Stack, pool: &Arc<BufferPool>, desc: IoDesc, buf: Vec<u8>) -> (Vec<u8>, i32) {
        let (tx, rx) = mpsc::channel();
        start(stack, pool, &desc, buf, move |buf, result| {
            let _ = tx.send((buf, result));
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("answered")
    }

    #[test]
    fn requests_are_submitted_and_answered_from_the_completion() {
        let stack = Stack::of(
            Arc::new(Submitting(Arc::new(MemoryBackend::new(1 << 20).unwrap()))),
            false,
        );
        assert!(stack.is_asynchronous());
        let pool = BufferPool::new(1 << 20);
        // Tags' buffers are the device's largest request; requests use a prefix.
        let tag = |fill| vec![fill; 16384];
        let write = desc(io_desc::OP_WRITE, io_desc::F_FUA, 8, 16);
        let (_, result) = run(&stack, &pool, write, tag(0x5a));
        assert_eq!(result, 8192);
        let (back, result) = run(&stack, &pool, desc(io_desc::OP_READ, 0, 8, 16), tag(0));
        assert_eq!(result, 8192);
        assert!(back[..8192].iter().all(|&b| b == 0x5a));
        assert!(
            back[8192..].iter().all(|&b| b == 0),
            "read past the request"
        );
        let zero = desc(io_desc::OP_WRITE_ZEROES, io_desc::F_NOUNMAP, 8, 8);
        assert_eq!(run(&stack, &pool, zero, tag(0)).1, 0);
        let (back, _) = run(&stack, &pool, desc(io_desc::OP_READ, 0, 8, 16), tag(1));
        assert!(
            back[..4096].iter().all(|&b| b == 0) && back[4096..8192].iter().all(|&b| b == 0x5a)
        );
        assert_eq!(
            run(&stack, &pool, desc(io_desc::OP_FLUSH, 0, 0, 0), tag(0)).1,
            0
        );
        assert_eq!(
            run(&stack, &pool, desc(io_desc::OP_DISCARD, 0, 8, 8), tag(0)).1,
            0
        );
        // Larger than the tag's buffer, past the end, an operation zcnbd does not offer.
        let big = desc(io_desc::OP_READ, 0, 0, 64);
        assert_eq!(run(&stack, &pool, big, tag(0)).1, -libc::EINVAL);
        assert!(run(&stack, &pool, desc(io_desc::OP_READ, 0, 2047, 16), tag(0)).1 < 0);
        assert_eq!(
            run(&stack, &pool, desc(10, 0, 0, 0), tag(0)).1,
            -libc::EOPNOTSUPP
        );
    }
}
