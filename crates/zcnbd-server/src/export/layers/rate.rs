//! The rate layer (`--filter rate`, nbdkit-rate-filter): reads and writes wait so that the
//! data they move stays under a bandwidth, for the export as a whole (`rate`) and for each
//! client connection (`connection-rate`). Rates are in **bits per second** as nbdkit's
//! (`rate=80M`: 10 MiB/s; K/M/G suffixes are powers of 1024), 0 or absent for none.
//!
//! Each limit is a token bucket holding up to `burstiness` seconds of its rate (default
//! 2): a request takes its bits and, if the bucket ran dry, waits until the rate has paid
//! for them; requests larger than the bucket wait in proportion, so the average holds. The
//! rates can change while the server runs: through the control socket (`zcnbd filter
//! --control PATH rate.rate=40M`), or from `rate-file` / `connection-rate-file` (a file
//! holding a rate, read again at most once a second, as nbdkit does; a file that is missing
//! or does not hold a rate leaves the rate as it was).

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::options::Options;
use crate::config::parse_size;
use crate::export::{connection, Backend, Layer};

/// The highest rate (bits per second) an option may name.
pub const RATE_MAX: u64 = 1 << 50;
/// The longest a bucket may hold, in seconds of its rate.
pub const BURSTINESS_MAX: f64 = 3600.0;
/// How many connections' buckets are kept before idle ones are dropped.
const CONNECTION_BUCKETS_KEPT: usize = 256;
/// How often a rate file is read again.
const RATE_FILE_PERIOD: Duration = Duration::from_secs(1);

/// One limit's bucket.
#[derive(Debug)]
struct Bucket {
    /// Bits it holds; below zero while requests wait for the rate to pay their debt.
    bits: f64,
    refilled: Instant,
}

impl Bucket {
    fn full(rate: u64, burstiness: f64) -> Bucket {
        Bucket {
            bits: rate as f64 * burstiness,
            refilled: Instant::now(),
        }
    }

    /// Takes `bits` at `rate`: how long the taker must wait.
    fn take(&mut self, bits: f64, rate: u64, burstiness: f64) -> Duration {
        let now = Instant::now();
        let rate = rate as f64;
        let elapsed = now.duration_since(self.refilled).as_secs_f64();
        self.bits = (self.bits + elapsed * rate).min(rate * burstiness);
        self.refilled = now;
        self.bits -= bits;
        match self.bits < 0.0 {
            true => Duration::from_secs_f64(-self.bits / rate),
            false => Duration::ZERO,
        }
    }
}

/// A rate that may change at run time, and the file it may come from.
#[derive(Debug)]
struct Limit {
    bits_per_second: AtomicU64,
    file: Option<PathBuf>,
    file_read: Mutex<Option<Instant>>,
}

impl Limit {
    fn new(rate: u64, file: Option<PathBuf>) -> Limit {
        Limit {
            bits_per_second: AtomicU64::new(rate),
            file,
            file_read: Mutex::new(None),
        }
    }

    /// The rate now (reading its file again if a second has passed).
    fn rate(&self) -> u64 {
        if let Some(path) = &self.file {
            let mut read = self.file_read.lock().unwrap_or_else(|p| p.into_inner());
            if read.is_none_or(|at| at.elapsed() >= RATE_FILE_PERIOD) {
                *read = Some(Instant::now());
                let text = std::fs::read_to_string(path).unwrap_or_default();
                if let Some(rate) = parse_rate(text.trim()) {
                    let old = self.bits_per_second.swap(rate, Ordering::Relaxed);
                    if old != rate {
                        tracing::info!(file = %path.display(), bits_per_second = rate, "rate changed");
                    }
                }
            }
        }
        self.bits_per_second.load(Ordering::Relaxed)
    }
}

fn parse_rate(text: &str) -> Option<u64> {
    parse_size(text).ok().filter(|r| *r <= RATE_MAX)
}

/// A layer limiting bandwidth.
#[derive(Debug)]
pub struct Rate {
    export: Limit,
    connection: Limit,
    burstiness: f64,
    export_bucket: Mutex<Option<Bucket>>,
    connection_buckets: Mutex<HashMap<u64, Bucket>>,
}

fn rate_option(o: &mut Options<'_>, key: &'static str) -> Result<u64, String> {
    match o.get(key) {
        None => Ok(0),
        Some(text) => parse_rate(text).ok_or_else(|| {
            format!("filter rate: {key}={text:?} is not a rate in bits per second (80M, 1G, 0 for none)")
        }),
    }
}

impl Rate {
    /// The layer `options` describe.
    pub fn from_options(mut o: Options<'_>) -> Result<Rate, String> {
        let rate = rate_option(&mut o, "rate")?;
        let connection_rate = rate_option(&mut o, "connection-rate")?;
        let burstiness = match o.get("burstiness") {
            None => 2.0,
            Some(text) => text
                .parse::<f64>()
                .ok()
                .filter(|b| *b > 0.0 && *b <= BURSTINESS_MAX)
                .ok_or_else(|| {
                    format!("filter rate: burstiness={text:?} is not a number of seconds above 0 and up to {BURSTINESS_MAX}")
                })?,
        };
        let rate_file = o.get("rate-file").map(PathBuf::from);
        let connection_rate_file = o.get("connection-rate-file").map(PathBuf::from);
        o.finish()?;
        Ok(Rate {
            export: Limit::new(rate, rate_file),
            connection: Limit::new(connection_rate, connection_rate_file),
            burstiness,
            export_bucket: Mutex::new(None),
            connection_buckets: Mutex::new(HashMap::new()),
        })
    }

    /// Waits until `bytes` may move under both limits.
    fn pace(&self, bytes: usize) {
        let bits = bytes as f64 * 8.0;
        let mut wait = Duration::ZERO;
        let rate = self.export.rate();
        if rate > 0 {
            let mut bucket = self.export_bucket.lock().unwrap_or_else(|p| p.into_inner());
            let bucket = bucket.get_or_insert_with(|| Bucket::full(rate, self.burstiness));
            wait = bucket.take(bits, rate, self.burstiness);
        }
        let rate = self.connection.rate();
        if rate > 0 {
            let id = connection::current().unwrap_or(0);
            let mut buckets = self
                .connection_buckets
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if buckets.len() >= CONNECTION_BUCKETS_KEPT && !buckets.contains_key(&id) {
                // Connections that have been idle long enough to have a full bucket lose
                // nothing by starting a new one.
                let full = Duration::from_secs_f64(self.burstiness);
                buckets.retain(|_, b| b.refilled.elapsed() < full);
            }
            let bucket = buckets
                .entry(id)
                .or_insert_with(|| Bucket::full(rate, self.burstiness));
            wait = wait.max(bucket.take(bits, rate, self.burstiness));
        }
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

impl Layer for Rate {
    fn name(&self) -> &'static str {
        "rate"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn set(&self, key: &str, value: &str) -> Result<(), String> {
        let limit = match key {
            "rate" => &self.export,
            "connection-rate" => &self.connection,
            _ => {
                return Err(format!(
                "filter rate: {key:?} cannot be changed while serving (rate, connection-rate can)"
            ))
            }
        };
        let rate = parse_rate(value).ok_or_else(|| {
            format!("filter rate: {key}={value:?} is not a rate in bits per second (80M, 1G, 0 for none)")
        })?;
        limit.bits_per_second.store(rate, Ordering::Relaxed);
        tracing::info!(
            key,
            bits_per_second = rate,
            "rate changed through the control socket"
        );
        Ok(())
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.pace(buf.len());
        next.pread(buf, offset)
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.pace(buf.len());
        next.pwrite(buf, offset, fua)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::{Layered, MemoryBackend};

    fn rate(entry: &str) -> Result<Rate, String> {
        let (_, options) = split(entry).unwrap();
        Rate::from_options(options)
    }

    #[test]
    fn options_are_nbdkits() {
        let r = rate("rate:rate=1M,connection-rate=64K,burstiness=0.5").unwrap();
        assert_eq!(r.export.rate(), 1 << 20);
        assert_eq!(r.connection.rate(), 64 << 10);
        assert_eq!(r.burstiness, 0.5);
        assert!(rate("rate:rate=fast")
            .unwrap_err()
            .contains("bits per second"));
        assert!(rate("rate:burstiness=0").is_err());
        assert!(rate("rate:speed=1")
            .unwrap_err()
            .contains("connection-rate"));
    }

    #[test]
    fn a_bucket_pays_debts_at_the_rate() {
        let mut b = Bucket::full(8000, 1.0); // 1000 bytes a second, 1000 held
        assert_eq!(b.take(8000.0, 8000, 1.0), Duration::ZERO);
        let wait = b.take(4000.0, 8000, 1.0);
        assert!((0.45..=0.51).contains(&wait.as_secs_f64()), "{wait:?}");
    }

    #[test]
    fn reads_keep_to_the_export_rate_and_each_connection_to_its_own() {
        let below = Arc::new(MemoryBackend::new(1 << 20).unwrap());
        // 64 KiB/s with a 0.25 s bucket (16 KiB): the first 16 KiB pass, 64 KiB more take 1 s.
        let layer = Arc::new(rate("rate:rate=512K,burstiness=0.25").unwrap());
        let stack = Layered::new(layer.clone(), below.clone());
        let mut buf = vec![0u8; 16 << 10];
        let start = Instant::now();
        for _ in 0..5 {
            stack.pread(&mut buf, 0).unwrap();
        }
        let took = start.elapsed().as_secs_f64();
        assert!((0.9..1.6).contains(&took), "{took}");

        // Changed at run time: unlimited.
        layer.set("rate", "0").unwrap();
        let start = Instant::now();
        for _ in 0..50 {
            stack.pread(&mut buf, 0).unwrap();
        }
        assert!(start.elapsed() < Duration::from_millis(300));
        assert!(layer.set("burstiness", "1").is_err());

        // Two connections each at their own 64 KiB/s: both pass 32 KiB in ~0.25 s
        // together, where one limit for both would take twice as long.
        layer.set("connection-rate", "512K").unwrap();
        let (a, b) = (
            connection::new_connection_id(),
            connection::new_connection_id(),
        );
        let start = Instant::now();
        std::thread::scope(|s| {
            for id in [a, b] {
                let stack = &stack;
                s.spawn(move || {
                    connection::within(id, || {
                        let mut buf = vec![0u8; 16 << 10];
                        for _ in 0..2 {
                            stack.pread(&mut buf, 0).unwrap();
                        }
                    })
                });
            }
        });
        let took = start.elapsed().as_secs_f64();
        assert!((0.2..0.45).contains(&took), "{took}");
    }

    #[test]
    fn a_rate_file_changes_the_rate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rate");
        std::fs::write(&path, "1M\n").unwrap();
        let r = rate(&format!("rate:rate=8K,rate-file={}", path.display())).unwrap();
        assert_eq!(r.export.rate(), 1 << 20);
        std::fs::write(&path, "nonsense").unwrap();
        *r.export.file_read.lock().unwrap() = None;
        assert_eq!(r.export.rate(), 1 << 20);
    }
}
