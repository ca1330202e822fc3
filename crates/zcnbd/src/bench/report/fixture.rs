//! A synthetic run for the report and plot tests: 3 targets × 2 rw modes × 3 block sizes,
//! 3 repeats each, with a loopback ceiling and zcnbd server counters.

use crate::bench::results::{Ceiling, Cell, Machine, Results, Sample, ServerCounters, Workload};

/// Target labels, base first.
pub const TARGETS: [&str; 3] = ["zcnbd:memory:copy", "zcnbd:memory", "nbdkit:memory"];
/// rw modes.
pub const RWS: [&str; 2] = ["randread", "randwrite"];
/// Block sizes.
pub const BLOCK_SIZES: [u64; 3] = [4096, 65536, 1 << 20];

/// The whole synthetic run.
pub fn sample_results() -> Results {
    let mut cells = Vec::new();
    for rw in RWS {
        for &bs in &BLOCK_SIZES {
            for target in TARGETS {
                cells.push(Cell {
                    target: target.to_string(),
                    rw: rw.to_string(),
                    bs,
                    iodepth: 32,
                    samples: (0..3).map(|i| sample(target, rw, bs, i)).collect(),
                });
            }
        }
    }
    Results {
        machine: Machine {
            cpu: "AMD EPYC 7B13".to_string(),
            cpus: 2,
            memory_gib: 7.8,
            kernel: "6.1.0-18-cloud-amd64".to_string(),
            tcp_congestion_control: "cubic".to_string(),
        },
        workload: Workload {
            iodepths: vec![32],
            jobs: 1,
            connections: 1,
            runtime_s: 10.0,
            size_bytes: 1 << 30,
            repeat: 3,
            prefill: true,
            warm: false,
            verify: true,
            client: "zcnbd".to_string(),
            network: "loopback".to_string(),
        },
        targets: TARGETS.iter().map(|t| t.to_string()).collect(),
        rws: RWS.iter().map(|r| r.to_string()).collect(),
        block_sizes: BLOCK_SIZES.to_vec(),
        ceiling: Some(Ceiling {
            send_mib_s: 4200.0,
            sendfile_mib_s: 5600.0,
        }),
        cells,
        interrupted: false,
    }
}

/// Plausible numbers: zcnbd 1.4× the copying zcnbd, nbdkit 0.8×, throughput rising with bs.
fn sample(target: &str, rw: &str, bs: u64, repeat: u32) -> Sample {
    let speed = match target {
        "zcnbd:memory" => 1.4,
        "nbdkit:memory" => 0.8,
        _ => 1.0,
    };
    let rw_factor = if rw == "randread" { 1.0 } else { 0.85 };
    let base_mib_s = match bs {
        4096 => 690.0,
        65536 => 2100.0,
        _ => 3000.0,
    };
    let jitter = 1.0 + 0.01 * f64::from(repeat);
    let mib_s = base_mib_s * speed * rw_factor * jitter;
    let iops = mib_s * 1_048_576.0 / bs as f64;
    let lat_p50_us = 32.0 * 1e6 / iops;
    let zerocopy = target == "zcnbd:memory";
    let moved = (mib_s * 10.0 * 1_048_576.0) as u64;
    Sample {
        iops,
        mib_s,
        lat_p50_us,
        lat_p99_us: lat_p50_us * 2.5,
        lat_p999_us: lat_p50_us * 4.0,
        client_cpu_s_per_gib: 0.4 / speed,
        server_cpu_s_per_gib: Some(0.3 / speed),
        server_receive_cpu_s_per_gib: None,
        client_receive_cpu_s_per_gib: None,
        server_counters: target
            .starts_with("zcnbd")
            .then(|| counters(rw == "randread", zerocopy, moved)),
        verify_errors: 0,
        errors: 0,
    }
}

/// Where `moved` bytes went: reads are sent, writes received; zcnbd:memory:copy copies.
fn counters(read: bool, zerocopy: bool, moved: u64) -> ServerCounters {
    let pick = |wanted: bool| if wanted { moved } else { 0 };
    ServerCounters {
        sent_plain_bytes: pick(read && !zerocopy),
        sent_zerocopy_bytes: pick(read && zerocopy),
        received_in_place_bytes: pick(!read && zerocopy),
        copied_bytes: pick(!zerocopy),
        ..ServerCounters::default()
    }
}
