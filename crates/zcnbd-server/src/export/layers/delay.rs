//! The delay layer (`--filter delay`, nbdkit-delay-filter): each request waits a set time
//! before it goes on down the stack - a slow disk or a distant server, for testing clients.
//! Options (durations: `1.5` seconds, `250ms`, `100us`): `rdelay`, `wdelay`, `zdelay`,
//! `trimdelay`, `extentsdelay`, `cachedelay` (and nbdkit's `delay-read`, `delay-write`,
//! `delay-zero`, `delay-trim`, `delay-extents`, `delay-cache` for the same), and `delay-flush`.
//! Only the request waits: it runs on the worker pool, never on an engine's thread.

use std::io;
use std::time::Duration;

use zcnbd_proto::Extent;

use super::options::Options;
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// Waits per kind of request.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Delay {
    read: Duration,
    write: Duration,
    zero: Duration,
    trim: Duration,
    extents: Duration,
    cache: Duration,
    flush: Duration,
}

impl Delay {
    /// The layer `options` describe.
    pub fn from_options(mut options: Options<'_>) -> Result<Delay, String> {
        let mut either = |short: &'static str, long: &'static str| -> Result<Duration, String> {
            let a = options.duration(short)?;
            let b = options.duration(long)?;
            Ok(b.or(a).unwrap_or_default())
        };
        let delay = Delay {
            read: either("rdelay", "delay-read")?,
            write: either("wdelay", "delay-write")?,
            zero: either("zdelay", "delay-zero")?,
            trim: either("trimdelay", "delay-trim")?,
            extents: either("extentsdelay", "delay-extents")?,
            cache: either("cachedelay", "delay-cache")?,
            flush: options.duration("delay-flush")?.unwrap_or_default(),
        };
        options.finish()?;
        Ok(delay)
    }
}

fn wait(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

impl Layer for Delay {
    fn name(&self) -> &'static str {
        "delay"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        wait(self.read);
        next.pread(buf, offset)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        wait(self.write);
        next.pwrite(buf, offset, fua)
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        wait(self.flush);
        next.flush()
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        wait(self.trim);
        next.trim(offset, len, fua)
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        wait(self.zero);
        next.zero(offset, len, flags)
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        wait(self.cache);
        next.cache(offset, len)
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        wait(self.extents);
        next.extents(offset, len, extents_max, out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::{Layered, MemoryBackend};

    fn delay(entry: &str) -> Result<Delay, String> {
        let (_, options) = split(entry).unwrap();
        Delay::from_options(options)
    }

    #[test]
    fn options_name_each_kind_of_request() {
        let d = delay("delay:rdelay=10ms,delay-write=20ms,delay-flush=1").unwrap();
        assert_eq!(d.read, Duration::from_millis(10));
        assert_eq!(d.write, Duration::from_millis(20));
        assert_eq!(d.flush, Duration::from_secs(1));
        assert_eq!(d.zero, Duration::ZERO);
        assert!(delay("delay:rdelay=x").is_err());
        assert!(delay("delay:speed=1").unwrap_err().contains("rdelay"));
    }

    #[test]
    fn reads_wait_and_writes_do_not_unless_asked() {
        let below = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        let layered = Layered::new(Arc::new(delay("delay:rdelay=50ms").unwrap()), below);
        let mut buf = [0u8; 512];
        let start = Instant::now();
        layered.pread(&mut buf, 0).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(50));
        let start = Instant::now();
        layered.pwrite(&buf, 0, false).unwrap();
        assert!(start.elapsed() < Duration::from_millis(50));
        // Every request reaches the layer: nothing is mapped past it.
        assert!(!layered.never_waits() && !layered.can_submit() && layered.medium().is_none());
    }
}
