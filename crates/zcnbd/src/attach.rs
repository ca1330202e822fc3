//! `zcnbd attach` (an export as a local block device, through the kernel's ublk driver, or
//! its NBD client fed by zcnbd's own server), `zcnbd detach` and `zcnbd list`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use zcnbd_server::attach::driver::{self, Chosen, Driver};
use zcnbd_server::attach::nbd::{self, NbdOptions};
use zcnbd_server::attach::placement::Placement;
use zcnbd_server::attach::{self, AttachOptions};

use crate::daemon::{self, PidFile};
use zcnbd_server::export::Export;
use zcnbd_server::{
    is_http_url, is_nbd_uri, parse_size, BackendSpec, BitmapSettings, ExportSpec, ImageFormat,
    ImageSettings, RbdSpec,
};

/// Arguments of `zcnbd attach`.
#[derive(Debug, clap::Args)]
pub struct AttachArgs {
    /// What the device holds: a raw file or block device, a disk image (qcow2 with its backing
    /// chain, vmdk), rbd:POOL/IMAGE, or an export another NBD server serves (nbd://,
    /// nbds:// with its TLS keys, nbd+unix://, nbd+vsock://; nbd-client's job), or a file on
    /// a web server (http://, https://: read-only, the --http-* options); without it,
    /// --memory.
    #[arg(value_name = "SOURCE", required_unless_present = "memory")]
    file: Option<PathBuf>,
    /// A RAM disk of this size instead (e.g. 1G).
    #[arg(long, value_name = "SIZE", conflicts_with = "file")]
    memory: Option<String>,
    /// A read-only device.
    #[arg(short = 'r', long)]
    read_only: bool,
    /// SOURCE's format (raw, qcow2, vmdk) [default: what its first bytes say, raw refused
    /// writes to a file that looks like an image].
    #[arg(short = 'f', long, value_name = "FORMAT", value_parser = image_format, requires = "file")]
    format: Option<ImageFormat>,
    /// Write to a throwaway overlay; SOURCE is only read (qemu-nbd's --snapshot).
    #[arg(long, requires = "file")]
    snapshot: bool,
    /// Open an image read-only even while QEMU has it open for writing (needs -r or
    /// --snapshot).
    #[arg(long, requires = "file")]
    force_share: bool,
    /// O_DIRECT for a raw file, or an image's data clusters (qemu-nbd's --cache=none).
    #[arg(long, requires = "file")]
    direct: bool,
    /// Stack this layer over the data (repeatable, bottom first; as for zcnbd serve).
    #[arg(long = "filter", value_name = "NAME")]
    filters: Vec<String>,
    /// An option for every --filter NAME (repeatable), e.g. delay.rdelay=10ms.
    #[arg(long = "filter-opt", value_name = "NAME.KEY=VALUE")]
    filter_options: Vec<String>,
    /// Where the cache filter keeps its files when its cache-dir option names none
    /// [default: $TMPDIR, else /var/tmp].
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    #[command(flatten)]
    http: crate::http_args::HttpArgs,
    /// Connections to an NBD URI's server (used when it allows multi-conn).
    #[arg(long, value_name = "N", default_value_t = 1)]
    connections: usize,
    /// How long an NBD URI's server that went away is tried again (its requests then sent
    /// again) before they fail; 0: at once (QEMU's reconnect-delay).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = crate::units::duration)]
    reconnect_timeout: std::time::Duration,
    /// The kernel driver: ublk (/dev/ublkbN), nbd (/dev/nbdN: the kernel's NBD client on
    /// socket pairs to zcnbd's own server, what qemu-nbd -c and nbd-client do), or auto:
    /// ublk where the kernel has it (after modprobe ublk_drv), else nbd (after modprobe nbd).
    #[arg(long, value_name = "DRIVER", default_value = "auto", value_parser = driver_name)]
    driver: Driver,
    /// Queues (one thread each) [default: one per CPU]; with --driver nbd, connections (more
    /// than one only where the export allows multi-conn) [default: one per CPU where it
    /// does, else one].
    #[arg(long, value_name = "N")]
    queues: Option<u16>,
    /// Requests in flight per queue.
    #[arg(long, value_name = "N", default_value_t = attach::QUEUE_DEPTH_DEFAULT)]
    queue_depth: u16,
    /// Threads per queue answering requests, so many are in flight at once; 0: each on its
    /// queue's thread, in order [default: 16 for an NBD URI, a URL, rbd: or --direct, whose
    /// requests wait; 0 for memory; files and images get at least 2, for the requests their
    /// queue's ring does not do itself].
    #[arg(long, value_name = "N")]
    io_threads: Option<u16>,
    /// The largest request the device takes unsplit (each tag has a buffer this large).
    #[arg(long, value_name = "SIZE", default_value = "1M", value_parser = request_size)]
    request_max: u32,
    /// Advertise the device as rotational.
    #[arg(long)]
    rotational: bool,
    /// Copy mode even where zero copy is possible (Linux 6.16+ and a file or image source,
    /// or a plain multi-conn nbd:// server: each request's pages read into and written
    /// from the file or the queue's own connection in place).
    #[arg(long)]
    no_zero_copy: bool,
    /// Where each queue's thread runs: elsewhere (off the CPUs whose requests it serves, so
    /// a program and the thread serving it work side by side, as the loop device's workers
    /// do), own (on those CPUs, where every CPU submits), or any (wherever the scheduler
    /// puts it).
    #[arg(long, value_name = "WHERE", default_value = "elsewhere", value_parser = placement_name)]
    queue_placement: Placement,
    /// Take over DEVICE, whose attach process died (its I/O waited), serving it from SOURCE
    /// again (the same data): the waiting I/O is re-issued and goes on.
    #[arg(long, value_name = "DEVICE", conflicts_with_all = ["queues", "rotational", "no_recovery"])]
    recover: Option<String>,
    /// The device goes when this process does (its I/O fails), instead of waiting for
    /// `zcnbd attach --recover` (with --driver nbd: its I/O fails, and `zcnbd detach`
    /// removes it).
    #[arg(long)]
    no_recovery: bool,
    /// With --driver nbd: how long the device's I/O waits for `zcnbd attach --recover` once
    /// this process died, before it fails (ublk waits as long as the device is there).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = crate::units::duration)]
    dead_connection_timeout: std::time::Duration,
    /// Run in the background: return once the device takes I/O (the device printed first).
    #[arg(long)]
    fork: bool,
    /// Write this process's pid to FILE once the device takes I/O (removed at exit).
    #[arg(long, value_name = "FILE")]
    pid_file: Option<PathBuf>,
}

fn placement_name(text: &str) -> Result<Placement, String> {
    Placement::named(text).ok_or_else(|| format!("{text}: not elsewhere, own or any"))
}

fn driver_name(text: &str) -> Result<Driver, String> {
    Driver::named(text).ok_or_else(|| format!("{text}: not ublk, nbd or auto"))
}

fn image_format(text: &str) -> Result<ImageFormat, String> {
    ImageFormat::named(text).ok_or_else(|| format!("{text}: not raw, qcow2 or vmdk"))
}

/// `--request-max`: a multiple of 4K up to the driver's limit.
fn request_size(text: &str) -> Result<u32, String> {
    let max = attach::IO_BUF_BYTES_MAX;
    let bytes = parse_size(text).map_err(|e| e.to_string())?;
    match u32::try_from(bytes) {
        Ok(n) if n >= 4096 && n.is_multiple_of(4096) && n <= max => Ok(n),
        _ => Err(format!(
            "{text}: a multiple of 4K from 4K to {}M (IO_BUF_BYTES_MAX)",
            max >> 20
        )),
    }
}

impl AttachArgs {
    /// Whether it runs in the background (`--fork`).
    pub fn forks(&self) -> bool {
        self.fork
    }

    /// The export, whose largest request is what `driver` sends unsplit.
    fn export_spec(&self, driver: Chosen) -> Result<ExportSpec, Box<dyn std::error::Error>> {
        let rbd = self
            .file
            .as_ref()
            .and_then(|f| f.to_str()?.strip_prefix("rbd:"));
        let uri = self
            .file
            .as_ref()
            .and_then(|f| f.to_str())
            .filter(|f| is_nbd_uri(f));
        let url = self.file.as_ref().and_then(|f| f.to_str());
        let http = self.http.spec(url.filter(|f| is_http_url(f)))?;
        let backend = match (&self.file, &self.memory, rbd) {
            (Some(_), _, _) if uri.is_some() => BackendSpec::Nbd {
                uri: uri.unwrap_or_default().to_string(),
                connections: self.connections,
                reconnect: self.reconnect_timeout,
            },
            (Some(_), _, Some(image)) => BackendSpec::Rbd(RbdSpec::parse(image)?),
            (Some(path), _, None) => BackendSpec::File {
                path: path.clone(),
                direct: self.direct,
            },
            (None, Some(size), _) => match parse_size(size)? {
                0 => return Err("--memory: a device needs at least one sector".into()),
                n => BackendSpec::Memory(n),
            },
            (None, None, _) => return Err("give SOURCE or --memory SIZE".into()),
        };
        // A URL is no file: its settings replace what the match made of it.
        let backend = http.map_or(backend, BackendSpec::Http);
        Ok(ExportSpec {
            name: String::new(),
            description: String::new(),
            backend,
            read_only: self.read_only,
            min_block_size: 512,
            clients_max: None,
            tls_only: false,
            rotational: self.rotational,
            filters: crate::filters::with_options(&self.filters, &self.filter_options)?,
            payload_max: Some(match driver {
                Chosen::Ublk => self.request_max,
                Chosen::Nbd => nbd::REQUEST_BYTES_MAX,
            }),
            image: ImageSettings {
                format: self.format,
                snapshot: self.snapshot,
                force_share: self.force_share,
            },
            bitmaps: BitmapSettings::default(),
        })
    }
}

/// A device being served, by either driver.
enum Device {
    Ublk(Box<attach::Attached>),
    Nbd(nbd::NbdAttached),
}

impl Device {
    fn path(&self) -> PathBuf {
        match self {
            Device::Ublk(d) => d.device_path(),
            Device::Nbd(d) => d.device_path(),
        }
    }

    fn serve_until(self, stop: &AtomicBool) -> Result<(), Box<dyn std::error::Error>> {
        match self {
            Device::Ublk(d) => d.serve_until(stop)?,
            Device::Nbd(d) => d.serve_until(stop)?,
        }
        Ok(())
    }
}

/// The device through ublk (made, or taken over with `--recover`).
fn ublk_device(
    args: &AttachArgs,
    export: &Export,
    io_threads: u16,
) -> Result<attach::Attached, attach::AttachError> {
    let stack = Arc::clone(&export.stack);
    let minimum = export.block_size.minimum;
    if let Some(device) = &args.recover {
        return attach::recover(device, stack, minimum, io_threads, args.queue_placement);
    }
    let options = AttachOptions {
        queues: args.queues.unwrap_or(AttachOptions::default().queues),
        queue_depth: args.queue_depth,
        io_buf_bytes: args.request_max,
        rotational: args.rotational,
        recovery: !args.no_recovery,
        io_threads,
        zero_copy: !args.no_zero_copy,
        placement: args.queue_placement,
    };
    attach::attach(stack, minimum, &options)
}

/// The device through the kernel's NBD client (connected, or given new connections with
/// `--recover`).
fn nbd_device(args: &AttachArgs, export: Export) -> Result<nbd::NbdAttached, nbd::NbdError> {
    let options = NbdOptions {
        connections: args.queues,
        dead_conn_timeout: match args.no_recovery {
            true => std::time::Duration::ZERO,
            false => args.dead_connection_timeout,
        },
        engine: Default::default(),
    };
    match &args.recover {
        Some(device) => nbd::recover(device, export, &options),
        None => nbd::attach(export, &options),
    }
}

/// `zcnbd attach`: makes the device (or takes one over), prints it, serves it until
/// SIGINT/SIGTERM or `zcnbd detach`, then removes it.
pub fn run(args: &AttachArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if let Some(dir) = &args.cache_dir {
        zcnbd_server::export::layers::set_cache_dir(dir.clone());
    }
    let chosen = match &args.recover {
        Some(device) => driver::of_device(device),
        None => driver::choose(args.driver)?,
    };
    let spec = args.export_spec(chosen)?;
    let io_threads = args.io_threads.unwrap_or(match &spec.backend {
        BackendSpec::Nbd { .. }
        | BackendSpec::Http(_)
        | BackendSpec::Rbd(_)
        | BackendSpec::File { direct: true, .. } => attach::IO_THREADS_WAITING_DEFAULT,
        _ => 0,
    });
    let export = spec.build()?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    // The export open, no thread started yet: the one moment to fork.
    let readiness = match args.fork {
        true => Some(daemon::fork()?),
        false => None,
    };
    let (source, stack) = (export.source.clone(), Arc::clone(&export.stack));
    let device = match chosen {
        Chosen::Ublk => Device::Ublk(Box::new(ublk_device(args, &export, io_threads)?)),
        Chosen::Nbd => Device::Nbd(nbd_device(args, export)?),
    };
    settle_udev();
    tracing::info!(
        device = %device.path().display(),
        source = %source,
        size = stack.size(),
        read_only = stack.is_read_only(),
        "attached"
    );
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", device.path().display())?;
    out.flush()?;
    drop(out);
    let _pid_file = args.pid_file.as_deref().map(PidFile::write).transpose()?;
    if let Some(r) = readiness {
        r.notify()?;
    }
    let served = device.serve_until(&stop);
    // What the layers hold (a writeback cache's dirty blocks) reaches the source, as at the
    // end of `zcnbd serve`: the device is gone (or kept for a new process), no request runs.
    // A source alone holds nothing the kernel's own flushes did not reach (and a remote one
    // that went away would hold the exit up for its reconnect timeout).
    if !stack.is_read_only() && !stack.layer_names().is_empty() {
        if let Err(e) = stack.flush() {
            tracing::warn!(source = %source, "final flush failed: {e}");
        }
    }
    served?;
    Ok(ExitCode::SUCCESS)
}

/// Waits for udev to have made the device's links and partitions' nodes, where udev runs.
fn settle_udev() {
    let _ = std::process::Command::new("udevadm")
        .args(["settle", "--timeout=10"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: AttachArgs,
    }

    #[test]
    fn the_defaults_are_the_drivers_own() {
        let cli = Cli::try_parse_from(["attach", "--memory", "16M"]).unwrap();
        assert_eq!(cli.args.driver, Driver::Auto);
        assert_eq!(
            cli.args.dead_connection_timeout,
            nbd::DEAD_CONN_TIMEOUT_DEFAULT
        );
        let nbd = Cli::try_parse_from(["attach", "--driver", "nbd", "x.raw"]).unwrap();
        assert_eq!(nbd.args.driver, Driver::Nbd);
        let spec = nbd.args.export_spec(Chosen::Nbd).unwrap();
        assert_eq!(spec.payload_max, Some(nbd::REQUEST_BYTES_MAX));
        assert!(Cli::try_parse_from(["attach", "--driver", "loop", "x.raw"]).is_err());
    }
}
