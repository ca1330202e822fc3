//! Many requests in flight at once from one client (shared by several test crates).

use std::time::Duration;

use zcnbd_client::Client;

/// Submits `n` requests with `submit` (request `i` with user data `i`) before collecting any
/// reply, then waits for all of them; returns their buffers in request order. A failed
/// request fails the test.
pub fn all_at_once(client: &Client, n: usize, submit: impl Fn(usize)) -> Vec<Vec<u8>> {
    (0..n).for_each(&submit);
    let mut done = Vec::new();
    while done.len() < n {
        client.complete(&mut done, Some(Duration::from_secs(30)));
    }
    done.sort_by_key(|c| c.user_data);
    done.into_iter()
        .map(|c| {
            c.result.expect("request failed");
            c.buffer
        })
        .collect()
}
