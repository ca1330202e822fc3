//! The reports of a `zcnbd bench` run: the terminal table, the same content as GitHub markdown
//! (for docs/benchmarks/), and JSON with every sample plus the per-cell summaries.
//!
//! Layout, in the seeds' before/after spirit: one block per rw mode; inside it one row per
//! (block size, target), the first target being the base every ratio is taken against. A header
//! says which machine and workload the numbers come from and what the loopback could do at best;
//! a trailing section lists the zcnbd server's data-path counters, which prove which path
//! (copy, splice, zero-copy) the bytes actually took.

mod grid;
pub(super) mod human;
mod summary;

#[cfg(test)]
pub(super) mod fixture;
#[cfg(test)]
mod tests;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use self::grid::{Align, Grid};
use self::summary::{summaries, CellSummary};
use crate::bench::results::{Ceiling, Machine, Results, Workload};

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The results could not be serialized to JSON.
    #[error("serializing the results to JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The report file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// What the filesystem said.
        source: std::io::Error,
    },
}

/// The JSON document: the whole run (every cell, every sample) plus one summary per cell.
#[derive(Serialize)]
struct JsonReport<'a> {
    #[serde(flatten)]
    results: &'a Results,
    summary: Vec<CellSummary>,
}

/// The terminal table: header, loud warnings, one block per rw mode, then the data paths.
pub fn render_table(results: &Results) -> String {
    let rows = summaries(results);
    let mut out = String::new();
    for warning in warnings(results, &rows) {
        let _ = writeln!(out, "!!! {warning}");
    }
    let _ = writeln!(out, "machine:   {}", machine_line(&results.machine));
    let _ = writeln!(out, "workload:  {}", workload_line(&results.workload));
    if let Some(ceiling) = &results.ceiling {
        let _ = writeln!(out, "loopback ceiling: {}", ceiling_line(ceiling));
    }
    for (i, pair) in notes(results).chunks(2).enumerate() {
        let label = if i == 0 { "notes:" } else { "" };
        let _ = writeln!(out, "{label:<11}{}", pair.join("; "));
    }
    for rw in &results.rws {
        let _ = write!(
            out,
            "\n{rw}\n{}",
            performance(results, &rows, rw, false).to_text("  ")
        );
    }
    let counters = counters(results, &rows);
    if !counters.is_empty() {
        let _ = write!(
            out,
            "\n{}\n{}",
            counters_title(results),
            counters.to_text("  ")
        );
    }
    out
}

/// The same content as [`render_table`], as GitHub markdown with one table per rw mode.
pub fn render_markdown(results: &Results) -> String {
    let rows = summaries(results);
    let mut out = String::from("## zcnbd bench\n\n");
    for warning in warnings(results, &rows) {
        let _ = writeln!(out, "> **{warning}**\n");
    }
    let _ = writeln!(out, "- **Machine:** {}", machine_line(&results.machine));
    let _ = writeln!(out, "- **Workload:** {}", workload_line(&results.workload));
    if let Some(ceiling) = &results.ceiling {
        let _ = writeln!(out, "- **Loopback ceiling:** {}", ceiling_line(ceiling));
    }
    let _ = writeln!(out, "- **Notes:** {}", notes(results).join("; "));
    for rw in &results.rws {
        let grid = performance(results, &rows, rw, true);
        let _ = write!(out, "\n### {rw}\n\n{}", grid.to_markdown());
    }
    let counters = counters(results, &rows);
    if !counters.is_empty() {
        let title = counters_title(results);
        let _ = write!(out, "\n### {title}\n\n{}", counters.to_markdown());
    }
    out
}

/// Writes the whole run and the per-cell summaries as pretty JSON to `path`.
pub fn write_json(results: &Results, path: &Path) -> Result<(), ReportError> {
    let report = JsonReport {
        results,
        summary: summaries(results),
    };
    let mut json = serde_json::to_vec_pretty(&report)?;
    json.push(b'\n');
    write_file(path, &json)
}

/// Writes [`render_markdown`] to `path`.
pub fn write_markdown(results: &Results, path: &Path) -> Result<(), ReportError> {
    write_file(path, render_markdown(results).as_bytes())
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// One line: `Intel Xeon …, 2 CPUs, 7.8 GiB, kernel 6.1.0, tcp cubic`.
pub(super) fn machine_line(m: &Machine) -> String {
    format!(
        "{}, {} CPUs, {:.1} GiB, kernel {}, tcp {}",
        m.cpu, m.cpus, m.memory_gib, m.kernel, m.tcp_congestion_control
    )
}

/// One line with every workload knob, so a table is never read without its conditions.
pub(super) fn workload_line(w: &Workload) -> String {
    let on_off = |b: bool| if b { "on" } else { "off" };
    let warm = match w.warm {
        true => ", warmed (each target read once first)",
        false => "",
    };
    format!(
        "client {} over {}, iodepth {}, jobs {}, connections {}, runtime {}, size {}, repeat {}, prefill {}, verify {}{warm}",
        w.client,
        w.network,
        w.iodepths
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        w.jobs,
        w.connections,
        human::seconds(w.runtime_s),
        human::bytes(w.size_bytes),
        w.repeat,
        on_off(w.prefill),
        on_off(w.verify),
    )
}

/// The ceiling's two numbers: `send() 4200 MiB/s, sendfile() 5600 MiB/s`.
fn ceiling_line(c: &Ceiling) -> String {
    format!(
        "send() {} MiB/s, sendfile() {} MiB/s",
        human::mib_s(c.send_mib_s),
        human::mib_s(c.sendfile_mib_s)
    )
}

/// How to read the columns, one short note each.
fn notes(results: &Results) -> Vec<String> {
    let base = results
        .targets
        .first()
        .map_or("the first target", String::as_str);
    let mut notes = vec![
        format!("medians over {} repeats", results.workload.repeat),
        format!("vs: MiB/s relative to {base}"),
    ];
    if results.workload.repeat > 1 {
        notes.push("±: (max - min) / median of MiB/s".into());
    }
    if results.ceiling.is_some() {
        notes.push("% ceiling: MiB/s over the better loopback ceiling".into());
    }
    if results.measured_receive_threads() {
        notes.push(
            "rx: CPU per GiB of the kernel's receive thread at that end of the veth pair, \
             charged to neither process"
                .into(),
        );
    }
    notes
}

/// What must be read before any number: an interrupted run, lost data, failed requests.
fn warnings(results: &Results, rows: &[CellSummary]) -> Vec<String> {
    let mut out = Vec::new();
    if results.interrupted {
        out.push("INTERRUPTED: the run was stopped; only cells that finished are shown".into());
    }
    for r in rows.iter().filter(|r| r.has_errors()) {
        let depth = match results.several_iodepths() {
            true => format!(" iodepth {}", r.iodepth),
            false => String::new(),
        };
        out.push(format!(
            "ERRORS in {} {} {}{depth}: {} verify errors, {} failed requests",
            r.target,
            r.rw,
            human::block_size(r.bs),
            r.verify_errors,
            r.errors
        ));
    }
    out
}

/// Which optional columns this run needs.
struct Columns {
    /// Several iodepths: a column says which.
    depth: bool,
    spread: bool,
    server_cpu: bool,
    /// The receive threads at each end (`--netns`).
    receive: bool,
    ceiling: bool,
    errors: bool,
}

impl Columns {
    fn of(results: &Results, rows: &[CellSummary]) -> Self {
        Self {
            depth: results.several_iodepths(),
            spread: results.workload.repeat > 1 || rows.iter().any(|r| r.sample_count > 1),
            server_cpu: rows.iter().any(|r| r.server_cpu_s_per_gib.is_some()),
            receive: rows
                .iter()
                .any(|r| r.server_receive_cpu_s_per_gib.is_some()),
            ceiling: results.ceiling.is_some(),
            errors: rows.iter().any(CellSummary::has_errors),
        }
    }

    /// The column titles; `base` is the first target, the ratios' denominator.
    fn header(&self, base: &str) -> Vec<(String, Align)> {
        let right = |title: &str| (title.to_string(), Align::Right);
        let mut cols = vec![("bs".into(), Align::Left)];
        if self.depth {
            cols.push(right("iodepth"));
        }
        cols.push(("target".into(), Align::Left));
        cols.push(right("MiB/s"));
        if self.spread {
            cols.push(right("±"));
        }
        cols.extend([right("IOPS"), right("p50"), right("p99")]);
        cols.push(right(&format!("vs {base}")));
        cols.push(right("client CPU s/GiB"));
        if self.server_cpu {
            cols.push(right("server CPU s/GiB"));
        }
        if self.receive {
            cols.push(right("server rx s/GiB"));
            cols.push(right("client rx s/GiB"));
        }
        if self.ceiling {
            cols.push(right("% ceiling"));
        }
        if self.errors {
            cols.push(("errors".into(), Align::Left));
        }
        cols
    }

    /// The measured columns of one cell; `is_base` marks the first target's row.
    fn row(&self, r: &CellSummary, is_base: bool) -> Vec<String> {
        let mut row = vec![human::mib_s(r.mib_s)];
        if self.spread {
            row.push(human::spread(r.mib_s_spread));
        }
        row.push(human::count(r.iops));
        row.push(human::latency_us(r.lat_p50_us));
        row.push(human::latency_us(r.lat_p99_us));
        row.push(match r.ratio_to_first {
            _ if is_base => "base".into(),
            Some(ratio) => human::ratio(ratio),
            None => "-".into(),
        });
        row.push(human::cpu_s_per_gib(r.client_cpu_s_per_gib));
        if self.server_cpu {
            row.push(
                r.server_cpu_s_per_gib
                    .map_or("-".into(), human::cpu_s_per_gib),
            );
        }
        if self.receive {
            for cpu in [
                r.server_receive_cpu_s_per_gib,
                r.client_receive_cpu_s_per_gib,
            ] {
                row.push(cpu.map_or("-".into(), human::cpu_s_per_gib));
            }
        }
        if self.ceiling {
            row.push(r.ceiling_fraction.map_or("-".into(), human::percent));
        }
        if self.errors && r.has_errors() {
            row.push(format!(
                "!!! {} verify, {} failed",
                r.verify_errors, r.errors
            ));
        }
        row
    }
}

/// The block of one rw mode: a row per (block size, iodepth, target), the base target's ratio
/// as "base".
fn performance(results: &Results, rows: &[CellSummary], rw: &str, repeat_bs: bool) -> Grid {
    let base = results.targets.first().map_or("first", String::as_str);
    let columns = Columns::of(results, rows);
    let mut grid = Grid::new(columns.header(base));
    for &bs in &results.block_sizes {
        for (d, &depth) in results.workload.iodepths.iter().enumerate() {
            for (i, target) in results.targets.iter().enumerate() {
                let first = i == 0 || repeat_bs;
                let bs_label = match first && (d == 0 || repeat_bs) {
                    true => human::block_size(bs),
                    false => String::new(),
                };
                let mut row = vec![bs_label];
                if columns.depth {
                    row.push(if first {
                        depth.to_string()
                    } else {
                        String::new()
                    });
                }
                row.push(target.clone());
                let cell = rows.iter().find(|r| {
                    r.rw == rw && r.bs == bs && r.iodepth == depth && &r.target == target
                });
                match cell {
                    Some(r) => row.extend(columns.row(r, i == 0)),
                    None => row.push("not run".into()),
                }
                grid.push(row);
            }
        }
    }
    grid
}

fn counters_title(results: &Results) -> String {
    let repeats = results.workload.repeat;
    format!("zcnbd server data path (MiB, summed over {repeats} repeats)")
}

/// The data-path counters of every cell that has them, by target, rw, block size: which path
/// the bytes took.
fn counters(results: &Results, rows: &[CellSummary]) -> Grid {
    let several = results.several_iodepths();
    let mut left: Vec<(String, Align)> = ["target", "rw", "bs"]
        .map(|t| (t.to_string(), Align::Left))
        .into();
    if several {
        left.push(("iodepth".into(), Align::Right));
    }
    let right = [
        "plain",
        "splice",
        "zerocopy",
        "zerocopy-copied",
        "in-place",
        "spliced-in",
        "copied",
    ]
    .map(|t| (t.to_string(), Align::Right));
    let mut grid = Grid::new(left.into_iter().chain(right).collect());
    let by_target = results
        .targets
        .iter()
        .flat_map(|t| rows.iter().filter(move |r| &r.target == t));
    for r in by_target {
        let Some(c) = r.server_counters else { continue };
        let mut row = vec![r.target.clone(), r.rw.clone(), human::block_size(r.bs)];
        if several {
            row.push(r.iodepth.to_string());
        }
        row.extend([
            human::mib(c.sent_plain_bytes),
            human::mib(c.sent_splice_bytes),
            human::mib(c.sent_zerocopy_bytes),
            human::mib(c.sent_zerocopy_copied_bytes),
            human::mib(c.received_in_place_bytes),
            human::mib(c.received_splice_bytes),
            human::mib(c.copied_bytes),
        ]);
        grid.push(row);
    }
    grid
}
