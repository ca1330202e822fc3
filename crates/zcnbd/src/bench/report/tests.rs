//! Report tests over the synthetic run in `fixture`.

use super::fixture::{sample_results, BLOCK_SIZES, RWS, TARGETS};
use super::*;

#[test]
fn table_has_header_labels_and_ratios() {
    let table = render_table(&sample_results());
    println!("{table}");
    assert!(table.contains(
        "machine:   AMD EPYC 7B13, 2 CPUs, 7.8 GiB, kernel 6.1.0-18-cloud-amd64, tcp cubic"
    ));
    assert!(table.contains("iodepth 32, jobs 1, connections 1, runtime 10 s, size 1 GiB"));
    assert!(table.contains("repeat 3, prefill on, verify on"));
    assert!(table.contains("loopback ceiling: send() 4200 MiB/s, sendfile() 5600 MiB/s"));
    for label in [
        "4k",
        "64k",
        "1m",
        "randread",
        "randwrite",
        "vs zcnbd:memory:copy",
    ] {
        assert!(table.contains(label), "missing {label}");
    }
    for target in TARGETS {
        assert!(table.contains(target), "missing {target}");
    }
    assert!(table.contains("1.40×"));
    assert!(table.contains("0.80×"));
    assert!(table.contains("base"));
    assert!(table.contains("±"));
    assert!(table.contains("µs"));
    assert!(!table.contains("!!!"), "no warnings expected");
}

#[test]
fn table_fits_160_columns() {
    let table = render_table(&sample_results());
    for line in table.lines() {
        assert!(line.chars().count() <= 160, "too wide: {line}");
    }
}

#[test]
fn table_lists_the_data_path_counters() {
    let table = render_table(&sample_results());
    let (_, counters) = table
        .split_once("zcnbd server data path (MiB, summed over 3 repeats)")
        .expect("counters section");
    // Two zcnbd targets × 2 rw × 3 bs, plus the header and its rule.
    assert_eq!(
        counters.trim().lines().count(),
        2 + 2 * RWS.len() * BLOCK_SIZES.len()
    );
    assert!(counters.contains("zerocopy"));
    assert!(!counters.contains("nbdkit"));
}

#[test]
fn table_is_loud_about_errors_and_interruptions() {
    let mut results = sample_results();
    results.interrupted = true;
    results.cells[4].samples[1].verify_errors = 3;
    results.cells[5].samples[0].errors = 2;
    results.cells.pop();
    let table = render_table(&results);
    println!("{table}");
    assert!(table.starts_with("!!! INTERRUPTED"));
    assert!(table.contains("!!! ERRORS in zcnbd:memory randread 64k: 3 verify errors"));
    assert!(table.contains("!!! ERRORS in nbdkit:memory randread 64k: 0 verify errors, 2 failed"));
    assert!(table.contains("!!! 3 verify, 0 failed"));
    assert!(table.contains("not run"));
    let markdown = render_markdown(&results);
    assert!(markdown.starts_with("## zcnbd bench\n\n> **INTERRUPTED"));
    assert!(markdown.contains("> **ERRORS in zcnbd:memory randread 64k"));
}

#[test]
fn table_without_repeats_or_ceiling_drops_those_columns() {
    let mut results = sample_results();
    results.workload.repeat = 1;
    results.ceiling = None;
    for cell in &mut results.cells {
        cell.samples.truncate(1);
    }
    let table = render_table(&results);
    assert!(!table.contains("±"));
    assert!(!table.contains("% ceiling"));
    assert!(!table.contains("loopback ceiling"));
}

#[test]
fn receive_threads_get_columns_only_when_measured() {
    let results = sample_results();
    assert!(!render_table(&results).contains("rx s/GiB"));
    let mut netns = sample_results();
    for (k, sample) in netns
        .cells
        .iter_mut()
        .flat_map(|c| &mut c.samples)
        .enumerate()
    {
        sample.server_receive_cpu_s_per_gib = Some(0.04);
        sample.client_receive_cpu_s_per_gib = Some(0.125 + k as f64 * 1e-6);
    }
    let markdown = render_markdown(&netns);
    let (_, section) = markdown.split_once("### randread\n\n").expect("heading");
    let header = section.lines().next().expect("header");
    assert!(
        header.contains("| server CPU s/GiB | server rx s/GiB | client rx s/GiB |"),
        "{header}"
    );
    let row = section.lines().nth(2).expect("a row");
    assert!(row.contains(" | 0.040 | 0.125 |"), "{row}");
    assert!(markdown.contains("rx: CPU per GiB of the kernel's receive thread"));
}

#[test]
fn markdown_has_a_table_per_rw_mode() {
    let markdown = render_markdown(&sample_results());
    println!("{markdown}");
    for rw in RWS {
        let (_, section) = markdown
            .split_once(&format!("### {rw}\n\n"))
            .expect("rw heading");
        assert!(section.starts_with("| bs | target | MiB/s |"));
        let rows = section.lines().take_while(|l| l.starts_with('|')).count();
        assert_eq!(rows, 2 + TARGETS.len() * BLOCK_SIZES.len());
    }
    assert!(markdown.contains("- **Loopback ceiling:** send() 4200 MiB/s"));
    assert!(markdown.contains("| 64k | zcnbd:memory |"));
    assert!(markdown.contains("### zcnbd server data path"));
}

#[test]
fn json_has_every_cell_sample_and_summary() -> Result<(), Box<dyn std::error::Error>> {
    let results = sample_results();
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.json");
    write_json(&results, &path)?;
    let value: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    let cells = value["cells"].as_array().ok_or("cells")?;
    assert_eq!(cells.len(), TARGETS.len() * RWS.len() * BLOCK_SIZES.len());
    for cell in cells {
        assert_eq!(cell["samples"].as_array().ok_or("samples")?.len(), 3);
    }
    assert_eq!(value["machine"]["cpus"], 2);
    assert_eq!(value["workload"]["repeat"], 3);
    assert_eq!(value["ceiling"]["sendfile_mib_s"], 5600.0);
    let summary = value["summary"].as_array().ok_or("summary")?;
    assert_eq!(summary.len(), cells.len());
    let zc = summary
        .iter()
        .find(|s| s["target"] == "zcnbd:memory" && s["rw"] == "randread" && s["bs"] == 4096)
        .ok_or("zcnbd randread 4k summary")?;
    let ratio = zc["ratio_to_first"].as_f64().ok_or("ratio")?;
    assert!((ratio - 1.4).abs() < 1e-9);
    assert!(zc["server_counters"]["sent_zerocopy_bytes"].as_u64() > Some(0));
    Ok(())
}

#[test]
fn markdown_file_is_written() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("BENCHMARKS.md");
    write_markdown(&sample_results(), &path)?;
    assert!(std::fs::read_to_string(&path)?.contains("### randwrite"));
    let missing = dir.path().join("no/such/dir/x.md");
    let err = write_markdown(&sample_results(), &missing);
    assert!(matches!(err, Err(ReportError::Write { .. })));
    Ok(())
}

#[test]
fn several_iodepths_get_a_column_and_ratios_of_their_own() {
    let mut results = sample_results();
    // The same cells again at iodepth 1, each target at half the speed.
    let shallow: Vec<_> = results
        .cells
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c.iodepth = 1;
            for s in &mut c.samples {
                s.mib_s /= 2.0;
            }
            c
        })
        .collect();
    results.cells.extend(shallow);
    results.workload.iodepths = vec![1, 32];
    let table = render_table(&results);
    println!("{table}");
    assert!(table.contains("iodepth 1,32, jobs 1"));
    let header = table
        .lines()
        .find(|l| l.contains("bs") && l.contains("target"))
        .unwrap();
    assert!(header.contains("iodepth"), "{header}");
    // Each depth's ratios are to the first target at that depth: unchanged by the halving.
    let rows = summaries(&results);
    assert_eq!(
        rows.len(),
        2 * RWS.len() * BLOCK_SIZES.len() * TARGETS.len()
    );
    for r in &rows {
        let twin = rows
            .iter()
            .find(|o| {
                o.target == r.target && o.rw == r.rw && o.bs == r.bs && o.iodepth != r.iodepth
            })
            .unwrap();
        assert_eq!(
            r.ratio_to_first.map(|x| (x * 1000.0).round()),
            twin.ratio_to_first.map(|x| (x * 1000.0).round())
        );
    }
    // The single-depth table has no such column.
    let single = render_table(&sample_results());
    let header = single
        .lines()
        .find(|l| l.contains("bs") && l.contains("target"))
        .unwrap();
    assert!(!header.contains("iodepth"), "{header}");
}
