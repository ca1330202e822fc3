//! librbd and librados, the few calls an RBD export needs (`rbd/librbd.h`, `rados/librados.h`
//! from Ceph 16): connect to a cluster, open an image (or a snapshot, read-only), asynchronous
//! reads, writes, flushes, discards and zeroing, the blocking forms for the server's own flush,
//! and the allocation map (`rbd_diff_iterate2`).
//!
//! Ownership of an operation in flight: [`Image::aio`] takes the memory it works on (a value
//! whose bytes stay put when it moves, [`StableBytes`]) and the closure to call, boxes both and
//! gives librbd the box's address as the completion's argument; librbd's callback takes the
//! box back exactly once and hands the memory to the closure. Nothing else points at the
//! memory meanwhile, since the box owns it.
//!
//! Completions run on librbd's own callback thread (`on_complete`), not through the eventfd
//! that `rbd_set_image_notification` offers: librbd calls the callback first in any case
//! (`AioCompletion::complete` runs `complete_cb`, then signals the eventfd), and the
//! server's completions may run on any thread and only queue a reply (posting it to a ring's
//! mailbox or a connection's writer), so waiting on an eventfd would add a wake-up and a
//! thread hop per batch to reach the same place. Measured (a throwaway eventfd build: a poller
//! thread reading the eventfd and draining `rbd_poll_io_events`; zcnbd bench, randread,
//! iodepth 32, 5 s cells alternated twice, one-OSD test cluster on a shared 2-vCPU machine):
//! 4 KiB 4.68k/6.20k IOPS through the callback against 5.63k/4.85k through the eventfd, 1 MiB
//! 312/330 against 349/304 MiB/s - no difference beyond the noise - and the eventfd spent
//! more server CPU per GiB (28-31 s against 24-27 s at 4 KiB). So: the callback.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::ptr;
use std::sync::OnceLock;

use libloading::Library;

use tracing::error;

use crate::buffer_pool::PooledBuf;

type RadosT = *mut c_void;
type IoCtxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type Callback = extern "C" fn(CompletionT, *mut c_void);
type DiffCallback = extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

/// librbd's `rbd_snap_info_t`.
#[repr(C)]
struct SnapInfo {
    id: u64,
    size: u64,
    name: *const c_char,
}

/// Most snapshots of one image listed (Ceph's own default limit per image is 510).
const SNAPSHOTS_MAX: usize = 4096;

/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: write real zeroes, never deallocate.
const WRITE_ZEROES_THICK: c_int = 1;

/// The library a machine without Ceph's client lacks, and the package that brings it.
const LIBRBD: &str = "librbd.so.1";
const LIBRADOS: &str = "librados.so.2";
/// What to tell a user whose machine has no librbd.
const INSTALL_HINT: &str = "install librbd1 (Debian, Ubuntu: apt-get install librbd1)";

/// Declares the librados and librbd calls, and [`CephApi`]: a table of them resolved at run
/// time from the libraries (`dlopen`), so that the server neither links them nor needs their
/// headers to build, and a machine without them fails only an RBD export's start.
macro_rules! ceph_api {
    ($($lib:ident: { $(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;)* })*) => {
        /// librados' and librbd's calls, resolved once from the installed libraries.
        pub struct CephApi {
            $($(
                $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?,
            )*)*
            /// The libraries the calls live in: loaded for the life of the process.
            _libraries: [Library; 2],
        }

        impl CephApi {
            fn resolve(rados: Library, rbd: Library) -> Result<CephApi, String> {
                let libraries = [rados, rbd];
                $($(
                    let $name = {
                        let (index, file) = ceph_api!(@which $lib);
                        let name = concat!(stringify!($name), "\0");
                        // SAFETY: the symbol is a function with this signature in every
                        // librados/librbd since Ceph 15 (`rados/librados.h`,
                        // `rbd/librbd.h`); the pointer is used only while the library
                        // stays loaded, which is for the life of the process (`_libraries`).
                        let symbol = unsafe {
                            libraries[index].get::<unsafe extern "C" fn($($ty),*) $(-> $ret)?>(
                                name.as_bytes(),
                            )
                        };
                        *symbol.map_err(|e| format!("{file}: {e}"))?
                    };
                )*)*
                Ok(CephApi { $($($name,)*)* _libraries: libraries })
            }
        }
    };
    (@which rados) => { (0, LIBRADOS) };
    (@which rbd) => { (1, LIBRBD) };
}

ceph_api! {
    rados: {
        fn rados_create(cluster: *mut RadosT, id: *const c_char) -> c_int;
        fn rados_conf_read_file(cluster: RadosT, path: *const c_char) -> c_int;
        fn rados_conf_parse_env(cluster: RadosT, var: *const c_char) -> c_int;
        fn rados_conf_set(cluster: RadosT, option: *const c_char, value: *const c_char) -> c_int;
        fn rados_conf_get(cluster: RadosT, option: *const c_char, buf: *mut c_char, len: usize) -> c_int;
        fn rados_connect(cluster: RadosT) -> c_int;
        fn rados_shutdown(cluster: RadosT);
        fn rados_ioctx_create(cluster: RadosT, pool: *const c_char, io: *mut IoCtxT) -> c_int;
        fn rados_ioctx_destroy(io: IoCtxT);
        fn rados_ioctx_set_namespace(io: IoCtxT, nspace: *const c_char);
    }
    rbd: {
        fn rbd_open(io: IoCtxT, name: *const c_char, image: *mut ImageT, snap: *const c_char) -> c_int;
        fn rbd_open_read_only(io: IoCtxT, name: *const c_char, image: *mut ImageT, snap: *const c_char) -> c_int;
        fn rbd_close(image: ImageT) -> c_int;
        fn rbd_get_size(image: ImageT, size: *mut u64) -> c_int;
        fn rbd_read(image: ImageT, off: u64, len: usize, buf: *mut c_char) -> isize;
        fn rbd_write(image: ImageT, off: u64, len: usize, buf: *const c_char) -> isize;
        fn rbd_discard(image: ImageT, off: u64, len: u64) -> c_int;
        fn rbd_write_zeroes(image: ImageT, off: u64, len: usize, zero: c_int, op: c_int) -> isize;
        fn rbd_flush(image: ImageT) -> c_int;
        fn rbd_diff_iterate2(
            image: ImageT,
            from_snap: *const c_char,
            off: u64,
            len: u64,
            include_parent: u8,
            whole_object: u8,
            cb: DiffCallback,
            arg: *mut c_void,
        ) -> c_int;
        fn rbd_snap_list(image: ImageT, snaps: *mut SnapInfo, max_snaps: *mut c_int) -> c_int;
        fn rbd_snap_list_end(snaps: *mut SnapInfo);
        fn rbd_aio_create_completion(arg: *mut c_void, cb: Callback, c: *mut CompletionT) -> c_int;
        fn rbd_aio_get_return_value(c: CompletionT) -> isize;
        fn rbd_aio_release(c: CompletionT);
        fn rbd_aio_readv(image: ImageT, iov: *const libc::iovec, iovcnt: c_int, off: u64, c: CompletionT) -> c_int;
        fn rbd_aio_write2(image: ImageT, off: u64, len: usize, buf: *const c_char, c: CompletionT, op_flags: c_int) -> c_int;
        fn rbd_aio_flush(image: ImageT, c: CompletionT) -> c_int;
        fn rbd_aio_discard(image: ImageT, off: u64, len: u64, c: CompletionT) -> c_int;
        fn rbd_aio_write_zeroes(image: ImageT, off: u64, len: usize, c: CompletionT, zero_flags: c_int, op_flags: c_int) -> c_int;
    }
}

/// The loaded API, or why it could not be loaded (asked once per process).
static API: OnceLock<Result<CephApi, String>> = OnceLock::new();

/// librados' and librbd's calls, loading the libraries the first time; the error names the
/// missing library and the package to install.
pub fn api() -> Result<&'static CephApi, CephError> {
    let loaded = API.get_or_init(|| {
        // dlopen's own words ("librbd.so.1: cannot open shared object file: ...").
        let why = |e: libloading::Error| {
            std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string())
        };
        // SAFETY: loading runs the libraries' initialisers; librados and librbd are C++
        // libraries whose initialisers only set up their own globals.
        let open = |file: &str| unsafe { Library::new(file) }.map_err(why);
        let rados = open(LIBRADOS)?;
        let rbd = open(LIBRBD)?;
        CephApi::resolve(rados, rbd)
    });
    loaded
        .as_ref()
        .map_err(|why| CephError::Missing(format!("{why}; {INSTALL_HINT}")))
}

/// Why a Ceph export could not be opened or served.
#[derive(Debug)]
pub enum CephError {
    /// Ceph's client libraries are not installed (or not usable): what dlopen said, and
    /// what to install.
    Missing(String),
    /// A librados or librbd call failed.
    Call {
        /// What was being done ("connecting to the cluster", "opening image rbd/disk").
        step: String,
        /// The positive errno the call returned (negated).
        errno: i32,
    },
}

impl CephError {
    fn call(step: String, errno: i32) -> CephError {
        CephError::Call { step, errno }
    }

    fn errno(&self) -> i32 {
        match self {
            CephError::Missing(_) => libc::ENOENT,
            CephError::Call { errno, .. } => *errno,
        }
    }
}

impl fmt::Display for CephError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CephError::Missing(why) => write!(f, "Ceph's client library is missing: {why}"),
            CephError::Call { step, errno } => {
                let e = io::Error::from_raw_os_error(*errno);
                write!(f, "{step}: {e}")
            }
        }
    }
}

impl std::error::Error for CephError {}

impl From<CephError> for io::Error {
    fn from(e: CephError) -> io::Error {
        io::Error::new(
            io::Error::from_raw_os_error(e.errno()).kind(),
            e.to_string(),
        )
    }
}

/// `Ok(ret)` for a non-negative return, else the errno as an error for `step`.
fn check(ret: c_int, step: impl FnOnce() -> String) -> Result<c_int, CephError> {
    if ret < 0 {
        Err(CephError::call(step(), -ret))
    } else {
        Ok(ret)
    }
}

fn io_result(ret: isize) -> io::Result<usize> {
    usize::try_from(ret).map_err(|_| io::Error::from_raw_os_error(ret.unsigned_abs() as i32))
}

fn cstring(what: &str, text: &str) -> Result<CString, CephError> {
    CString::new(text)
        .map_err(|_| CephError::call(format!("{what} {text:?} contains a NUL byte"), libc::EINVAL))
}

/// Which image to open: a pool, the namespace in it (`None`: the default one), the image,
/// and a snapshot of it (`None`: the image itself). Shown as `rbd` names it:
/// `POOL[/NAMESPACE]/IMAGE[@SNAP]`.
#[derive(Debug, Clone, Copy)]
pub struct ImageName<'a> {
    pub pool: &'a str,
    pub namespace: Option<&'a str>,
    pub image: &'a str,
    pub snap: Option<&'a str>,
}

impl fmt::Display for ImageName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.pool)?;
        for part in self.namespace.iter().chain([&self.image]) {
            write!(f, "/{part}")?;
        }
        match self.snap {
            Some(snap) => write!(f, "@{snap}"),
            None => Ok(()),
        }
    }
}

/// A cluster handle being configured: not yet connected.
pub struct Rados {
    raw: RadosT,
    api: &'static CephApi,
}

impl Rados {
    /// A handle for client `id` (`None`: librados' default, `admin`).
    pub fn create(id: Option<&str>) -> Result<Rados, CephError> {
        let api = api()?;
        let id = id.map(|id| cstring("client id", id)).transpose()?;
        let mut raw = ptr::null_mut();
        let id_ptr = id.as_ref().map_or(ptr::null(), |id| id.as_ptr());
        // SAFETY: `raw` is a valid out pointer; `id_ptr` is null or a NUL-terminated string
        // that outlives the call.
        let ret = unsafe { (api.rados_create)(&mut raw, id_ptr) };
        check(ret, || "creating the cluster handle".to_owned())?;
        Ok(Rados { raw, api })
    }

    /// Reads `path`, or with `None` the first of librados' default places (`$CEPH_CONF`,
    /// `/etc/ceph/ceph.conf`, `~/.ceph/config`, `./ceph.conf`); then `CEPH_ARGS`.
    pub fn read_conf(&mut self, path: Option<&Path>) -> Result<(), CephError> {
        let api = self.api;
        let text = path.map(|p| p.to_string_lossy().into_owned());
        let c_path = text.as_deref().map(|p| cstring("path", p)).transpose()?;
        let p = c_path.as_ref().map_or(ptr::null(), |p| p.as_ptr());
        // SAFETY: `self.raw` is a live, unconnected handle (ours until Drop); `p` is null or
        // a NUL-terminated string that outlives the call.
        let ret = unsafe { (api.rados_conf_read_file)(self.raw, p) };
        // Without a file named, none found is not an error: CEPH_ARGS may say it all, and
        // connecting then fails with librados' own words.
        if !(path.is_none() && ret == -libc::ENOENT) {
            check(ret, || match &text {
                Some(p) => format!("reading {p}"),
                None => "reading the Ceph configuration".to_owned(),
            })?;
        }
        // SAFETY: as above; a null variable name means CEPH_ARGS.
        let ret = unsafe { (api.rados_conf_parse_env)(self.raw, ptr::null()) };
        check(ret, || "parsing CEPH_ARGS".to_owned()).map(drop)
    }

    /// A configuration value as text.
    pub fn conf_get(&self, option: &str) -> Result<String, CephError> {
        let api = self.api;
        let name = cstring("option", option)?;
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is writable for its length, which is what we pass; `name` is a
        // NUL-terminated string that outlives the call.
        let ret = unsafe {
            (api.rados_conf_get)(self.raw, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        };
        check(ret, || format!("reading option {option}"))?;
        let text = CStr::from_bytes_until_nul(&buf).map_err(|_| {
            CephError::call(
                format!("option {option}: value too long"),
                libc::ENAMETOOLONG,
            )
        })?;
        Ok(text.to_string_lossy().into_owned())
    }

    /// Sets a configuration value.
    pub fn conf_set(&mut self, option: &str, value: &str) -> Result<(), CephError> {
        let api = self.api;
        let (name, val) = (cstring("option", option)?, cstring("value", value)?);
        // SAFETY: a live, unconnected handle; both strings outlive the call.
        let ret = unsafe { (api.rados_conf_set)(self.raw, name.as_ptr(), val.as_ptr()) };
        check(ret, || format!("setting {option} = {value}")).map(drop)
    }

    /// Connects (bounded by `client_mount_timeout`) and opens the image `spec` names, in its
    /// pool's namespace, at its snapshot (read-only if a snapshot or `read_only`).
    pub fn open(self, spec: &ImageName<'_>, read_only: bool) -> Result<Image, CephError> {
        let api = self.api;
        let (pool, name, snap) = (spec.pool, spec.image, spec.snap);
        // SAFETY: a live handle, connected at most once (this consumes it).
        let ret = unsafe { (api.rados_connect)(self.raw) };
        check(ret, || "connecting to the Ceph cluster".to_owned())?;
        let cluster = Cluster(self);
        let c_pool = cstring("pool", pool)?;
        let mut io = ptr::null_mut();
        // SAFETY: a connected handle; `io` is a valid out pointer; the name outlives the call.
        let ret = unsafe { (api.rados_ioctx_create)(cluster.0.raw, c_pool.as_ptr(), &mut io) };
        check(ret, || format!("opening pool {pool:?}"))?;
        let io = IoCtx { raw: io, cluster };
        if let Some(namespace) = spec.namespace {
            let c_ns = cstring("namespace", namespace)?;
            // SAFETY: a live io context with no operation in flight; librados copies the
            // name, which outlives the call.
            unsafe { (api.rados_ioctx_set_namespace)(io.raw, c_ns.as_ptr()) };
        }
        let (c_name, c_snap) = (
            cstring("image", name)?,
            snap.map(|s| cstring("snapshot", s)),
        );
        let c_snap = c_snap.transpose()?;
        let snap_ptr = c_snap.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        let mut raw = ptr::null_mut();
        // SAFETY: a live io context (owned by `io`, which the image keeps); `raw` is a valid
        // out pointer; the strings outlive the call.
        let ret = unsafe {
            if read_only || snap.is_some() {
                (api.rbd_open_read_only)(io.raw, c_name.as_ptr(), &mut raw, snap_ptr)
            } else {
                (api.rbd_open)(io.raw, c_name.as_ptr(), &mut raw, snap_ptr)
            }
        };
        check(ret, || format!("opening image {spec}"))?;
        Ok(Image {
            raw,
            io: Some(io),
            api,
        })
    }
}

impl Drop for Rados {
    fn drop(&mut self) {
        let api = self.api;
        // SAFETY: the handle is ours and nothing opened from it outlives it: an `IoCtx` holds
        // the `Cluster` that holds this, and an `Image` holds its `IoCtx`.
        unsafe { (api.rados_shutdown)(self.raw) }
    }
}

/// A connected cluster handle.
struct Cluster(Rados);

/// A pool's I/O context; keeps its cluster connected.
struct IoCtx {
    raw: IoCtxT,
    cluster: Cluster,
}

impl Drop for IoCtx {
    fn drop(&mut self) {
        let api = self.cluster.0.api;
        // SAFETY: ours, and the image opened from it (which holds it) is closed already.
        unsafe { (api.rados_ioctx_destroy)(self.raw) }
        let _ = &self.cluster;
    }
}

/// An open image (or snapshot). librbd's image handle is thread-safe for I/O; every method
/// takes `&self`. Dropped on librbd's callback thread, it is closed on a thread of its own
/// (`rbd_close` waits for the callback thread's work); elsewhere, before the drop returns.
pub struct Image {
    raw: ImageT,
    /// Taken when closing.
    io: Option<IoCtx>,
    api: &'static CephApi,
}

// SAFETY: librbd's image handle (`ImageCtx`) locks internally and may be used from any
// thread; the handle is closed only in Drop, when no `&Image` is left.
unsafe impl Send for Image {}
// SAFETY: as above: concurrent I/O calls on one handle are what librbd's aio API is for.
unsafe impl Sync for Image {}

impl Drop for Image {
    fn drop(&mut self) {
        let closing = Closing {
            raw: self.raw,
            io: self.io.take(),
            api: self.api,
        };
        if !on_callback_thread() {
            return closing.close();
        }
        // `rbd_close` here would wait for this very thread: close on another.
        let spawned = std::thread::Builder::new()
            .name("rbd-close".to_owned())
            .spawn(move || closing.close());
        if let Err(e) = spawned {
            error!("cannot start a thread to close the RBD image ({e}): leaving it open");
        }
    }
}

/// An image handle on its way to `rbd_close`, with the I/O context (and cluster) to release
/// after it.
struct Closing {
    raw: ImageT,
    io: Option<IoCtx>,
    api: &'static CephApi,
}

// SAFETY: librbd's image handle may be closed from any thread; nothing else holds it (it
// was taken out of the `Image` being dropped).
unsafe impl Send for Closing {}

impl Closing {
    fn close(self) {
        let api = self.api;
        // SAFETY: ours; every operation in flight holds a reference to the backend (through
        // its completion) and so to the image, so none is left when it is dropped.
        let ret = unsafe { (api.rbd_close)(self.raw) };
        if ret < 0 {
            let e = io::Error::from_raw_os_error(-ret);
            error!("closing the RBD image: {e}");
        }
        drop(self.io);
    }
}

thread_local! {
    /// Set while this thread runs an operation's completion from librbd's callback.
    static IN_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is librbd's, running a completion: where an image must not be
/// closed, nor its closing waited for.
pub fn on_callback_thread() -> bool {
    IN_CALLBACK.with(|c| c.get())
}

/// Memory whose bytes stay where they are when the value is moved (they live in a heap
/// allocation the value owns), so librbd may work on them while the value moves into the
/// operation's box.
///
/// # Safety
/// `bytes` must return the same address and length every time until the value is dropped,
/// however often the value moves in between.
pub unsafe trait StableBytes: Send + 'static {
    /// The bytes an operation reads into or writes from (empty if none).
    fn bytes(&mut self) -> &mut [u8];
}

// SAFETY: a `PooledBuf`'s bytes live in the `Vec` of its `AlignedBuf` (on the heap; the
// buffer never reallocates), or in lent memory, whose `LentMemory` promise is the same, so
// they stay put when the `PooledBuf` moves.
unsafe impl StableBytes for PooledBuf {
    fn bytes(&mut self) -> &mut [u8] {
        self
    }
}

// SAFETY: no bytes at all (operations without memory: flush, discard, zeroing).
unsafe impl StableBytes for () {
    fn bytes(&mut self) -> &mut [u8] {
        &mut []
    }
}

/// One asynchronous librbd operation, on the bytes of the memory handed to [`Image::aio`].
#[derive(Debug, Clone, Copy)]
pub enum Aio {
    /// Fill the bytes from `offset`.
    Read { offset: u64 },
    /// Write the bytes at `offset`.
    Write { offset: u64 },
    /// Make completed writes durable.
    Flush,
    /// Discard a range.
    Discard { offset: u64, len: u64 },
    /// Zero a range; `thick`: write zeroes, never deallocate.
    WriteZeroes { offset: u64, len: u64, thick: bool },
}

/// What runs when an operation completes: librbd's return value in.
type Finish = Box<dyn FnOnce(isize) + Send>;

/// An operation in flight: the single iovec a read points librbd at, and what to run.
struct Pending {
    iov: libc::iovec,
    finish: Finish,
    /// The calls the callback makes.
    api: &'static CephApi,
}

/// librbd's completion callback: takes the `Pending` back (once: librbd calls each
/// completion's callback once) and runs it.
extern "C" fn on_complete(c: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<Pending>` leaked in `Image::aio` for this completion, and
    // librbd calls the callback once, so the box is taken back exactly once.
    let pending = unsafe { Box::from_raw(arg.cast::<Pending>()) };
    let api = pending.api;
    // SAFETY: `c` is the completion librbd is completing, still ours until released.
    let ret = unsafe { (api.rbd_aio_get_return_value)(c) };
    // SAFETY: released once, here; librbd holds its own reference while calling us.
    unsafe { (api.rbd_aio_release)(c) };
    // A panic must not unwind into librbd (C++): log it. The completion it held was dropped
    // during the unwind, which answers its request EIO.
    IN_CALLBACK.with(|c| c.set(true));
    if catch_unwind(AssertUnwindSafe(move || (pending.finish)(ret))).is_err() {
        error!("an RBD completion panicked; its request was answered EIO");
    }
    IN_CALLBACK.with(|c| c.set(false));
}

extern "C" fn on_extent(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `&mut dyn FnMut` that `Image::allocated` passes, alive for the
    // whole of its `rbd_diff_iterate2` call, which is when librbd calls this.
    let visit = unsafe { &mut *arg.cast::<&mut dyn FnMut(u64, u64) -> bool>() };
    if exists == 0 {
        return 0;
    }
    match catch_unwind(AssertUnwindSafe(|| visit(offset, len as u64))) {
        Ok(true) => 0,
        // Enough extents, or a panic: stop iterating.
        Ok(false) => -libc::ECANCELED,
        Err(_) => -libc::EIO,
    }
}

impl Image {
    /// The image's (or snapshot's) size in bytes.
    pub fn size(&self) -> io::Result<u64> {
        let api = self.api;
        let mut size = 0;
        // SAFETY: an open image; `size` is a valid out pointer.
        let ret = unsafe { (api.rbd_get_size)(self.raw, &mut size) };
        io_result(ret as isize)?;
        Ok(size)
    }

    /// Starts `aio` on `mem`'s bytes and returns at once; `done` gets `mem` back and the
    /// result (bytes done, or the error) on librbd's callback thread - or on this thread if
    /// librbd refuses to start the operation.
    pub fn aio<T: StableBytes>(
        &self,
        aio: Aio,
        mut mem: T,
        done: impl FnOnce(T, io::Result<usize>) + Send + 'static,
    ) {
        let api = self.api;
        let bytes = mem.bytes();
        let (base, len) = (bytes.as_mut_ptr(), bytes.len());
        // `mem` moves into the box; its bytes, by `StableBytes`, stay at `base`.
        let finish: Finish = Box::new(move |ret| done(mem, io_result(ret)));
        let pending = Box::into_raw(Box::new(Pending {
            iov: libc::iovec {
                iov_base: base.cast(),
                iov_len: len,
            },
            finish,
            api: self.api,
        }));
        let mut c = ptr::null_mut();
        // SAFETY: `c` is a valid out pointer; `pending` is the callback's argument, taken back
        // by `on_complete` or below, never both.
        let mut ret =
            unsafe { (api.rbd_aio_create_completion)(pending.cast(), on_complete, &mut c) };
        if ret >= 0 {
            // SAFETY: an open image and a fresh completion. The memory librbd works on is
            // `len` bytes at `base` (the iovec in `pending`, which lives until the callback),
            // owned by `pending` until the callback hands it to `done`, and touched by
            // nothing else meanwhile.
            ret = unsafe { self.start(aio, pending, c) };
            if ret < 0 {
                // SAFETY: not started, so librbd will not call back: the completion is ours.
                unsafe { (api.rbd_aio_release)(c) };
            }
        }
        if ret < 0 {
            // SAFETY: not started: librbd never saw `pending` (or dropped it), so this is the
            // only owner taking it back.
            let pending = unsafe { Box::from_raw(pending) };
            (pending.finish)(ret as isize);
        }
    }

    /// Starts `aio` with completion `c`.
    ///
    /// # Safety
    /// `pending`'s iovec describes memory valid until `c` completes, and `c` is fresh.
    unsafe fn start(&self, aio: Aio, pending: *mut Pending, c: CompletionT) -> c_int {
        let api = self.api;
        // SAFETY: `pending` is a live box (the caller's contract); only the iovec's address
        // is taken here, and its fields copied.
        let (iov, base, len) = unsafe {
            let iov = ptr::addr_of!((*pending).iov);
            (iov, (*iov).iov_base, (*iov).iov_len)
        };
        let (image, thick) = (
            self.raw,
            matches!(aio, Aio::WriteZeroes { thick: true, .. }),
        );
        let zero_flags = if thick { WRITE_ZEROES_THICK } else { 0 };
        match aio {
            // SAFETY: an open image, a fresh completion, and memory valid until it completes
            // (the caller's contract); the same for each call below.
            Aio::Read { offset } => unsafe { (api.rbd_aio_readv)(image, iov, 1, offset, c) },
            // SAFETY: as above.
            Aio::Write { offset } => unsafe {
                (api.rbd_aio_write2)(image, offset, len, base.cast(), c, 0)
            },
            // SAFETY: as above; no memory.
            Aio::Flush => unsafe { (api.rbd_aio_flush)(image, c) },
            // SAFETY: as above; no memory.
            Aio::Discard { offset, len } => unsafe { (api.rbd_aio_discard)(image, offset, len, c) },
            Aio::WriteZeroes { offset, len, .. } => match usize::try_from(len) {
                // SAFETY: as above; no memory.
                Ok(len) => unsafe {
                    (api.rbd_aio_write_zeroes)(image, offset, len, c, zero_flags, 0)
                },
                Err(_) => -libc::EINVAL,
            },
        }
    }

    /// Reads `buf` from `offset`, blocking.
    pub fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let api = self.api;
        // SAFETY: `buf` is valid and exclusively ours for its length during the call.
        let ret = unsafe { (api.rbd_read)(self.raw, offset, buf.len(), buf.as_mut_ptr().cast()) };
        whole(io_result(ret)?, buf.len())
    }

    /// Writes `buf` at `offset`, blocking.
    pub fn write(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let api = self.api;
        // SAFETY: `buf` is valid for its length during the call; librbd copies it.
        let ret = unsafe { (api.rbd_write)(self.raw, offset, buf.len(), buf.as_ptr().cast()) };
        whole(io_result(ret)?, buf.len())
    }

    /// Discards a range, blocking.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let api = self.api;
        // SAFETY: an open image; no memory is passed.
        io_result(unsafe { (api.rbd_discard)(self.raw, offset, len) } as isize).map(drop)
    }

    /// Zeroes a range, blocking; `thick`: write zeroes, never deallocate.
    pub fn write_zeroes(&self, offset: u64, len: u64, thick: bool) -> io::Result<()> {
        let api = self.api;
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let flags = if thick { WRITE_ZEROES_THICK } else { 0 };
        // SAFETY: an open image; no memory is passed.
        io_result(unsafe { (api.rbd_write_zeroes)(self.raw, offset, len, flags, 0) }).map(drop)
    }

    /// Makes completed writes durable, blocking.
    pub fn flush(&self) -> io::Result<()> {
        let api = self.api;
        // SAFETY: an open image.
        io_result(unsafe { (api.rbd_flush)(self.raw) } as isize).map(drop)
    }

    /// Calls `visit(offset, len)` for each allocated object-sized piece of
    /// `[offset, offset+len)` (with the parent image's, whole objects: the object map's
    /// answer, cheap with fast-diff) until it returns false. Blocks: call it off the engine.
    pub fn allocated(
        &self,
        offset: u64,
        len: u64,
        visit: impl FnMut(u64, u64) -> bool,
    ) -> io::Result<()> {
        self.diff_iterate(None, offset, len, true, on_extent, visit)
    }

    /// `rbd_diff_iterate2` from `from` (`None`: the beginning) over `[offset, offset+len)`
    /// (`whole_object`: object-sized pieces), each extent `callback` passes on given to
    /// `visit` until it returns false.
    fn diff_iterate(
        &self,
        from: Option<&CStr>,
        offset: u64,
        len: u64,
        whole_object: bool,
        callback: DiffCallback,
        mut visit: impl FnMut(u64, u64) -> bool,
    ) -> io::Result<()> {
        let api = self.api;
        let mut stopped = false;
        let mut until = |offset, len| {
            stopped = !visit(offset, len);
            !stopped
        };
        let mut visit: &mut dyn FnMut(u64, u64) -> bool = &mut until;
        let arg = ptr::addr_of_mut!(visit).cast::<c_void>();
        let from = from.map_or(ptr::null(), CStr::as_ptr);
        // SAFETY: an open image; `from` is null or a C string alive for the call; `arg`
        // points at `visit`, which outlives the call and is only used by `callback` (which
        // takes it as that type: `on_extent`, `on_change`) during it.
        let ret = unsafe {
            let whole = u8::from(whole_object);
            (api.rbd_diff_iterate2)(self.raw, from, offset, len, 1, whole, callback, arg)
        };
        if stopped && ret == -libc::ECANCELED {
            return Ok(());
        }
        io_result(ret as isize).map(drop)
    }
}

/// One snapshot of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub id: u64,
    pub name: String,
}

impl Image {
    /// The image's snapshots, oldest first (by id).
    pub fn snapshots(&self) -> io::Result<Vec<Snapshot>> {
        let api = self.api;
        let mut room: c_int = 16;
        loop {
            let cap = usize::try_from(room).unwrap_or(0).clamp(1, SNAPSHOTS_MAX);
            let mut infos: Vec<SnapInfo> = (0..cap)
                .map(|_| SnapInfo {
                    id: 0,
                    size: 0,
                    name: ptr::null(),
                })
                .collect();
            let mut max = cap as c_int;
            // SAFETY: an open image; `infos` has room for `max` entries, which librbd
            // fills (names it allocates, freed by `rbd_snap_list_end` below).
            let ret = unsafe { (api.rbd_snap_list)(self.raw, infos.as_mut_ptr(), &mut max) };
            if ret == -libc::ERANGE {
                if cap >= SNAPSHOTS_MAX || max as usize <= cap {
                    return Err(io::Error::other(format!(
                        "more than {SNAPSHOTS_MAX} snapshots (SNAPSHOTS_MAX)"
                    )));
                }
                room = max;
                continue;
            }
            let count = io_result(ret as isize)?.min(cap);
            let snaps = infos[..count]
                .iter()
                .map(|info| Snapshot {
                    id: info.id,
                    // SAFETY: librbd set a NUL-terminated name for each listed entry, valid
                    // until `rbd_snap_list_end`.
                    name: unsafe { CStr::from_ptr(info.name) }
                        .to_string_lossy()
                        .into_owned(),
                })
                .collect::<Vec<_>>();
            // SAFETY: the list `rbd_snap_list` filled, released once.
            unsafe { (api.rbd_snap_list_end)(infos.as_mut_ptr()) };
            let mut snaps = snaps;
            snaps.sort_by_key(|s| s.id);
            return Ok(snaps);
        }
    }

    /// Calls `visit(offset, len)` for each extent of `[offset, offset+len)` that changed
    /// since snapshot `snap` (written, discarded or zeroed), until it returns false. Blocks:
    /// call it off the engine.
    pub fn changed_since(
        &self,
        snap: &str,
        offset: u64,
        len: u64,
        visit: impl FnMut(u64, u64) -> bool,
    ) -> io::Result<()> {
        let snap = cstring("snapshot", snap).map_err(|e| io::Error::other(e.to_string()))?;
        self.diff_iterate(Some(&snap), offset, len, false, on_change, visit)
    }
}

/// `rbd_diff_iterate2`'s callback for [`Image::changed_since`]: every extent reported is a
/// change, whether it exists now or was discarded.
extern "C" fn on_change(offset: u64, len: usize, _exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `&mut dyn FnMut` that `Image::changed_since` passes, alive for
    // the whole of its `rbd_diff_iterate2` call, which is when librbd calls this.
    let visit = unsafe { &mut *arg.cast::<&mut dyn FnMut(u64, u64) -> bool>() };
    match catch_unwind(AssertUnwindSafe(|| visit(offset, len as u64))) {
        Ok(true) => 0,
        Ok(false) => -libc::ECANCELED,
        Err(_) => -libc::EIO,
    }
}

fn whole(done: usize, want: usize) -> io::Result<()> {
    if done == want {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("librbd moved {done} of {want} bytes"),
        ))
    }
}
