//! Every request of both engines goes through the export's stack, on every data path: a
//! watching layer over a memory and a file export sees each read and write (through `map`,
//! when an engine moves the bytes itself, or through `pread`/`pwrite`), and every FUA write is
//! made durable through it (a flush, or a write the layers made durable) before its reply,
//! where the layer says a `RWF_DSYNC` write to the place is not enough. The io_uring engine
//! once answered a FUA write received in place without either.

mod one_client;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use one_client::{with_client, within};
use zcnbd_client::WriteFlags;
use zcnbd_server::export::{
    memory_backend, Backend, Export, FileBackend, FileMode, Layer, Map, MapFor, Stack,
};
use zcnbd_server::{DataPath, EngineKind, EngineOptions, Limits, Server};

/// Counts what comes down through it; changes nothing.
#[derive(Debug, Default)]
struct Watch {
    maps: AtomicUsize,
    preads: AtomicUsize,
    pwrites: AtomicUsize,
    durable_writes: AtomicUsize,
    flushes: AtomicUsize,
}

impl Layer for Watch {
    fn name(&self) -> &'static str {
        "watch"
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.preads.fetch_add(1, Ordering::Relaxed);
        next.pread(buf, offset)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.pwrites.fetch_add(1, Ordering::Relaxed);
        if fua {
            self.durable_writes.fetch_add(1, Ordering::Relaxed);
        }
        next.pwrite(buf, offset, fua)
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        next.flush()
    }
    fn map(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        how: MapFor,
        out: &mut Map,
    ) -> io::Result<()> {
        self.maps.fetch_add(1, Ordering::Relaxed);
        next.map(offset, len, how, out)?;
        // As an image's layer would: a FUA write is durable only once the stack has flushed
        // (or written it durably) - not by a RWF_DSYNC write to the place alone.
        out.dsync_is_fua = false;
        Ok(())
    }
}

const SIZE: u64 = 8 << 20;
const SIZES: [usize; 3] = [4096, 64 << 10, 1 << 20];

fn engines() -> Vec<(EngineKind, DataPath)> {
    vec![
        (EngineKind::Portable, DataPath::Auto),
        (EngineKind::Uring, DataPath::Auto),
        (EngineKind::Uring, DataPath::ZeroCopy),
        (EngineKind::Uring, DataPath::Copy),
    ]
}

fn server(
    base: Arc<dyn Backend>,
    watch: &Arc<Watch>,
    engine: EngineKind,
    path: DataPath,
) -> Arc<Server> {
    let stack = Stack::new(base, vec![Arc::clone(watch) as Arc<dyn Layer>], false);
    let options = EngineOptions {
        engine,
        data_path: path,
        ring_threads: 1,
        ..EngineOptions::default()
    };
    let limits = Limits {
        worker_threads: 2,
        ..Limits::default()
    };
    match Server::with_engine(vec![Export::new("", stack)], limits, options) {
        Ok(server) => server,
        Err(e) => panic!("{engine:?} could not start here: {e}"),
    }
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + seed) as u8).collect()
}

/// Writes (plain and FUA) and reads of each size through `server`; checks the data and what
/// the watching layer saw.
fn exercise(label: String, server: Arc<Server>, watch: Arc<Watch>, engine: EngineKind) {
    within(Duration::from_secs(60), &label.clone(), move || {
        with_client(engine, server, |client| {
            let mut fua_writes = 0;
            for (i, len) in SIZES.into_iter().enumerate() {
                let at = (i as u64) * (2 << 20);
                let data = pattern(len, i);
                client.write_at(&data, at).unwrap();
                let fua = WriteFlags { fua: true };
                let before = durable(&watch);
                let bufs = [std::io::IoSlice::new(&data)];
                client
                    .write_vectored_at(&bufs, at + len as u64, fua)
                    .unwrap();
                fua_writes += 1;
                assert!(
                    durable(&watch) > before,
                    "{label}: a {len}-byte FUA write was answered before the stack made it durable"
                );
                let mut back = vec![0u8; 2 * len];
                client.read_at(&mut back, at).unwrap();
                assert_eq!(back[..len], data[..], "{label}: {len} bytes");
                assert_eq!(back[len..], data[..], "{label}: {len} bytes (FUA)");
            }
            let seen = watch.maps.load(Ordering::Relaxed)
                + watch.preads.load(Ordering::Relaxed)
                + watch.pwrites.load(Ordering::Relaxed);
            // Two writes and a read per size: each reached the stack at least once.
            assert!(
                seen >= 3 * SIZES.len(),
                "{label}: the stack saw {seen} calls"
            );
            assert!(fua_writes > 0);
        });
    });
}

fn durable(watch: &Watch) -> usize {
    watch.flushes.load(Ordering::Relaxed) + watch.durable_writes.load(Ordering::Relaxed)
}

#[test]
fn a_memory_export_goes_through_its_stack_on_every_engine() {
    for (engine, path) in engines() {
        let watch = Arc::new(Watch::default());
        let base = Arc::new(memory_backend(SIZE).unwrap());
        let label = format!("memory, {engine:?}, {path:?}");
        exercise(label, server(base, &watch, engine, path), watch, engine);
    }
}

#[test]
fn a_file_export_goes_through_its_stack_on_every_engine() {
    for mode in [FileMode::Buffered, FileMode::Direct] {
        for (engine, path) in engines() {
            let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
            let file = dir.path().join("disk");
            std::fs::File::create(&file).unwrap().set_len(SIZE).unwrap();
            let base = match FileBackend::open(&file, mode, true) {
                Ok(base) => base,
                Err(e) if mode == FileMode::Direct => panic!("O_DIRECT here: {e}"),
                Err(e) => panic!("{e}"),
            };
            let watch = Arc::new(Watch::default());
            let label = format!("file {mode:?}, {engine:?}, {path:?}");
            let server = server(Arc::new(base), &watch, engine, path);
            exercise(label, server, watch, engine);
        }
    }
}
