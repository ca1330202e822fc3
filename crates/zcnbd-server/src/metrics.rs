//! `--metrics ADDR`: the data-path counters over HTTP in Prometheus text format.
//!
//! A deliberately tiny responder: every request, whatever its path, gets the counters. Each
//! connection is read for at most 8 KiB and 1 s, so a slow or hostile scraper cannot hold it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::stats::Stats;

/// Longest request head read from a scraper.
const REQUEST_BYTES_MAX: usize = 8192;

/// Starts the responder thread on `addr`.
pub fn spawn(addr: SocketAddr, stats: Arc<Stats>) -> io::Result<()> {
    let listener = TcpListener::bind(addr)?;
    info!("metrics on http://{}/metrics", listener.local_addr()?);
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => {
                        if let Err(e) = respond(s, &stats) {
                            warn!("metrics request failed: {e}");
                        }
                    }
                    Err(e) => warn!("metrics accept failed: {e}"),
                }
            }
        })?;
    Ok(())
}

fn respond(mut stream: TcpStream, stats: &Stats) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut head = [0u8; REQUEST_BYTES_MAX];
    let mut filled = 0;
    while filled < head.len() && !head[..filled].windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut head[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    let body = stats.render_prometheus();
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(reply.as_bytes())
}
