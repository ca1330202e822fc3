//! Data-path counters: which mechanism moved each byte, how many bytes the server copied
//! itself, and how many times it entered the kernel. Printed at shutdown (`--stats`) and
//! served in Prometheus text format (`--metrics ADDR`).
//!
//! The engines say what happened ([`Stats::read_done`], [`Stats::write_done`],
//! [`Stats::replies_sent`], ...); which counter each byte goes to is decided here, once.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// One counter.
#[derive(Debug, Default)]
struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The current value.
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// How a read's data reached its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    /// Read into a buffer by the server (`pread` / `READ` through the page cache): a copy
    /// beyond the socket's.
    Copied,
    /// Read into a buffer chunk by chunk, holes left out: each data chunk was counted with
    /// [`Stats::copied`] as it was read.
    Sparse,
    /// Sent from the export itself (its mapping, `sendfile`, splice): no copy but the
    /// socket's.
    Export,
    /// `O_DIRECT` into an ordinary buffer: the device's DMA, no CPU copy.
    Direct,
    /// `O_DIRECT` into a ring's registered buffer (`READ_FIXED`).
    Fixed,
    /// Spliced from an upstream's socket into a pipe, except `copied` bytes (that came
    /// with a response's head, counted with [`Stats::copied`]).
    Piped { copied: usize },
}

/// How a write's payload reached the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePath {
    /// Through a buffer the server copied from (memcpy into the mapping, `pwrite` / `WRITE`
    /// into the page cache).
    Copied,
    /// Received straight into the mapping, except `staged` bytes that arrived with request
    /// headers and were copied into place (counted with [`Stats::copied`] then).
    InPlace { staged: usize },
    /// Spliced from the socket through a pipe into the page cache.
    Spliced,
    /// `O_DIRECT` from an ordinary buffer: no CPU copy.
    Direct,
    /// `O_DIRECT` from a ring's registered buffer (`WRITE_FIXED`).
    Fixed,
}

/// How replies left for the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendPath {
    /// `send` / `sendmsg` / `writev`: the kernel copies the data into the socket.
    Plain,
    /// Spliced from the page cache (`SPLICE` through a pipe).
    Splice,
    /// `sendfile` from the memory export's memfd (a splice inside the kernel).
    Sendfile,
    /// A zero-copy send; `copied` when the kernel reported it copied the data anyway.
    ZeroCopy { copied: bool },
}

macro_rules! counters {
    ($($field:ident => $help:literal,)*) => {
        /// Every data-path counter of a server.
        #[derive(Debug, Default)]
        pub struct Stats {
            $(#[doc = $help] $field: Counter,)*
        }

        impl Stats {
            /// `(name, help, value)` of every counter.
            pub fn snapshot(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![$((stringify!($field), $help, self.$field.get()),)*]
            }
        }
    };
}

counters! {
    requests => "Requests answered.",
    read_bytes => "Payload bytes of successful reads.",
    write_bytes => "Payload bytes of successful writes.",
    sent_plain_bytes => "Read payload bytes sent with plain send/sendmsg (one kernel copy into the socket).",
    sent_splice_bytes => "Read payload bytes spliced to the socket from the page cache, or from a pipe an upstream's bytes were spliced into (no CPU copy on the server).",
    upstream_spliced_bytes => "Read payload bytes spliced from an upstream's socket (a plain-HTTP web server's, or a plain NBD upstream's for reads of at least --splice-min-bytes) into a pipe, on their way to the client's socket without a copy through user memory.",
    sent_zerocopy_bytes => "Read payload bytes sent with zero-copy send that the kernel did not copy.",
    sent_zerocopy_copied_bytes => "Read payload bytes sent with zero-copy send that the kernel reported it copied anyway.",
    received_in_place_bytes => "Write payload bytes received straight into their final place (the page cache mapping).",
    received_splice_bytes => "Write payload bytes spliced from the socket through a pipe into a buffered file's page cache (one kernel copy, none in userspace).",
    fixed_io_bytes => "O_DIRECT payload bytes read or written through a ring's registered buffers (READ_FIXED / WRITE_FIXED; reads then leave from the same buffer).",
    fixed_buffer_misses => "O_DIRECT requests that could have used a registered buffer but found none free (or were larger than the region) and used a pooled buffer instead.",
    copied_bytes => "Payload bytes the server copied between its own buffers and the backend (memcpy, or read/write through a bounce buffer); zero means the socket's own copy is the only one.",
    tls_connections => "Connections that switched to TLS (NBD_OPT_STARTTLS and a TLS handshake that succeeded).",
    tls_kernel_connections => "TLS connections whose records the kernel encrypts as they are sent (kTLS; their replies leave by the engine's own mechanisms: sendfile, splice, plain sends).",
    tls_encrypted_bytes => "Plaintext bytes OpenSSL encrypted in user space (option replies and replies of TLS connections; counted when the connection closes).",
    tls_decrypted_bytes => "Plaintext bytes OpenSSL decrypted in user space (options and requests of TLS connections; counted when the connection closes).",
    ring_enters => "io_uring_enter calls (io_uring engine).",
    waits_polled => "Times a thread with nothing to do found its next work while polling (--poll-max-us), without sleeping: ring threads, and portable connections whose requests run on their reader.",
    waits_slept => "Times such a thread slept until its next work came (after polling, if its window was open).",
    waits_coalesced => "Waits for a pipelining client that coalesced (while trials say it pays): a ring thread sleeping until several completions, a portable reader holding replies for more requests.",
    sends_overlapped => "Reply sends made as soon as four replies were queued, before the rest of a pipelining client's burst was read (portable reader) or started (ring) (while trials say it pays).",
    syscalls => "Portable engine: socket reads (a request header or payload) and reply writes (one writev each); io_uring engine: the send and sendfile calls of sendfile replies, and the FIONREAD and splice calls that take spliced writes off the socket.",
}

impl Stats {
    /// A client switched to TLS.
    pub fn tls_connection(&self) {
        self.tls_connections.add(1);
    }

    /// A TLS connection's sending half went to the kernel (kTLS).
    pub fn tls_kernel_connection(&self) {
        self.tls_kernel_connections.add(1);
    }

    /// A TLS session ended having encrypted and decrypted this many plaintext bytes.
    pub fn tls_session_closed(&self, encrypted: u64, decrypted: u64) {
        self.tls_encrypted_bytes.add(encrypted);
        self.tls_decrypted_bytes.add(decrypted);
    }

    /// `replies` replies carrying `data_bytes` of read data reached the socket by `how`.
    pub fn replies_sent(&self, how: SendPath, replies: usize, data_bytes: usize) {
        self.requests.add(replies as u64);
        let counter = match how {
            SendPath::Plain => &self.sent_plain_bytes,
            SendPath::Splice | SendPath::Sendfile => &self.sent_splice_bytes,
            SendPath::ZeroCopy { copied: false } => &self.sent_zerocopy_bytes,
            SendPath::ZeroCopy { copied: true } => &self.sent_zerocopy_copied_bytes,
        };
        counter.add(data_bytes as u64);
    }

    /// A read of `len` bytes succeeded, its data brought by `path`.
    pub fn read_done(&self, path: ReadPath, len: usize) {
        match path {
            ReadPath::Copied => self.copied_bytes.add(len as u64),
            ReadPath::Fixed => self.fixed_io_bytes.add(len as u64),
            ReadPath::Piped { copied } => self
                .upstream_spliced_bytes
                .add(len.saturating_sub(copied) as u64),
            ReadPath::Sparse | ReadPath::Export | ReadPath::Direct => {}
        }
        self.read_bytes.add(len as u64);
    }

    /// A write of `len` bytes succeeded, its payload brought by `path`.
    pub fn write_done(&self, path: WritePath, len: usize) {
        match path {
            WritePath::Copied => self.copied_bytes.add(len as u64),
            WritePath::InPlace { staged } => self
                .received_in_place_bytes
                .add(len.saturating_sub(staged) as u64),
            WritePath::Spliced => self.received_splice_bytes.add(len as u64),
            WritePath::Fixed => self.fixed_io_bytes.add(len as u64),
            WritePath::Direct => {}
        }
        self.write_bytes.add(len as u64);
    }

    /// The server copied `bytes` of payload itself (a sparse read's data chunk, the start
    /// of a payload that arrived with request headers).
    pub fn copied(&self, bytes: usize) {
        self.copied_bytes.add(bytes as u64);
    }

    /// An `O_DIRECT` request found no free registered buffer and used a pooled one.
    pub fn fixed_buffer_missed(&self) {
        self.fixed_buffer_misses.add(1);
    }

    /// One `io_uring_enter`.
    /// A thread with nothing to do waited for work: found it while polling, or slept.
    pub fn waited(&self, polled: bool) {
        match polled {
            true => self.waits_polled.add(1),
            false => self.waits_slept.add(1),
        }
    }

    /// A ring thread's sleep waited for several completions at once.
    pub fn waited_coalesced(&self) {
        self.waits_coalesced.add(1);
    }

    /// A portable reader or a ring sent its queued replies early, overlapping the client's
    /// work.
    pub fn sent_overlapped(&self) {
        self.sends_overlapped.add(1);
    }

    pub fn ring_entered(&self) {
        self.ring_enters.add(1);
    }

    /// One system call on the data path outside a ring (see the `syscalls` counter).
    pub fn syscall(&self) {
        self.syscalls.add(1);
    }
}

impl Stats {
    /// Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        for (name, help, value) in self.snapshot() {
            let _ = writeln!(out, "# HELP zcnbd_{name}_total {help}");
            let _ = writeln!(out, "# TYPE zcnbd_{name}_total counter");
            let _ = writeln!(out, "zcnbd_{name}_total {value}");
        }
        out
    }

    /// A human-readable table, one counter per line.
    pub fn render_table(&self) -> String {
        let snapshot = self.snapshot();
        let width = snapshot.iter().map(|(n, _, _)| n.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (name, _, value) in &snapshot {
            let _ = writeln!(out, "{name:<width$}  {value:>16}");
        }
        let requests = self.requests.get().max(1);
        let enters = self.ring_enters.get() + self.syscalls.get();
        let _ = writeln!(
            out,
            "{:<width$}  {:>16.2}",
            "kernel_entries_per_request",
            enters as f64 / requests as f64
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counters that are not zero, by name.
    fn nonzero(stats: &Stats) -> Vec<(&'static str, u64)> {
        let snapshot = stats.snapshot().into_iter();
        snapshot.filter(|c| c.2 != 0).map(|c| (c.0, c.2)).collect()
    }

    #[test]
    fn renders_every_counter() {
        let stats = Stats::default();
        stats.replies_sent(SendPath::Splice, 2, 4096);
        let text = stats.render_prometheus();
        assert!(text.contains("zcnbd_sent_splice_bytes_total 4096\n"));
        assert!(text.contains("zcnbd_requests_total 2\n"));
        assert!(text.contains("# TYPE zcnbd_copied_bytes_total counter\n"));
        assert!(stats.render_table().contains("requests"));
    }

    #[test]
    fn each_send_path_has_its_counter() {
        let stats = Stats::default();
        stats.replies_sent(SendPath::Plain, 3, 1);
        stats.replies_sent(SendPath::Sendfile, 1, 10);
        stats.replies_sent(SendPath::ZeroCopy { copied: false }, 1, 100);
        stats.replies_sent(SendPath::ZeroCopy { copied: true }, 1, 1000);
        let expected = [
            ("requests", 6),
            ("sent_plain_bytes", 1),
            ("sent_splice_bytes", 10),
            ("sent_zerocopy_bytes", 100),
            ("sent_zerocopy_copied_bytes", 1000),
        ];
        assert_eq!(nonzero(&stats), expected);
    }

    #[test]
    fn reads_count_their_copies_and_registered_buffers() {
        let stats = Stats::default();
        stats.read_done(ReadPath::Copied, 1);
        stats.read_done(ReadPath::Export, 10);
        stats.read_done(ReadPath::Direct, 100);
        stats.read_done(ReadPath::Fixed, 1000);
        stats.copied(20_000);
        stats.read_done(ReadPath::Sparse, 30_000);
        stats.read_done(ReadPath::Piped { copied: 50_000 }, 400_000);
        let expected = [
            ("read_bytes", 431_111),
            ("upstream_spliced_bytes", 350_000),
            ("fixed_io_bytes", 1000),
            ("copied_bytes", 20_001),
        ];
        assert_eq!(nonzero(&stats), expected);
    }

    #[test]
    fn writes_count_where_the_payload_went() {
        let stats = Stats::default();
        stats.write_done(WritePath::Copied, 1);
        stats.write_done(WritePath::InPlace { staged: 4 }, 14);
        stats.write_done(WritePath::Spliced, 100);
        stats.write_done(WritePath::Direct, 1000);
        stats.write_done(WritePath::Fixed, 10_000);
        let expected = [
            ("write_bytes", 11_115),
            ("received_in_place_bytes", 10),
            ("received_splice_bytes", 100),
            ("fixed_io_bytes", 10_000),
            ("copied_bytes", 1),
        ];
        assert_eq!(nonzero(&stats), expected);
    }

    #[test]
    fn kernel_entries_and_misses() {
        let stats = Stats::default();
        stats.ring_entered();
        stats.syscall();
        stats.syscall();
        stats.fixed_buffer_missed();
        let expected = [
            ("fixed_buffer_misses", 1),
            ("ring_enters", 1),
            ("syscalls", 2),
        ];
        assert_eq!(nonzero(&stats), expected);
    }
}
