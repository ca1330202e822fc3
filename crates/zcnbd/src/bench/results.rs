//! What a benchmark run measured: one record per (target, rw mode, block size, iodepth) cell and
//! repeat, and the summaries (median, spread, ratio to the first target) every report uses.

use serde::Serialize;

/// The machine the numbers come from.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model name (from /proc/cpuinfo).
    pub cpu: String,
    /// Online CPUs.
    pub cpus: usize,
    /// Memory in GiB.
    pub memory_gib: f64,
    /// Kernel release (uname -r).
    pub kernel: String,
    /// TCP congestion control for new connections (`net.ipv4.tcp_congestion_control`):
    /// on loopback it changes results (BBR's pacing slows some connections down).
    pub tcp_congestion_control: String,
}

/// The workload, as given on the command line.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// Requests in flight per job: one set of cells per value.
    pub iodepths: Vec<u32>,
    pub jobs: u32,
    pub connections: u32,
    pub runtime_s: f64,
    pub size_bytes: u64,
    pub repeat: u32,
    pub prefill: bool,
    /// Each target's region was read once before measuring (`--warm`).
    pub warm: bool,
    pub verify: bool,
    /// Who drove the cells: `zcnbd` (its client library) or fio's version (`--client fio`).
    pub client: String,
    /// How the client reached the servers: `loopback`, or `veth to a network namespace`
    /// (`--netns`).
    pub network: String,
}

/// The loopback ceiling: one TCP stream for the same duration, sent two ways.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ceiling {
    /// MiB/s with send() from a user buffer.
    pub send_mib_s: f64,
    /// MiB/s with sendfile() from the page cache (no copy on the sender).
    pub sendfile_mib_s: f64,
}

impl Ceiling {
    /// The better of the two: what a server on this machine could reach at best.
    pub fn best_mib_s(&self) -> f64 {
        self.send_mib_s.max(self.sendfile_mib_s)
    }
}

/// A zcnbd server's data-path counters over one cell (bytes).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ServerCounters {
    pub sent_plain_bytes: u64,
    pub sent_splice_bytes: u64,
    pub sent_zerocopy_bytes: u64,
    pub sent_zerocopy_copied_bytes: u64,
    pub received_in_place_bytes: u64,
    pub received_splice_bytes: u64,
    pub copied_bytes: u64,
}

/// One measurement of one cell.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Operations per second.
    pub iops: f64,
    /// MiB per second of payload.
    pub mib_s: f64,
    /// Latency percentiles, microseconds.
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    /// Client (this process) CPU seconds per GiB moved.
    pub client_cpu_s_per_gib: f64,
    /// Server CPU seconds per GiB moved, for servers this run started.
    pub server_cpu_s_per_gib: Option<f64>,
    /// CPU seconds per GiB of the kernel's receive threads at the servers' end of `--netns`'
    /// veth pair (what the server was sent, received for it; charged to no process).
    pub server_receive_cpu_s_per_gib: Option<f64>,
    /// The same at the client's end.
    pub client_receive_cpu_s_per_gib: Option<f64>,
    /// The zcnbd server's counters during the cell, when the target is zcnbd.
    pub server_counters: Option<ServerCounters>,
    /// Blocks whose crc32c did not match (with --verify; else 0).
    pub verify_errors: u64,
    /// Requests that failed.
    pub errors: u64,
}

/// Every repeat of one cell of one target.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// Target label, as given.
    pub target: String,
    /// fio-style rw mode: randread, randwrite, read, write, randrw.
    pub rw: String,
    /// Block size in bytes.
    pub bs: u64,
    /// Requests in flight per job.
    pub iodepth: u32,
    /// One sample per repeat.
    pub samples: Vec<Sample>,
}

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Results {
    pub machine: Machine,
    pub workload: Workload,
    /// Target labels, in command-line order (the first is the ratios' base).
    pub targets: Vec<String>,
    pub rws: Vec<String>,
    pub block_sizes: Vec<u64>,
    pub ceiling: Option<Ceiling>,
    pub cells: Vec<Cell>,
    /// Whether the run was interrupted (Ctrl-C): only finished cells are present.
    pub interrupted: bool,
}

/// The median of `values` (0 for none).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// The spread of `values`: (max - min) / median, as a fraction (0 for fewer than two).
pub fn spread(values: &[f64]) -> f64 {
    let m = median(values);
    if values.len() < 2 || m == 0.0 {
        return 0.0;
    }
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    (max - min) / m
}

impl Cell {
    /// The median of one field over the repeats.
    pub fn median_of(&self, field: impl Fn(&Sample) -> f64) -> f64 {
        median(&self.samples.iter().map(field).collect::<Vec<_>>())
    }

    /// The spread of one field over the repeats.
    pub fn spread_of(&self, field: impl Fn(&Sample) -> f64) -> f64 {
        spread(&self.samples.iter().map(field).collect::<Vec<_>>())
    }
}

impl Results {
    /// Whether any sample measured `--netns`' receive threads.
    pub fn measured_receive_threads(&self) -> bool {
        self.cells
            .iter()
            .flat_map(|c| &c.samples)
            .any(|s| s.server_receive_cpu_s_per_gib.is_some())
    }

    /// The cell for `target`, `rw`, `bs` and `iodepth`, if it ran.
    pub fn cell(&self, target: &str, rw: &str, bs: u64, iodepth: u32) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.target == target && c.rw == rw && c.bs == bs && c.iodepth == iodepth)
    }

    /// Whether the run measured several iodepths (the reports then say which is which).
    pub fn several_iodepths(&self) -> bool {
        self.workload.iodepths.len() > 1
    }

    /// Median MiB/s of a cell divided by the first target's, for the same rw, bs and iodepth.
    pub fn ratio_to_first(&self, cell: &Cell) -> Option<f64> {
        let first = self.targets.first()?;
        let base = self.cell(first, &cell.rw, cell.bs, cell.iodepth)?;
        let b = base.median_of(|s| s.mib_s);
        (b > 0.0).then(|| cell.median_of(|s| s.mib_s) / b)
    }
}
