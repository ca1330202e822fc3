//! A pattern of blocks written every other block (so holes lie between) by many requests in
//! flight at once, then read back and checked (shared by the asynchronous-backend tests).

use zcnbd_client::{Client, WriteFlags};

use crate::pipelined::all_at_once;

/// Bytes of each block.
pub const BLOCK: usize = 4096;

/// Block `i`'s contents.
pub fn block(i: usize) -> Vec<u8> {
    (0..BLOCK).map(|k| (i * 7 + k % 251) as u8).collect()
}

/// Where block `i` is written: every other block, so holes lie between.
pub fn at(i: usize) -> u64 {
    (2 * i * BLOCK) as u64
}

/// Writes blocks `0..n`, every request sent before any reply is collected.
pub fn write_all(client: &Client, n: usize) {
    all_at_once(client, n, |i| {
        let flags = WriteFlags::default();
        client
            .submit_write(block(i), at(i), flags, i as u64)
            .unwrap();
    });
}

/// Reads blocks `0..n` back the same way and checks each (`what` names the case).
pub fn read_all_back(client: &Client, n: usize, what: &str) {
    let read = all_at_once(client, n, |i| {
        client.submit_read(vec![0; BLOCK], at(i), i as u64).unwrap();
    });
    for (i, data) in read.iter().enumerate() {
        assert_eq!(*data, block(i), "{what}: block {i}");
    }
}
