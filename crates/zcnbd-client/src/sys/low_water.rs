//! A socket's receive low-water mark (`SO_RCVLOWAT`, `socket(7)`), which rustix has no call
//! for. On TCP it tells the kernel not to wake a reader (a blocking `recv`, `poll` for
//! readability) until that many bytes have come, unless the receive window is nearly closed,
//! the peer closed, or an error came; the kernel caps it at half the receive buffer's limit
//! and grows the buffer to hold it. One wake-up per large piece of a long payload rather
//! than one per segment that lands: on this project's two-vCPU machines a wake-up across
//! CPUs costs tens of µs.
//!
//! The rules for a user: a mark no larger than what is sure to come (the rest of a payload),
//! or the wait lasts until the timeout; the wait a poll (readable once the bytes not yet
//! taken reach the mark) followed by a non-blocking receive, not a blocking receive, which
//! once it took some bytes waits for the mark's worth of *new* ones. Unix sockets accept a
//! mark but their poll ignores it.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// Sets `socket`'s receive low-water mark to `bytes` (1 is the kernel's default: wake for
/// any byte). Values above `c_int::MAX` are clamped.
pub fn set_receive_low_water(socket: impl AsFd, bytes: usize) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: `value` is a live `c_int` on this frame for the duration of the call, and the
    // length passed is its size, which is what SO_RCVLOWAT reads; the descriptor is borrowed
    // from an open socket (a wrong kind of descriptor is an error, not undefined behaviour).
    let done = unsafe {
        libc::setsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&value as *const libc::c_int).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match done {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// `socket`'s receive low-water mark as the kernel holds it (after its cap).
#[cfg(test)]
pub fn receive_low_water(socket: impl AsFd) -> io::Result<usize> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are live on this frame for the duration of the call; `len`
    // says `value`'s size, and the kernel writes at most that many bytes to it.
    let done = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&mut value as *mut libc::c_int).cast::<libc::c_void>(),
            &mut len,
        )
    };
    match done {
        0 => Ok(usize::try_from(value).unwrap_or(0)),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    #[test]
    fn a_reader_waits_for_the_low_water_mark_and_reads_all_once_it_is_there() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut reader, _) = listener.accept().unwrap();
        set_receive_low_water(&reader, 64 << 10).unwrap();
        assert_eq!(receive_low_water(&reader).unwrap(), 64 << 10);
        reader
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        writer.write_all(&[7u8; 1000]).unwrap();
        let mut buf = vec![0u8; 128 << 10];
        // 1000 bytes are below the mark: the blocking read waits its whole timeout, then
        // returns what came.
        let started = std::time::Instant::now();
        assert_eq!(reader.read(&mut buf).unwrap(), 1000);
        assert!(started.elapsed() >= Duration::from_millis(150));
        writer.write_all(&vec![7u8; 64 << 10]).unwrap();
        // The mark is met: the read wakes with all of it.
        assert_eq!(reader.read(&mut buf).unwrap(), 64 << 10);
        set_receive_low_water(&reader, 1).unwrap();
        assert_eq!(receive_low_water(&reader).unwrap(), 1);
        writer.write_all(&[1u8; 10]).unwrap();
        assert_eq!(reader.read(&mut buf).unwrap(), 10);
    }
}
