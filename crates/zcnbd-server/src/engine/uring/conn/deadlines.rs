//! The connection's clocks for `--write-timeout` and `--idle-timeout`: when the client last
//! sent a byte, and when the send in progress last moved bytes (or began). The ring's timer
//! compares them with its turn's clock (`Conn::on_tick`).

use std::time::{Duration, Instant};

use super::super::key::Tag;

/// When the connection last made progress each way.
#[derive(Debug)]
pub(super) struct Deadlines {
    /// When the client last sent a byte (for `--idle-timeout`).
    last_recv_at: Instant,
    /// When the send in progress last moved bytes, or began (for `--write-timeout`).
    send_progress_at: Instant,
}

impl Deadlines {
    pub fn new(now: Instant) -> Deadlines {
        Deadlines {
            last_recv_at: now,
            send_progress_at: now,
        }
    }

    /// An operation tagged `tag` moved bytes at `now`.
    pub fn on_progress(&mut self, tag: Tag, now: Instant) {
        match tag {
            Tag::Recv | Tag::PipeIn => self.last_recv_at = now,
            Tag::Send | Tag::SpliceHeader | Tag::SpliceOut | Tag::SpliceTail | Tag::Writable => {
                self.send_progress_at = now
            }
            _ => {}
        }
    }

    /// A send begins at `now`.
    pub fn send_started(&mut self, now: Instant) {
        self.send_progress_at = now;
    }

    /// Whether a send in progress has moved nothing for `timeout`.
    pub fn send_stalled(&self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.send_progress_at) >= timeout
    }

    /// Whether the client has sent nothing for `timeout`.
    pub fn recv_idle(&self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.last_recv_at) >= timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_moves_only_its_own_clock() {
        let start = Instant::now();
        let mut d = Deadlines::new(start);
        let later = start + Duration::from_secs(10);
        d.on_progress(Tag::Recv, later);
        assert!(!d.recv_idle(later, Duration::from_secs(5)));
        assert!(d.send_stalled(later, Duration::from_secs(5)));
        d.on_progress(Tag::FileRead, later + Duration::from_secs(10));
        assert!(d.send_stalled(later, Duration::from_secs(10)));
        d.send_started(later);
        assert!(!d.send_stalled(later, Duration::from_secs(1)));
    }
}
