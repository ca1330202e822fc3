//! The loopback ceiling: how fast one TCP stream on this machine moves data for the same
//! duration as a cell, sent with send() from a user buffer and with sendfile() from the
//! page cache. Every result is also shown as a share of the better of the two.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustix::fs::{memfd_create, MemfdFlags};

use super::results::Ceiling;

/// Bytes per send() call, and the size of the file sendfile() reads from.
const CHUNK_BYTES: usize = 1 << 20;
const FILE_BYTES: u64 = 64 << 20;

/// Measures both ways for `duration` each.
pub fn probe(duration: Duration) -> std::io::Result<Ceiling> {
    Ok(Ceiling {
        send_mib_s: stream(duration, Sender::Send)?,
        sendfile_mib_s: stream(duration, Sender::Sendfile)?,
    })
}

#[derive(Clone, Copy)]
enum Sender {
    Send,
    Sendfile,
}

/// One stream: a receiver thread drains the socket; returns the sender's MiB/s.
fn stream(duration: Duration, how: Sender) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; CHUNK_BYTES];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    });
    let sock = TcpStream::connect(addr)?;
    let start = Instant::now();
    let sent = match how {
        Sender::Send => send_loop(&sock, start + duration)?,
        Sender::Sendfile => sendfile_loop(&sock, start + duration)?,
    };
    let elapsed = start.elapsed().as_secs_f64();
    drop(sock);
    let _ = receiver.join();
    Ok(sent as f64 / (1024.0 * 1024.0) / elapsed)
}

fn send_loop(sock: &TcpStream, until: Instant) -> std::io::Result<u64> {
    use std::io::Write;
    let buf = vec![0x5au8; CHUNK_BYTES];
    let mut sent = 0u64;
    let mut s = sock;
    while Instant::now() < until {
        s.write_all(&buf)?;
        sent += CHUNK_BYTES as u64;
    }
    Ok(sent)
}

fn sendfile_loop(sock: &TcpStream, until: Instant) -> std::io::Result<u64> {
    let file = memfd_create("zcnbd-ceiling", MemfdFlags::CLOEXEC)?;
    let chunk = vec![0x5au8; CHUNK_BYTES];
    for _ in 0..FILE_BYTES / CHUNK_BYTES as u64 {
        rustix::io::write(&file, &chunk)?;
    }
    let mut sent = 0u64;
    while Instant::now() < until {
        let mut offset = 0u64;
        while offset < FILE_BYTES {
            let n = rustix::fs::sendfile(sock.as_fd(), &file, Some(&mut offset), CHUNK_BYTES)?;
            if n == 0 {
                break;
            }
            sent += n as u64;
        }
    }
    Ok(sent)
}
