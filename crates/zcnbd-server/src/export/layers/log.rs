//! The log layer (`--filter log:logfile=PATH`, nbdkit-log-filter): one line per request to a
//! file, for debugging a client - when (UTC), a request number, the command with its offset,
//! length and flags, the result (`ok` or the errno) and how long the layers below took:
//!
//! ```text
//! 2026-11-27T17:30:01.123456Z id=7 Write offset=0x10000 count=0x1000 fua=1 -> ok 41us
//! 2026-11-27T17:30:01.123601Z id=8 Read offset=0x7fff000 count=0x2000 -> EIO 12us
//! ```
//!
//! `logappend=true` appends to the file instead of starting it afresh. Each line is written
//! as a whole when its request ends (requests in flight at once may end in another order).

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, LineWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use zcnbd_proto::Extent;

use super::options::Options;
use crate::export::{Backend, Layer, ZeroError, ZeroFlags};

/// A layer writing a line per request.
#[derive(Debug)]
pub struct Log {
    path: PathBuf,
    file: Mutex<LineWriter<File>>,
    next_id: AtomicU64,
}

impl Log {
    /// The layer `options` describe; opens (or creates) the file.
    pub fn from_options(mut options: Options<'_>) -> Result<Log, String> {
        let path = PathBuf::from(
            options
                .get("logfile")
                .ok_or("filter log: give logfile=PATH")?,
        );
        let append = match options.get("logappend") {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => return Err(format!("filter log: logappend={other:?}: true or false")),
        };
        options.finish()?;
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&path)
            .map_err(|e| format!("filter log: cannot open {}: {e}", path.display()))?;
        Ok(Log {
            path,
            file: Mutex::new(LineWriter::new(file)),
            next_id: AtomicU64::new(1),
        })
    }

    /// Runs `op`, then writes its line.
    fn logged<T, E: AsErrno>(
        &self,
        what: fmt::Arguments<'_>,
        op: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        let result = op();
        let micros = start.elapsed().as_micros();
        let outcome = match &result {
            Ok(_) => "ok".to_owned(),
            Err(e) => errno_name(e.errno()),
        };
        let line = format!("{} id={id} {what} -> {outcome} {micros}us\n", utc_now());
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = file.write_all(line.as_bytes()) {
            // Logged once per failure of the file, not per request: the requests go on.
            tracing::warn!(path = %self.path.display(), error = %e, "filter log: cannot write its file");
        }
        result
    }
}

/// Errors that carry an errno.
trait AsErrno {
    fn errno(&self) -> i32;
}

impl AsErrno for io::Error {
    fn errno(&self) -> i32 {
        self.raw_os_error().unwrap_or(libc::EIO)
    }
}

impl AsErrno for ZeroError {
    fn errno(&self) -> i32 {
        match self {
            ZeroError::NotFast => libc::ENOTSUP,
            ZeroError::Io(e) => e.errno(),
        }
    }
}

fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EIO => "EIO",
        libc::EPERM => "EPERM",
        libc::ENOMEM => "ENOMEM",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::ESHUTDOWN => "ESHUTDOWN",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::ENOTSUP => "ENOTSUP",
        libc::EROFS => "EROFS",
        libc::EFBIG => "EFBIG",
        _ => return format!("errno {errno}"),
    };
    name.to_owned()
}

/// Now, as `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
fn utc_now() -> String {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60,
        since.subsec_micros()
    )
}

/// The Gregorian date `days` after 1970-01-01 (Howard Hinnant's days-to-civil).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

impl Layer for Log {
    fn name(&self) -> &'static str {
        "log"
    }
    fn intercepts(&self) -> bool {
        true
    }
    fn pread(&self, next: &dyn Backend, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let count = buf.len();
        self.logged(
            format_args!("Read offset={offset:#x} count={count:#x}"),
            || next.pread(buf, offset),
        )
    }
    fn pwrite(&self, next: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let (count, fua) = (buf.len(), u8::from(fua));
        self.logged(
            format_args!("Write offset={offset:#x} count={count:#x} fua={fua}"),
            || next.pwrite(buf, offset, fua == 1),
        )
    }
    fn flush(&self, next: &dyn Backend) -> io::Result<()> {
        self.logged(format_args!("Flush"), || next.flush())
    }
    fn trim(&self, next: &dyn Backend, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let f = u8::from(fua);
        self.logged(
            format_args!("Trim offset={offset:#x} count={len:#x} fua={f}"),
            || next.trim(offset, len, fua),
        )
    }
    fn zero(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> Result<(), ZeroError> {
        let (t, f, u) = (
            u8::from(flags.may_trim),
            u8::from(flags.fast),
            u8::from(flags.fua),
        );
        self.logged(
            format_args!("Zero offset={offset:#x} count={len:#x} trim={t} fast={f} fua={u}"),
            || next.zero(offset, len, flags),
        )
    }
    fn cache(&self, next: &dyn Backend, offset: u64, len: u64) -> io::Result<()> {
        self.logged(
            format_args!("Cache offset={offset:#x} count={len:#x}"),
            || next.cache(offset, len),
        )
    }
    fn extents(
        &self,
        next: &dyn Backend,
        offset: u64,
        len: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.logged(
            format_args!("Extents offset={offset:#x} count={len:#x}"),
            || next.extents(offset, len, extents_max, out),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::export::layers::options::split;
    use crate::export::{Layered, MemoryBackend};

    #[test]
    fn dates_from_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_722), (2023, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_784), (2026, 11, 27));
    }

    #[test]
    fn a_line_per_request_with_its_result() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("requests.log");
        let entry = format!("log:logfile={}", path.display());
        let (_, options) = split(&entry).unwrap();
        let layer = Arc::new(Log::from_options(options).unwrap());
        let top = Layered::new(layer, Arc::new(MemoryBackend::new(1 << 20).unwrap()));
        top.pwrite(&[1; 4096], 0x1000, true).unwrap();
        let mut buf = [0u8; 512];
        top.pread(&mut buf, 0).unwrap();
        assert!(top.pread(&mut buf, 1 << 20).is_err());
        top.flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(
            lines[0].contains("id=1 Write offset=0x1000 count=0x1000 fua=1 -> ok "),
            "{text}"
        );
        assert!(
            lines[1].contains("id=2 Read offset=0x0 count=0x200 -> ok "),
            "{text}"
        );
        assert!(
            lines[2].contains("id=3 Read offset=0x100000 count=0x200 -> E"),
            "{text}"
        );
        assert!(lines[3].contains("id=4 Flush -> ok "), "{text}");
        assert!(
            lines
                .iter()
                .all(|l| l.ends_with("us") && l.starts_with("20")),
            "{text}"
        );
    }

    #[test]
    fn options_need_a_file() {
        for bad in [
            "log",
            "log:logfile=/nonexistent/dir/x",
            "log:logfile=/tmp/x,logappend=yes",
        ] {
            let (_, options) = split(bad).unwrap();
            assert!(Log::from_options(options).is_err(), "{bad}");
        }
    }
}
