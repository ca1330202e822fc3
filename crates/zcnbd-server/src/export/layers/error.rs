//! The error layer (`--filter error`, nbdkit-error-filter): fails requests on purpose, for
//! testing how clients cope. `error=EIO` (also EPERM, ENOMEM, EINVAL, ENOSPC, ESHUTDOWN,
//! EOVERFLOW, ENOTSUP) is the errno, `error-rate=0.1` (or `10%`) the share of requests that
//! fail, `error-file=PATH` limits failing to the times PATH exists (touch it to start, remove
//! it to stop). Each kind of request can have its own: `error-pread`, `error-pread-rate`,
//! `error-pread-file`, and likewise `pwrite`, `trim`, `zero`, `extents`, `cache`, `flush`.
//! A rate of 0 (the default) fails nothing.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use zcnbd_proto::Extent;

use super::options::Options;
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// When one kind of request fails.
#[derive(Debug, Clone, PartialEq)]
struct Rule {
    errno: i32,
    rate: f64,
    file: Option<PathBuf>,
}

/// The errnos a rule may name (those nbdkit's error filter takes, and EOVERFLOW, ENOTSUP).
const ERRNOS: &[(&str, i32)] = &[
    ("EIO", libc::EIO),
    ("EPERM", libc::EPERM),
    ("ENOMEM", libc::ENOMEM),
    ("EINVAL", libc::EINVAL),
    ("ENOSPC", libc::ENOSPC),
    ("ESHUTDOWN", libc::ESHUTDOWN),
    ("EOVERFLOW", libc::EOVERFLOW),
    ("ENOTSUP", libc::ENOTSUP),
];

/// A layer that fails requests by its rules.
#[derive(Debug)]
pub struct ErrorInjection {
    pread: Rule,
    pwrite: Rule,
    trim: Rule,
    zero: Rule,
    extents: Rule,
    cache: Rule,
    flush: Rule,
    /// xorshift64 state: which requests of a rate fail.
    random: AtomicU64,
}

fn errno_named(filter: &str, text: &str) -> Result<i32, String> {
    ERRNOS
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(text))
        .map(|&(_, code)| code)
        .ok_or_else(|| {
            let names: Vec<&str> = ERRNOS.iter().map(|(n, _)| *n).collect();
            format!(
                "filter {filter}: no errno {text:?} (there are: {})",
                names.join(", ")
            )
        })
}

impl ErrorInjection {
    /// The layer `options` describe.
    pub fn from_options(mut o: Options<'_>) -> Result<ErrorInjection, String> {
        let all = Rule {
            errno: o
                .get("error")
                .map(|t| errno_named("error", t))
                .transpose()?
                .unwrap_or(libc::EIO),
            rate: o.rate("error-rate")?.unwrap_or(0.0),
            file: o.get("error-file").map(PathBuf::from),
        };
        // `error-KIND`, `error-KIND-rate`, `error-KIND-file`: each over `all`'s.
        let mut rule = |errno: &'static str, rate: &'static str, file: &'static str| {
            Ok::<Rule, String>(Rule {
                errno: match o.get(errno) {
                    Some(t) => errno_named("error", t)?,
                    None => all.errno,
                },
                rate: o.rate(rate)?.unwrap_or(all.rate),
                file: o.get(file).map(PathBuf::from).or_else(|| all.file.clone()),
            })
        };
        let layer = ErrorInjection {
            pread: rule("error-pread", "error-pread-rate", "error-pread-file")?,
            pwrite: rule("error-pwrite", "error-pwrite-rate", "error-pwrite-file")?,
            trim: rule("error-trim", "error-trim-rate", "error-trim-file")?,
            zero: rule("error-zero", "error-zero-rate", "error-zero-file")?,
            extents: rule("error-extents", "error-extents-rate", "error-extents-file")?,
            cache: rule("error-cache", "error-cache-rate", "error-cache-file")?,
            flush: rule("error-flush", "error-flush-rate", "error-flush-file")?,
            random: AtomicU64::new(seed()),
        };
        o.finish()?;
        Ok(layer)
    }

    /// A number in [0, 1), different each call.
    fn next_random(&self) -> f64 {
        let mut x = self.random.load(Ordering::Relaxed);
        loop {
            let mut y = x;
            y ^= y << 13;
            y ^= y >> 7;
            y ^= y << 17;
            match self
                .random
                .compare_exchange_weak(x, y, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return (y >> 11) as f64 / (1u64 << 53) as f64,
                Err(now) => x = now,
            }
        }
    }

    /// The error `rule` gives this request, if it fails.
    fn fails(&self, rule: &Rule) -> Option<io::Error> {
        if rule.rate <= 0.0 {
            return None;
        }
        if let Some(file) = &rule.file {
            if !file.exists() {
                return None;
            }
        }
        (rule.rate >= 1.0 || self.next_random() < rule.rate)
            .then(|| io::Error::from_raw_os_error(rule.errno))
    }
}

/// A non-zero seed that differs between runs.
fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ u64::from(std::process::id()).rotate_left(32)) | 1
}

impl Layer for ErrorInjection {
    fn name(&self) -> &'static str {
        "error"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.fails(&self.pread)
            .map_or_else(|| next.pread(buf, offset), Err)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.fails(&self.pwrite)
            .map_or_else(|| next.pwrite(buf, offset, fua), Err)
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        self.fails(&self.flush).map_or_else(|| next.flush(), Err)
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.fails(&self.trim)
            .map_or_else(|| next.trim(offset, len, fua), Err)
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        match self.fails(&self.zero) {
            Some(e) => Err(e.into()),
            None => next.zero(offset, len, flags),
        }
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        self.fails(&self.cache)
            .map_or_else(|| next.cache(offset, len), Err)
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        match self.fails(&self.extents) {
            Some(e) => Err(e),
            None => next.extents(offset, len, extents_max, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::{Layered, MemoryBackend};

    fn layered(entry: &str) -> Layered {
        let (_, options) = split(entry).unwrap();
        let layer = ErrorInjection::from_options(options).unwrap();
        Layered::new(
            Arc::new(layer),
            Arc::new(MemoryBackend::new(1 << 20).unwrap()),
        )
    }

    fn read_fails(l: &Layered) -> Option<i32> {
        let mut buf = [0u8; 512];
        l.pread(&mut buf, 0).err().and_then(|e| e.raw_os_error())
    }

    #[test]
    fn a_rate_of_one_fails_every_request_with_the_errno_asked() {
        let l = layered("error:error=ENOSPC,error-rate=1");
        assert_eq!(read_fails(&l), Some(libc::ENOSPC));
        assert!(l.flush().is_err());
        let l = layered("error:error-pwrite-rate=100%");
        assert_eq!(read_fails(&l), None);
        assert_eq!(
            l.pwrite(&[0; 512], 0, false).unwrap_err().raw_os_error(),
            Some(libc::EIO)
        );
    }

    #[test]
    fn a_rate_fails_about_that_share() {
        let l = layered("error:error-rate=0.25");
        let failed = (0..2000).filter(|_| read_fails(&l).is_some()).count();
        // 500 expected; the bounds are over 8 standard deviations wide.
        assert!((350..650).contains(&failed), "{failed} of 2000 failed");
    }

    #[test]
    fn the_trigger_file_turns_failures_on_and_off() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fail");
        let l = layered(&format!("error:error-rate=1,error-file={}", file.display()));
        assert_eq!(read_fails(&l), None);
        std::fs::write(&file, b"").unwrap();
        assert_eq!(read_fails(&l), Some(libc::EIO));
        std::fs::remove_file(&file).unwrap();
        assert_eq!(read_fails(&l), None);
    }

    #[test]
    fn bad_options_are_refused() {
        for entry in ["error:error=EBOGUS", "error:error-rate=2", "error:rate=1"] {
            let (_, options) = split(entry).unwrap();
            assert!(ErrorInjection::from_options(options).is_err(), "{entry}");
        }
    }
}
