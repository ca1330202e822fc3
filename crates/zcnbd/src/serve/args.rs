//! `zcnbd serve`'s options, and the server configuration they make.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use zcnbd_server::tls::{KtlsMode, TlsConfig, TlsMode};
use zcnbd_server::vsock::{self, VsockAddr};
use zcnbd_server::{
    is_http_url, is_nbd_uri, load_config, parse_payload_max, parse_size, BackendSpec,
    BitmapSettings, Config, DataPath, EngineKind, EngineOptions, ExportDefaults, ExportSpec,
    ImageFormat, ImageSettings, Limits, ListenAddr, RbdSpec, ReloadSource, ServerConfig,
};

use crate::units;

/// Options of `zcnbd serve`.
#[derive(Debug, Parser)]
#[command(name = "zcnbd serve")]
pub struct ServeArgs {
    /// Serve this regular file or block device, or with rbd:POOL[/NAMESPACE]/IMAGE[@SNAP] a Ceph RBD
    /// image (a snapshot read-only), or with an NBD URI (nbd://, nbds://, nbd+unix://,
    /// nbd+vsock://) what another NBD server serves (zcnbd as a proxy: nbdkit's nbd plugin),
    /// or with an http:// or https:// URL a file on a web server, read-only (nbdkit's curl
    /// plugin; the --http-* options).
    #[arg(help_heading = "Exports", value_name = "FILE", conflicts_with_all = ["memory", "null", "config"])]
    file: Option<PathBuf>,
    #[command(flatten)]
    http: crate::http_args::HttpArgs,
    /// Connections to an NBD URI's server (used when it allows multi-conn).
    #[arg(
        help_heading = "Exports",
        long,
        value_name = "N",
        default_value_t = 1,
        requires = "file"
    )]
    upstream_connections: usize,
    /// How long an NBD URI's server that went away is tried again (its requests then sent
    /// again) before they fail; 0: at once.
    #[arg(help_heading = "Exports", long, value_name = "DURATION", default_value = "60s", value_parser = units::duration, requires = "file")]
    reconnect_timeout: Duration,
    /// With rbd:POOL/IMAGE: the Ceph configuration file [default: librados' search:
    /// $CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf].
    #[arg(
        help_heading = "Ceph RBD",
        long,
        value_name = "FILE",
        requires = "file"
    )]
    ceph_conf: Option<PathBuf>,
    /// With rbd:POOL/IMAGE: the Ceph client id, without "client." [default: admin, or
    /// CEPH_ARGS' --id]; its key is found in the configuration's keyring.
    #[arg(
        help_heading = "Ceph RBD",
        long,
        value_name = "NAME",
        requires = "file"
    )]
    ceph_id: Option<String>,
    /// Serve a sparse in-memory disk of SIZE (e.g. 64M, 1G, 1T); the default is 1G.
    #[arg(help_heading = "Exports", long, value_name = "SIZE", conflicts_with_all = ["null", "config"], value_parser = disk_size)]
    memory: Option<String>,
    /// Serve a null disk of SIZE: writes are discarded, reads return zeroes.
    #[arg(help_heading = "Exports", long, value_name = "SIZE", conflicts_with = "config", value_parser = disk_size)]
    null: Option<String>,
    /// Use O_DIRECT for FILE (qemu-nbd's --cache=none): a raw file's aligned requests, an
    /// image's data clusters in every file of its chain (its tables stay buffered).
    #[arg(help_heading = "Exports", long, requires = "file")]
    direct: bool,
    /// FILE's format: raw (its bytes are the disk), qcow2, or vmdk (flat extents, served
    /// read-only) [default: what the file's first bytes say; the log says when it is an
    /// image].
    #[arg(help_heading = "Images", short = 'f', long, value_name = "FORMAT", value_parser = image_format, requires = "file")]
    format: Option<ImageFormat>,
    /// Write to a throwaway qcow2 overlay over FILE (a raw file, a disk image, an RBD
    /// image, an NBD URI's export or a URL's file), made in $TMPDIR (default /var/tmp) and deleted at exit; FILE is opened
    /// read-only and never written (qemu-nbd's --snapshot).
    #[arg(help_heading = "Images", long, requires = "file")]
    snapshot: bool,
    /// Open a disk image read-only even while another program (QEMU) has it open for writing,
    /// instead of refusing as QEMU's locks ask (qemu-img's -U); needs --read-only or
    /// --snapshot.
    #[arg(help_heading = "Images", long, requires = "file")]
    force_share: bool,
    /// Offer the dirty bitmap NAME as the metadata context qemu:dirty-bitmap:NAME (qemu-nbd's -B;
    /// repeatable): a qcow2 image's persistent bitmap of that name, else one zcnbd tracks,
    /// recording every write, trim and write-zeroes (kept in a file beside FILE, or in
    /// --bitmap-dir; a memory export's in memory).
    ///
    /// An RBD export offers its image's snapshots as bitmaps without it.
    #[arg(
        help_heading = "Dirty bitmaps",
        short = 'B',
        long = "bitmap",
        value_name = "NAME",
        conflicts_with = "config"
    )]
    bitmaps: Vec<String>,
    /// The granularity of tracked bitmaps made new: a power of two from 512 bytes to 2G
    /// [default: 64K].
    #[arg(help_heading = "Dirty bitmaps", long, value_name = "SIZE", value_parser = bitmap_granularity, conflicts_with = "config")]
    bitmap_granularity: Option<u64>,
    /// Keep tracked bitmaps in this directory (needed for an RBD image or a block device)
    /// [default: beside FILE].
    #[arg(
        help_heading = "Dirty bitmaps",
        long,
        value_name = "DIR",
        conflicts_with = "config"
    )]
    bitmap_dir: Option<PathBuf>,
    /// Open a writable qcow2 image that has persistent dirty bitmaps (which zcnbd does not
    /// update) by marking them in use, inconsistent, as QEMU does after a crash; without it
    /// such an image is served only read-only.
    #[arg(
        help_heading = "Images",
        long,
        requires = "file",
        conflicts_with = "config"
    )]
    invalidate_bitmaps: bool,
    /// Listen on this Unix socket (mode 0600) for requests to add, clear, remove and list
    /// dirty bitmaps while the server runs (`zcnbd bitmap`); every writable export then
    /// records writes for the bitmaps it may get.
    #[arg(help_heading = "Dirty bitmaps", long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Refuse writes.
    #[arg(help_heading = "Exports", short = 'r', long)]
    read_only: bool,
    /// Export name.
    #[arg(help_heading = "Exports", short = 'x', long, default_value = "")]
    name: String,
    /// Export description shown to clients.
    #[arg(help_heading = "Exports", long, default_value = "")]
    description: String,
    /// Advertised minimum block size (a power of two, 1 to 65536).
    #[arg(
        help_heading = "Exports",
        long = "block-size-min",
        alias = "min-block-size",
        default_value_t = 1
    )]
    min_block_size: u32,
    /// Advertise the export as rotational (NBD_FLAG_ROTATIONAL: the kernel client then picks
    /// an I/O scheduler that sorts requests, as for a spinning disk).
    #[arg(help_heading = "Exports", long, conflicts_with = "config")]
    rotational: bool,
    /// Stack this layer over the data (nbdkit's --filter; repeatable, bottom first; with --config,
    /// under every export's own `filters`).
    ///
    /// Layers: blocksize (any request becomes aligned, bounded ones below: minblock=,
    /// maxdata=; nbdkit-blocksize-filter), cache (blocks kept in a local file: cache=writeback
    /// or writethrough, cache-on-read=yes, cache-max-size=1G; nbdkit-cache-filter), delay (each request waits: rdelay=, wdelay=, ...;
    /// nbdkit-delay-filter), error (requests fail: error=EIO, error-rate=10%,
    /// error-file=PATH; nbdkit-error-filter), log (a line per request to logfile=PATH;
    /// nbdkit-log-filter), partition (partition=N of an MBR or GPT disk;
    /// nbdkit-partition-filter), passthrough (forwards every call: the stack's cost, and a
    /// check that nothing skips it), rate (bandwidth in bits/s: rate=80M,
    /// connection-rate=16M; nbdkit-rate-filter), readahead (sequential reads fetch a growing
    /// window: window=64K, max=4M; nbdkit-readahead-filter), retry (failed requests tried
    /// again after reopening the source: retries=5, retry-delay=2s, retry-writes=no;
    /// nbdkit-retry-filter). Options as NAME:KEY=VALUE,... or with --filter-opt.
    #[arg(help_heading = "Exports", long = "filter", value_name = "NAME")]
    filters: Vec<String>,
    /// An option for every --filter NAME (repeatable), e.g. delay.rdelay=10ms.
    #[arg(
        help_heading = "Exports",
        long = "filter-opt",
        value_name = "NAME.KEY=VALUE"
    )]
    filter_options: Vec<String>,
    /// Where the cache filter keeps its files (unnamed: nothing is left behind) when its
    /// cache-dir option names none [default: $TMPDIR, else /var/tmp].
    #[arg(help_heading = "Exports", long, value_name = "DIR")]
    cache_dir: Option<std::path::PathBuf>,
    /// The largest read or write payload a client may send (advertised as the maximum block size);
    /// larger reads are refused with EINVAL, larger writes disconnect.
    ///
    /// With --config, for exports without their own payload_max.
    #[arg(help_heading = "Exports", long = "payload-max", alias = "max-payload", value_name = "SIZE", default_value = "64M", value_parser = payload_size)]
    max_payload: u32,
    /// Serve the exports of a TOML file instead (docs/guides/config.md).
    ///
    /// SIGHUP re-reads it (and the TLS credentials): new exports appear, removed ones take no new
    /// clients (attached ones carry on), unchanged ones keep their open file or memory; a file that
    /// does not parse, or whose new exports or credentials cannot be opened, is logged and the
    /// running configuration is kept.
    #[arg(help_heading = "Exports", long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// TCP port [default: 10809].
    #[arg(help_heading = "Network", short = 'p', long)]
    pub(super) port: Option<u16>,
    /// Address to bind, IPv4 or IPv6 [default: 127.0.0.1].
    #[arg(help_heading = "Network", short = 'b', long)]
    pub(super) bind: Option<IpAddr>,
    /// Listen on this Unix socket instead of TCP (also -k, qemu-nbd's, and -U, nbdkit's).
    ///
    /// A live server's socket is refused, a stale one replaced; at exit the path is removed only if
    /// it is still this server's socket.
    #[arg(help_heading = "Network", short = 's', short_aliases = ['k', 'U'], long, value_name = "PATH")]
    pub(super) socket: Option<PathBuf>,
    /// Listen on AF_VSOCK, any CID, port PORT (default when given: 10809): instead of TCP, or as
    /// well when -p, -b or -s is given.
    ///
    /// Clients in guests connect to the host's CID 2, on one machine to CID 1 (vsock_loopback):
    /// nbd+vsock://CID[:PORT]/NAME.
    #[arg(help_heading = "Network", 
        long,
        value_name = "PORT",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "10809"
    )]
    pub(super) vsock: Option<u32>,
    /// Captive mode (nbdkit's --run): once listening, run CMD with /bin/sh -c, with $uri (and $nbd,
    /// the same), $port, $unixsocket and $exportname set; stop when it exits and exit with its
    /// status.
    ///
    /// Listens on a private Unix socket unless -p, -b or -s is given.
    #[arg(help_heading = "Service", long, value_name = "CMD")]
    pub(super) run: Option<String>,
    /// Exit (in order, as on SIGTERM) when the process that started zcnbd exits
    /// (PR_SET_PDEATHSIG; not with --fork, whose child the setting would not reach).
    #[arg(help_heading = "Service", long, conflicts_with = "fork")]
    pub(super) exit_with_parent: bool,
    /// Run in the background (qemu-nbd's --fork): the command returns once the server accepts
    /// clients (status 0), or with the error if it could not start.
    ///
    /// Logs then go to /dev/null.
    #[arg(help_heading = "Service", long, conflicts_with = "run")]
    pub(super) fork: bool,
    /// Print the URI of the (first) export on standard output once clients can connect
    /// (nbdkit's --print-uri).
    #[arg(help_heading = "Service", long)]
    pub(super) print_uri: bool,
    /// Check what would be served and exit: every export's settings, files and image chains
    /// (opened read-only, shared: a running server on them is no conflict) and the TLS
    /// credentials, printed one line each; nothing is listened on.
    ///
    /// nbdkit's --dump-config use: check an edited --config before sending SIGHUP. An RBD image
    /// is not contacted.
    #[arg(long, help_heading = "Service")]
    pub(super) check: bool,
    /// Write the server's pid to FILE once it accepts clients (written whole, by rename);
    /// removed at a clean exit.
    #[arg(help_heading = "Service", long, value_name = "FILE")]
    pub(super) pid_file: Option<PathBuf>,
    /// Time a client has to finish the handshake.
    #[arg(help_heading = "Limits", long, value_name = "DURATION", default_value = "10s", value_parser = units::duration)]
    handshake_timeout: Duration,
    #[arg(
        long,
        hide = true,
        value_name = "MS",
        conflicts_with = "handshake_timeout"
    )]
    handshake_timeout_ms: Option<u64>,
    /// Most clients attached to exports at once; more are refused when they ask to attach
    /// (NBD_REP_ERR_POLICY), with a log line naming the limit.
    #[arg(help_heading = "Limits", long, default_value_t = Limits::default().connections_max)]
    connections_max: usize,
    /// Most connections in their handshake at once; when full, a new connection closes the
    /// handshake that has been silent longest (idle connections cannot lock clients out).
    #[arg(help_heading = "Limits", long, default_value_t = Limits::default().handshakes_max)]
    handshakes_max: usize,
    /// Most clients attached to the export at once (qemu-nbd's -e; with --config, each export's
    /// connections_max).
    ///
    /// Default: only --connections-max.
    #[arg(
        help_heading = "Exports",
        short = 'e',
        long,
        value_name = "N",
        conflicts_with = "config"
    )]
    shared: Option<usize>,
    /// Buffer memory (read replies waiting to be sent, write payloads waiting to be written) all
    /// clients together may hold; each keeps a small reserve, so clients that stop reading cannot
    /// starve others.
    ///
    /// When it is taken, requests wait (logged).
    #[arg(help_heading = "Limits", long, value_name = "SIZE", default_value = "512M", value_parser = memory_size)]
    buffers_max: usize,
    /// Disconnect a client that takes no reply bytes for this long while replies wait.
    #[arg(help_heading = "Limits", long, value_name = "DURATION", default_value = WRITE_TIMEOUT_DEFAULT, value_parser = units::duration)]
    write_timeout: Duration,
    #[arg(long, hide = true, value_name = "MS", conflicts_with = "write_timeout")]
    write_timeout_ms: Option<u64>,
    /// Disconnect a client that sends nothing for this long while none of its requests is in
    /// flight (default: never).
    #[arg(help_heading = "Limits", long, value_name = "DURATION", value_parser = units::duration)]
    idle_timeout: Option<Duration>,
    #[arg(long, hide = true, value_name = "MS", conflicts_with = "idle_timeout")]
    idle_timeout_ms: Option<u64>,
    /// Disconnect a client that sends nothing for this long in the middle of a write's
    /// payload (io_uring engine: the payload may hold its place in the export, which other
    /// clients' changes of those clusters wait for).
    #[arg(help_heading = "Limits", long, value_name = "DURATION", default_value = PAYLOAD_TIMEOUT_DEFAULT, value_parser = units::duration)]
    payload_timeout: Duration,
    #[arg(
        long,
        hide = true,
        value_name = "MS",
        conflicts_with = "payload_timeout"
    )]
    payload_timeout_ms: Option<u64>,
    /// TCP keepalive: probe a silent client after this long (default when given: 60s; a bare
    /// number is seconds), drop it after 6 unanswered probes.
    #[arg(help_heading = "Limits", long, value_name = "DURATION", num_args = 0..=1, default_missing_value = "60s", value_parser = units::duration)]
    keepalive: Option<Duration>,
    /// Worker threads running backend operations.
    #[arg(help_heading = "Tuning", long, default_value_t = 16)]
    threads: usize,
    /// I/O engine for the transmission phase (auto: io_uring where the kernel allows).
    #[arg(help_heading = "Tuning", long, value_enum, default_value_t = EngineArg::Auto)]
    engine: EngineArg,
    /// How payloads move: copy (bounce buffers, the classic path), zerocopy (splice, receive
    /// in place, zero-copy send at every size), auto (zero-copy where it pays).
    #[arg(help_heading = "Tuning", long, value_enum, default_value_t = DataPathArg::Auto)]
    data_path: DataPathArg,
    /// io_uring threads (rings); 0: one per CPU.
    #[arg(help_heading = "Tuning", long, default_value_t = 0)]
    ring_threads: usize,
    /// With --data-path auto: reads this long or longer are spliced from the page cache
    /// (memory export: sendfile), or for an nbd:// or nbd+unix:// upstream from its socket
    /// through a pipe to the client's, for every client.
    ///
    /// Default: a memory export's reads of 256 KiB or more to a client on another host go by
    /// sendfile or from the mapping, whichever the io_uring engine's trials find faster (or,
    /// as fast, cheaper in its own CPU per byte): it depends on the CPU (on an Intel Xeon
    /// sendfile cost less and was as fast or faster, on an AMD EPYC it cost more and was
    /// slower: docs/benchmarks/veth.md); never to a client on this host (loopback, the
    /// server's own address, a Unix socket: that client then reads the pages itself and it
    /// was slower); an upstream's reads of 256 KiB or more spliced to a client on another
    /// host only; files: never (slower where measured). Given, it holds for every client and
    /// no trial runs; 1G turns splicing off.
    #[arg(help_heading = "Tuning", long, value_name = "SIZE", value_parser = memory_size)]
    splice_min_bytes: Option<usize>,
    /// With --data-path auto: memory-export writes up to this long are received straight into
    /// place; longer ones through a buffer.
    ///
    /// Default: every size (on Linux 6.18 that measured faster, with less server CPU, under BBR,
    /// cubic and on Unix sockets alike).
    #[arg(help_heading = "Tuning", long, value_name = "SIZE", value_parser = memory_size)]
    receive_in_place_max_bytes: Option<usize>,
    /// With --data-path auto: buffered-file writes this long or longer (without FUA) are
    /// spliced from the socket through a pipe into the file instead of received into a
    /// buffer and written (no userspace copy; it pays from 512 KiB on loopback).
    #[arg(help_heading = "Tuning", long, value_name = "SIZE", default_value = RECEIVE_SPLICE_MIN_DEFAULT, value_parser = memory_size)]
    receive_splice_min_bytes: usize,
    /// With --data-path auto: O_DIRECT reads this long or longer use zero-copy send.
    #[arg(help_heading = "Tuning", long, value_name = "SIZE", default_value = ZEROCOPY_SEND_MIN_DEFAULT, value_parser = memory_size)]
    zerocopy_send_min_bytes: usize,
    /// Registered-buffer memory per io_uring ring for O_DIRECT reads and writes (READ_FIXED,
    /// WRITE_FIXED, SEND_ZC from the same buffer); 0: off.
    ///
    /// Pinned, only on rings serving an O_DIRECT export; if registration fails (RLIMIT_MEMLOCK),
    /// pooled buffers are used.
    #[arg(help_heading = "Tuning", long, value_name = "SIZE", default_value = FIXED_BUFFER_MAX_DEFAULT, value_parser = memory_size)]
    fixed_buffer_bytes_max: usize,
    /// A thread with nothing to do (an io_uring ring, or a portable connection whose requests never
    /// wait) polls this long at most for the next request before it sleeps; adaptive: the window
    /// shrinks to nothing while requests come slower. 0: never poll.
    ///
    /// Saves a cross-CPU wake-up per request at low queue depth.
    #[arg(help_heading = "Tuning", 
        long,
        value_name = "DURATION",
        default_value = POLL_MAX_DEFAULT,
        value_parser = poll_duration
    )]
    poll_max: Duration,
    #[arg(long, hide = true, value_name = "US", conflicts_with = "poll_max",
        value_parser = clap::value_parser!(u64).range(0..=zcnbd_server::POLL_MAX_US_LIMIT))]
    poll_max_us: Option<u64>,
    /// For a client that keeps several requests in flight, a thread may wait up to this long
    /// for several to answer at once (an io_uring ring: for four completions; a portable
    /// connection: holding its replies), while measured trials say it moves as many
    /// requests for less CPU, nearly as many (0.85x) for much less (at most 0.6x), or clearly
    /// more. 0: never.
    #[arg(help_heading = "Tuning", 
        long,
        value_name = "DURATION",
        default_value = COALESCE_MAX_DEFAULT,
        value_parser = coalesce_duration
    )]
    coalesce_max: Duration,
    #[arg(long, hide = true, value_name = "US", conflicts_with = "coalesce_max",
        value_parser = clap::value_parser!(u64).range(0..=zcnbd_server::COALESCE_MAX_US_LIMIT))]
    coalesce_max_us: Option<u64>,
    /// Print the data-path counters at shutdown.
    #[arg(help_heading = "Service", long)]
    stats: bool,
    /// Serve the data-path counters in Prometheus format on this address (e.g. 127.0.0.1:9100).
    #[arg(help_heading = "Service", long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// TLS: off, on (STARTTLS offered, plain text allowed) or require (every option but STARTTLS
    /// refused with NBD_REP_ERR_TLS_REQD until TLS is up).
    ///
    /// Any --tls* option replaces the [tls] table of --config.
    #[arg(help_heading = "TLS", long, value_name = "MODE")]
    tls: Option<TlsMode>,
    /// Directory with ca-cert.pem, server-cert.pem and server-key.pem (nbdkit's and QEMU's
    /// layout).
    #[arg(
        help_heading = "TLS",
        long,
        value_name = "DIR",
        conflicts_with = "tls_psk"
    )]
    tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by the directory's ca-cert.pem.
    #[arg(help_heading = "TLS", long)]
    tls_verify_peer: bool,
    /// Only let in clients whose certificate subject (GnuTLS's form, e.g.
    /// "CN=client,O=Example") or PSK username is one of these (qemu-nbd's --tls-authz).
    #[arg(help_heading = "TLS", long, value_name = "NAME", num_args = 1..)]
    tls_authz: Vec<String>,
    /// Pre-shared keys: psktool's "username:hexkey" lines.
    #[arg(help_heading = "TLS", long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Kernel TLS: auto (the kernel encrypts what is sent, so sendfile, splice and the
    /// io_uring engine keep working under TLS, where it has the "tls" module and the cipher
    /// suits it; records are still read in user space) or off (user space both ways).
    #[arg(help_heading = "TLS", long, value_name = "MODE")]
    tls_ktls: Option<KtlsMode>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum EngineArg {
    Auto,
    Uring,
    Portable,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum DataPathArg {
    Copy,
    Zerocopy,
    Auto,
}

/// `--memory`'s and `--null`'s value: a size of at least one byte (checked here so that the
/// error names the option).
fn disk_size(text: &str) -> Result<String, String> {
    match parse_size(text).map_err(|e| e.to_string())? {
        0 => Err("an export needs at least 1 byte".into()),
        _ => Ok(text.to_owned()),
    }
}

/// Whole milliseconds of `d`, at least 1 when it is not zero.
fn ms(d: Duration) -> u64 {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 && !d.is_zero() {
        1
    } else {
        ms
    }
}

/// The server's defaults as the options show them (a test checks they are the server's).
const WRITE_TIMEOUT_DEFAULT: &str = "60s";
const PAYLOAD_TIMEOUT_DEFAULT: &str = "30s";
const POLL_MAX_DEFAULT: &str = "50us";
const COALESCE_MAX_DEFAULT: &str = "40us";
const RECEIVE_SPLICE_MIN_DEFAULT: &str = "512K";
const ZEROCOPY_SEND_MIN_DEFAULT: &str = "64K";
const FIXED_BUFFER_MAX_DEFAULT: &str = "32M";

/// A duration of at most `limit_us` microseconds.
fn bounded(text: &str, limit_us: u64, name: &str) -> Result<Duration, String> {
    let d = units::duration(text)?;
    if d > Duration::from_micros(limit_us) {
        return Err(format!("at most {limit_us}us ({name})"));
    }
    Ok(d)
}

/// `--poll-max`'s value.
fn poll_duration(text: &str) -> Result<Duration, String> {
    bounded(text, zcnbd_server::POLL_MAX_US_LIMIT, "POLL_MAX_US_LIMIT")
}

/// `--coalesce-max`'s value.
fn coalesce_duration(text: &str) -> Result<Duration, String> {
    bounded(
        text,
        zcnbd_server::COALESCE_MAX_US_LIMIT,
        "COALESCE_MAX_US_LIMIT",
    )
}

/// `--buffers-max`'s (and the other byte counts') value.
fn memory_size(text: &str) -> Result<usize, String> {
    let bytes = parse_size(text).map_err(|e| e.to_string())?;
    usize::try_from(bytes).map_err(|_| format!("{text}: too large"))
}

/// `--payload-max`'s value.
fn payload_size(text: &str) -> Result<u32, String> {
    parse_payload_max(text).map_err(|e| e.to_string())
}

/// `--format`'s value.
fn bitmap_granularity(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.to_string())
}

fn image_format(text: &str) -> Result<ImageFormat, String> {
    ImageFormat::named(text).ok_or_else(|| format!("{text}: not raw, qcow2 or vmdk"))
}

impl ServeArgs {
    /// `--cache-dir`.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.cache_dir.as_deref()
    }

    /// Whether it runs in the background (`--fork`).
    pub fn forks(&self) -> bool {
        self.fork
    }

    /// What the command line says for every export of a `--config` file.
    fn export_defaults(&self) -> Result<ExportDefaults, String> {
        Ok(ExportDefaults {
            filters_below: crate::filters::with_options(&self.filters, &self.filter_options)?,
            payload_max: self.max_payload,
            bitmaps_on_demand: self.control.is_some(),
        })
    }

    /// Whether any --tls* option was given (they replace the config file's [tls] table).
    fn tls_given(&self) -> bool {
        self.tls.is_some()
            || self.tls_certificates.is_some()
            || self.tls_verify_peer
            || !self.tls_authz.is_empty()
            || self.tls_psk.is_some()
            || self.tls_ktls.is_some()
    }

    /// The TLS settings from the command line; `--tls` defaults to `require` when
    /// `--tls-authz` or `--tls-verify-peer` restrict who may connect, else to `on` once
    /// credentials are given.
    fn tls_config(&self) -> TlsConfig {
        let credentials = self.tls_certificates.is_some() || self.tls_psk.is_some();
        let restricted = self.tls_verify_peer || !self.tls_authz.is_empty();
        TlsConfig {
            mode: self.tls.unwrap_or(if restricted {
                TlsMode::Require
            } else if credentials {
                TlsMode::On
            } else {
                TlsMode::Off
            }),
            certificates: self.tls_certificates.clone(),
            verify_peer: self.tls_verify_peer,
            authz: self.tls_authz.clone(),
            psk: self.tls_psk.clone(),
            ktls: self.tls_ktls.unwrap_or_default(),
        }
    }

    pub(super) fn config(&self) -> Result<Config, Box<dyn std::error::Error>> {
        if self.config.is_some() && self.http.given() {
            return Err("the --http-* options are for a URL on the command line (in --config: the http_* keys)".into());
        }
        let mut config = match &self.config {
            Some(path) => load_config(path)?.with_defaults(&self.export_defaults()?),
            None => Config {
                exports: self.export_specs()?,
                tls: None,
            },
        };
        if self.tls_given() {
            config.tls = Some(self.tls_config());
        }
        Ok(config)
    }

    fn export_specs(&self) -> Result<Vec<ExportSpec>, Box<dyn std::error::Error>> {
        let rbd = self
            .file
            .as_ref()
            .and_then(|f| f.to_str()?.strip_prefix("rbd:"));
        if rbd.is_none() && (self.ceph_conf.is_some() || self.ceph_id.is_some()) {
            return Err("--ceph-conf and --ceph-id go with rbd:POOL/IMAGE".into());
        }
        let uri = self
            .file
            .as_ref()
            .and_then(|f| f.to_str())
            .filter(|f| is_nbd_uri(f));
        let url = self.file.as_ref().and_then(|f| f.to_str());
        let http = self.http.spec(url.filter(|f| is_http_url(f)))?;
        if http.is_some() && self.direct {
            return Err("--direct is for files, not a URL".into());
        }
        let backend = match (&self.file, &self.memory, &self.null) {
            (Some(_), _, _) if uri.is_some() && self.direct => {
                return Err("--direct is for files, not an NBD URI".into())
            }
            (Some(_), _, _) if uri.is_some() => BackendSpec::Nbd {
                uri: uri.unwrap_or_default().to_string(),
                connections: self.upstream_connections,
                reconnect: self.reconnect_timeout,
            },
            (Some(_), _, _) if rbd.is_some() && self.direct => {
                return Err("--direct is for files, not rbd:POOL/IMAGE".into())
            }
            (Some(_), _, _) if rbd.is_some() => BackendSpec::Rbd(RbdSpec {
                conf: self.ceph_conf.clone(),
                id: self.ceph_id.clone(),
                ..RbdSpec::parse(rbd.unwrap_or_default())?
            }),
            (Some(path), _, _) => BackendSpec::File {
                path: path.clone(),
                direct: self.direct,
            },
            (_, _, Some(size)) => BackendSpec::Null(parse_size(size)?),
            (_, Some(size), _) => BackendSpec::Memory(parse_size(size)?),
            (None, None, None) => BackendSpec::Memory(1 << 30),
        };
        // A URL is no file: its settings replace what the match made of it.
        let backend = http.map_or(backend, BackendSpec::Http);
        Ok(vec![ExportSpec {
            name: self.name.clone(),
            description: self.description.clone(),
            backend,
            read_only: self.read_only,
            min_block_size: self.min_block_size,
            clients_max: self.shared,
            tls_only: false,
            rotational: self.rotational,
            filters: crate::filters::with_options(&self.filters, &self.filter_options)?,
            payload_max: Some(self.max_payload),
            image: ImageSettings {
                format: self.format,
                snapshot: self.snapshot,
                force_share: self.force_share,
            },
            bitmaps: BitmapSettings {
                names: self.bitmaps.clone(),
                granularity: self.bitmap_granularity,
                dir: self.bitmap_dir.clone(),
                on_demand: self.control.is_some(),
                invalidate: self.invalidate_bitmaps,
            },
        }])
    }
}

impl ServeArgs {
    /// Whether -p, -b or -s says where to listen.
    pub(super) fn listen_given(&self) -> bool {
        self.port.is_some() || self.bind.is_some() || self.socket.is_some()
    }

    /// Where to listen (unless sockets were passed): TCP or `-s`'s Unix socket unless only
    /// `--vsock` is given, and `--vsock`'s socket.
    pub(super) fn listen_addrs(&self) -> Vec<ListenAddr> {
        let mut addrs = Vec::new();
        if self.listen_given() || self.vsock.is_none() {
            addrs.push(match &self.socket {
                Some(path) => ListenAddr::Unix(path.clone()),
                None => ListenAddr::Tcp(SocketAddr::new(
                    self.bind.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                    self.port.unwrap_or(10809),
                )),
            });
        }
        addrs.extend(self.vsock_addr());
        addrs
    }

    /// `--vsock`'s address.
    pub(super) fn vsock_addr(&self) -> Option<ListenAddr> {
        self.vsock.map(|port| {
            ListenAddr::Vsock(VsockAddr {
                cid: vsock::CID_ANY,
                port,
            })
        })
    }

    fn limits(&self) -> Limits {
        Limits {
            handshake_timeout_ms: self
                .handshake_timeout_ms
                .unwrap_or(ms(self.handshake_timeout)),
            connections_max: self.connections_max,
            handshakes_max: self.handshakes_max,
            write_timeout_ms: self.write_timeout_ms.unwrap_or(ms(self.write_timeout)),
            idle_timeout_ms: self.idle_timeout_ms.or(self.idle_timeout.map(ms)),
            payload_timeout_ms: self
                .payload_timeout_ms
                .unwrap_or(ms(self.payload_timeout))
                .max(1),
            keepalive_idle_ms: self.keepalive.map(ms),
            worker_threads: self.threads,
            buffers_bytes_max: self.buffers_max,
            ..Limits::default()
        }
    }

    fn engine_options(&self) -> EngineOptions {
        EngineOptions {
            engine: match self.engine {
                EngineArg::Auto => EngineKind::Auto,
                EngineArg::Uring => EngineKind::Uring,
                EngineArg::Portable => EngineKind::Portable,
            },
            data_path: match self.data_path {
                DataPathArg::Copy => DataPath::Copy,
                DataPathArg::Zerocopy => DataPath::ZeroCopy,
                DataPathArg::Auto => DataPath::Auto,
            },
            ring_threads: self.ring_threads,
            splice_min_bytes: self.splice_min_bytes,
            receive_in_place_max_bytes: self.receive_in_place_max_bytes,
            receive_splice_min_bytes: self.receive_splice_min_bytes,
            zerocopy_send_min_bytes: self.zerocopy_send_min_bytes,
            fixed_buffer_bytes_max: self.fixed_buffer_bytes_max,
            poll_max: self
                .poll_max_us
                .map_or(self.poll_max, Duration::from_micros),
            coalesce_max: self
                .coalesce_max_us
                .map_or(self.coalesce_max, Duration::from_micros),
            ..EngineOptions::default()
        }
    }

    /// `--check`'s report (see the option).
    pub(super) fn check_report(&self) -> Result<String, Box<dyn std::error::Error>> {
        let config = self.config()?;
        let mut report = Vec::new();
        for spec in &config.exports {
            report.push(spec.dry_run()?);
        }
        let tls = config.tls.unwrap_or_default();
        report.push(match tls.load()? {
            Some(_) => format!("TLS {:?}: credentials loaded", tls.mode).to_lowercase(),
            None => "TLS off".to_owned(),
        });
        report.push("ok: nothing served (--check)".to_owned());
        Ok(report.join("\n"))
    }

    /// The server's configuration: exports opened, limits and engine options.
    pub(super) fn server_config(&self) -> Result<ServerConfig, Box<dyn std::error::Error>> {
        let config = self.config()?;
        let exports = config
            .exports
            .iter()
            .map(ExportSpec::build)
            .collect::<Result<Vec<_>, _>>()?;
        let defaults = self.export_defaults()?;
        let reload = self.config.as_ref().map(|path| ReloadSource {
            path: path.clone(),
            config: config.clone(),
            tls_from_command_line: self.tls_given(),
            defaults,
        });
        Ok(ServerConfig {
            exports,
            listen: self.listen_addrs(),
            limits: self.limits(),
            engine: self.engine_options(),
            print_stats: self.stats,
            metrics: self.metrics,
            control: self.control.clone(),
            tls: config.tls.unwrap_or_default(),
            reload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(args: &[&str]) -> Vec<String> {
        let argv = std::iter::once("serve").chain(args.iter().copied());
        let parsed = ServeArgs::try_parse_from(argv).expect("valid arguments");
        parsed
            .listen_addrs()
            .iter()
            .map(|a| a.to_string())
            .collect()
    }

    #[test]
    fn durations_show_the_server_defaults_and_the_old_spellings_still_work() {
        let show_ms = |ms| units::show(Duration::from_millis(ms));
        let show_us = |us| units::show(Duration::from_micros(us));
        assert_eq!(
            WRITE_TIMEOUT_DEFAULT,
            show_ms(Limits::default().write_timeout_ms)
        );
        assert_eq!(
            PAYLOAD_TIMEOUT_DEFAULT,
            show_ms(Limits::default().payload_timeout_ms)
        );
        assert_eq!(POLL_MAX_DEFAULT, show_us(zcnbd_server::POLL_MAX_US_DEFAULT));
        assert_eq!(
            COALESCE_MAX_DEFAULT,
            show_us(zcnbd_server::COALESCE_MAX_US_DEFAULT)
        );
        let engine = EngineOptions::default();
        let size = |text| memory_size(text).unwrap();
        assert_eq!(
            size(RECEIVE_SPLICE_MIN_DEFAULT),
            engine.receive_splice_min_bytes
        );
        assert_eq!(
            size(ZEROCOPY_SEND_MIN_DEFAULT),
            engine.zerocopy_send_min_bytes
        );
        assert_eq!(
            size(FIXED_BUFFER_MAX_DEFAULT),
            engine.fixed_buffer_bytes_max
        );
        // Sizes in one syntax, plain bytes included (what units and configs used to say).
        let argv = [
            "serve",
            "--splice-min-bytes",
            "64K",
            "--fixed-buffer-bytes-max",
            "1048576",
        ];
        let parsed = ServeArgs::try_parse_from(argv).unwrap().engine_options();
        assert_eq!(
            (parsed.splice_min_bytes, parsed.fixed_buffer_bytes_max),
            (Some(64 << 10), 1 << 20)
        );
        let limits = |args: &[&str]| {
            let argv = std::iter::once("serve").chain(args.iter().copied());
            ServeArgs::try_parse_from(argv).unwrap().limits()
        };
        let new = limits(&[
            "--handshake-timeout",
            "2s",
            "--write-timeout",
            "1500ms",
            "--idle-timeout",
            "1m",
            "--payload-timeout",
            "5s",
            "--keepalive",
            "30",
        ]);
        let old = limits(&[
            "--handshake-timeout-ms",
            "2000",
            "--write-timeout-ms",
            "1500",
            "--idle-timeout-ms",
            "60000",
            "--payload-timeout-ms",
            "5000",
            "--keepalive=30",
        ]);
        for l in [&new, &old] {
            assert_eq!(l.handshake_timeout_ms, 2000);
            assert_eq!(l.write_timeout_ms, 1500);
            assert_eq!(l.idle_timeout_ms, Some(60_000));
            assert_eq!(l.payload_timeout_ms, 5000);
            assert_eq!(l.keepalive_idle_ms, Some(30_000));
        }
        let argv = ["serve", "--poll-max", "2ms"];
        assert!(
            ServeArgs::try_parse_from(argv).is_err(),
            "over POLL_MAX_US_LIMIT"
        );
    }

    #[test]
    fn limits_are_named_thing_max_and_the_old_spellings_still_parse() {
        for argv in [
            ["serve", "--payload-max", "16M", "--block-size-min", "512"],
            ["serve", "--max-payload", "16M", "--min-block-size", "512"],
        ] {
            let parsed = ServeArgs::try_parse_from(argv).unwrap();
            assert_eq!((parsed.max_payload, parsed.min_block_size), (16 << 20, 512));
        }
    }

    #[test]
    fn vsock_replaces_tcp_unless_p_b_or_s_is_given() {
        assert_eq!(addrs(&[]), ["127.0.0.1:10809"]);
        assert_eq!(addrs(&["--vsock"]), ["vsock:any:10809"]);
        assert_eq!(addrs(&["--vsock=2000"]), ["vsock:any:2000"]);
        assert_eq!(
            addrs(&["-p", "7", "--vsock"]),
            ["127.0.0.1:7", "vsock:any:10809"]
        );
        assert_eq!(
            addrs(&["-s", "/s", "--vsock"]),
            ["unix:/s", "vsock:any:10809"]
        );
        // The value needs `=`: a FILE after --vsock stays the FILE.
        let parsed = ServeArgs::try_parse_from(["serve", "--vsock", "disk.img"]).unwrap();
        assert_eq!(parsed.file, Some(PathBuf::from("disk.img")));
        assert_eq!(parsed.vsock, Some(10809));
    }
}
