//! One client against a library `Server`, for the tests that check a connection ends and the
//! server shuts down without hanging (shared by several test crates).

use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use zcnbd_client::Client;
use zcnbd_server::stream::Stream;
use zcnbd_server::{EngineKind, Server};

/// Runs `f` in a thread; fails the test if it takes longer than `limit`.
pub fn within(limit: Duration, what: &str, f: impl FnOnce() + Send + 'static) {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    finished
        .recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} hung"));
}

/// Serves one connection of `server` and runs `client` against it; then checks that the
/// connection ends and the server shuts down.
pub fn with_client(engine: EngineKind, server: Arc<Server>, client: impl FnOnce(&Client)) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let serving = Arc::clone(&server);
    let (ended, connection_ended) = mpsc::channel();
    std::thread::spawn(move || {
        let (socket, _) = listener.accept().unwrap();
        serving.serve_stream(Stream::Unix(socket), "test");
        let _ = ended.send(());
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let c = Client::connect(&uri).unwrap();
    client(&c);
    c.close();
    drop(c);
    connection_ended
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{engine:?}: the connection's end hung"));
    within(Duration::from_secs(10), "server teardown", move || {
        drop(server)
    });
}
