//! Where the log goes (`--log`), in a form the place can keep:
//!
//! - `stderr`: lines with times; coloured only when standard error is a terminal and
//!   `NO_COLOR` is not set (journald and files would keep the escape codes as text).
//! - `journald`: standard error is the journal (systemd says so in `JOURNAL_STREAM`): no
//!   time (the journal adds it), each line prefixed with its syslog priority (`<4>` for a
//!   warning, sd-daemon(3)), so `journalctl -p warning` finds warnings.
//! - `syslog`: datagrams to `/dev/log` (`<PRI>zcnbd[PID]: ...`, facility daemon), which
//!   journald also receives: what `serve --fork` uses, whose standard error is gone.
//!
//! `auto` (the default) picks `journald` when `JOURNAL_STREAM` names standard error,
//! `syslog` for `serve --fork` when `/dev/log` exists, else `stderr`.

use std::io::{self, IsTerminal, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// `--log`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogTarget {
    Auto,
    Stderr,
    Journald,
    Syslog,
}

/// The system's syslog socket.
const SYSLOG_SOCKET: &str = "/dev/log";
/// syslog's facility for daemons (RFC 5424: 3).
const FACILITY_DAEMON: u8 = 3;

/// syslog severity of a tracing level.
fn severity(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Whether `JOURNAL_STREAM` ("DEVICE:INODE") names the file standard error is.
fn stderr_is_the_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    stream.to_string_lossy() == format!("{}:{}", meta.dev(), meta.ino())
}

/// What `auto` means here (`forking`: `serve --fork`).
pub fn resolve(target: LogTarget, forking: bool) -> LogTarget {
    match target {
        LogTarget::Auto if stderr_is_the_journal() => LogTarget::Journald,
        LogTarget::Auto if forking && Path::new(SYSLOG_SOCKET).exists() => LogTarget::Syslog,
        LogTarget::Auto => LogTarget::Stderr,
        other => other,
    }
}

/// Whether to colour: a terminal, and no `NO_COLOR`.
fn colour() -> bool {
    io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber: `filter` (RUST_LOG or -v) to `target`.
pub fn init(filter: tracing_subscriber::EnvFilter, target: LogTarget) {
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match target {
        LogTarget::Journald => builder
            .without_time()
            .with_ansi(false)
            .with_writer(Prefixed)
            .init(),
        LogTarget::Syslog => builder
            .without_time()
            .with_ansi(false)
            .with_writer(Syslog::new())
            .init(),
        LogTarget::Stderr | LogTarget::Auto => {
            builder.with_ansi(colour()).with_writer(io::stderr).init()
        }
    }
}

/// One event's text, written when it is complete.
pub struct Event {
    severity: u8,
    text: Vec<u8>,
    to: Sink,
}

#[derive(Clone)]
enum Sink {
    /// Standard error, each line prefixed `<N>`.
    Journal,
    /// A datagram to the syslog socket.
    Syslog(std::sync::Arc<Option<UnixDatagram>>),
}

impl Write for Event {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.text);
        match &self.to {
            Sink::Journal => {
                let mut out = String::with_capacity(text.len() + 8);
                for line in text.lines() {
                    out.push_str(&format!("<{}>{line}\n", self.severity));
                }
                let _ = io::stderr().write_all(out.as_bytes());
            }
            Sink::Syslog(socket) => {
                let pri = FACILITY_DAEMON * 8 + self.severity;
                let message = format!("<{pri}>zcnbd[{}]: {}", std::process::id(), text.trim_end());
                if let Some(socket) = socket.as_ref() {
                    let _ = socket.send_to(message.as_bytes(), SYSLOG_SOCKET);
                }
            }
        }
    }
}

/// journald's stream: standard error with priorities.
struct Prefixed;

impl<'a> MakeWriter<'a> for Prefixed {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        self.event(6)
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Event {
        self.event(severity(meta.level()))
    }
}

impl Prefixed {
    fn event(&self, severity: u8) -> Event {
        Event {
            severity,
            text: Vec::new(),
            to: Sink::Journal,
        }
    }
}

/// syslog: one datagram per event.
struct Syslog(std::sync::Arc<Option<UnixDatagram>>);

impl Syslog {
    fn new() -> Syslog {
        Syslog(std::sync::Arc::new(UnixDatagram::unbound().ok()))
    }

    fn event(&self, severity: u8) -> Event {
        Event {
            severity,
            text: Vec::new(),
            to: Sink::Syslog(std::sync::Arc::clone(&self.0)),
        }
    }
}

impl<'a> MakeWriter<'a> for Syslog {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        self.event(6)
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Event {
        self.event(severity(meta.level()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(severity(&Level::ERROR), 3);
        assert_eq!(severity(&Level::WARN), 4);
        assert_eq!(severity(&Level::INFO), 6);
        assert_eq!(severity(&Level::TRACE), 7);
        // Not the journal unless JOURNAL_STREAM names standard error.
        assert_eq!(resolve(LogTarget::Stderr, true), LogTarget::Stderr);
    }
}
