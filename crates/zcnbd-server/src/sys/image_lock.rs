//! QEMU's image locks, so that zcnbd and a running QEMU (or qemu-nbd, qemu-img) refuse each
//! other's conflicting use of one image file (QEMU's `block/file-posix.c`).
//!
//! QEMU takes shared open-file-description locks (`F_OFD_SETLK`, `F_RDLCK`) on single bytes:
//! byte 100+i for each permission i it holds, 200+i for each it does not share with others
//! (i: 0 consistent read, 1 write, 2 write-unchanged, 3 resize). Before it takes them it
//! tests the opposite bytes with `F_OFD_GETLK` and `F_WRLCK`: a holder of a permission it
//! will not share (byte 100+i held by another), or someone who will not share a permission
//! it wants (byte 200+i). Locks of one open file description never conflict with each
//! other, and go away when it is closed.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// The byte of the first "holds permission" lock.
const PERM_BASE: i64 = 100;
/// The byte of the first "does not share permission" lock.
const SHARED_BASE: i64 = 200;
/// QEMU's permissions, as bits (`BLK_PERM_*`).
const CONSISTENT_READ: u8 = 1 << 0;
const WRITE: u8 = 1 << 1;
const RESIZE: u8 = 1 << 3;
/// Every permission QEMU locks for.
const PERMS_ALL: u8 = 0x0f;

/// How an image file is used, as QEMU would lock it for that use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockUse {
    /// The image served read-write: nobody else may write or resize it (QEMU: holds
    /// consistent read, write and resize; shares neither write nor resize).
    ReadWrite,
    /// The image served read-only: others may read, nobody may write or resize.
    ReadOnly,
    /// Read-only, sharing everything (`--force-share`, qemu-img's `-U`): nothing is
    /// refused, and others are warned only by the read lock.
    ForceShare,
    /// A backing file: as read-only. (QEMU shares everything on a raw file under a qcow2
    /// backing; zcnbd refuses writers to any backing file, which would change the disk under
    /// the image.)
    BackingImage,
}

impl LockUse {
    /// (permissions held, permissions shared).
    fn perms(self) -> (u8, u8) {
        match self {
            LockUse::ReadWrite => (
                CONSISTENT_READ | WRITE | RESIZE,
                PERMS_ALL & !(WRITE | RESIZE),
            ),
            LockUse::ReadOnly | LockUse::BackingImage => {
                (CONSISTENT_READ, PERMS_ALL & !(WRITE | RESIZE))
            }
            LockUse::ForceShare => (CONSISTENT_READ, PERMS_ALL),
        }
    }
}

/// Why an image could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Someone holds a permission this use cannot share, or refuses one it needs (QEMU's
    /// words, so that users of both recognise it).
    #[error("failed to get {what} lock (byte {byte}): is another process using the image?")]
    Conflict { what: &'static str, byte: i64 },
    /// The file system refused the locking calls.
    #[error("cannot lock the image: {0}")]
    Io(#[from] io::Error),
}

/// How many times a conflict is asked again, [`LOCK_RETRY_WAIT`] apart, before it is
/// reported. The locks belong to an open file description, and a child this process forks
/// (a test's tool, `--run`'s command) holds a copy of every descriptor it inherited until its
/// `exec` closes them: an image's read-only look, closed just before the real open, may
/// still hold its locks in such a child for a moment.
pub const LOCK_CONFLICT_RETRIES: u32 = 5;
/// The wait between two asks (see [`LOCK_CONFLICT_RETRIES`]).
pub const LOCK_RETRY_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// Locks `file` for `how`, after checking that nobody holds locks that conflict (asked again
/// a few times before a conflict is reported: [`LOCK_CONFLICT_RETRIES`]); the locks last as
/// long as `file` is open.
pub fn lock(file: &File, how: LockUse) -> Result<(), LockError> {
    let mut tries = 0;
    loop {
        match lock_once(file, how) {
            Err(LockError::Conflict { .. }) if tries < LOCK_CONFLICT_RETRIES => {
                tries += 1;
                std::thread::sleep(LOCK_RETRY_WAIT);
            }
            other => return other,
        }
    }
}

fn lock_once(file: &File, how: LockUse) -> Result<(), LockError> {
    let (held, shared) = how.perms();
    for i in 0..4 {
        let bit = 1u8 << i;
        // Someone refuses to share a permission we want.
        if held & bit != 0 && is_locked(file, SHARED_BASE + i)? {
            return Err(LockError::Conflict {
                what: perm_name(bit, false),
                byte: SHARED_BASE + i,
            });
        }
        // Someone holds a permission we refuse to share.
        if shared & bit == 0 && is_locked(file, PERM_BASE + i)? {
            return Err(LockError::Conflict {
                what: perm_name(bit, true),
                byte: PERM_BASE + i,
            });
        }
    }
    for i in 0..4 {
        let bit = 1u8 << i;
        if held & bit != 0 {
            read_lock(file, PERM_BASE + i)?;
        }
        if shared & bit == 0 {
            read_lock(file, SHARED_BASE + i)?;
        }
    }
    Ok(())
}

/// QEMU's name for the lock a conflict is about.
fn perm_name(bit: u8, shared: bool) -> &'static str {
    match (bit, shared) {
        (CONSISTENT_READ, false) => "\"consistent read\"",
        (CONSISTENT_READ, true) => "shared \"consistent read\"",
        (WRITE, false) => "\"write\"",
        (WRITE, true) => "shared \"write\"",
        (RESIZE, false) => "\"resize\"",
        (RESIZE, true) => "shared \"resize\"",
        (_, false) => "\"write unchanged\"",
        (_, true) => "shared \"write unchanged\"",
    }
}

fn flock_at(byte: i64, kind: libc::c_short) -> libc::flock {
    // SAFETY: `flock` is plain data for which all-zero bytes are a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    fl
}

/// Takes a shared lock on `byte`.
fn read_lock(file: &File, byte: i64) -> io::Result<()> {
    let fl = flock_at(byte, libc::F_RDLCK as libc::c_short);
    // SAFETY: `fl` is a valid `flock` that outlives the call; the descriptor is open.
    let r = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_OFD_SETLK,
            &fl as *const libc::flock,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether another open file description holds any lock on `byte`.
fn is_locked(file: &File, byte: i64) -> io::Result<bool> {
    let mut fl = flock_at(byte, libc::F_WRLCK as libc::c_short);
    // SAFETY: `fl` is a valid `flock` the kernel fills in; the descriptor is open.
    let r = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_OFD_GETLK,
            &mut fl as *mut libc::flock,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn writers_exclude_each_other_and_readers_but_force_share_passes() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let (a, b, c) = (open(f.path()), open(f.path()), open(f.path()));
        lock(&a, LockUse::ReadWrite).unwrap();
        assert!(matches!(
            lock(&b, LockUse::ReadWrite),
            Err(LockError::Conflict { byte: 201, .. })
        ));
        assert!(matches!(
            lock(&b, LockUse::ReadOnly),
            Err(LockError::Conflict { byte: 101, .. })
        ));
        lock(&c, LockUse::ForceShare).unwrap();
        drop(a);
        lock(&b, LockUse::ReadOnly).unwrap();
        // A reader refuses writers, not other readers.
        assert!(lock(&open(f.path()), LockUse::ReadWrite).is_err());
        lock(&open(f.path()), LockUse::ReadOnly).unwrap();
    }
}
