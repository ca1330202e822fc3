//! `zcnbd bench`: the seeds' before/after tables, measured with zcnbd's client library
//! against zcnbd and its peers, side by side, with the machine's loopback ceiling.
//!
//! Targets are interleaved cell by cell (and repeat by repeat), so a slow moment of a noisy
//! machine hits every target alike; reports give medians, spreads and ratios to the first.

mod ceiling;
mod creds;
mod fio;
mod machine;
mod netns;
pub mod plot;
mod prefill;
pub mod report;
pub mod results;
mod target;
mod verify;
mod web;
mod workload;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use results::{Cell, Results, Sample, Workload};
use target::{Running, TargetSpec};
use workload::{CellPlan, Rw};

/// Arguments of `zcnbd bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// NBD URIs (nbd://, nbds://, and their +unix and +vsock forms), or servers to start for
    /// the run: zcnbd:memory, zcnbd:memory:copy (the --data-path copy baseline), zcnbd:FILE
    /// (a raw file, or an existing disk image such as FILE.qcow2), nbdkit:memory, nbdkit:FILE,
    /// qemu-nbd:FILE (in the format its first bytes say; qemu-nbd options may follow, as in
    /// qemu-nbd:FILE.qcow2:--cache=none:--aio=io_uring), and on an existing Ceph RBD image of the
    /// cluster $CEPH_CONF names, zcnbd:rbd:POOL/IMAGE and qemu-nbd:rbd:POOL/IMAGE; a :tls suffix (zcnbd:memory:tls,
    /// nbdkit:memory:tls, qemu-nbd:FILE:tls) starts the server requiring TLS with
    /// certificates made for the run (certtool), and connects with nbds://; zcnbd@PATH:...
    /// starts another zcnbd build the same way (before/after tables); zcnbd:proxy,
    /// nbdkit:proxy (its nbd plugin) and qemu-nbd:proxy (an nbd+unix URI as its image) start
    /// the server as an NBD proxy in front of a zcnbd memory export this run starts (whose CPU
    /// is not counted); zcnbd:web, nbdkit:web (its curl plugin) and qemu-nbd:web (its curl
    /// driver) serve a file nginx serves over HTTP (zcnbd:webs, nbdkit:webs: HTTPS; nginx's
    /// CPU is not counted; read-only: not prefilled); fio-rbd:POOL/IMAGE
    /// (with --client fio) is fio's rbd engine on the image, no NBD in between. Ratios are to
    /// the first.
    #[arg(required = true, value_name = "TARGET")]
    targets: Vec<String>,
    /// Who drives the cells: zcnbd (zcnbd's client library, in this process) or fio (fio's nbd
    /// engine through libnbd, a process per cell; TLS through $HOME/.pki/libnbd).
    #[arg(long, value_enum, default_value = "zcnbd")]
    client: ClientKind,
    /// Access patterns (fio names): randread, randwrite, read, write, randrw.
    #[arg(long, value_delimiter = ',', default_value = "randread,randwrite")]
    rw: Vec<String>,
    /// Block sizes.
    #[arg(long, value_delimiter = ',', default_value = "4k,64k,1m")]
    bs: Vec<String>,
    /// Requests in flight per job: a list measures each (e.g. 1,16,64), interleaved.
    #[arg(long, value_delimiter = ',', default_value = "16")]
    iodepth: Vec<u32>,
    /// Jobs (threads), each with its own client.
    #[arg(long, default_value_t = 1)]
    jobs: u32,
    /// Connections per client (used when the server allows multi-conn).
    #[arg(long, default_value_t = 1)]
    connections: u32,
    /// Duration of each cell (e.g. 10s, 500ms, 1m).
    #[arg(long, default_value = "10s")]
    runtime: String,
    /// Bytes of each export to use (and the size of exports this run starts).
    #[arg(long, default_value = "1G")]
    size: String,
    /// Write the whole region before measuring, so reads see written data (the default for
    /// servers this run starts).
    #[arg(long, conflicts_with = "no_prefill")]
    prefill: bool,
    /// Do not prefill.
    #[arg(long)]
    no_prefill: bool,
    /// Read each target's whole region once before measuring (after any prefill): the
    /// measured reads are then a cache's second pass (a `--filter=cache` target's, the page
    /// cache's for a file).
    #[arg(long)]
    warm: bool,
    /// Check the crc32c of every block read back (writes write a known pattern).
    #[arg(long)]
    verify: bool,
    /// Measure every cell this many times, interleaved; report median and spread.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Skip the loopback ceiling probe.
    #[arg(long)]
    no_ceiling: bool,
    /// Start the servers in a network namespace of their own, reached over a veth pair
    /// (10.231.0.1 - 10.231.0.2), not on the loopback. Each end receives in a kernel thread
    /// of its own (threaded NAPI), as another machine would: neither process is charged for
    /// the other's receive work, and the threads' CPU is reported apart (needs root, ip and
    /// ethtool; no ceiling probe).
    #[arg(long)]
    netns: bool,
    /// Write every cell and sample as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the tables as Markdown.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// Draw MiB/s and IOPS against block size, a panel per rw mode (PNG).
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
}

/// The program that drives the cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ClientKind {
    /// zcnbd's client library.
    Zcnbd,
    /// fio 3's nbd engine (libnbd), or its rbd engine for fio-rbd: targets.
    Fio,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Target(#[from] target::TargetError),
    #[error("{target}: {source}")]
    Client {
        target: String,
        source: zcnbd_client::Error,
    },
    #[error("{target}: {source}")]
    Fio {
        target: String,
        source: fio::FioError,
    },
    #[error("ceiling probe: {0}")]
    Ceiling(std::io::Error),
    #[error(transparent)]
    Netns(#[from] netns::NetnsError),
    #[error(transparent)]
    Report(#[from] report::ReportError),
    #[error(transparent)]
    Plot(#[from] plot::PlotError),
}

/// Parses "10s", "500ms", "2m" or plain seconds (`units.rs`); more than zero.
fn parse_duration(s: &str) -> Option<Duration> {
    crate::units::parse_duration(s).filter(|d| !d.is_zero())
}

/// The deepest queue a job keeps (`--iodepth`).
const IODEPTH_MAX: u32 = 1024;

/// The parsed command line.
struct Plan {
    targets: Vec<TargetSpec>,
    rws: Vec<Rw>,
    block_sizes: Vec<u64>,
    runtime: Duration,
    size: u64,
}

fn plan(args: &BenchArgs) -> Result<Plan, BenchError> {
    let usage = |m: String| BenchError::Usage(m);
    let targets = args
        .targets
        .iter()
        .map(|t| TargetSpec::parse(t))
        .collect::<Result<Vec<_>, _>>()?;
    if args.client == ClientKind::Zcnbd {
        if let Some(t) = targets.iter().find(|t| !t.speaks_nbd()) {
            return Err(usage(format!(
                "{}: only fio reaches it (--client fio)",
                t.label
            )));
        }
    }
    if args.client == ClientKind::Fio && (args.verify || args.connections > 1) {
        return Err(usage(
            "--client fio: --verify and --connections are zcnbd client options".into(),
        ));
    }
    let rws = args
        .rw
        .iter()
        .map(|r| Rw::parse(r).ok_or_else(|| usage(format!("unknown --rw {r:?}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let block_sizes = args
        .bs
        .iter()
        .map(|b| match zcnbd_server::parse_size(b) {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(usage(format!("bad --bs {b:?}"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let runtime = parse_duration(&args.runtime)
        .ok_or_else(|| usage(format!("bad --runtime {:?}", args.runtime)))?;
    let size = zcnbd_server::parse_size(&args.size)
        .map_err(|_| usage(format!("bad --size {:?}", args.size)))?;
    if args.verify
        && block_sizes
            .iter()
            .any(|b| b % verify::VERIFY_BLOCK_BYTES as u64 != 0)
    {
        return Err(usage(
            "--verify needs block sizes that are multiples of 4k".into(),
        ));
    }
    if block_sizes.iter().any(|&b| b > size) {
        return Err(usage("a block size is larger than --size".into()));
    }
    let depths = &args.iodepth;
    if depths.is_empty() || depths.iter().any(|&d| d == 0 || d > IODEPTH_MAX) {
        return Err(usage(format!(
            "--iodepth: from 1 to {IODEPTH_MAX} (IODEPTH_MAX)"
        )));
    }
    if depths
        .iter()
        .enumerate()
        .any(|(i, d)| depths[..i].contains(d))
    {
        return Err(usage("--iodepth lists a depth twice".into()));
    }
    Ok(Plan {
        targets,
        rws,
        block_sizes,
        runtime,
        size,
    })
}

/// Runs the benchmark and prints the table; files as asked.
pub fn run(args: BenchArgs) -> Result<(), BenchError> {
    let plan = plan(&args)?;
    let stop = Arc::new(AtomicBool::new(false));
    // SIGINT or SIGTERM: report what was measured and stop the servers this run started.
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&stop));
    }
    let verify = args
        .verify
        .then(|| Arc::new(verify::Pattern::new(plan.size)));

    let creds = match plan.targets.iter().any(TargetSpec::needs_credentials) {
        true => {
            eprintln!("making TLS certificates for the run (certtool)");
            Some(creds::BenchCreds::make().map_err(target::TargetError::from)?)
        }
        false => None,
    };
    let netns = match args.netns {
        true => {
            eprintln!("making a network namespace and a veth pair for the servers");
            Some(netns::Netns::create()?)
        }
        false => None,
    };
    eprintln!("starting {} target(s)", plan.targets.len());
    let mut running = Vec::new();
    for t in &plan.targets {
        running.push(t.start(plan.size, creds.as_ref(), netns.as_ref())?);
    }
    let regions = prepare_regions(&args, &plan, &running, verify.as_deref())?;
    let ceiling = if args.no_ceiling || args.netns {
        None
    } else {
        eprintln!(
            "measuring the loopback ceiling ({:?} per sender)",
            plan.runtime
        );
        Some(ceiling::probe(plan.runtime).map_err(BenchError::Ceiling)?)
    };

    let mut results = Results {
        machine: machine::describe(),
        workload: Workload {
            iodepths: args.iodepth.clone(),
            jobs: args.jobs,
            connections: args.connections,
            runtime_s: plan.runtime.as_secs_f64(),
            size_bytes: plan.size,
            repeat: args.repeat.max(1),
            prefill: !args.no_prefill,
            warm: args.warm,
            verify: args.verify,
            network: match args.netns {
                true => "veth to a network namespace (receive in NAPI threads)".into(),
                false => "loopback".into(),
            },
            client: match args.client {
                ClientKind::Zcnbd => "zcnbd".into(),
                ClientKind::Fio => fio::version().unwrap_or_else(|| "fio".into()),
            },
        },
        targets: plan.targets.iter().map(|t| t.label.clone()).collect(),
        rws: plan.rws.iter().map(|r| r.name().to_string()).collect(),
        block_sizes: plan.block_sizes.clone(),
        ceiling,
        cells: Vec::new(),
        interrupted: false,
    };
    let servers = Servers {
        running: &running,
        regions: &regions,
        netns: netns.as_ref(),
    };
    measure(&args, &plan, &servers, verify, &stop, &mut results);
    drop(running);
    drop(creds);
    drop(netns);

    write_results(&args, &results)
}

/// The region each target is measured over (the run's size, or the export's if smaller),
/// prefilled where asked so that reads measure written data.
fn prepare_regions(
    args: &BenchArgs,
    plan: &Plan,
    running: &[target::Running],
    verify: Option<&verify::Pattern>,
) -> Result<Vec<u64>, BenchError> {
    let mut regions = Vec::new();
    for (t, r) in plan.targets.iter().zip(running) {
        let client_error = |source| BenchError::Client {
            target: t.label.clone(),
            source,
        };
        if !t.speaks_nbd() {
            if !args.no_prefill {
                eprintln!("prefilling {} with fio ({} MiB)", t.label, plan.size >> 20);
                fio::prefill(&r.fio, plan.size).map_err(|e| BenchError::Fio {
                    target: t.label.clone(),
                    source: e,
                })?;
            }
            regions.push(plan.size);
            continue;
        }
        let size = zcnbd_client::Client::connect(&r.uri)
            .map_err(client_error)?
            .size();
        let region = plan.size.min(size);
        if (t.is_started() && !t.is_read_only() && !args.no_prefill) || args.prefill {
            eprintln!("prefilling {} ({} MiB)", t.label, region >> 20);
            prefill::write_all(&r.uri, region, verify).map_err(client_error)?;
        }
        if args.warm {
            eprintln!(
                "warming {}: reading it once ({} MiB)",
                t.label,
                region >> 20
            );
            prefill::read_all(&r.uri, region).map_err(client_error)?;
        }
        regions.push(region);
    }
    Ok(regions)
}

/// The table on standard output, and the files asked for.
fn write_results(args: &BenchArgs, results: &Results) -> Result<(), BenchError> {
    println!("{}", report::render_table(results));
    if let Some(path) = &args.json {
        report::write_json(results, path)?;
    }
    if let Some(path) = &args.markdown {
        report::write_markdown(results, path)?;
    }
    if let Some(path) = &args.plot {
        plot::write_plot(results, path)?;
    }
    Ok(())
}

/// The servers a run measures: one per target, the region each is measured over, and the
/// namespace they live in (`--netns`).
struct Servers<'a> {
    running: &'a [Running],
    regions: &'a [u64],
    netns: Option<&'a netns::Netns>,
}

/// Every cell of every repeat, targets interleaved, into `results.cells`.
fn measure(
    args: &BenchArgs,
    plan: &Plan,
    servers: &Servers,
    verify: Option<Arc<verify::Pattern>>,
    stop: &AtomicBool,
    results: &mut Results,
) {
    let Servers {
        running,
        regions,
        netns,
    } = *servers;
    let repeat = args.repeat.max(1);
    let depths = &args.iodepth;
    let cells = plan.rws.len() * plan.block_sizes.len() * depths.len() * running.len();
    let runs = repeat as u64 * cells as u64;
    let bar = ProgressBar::new(runs);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} cells, {eta} left: {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    for round in 0..repeat {
        for &rw in &plan.rws {
            for (&bs, &iodepth) in plan
                .block_sizes
                .iter()
                .flat_map(|bs| depths.iter().map(move |d| (bs, d)))
            {
                for (k, (t, r)) in plan.targets.iter().zip(running).enumerate() {
                    if stop.load(Ordering::Relaxed) {
                        results.interrupted = true;
                        bar.abandon_with_message("interrupted: reporting finished cells");
                        return;
                    }
                    bar.set_message(format!(
                        "{} {} bs={} iodepth={iodepth} (repeat {}/{})",
                        t.label,
                        rw.name(),
                        report::human::block_size(bs),
                        round + 1,
                        repeat
                    ));
                    let cell = CellPlan {
                        uri: r.uri.clone(),
                        rw,
                        bs,
                        iodepth,
                        jobs: args.jobs,
                        connections: args.connections,
                        runtime: plan.runtime,
                        region: regions[k],
                        verify: verify.clone(),
                    };
                    let sample = match one_sample(&cell, r, args.client, netns, stop) {
                        Some(s) => s,
                        None => {
                            results.interrupted = true;
                            bar.abandon_with_message("interrupted: reporting finished cells");
                            return;
                        }
                    };
                    push_sample(results, &t.label, rw, (bs, iodepth), sample);
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
}

/// Measures one cell once; `None` if it was interrupted. With `netns`, the receive threads
/// at each end of its veth pair are measured too.
fn one_sample(
    cell: &CellPlan,
    server: &Running,
    client: ClientKind,
    netns: Option<&netns::Netns>,
    stop: &AtomicBool,
) -> Option<Sample> {
    let counters_before = server.counters();
    let server_cpu_before = server.cpu_seconds();
    let receive_cpu_before = netns.and_then(netns::Netns::receive_cpu_seconds);
    let client_cpu = || match client {
        ClientKind::Zcnbd => machine::cpu_seconds("self"),
        ClientKind::Fio => machine::children_cpu_seconds(),
    };
    let client_cpu_before = client_cpu();
    let measured = match client {
        ClientKind::Zcnbd => workload::run(cell, stop)
            .map(Measured::from_workload)
            .map_err(|e| e.to_string()),
        ClientKind::Fio => fio::run_cell(cell, &server.fio)
            .map_err(|e| e.to_string())
            .and_then(Measured::from_fio),
    };
    let client_cpu = client_cpu().zip(client_cpu_before).map(|(a, b)| a - b);
    let server_cpu = server
        .cpu_seconds()
        .zip(server_cpu_before)
        .map(|(a, b)| a - b);
    let receive_cpu = netns
        .and_then(netns::Netns::receive_cpu_seconds)
        .zip(receive_cpu_before)
        .map(|(after, before)| after.since(before));
    let counters = server
        .counters()
        .zip(counters_before)
        .map(|(after, before)| target::counters_delta(before, after));
    if stop.load(Ordering::Relaxed) {
        return None;
    }
    Some(match measured {
        Ok(m) => {
            let gib = m.bytes as f64 / (1u64 << 30) as f64;
            let per_gib = |cpu: f64| if gib > 0.0 { cpu / gib } else { 0.0 };
            if let Some(e) = &m.first_error {
                eprintln!("{} errors, first: {e}", m.errors);
            }
            Sample {
                iops: m.iops,
                mib_s: m.mib_s,
                lat_p50_us: m.lat_us[0],
                lat_p99_us: m.lat_us[1],
                lat_p999_us: m.lat_us[2],
                client_cpu_s_per_gib: per_gib(client_cpu.unwrap_or(0.0)),
                server_cpu_s_per_gib: server_cpu.map(per_gib),
                server_receive_cpu_s_per_gib: receive_cpu.map(|r| per_gib(r.servers)),
                client_receive_cpu_s_per_gib: receive_cpu.map(|r| per_gib(r.client)),
                server_counters: counters,
                verify_errors: m.verify_errors,
                errors: m.errors,
            }
        }
        Err(e) => {
            eprintln!("cell failed: {e}");
            Sample {
                iops: 0.0,
                mib_s: 0.0,
                lat_p50_us: 0.0,
                lat_p99_us: 0.0,
                lat_p999_us: 0.0,
                client_cpu_s_per_gib: 0.0,
                server_cpu_s_per_gib: None,
                server_receive_cpu_s_per_gib: None,
                client_receive_cpu_s_per_gib: None,
                server_counters: None,
                verify_errors: 0,
                errors: 1,
            }
        }
    })
}

/// One cell's figures, whichever client measured them.
struct Measured {
    iops: f64,
    mib_s: f64,
    bytes: u64,
    /// p50, p99 and p99.9 latency, microseconds.
    lat_us: [f64; 3],
    errors: u64,
    verify_errors: u64,
    first_error: Option<String>,
}

impl Measured {
    fn from_workload(m: workload::Measured) -> Measured {
        let secs = m.elapsed.as_secs_f64().max(1e-9);
        let us = |q: f64| m.latency.value_at_quantile(q) as f64 / 1000.0;
        Measured {
            iops: m.ops as f64 / secs,
            mib_s: m.bytes as f64 / (1024.0 * 1024.0) / secs,
            bytes: m.bytes,
            lat_us: [us(0.5), us(0.99), us(0.999)],
            errors: m.errors,
            verify_errors: m.verify_errors,
            first_error: m.first_error,
        }
    }

    /// fio's figures; a job that ended with an errno, or moved nothing, failed.
    fn from_fio(m: fio::FioMeasured) -> Result<Measured, String> {
        if m.error != 0 || m.bytes == 0 {
            return Err(format!(
                "fio moved {} bytes, job error {}",
                m.bytes, m.error
            ));
        }
        Ok(Measured {
            iops: m.iops,
            mib_s: m.mib_s,
            bytes: m.bytes,
            lat_us: [m.lat_p50_us, m.lat_p99_us, m.lat_p999_us],
            errors: 0,
            verify_errors: 0,
            first_error: None,
        })
    }
}

fn push_sample(results: &mut Results, target: &str, rw: Rw, at: (u64, u32), sample: Sample) {
    let (bs, iodepth) = at;
    if let Some(cell) = results
        .cells
        .iter_mut()
        .find(|c| c.target == target && c.rw == rw.name() && c.bs == bs && c.iodepth == iodepth)
    {
        cell.samples.push(sample);
        return;
    }
    results.cells.push(Cell {
        target: target.to_string(),
        rw: rw.name().to_string(),
        bs,
        iodepth,
        samples: vec![sample],
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("0s"), None);
        assert_eq!(parse_duration("x"), None);
    }
}
