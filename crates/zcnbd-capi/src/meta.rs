//! Metadata contexts through the C ABI: connecting with a list of contexts, asking whether
//! one was selected, and block status for a named context into the caller's array
//! (`include/zcnbd.h`).

use std::ffi::{c_char, c_int, CStr};

use zcnbd_client::{ClientOptions, Extent, META_CONTEXT_QUERIES_MAX};

use crate::{connect_with, fail, guarded, handle, invalid, zcnbd};

/// One extent, as `struct zcnbd_extent` in the header (libnbd's `nbd_extent` layout).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct zcnbd_extent {
    /// Bytes the status applies to.
    pub length: u64,
    /// The status flags, as the context defines them.
    pub flags: u64,
}

/// A context name from C: non-NULL, NUL-terminated UTF-8.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
unsafe fn context_name<'a>(name: *const c_char) -> Result<&'a str, c_int> {
    if name.is_null() {
        return Err(invalid("metadata context name is NULL"));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's duty.
    let name = unsafe { CStr::from_ptr(name) };
    name.to_str()
        .map_err(|_| invalid("metadata context name is not UTF-8"))
}

/// The `ncontexts` names at `contexts`, at most `ZCNBD_META_CONTEXTS_MAX` of them.
///
/// # Safety
/// `contexts` points to `ncontexts` pointers, each NULL or a NUL-terminated string (or
/// `ncontexts` is 0).
unsafe fn context_list(
    contexts: *const *const c_char,
    ncontexts: usize,
) -> Result<Vec<String>, c_int> {
    // Checked before the array is read, so a wild count is never walked.
    if ncontexts > META_CONTEXT_QUERIES_MAX {
        return Err(invalid(
            "more than ZCNBD_META_CONTEXTS_MAX metadata contexts",
        ));
    }
    if ncontexts == 0 {
        return Ok(Vec::new());
    }
    if contexts.is_null() {
        return Err(invalid("metadata context list is NULL"));
    }
    // SAFETY: non-NULL and `ncontexts` pointers long, by the caller's duty.
    let pointers = unsafe { std::slice::from_raw_parts(contexts, ncontexts) };
    pointers
        .iter()
        // SAFETY: each pointer is NULL (refused) or NUL-terminated, by the caller's duty.
        .map(|&p| unsafe { context_name(p) }.map(str::to_owned))
        .collect()
}

/// Connects to `uri` as `zcnbd_connect` does, asking for exactly the `ncontexts` metadata
/// contexts at `contexts` (list `base:allocation` too if wanted); NULL on error, with `errno`
/// set. A context the server does not have is no error: ask with `zcnbd_has_meta_context`.
///
/// # Safety
/// `uri` is a NUL-terminated string; `contexts` points to `ncontexts` NUL-terminated strings
/// (or `ncontexts` is 0).
#[no_mangle]
pub unsafe extern "C" fn zcnbd_connect_meta(
    uri: *const c_char,
    connections: c_int,
    contexts: *const *const c_char,
    ncontexts: usize,
) -> *mut zcnbd {
    let configure = |options: &mut ClientOptions| {
        // SAFETY: forwarded duty.
        options.meta_contexts = unsafe { context_list(contexts, ncontexts) }?;
        options.base_allocation = false;
        Ok(())
    };
    // SAFETY: forwarded duty.
    unsafe { connect_with(uri, connections, configure) }
}

/// 1 if the server selected metadata context `name`, 0 if not, or `-errno`.
///
/// # Safety
/// `h` is NULL or a live handle; `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_has_meta_context(h: *mut zcnbd, name: *const c_char) -> c_int {
    guarded(-libc::EIO, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL");
        };
        // SAFETY: forwarded duty.
        match unsafe { context_name(name) } {
            Ok(name) => c_int::from(handle.client.has_meta_context(name)),
            Err(e) => e,
        }
    })
}

/// Block status of metadata context `context` for `len` bytes at `offset`, waiting: fills at
/// most `nr_extents` entries of `extents` (the last one cut at `offset + len`) and returns
/// how many, or `-errno`; `*covered` (if `covered` is not NULL) gets the bytes from `offset`
/// they describe.
///
/// # Safety
/// `h` is NULL or live; `context` is NULL or a NUL-terminated string; `extents` is NULL or
/// writable for `nr_extents` entries; `covered` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn zcnbd_block_status(
    h: *mut zcnbd,
    context: *const c_char,
    offset: u64,
    len: u64,
    extents: *mut zcnbd_extent,
    nr_extents: usize,
    covered: *mut u64,
) -> isize {
    guarded(-libc::EIO as isize, || {
        // SAFETY: forwarded duty.
        let Some(handle) = (unsafe { handle(h) }) else {
            return invalid("handle is NULL") as isize;
        };
        // SAFETY: forwarded duty.
        let name = match unsafe { context_name(context) } {
            Ok(name) => name,
            Err(e) => return e as isize,
        };
        if extents.is_null() || nr_extents == 0 {
            return invalid("the extent array is NULL or empty") as isize;
        }
        let found = match handle.client.block_status_of(name, offset, len) {
            Ok(found) => found,
            Err(e) => return fail(&e) as isize,
        };
        // SAFETY: non-NULL and writable for `nr_extents` entries by the caller's duty; no
        // other reference to that memory exists during this call.
        let out = unsafe { std::slice::from_raw_parts_mut(extents, nr_extents) };
        let (filled, bytes) = fill(&found, len, out);
        if !covered.is_null() {
            // SAFETY: non-NULL and writable by the caller's duty.
            unsafe { covered.write(bytes) };
        }
        filled as isize
    })
}

/// Copies `found` into `out` up to `len` bytes: (entries filled, bytes they cover).
fn fill(found: &[Extent], len: u64, out: &mut [zcnbd_extent]) -> (usize, u64) {
    let mut at = 0u64;
    let mut filled = 0;
    for (e, slot) in found.iter().zip(out.iter_mut()) {
        if at >= len {
            break;
        }
        let length = e.length.min(len - at);
        *slot = zcnbd_extent {
            length,
            flags: u64::from(e.flags),
        };
        at += length;
        filled += 1;
    }
    (filled, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(length: u64, flags: u32) -> Extent {
        Extent { length, flags }
    }

    #[test]
    fn fill_cuts_at_the_array_and_the_range() {
        let found = [extent(100, 1), extent(50, 0), extent(1000, 3)];
        let mut out = [zcnbd_extent {
            length: 0,
            flags: 0,
        }; 2];
        assert_eq!(fill(&found, 1 << 20, &mut out), (2, 150));
        assert_eq!(
            out[1],
            zcnbd_extent {
                length: 50,
                flags: 0
            }
        );
        let mut out = [zcnbd_extent {
            length: 0,
            flags: 0,
        }; 8];
        assert_eq!(fill(&found, 160, &mut out), (3, 160));
        assert_eq!(
            out[2],
            zcnbd_extent {
                length: 10,
                flags: 3
            }
        );
        assert_eq!(fill(&found, 100, &mut out), (1, 100));
        assert_eq!(fill(&[], 100, &mut out), (0, 0));
    }

    #[test]
    fn context_lists_are_checked_before_they_are_read() {
        let too_many = META_CONTEXT_QUERIES_MAX + 1;
        // SAFETY: the count is refused before the (NULL) array would be read.
        assert!(unsafe { context_list(std::ptr::null(), too_many) }.is_err());
        // SAFETY: a zero count reads nothing.
        assert_eq!(unsafe { context_list(std::ptr::null(), 0) }, Ok(Vec::new()));
        // SAFETY: a NULL array with a count is refused unread.
        assert!(unsafe { context_list(std::ptr::null(), 1) }.is_err());
        let names = [c"base:allocation".as_ptr(), std::ptr::null()];
        // SAFETY: two pointers, one a C string and one NULL (refused).
        assert!(unsafe { context_list(names.as_ptr(), 2) }.is_err());
        // SAFETY: one valid C string.
        let one = unsafe { context_list(names.as_ptr(), 1) };
        assert_eq!(one, Ok(vec!["base:allocation".to_string()]));
    }
}
