//! A ublk request started on an asynchronous stack (an NBD upstream, RBD): the queue thread
//! hands it to [`Stack::submit`] and goes on; the completion, on whichever thread completes
//! the operation, hands the tag's buffer and the COMMIT result back (`queue.rs` sends them
//! to the queue thread and wakes it). No I/O thread waits for the request.
//!
//! A read or write's operation owns the tag's buffer itself, lent memory in the place of a
//! pooled buffer ([`PooledBuf::lent`]): an NBD upstream receives a read's data straight into
//! it and sends a write's from it, no copy in user space; the completion hands it back. If
//! an operation is dropped unfinished, its tag's buffer goes back to the queue on its own
//! (the queue answers that request with EIO, `QueueRing::commit_orphans`).

use std::any::Any;
use std::io;

use crate::buffer_pool::PooledBuf;
use crate::export::{AsyncOp, Completion, Stack, ZeroFlags};
use crate::sys::lent_memory::LentMemory;

use super::uapi::{io_desc, IoDesc};

/// Starts the request `desc` on `stack` with the tag's buffer `buf`; `answer` gets `buf`
/// back with the request's COMMIT result (as `queue.rs`'s `answer` computes it on the
/// blocking path): at once for a request that cannot be started.
pub(super) fn start<B: LentMemory>(
    stack: &Stack,
    desc: &IoDesc,
    buf: B,
    answer: impl FnOnce(B, i32) + Send + 'static,
) {
    let (offset, len) = (desc.offset(), desc.bytes());
    let fua = desc.op_flags & io_desc::F_FUA != 0;
    let Some(bytes) = usize::try_from(len)
        .ok()
        .filter(|&n| n <= buf.bytes().len())
    else {
        return answer(buf, -libc::EINVAL);
    };
    // A read's or write's operation owns the tag's buffer; the others leave it here.
    let (op, kept) = match desc.op() {
        io_desc::OP_READ => {
            let buf = PooledBuf::lent(Box::new(buf), bytes);
            (AsyncOp::Read { buf, offset }, None)
        }
        io_desc::OP_WRITE => {
            let buf = PooledBuf::lent(Box::new(buf), bytes);
            (AsyncOp::Write { buf, offset, fua }, None)
        }
        op => match effect(op, desc, offset, len, fua) {
            Some(op) => (op, Some(buf)),
            None => return answer(buf, -libc::EOPNOTSUPP),
        },
    };
    let done = Completion::new(move |op, result: io::Result<()>| {
        let (buf, done) = match (op, kept) {
            (Some(AsyncOp::Read { buf: data, .. } | AsyncOp::Write { buf: data, .. }), None) => {
                let whole = data.len() == bytes;
                let Some(buf) = data
                    .take_lent()
                    .and_then(|memory| (memory as Box<dyn Any>).downcast::<B>().ok())
                else {
                    // Handed back with another buffer than it was given (a backend bug):
                    // the tag's buffer went with its operation and the queue answers the
                    // request (EIO).
                    return;
                };
                let done = match (result, whole) {
                    (Ok(()), true) => Ok(bytes),
                    (Ok(()), false) => Err(io::Error::from_raw_os_error(libc::EIO)),
                    (Err(e), _) => Err(e),
                };
                (*buf, done)
            }
            (Some(_), Some(buf)) => (buf, result.map(|()| 0)),
            // Dropped uncompleted: the error the stack's contract names.
            (None, Some(buf)) => (buf, Err(io::Error::from_raw_os_error(libc::EIO))),
            // Dropped uncompleted with the tag's buffer (the queue answers the request), or
            // handed back as another kind of operation (a backend bug: likewise).
            (_, None) => return,
        };
        answer(buf, commit_result(done));
    });
    stack.submit(op, done);
}

/// The operation of a request that moves no data (`None`: one zcnbd does not offer).
fn effect(op: u8, desc: &IoDesc, offset: u64, len: u64, fua: bool) -> Option<AsyncOp> {
    Some(match op {
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
        _ => return None,
    })
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
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::Duration;

    use zcnbd_proto::Extent;

    use super::*;
    use crate::export::{run_blocking, Backend, Capabilities, MemoryBackend, ZeroError};

    /// A memory disk that completes every operation on a thread of its own, noting where
    /// each read's and write's buffer is.
    #[derive(Debug)]
    struct Submitting(Arc<MemoryBackend>, Arc<Mutex<Vec<usize>>>);

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
            if let AsyncOp::Read { buf, .. } | AsyncOp::Write { buf, .. } = &op {
                self.1.lock().unwrap().push(buf.as_ptr() as usize);
            }
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
    fn run(stack: &Stack, desc: IoDesc, buf: Vec<u8>) -> (Vec<u8>, i32) {
        let (tx, rx) = mpsc::channel();
        start(stack, &desc, buf, move |buf, result| {
            let _ = tx.send((buf, result));
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("answered")
    }

    #[test]
    fn requests_are_submitted_and_answered_from_the_completion() {
        let seen = Arc::default();
        let memory = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let stack = Stack::of(Arc::new(Submitting(memory, Arc::clone(&seen))), false);
        assert!(stack.is_asynchronous());
        // Tags' buffers are the device's largest request; requests use a prefix.
        let tag = |fill| vec![fill; 16384];
        let write = desc(io_desc::OP_WRITE, io_desc::F_FUA, 8, 16);
        let data = tag(0x5a);
        let written_from = data.as_ptr() as usize;
        let (back, result) = run(&stack, write, data);
        assert_eq!(result, 8192);
        assert_eq!(
            back.as_ptr() as usize,
            written_from,
            "the tag's buffer comes back"
        );
        let read = tag(0);
        let read_into = read.as_ptr() as usize;
        let (back, result) = run(&stack, desc(io_desc::OP_READ, 0, 8, 16), read);
        assert_eq!(result, 8192);
        assert!(back[..8192].iter().all(|&b| b == 0x5a));
        assert!(
            back[8192..].iter().all(|&b| b == 0),
            "read past the request"
        );
        // The write left from the tag's buffer and the read landed in it: no copy of ours.
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        assert_eq!(seen, [written_from, read_into]);
        let zero = desc(io_desc::OP_WRITE_ZEROES, io_desc::F_NOUNMAP, 8, 8);
        assert_eq!(run(&stack, zero, tag(0)).1, 0);
        let (back, _) = run(&stack, desc(io_desc::OP_READ, 0, 8, 16), tag(1));
        assert!(
            back[..4096].iter().all(|&b| b == 0) && back[4096..8192].iter().all(|&b| b == 0x5a)
        );
        assert_eq!(run(&stack, desc(io_desc::OP_FLUSH, 0, 0, 0), tag(0)).1, 0);
        assert_eq!(run(&stack, desc(io_desc::OP_DISCARD, 0, 8, 8), tag(0)).1, 0);
        // Larger than the tag's buffer, past the end, an operation zcnbd does not offer.
        let big = desc(io_desc::OP_READ, 0, 0, 64);
        assert_eq!(run(&stack, big, tag(0)).1, -libc::EINVAL);
        assert!(run(&stack, desc(io_desc::OP_READ, 0, 2047, 16), tag(0)).1 < 0);
        assert_eq!(run(&stack, desc(10, 0, 0, 0), tag(0)).1, -libc::EOPNOTSUPP);
    }
}
