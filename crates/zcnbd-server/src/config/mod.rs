//! Export specifications, from the command line or a TOML `--config` file, and how they
//! become [`Export`]s. SIGHUP re-reads the file (`reload.rs`).
//!
//! ```toml
//! [[export]]
//! name = "mem"
//! description = "a memory disk"
//! memory = "64M"          # exactly one of memory / file / null / rbd / url
//! read_only = false
//! block_size_min = 1
//! payload_max = "64M"     # largest read or write (default: --payload-max, 64M)
//! connections_max = 4     # most clients attached at once (default: the server's limit)
//! tls_only = false        # only clients that switched to TLS see and use it
//! rotational = false      # advertise NBD_FLAG_ROTATIONAL (a spinning disk)
//! filters = []            # layers over the data, bottom first (export::layers)
//!
//! [[export]]
//! name = "disk"
//! file = "/var/lib/disk.img"
//! direct = true
//!
//! [[export]]
//! name = "vm"
//! file = "/var/lib/vm.qcow2"
//! format = "qcow2"        # raw, qcow2, vmdk; default: what the file's first bytes say
//! snapshot = false        # writes go to a throwaway overlay (qemu-nbd's --snapshot)
//! force_share = false     # with read_only: share the image with its writers (QEMU's -U)
//!
//! [[export]]
//! name = "vm1"
//! rbd = "pool/image"      # or "pool/namespace/image", "pool/image@snapshot" (read-only)
//! ceph_conf = "/etc/ceph/ceph.conf"   # default: librados' search ($CEPH_CONF, ...)
//! ceph_id = "admin"       # the client id (client.admin); default: librados' (CEPH_ARGS)
//!
//! [[export]]
//! name = "cloud"
//! url = "https://example.com/disk.img"   # read-only (snapshot = true takes writes)
//! http_connections = 4    # keep-alive connections to the web server
//! http_headers = ["Authorization: Bearer ..."]   # never logged
//! http_cafile = "/etc/zcnbd/web-ca.pem"   # or http_insecure = true
//! http_timeout = "30s"
//!
//! [tls]                   # optional: see crate::tls::TlsConfig
//! mode = "on"
//! certificates = "/etc/zcnbd/tls"
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use zcnbd_proto::BlockSize;

use crate::export::layers::{layer_named, LayerError, LAYER_NAMES};
use crate::export::tracking::{Bitmaps, ServedFile, Tracking};
pub use crate::export::RbdSpec;
pub use crate::export::{is_http_url, HttpHeader, HttpSpec};
use crate::export::{Backend, Export, ImageError, ImageFormat, Layer, Stack};
use crate::tls::TlsConfig;

mod bitmaps;
mod http;
mod open;

/// Where an export's data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    /// A sparse in-memory disk of this many bytes.
    Memory(u64),
    /// Reads zeroes, discards writes.
    Null(u64),
    /// A file or block device.
    File { path: PathBuf, direct: bool },
    /// A Ceph RBD image or snapshot.
    Rbd(RbdSpec),
    /// An export another NBD server serves (an NBD URI), over this many connections, made
    /// again for up to `reconnect` when lost.
    Nbd {
        uri: String,
        connections: usize,
        reconnect: std::time::Duration,
    },
    /// A file on a web server (an `http://` or `https://` URL), read-only.
    Http(HttpSpec),
}

/// One export as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    pub name: String,
    pub description: String,
    pub backend: BackendSpec,
    pub read_only: bool,
    pub min_block_size: u32,
    /// Most clients attached at once (`connections_max`; `None`: the server's limit).
    pub clients_max: Option<usize>,
    /// Only clients that switched to TLS may see or use it (`tls_only`).
    pub tls_only: bool,
    /// Advertise `NBD_FLAG_ROTATIONAL`: the data is on a spinning disk, so the kernel client
    /// picks an I/O scheduler that sorts requests (`rotational`).
    pub rotational: bool,
    /// Layers over the data, bottom first (`filters`; `--filter` adds its own under them).
    pub filters: Vec<String>,
    /// The largest read or write payload, advertised in `NBD_INFO_BLOCK_SIZE` (`payload_max`;
    /// `None`: the server's, `--payload-max`).
    pub payload_max: Option<u32>,
    /// How a file is read as a disk, and overlays (`format`, `snapshot`, `force_share`).
    pub image: ImageSettings,
    /// Dirty bitmaps (`bitmaps`, `bitmap_granularity`, `bitmap_dir`).
    pub bitmaps: BitmapSettings,
}

/// The dirty bitmaps of an export (qemu-nbd's `-B NAME`): a qcow2 image's persistent bitmap
/// of that name, else one zcnbd tracks (`export::tracking`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BitmapSettings {
    /// Bitmaps to offer as `qemu:dirty-bitmap:NAME`.
    pub names: Vec<String>,
    /// The granularity of tracked bitmaps made new (`None`: 64 KiB).
    pub granularity: Option<u64>,
    /// Where tracked bitmaps are kept (`None`: beside the export's file; a memory export's
    /// in memory; an RBD image or block device needs one).
    pub dir: Option<PathBuf>,
    /// Whether bitmaps may be made while the server runs (a control socket is open), so
    /// the export records writes even with none yet.
    pub on_demand: bool,
    /// A writable qcow2 image's persistent bitmaps, which zcnbd does not update, are marked
    /// in use (inconsistent) at start instead of refusing the image (`invalidate_bitmaps`).
    pub invalidate: bool,
}

/// How an export's file is read as a disk (qemu-nbd's `--format`, `--snapshot`,
/// `--force-share`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageSettings {
    /// The file's format (`None`: what its first bytes say; raw unless they are an image's).
    pub format: Option<ImageFormat>,
    /// Writes go to a throwaway qcow2 overlay made for the run; the export is never written.
    pub snapshot: bool,
    /// Open a read-only image sharing it with writers (QEMU's locks let them in).
    pub force_share: bool,
}

/// The largest payload an export takes unless configured (`--payload-max`): nbdkit's, which
/// old tools that never ask for block sizes rely on.
pub const PAYLOAD_BYTES_MAX_DEFAULT: u32 = 64 << 20;
/// The largest `--payload-max` / `payload_max` accepted.
pub const PAYLOAD_BYTES_MAX_LIMIT: u32 = 1 << 30;

/// What the command line says for every export of a `--config` file: layers stacked under
/// each export's own, and the payload limit of those that set none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDefaults {
    /// `--filter` layers, under each export's `filters`.
    pub filters_below: Vec<String>,
    /// `--payload-max`, for exports without `payload_max`.
    pub payload_max: u32,
    /// `--control`: every export may get bitmaps while the server runs.
    pub bitmaps_on_demand: bool,
}

impl Default for ExportDefaults {
    fn default() -> Self {
        ExportDefaults {
            filters_below: Vec::new(),
            payload_max: PAYLOAD_BYTES_MAX_DEFAULT,
            bitmaps_on_demand: false,
        }
    }
}

/// What a `--config` file holds: exports and, optionally, the server's TLS settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub exports: Vec<ExportSpec>,
    /// The `[tls]` table (`None` when absent).
    pub tls: Option<TlsConfig>,
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A size string did not parse.
    #[error("bad size {0:?}: {1} (write bytes, or a number with K, M, G, T or P: 512, 64K, 1.5G)")]
    Size(String, String),
    /// A memory or null export of no bytes.
    #[error("export {0:?}: a memory or null export needs at least 1 byte")]
    Empty(String),
    /// The config file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The config file is not valid TOML for this schema.
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// An export table names no backend or several.
    #[error("export {0:?}: set exactly one of memory, file, null, rbd, url")]
    Backend(String),
    /// http_* keys given to an export that is not a URL.
    #[error("export {0:?}: http_connections, http_headers, http_cafile, http_insecure and http_timeout go with url")]
    HttpOptions(String),
    /// An HTTP source's settings are refused, or its server's answers at start.
    #[error("export {name:?}: {url}: {source}")]
    Http {
        name: String,
        /// The URL, redacted (no query).
        url: String,
        source: crate::export::HttpError,
    },
    /// ceph_conf or ceph_id given to an export that is not an RBD image.
    #[error("export {0:?}: ceph_conf and ceph_id go with rbd")]
    CephOptions(String),
    /// An `rbd` value is not `POOL/IMAGE[@SNAP]`.
    #[error(transparent)]
    RbdSpec(#[from] crate::export::RbdSpecError),

    /// A name or description is longer than the protocol allows.
    #[error("export {0:?}: name and description must be at most 4096 bytes")]
    TooLong(String),
    /// A filter name that names no layer.
    #[error("export {export:?}: no filter is called {filter:?} (there are: {})", LAYER_NAMES.join(", "))]
    Filter { export: String, filter: String },
    /// A filter refused its options.
    #[error("export {export:?}: {reason}")]
    FilterOptions { export: String, reason: String },
    /// The payload limit is below the preferred block size, above the limit, or not a
    /// multiple of the minimum block size.
    #[error("export {0:?}: payload_max must be a multiple of block_size_min, at least 4096 (or block_size_min) and at most 1G")]
    PayloadMax(String),
    /// The minimum block size is not a power of two up to 64 KiB.
    #[error("export {0:?}: block_size_min must be a power of two from 1 to 65536")]
    BlockSize(String),
    /// The backend could not be set up.
    #[error("export {name:?}: {source}")]
    Open {
        name: String,
        source: std::io::Error,
    },
    /// The export's file could not be opened (the message names it).
    #[error("export {name:?}: cannot open {}: {source}", path.display())]
    OpenFile {
        name: String,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The export's disk image (or a file of its chain) could not be opened.
    #[error("export {name:?}: {source}")]
    Image { name: String, source: ImageError },
    /// `format` names no format.
    #[error("export {name:?}: no format is called {format:?} (there are: raw, qcow2, vmdk)")]
    Format { name: String, format: String },
    /// Image settings that do not go together or with the backend.
    #[error("export {name:?}: {why}")]
    ImageSettings { name: String, why: &'static str },
    /// A dirty bitmap could not be made or loaded.
    #[error("{source}")]
    Bitmap {
        name: String,
        source: Box<crate::export::tracking::TrackingError>,
    },
    /// Tracked bitmaps of this kind of export need a directory to be kept in.
    #[error("export {name:?}: bitmaps zcnbd tracks for {what} are kept in bitmap_dir (--bitmap-dir DIR): set one")]
    BitmapDir { name: String, what: &'static str },
}

/// Parses sizes like `64M`, `1G`, `1T` (binary units) or plain bytes.
pub fn parse_size(text: &str) -> Result<u64, ConfigError> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(text)
        .map_err(|e| ConfigError::Size(text.to_owned(), e.to_string()))
}

/// A memory or null export's size: at least one byte.
fn disk_size(text: &str, name: &str) -> Result<u64, ConfigError> {
    match parse_size(text)? {
        0 => Err(ConfigError::Empty(name.to_owned())),
        bytes => Ok(bytes),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    export: Vec<ExportTable>,
    tls: Option<TlsConfig>,
}

/// A filter in TOML: `"NAME:KEY=VALUE,..."` as on the command line, or a table
/// `{ name = "NAME", KEY = VALUE, ... }`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FilterEntry {
    Text(String),
    Table(std::collections::BTreeMap<String, toml::Value>),
}

impl FilterEntry {
    /// The command line's form, `NAME:KEY=VALUE,...`.
    fn into_text(self, export: &str) -> Result<String, ConfigError> {
        let mut table = match self {
            FilterEntry::Text(text) => return Ok(text),
            FilterEntry::Table(table) => table,
        };
        let refuse = |reason: String| ConfigError::FilterOptions {
            export: export.to_owned(),
            reason,
        };
        let name = match table.remove("name") {
            Some(toml::Value::String(name)) => name,
            _ => return Err(refuse("a filter table needs name = \"NAME\"".into())),
        };
        let mut text = name.clone();
        for (i, (key, value)) in table.into_iter().enumerate() {
            let value = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Float(x) => x.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                _ => {
                    return Err(refuse(format!(
                        "filter {name}: {key} must be a string, number or boolean"
                    )))
                }
            };
            if value.contains(',') || key.contains(['=', ',']) {
                return Err(refuse(format!(
                    "filter {name}: {key}: a key or value cannot hold ',' (or a key '=')"
                )));
            }
            text.push(if i == 0 { ':' } else { ',' });
            text.push_str(&format!("{key}={value}"));
        }
        Ok(text)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportTable {
    #[serde(default)]
    name: String,
    #[serde(default)]
    description: String,
    memory: Option<String>,
    null: Option<String>,
    file: Option<PathBuf>,
    rbd: Option<String>,
    url: Option<String>,
    http_connections: Option<usize>,
    #[serde(default)]
    http_headers: Vec<String>,
    http_cafile: Option<PathBuf>,
    #[serde(default)]
    http_insecure: bool,
    http_timeout: Option<String>,
    ceph_conf: Option<PathBuf>,
    ceph_id: Option<String>,
    #[serde(default)]
    direct: bool,
    #[serde(default)]
    read_only: bool,
    #[serde(default = "one", alias = "min_block_size")]
    block_size_min: u32,
    #[serde(alias = "max_connections")]
    connections_max: Option<usize>,
    #[serde(default)]
    tls_only: bool,
    #[serde(default)]
    rotational: bool,
    #[serde(default)]
    filters: Vec<FilterEntry>,
    #[serde(alias = "max_payload")]
    payload_max: Option<String>,
    format: Option<String>,
    #[serde(default)]
    snapshot: bool,
    #[serde(default)]
    force_share: bool,
    #[serde(default)]
    bitmaps: Vec<String>,
    bitmap_granularity: Option<String>,
    bitmap_dir: Option<PathBuf>,
    #[serde(default)]
    invalidate_bitmaps: bool,
}

fn one() -> u32 {
    1
}

impl ExportTable {
    fn into_spec(self) -> Result<ExportSpec, ConfigError> {
        let ceph_options = self.ceph_conf.is_some() || self.ceph_id.is_some();
        let http_options = self.has_http_keys();
        let http = self.url.as_deref().map(|u| self.http_spec(u)).transpose()?;
        let backend = match (self.memory, self.null, self.file, self.rbd, http) {
            (Some(size), None, None, None, None) => {
                BackendSpec::Memory(disk_size(&size, &self.name)?)
            }
            (None, Some(size), None, None, None) => {
                BackendSpec::Null(disk_size(&size, &self.name)?)
            }
            (None, None, Some(path), None, None) => BackendSpec::File {
                path,
                direct: self.direct,
            },
            (None, None, None, Some(image), None) => BackendSpec::Rbd(RbdSpec {
                conf: self.ceph_conf,
                id: self.ceph_id,
                ..RbdSpec::parse(&image)?
            }),
            (None, None, None, None, Some(http)) => BackendSpec::Http(http),
            _ => return Err(ConfigError::Backend(self.name)),
        };
        if ceph_options && !matches!(backend, BackendSpec::Rbd(_)) {
            return Err(ConfigError::CephOptions(self.name));
        }
        if http_options && !matches!(backend, BackendSpec::Http(_)) {
            return Err(ConfigError::HttpOptions(self.name));
        }
        let format = match self.format.as_deref() {
            None => None,
            Some(name) => Some(ImageFormat::named(name).ok_or_else(|| ConfigError::Format {
                name: self.name.clone(),
                format: name.to_owned(),
            })?),
        };
        let image = ImageSettings {
            format,
            snapshot: self.snapshot,
            force_share: self.force_share,
        };
        let bitmaps = BitmapSettings {
            names: self.bitmaps,
            granularity: self
                .bitmap_granularity
                .as_deref()
                .map(parse_size)
                .transpose()?,
            dir: self.bitmap_dir,
            on_demand: false,
            invalidate: self.invalidate_bitmaps,
        };
        let filters = self
            .filters
            .into_iter()
            .map(|f| f.into_text(&self.name))
            .collect::<Result<_, _>>()?;
        Ok(ExportSpec {
            image,
            bitmaps,
            name: self.name,
            description: self.description,
            backend,
            read_only: self.read_only,
            min_block_size: self.block_size_min,
            clients_max: self.connections_max,
            tls_only: self.tls_only,
            rotational: self.rotational,
            filters,
            payload_max: self
                .payload_max
                .as_deref()
                .map(parse_payload_max)
                .transpose()?,
        })
    }
}

impl Config {
    /// Applies the command line's `defaults` to every export: its layers under each
    /// export's own, its payload limit where an export sets none.
    pub fn with_defaults(mut self, defaults: &ExportDefaults) -> Config {
        for export in &mut self.exports {
            let below = defaults.filters_below.iter().cloned();
            export.filters.splice(0..0, below);
            export.payload_max.get_or_insert(defaults.payload_max);
            export.bitmaps.on_demand |= defaults.bitmaps_on_demand;
        }
        self
    }
}

/// A payload limit as a size string (`64M`); what fits no `u32` is refused by the caller's
/// checks as too large.
pub fn parse_payload_max(text: &str) -> Result<u32, ConfigError> {
    let bytes = parse_size(text)?;
    Ok(u32::try_from(bytes).unwrap_or(u32::MAX))
}

/// Reads a TOML config file: its exports and its `[tls]` table.
pub fn load_config(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_config(&text).map_err(|e| match e {
        ConfigError::Parse { message, .. } => ConfigError::Parse {
            path: path.to_owned(),
            message,
        },
        other => other,
    })
}

fn parse_config(text: &str) -> Result<Config, ConfigError> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: PathBuf::new(),
        message: e.to_string(),
    })?;
    let exports = file
        .export
        .into_iter()
        .map(ExportTable::into_spec)
        .collect::<Result<_, _>>()?;
    Ok(Config {
        exports,
        tls: file.tls,
    })
}

impl ExportSpec {
    /// Opens the backend and makes the export.
    pub fn build(&self) -> Result<Export, ConfigError> {
        self.build_keeping(None)
    }

    /// Opens the backend and makes the export, with `bitmaps` if given (a reload's, of the
    /// same data) instead of new ones.
    pub(crate) fn build_keeping(
        &self,
        bitmaps: Option<Arc<Bitmaps>>,
    ) -> Result<Export, ConfigError> {
        self.check()?;
        // Before the open, which may write (an image's header): what a bitmap file's
        // identity of the file is compared with.
        let served = self.served_file();
        let backend = self.open()?;
        self.with_backend(backend, bitmaps, served)
    }

    /// The export over `backend`, an open backend this spec describes (a reload keeps an
    /// export's backend when only its settings changed), with the spec's layers over it, and
    /// on top the dirty bitmaps: `bitmaps` if given (a reload keeps them, adding any the
    /// spec names anew), else the spec's, for the content of `served` (the served file as it
    /// was before `backend` opened it; for a kept backend, as it is now).
    pub(crate) fn with_backend(
        &self,
        backend: Arc<dyn Backend>,
        bitmaps: Option<Arc<Bitmaps>>,
        served: Option<ServedFile>,
    ) -> Result<Export, ConfigError> {
        self.check()?;
        // An RBD snapshot cannot be written, unless an overlay takes the writes. (A
        // read-only upstream NBD export or a web server's file says so in its capabilities,
        // which the stack follows: unless a layer takes the writes, as the cache does in
        // writeback, or --snapshot's overlay.)
        let snapshot = matches!(&self.backend, BackendSpec::Rbd(spec) if spec.snap.is_some());
        let unwritable = snapshot && !self.image.snapshot;
        let mut layers = self.layers()?;
        let bitmaps = self.tracked_bitmaps(&*backend, bitmaps, served)?;
        if let Some(bitmaps) = &bitmaps {
            layers.push(Arc::new(Tracking(Arc::clone(bitmaps))));
        }
        let stack = Stack::open(backend, layers, self.read_only || unwritable).map_err(|e| {
            ConfigError::FilterOptions {
                export: self.name.clone(),
                reason: e.to_string(),
            }
        })?;
        let backend_minimum = stack.block_size_minimum();
        Ok(Export {
            name: self.name.clone(),
            description: self.description.clone(),
            block_size: self.block_size_over(backend_minimum),
            stack: Arc::new(stack),
            clients_max: self.clients_max,
            tls_only: self.tls_only,
            rotational: self.rotational,
            bitmaps,
            source: self.source(),
        })
    }

    /// What it serves, for the log: the backend and how it is opened.
    pub fn source(&self) -> String {
        let mut source = match &self.backend {
            BackendSpec::Memory(_) => "memory".to_owned(),
            BackendSpec::Null(_) => "null".to_owned(),
            BackendSpec::File { path, direct } => {
                let direct = if *direct { ", O_DIRECT" } else { "" };
                format!("file {}{direct}", path.display())
            }
            BackendSpec::Rbd(spec) => {
                let ns = spec
                    .namespace
                    .as_deref()
                    .map(|n| format!("{n}/"))
                    .unwrap_or_default();
                let snap = spec
                    .snap
                    .as_deref()
                    .map(|s| format!("@{s}"))
                    .unwrap_or_default();
                format!("rbd:{}/{ns}{}{snap}", spec.pool, spec.image)
            }
            BackendSpec::Nbd {
                uri, connections, ..
            } => {
                format!("{uri}, {connections} connection(s)")
            }
            BackendSpec::Http(spec) => spec.describe(),
        };
        if let Some(format) = self.image.format {
            source.push_str(&format!(" ({})", format.name()));
        }
        if self.image.snapshot {
            source.push_str(", writes to a throwaway overlay");
        }
        source
    }

    /// Whether the backend `self` opens is the one `other` opens: the same data, and a file
    /// or RBD image opened the same way (a read-only export's is opened read-only).
    pub(crate) fn same_backend(&self, other: &ExportSpec) -> bool {
        let opened = matches!(
            self.backend,
            BackendSpec::File { .. } | BackendSpec::Rbd(_) | BackendSpec::Nbd { .. }
        );
        self.backend == other.backend
            && self.image == other.image
            && (!opened || self.read_only == other.read_only)
    }

    /// The layers `filters` names, bottom first.
    fn layers(&self) -> Result<Vec<Arc<dyn Layer>>, ConfigError> {
        let named = |filter: &String| {
            layer_named(filter).map_err(|e| match e {
                LayerError::Unknown(name) => ConfigError::Filter {
                    export: self.name.clone(),
                    filter: name,
                },
                LayerError::Options(reason) => ConfigError::FilterOptions {
                    export: self.name.clone(),
                    reason,
                },
            })
        };
        self.filters.iter().map(named).collect()
    }

    /// The advertised size constraints.
    fn block_size(&self) -> BlockSize {
        self.block_size_over(1)
    }

    /// The advertised size constraints over a backend that needs `backend_minimum`
    /// alignment (an NBD upstream's minimum block size, where larger than the spec's).
    fn block_size_over(&self, backend_minimum: u32) -> BlockSize {
        let wanted = BlockSize::with_minimum(self.min_block_size.max(backend_minimum));
        let minimum = match wanted.is_valid() {
            true => wanted,
            false => BlockSize::with_minimum(self.min_block_size),
        };
        BlockSize {
            payload_max: self.payload_max.unwrap_or(PAYLOAD_BYTES_MAX_DEFAULT),
            ..minimum
        }
    }

    /// What the protocol allows of the settings.
    fn check(&self) -> Result<(), ConfigError> {
        let name = &self.name;
        if name.len() > 4096 || self.description.len() > 4096 {
            return Err(ConfigError::TooLong(name.clone()));
        }
        if !BlockSize::with_minimum(self.min_block_size).is_valid() {
            return Err(ConfigError::BlockSize(name.clone()));
        }
        let block_size = self.block_size();
        if !block_size.is_valid()
            || block_size.payload_max > PAYLOAD_BYTES_MAX_LIMIT
            || !block_size.payload_max.is_multiple_of(block_size.minimum)
        {
            return Err(ConfigError::PayloadMax(name.clone()));
        }
        if let BackendSpec::Http(spec) = &self.backend {
            spec.check().map_err(|source| ConfigError::Http {
                name: name.clone(),
                url: spec.redacted(),
                source: source.into(),
            })?;
        }
        self.check_image()
            .map_err(|why| ConfigError::ImageSettings {
                name: name.clone(),
                why,
            })?;
        self.layers().map(drop)
    }
}

/// The `--config` file a server's exports came from: what SIGHUP re-reads.
#[derive(Debug, Clone)]
pub struct ReloadSource {
    /// The file.
    pub path: PathBuf,
    /// What it held at start: `ServerConfig::exports` were built from
    /// `config.exports`, one each, in order; `config.tls` is the TLS settings in effect (the
    /// file's `[tls]` table, or the `--tls*` options when `tls_from_command_line`).
    pub config: Config,
    /// `--tls*` options replaced the file's `[tls]` table: a reload loads `config.tls` again
    /// (renewed credentials) and does not look at the file's table.
    pub tls_from_command_line: bool,
    /// What the command line says for every export (`--filter`, `--payload-max`), applied
    /// again at each reload.
    pub defaults: ExportDefaults,
}

/// Whether `source` is an NBD URI (an upstream export) rather than a file.
pub fn is_nbd_uri(source: &str) -> bool {
    [
        "nbd://",
        "nbds://",
        "nbd+unix://",
        "nbds+unix://",
        "nbd+vsock://",
        "nbds+vsock://",
    ]
    .iter()
    .any(|scheme| source.starts_with(scheme))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_binary() {
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn config_file_with_several_exports() {
        let specs = parse_config(
            r#"
            [[export]]
            name = "mem"
            description = "a memory disk"
            memory = "64M"
            [[export]]
            name = "zero"
            null = "1G"
            read_only = true
            [[export]]
            name = "disk"
            file = "/tmp/x"
            direct = true
            block_size_min = 512
            connections_max = 2
            tls_only = true
            rotational = true
            [tls]
            mode = "on"
            certificates = "/etc/zcnbd/tls"
            ktls = "off"
            "#,
        )
        .unwrap();
        let tls = specs.tls.unwrap();
        assert_eq!(tls.mode, crate::tls::TlsMode::On);
        assert_eq!(tls.certificates, Some("/etc/zcnbd/tls".into()));
        assert_eq!(tls.ktls, crate::tls::KtlsMode::Off);
        let specs = specs.exports;
        assert_eq!((specs[0].tls_only, specs[2].tls_only), (false, true));
        assert_eq!((specs[0].rotational, specs[2].rotational), (false, true));
        assert_eq!(specs.len(), 3);
        assert_eq!(specs[0].backend, BackendSpec::Memory(64 << 20));
        assert!(specs[1].read_only);
        assert_eq!(
            specs[2].backend,
            BackendSpec::File {
                path: "/tmp/x".into(),
                direct: true
            }
        );
        assert_eq!(specs[2].min_block_size, 512);
        assert_eq!(
            (specs[0].clients_max, specs[2].clients_max),
            (None, Some(2))
        );
    }

    #[test]
    fn rbd_exports_parse() {
        let config = parse_config(
            "[[export]]\nname = \"vm\"\nrbd = \"pool/img@s1\"\n\
             ceph_conf = \"/etc/ceph/c2.conf\"\nceph_id = \"nbd\"\n",
        )
        .expect("rbd export");
        let BackendSpec::Rbd(spec) = &config.exports[0].backend else {
            panic!("not rbd: {:?}", config.exports[0].backend);
        };
        assert_eq!((spec.pool.as_str(), spec.image.as_str()), ("pool", "img"));
        assert_eq!(spec.snap.as_deref(), Some("s1"));
        assert_eq!(spec.conf.as_deref(), Some(Path::new("/etc/ceph/c2.conf")));
        assert_eq!(spec.id.as_deref(), Some("nbd"));
        assert!(matches!(
            parse_config("[[export]]\nmemory = \"1M\"\nceph_id = \"nbd\"\n"),
            Err(ConfigError::CephOptions(_))
        ));
        assert!(matches!(
            parse_config("[[export]]\nrbd = \"no-slash\"\n"),
            Err(ConfigError::RbdSpec(_))
        ));
        assert!(matches!(
            parse_config("[[export]]\nrbd = \"p/i\"\nfile = \"/tmp/x\"\n"),
            Err(ConfigError::Backend(_))
        ));
    }

    #[test]
    fn image_settings_parse_and_bad_ones_are_refused() {
        let config = parse_config(
            "[[export]]\nname = \"vm\"\nfile = \"/tmp/vm.qcow2\"\nformat = \"qcow2\"\n\
             snapshot = true\nforce_share = true\n",
        )
        .expect("image export");
        let image = &config.exports[0].image;
        assert_eq!(image.format, Some(ImageFormat::Qcow2));
        assert!(image.snapshot && image.force_share);
        assert!(matches!(
            parse_config("[[export]]\nfile = \"/tmp/x\"\nformat = \"qed\"\n"),
            Err(ConfigError::Format { .. })
        ));
        let refused = |toml: &str| {
            let spec = parse_config(toml).expect("parses").exports.remove(0);
            matches!(spec.build(), Err(ConfigError::ImageSettings { .. }))
        };
        assert!(refused("[[export]]\nmemory = \"1M\"\nsnapshot = true\n"));
        assert!(refused("[[export]]\nmemory = \"1M\"\nformat = \"raw\"\n"));
        assert!(refused(
            "[[export]]\nfile = \"/tmp/x\"\nforce_share = true\n"
        ));
        assert!(refused(
            "[[export]]\nfile = \"/tmp/x\"\ndirect = true\nsnapshot = true\n"
        ));
        // An image takes direct (its data clusters): no refusal of the settings.
        let image = "[[export]]\nfile = \"/tmp/x\"\ndirect = true\nformat = \"qcow2\"\n";
        let spec = parse_config(image).expect("parses").exports.remove(0);
        assert!(!matches!(
            spec.build(),
            Err(ConfigError::ImageSettings { .. })
        ));
    }

    #[test]
    fn bitmap_settings_parse_and_make_tracked_bitmaps() {
        let dir = tempfile::tempdir().unwrap();
        let toml = format!(
            "[[export]]\nname = \"m\"\nmemory = \"1M\"\nbitmaps = [\"b0\", \"b1\"]\n\
             bitmap_granularity = \"128K\"\n\
             [[export]]\nname = \"n\"\nnull = \"1M\"\nbitmap_dir = {:?}\n",
            dir.path()
        );
        let config = parse_config(&toml).expect("bitmaps");
        let m = &config.exports[0].bitmaps;
        assert_eq!(m.names, ["b0", "b1"]);
        assert_eq!(m.granularity, Some(128 << 10));
        assert_eq!(config.exports[1].bitmaps.dir.as_deref(), Some(dir.path()));
        let export = config.exports[0].build().unwrap();
        assert_eq!(
            export.info().meta_contexts,
            ["qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"]
        );
        // No names and no control socket: no tracking layer at all.
        assert!(config.exports[1].build().unwrap().bitmaps.is_none());
        let defaults = ExportDefaults {
            bitmaps_on_demand: true,
            ..ExportDefaults::default()
        };
        let config = Config {
            exports: vec![config.exports[1].clone()],
            tls: None,
        }
        .with_defaults(&defaults);
        let export = config.exports[0].build().unwrap();
        assert!(export.bitmaps.is_some() && export.info().meta_contexts.is_empty());
        let invalidating = parse_config("[[export]]\nfile = \"/x\"\ninvalidate_bitmaps = true\n");
        assert!(invalidating.expect("parses").exports[0].bitmaps.invalidate);
        let bad = parse_config("[[export]]\nmemory = \"1M\"\nbitmaps = [\"a/b\"]\n");
        let spec = bad.expect("parses").exports.remove(0);
        assert!(matches!(spec.build(), Err(ConfigError::Bitmap { .. })));
    }

    #[test]
    fn config_errors_are_reported() {
        assert!(matches!(
            parse_config("[[export]]\nname = \"a\"\n"),
            Err(ConfigError::Backend(_))
        ));
        assert!(matches!(
            parse_config("[[export]]\nmemory = \"1M\"\nnull = \"1M\"\n"),
            Err(ConfigError::Backend(_))
        ));
        assert!(matches!(
            parse_config("[[export]]\nbogus = 1\n"),
            Err(ConfigError::Parse { .. })
        ));
        let bad_block = ExportSpec {
            name: String::new(),
            description: String::new(),
            backend: BackendSpec::Null(1 << 20),
            read_only: false,
            min_block_size: 3,
            clients_max: None,
            tls_only: false,
            rotational: false,
            filters: Vec::new(),
            payload_max: None,
            image: ImageSettings::default(),
            bitmaps: BitmapSettings::default(),
        };
        assert!(matches!(bad_block.build(), Err(ConfigError::BlockSize(_))));
        for bad in [1000, 2 << 30, 4096 + 512] {
            let spec = ExportSpec {
                min_block_size: 1024,
                payload_max: Some(bad),
                ..bad_block.clone()
            };
            assert!(
                matches!(spec.build(), Err(ConfigError::PayloadMax(_))),
                "{bad}"
            );
        }
        let missing = ExportSpec {
            min_block_size: 1,
            backend: BackendSpec::File {
                path: "/nonexistent/zcnbd-missing.img".into(),
                direct: false,
            },
            ..bad_block.clone()
        };
        let message = missing.build().unwrap_err().to_string();
        assert!(
            message.contains("/nonexistent/zcnbd-missing.img"),
            "{message}"
        );
        let unknown = ExportSpec {
            min_block_size: 1,
            filters: vec!["passthrough".into(), "bogus".into()],
            ..bad_block
        };
        let message = unknown.build().unwrap_err().to_string();
        assert!(
            message.contains("\"bogus\"") && message.contains("passthrough"),
            "{message}"
        );
    }

    #[test]
    fn nbd_uris_are_told_from_files() {
        assert!(is_nbd_uri("nbd://h/x") && is_nbd_uri("nbds+unix:///?socket=/s"));
        assert!(!is_nbd_uri("disk.img") && !is_nbd_uri("rbd:p/i") && !is_nbd_uri("nbd.img"));
    }

    #[test]
    fn the_old_key_spellings_still_read() {
        let text = "[[export]]\nname = \"a\"\nmemory = \"1M\"\nmax_payload = \"16M\"\n\
                    min_block_size = 512\nmax_connections = 3\n";
        let spec = parse_config(text).unwrap().exports[0].build().unwrap();
        assert_eq!(spec.block_size.payload_max, 16 << 20);
        assert_eq!(spec.block_size.minimum, 512);
        assert_eq!(spec.clients_max, Some(3));
    }

    #[test]
    fn payload_limits_come_from_the_export_else_the_command_line() {
        let text = "[[export]]\nname = \"a\"\nmemory = \"1M\"\npayload_max = \"16M\"\n\
                    [[export]]\nname = \"b\"\nnull = \"1M\"\n";
        let defaults = ExportDefaults {
            payload_max: 8 << 20,
            ..ExportDefaults::default()
        };
        let config = parse_config(text).unwrap().with_defaults(&defaults);
        let sizes: Vec<u32> = config
            .exports
            .iter()
            .map(|e| e.build().unwrap().block_size.payload_max)
            .collect();
        assert_eq!(sizes, [16 << 20, 8 << 20]);
        let alone = parse_config("[[export]]\nnull = \"1M\"\n").unwrap();
        let info = alone.exports[0].build().unwrap().info();
        assert_eq!(info.block_size.payload_max, PAYLOAD_BYTES_MAX_DEFAULT);
    }

    #[test]
    fn filters_in_toml_are_strings_or_tables() {
        let text = "[[export]]\nname = \"a\"\nmemory = \"1M\"\nfilters = [\"log:logfile=/x\", \
                    { name = \"delay\", rdelay = \"10ms\", wdelay = 1.5 }, \
                    { name = \"retry\", retries = 3, retry-writes = true }]\n";
        let config = parse_config(text).unwrap();
        assert_eq!(
            config.exports[0].filters,
            [
                "log:logfile=/x",
                "delay:rdelay=10ms,wdelay=1.5",
                "retry:retries=3,retry-writes=true"
            ]
        );
        for bad in [
            "{ rdelay = \"1\" }",
            "{ name = \"delay\", rdelay = \"1,2\" }",
            "{ name = \"delay\", rdelay = [1] }",
        ] {
            let text = format!("[[export]]\nname = \"a\"\nmemory = \"1M\"\nfilters = [{bad}]\n");
            assert!(parse_config(&text).is_err(), "{bad}");
        }
    }

    #[test]
    fn filters_stack_in_order_with_the_command_lines_below() {
        let text = "[[export]]\nname = \"a\"\nmemory = \"1M\"\nfilters = [\"passthrough\"]\n\
                    [[export]]\nname = \"b\"\nnull = \"1M\"\n";
        let config = parse_config(text).unwrap();
        assert_eq!(config.exports[0].filters, ["passthrough"]);
        assert!(config.exports[1].filters.is_empty());
        let defaults = ExportDefaults {
            filters_below: vec!["passthrough".to_owned()],
            ..ExportDefaults::default()
        };
        let config = config.with_defaults(&defaults);
        assert_eq!(config.exports[0].filters, ["passthrough", "passthrough"]);
        assert_eq!(config.exports[1].filters, ["passthrough"]);
        let export = config.exports[0].build().unwrap();
        assert_eq!(export.stack.layer_names(), ["passthrough", "passthrough"]);
    }
}
