//! The retry layer (`--filter retry`, nbdkit-retry-filter): a request the stack below fails
//! is tried again after a wait, with the source reopened first (an NBD upstream's
//! connection made anew), so that a flaky network or a restarting server costs the client
//! a pause rather than an error. Options: `retries` (attempts after the first; default 5,
//! at most [`RETRIES_MAX`]), `retry-delay` (the first wait; default 2s), `retry-exponential`
//! (each wait twice the last, up to [`RETRY_WAIT_MAX`]; default yes), `retry-writes` (default no).
//!
//! Reads, block status and cache requests are retried; writes, trims, zeroes and flushes
//! only with `retry-writes=yes`, because repeating one is not always safe: a write that
//! failed may have landed, and a flush that failed may have lost what it was to keep (an
//! upstream that crashed forgot its unflushed writes, and a new connection's flush cannot
//! bring them back). A request the source refused for what it asked (`EINVAL`, `ENOSPC`,
//! `EPERM`, `EROFS`, `EOPNOTSUPP`, `EOVERFLOW`) is not retried: asking again would get the
//! same answer.

use std::io;
use std::time::Duration;

use zcnbd_proto::Extent;

use super::options::Options;
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// The most retries a request may have.
pub const RETRIES_MAX: u64 = 1000;
/// The longest wait between two tries, however many doublings came before.
pub const RETRY_WAIT_MAX: Duration = Duration::from_secs(60);

/// When and how often to try again.
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    retries: u64,
    delay: Duration,
    exponential: bool,
    writes: bool,
}

/// Errors that say the request itself is wrong, or the export cannot do it: trying again
/// would fail the same way.
fn is_final(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::ENOSPC | libc::EPERM | libc::EROFS | libc::EOPNOTSUPP)
            | Some(libc::EOVERFLOW)
    )
}

impl Retry {
    /// The layer `options` describe.
    pub fn from_options(mut o: Options<'_>) -> Result<Retry, String> {
        let retry = Retry {
            retries: o.count("retries", 0, RETRIES_MAX)?.unwrap_or(5),
            delay: o.duration("retry-delay")?.unwrap_or(Duration::from_secs(2)),
            exponential: o.boolean("retry-exponential")?.unwrap_or(true),
            writes: o.boolean("retry-writes")?.unwrap_or(false),
        };
        o.finish()?;
        Ok(retry)
    }

    /// Runs `op` against `next`, again after each failure (the source reopened after the
    /// wait) while retries are left and the failure may pass.
    fn attempt<T>(
        &self,
        next: &dyn Backend,
        what: &'static str,
        retried: bool,
        mut op: impl FnMut() -> Result<T, ZeroError>,
    ) -> Result<T, ZeroError> {
        let mut wait = self.delay.min(RETRY_WAIT_MAX);
        let mut tries = 0;
        loop {
            let e = match op() {
                Ok(done) => {
                    if tries > 0 {
                        tracing::info!(what, tries, "succeeded after retrying");
                    }
                    return Ok(done);
                }
                Err(ZeroError::Io(e)) if retried && tries < self.retries && !is_final(&e) => e,
                Err(other) => return Err(other),
            };
            tries += 1;
            tracing::warn!(what, error = %e, attempt = tries, of = self.retries,
                wait_ms = wait.as_millis() as u64, "failed: retrying after a wait");
            std::thread::sleep(wait);
            if self.exponential {
                wait = wait.saturating_mul(2).min(RETRY_WAIT_MAX);
            }
            if let Err(e) = next.reopen() {
                tracing::warn!(what, error = %e, "could not reopen the source");
            }
        }
    }

    fn io<T>(
        &self,
        next: &dyn Backend,
        what: &'static str,
        retried: bool,
        mut op: impl FnMut() -> io::Result<T>,
    ) -> io::Result<T> {
        self.attempt(next, what, retried, || op().map_err(ZeroError::Io))
            .map_err(|e| match e {
                ZeroError::Io(e) => e,
                ZeroError::NotFast => io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            })
    }
}

impl Layer for Retry {
    fn name(&self) -> &'static str {
        "retry"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.io(next, "read", true, || next.pread(buf, offset))
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.io(next, "write", self.writes, || next.pwrite(buf, offset, fua))
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        self.io(next, "flush", self.writes, || next.flush())
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.io(next, "trim", self.writes, || next.trim(offset, len, fua))
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        self.attempt(next, "zero", self.writes, || next.zero(offset, len, flags))
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        self.io(next, "cache", true, || next.cache(offset, len))
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        let start = out.len();
        self.io(next, "block status", true, || {
            out.truncate(start);
            next.extents(offset, len, extents_max, out)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::layers::test_disk::TestDisk;
    use crate::export::Layered;

    fn retry(entry: &str) -> Result<Retry, String> {
        let (_, options) = split(entry).unwrap();
        Retry::from_options(options)
    }

    /// A memory disk whose next `fails` requests fail with `errno`, counting reopens.
    fn flaky(fails: u32, errno: i32) -> Arc<TestDisk> {
        let mut disk = TestDisk::new(1 << 20);
        disk.fails = AtomicU32::new(fails);
        disk.errno = errno;
        disk.shared()
    }

    #[test]
    fn options_have_nbdkits_names_and_defaults() {
        let r = retry("retry").unwrap();
        assert_eq!(
            (r.retries, r.delay, r.exponential, r.writes),
            (5, Duration::from_secs(2), true, false)
        );
        let r = retry("retry:retries=2,retry-delay=10ms,retry-exponential=no,retry-writes=yes")
            .unwrap();
        assert_eq!(
            (r.retries, r.delay, r.exponential, r.writes),
            (2, Duration::from_millis(10), false, true)
        );
        assert!(retry("retry:retries=1001").is_err());
        assert!(retry("retry:retry-readonly=yes")
            .unwrap_err()
            .contains("retry-writes"));
    }

    #[test]
    fn reads_are_retried_after_a_reopen_with_growing_waits() {
        let below = flaky(3, libc::EIO);
        let layer = retry("retry:retries=3,retry-delay=10ms").unwrap();
        let stack = Layered::new(Arc::new(layer), below.clone() as Arc<dyn Backend>);
        let start = Instant::now();
        let mut buf = [1u8; 512];
        stack.pread(&mut buf, 0).unwrap();
        // Waits of 10, 20 and 40 ms.
        assert!(
            start.elapsed() >= Duration::from_millis(70),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(buf, [0u8; 512]);
        assert_eq!(below.reopened.load(Ordering::SeqCst), 3);
        let mut extents = Vec::new();
        below.fails.store(1, Ordering::SeqCst);
        stack.extents(0, 4096, 8, &mut extents).unwrap();
        assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 4096);
    }

    #[test]
    fn too_many_failures_fail_and_final_errors_are_not_retried() {
        let below = flaky(3, libc::EIO);
        let layer = retry("retry:retries=2,retry-delay=1ms").unwrap();
        let stack = Layered::new(Arc::new(layer), below.clone() as Arc<dyn Backend>);
        let mut buf = [0u8; 512];
        let e = stack.pread(&mut buf, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert_eq!(below.fails.load(Ordering::SeqCst), 0);

        let below = flaky(1, libc::EINVAL);
        let layer = retry("retry:retry-delay=1ms").unwrap();
        let stack = Layered::new(Arc::new(layer), below.clone() as Arc<dyn Backend>);
        assert_eq!(
            stack.pread(&mut buf, 0).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        assert_eq!(below.reopened.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn writes_and_flushes_are_retried_only_when_asked() {
        let below = flaky(1, libc::EIO);
        let layer = retry("retry:retry-delay=1ms").unwrap();
        let stack = Layered::new(Arc::new(layer), below.clone() as Arc<dyn Backend>);
        assert!(stack.pwrite(&[7; 512], 0, false).is_err());
        below.fails.store(1, Ordering::SeqCst);
        assert!(stack.flush().is_err());

        let below = flaky(1, libc::EIO);
        let layer = retry("retry:retry-delay=1ms,retry-writes=yes").unwrap();
        let stack = Layered::new(Arc::new(layer), below.clone() as Arc<dyn Backend>);
        stack.pwrite(&[7; 512], 0, false).unwrap();
        below.fails.store(1, Ordering::SeqCst);
        stack.flush().unwrap();
        let mut buf = [0u8; 512];
        stack.pread(&mut buf, 0).unwrap();
        assert_eq!(buf, [7u8; 512]);
    }
}
