//! Sending a memory export's pages, and receiving write payloads into them, without touching
//! them in Rust: the portable engine's replies that point into the export's mapping
//! (`sys/mapping.rs` says why no Rust reference to those bytes is ever formed) go to the
//! kernel as raw iovecs (`sendmsg`), or to OpenSSL as a raw address (`SSL_write` copies the
//! plaintext into its record buffer, in C); payloads land by `recv` into the mapping, or by
//! `SSL_read`, which copies the decrypted record into it.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use foreign_types::ForeignTypeRef;
use openssl::ssl::SslRef;
use zcnbd_tls::{RawDest, RawPlaintext, RawSslError};

use super::mapping::MappedRange;

/// Most iovecs one send carries (Linux's `IOV_MAX`).
pub const PIECES_MAX: usize = 1024;

/// A piece of what one send carries.
#[derive(Debug, Clone, Copy)]
pub enum OutPiece<'a> {
    /// Bytes Rust owns (headers, a reply buffer).
    Bytes(&'a [u8]),
    /// A range of the memory export's mapping (kept mapped by the range).
    Mapped(&'a MappedRange),
}

impl OutPiece<'_> {
    /// Bytes in the piece.
    pub fn len(&self) -> usize {
        match self {
            OutPiece::Bytes(b) => b.len(),
            OutPiece::Mapped(m) => m.len(),
        }
    }

    /// Whether the piece is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One `sendmsg` of `pieces` (at most [`PIECES_MAX`]), less their first `skip` bytes (what
/// earlier calls sent): the bytes sent. Blocks as the socket does; a send timeout is
/// `WouldBlock`, as for any write.
pub fn send_pieces(
    fd: BorrowedFd<'_>,
    pieces: &[OutPiece<'_>],
    mut skip: usize,
) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(pieces.len().min(PIECES_MAX));
    for piece in pieces {
        let len = piece.len();
        if skip >= len {
            skip -= len;
            continue;
        }
        let base: *const u8 = match piece {
            OutPiece::Bytes(b) => b.as_ptr(),
            OutPiece::Mapped(m) => match m.io_range(0..len) {
                Some(p) => p,
                None => return Err(io::Error::from_raw_os_error(libc::EFAULT)),
            },
        };
        // SAFETY: `skip < len`, so the address stays inside the piece.
        let base = unsafe { base.add(skip) };
        iov.push(libc::iovec {
            iov_base: base as *mut libc::c_void,
            iov_len: len - skip,
        });
        skip = 0;
        if iov.len() == PIECES_MAX {
            break;
        }
    }
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: zeroed is a valid msghdr (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    // SAFETY: every iovec points into memory that outlives the call: byte pieces are borrowed
    // for it, and mapped pieces' ranges lie inside a mapping their `MappedRange` keeps mapped
    // (checked by `io_range`). The kernel only reads them; `msg` and `iov` live across the
    // call and the kernel keeps no pointer after it returns.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

impl RawPlaintext for MappedRange {
    fn len(&self) -> usize {
        MappedRange::len(self)
    }

    fn ssl_write(&self, ssl: &SslRef, at: usize, len: usize) -> Result<usize, RawSslError> {
        let (ptr, len) = ssl_range(self, at, len)?;
        // SAFETY: `ssl` is live for the borrow and its owner (the session's engine, under its
        // lock) lets no other thread use it meanwhile; `ptr..ptr+len` lies inside the mapping
        // this range keeps mapped (`io_range`), and OpenSSL only reads it, copying it into
        // its own record buffer before it returns.
        let rc = unsafe { openssl_sys::SSL_write(ssl.as_ptr(), ptr.cast(), len) };
        if rc > 0 {
            return Ok(rc as usize);
        }
        Err(ssl_error(ssl, rc, "SSL_write from the mapping"))
    }
}

impl RawDest for MappedRange {
    fn len(&self) -> usize {
        MappedRange::len(self)
    }

    fn ssl_read(&self, ssl: &SslRef, at: usize, len: usize) -> Result<usize, RawSslError> {
        let (ptr, len) = ssl_range(self, at, len)?;
        // SAFETY: `ssl` is live for the borrow and its owner (the session's engine, under its
        // lock) lets no other thread use it meanwhile; `ptr..ptr+len` lies inside the mapping
        // this range keeps mapped (`io_range`), and OpenSSL writes at
        // most `len` bytes there, copying decrypted plaintext from its own record buffer.
        let rc = unsafe { openssl_sys::SSL_read(ssl.as_ptr(), ptr.cast(), len) };
        if rc > 0 {
            return Ok(rc as usize);
        }
        Err(ssl_error(ssl, rc, "SSL_read into the mapping"))
    }
}

/// The address of `len` bytes of `range` from `at`, and the length as OpenSSL takes it
/// (shortened to `c_int::MAX`: one call moves at most that much).
fn ssl_range(
    range: &MappedRange,
    at: usize,
    len: usize,
) -> Result<(*mut u8, libc::c_int), RawSslError> {
    let len = len.min(libc::c_int::MAX as usize);
    let ptr = at
        .checked_add(len)
        .and_then(|end| range.io_range(at..end))
        .ok_or(RawSslError {
            code: openssl_sys::SSL_ERROR_SSL,
        })?;
    Ok((ptr, len as libc::c_int))
}

/// What `SSL_get_error` says of a call that returned `rc`; a hard failure's error queue is
/// emptied into the debug log, so the next OpenSSL call on this thread starts clean.
fn ssl_error(ssl: &SslRef, rc: libc::c_int, what: &str) -> RawSslError {
    // SAFETY: `ssl` is live for the borrow; SSL_get_error only reads its state and the
    // thread's error queue.
    let code = unsafe { openssl_sys::SSL_get_error(ssl.as_ptr(), rc) };
    if code == openssl_sys::SSL_ERROR_SSL || code == openssl_sys::SSL_ERROR_SYSCALL {
        let stack = openssl::error::ErrorStack::get();
        tracing::debug!("{what} failed ({code}): {stack}");
    }
    RawSslError { code }
}

/// One `recv` of up to `len` bytes into `range` from `at`: the bytes received (0 at the end
/// of the stream). Blocks as the socket does; a receive timeout is `WouldBlock`.
pub fn recv_into(
    fd: BorrowedFd<'_>,
    range: &MappedRange,
    at: usize,
    len: usize,
) -> io::Result<usize> {
    recv_into_flags(fd, range, at, len, 0)
}

/// Like [`recv_into`], but `WouldBlock` instead of waiting when nothing has arrived.
pub fn recv_into_nowait(
    fd: BorrowedFd<'_>,
    range: &MappedRange,
    at: usize,
    len: usize,
) -> io::Result<usize> {
    recv_into_flags(fd, range, at, len, libc::MSG_DONTWAIT)
}

fn recv_into_flags(
    fd: BorrowedFd<'_>,
    range: &MappedRange,
    at: usize,
    len: usize,
    flags: libc::c_int,
) -> io::Result<usize> {
    let end = at
        .checked_add(len)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
    let ptr = range
        .io_range(at..end)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
    // SAFETY: `ptr..ptr+len` lies inside the mapping `range` keeps mapped (`io_range`); the
    // kernel writes at most `len` bytes there and keeps no pointer after the call.
    let n = unsafe { libc::recv(fd.as_raw_fd(), ptr.cast(), len, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use std::time::Duration;

    use zcnbd_tls::Plaintext;

    use super::*;
    use crate::sys::mapping::Mapping;
    use crate::tls::ktls::loopback_pair;
    use crate::tls::test_psk::{psk_client, psk_server};

    /// A memfd of `len` bytes mapped, filled with a pattern; the pattern too.
    fn mapped(len: usize) -> (Arc<Mapping>, Vec<u8>) {
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, len as u64).unwrap();
        let map = Arc::new(Mapping::new(fd.as_fd(), len as u64).unwrap());
        let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        assert!(map.copy_in(0, &pattern));
        (map, pattern)
    }

    #[test]
    fn pieces_are_sent_in_order_and_resume_after_what_was_sent() {
        let (map, pattern) = mapped(1 << 20);
        let range = Mapping::range(&map, 4096, 300_000).unwrap();
        let mut copy = vec![0u8; 10];
        assert!(range.copy_out(5, &mut copy));
        assert_eq!(copy, pattern[4101..4111]);
        assert!(!range.copy_out(299_995, &mut copy));
        let pieces = [
            OutPiece::Bytes(b"head"),
            OutPiece::Mapped(&range),
            OutPiece::Bytes(b"tail"),
        ];
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        let (a, mut b) = UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got
        });
        // Resumes from arbitrary points, as after short sends.
        let mut sent = 0;
        for step in [3, 5000, total] {
            while sent < step.min(total) {
                let skip = sent;
                let n = send_pieces(a.as_fd(), &pieces, skip).unwrap();
                sent += n;
            }
        }
        assert_eq!(send_pieces(a.as_fd(), &pieces, total).unwrap(), 0);
        drop(a);
        let got = reader.join().unwrap();
        let mut want = b"head".to_vec();
        want.extend_from_slice(&pattern[4096..4096 + 300_000]);
        want.extend_from_slice(b"tail");
        assert_eq!(got.len(), want.len());
        assert!(got == want);
    }

    #[test]
    fn openssl_encrypts_mapped_plaintext_in_order_with_gathered_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (server, keys) = psk_server(dir.path());
        let client = psk_client(&keys, None);
        let (c, s) = loopback_pair().unwrap();
        let timeout = Duration::from_secs(10);
        let (srv, cli) = std::thread::scope(|scope| {
            let srv = scope.spawn(|| server.accept(s, &[], timeout));
            let cli = client.connect(c, "localhost", timeout);
            (srv.join().unwrap(), cli)
        });
        let (srv, cli) = (srv.unwrap(), cli.unwrap());
        let counters = srv.counters();
        let ((mut sr, mut sw), (mut cr, mut cw)) = (srv.split(), cli.split());

        let (map, pattern) = mapped(1 << 20);
        let big = Mapping::range(&map, 1000, 700_000).unwrap();
        let small = Mapping::range(&map, 5, 10).unwrap();
        let parts = [
            Plaintext::Bytes(b"header"),
            Plaintext::Raw(&big),
            Plaintext::Bytes(b"between"),
            Plaintext::Raw(&small),
            Plaintext::Bytes(b"end"),
        ];
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut want = b"header".to_vec();
        want.extend_from_slice(&pattern[1000..701_000]);
        want.extend_from_slice(b"between");
        want.extend_from_slice(&pattern[5..15]);
        want.extend_from_slice(b"end");
        let sent = std::thread::scope(|scope| {
            let send = scope.spawn(|| sw.write_all_parts(&parts));
            let mut got = vec![0u8; total];
            cr.read_exact(&mut got).unwrap();
            send.join().unwrap().unwrap();
            got
        });
        assert!(sent == want, "the plaintext differs");
        assert_eq!(counters.encrypted_bytes(), total as u64);
        sw.flush().unwrap();

        // The other way: a payload decrypted straight into the mapping, after bytes read
        // the ordinary way from the same records.
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let dest = Mapping::range(&map, 65536, payload.len()).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                cw.write_all(b"hdr").unwrap();
                cw.write_all(&payload).unwrap();
            });
            let mut hdr = [0u8; 3];
            sr.read_exact(&mut hdr).unwrap();
            assert_eq!(&hdr, b"hdr");
            let mut at = 0;
            while at < payload.len() {
                let n = sr.read_raw(&dest, at, payload.len() - at).unwrap();
                assert!(n > 0);
                at += n;
            }
        });
        let mut landed = vec![0u8; payload.len()];
        assert!(dest.copy_out(0, &mut landed));
        assert!(landed == payload, "the payload differs");
        assert_eq!(counters.decrypted_bytes(), payload.len() as u64 + 3);
    }

    #[test]
    fn recv_lands_in_the_mapping() {
        let (map, _) = mapped(1 << 16);
        let dest = Mapping::range(&map, 100, 5000).unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[9u8; 5000]).unwrap();
        let mut at = 0;
        while at < 5000 {
            at += recv_into(b.as_fd(), &dest, at, 5000 - at).unwrap();
        }
        let mut got = vec![0u8; 5000];
        assert!(dest.copy_out(0, &mut got));
        assert!(got.iter().all(|&x| x == 9));
        assert!(recv_into(b.as_fd(), &dest, 4999, 2).is_err());
    }
}
