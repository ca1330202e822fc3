//! The C ABI of the zcnbd client (`include/zcnbd.h` documents every call and the threading
//! rules). Each function checks its pointers, turns panics into errors, and maps errors to
//! `-errno` with a thread-local message for `zcnbd_last_error`.
//!
//! This crate is nothing but the boundary with C, so it is all `unsafe` at the edges: each
//! block says which of the header's documented caller duties makes it sound.
#![allow(non_camel_case_types)]

mod meta;

pub use meta::{zcnbd_block_status, zcnbd_connect_meta, zcnbd_extent, zcnbd_has_meta_context};

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use zcnbd_client::{Client, ClientOptions, Completer, Error, WriteFlags, ZeroFlags};

/// `ZCNBD_FUA`: the write is durable before it completes.
pub const ZCNBD_FUA: u32 = 1;
/// `ZCNBD_NO_HOLE`: zeroing keeps the range allocated.
pub const ZCNBD_NO_HOLE: u32 = 2;
/// `ZCNBD_FAST_ZERO`: zeroing fails with `-ENOTSUP` unless it is fast.
pub const ZCNBD_FAST_ZERO: u32 = 4;

/// The opaque handle C holds.
pub struct zcnbd {
    pub(crate) client: Client,
}

/// A completion callback: the handle, bytes done or `-errno`, the caller's pointer.
pub type zcnbd_cb = Option<unsafe extern "C" fn(h: *mut zcnbd, ret: isize, opaque: *mut c_void)>;

/// Counters, as `struct zcnbd_stats` in the header.
#[repr(C)]
pub struct zcnbd_stats {
    pub requests: u64,
    pub received_in_place_bytes: u64,
    pub zeroed_bytes: u64,
    pub written_bytes: u64,
    pub copied_bytes: u64,
    pub syscalls: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// Records `e` and returns `-errno`.
pub(crate) fn fail(e: &Error) -> c_int {
    set_error(&e.to_string());
    -e.errno()
}

/// Sets the calling thread's C `errno` (positive), as `zcnbd_connect` does on failure.
fn set_errno(code: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno, valid for the thread's
    // life; writing an int there is what C's `errno = code` does.
    unsafe { *libc::__errno_location() = code };
}

pub(crate) fn invalid(message: &str) -> c_int {
    set_error(message);
    -libc::EINVAL
}

/// Runs `f`, turning a panic into `-EIO` (a panic must not unwind into C).
pub(crate) fn guarded<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_error("internal error (panic) in libzcnbd");
        on_panic
    })
}

/// The handle behind `h`, or `None` for NULL.
///
/// # Safety
/// `h` is NULL or a live handle from `zcnbd_connect` (the header's rule).
pub(crate) unsafe fn handle<'a>(h: *mut zcnbd) -> Option<&'a zcnbd> {
    // SAFETY: the caller guarantees `h` is NULL or live; `as_ref` handles NULL.
    unsafe { h.as_ref() }
}

/// The iovec array as `(pointer, length)` pairs.
///
/// # Safety
/// `iov` points to `iovcnt` readable `struct iovec`s (or `iovcnt` is 0).
unsafe fn pieces(iov: *const libc::iovec, iovcnt: c_int) -> Result<Vec<(*mut u8, usize)>, c_int> {
    if iovcnt < 0 || (iovcnt > 0 && iov.is_null()) {
        return Err(invalid("bad iovec array"));
    }
    if iovcnt == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: non-NULL and `iovcnt` elements long, by the caller's duty.
    let iov = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
    Ok(iov
        .iter()
        .map(|v| (v.iov_base.cast::<u8>(), v.iov_len))
        .collect())
}

/// A C callback with its arguments, sent to whichever thread completes the request.
struct CCallback {
    cb: zcnbd_cb,
    h: *mut zcnbd,
    opaque: *mut c_void,
}

// SAFETY: the header makes callbacks run in the thread that calls zcnbd_poll or a blocking
// call, and says opaque must be usable from there; the handle is thread-safe.
unsafe impl Send for CCallback {}

impl CCallback {
    fn into_completer(self) -> Completer {
        Box::new(move |result| {
            let this = self;
            let ret = match result {
                Ok(done) => done.bytes as isize,
                Err(e) => {
                    set_error(&e.to_string());
                    -(e.errno() as isize)
                }
            };
            if let Some(cb) = this.cb {
                // SAFETY: the callback and its arguments are what the C caller registered;
                // `h` stays valid until zcnbd_close returns, which runs the last callbacks.
                unsafe { cb(this.h, ret, this.opaque) };
            }
        })
    }
}

/// Connects to `uri` with up to `connections` connections; NULL on error, with `errno` set
/// and a message for `zcnbd_last_error`.
///
/// # Safety
/// `uri` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_connect(uri: *const c_char, connections: c_int) -> *mut zcnbd {
    // SAFETY: forwarded duty; no context list to read.
    unsafe { connect_with(uri, connections, |_| Ok(())) }
}

/// Connects as `zcnbd_connect` does, with the options `configure` adjusts (it returns
/// `-errno` to refuse); NULL on error, with `errno` set and a message.
///
/// # Safety
/// `uri` is NULL or a NUL-terminated string.
pub(crate) unsafe fn connect_with(
    uri: *const c_char,
    connections: c_int,
    configure: impl FnOnce(&mut ClientOptions) -> Result<(), c_int>,
) -> *mut zcnbd {
    // What errno says if the call fails: EIO unless a failure below says better (a panic).
    let mut errno = libc::EIO;
    let h = guarded(std::ptr::null_mut(), || {
        if uri.is_null() {
            errno = -invalid("uri is NULL");
            return std::ptr::null_mut();
        }
        // SAFETY: non-NULL and NUL-terminated by the caller's duty.
        let uri = unsafe { CStr::from_ptr(uri) };
        let Ok(uri) = uri.to_str() else {
            errno = -invalid("uri is not UTF-8");
            return std::ptr::null_mut();
        };
        let mut options = ClientOptions {
            connections: connections.max(1) as usize,
            ..ClientOptions::default()
        };
        if let Err(e) = configure(&mut options) {
            errno = -e;
            return std::ptr::null_mut();
        }
        match Client::connect_with(uri, &options) {
            Ok(client) => Box::into_raw(Box::new(zcnbd { client })),
            Err(e) => {
                errno = -fail(&e);
                std::ptr::null_mut()
            }
        }
    });
    if h.is_null() {
        set_errno(errno);
    }
    h
}

/// The calling thread's last error message.
#[no_mangle]
pub extern "C" fn zcnbd_last_error() -> *const c_char {
    // The pointer stays valid until this thread's next failing call replaces the string.
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The export's size, or `-errno`.
///
/// # Safety
/// `h` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_size(h: *mut zcnbd) -> i64 {
    // SAFETY: forwarded duty.
    match unsafe { handle(h) } {
        Some(h) => h.client.size() as i64,
        None => i64::from(invalid("handle is NULL")),
    }
}

/// Connections in use, or `-errno`.
///
/// # Safety
/// `h` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_connections(h: *mut zcnbd) -> c_int {
    // SAFETY: forwarded duty.
    match unsafe { handle(h) } {
        Some(h) => h.client.connections() as c_int,
        None => invalid("handle is NULL"),
    }
}

/// Fills `out` with the counters; 0 or `-errno`.
///
/// # Safety
/// `h` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_get_stats(h: *mut zcnbd, out: *mut zcnbd_stats) -> c_int {
    // SAFETY: forwarded duty.
    let Some(h) = (unsafe { handle(h) }) else {
        return invalid("handle is NULL");
    };
    if out.is_null() {
        return invalid("stats pointer is NULL");
    }
    let s = h.client.stats();
    let stats = zcnbd_stats {
        requests: s.requests,
        received_in_place_bytes: s.received_in_place_bytes,
        zeroed_bytes: s.zeroed_bytes,
        written_bytes: s.written_bytes,
        copied_bytes: s.copied_bytes,
        syscalls: s.syscalls,
    };
    // SAFETY: non-NULL and writable by the caller's duty.
    unsafe { out.write(stats) };
    0
}

fn write_flags(flags: u32) -> Result<WriteFlags, c_int> {
    if flags & !ZCNBD_FUA != 0 {
        return Err(invalid("unknown write flags"));
    }
    Ok(WriteFlags {
        fua: flags & ZCNBD_FUA != 0,
    })
}

/// Holds the handle's submissions back until as many `zcnbd_unplug` calls: requests
/// submitted meanwhile leave together, in one socket call. 0 or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_plug(h: *mut zcnbd) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        handle.client.hold();
        0
    })
}

/// Ends one `zcnbd_plug`; the last sends what was held back. 0, or `-EINVAL` if the
/// handle was not plugged.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_unplug(h: *mut zcnbd) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        match handle.client.release() {
            true => 0,
            false => invalid("zcnbd_unplug without zcnbd_plug"),
        }
    })
}

/// Starts a read into `iov`; `cb` runs when it finishes. 0 or `-errno`.
///
/// # Safety
/// `h` live; `iov` holds `iovcnt` iovecs whose memory stays valid and untouched until `cb`.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_preadv_async(
    h: *mut zcnbd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: u64,
    cb: zcnbd_cb,
    opaque: *mut c_void,
) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        // SAFETY: forwarded duty.
        let pieces = match unsafe { pieces(iov, iovcnt) } {
            Ok(p) => p,
            Err(e) => return e,
        };
        let completer = CCallback { cb, h, opaque }.into_completer();
        // SAFETY: the caller keeps the memory valid and untouched until `cb` runs.
        match unsafe { handle.client.submit_read_raw(&pieces, offset, completer) } {
            Ok(()) => 0,
            Err(e) => fail(&e),
        }
    })
}

/// Starts a write of `iov`; `cb` runs when the server has answered. 0 or `-errno`.
///
/// # Safety
/// As `zcnbd_preadv_async`; the memory is only read.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_pwritev_async(
    h: *mut zcnbd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: u64,
    flags: u32,
    cb: zcnbd_cb,
    opaque: *mut c_void,
) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        // SAFETY: forwarded duty.
        let pieces = match unsafe { pieces(iov, iovcnt) } {
            Ok(p) => p,
            Err(e) => return e,
        };
        let flags = match write_flags(flags) {
            Ok(f) => f,
            Err(e) => return e,
        };
        let pieces: Vec<(*const u8, usize)> =
            pieces.iter().map(|&(p, n)| (p.cast_const(), n)).collect();
        let completer = CCallback { cb, h, opaque }.into_completer();
        // SAFETY: the caller keeps the memory valid and unwritten until `cb` runs.
        match unsafe {
            handle
                .client
                .submit_write_raw(&pieces, offset, flags, completer)
        } {
            Ok(()) => 0,
            Err(e) => fail(&e),
        }
    })
}

/// Starts a flush. 0 or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_flush_async(
    h: *mut zcnbd,
    cb: zcnbd_cb,
    opaque: *mut c_void,
) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        let completer = CCallback { cb, h, opaque }.into_completer();
        match handle.client.submit_flush_with(completer) {
            Ok(()) => 0,
            Err(e) => fail(&e),
        }
    })
}

/// Reads into `iov`, waiting; bytes read or `-errno`.
///
/// # Safety
/// `h` live; `iov` holds `iovcnt` writable iovecs.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_preadv(
    h: *mut zcnbd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: u64,
) -> isize {
    guarded(-libc::EIO as isize, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL") as isize;
        };
        // SAFETY: forwarded duty.
        let pieces = match unsafe { pieces(iov, iovcnt) } {
            Ok(p) => p,
            Err(e) => return e as isize,
        };
        let mut bufs: Vec<IoSliceMut<'_>> = pieces
            .iter()
            .filter(|&&(_, n)| n > 0)
            // SAFETY: each iovec is writable for its length (caller's duty), and the slices
            // live only during this blocking call.
            .map(|&(p, n)| IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(p, n) }))
            .collect();
        match handle.client.read_vectored_at(&mut bufs, offset) {
            Ok(n) => n as isize,
            Err(e) => fail(&e) as isize,
        }
    })
}

/// Writes `iov`, waiting; bytes written or `-errno`.
///
/// # Safety
/// `h` live; `iov` holds `iovcnt` readable iovecs.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_pwritev(
    h: *mut zcnbd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: u64,
    flags: u32,
) -> isize {
    guarded(-libc::EIO as isize, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL") as isize;
        };
        // SAFETY: forwarded duty.
        let pieces = match unsafe { pieces(iov, iovcnt) } {
            Ok(p) => p,
            Err(e) => return e as isize,
        };
        let flags = match write_flags(flags) {
            Ok(f) => f,
            Err(e) => return e as isize,
        };
        let bufs: Vec<IoSlice<'_>> = pieces
            .iter()
            .filter(|&&(_, n)| n > 0)
            // SAFETY: each iovec is readable for its length (caller's duty).
            .map(|&(p, n)| IoSlice::new(unsafe { std::slice::from_raw_parts(p, n) }))
            .collect();
        match handle.client.write_vectored_at(&bufs, offset, flags) {
            Ok(n) => n as isize,
            Err(e) => fail(&e) as isize,
        }
    })
}

/// Runs `op` on the handle: 0 or `-errno`.
///
/// # Safety
/// `h` is NULL or live.
unsafe fn simple(h: *mut zcnbd, op: impl FnOnce(&Client) -> zcnbd_client::Result<()>) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        match op(&handle.client) {
            Ok(()) => 0,
            Err(e) => fail(&e),
        }
    })
}

/// Flushes, waiting. 0 or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_flush(h: *mut zcnbd) -> c_int {
    // SAFETY: forwarded duty.
    unsafe { simple(h, |c| c.flush()) }
}

/// Trims, waiting. 0 or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_trim(h: *mut zcnbd, offset: u64, len: u64, flags: u32) -> c_int {
    let flags = match write_flags(flags) {
        Ok(f) => f,
        Err(e) => return e,
    };
    // SAFETY: forwarded duty.
    unsafe { simple(h, |c| c.trim(offset, len, flags)) }
}

/// Writes zeroes, waiting. 0 or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_zero(h: *mut zcnbd, offset: u64, len: u64, flags: u32) -> c_int {
    if flags & !(ZCNBD_FUA | ZCNBD_NO_HOLE | ZCNBD_FAST_ZERO) != 0 {
        return invalid("unknown zero flags");
    }
    let flags = ZeroFlags {
        fua: flags & ZCNBD_FUA != 0,
        no_hole: flags & ZCNBD_NO_HOLE != 0,
        fast: flags & ZCNBD_FAST_ZERO != 0,
    };
    // SAFETY: forwarded duty.
    unsafe { simple(h, |c| c.write_zeroes(offset, len, flags)) }
}

/// A descriptor that turns readable when `zcnbd_poll` has work, or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_fd(h: *mut zcnbd) -> c_int {
    // SAFETY: forwarded duty.
    match unsafe { handle(h) } {
        Some(h) => h.client.event_fd().as_raw_fd(),
        None => invalid("handle is NULL"),
    }
}

/// Runs callbacks of finished requests, waiting up to `timeout_ms` (-1: until one finishes
/// or nothing is in flight; 0: not at all). Returns how many ran, or `-errno`.
///
/// # Safety
/// `h` live.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_poll(h: *mut zcnbd, timeout_ms: c_int) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        let timeout = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
        handle.client.poll(timeout).min(c_int::MAX as usize) as c_int
    })
}

/// Closes the handle: requests in flight fail with `-ESHUTDOWN` (their callbacks run here).
///
/// # Safety
/// `h` is NULL or live, and no other thread uses it any more.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_close(h: *mut zcnbd) {
    if h.is_null() {
        return;
    }
    guarded((), || {
        // SAFETY: live and no longer shared (caller's duty); callbacks run by `close` may
        // still see `h`, which is freed only after.
        let handle = unsafe { &*h };
        handle.client.close();
        // SAFETY: allocated by `zcnbd_connect` with Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(h) });
    })
}
