//! The checked top of the stack: FUA emulation, read-only, range checks, what it makes of the
//! layers' answers; the pass-through layer over every base; the maps of memory and file
//! exports.

use std::io;
use std::sync::{mpsc, Arc, Mutex};

use zcnbd_proto::consts::state;
use zcnbd_proto::{Errno, Extent};

use super::*;
use crate::buffer_pool::BufferPool;
use crate::export::layers::PassThrough;
use crate::export::{
    errno_of, Completion, Export, FileBackend, FileMode, MemoryBackend, NullBackend,
};

/// A backend that records every call, with the capabilities it is given.
#[derive(Debug)]
struct Recorder {
    caps: Capabilities,
    calls: Mutex<Vec<String>>,
}

impl Recorder {
    fn new(caps: Capabilities) -> Arc<Recorder> {
        Arc::new(Recorder {
            caps,
            calls: Mutex::default(),
        })
    }

    fn log(&self, call: String) -> io::Result<()> {
        self.calls.lock().unwrap().push(call);
        Ok(())
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl Backend for Recorder {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.log(format!("pread {offset}+{}", buf.len()))
    }
    fn pwrite(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.log(format!("pwrite {offset}+{} fua={fua}", buf.len()))
    }
    fn flush(&self) -> io::Result<()> {
        self.log("flush".into())
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.log(format!("trim {offset}+{len} fua={fua}"))
    }
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ZeroError> {
        Ok(self.log(format!("zero {offset}+{len} fua={}", flags.fua))?)
    }
    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.log(format!("cache {offset}+{len}"))
    }
    fn extents(&self, _: u64, _: u64, _: usize, _: &mut Vec<Extent>) -> io::Result<()> {
        self.log("extents".into())
    }
    fn can_submit(&self) -> bool {
        true
    }
    fn submit(&self, op: AsyncOp, done: Completion) {
        let _ = self.log(format!("submit {}", op.what()));
        done.complete(op, Ok(()));
    }
}

fn everything() -> Capabilities {
    Capabilities {
        write: true,
        flush: true,
        fua: true,
        trim: true,
        zero: true,
        fast_zero: true,
        cache: true,
        multi_conn: true,
    }
}

fn no_fua() -> Capabilities {
    Capabilities {
        fua: false,
        ..everything()
    }
}

fn errno<T: std::fmt::Debug>(result: io::Result<T>) -> Errno {
    errno_of(&result.expect_err("refused"))
}

#[test]
fn fua_is_native_where_the_layers_have_it_and_a_flush_where_not() {
    let native = Recorder::new(everything());
    let stack = Stack::of(Arc::clone(&native) as _, false);
    stack.write(&[0; 512], 0, true).unwrap();
    stack.trim(0, 4096, true).unwrap();
    let zero = ZeroFlags {
        fua: true,
        ..ZeroFlags::default()
    };
    stack.zero(0, 4096, zero).unwrap();
    assert_eq!(
        native.calls(),
        [
            "pwrite 0+512 fua=true",
            "trim 0+4096 fua=true",
            "zero 0+4096 fua=true"
        ]
    );

    let emulated = Recorder::new(no_fua());
    let stack = Stack::of(Arc::clone(&emulated) as _, false);
    stack.write(&[0; 512], 0, true).unwrap();
    stack.write(&[0; 512], 512, false).unwrap();
    stack.trim(0, 4096, true).unwrap();
    stack.zero(0, 4096, zero).unwrap();
    assert_eq!(
        emulated.calls(),
        [
            "pwrite 0+512 fua=false",
            "flush",
            "pwrite 512+512 fua=false",
            "trim 0+4096 fua=false",
            "flush",
            "zero 0+4096 fua=false",
            "flush"
        ]
    );
    // Emulated FUA is still advertised (and read-only exports advertise none).
    let export = Export::new("e", Stack::of(emulated as _, false));
    let flags = export.transmission_flags();
    use zcnbd_proto::consts::transmission_flags as tf;
    assert_ne!(flags & tf::SEND_FUA, 0);
}

#[test]
fn asynchronous_fua_is_a_flush_submitted_after_the_operation() {
    let emulated = Recorder::new(no_fua());
    let stack = Stack::of(Arc::clone(&emulated) as _, false);
    let pool = BufferPool::new(1 << 20);
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(move |op, result| {
        let _ = tx.send((op.map(|op| op.what()), result.is_ok()));
    });
    let write = AsyncOp::Write {
        buf: pool.get(512),
        offset: 0,
        fua: true,
    };
    stack.submit(write, done);
    assert_eq!(rx.try_recv().unwrap(), (Some("write"), true));
    assert_eq!(emulated.calls(), ["submit write", "submit flush"]);
}

#[test]
fn a_read_only_stack_refuses_every_write_and_says_so() {
    let memory: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20).unwrap());
    let stack = Stack::of(memory, true);
    assert!(stack.is_read_only());
    assert_eq!(errno(stack.write(b"x", 0, false)), Errno::Perm);
    assert_eq!(errno(stack.trim(0, 4096, false)), Errno::Perm);
    let zero = stack
        .zero(0, 4096, ZeroFlags::default())
        .map_err(io::Error::from);
    assert_eq!(errno(zero), Errno::Perm);
    let mut map = Map::default();
    assert_eq!(
        errno(stack.map(0, 4096, MapFor::Write, &mut map)),
        Errno::Perm
    );
    let mut buf = [1u8; 16];
    stack.read(&mut buf, 0).unwrap();
    assert_eq!(buf, [0; 16]);
    let export = Export::new("ro", Stack::of(Recorder::new(everything()) as _, true));
    use zcnbd_proto::consts::transmission_flags as tf;
    let flags = export.transmission_flags();
    assert_ne!(flags & tf::READ_ONLY, 0);
    assert_eq!(
        flags & (tf::SEND_FUA | tf::SEND_TRIM | tf::SEND_WRITE_ZEROES),
        0
    );
    // A backend that cannot write makes the stack read-only whatever was asked.
    let cannot = Capabilities {
        write: false,
        ..everything()
    };
    assert!(Stack::of(Recorder::new(cannot) as _, false).is_read_only());
}

#[test]
fn ranges_outside_the_export_are_refused_before_any_layer_sees_them() {
    let recorder = Recorder::new(everything());
    let stack = Stack::of(Arc::clone(&recorder) as _, false);
    let size = stack.size();
    let mut buf = [0u8; 512];
    assert_eq!(errno(stack.read(&mut buf, size - 100)), Errno::Inval);
    assert_eq!(errno(stack.write(&buf, size - 100, false)), Errno::NoSpc);
    assert_eq!(errno(stack.trim(u64::MAX - 10, 100, false)), Errno::NoSpc);
    assert_eq!(errno(stack.cache(size, 1)), Errno::Inval);
    let mut out = Vec::new();
    assert_eq!(errno(stack.extents(u64::MAX, 2, 4, &mut out)), Errno::Inval);
    let mut map = Map::default();
    let how = MapFor::Read { holes: true };
    assert_eq!(errno(stack.map(size - 1, 2, how, &mut map)), Errno::Inval);
    assert!(recorder.calls().is_empty(), "a layer saw a bad range");
    // The edges themselves are fine.
    stack.read(&mut buf, size - 512).unwrap();
    assert_eq!(recorder.calls(), ["pread 1048064+512"]);
}

#[test]
fn advisory_commands_the_layers_cannot_do_succeed_and_fast_zero_fails_fast() {
    let none = Capabilities {
        trim: false,
        cache: false,
        fast_zero: false,
        ..everything()
    };
    let recorder = Recorder::new(none);
    let stack = Stack::of(Arc::clone(&recorder) as _, false);
    stack.trim(0, 4096, false).unwrap();
    stack.cache(0, 4096).unwrap();
    let fast = ZeroFlags {
        fast: true,
        ..ZeroFlags::default()
    };
    assert!(matches!(stack.zero(0, 4096, fast), Err(ZeroError::NotFast)));
    assert!(recorder.calls().is_empty());
}

#[test]
fn extents_always_cover_part_of_the_range_and_never_past_it() {
    let stack = Stack::of(Recorder::new(everything()) as _, false);
    let mut out = Vec::new();
    stack.extents(0, 8192, 4, &mut out).unwrap();
    assert_eq!(
        out,
        [Extent {
            length: 8192,
            flags: 0
        }]
    );
    let hole = state::HOLE | state::ZERO;
    let mut out = vec![
        Extent {
            length: 0,
            flags: hole,
        },
        Extent {
            length: 4096,
            flags: 0,
        },
        Extent {
            length: 1 << 30,
            flags: hole,
        },
        Extent {
            length: 4096,
            flags: 0,
        },
    ];
    tidy_extents(&mut out, 0, 8192, 4);
    assert_eq!(
        out,
        [
            Extent {
                length: 4096,
                flags: 0
            },
            Extent {
                length: 4096,
                flags: hole
            }
        ]
    );
    let mut capped = vec![
        Extent {
            length: 1,
            flags: 0
        };
        10
    ];
    tidy_extents(&mut capped, 0, 100, 3);
    assert_eq!(capped.len(), 3);
}

/// A layer that maps wrongly: too short, zeroes to write to, or a panic.
#[derive(Debug)]
enum Liar {
    Short,
    ZeroForWrite,
    Panics,
}

impl Layer for Liar {
    fn name(&self) -> &'static str {
        "liar"
    }
    fn map(&self, _: &dyn Backend, _: u64, len: u64, _: MapFor, out: &mut Map) -> io::Result<()> {
        match self {
            Liar::Short => out.push(len - 1, Place::Zero),
            Liar::ZeroForWrite => out.push(len, Place::Zero),
            Liar::Panics => panic!("a layer bug"),
        }
        Ok(())
    }
}

#[test]
fn a_layer_that_maps_wrongly_is_an_error_never_a_place() {
    for liar in [Liar::Short, Liar::ZeroForWrite, Liar::Panics] {
        let base: Arc<dyn Backend> = Arc::new(NullBackend::new(1 << 20));
        let stack = Stack::new(base, vec![Arc::new(liar) as _], false);
        let mut map = Map::default();
        let got = stack.map(0, 4096, MapFor::Write, &mut map);
        assert_eq!(errno(got), Errno::Io);
        assert!(map.segments().is_empty());
    }
}

/// Every base backend, alone and under two pass-through layers.
fn bases() -> Vec<(&'static str, Arc<dyn Backend>, tempfile::NamedTempFile)> {
    let file = || {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        f
    };
    let (f1, f2, f3) = (file(), file(), file());
    let buffered = FileBackend::open(f1.path(), FileMode::Buffered, true).unwrap();
    let memory = MemoryBackend::new(1 << 20).unwrap();
    vec![
        ("memory", Arc::new(memory) as _, f2),
        ("file", Arc::new(buffered) as _, f1),
        ("null", Arc::new(NullBackend::new(1 << 20)) as _, f3),
    ]
}

#[test]
fn a_pass_through_layer_changes_nothing_on_any_base() {
    for (name, base, _file) in bases() {
        let alone = Stack::of(Arc::clone(&base), false);
        let layers: Vec<Arc<dyn Layer>> = vec![Arc::new(PassThrough), Arc::new(PassThrough)];
        let layered = Stack::new(Arc::clone(&base), layers, false);
        assert_eq!(layered.layer_names(), ["passthrough", "passthrough"]);
        assert_eq!(layered.size(), alone.size(), "{name}");
        assert_eq!(layered.capabilities(), alone.capabilities(), "{name}");
        assert_eq!(layered.medium(), alone.medium(), "{name}");
        assert_eq!(layered.never_waits(), alone.never_waits(), "{name}");
        layered.write(&[7u8; 8192], 65536, false).unwrap();
        let (mut a, mut b) = ([0u8; 8192], [0u8; 8192]);
        alone.read(&mut a, 65536).unwrap();
        layered.read(&mut b, 65536).unwrap();
        assert_eq!(a, b, "{name}");
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        alone.extents(0, 1 << 20, 16, &mut ea).unwrap();
        layered.extents(0, 1 << 20, 16, &mut eb).unwrap();
        assert_eq!(ea, eb, "{name}");
        let (mut ma, mut mb) = (Map::default(), Map::default());
        for how in [MapFor::Read { holes: true }, MapFor::Write] {
            let _lease = alone.map(65536, 8192, how, &mut ma).unwrap();
            let _lease = layered.map(65536, 8192, how, &mut mb).unwrap();
            assert_eq!(format!("{ma:?}"), format!("{mb:?}"), "{name} {how:?}");
        }
    }
}

/// The segments of a map, as (length, medium or what else).
fn runs(map: &Map) -> Vec<(u64, &'static str)> {
    let what = |p: &Place| match p {
        Place::Memory { .. } => "memory",
        Place::File { .. } => "file",
        Place::Direct { .. } => "direct",
        Place::Zero => "zero",
        Place::Stack => "stack",
    };
    map.segments()
        .iter()
        .map(|s| (s.len, what(&s.place)))
        .collect()
}

#[test]
fn a_memory_export_maps_to_its_mapping_and_its_holes_to_zeroes() {
    let memory: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20).unwrap());
    let stack = Stack::of(memory, false);
    stack.write(&[9u8; 65536], 65536, false).unwrap();
    let mut map = Map::default();
    let holes = MapFor::Read { holes: true };
    let _lease = stack.map(65536, 65536, holes, &mut map).unwrap();
    assert_eq!(runs(&map), [(65536, "memory")]);
    let Some(Place::Memory { range, .. }) = map.single().map(|s| &s.place) else {
        panic!("not the mapping");
    };
    assert_eq!((range.offset(), range.len()), (65536, 65536));
    let mut out = [0u8; 16];
    assert!(range.copy_out(100, &mut out));
    assert_eq!(out, [9u8; 16]);
    let _lease = stack.map(0, 4096, holes, &mut map).unwrap();
    assert_eq!(runs(&map), [(4096, "zero")]);
    let _lease = stack
        .map(65536 - 4096, 8192 + 65536, holes, &mut map)
        .unwrap();
    assert_eq!(
        runs(&map),
        [(4096, "zero"), (65536, "memory"), (4096, "stack")]
    );
    // Without holes wanted, or for a write, the whole range is the mapping.
    let _lease = stack
        .map(0, 4096, MapFor::Read { holes: false }, &mut map)
        .unwrap();
    assert_eq!(runs(&map), [(4096, "memory")]);
    let _lease = stack.map(0, 4096, MapFor::Write, &mut map).unwrap();
    assert_eq!(runs(&map), [(4096, "memory")]);
}

#[test]
fn a_file_export_maps_to_its_descriptors_at_the_same_offset() {
    for mode in [FileMode::Buffered, FileMode::Direct] {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("disk");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let Ok(file) = FileBackend::open(&path, mode, true) else {
            // No O_DIRECT on this file system (tmpfs): the buffered case still ran.
            assert_eq!(mode, FileMode::Direct);
            continue;
        };
        let stack = Stack::of(Arc::new(file), false);
        stack.write(&[1u8; 8192], 8192, false).unwrap();
        let mut map = Map::default();
        let _lease = stack.map(8192, 8192, MapFor::Write, &mut map).unwrap();
        let offset = match &map.single().unwrap().place {
            Place::File { offset, .. } if mode == FileMode::Buffered => *offset,
            Place::Direct { offset, .. } if mode == FileMode::Direct => *offset,
            other => panic!("{mode:?} mapped to {other:?}"),
        };
        assert_eq!(offset, 8192);
        let _lease = stack
            .map(0, 16384, MapFor::Read { holes: true }, &mut map)
            .unwrap();
        let kind = if mode == FileMode::Direct {
            "direct"
        } else {
            "file"
        };
        assert_eq!(runs(&map), [(8192, "zero"), (8192, kind)]);
    }
}

/// A layer whose first flush fails, as an `fdatasync` after a lost writeback does.
#[derive(Debug, Default)]
struct FlushFailsOnce(std::sync::atomic::AtomicBool);

impl Layer for FlushFailsOnce {
    fn name(&self) -> &'static str {
        "flush-fails-once"
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        if !self.0.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        next.flush()
    }
}

#[test]
fn after_a_failed_sync_every_flush_and_fua_request_fails_until_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.raw");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let base: Arc<dyn Backend> =
        Arc::new(FileBackend::open(&path, FileMode::Buffered, true).unwrap());
    let stack = Stack::new(
        Arc::clone(&base),
        vec![Arc::new(FlushFailsOnce::default())],
        false,
    );
    let mut map = Map::default();
    let _lease = stack.map(0, 4096, MapFor::Write, &mut map).unwrap();
    assert!(
        map.dsync_is_fua,
        "a raw file: RWF_DSYNC makes a write durable"
    );
    stack.write(&[1; 4096], 0, false).unwrap();
    assert_eq!(errno(stack.flush()), Errno::Io);
    // The layer's flush works again, and the kernel would say 0: the stack does not.
    assert_eq!(errno(stack.flush()), Errno::Io);
    assert_eq!(errno(stack.write(&[2; 4096], 0, true)), Errno::Io);
    assert_eq!(errno(stack.trim(0, 4096, true)), Errno::Io);
    let fua = ZeroFlags {
        may_trim: true,
        fast: false,
        fua: true,
    };
    assert!(stack.zero(0, 4096, fua).is_err());
    assert_eq!(
        errno(stack.written_in_place(0, 4096, true, true)),
        Errno::Io
    );
    // Reads and plain writes go on; an engine's FUA write goes through the stack.
    stack.write(&[3; 4096], 4096, false).unwrap();
    let mut buf = [0u8; 4096];
    stack.read(&mut buf, 4096).unwrap();
    assert_eq!(buf, [3; 4096]);
    let _lease = stack.map(0, 4096, MapFor::Write, &mut map).unwrap();
    assert!(!map.dsync_is_fua);
    // A reload keeps the open file, and with it the failure.
    let reloaded = Stack::of(Arc::clone(&base), false);
    assert_eq!(errno(reloaded.flush()), Errno::Io);
    // Opened again: a new start.
    let reopened = FileBackend::open(&path, FileMode::Buffered, true).unwrap();
    Stack::of(Arc::new(reopened), false).flush().unwrap();
}
