//! How the server is asked to move bytes: the engine (`--engine`), the data path
//! (`--data-path`) and the thresholds between mechanisms, with the measurements behind each
//! default. Plain data: the io_uring engine's choices are in
//! [`super::uring::mechanism`].

/// Which engine runs transmission (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// io_uring where the kernel allows it, else portable.
    #[default]
    Auto,
    /// io_uring or fail.
    Uring,
    /// Blocking reader per connection plus worker threads.
    Portable,
}

/// How payloads move (`--data-path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataPath {
    /// Through a bounce buffer both ways: the classic path, kept as the baseline.
    Copy,
    /// Zero-copy mechanisms for every size.
    ZeroCopy,
    /// Zero-copy mechanisms where they pay, chosen per request from size and what the kernel
    /// reported.
    #[default]
    Auto,
}

/// Engine choice and tuning.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub engine: EngineKind,
    pub data_path: DataPath,
    /// Rings (threads); 0 means one per CPU.
    pub ring_threads: usize,
    /// `auto`: reads at least this long are spliced from the page cache (memory: `sendfile`);
    /// shorter ones are sent from the mapping (memory) or a buffer (files). `None`: files
    /// never (on this project's 2-vCPU loopback VMs splice measured slower than a buffer,
    /// docs/benchmarks/history.md); memory exports and a plain NBD upstream's reads (spliced
    /// from its socket through a pipe) per connection, only to a peer on another host
    /// (`uring::mechanism::remote_splice_min`: from 256 KiB).
    pub splice_min_bytes: Option<usize>,
    /// `auto`: memory-export writes up to this long are received straight into the mapping;
    /// longer ones into a buffer then copied. `None`: every size, on TCP whatever its
    /// congestion control and on Unix sockets (measured on Linux 6.18, on this project's VMs:
    /// docs/benchmarks/large-requests.md).
    pub receive_in_place_max_bytes: Option<usize>,
    /// `auto`: buffered-file writes at least this long (without FUA) are spliced from the
    /// socket through a pipe into the file; shorter ones are received into a buffer and
    /// written. Measured on this project's VMs (docs/benchmarks/history.md): from 512 KiB splice
    /// moves 1.3x the MiB/s at 0.78x the server CPU; below, the io-wq hand-off of each
    /// file splice costs more than the copy it saves.
    pub receive_splice_min_bytes: usize,
    /// `auto`: O_DIRECT reads at least this long are sent with `SENDMSG_ZC` / `SEND_ZC`.
    pub zerocopy_send_min_bytes: usize,
    /// Registered (fixed) buffer memory per ring, for O_DIRECT reads and writes (`auto` and
    /// `zerocopy`); 0 turns it off. Pinned (counts against `RLIMIT_MEMLOCK` without
    /// `CAP_IPC_LOCK`) and only on rings that serve an O_DIRECT export; at most 1 GiB.
    pub fixed_buffer_bytes_max: usize,
    /// Submission queue entries per ring.
    pub ring_entries: u32,
    /// At most this long a thread with nothing to do polls for its next request before it
    /// sleeps (adaptive, see `engine/poll.rs`); zero: never. Ring threads, and portable
    /// connections whose requests all run on their reader.
    pub poll_max: std::time::Duration,
    /// At most this long a thread coalesces for a client that pipelines, while trials say it
    /// pays (see `engine/wait_trial.rs`); zero: never.
    pub coalesce_max: std::time::Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            engine: EngineKind::Auto,
            data_path: DataPath::Auto,
            ring_threads: 0,
            splice_min_bytes: None,
            receive_in_place_max_bytes: None,
            receive_splice_min_bytes: 512 * 1024,
            zerocopy_send_min_bytes: 64 * 1024,
            // Room for 31 1 MiB requests in flight (each takes a page of header room too).
            fixed_buffer_bytes_max: 32 << 20,
            ring_entries: 1024,
            poll_max: std::time::Duration::from_micros(super::poll::POLL_MAX_US_DEFAULT),
            coalesce_max: std::time::Duration::from_micros(
                super::wait_trial::COALESCE_MAX_US_DEFAULT,
            ),
        }
    }
}
