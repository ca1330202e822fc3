//! `--control PATH`: a Unix socket (mode 0600) on which the server's owner manages the
//! dirty bitmaps of running exports without disconnecting their clients - the step a backup
//! tool takes at each checkpoint. `zcnbd bitmap` speaks it; so can any program.
//!
//! One request per connection: a line of JSON, `{"op": "add" | "clear" | "remove" |
//! "list", "export": NAME, "bitmap": NAME, "granularity": BYTES}` (`export` defaults to "",
//! `granularity` is for `add`, `list` takes no bitmap and, without an export, lists every
//! export's), or `{"op": "set", "export": NAME, "filter": "rate", "key": "rate", "value":
//! "40M"}` (a filter's option changed while serving: `zcnbd filter`), answered with a line of JSON: `{"ok": true, ...}` or `{"ok": false,
//! "error": WHY}`. A request is read for at most [`REQUEST_BYTES_MAX`] bytes and
//! [`REQUEST_TIMEOUT`], so a client that stalls holds the socket no longer than that.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use zcnbd_proto::meta::DIRTY_BITMAP_PREFIX;

use crate::export::tracking::BitmapInfo;
use crate::server::Server;
use crate::unix_socket::{self, SocketFile};

/// Longest request line.
pub const REQUEST_BYTES_MAX: usize = 4096;
/// How long a request may take to arrive.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlRequest {
    pub op: ControlOp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bitmap: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granularity: Option<u64>,
    /// For `set`: the filter, its option and the new value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ControlOp {
    /// Start tracking a bitmap (empty, or as its file left it).
    Add,
    /// Mark a bitmap clean (a checkpoint).
    Clear,
    /// Stop tracking a bitmap and delete its file.
    Remove,
    /// The bitmaps of one export, or of all.
    List,
    /// Change a filter's option while serving (the rate filter's rates).
    Set,
}

/// The answer to a request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlReply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bitmaps: Vec<ListedBitmap>,
}

/// One bitmap in a `list` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedBitmap {
    pub export: String,
    pub name: String,
    pub granularity: u64,
    pub dirty_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
}

impl ControlReply {
    fn failed(why: impl ToString) -> ControlReply {
        ControlReply {
            ok: false,
            error: Some(why.to_string()),
            bitmaps: Vec::new(),
        }
    }

    fn done() -> ControlReply {
        ControlReply {
            ok: true,
            ..ControlReply::default()
        }
    }
}

/// The control socket, removed when dropped (if it is still this one).
#[derive(Debug)]
pub(crate) struct ControlSocket {
    _file: SocketFile,
}

/// Listens on `path` (`unix_socket.rs`: a stale socket left there by a server that died is
/// replaced; a live one, or any other file, is not) and answers requests about `server`'s
/// exports on a thread of its own.
pub(crate) fn spawn(path: &Path, server: &Arc<Server>) -> io::Result<ControlSocket> {
    let (listener, file) = unix_socket::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    info!("control socket on {}", path.display());
    let server = Arc::downgrade(server);
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => {
                        if let Err(e) = respond(s, &server) {
                            warn!("control request failed: {e}");
                        }
                    }
                    Err(e) => warn!("control socket accept failed: {e}"),
                }
            }
        })?;
    Ok(ControlSocket { _file: file })
}

fn respond(stream: UnixStream, server: &Weak<Server>) -> io::Result<()> {
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut line = Vec::new();
    BufReader::new((&stream).take(REQUEST_BYTES_MAX as u64 + 1)).read_until(b'\n', &mut line)?;
    let reply = if line.len() > REQUEST_BYTES_MAX {
        ControlReply::failed(format!("request longer than {REQUEST_BYTES_MAX} bytes"))
    } else {
        match (
            serde_json::from_slice::<ControlRequest>(&line),
            server.upgrade(),
        ) {
            (Err(e), _) => ControlReply::failed(format!("bad request: {e}")),
            (Ok(_), None) => ControlReply::failed("the server is stopping"),
            (Ok(request), Some(server)) => answer(&server, &request),
        }
    };
    if let Some(why) = &reply.error {
        info!("control request refused: {why}");
    }
    let mut text = serde_json::to_vec(&reply).map_err(io::Error::other)?;
    text.push(b'\n');
    (&stream).write_all(&text)
}

/// Does what `request` asks of `server`'s exports.
pub(crate) fn answer(server: &Server, request: &ControlRequest) -> ControlReply {
    let set = server.exports.load();
    let export_name = request.export.as_deref().unwrap_or("");
    if request.op == ControlOp::List && request.export.is_none() {
        let bitmaps = set
            .iter()
            .filter_map(|o| Some((o.name(), o.export.bitmaps.as_ref()?.list())))
            .flat_map(|(export, list)| list.into_iter().map(move |b| listed(export, b)))
            .collect();
        return ControlReply {
            ok: true,
            error: None,
            bitmaps,
        };
    }
    let Some(offered) = set.find(export_name) else {
        return ControlReply::failed(format!("no export is called {export_name:?}"));
    };
    if request.op == ControlOp::Set {
        let (Some(filter), Some(key), Some(value)) =
            (&request.filter, &request.key, &request.value)
        else {
            return ControlReply::failed("set needs \"filter\", \"key\" and \"value\"");
        };
        return match offered.export.stack.set_layer_option(filter, key, value) {
            Ok(()) => {
                info!(
                    export = export_name,
                    filter, key, value, "filter option changed"
                );
                ControlReply::done()
            }
            Err(e) => ControlReply::failed(e),
        };
    }
    let Some(bitmaps) = &offered.export.bitmaps else {
        return ControlReply::failed(format!(
            "export {export_name:?} tracks no bitmaps (it is not writable through zcnbd, or the server started without --control)"
        ));
    };
    let name = request.bitmap.as_deref();
    let result = match (request.op, name) {
        (ControlOp::List, _) => {
            let list = bitmaps.list().into_iter().map(|b| listed(export_name, b));
            return ControlReply {
                ok: true,
                error: None,
                bitmaps: list.collect(),
            };
        }
        // Answered above.
        (ControlOp::Set, _) => return ControlReply::done(),
        (_, None) => return ControlReply::failed("name the bitmap (\"bitmap\")"),
        // The source's bitmap of that name would win (`Tracking::meta_contexts`): one
        // tracked beside it would never be served.
        (ControlOp::Add, Some(name)) if !bitmaps.has(name) && source_has(&offered.export, name) => {
            return ControlReply::failed(format!(
                "export {export_name:?} has a bitmap {name:?} of its own (its image's or its NBD upstream's), served from there"
            ))
        }
        (ControlOp::Add, Some(name)) => bitmaps.add(name, request.granularity),
        (ControlOp::Clear, Some(name)) => bitmaps.clear(name),
        (ControlOp::Remove, Some(name)) => bitmaps.remove(name),
    };
    match result {
        Ok(()) => {
            if matches!(request.op, ControlOp::Add | ControlOp::Remove) {
                // The export's contexts changed: new clients see it.
                drop(set);
                server.exports.reoffer(export_name);
            }
            ControlReply::done()
        }
        Err(e) => ControlReply::failed(e),
    }
}

/// Whether `export` offers the dirty bitmap `name` (one that zcnbd does not track: the
/// caller checks that).
fn source_has(export: &crate::export::Export, name: &str) -> bool {
    let context = format!("{DIRTY_BITMAP_PREFIX}{name}");
    export.stack.meta_contexts().contains(&context)
}

fn listed(export: &str, b: BitmapInfo) -> ListedBitmap {
    ListedBitmap {
        export: export.to_owned(),
        name: b.name,
        granularity: b.granularity,
        dirty_bytes: b.dirty_bytes,
        file: b.file,
    }
}

/// Sends `request` to the control socket at `path` and returns the reply (`zcnbd bitmap`).
pub fn request(path: &Path, request: &ControlRequest) -> io::Result<ControlReply> {
    let stream = UnixStream::connect(path)?;
    stream.set_read_timeout(Some(REQUEST_TIMEOUT * 2))?;
    let mut text = serde_json::to_vec(request).map_err(io::Error::other)?;
    text.push(b'\n');
    (&stream).write_all(&text)?;
    let mut line = Vec::new();
    BufReader::new(&stream).read_until(b'\n', &mut line)?;
    serde_json::from_slice(&line).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}
