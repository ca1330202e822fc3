//! A backend that panics: the request gets `EIO`, the connection and the server go on serving,
//! and neither the connection's end nor the server's can hang on the lost request - on both
//! engines.

mod one_client;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use one_client::{with_client, within};
use zcnbd_proto::Extent;
use zcnbd_server::export::{
    memory_backend, Backend, Capabilities, Export, Stack, ZeroError, ZeroFlags,
};
use zcnbd_server::{DataPath, EngineKind, EngineOptions, Limits, Server};

/// Reads at this offset panic inside the backend.
const PANIC_OFFSET: u64 = 1 << 20;

/// A memory disk whose `pread` at [`PANIC_OFFSET`] panics. It offers no direct data source,
/// so the io_uring engine too runs every request through the worker pool.
#[derive(Debug)]
struct Panicky(Arc<dyn Backend>);

impl Backend for Panicky {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        assert_ne!(offset, PANIC_OFFSET, "injected backend panic");
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
    fn extents(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) -> io::Result<()> {
        // All data: reads are answered with one data chunk, by `pread`.
        let _ = (max, self.0.extents(offset, len, max, &mut Vec::new()));
        out.push(Extent {
            length: len,
            flags: 0,
        });
        Ok(())
    }
}

fn server(engine: EngineKind) -> Option<Arc<Server>> {
    let backend: Arc<dyn Backend> = Arc::new(memory_backend(4 << 20).expect("memory backend"));
    let export = Export::new("", Stack::of(Arc::new(Panicky(backend)), false));
    let options = EngineOptions {
        engine,
        data_path: DataPath::Auto,
        ring_threads: 1,
        ..EngineOptions::default()
    };
    match Server::with_engine(vec![export], Limits::default(), options) {
        Ok(server) => Some(server),
        Err(e) => {
            // The io_uring engine cannot start on this kernel: skipped with the reason,
            // except under CI (`CI=true`), whose machines have io_uring.
            let ci = std::env::var("CI").as_deref() == Ok("true");
            assert!(!ci, "{engine:?} cannot start under CI=true: {e}");
            eprintln!("SKIP {engine:?}: {e}");
            None
        }
    }
}

fn check_engine(engine: EngineKind) {
    let Some(server) = server(engine) else { return };
    with_client(engine, server, |client| {
        let data = vec![0xab; 4096];
        client.write_at(&data, 0).unwrap();
        let mut buf = vec![0; 4096];
        for _ in 0..3 {
            let err = client.read_at(&mut buf, PANIC_OFFSET).unwrap_err();
            assert_eq!(err.errno(), libc::EIO, "{engine:?}: {err}");
            client.read_at(&mut buf, 0).unwrap();
            assert_eq!(buf, data, "{engine:?}: served after the panic");
        }
    });
}

// Before panics were caught, the first of these reads never got a reply: the check fails by
// timing out rather than by hanging the test run.
#[test]
fn backend_panic_is_eio_and_nothing_hangs_portable() {
    within(Duration::from_secs(60), "portable engine", || {
        check_engine(EngineKind::Portable)
    });
}

#[test]
fn backend_panic_is_eio_and_nothing_hangs_uring() {
    within(Duration::from_secs(60), "io_uring engine", || {
        check_engine(EngineKind::Uring)
    });
}
