//! The exports every harness negotiates against, and the one server that sessions run on.

use std::sync::{Arc, OnceLock};

use zcnbd_proto::{ExportInfo, HandshakeLimits};
use zcnbd_server::{
    BackendSpec, BitmapSettings, DataPath, EngineKind, EngineOptions, ExportSpec, Limits, Server,
};

/// Handshake limits small enough that short fuzz inputs reach every one of them.
pub const HANDSHAKE_LIMITS: HandshakeLimits = HandshakeLimits {
    option_bytes_max: 1024,
    options_max: 32,
    meta_queries_max: 4,
};

/// The server's handshake deadline: short, as every client here half-closes promptly.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 200;

/// Payload limit of the `null` export: its size allows 32 MiB reads, and a few hundred of
/// those in one input would make each run take seconds without reaching any new code.
pub const NULL_PAYLOAD_BYTES_MAX: u32 = 64 * 1024;

/// A server and what its handshake tells clients about each export.
pub struct Fixture {
    pub server: Arc<Server>,
    pub infos: Vec<ExportInfo>,
}

/// Which engine (and data path) a session runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Portable,
    /// io_uring, `--data-path auto`: sends from the mapping; in-place receives limited to
    /// 16 KiB (`--receive-in-place-max-bytes`), so larger writes take the bounce buffers.
    UringAuto,
    /// io_uring, `--data-path zerocopy`: splice and receive-in-place for every size (the
    /// file export's writes are spliced socket → pipe → file).
    UringZeroCopy,
}

/// The process-wide fixture on the portable engine, built on first use.
pub fn fixture() -> &'static Fixture {
    fixture_for(Engine::Portable)
}

/// The process-wide fixture for `engine`, built on first use.
pub fn fixture_for(engine: Engine) -> &'static Fixture {
    static PORTABLE: OnceLock<Fixture> = OnceLock::new();
    static URING_AUTO: OnceLock<Fixture> = OnceLock::new();
    static URING_ZEROCOPY: OnceLock<Fixture> = OnceLock::new();
    let cell = match engine {
        Engine::Portable => &PORTABLE,
        Engine::UringAuto => &URING_AUTO,
        Engine::UringZeroCopy => &URING_ZEROCOPY,
    };
    cell.get_or_init(|| build(engine))
}

fn spec(name: &str, backend: BackendSpec, read_only: bool, min_block_size: u32) -> ExportSpec {
    // Memory exports track a dirty bitmap, so that sessions reach its context too.
    let bitmaps = BitmapSettings {
        names: match backend {
            BackendSpec::Memory(_) => vec!["fz".into()],
            _ => Vec::new(),
        },
        ..BitmapSettings::default()
    };
    ExportSpec {
        bitmaps,
        name: name.into(),
        description: format!("fuzz export {name:?}"),
        backend,
        read_only,
        min_block_size,
        clients_max: None,
        tls_only: false,
        rotational: false,
        filters: Vec::new(),
        payload_max: None,
        image: Default::default(),
    }
}

/// The backing file of the `b512` export: a buffered file, so sessions also reach the
/// page-cache paths (file reads, receive-then-write, and writes spliced socket → pipe →
/// file). Removed once open; each process and engine has its own.
fn b512_file(engine: Engine) -> std::path::PathBuf {
    let name = format!("zcnbd-fuzz-b512-{}-{engine:?}.img", std::process::id());
    let path = std::env::temp_dir().join(name);
    let file = std::fs::File::create(&path).expect("fuzz export file");
    // A size that is a multiple of the minimum block size but not of the preferred one.
    file.set_len((1 << 20) + 512)
        .expect("fuzz export file size");
    path
}

fn build(engine: Engine) -> Fixture {
    let b512 = b512_file(engine);
    let specs = [
        spec("", BackendSpec::Memory(1 << 20), false, 1),
        spec("ro", BackendSpec::Memory(1 << 20), true, 1),
        // The largest 4 KiB-aligned size: every offset + length sum is near overflow.
        spec("null", BackendSpec::Null(!4095), false, 1),
        spec(
            "b512",
            BackendSpec::File {
                path: b512.clone(),
                direct: false,
            },
            false,
            512,
        ),
    ];
    let mut exports: Vec<_> = specs
        .iter()
        .map(|s| s.build().expect("fuzz export"))
        .collect();
    let _ = std::fs::remove_file(&b512);
    exports[2].block_size.payload_max = NULL_PAYLOAD_BYTES_MAX;
    let infos = exports.iter().map(|e| e.info()).collect();
    let limits = Limits {
        handshake_timeout_ms: HANDSHAKE_TIMEOUT_MS,
        worker_threads: 2,
        handshake: HANDSHAKE_LIMITS,
        ..Default::default()
    };
    let (kind, data_path) = match engine {
        Engine::Portable => (EngineKind::Portable, DataPath::Auto),
        Engine::UringAuto => (EngineKind::Uring, DataPath::Auto),
        Engine::UringZeroCopy => (EngineKind::Uring, DataPath::ZeroCopy),
    };
    let options = EngineOptions {
        engine: kind,
        data_path,
        ring_threads: 1,
        receive_in_place_max_bytes: (engine == Engine::UringAuto).then_some(16 * 1024),
        ..Default::default()
    };
    let server = Server::with_engine(exports, limits, options).expect("fuzz server");
    Fixture { server, infos }
}
