//! fio as the client (`zcnbd bench --client fio`): every cell run by fio 3's nbd engine
//! (libnbd), the client most published NBD numbers use, so zcnbd's figures can be checked
//! with a client it did not write; and `fio-rbd:POOL/IMAGE` targets, fio's rbd engine with no
//! NBD in between (librbd straight to the cluster: what an RBD export can reach at best).
//!
//! fio's nbd engine refuses URI keys that read local files (`tls-certificates`): a TLS
//! target's fio runs with `HOME` set to the run's credentials home, where libnbd looks
//! (`.pki/libnbd`). Client CPU is what the fio process used (this process's reaped
//! children), read before and after each cell.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::workload::{CellPlan, Rw};

/// Why fio could not measure a cell.
#[derive(Debug, thiserror::Error)]
pub enum FioError {
    #[error("cannot run fio (scripts/install-deps.sh installs it): {0}")]
    Spawn(std::io::Error),
    #[error("fio failed ({status}): {stderr}")]
    Failed { status: String, stderr: String },
    #[error("fio's report: {0}")]
    Report(String),
}

/// How long a cell's fio may run past its runtime (connecting, ramping) before it is killed:
/// a server that stopped answering must not hang the run.
const FIO_GRACE: Duration = Duration::from_secs(60);

/// How long a prefill by fio may take.
const FIO_PREFILL_LIMIT: Duration = Duration::from_secs(3600);

/// How fio reaches one target: its engine options and environment.
#[derive(Debug, Clone, Default)]
pub struct FioTarget {
    /// `--ioengine=...` and the engine's own options.
    pub engine: Vec<String>,
    /// Variables set for fio (`HOME` for TLS, `CEPH_ARGS` for librbd options).
    pub env: Vec<(String, String)>,
}

impl FioTarget {
    /// fio's nbd engine on `uri`; `tls_home`: the run's credentials home, for `nbds://`.
    pub fn nbd(uri: &str, tls_home: Option<&std::path::Path>) -> FioTarget {
        FioTarget {
            engine: vec![
                "--ioengine=nbd".into(),
                format!("--uri={}", without_files(uri)),
            ],
            env: tls_home
                .map(|h| vec![("HOME".to_string(), h.display().to_string())])
                .unwrap_or_default(),
        }
    }

    /// fio's rbd engine on POOL/IMAGE as client.admin; `conf`: `KEY=VALUE` librbd options,
    /// handed over in `CEPH_ARGS` after any the environment has.
    pub fn rbd(pool: &str, image: &str, conf: &[String]) -> FioTarget {
        let engine = vec![
            "--ioengine=rbd".into(),
            "--clientname=admin".into(),
            format!("--pool={pool}"),
            format!("--rbdname={image}"),
        ];
        let mut env = Vec::new();
        if !conf.is_empty() {
            let mut args: Vec<String> = std::env::var("CEPH_ARGS")
                .ok()
                .filter(|a| !a.is_empty())
                .into_iter()
                .collect();
            args.extend(conf.iter().map(|kv| format!("--{kv}")));
            env.push(("CEPH_ARGS".to_string(), args.join(" ")));
        }
        FioTarget { engine, env }
    }
}

/// A URI without the `tls-certificates` key fio refuses (libnbd finds them through `HOME`).
fn without_files(uri: &str) -> String {
    let Some((base, query)) = uri.split_once('?') else {
        return uri.to_string();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|kv| !kv.starts_with("tls-certificates="))
        .collect();
    match kept.is_empty() {
        true => base.to_string(),
        false => format!("{base}?{}", kept.join("&")),
    }
}

/// What fio measured in one cell.
#[derive(Debug, Clone, PartialEq)]
pub struct FioMeasured {
    pub iops: f64,
    pub mib_s: f64,
    pub bytes: u64,
    /// Completion latency percentiles (fio's clat), microseconds, of the direction that moved
    /// most bytes.
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    /// fio's job error (an errno), 0 if none.
    pub error: u64,
}

/// `fio --version`, for the report; `None` when fio is missing.
pub fn version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs one cell under fio and reads its JSON report.
pub fn run_cell(cell: &CellPlan, target: &FioTarget) -> Result<FioMeasured, FioError> {
    let mut argv = common_args(target, cell.rw, cell.bs, cell.iodepth, cell.region);
    argv.push(format!("--numjobs={}", cell.jobs));
    argv.push("--time_based=1".into());
    argv.push(format!("--runtime={}ms", cell.runtime.as_millis().max(1)));
    run(&argv, target, cell.runtime + FIO_GRACE)
}

/// Writes `[0, region)` once with 1 MiB sequential writes (a target only fio reaches).
pub fn prefill(target: &FioTarget, region: u64) -> Result<FioMeasured, FioError> {
    const PREFILL_BS: u64 = 1 << 20;
    let argv = common_args(target, Rw::Write, PREFILL_BS.min(region), 16, region);
    run(&argv, target, FIO_PREFILL_LIMIT)
}

fn common_args(target: &FioTarget, rw: Rw, bs: u64, iodepth: u32, region: u64) -> Vec<String> {
    let mut argv = vec!["--name=zcnbd-bench".to_string()];
    argv.extend(target.engine.iter().cloned());
    argv.extend([
        format!("--rw={}", rw.name()),
        format!("--bs={bs}"),
        format!("--iodepth={iodepth}"),
        format!("--size={region}"),
        "--group_reporting=1".into(),
        "--norandommap=1".into(),
        "--randrepeat=0".into(),
        "--output-format=json".into(),
    ]);
    argv
}

/// Runs fio; killed if it outlives `limit` (a server that stopped answering).
fn run(argv: &[String], target: &FioTarget, limit: Duration) -> Result<FioMeasured, FioError> {
    let mut child = Command::new("fio")
        .args(argv)
        .envs(target.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(FioError::Spawn)?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait().map_err(FioError::Spawn)? {
            Some(status) => break status,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(FioError::Failed {
                    status: format!("killed after {limit:?}"),
                    stderr: String::new(),
                });
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        return Err(FioError::Failed {
            status: status.to_string(),
            stderr: stderr.trim().lines().last().unwrap_or("").to_string(),
        });
    }
    parse_report(&stdout)
}

/// fio's JSON report (after any lines the engine prints first, such as libnbd's
/// "connected" notes): totals over reads and writes, latency of the larger direction.
pub fn parse_report(stdout: &str) -> Result<FioMeasured, FioError> {
    let bad = |what: &str| FioError::Report(what.to_string());
    let start = stdout
        .find('{')
        .ok_or_else(|| bad("no JSON in fio's output"))?;
    let report: Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<Value>()
        .next()
        .ok_or_else(|| bad("empty"))?
        .map_err(|e| FioError::Report(e.to_string()))?;
    let job = report
        .get("jobs")
        .and_then(|j| j.get(0))
        .ok_or_else(|| bad("no job"))?;
    let directions: Vec<&Value> = ["read", "write"]
        .iter()
        .filter_map(|d| job.get(*d))
        .filter(|d| number(d, "io_bytes") > 0.0)
        .collect();
    let sum = |key: &str| directions.iter().map(|d| number(d, key)).sum::<f64>();
    let main = directions
        .iter()
        .max_by(|a, b| number(a, "io_bytes").total_cmp(&number(b, "io_bytes")));
    let percentile = |p: &str| {
        main.and_then(|d| d.pointer(&format!("/clat_ns/percentile/{p}")))
            .and_then(Value::as_f64)
            .map_or(0.0, |ns| ns / 1000.0)
    };
    Ok(FioMeasured {
        iops: sum("iops"),
        mib_s: sum("bw_bytes") / (1024.0 * 1024.0),
        bytes: sum("io_bytes") as u64,
        lat_p50_us: percentile("50.000000"),
        lat_p99_us: percentile("99.000000"),
        lat_p999_us: percentile("99.900000"),
        error: job.get("error").and_then(Value::as_u64).unwrap_or(0),
    })
}

fn number(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_loses_only_file_keys() {
        assert_eq!(
            without_files("nbds://127.0.0.1:1/?tls-certificates=/d"),
            "nbds://127.0.0.1:1/"
        );
        assert_eq!(
            without_files("nbds+unix:///?socket=/s&tls-certificates=/d"),
            "nbds+unix:///?socket=/s"
        );
        assert_eq!(without_files("nbd://h/x"), "nbd://h/x");
    }

    #[test]
    fn rbd_options_go_to_librbd() {
        let t = FioTarget::rbd("rbd", "bench", &["rbd_cache=false".into()]);
        assert!(t.engine.contains(&"--rbdname=bench".to_string()));
        let (_, args) = t.env.iter().find(|(k, _)| k == "CEPH_ARGS").expect("env");
        assert!(args.ends_with("--rbd_cache=false"));
        assert!(FioTarget::rbd("rbd", "bench", &[]).env.is_empty());
    }

    #[test]
    fn report_is_read_after_engine_notes() {
        let text = r#"fio: connected to NBD server
{"jobs": [{"error": 0,
  "read": {"iops": 1000.0, "bw_bytes": 4096000, "io_bytes": 12288000,
           "clat_ns": {"percentile": {"50.000000": 15000, "99.000000": 40000,
                                      "99.900000": 90000}}},
  "write": {"iops": 10.0, "bw_bytes": 40960, "io_bytes": 4096,
            "clat_ns": {"percentile": {"50.000000": 1, "99.000000": 2}}}}]}
"#;
        let m = parse_report(text).expect("report");
        assert_eq!(m.iops, 1010.0);
        assert_eq!(m.bytes, 12288000 + 4096);
        assert_eq!(
            (m.lat_p50_us, m.lat_p99_us, m.lat_p999_us),
            (15.0, 40.0, 90.0)
        );
        assert!(parse_report("no json").is_err());
        assert!(parse_report("{\"jobs\": []}").is_err());
    }
}
