//! Writing the whole region before measuring, so reads measure written data (a read of a
//! never-written range can be answered with holes, which proves nothing).

use std::time::Duration;

use zcnbd_client::{Client, Completion, WriteFlags};

use super::verify::Pattern;

const PREFILL_BLOCK_BYTES: u64 = 1 << 20;
const PREFILL_DEPTH: u64 = 16;

/// Writes `[0, region)` of `uri` with the verification pattern (or a fixed one) and flushes.
pub fn write_all(uri: &str, region: u64, pattern: Option<&Pattern>) -> zcnbd_client::Result<()> {
    let client = Client::connect(uri)?;
    let fixed = Pattern::new(0);
    let pattern = pattern.unwrap_or(&fixed);
    in_blocks(&client, region, |at, len| {
        let mut buf = vec![0u8; len];
        pattern.fill(&mut buf, at);
        client.submit_write(buf, at, WriteFlags::default(), at)
    })?;
    client.flush()
}

/// Reads `[0, region)` of `uri` once, the data dropped: a cache's first pass (`--warm`), so
/// that the measured reads are its second.
pub fn read_all(uri: &str, region: u64) -> zcnbd_client::Result<()> {
    let client = Client::connect(uri)?;
    in_blocks(&client, region, |at, len| {
        client.submit_read(vec![0u8; len], at, at)
    })
}

/// Covers `[0, region)` in blocks of [`PREFILL_BLOCK_BYTES`], [`PREFILL_DEPTH`] in flight:
/// `submit(offset, len)` starts each; returns once all completed (the first error).
fn in_blocks(
    client: &Client,
    region: u64,
    mut submit: impl FnMut(u64, usize) -> zcnbd_client::Result<()>,
) -> zcnbd_client::Result<()> {
    let mut next = 0u64;
    let mut in_flight = 0u64;
    let mut done: Vec<Completion> = Vec::new();
    loop {
        while in_flight < PREFILL_DEPTH && next < region {
            let len = PREFILL_BLOCK_BYTES.min(region - next);
            submit(next, len as usize)?;
            next += len;
            in_flight += 1;
        }
        if in_flight == 0 {
            return Ok(());
        }
        client.complete(&mut done, Some(Duration::from_secs(30)));
        for c in done.drain(..) {
            in_flight -= 1;
            c.result?;
        }
    }
}
