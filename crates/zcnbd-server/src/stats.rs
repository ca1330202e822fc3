//! Data-path counters: which mechanism moved each byte, how many bytes the server copied
//! itself, and how many times it entered the kernel. Printed at shutdown (`--stats`) and
//! served in Prometheus text format (`--metrics ADDR`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// One counter: its Prometheus name, help text, and value.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

macro_rules! counters {
    ($($field:ident => $help:literal,)*) => {
        /// Every data-path counter of a server.
        #[derive(Debug, Default)]
        pub struct Stats {
            $(#[doc = $help] pub $field: Counter,)*
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
    sent_splice_bytes => "Read payload bytes spliced from the page cache to the socket (no CPU copy on the server).",
    sent_zerocopy_bytes => "Read payload bytes sent with zero-copy send that the kernel did not copy.",
    sent_zerocopy_copied_bytes => "Read payload bytes sent with zero-copy send that the kernel reported it copied anyway.",
    received_in_place_bytes => "Write payload bytes received straight into their final place (the page cache mapping).",
    received_splice_bytes => "Write payload bytes spliced from the socket through a pipe into a buffered file's page cache (one kernel copy, none in userspace).",
    fixed_io_bytes => "O_DIRECT payload bytes read or written through a ring's registered buffers (READ_FIXED / WRITE_FIXED; reads then leave from the same buffer).",
    fixed_buffer_misses => "O_DIRECT requests that could have used a registered buffer but found none free (or were larger than the region) and used a pooled buffer instead.",
    copied_bytes => "Payload bytes the server copied between its own buffers and the backend (memcpy, or read/write through a bounce buffer); zero means the socket's own copy is the only one.",
    tls_connections => "Connections that switched to TLS (NBD_OPT_STARTTLS and a TLS handshake that succeeded).",
    tls_encrypted_bytes => "Plaintext bytes OpenSSL encrypted in user space (option replies and replies of TLS connections; counted when the connection closes).",
    tls_decrypted_bytes => "Plaintext bytes OpenSSL decrypted in user space (options and requests of TLS connections; counted when the connection closes).",
    ring_enters => "io_uring_enter calls (io_uring engine).",
    syscalls => "Portable engine: socket reads (a request header or payload) and reply writes (one writev each); io_uring engine: the send and sendfile calls of sendfile replies, and the FIONREAD and splice calls that take spliced writes off the socket.",
}

impl Stats {
    /// A client switched to TLS.
    pub fn tls_connection(&self) {
        self.tls_connections.add(1);
    }

    /// A TLS session ended having encrypted and decrypted this many plaintext bytes.
    pub fn tls_session_closed(&self, encrypted: u64, decrypted: u64) {
        self.tls_encrypted_bytes.add(encrypted);
        self.tls_decrypted_bytes.add(decrypted);
    }

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

    #[test]
    fn renders_every_counter() {
        let stats = Stats::default();
        stats.sent_splice_bytes.add(4096);
        stats.requests.add(2);
        let text = stats.render_prometheus();
        assert!(text.contains("zcnbd_sent_splice_bytes_total 4096\n"));
        assert!(text.contains("# TYPE zcnbd_copied_bytes_total counter\n"));
        assert!(stats.render_table().contains("requests"));
    }
}
