//! Plot tests: the PNG is written and the axis helpers label what they should.

use super::*;
use crate::bench::report::fixture::sample_results;
use crate::bench::results::Cell;

#[test]
fn plot_is_a_png() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.png");
    write_plot(&sample_results(), &path)?;
    let bytes = std::fs::read(&path)?;
    assert!(bytes.len() > 1000);
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
    // A copy to look at by eye; best effort, /tmp may be read-only somewhere.
    let _ = std::fs::copy(&path, "/tmp/bench-plot-sample.png");
    Ok(())
}

/// The fixture grown to 6 targets (one long label) and 9 block sizes, interrupted, with one
/// cell missing in the middle of a line.
fn crowded_results() -> Results {
    let mut results = sample_results();
    let extra = [
        "nbd-server:file:/var/tmp/a-long-export-name",
        "qemu-nbd:file",
        "x",
    ];
    results.targets.extend(extra.iter().map(|t| t.to_string()));
    results.block_sizes = (12..=20).map(|shift| 1u64 << shift).collect();
    let mut cells = Vec::new();
    for (t, target) in results.targets.iter().enumerate() {
        let model = results.targets[t.min(2)].as_str();
        for rw in &results.rws {
            for (i, &bs) in results.block_sizes.iter().enumerate() {
                let Some(base) = results.cell(model, rw, 4096, 32) else {
                    continue;
                };
                let mut cell = Cell {
                    target: target.clone(),
                    bs,
                    ..base.clone()
                };
                let scale = (1.0 + i as f64 * 0.6) / (1.0 + t.saturating_sub(2) as f64 * 0.3);
                for s in &mut cell.samples {
                    s.mib_s *= scale;
                    s.iops = s.mib_s * 1_048_576.0 / bs as f64;
                }
                cells.push(cell);
            }
        }
    }
    cells.retain(|c| !(c.target == "x" && c.bs == 65536));
    results.cells = cells;
    results.interrupted = true;
    results
}

#[test]
fn crowded_run_still_plots() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.png");
    write_plot(&crowded_results(), &path)?;
    assert!(std::fs::read(&path)?.starts_with(b"\x89PNG"));
    let _ = std::fs::copy(&path, "/tmp/bench-plot-stress.png");
    Ok(())
}

#[test]
fn lines_break_at_missing_cells() {
    let runs = contiguous_runs(&[(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]);
    assert_eq!(runs, [vec![(0.0, 1.0), (1.0, 2.0)], vec![(3.0, 4.0)]]);
    assert!(contiguous_runs(&[]).is_empty());
}

#[test]
fn empty_run_is_an_error() {
    let mut results = sample_results();
    results.rws.clear();
    let dir = std::env::temp_dir().join("never-written.png");
    assert!(matches!(write_plot(&results, &dir), Err(PlotError::Empty)));
    results.rws = (0..9).map(|i| format!("rw{i}")).collect();
    let err = write_plot(&results, &dir);
    assert!(matches!(err, Err(PlotError::TooManyRws { rws: 9 })));
}

#[test]
fn log_ticks_are_one_two_five() {
    assert_eq!(
        log_ticks(1_400.0, 375_000.0),
        [2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5]
    );
    assert_eq!(log_ticks(0.5, 1.0), [0.5, 1.0]);
    assert!(log_ticks(0.0, 1.0).is_empty());
}

#[test]
fn block_size_labels_only_on_ticks() {
    let results = sample_results();
    assert_eq!(block_size_label(&results, 0.0), "4k");
    assert_eq!(block_size_label(&results, 2.0), "1m");
    assert_eq!(block_size_label(&results, 0.5), "");
    assert_eq!(block_size_label(&results, 3.0), "");
}
