//! One summary per cell: the medians, spreads and ratios every report shows, computed once so
//! the table, the markdown and the JSON `summary` array cannot disagree.

use serde::Serialize;

use crate::bench::results::{median, Cell, Results, Sample, ServerCounters};

/// The per-cell numbers a report prints (medians over the repeats).
#[derive(Debug, Clone, Serialize)]
pub struct CellSummary {
    /// Target label.
    pub target: String,
    /// fio-style rw mode.
    pub rw: String,
    /// Block size in bytes.
    pub bs: u64,
    /// Requests in flight per job.
    pub iodepth: u32,
    /// How many repeats the medians are over.
    pub sample_count: usize,
    /// Median MiB/s.
    pub mib_s: f64,
    /// Spread of MiB/s over the repeats, as a fraction of the median.
    pub mib_s_spread: f64,
    /// Median operations per second.
    pub iops: f64,
    /// Spread of IOPS over the repeats, as a fraction of the median.
    pub iops_spread: f64,
    /// Median over the repeats of the p50 latency, microseconds.
    pub lat_p50_us: f64,
    /// Median over the repeats of the p99 latency, microseconds.
    pub lat_p99_us: f64,
    /// Median over the repeats of the p99.9 latency, microseconds.
    pub lat_p999_us: f64,
    /// Median MiB/s over the first target's median MiB/s for the same rw and bs.
    pub ratio_to_first: Option<f64>,
    /// Median client CPU seconds per GiB.
    pub client_cpu_s_per_gib: f64,
    /// Median server CPU seconds per GiB, over the repeats that measured it.
    pub server_cpu_s_per_gib: Option<f64>,
    /// Median CPU seconds per GiB of the receive threads at the servers' end (`--netns`).
    pub server_receive_cpu_s_per_gib: Option<f64>,
    /// The same at the client's end.
    pub client_receive_cpu_s_per_gib: Option<f64>,
    /// Median MiB/s as a fraction of the loopback ceiling's best.
    pub ceiling_fraction: Option<f64>,
    /// Verify errors, summed over the repeats.
    pub verify_errors: u64,
    /// Failed requests, summed over the repeats.
    pub errors: u64,
    /// The zcnbd server's data-path counters, summed over the repeats.
    pub server_counters: Option<ServerCounters>,
}

impl CellSummary {
    /// Summarize one cell of `results`.
    pub fn of(results: &Results, cell: &Cell) -> Self {
        let mib_s = cell.median_of(|s| s.mib_s);
        let ceiling = results.ceiling.map(|c| c.best_mib_s()).filter(|&b| b > 0.0);
        Self {
            target: cell.target.clone(),
            rw: cell.rw.clone(),
            bs: cell.bs,
            iodepth: cell.iodepth,
            sample_count: cell.samples.len(),
            mib_s,
            mib_s_spread: cell.spread_of(|s| s.mib_s),
            iops: cell.median_of(|s| s.iops),
            iops_spread: cell.spread_of(|s| s.iops),
            lat_p50_us: cell.median_of(|s| s.lat_p50_us),
            lat_p99_us: cell.median_of(|s| s.lat_p99_us),
            lat_p999_us: cell.median_of(|s| s.lat_p999_us),
            ratio_to_first: results.ratio_to_first(cell),
            client_cpu_s_per_gib: cell.median_of(|s| s.client_cpu_s_per_gib),
            server_cpu_s_per_gib: median_where(cell, |s| s.server_cpu_s_per_gib),
            server_receive_cpu_s_per_gib: median_where(cell, |s| s.server_receive_cpu_s_per_gib),
            client_receive_cpu_s_per_gib: median_where(cell, |s| s.client_receive_cpu_s_per_gib),
            ceiling_fraction: ceiling.map(|best| mib_s / best),
            verify_errors: total(cell, |s| s.verify_errors),
            errors: total(cell, |s| s.errors),
            server_counters: summed_counters(cell),
        }
    }

    /// Whether any repeat of this cell lost data or requests.
    pub fn has_errors(&self) -> bool {
        self.verify_errors > 0 || self.errors > 0
    }
}

/// The median of `field` over the repeats that measured it; `None` if none did.
fn median_where(cell: &Cell, field: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
    let measured: Vec<f64> = cell.samples.iter().filter_map(field).collect();
    (!measured.is_empty()).then(|| median(&measured))
}

/// Summaries of every cell that ran, in report order: rw, then block size, then iodepth,
/// then target.
pub fn summaries(results: &Results) -> Vec<CellSummary> {
    let mut out = Vec::with_capacity(results.cells.len());
    for rw in &results.rws {
        for &bs in &results.block_sizes {
            for &depth in &results.workload.iodepths {
                for target in &results.targets {
                    if let Some(cell) = results.cell(target, rw, bs, depth) {
                        out.push(CellSummary::of(results, cell));
                    }
                }
            }
        }
    }
    out
}

/// One count summed over the repeats (saturating: a report must not panic).
fn total(cell: &Cell, field: impl Fn(&Sample) -> u64) -> u64 {
    cell.samples.iter().map(field).fold(0, u64::saturating_add)
}

/// The counters summed over the repeats that reported them (`None` if none did).
fn summed_counters(cell: &Cell) -> Option<ServerCounters> {
    cell.samples
        .iter()
        .filter_map(|s| s.server_counters)
        .reduce(|a, b| ServerCounters {
            sent_plain_bytes: a.sent_plain_bytes.saturating_add(b.sent_plain_bytes),
            sent_splice_bytes: a.sent_splice_bytes.saturating_add(b.sent_splice_bytes),
            sent_zerocopy_bytes: a.sent_zerocopy_bytes.saturating_add(b.sent_zerocopy_bytes),
            sent_zerocopy_copied_bytes: a
                .sent_zerocopy_copied_bytes
                .saturating_add(b.sent_zerocopy_copied_bytes),
            received_in_place_bytes: a
                .received_in_place_bytes
                .saturating_add(b.received_in_place_bytes),
            received_splice_bytes: a
                .received_splice_bytes
                .saturating_add(b.received_splice_bytes),
            copied_bytes: a.copied_bytes.saturating_add(b.copied_bytes),
        })
}
