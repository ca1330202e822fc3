//! Connecting to an NBD upstream starts no thread of the proxy's own: `zcnbd attach` and
//! `zcnbd serve --fork` fork after opening their source, which only a process of one thread
//! may do. The upstream's driver thread starts with the first request submitted (alone in
//! its test binary, so no other test's upstream counts).

use std::os::unix::net::UnixListener;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use zcnbd_server::export::{
    memory_backend, AsyncOp, Backend, Completion, Export, NbdBackend, Stack,
};
use zcnbd_server::stream::Stream;
use zcnbd_server::{Limits, Server};

/// Threads of this process named `name`.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim() == name)
        .count()
}

#[test]
fn the_driver_thread_starts_with_the_first_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("upstream.sock");
    let memory = Arc::new(memory_backend(1 << 20).expect("memory backend"));
    let export = Export::new("", Stack::of(memory, false));
    let server = Server::new(vec![export], Limits::default()).expect("upstream server");
    let listener = UnixListener::bind(&path).expect("bind");
    std::thread::spawn(move || {
        for socket in listener.incoming().map_while(Result::ok) {
            let serving = Arc::clone(&server);
            std::thread::spawn(move || serving.serve_stream(Stream::Unix(socket), "upstream"));
        }
    });
    let uri = format!("nbd+unix:///?socket={}", path.display());
    let backend = NbdBackend::connect(&uri, 1, Duration::from_secs(1)).expect("connect");
    assert_eq!(
        threads_named("nbd-upstream"),
        0,
        "a thread before any request"
    );
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(move |_, result| {
        let _ = tx.send(result.is_ok());
    });
    backend.submit(AsyncOp::Flush, done);
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
    assert_eq!(threads_named("nbd-upstream"), 1);
    drop(backend);
    assert_eq!(
        threads_named("nbd-upstream"),
        0,
        "the driver outlived the backend"
    );
}
