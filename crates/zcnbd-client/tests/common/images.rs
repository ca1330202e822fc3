//! Disk images with metadata to report, served by qemu-nbd or zcnbd, and nbdinfo's map of
//! them as the oracle: a qcow2 over a qcow2 backing file (so `qemu:allocation-depth` has
//! depths 0, 1 and 2) whose top carries a persistent dirty bitmap `b0` (so
//! `qemu:dirty-bitmap:b0` has dirty ranges), made with qemu-img and qemu-io.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::servers::{ci, installed, zcnbd_bin};

/// Size of the image.
pub const IMAGE_BYTES: u64 = 64 << 20;
/// The persistent bitmap of the top image.
pub const BITMAP: &str = "qemu:dirty-bitmap:b0";
/// The ranges written to the top image after `b0` was added: exactly its dirty ranges
/// (64 KiB aligned, the bitmap's granularity).
pub const DIRTY: [(u64, u64); 3] = [
    (1 << 20, 64 << 10),
    (10 << 20, 192 << 10),
    (20 << 20, 64 << 10),
];

/// One extent of a map: offset, length, flags.
pub type Mapped = (u64, u64, u32);

/// Says why a test cannot run (under CI=true that fails it instead) and returns `None`.
pub fn skip<T>(what: &str, why: &str) -> Option<T> {
    assert!(!ci(), "{what}: {why} (CI=true requires every tool)");
    eprintln!("SKIP {what}: {why}");
    None
}

/// The first of `tools` that is not installed.
pub fn missing(tools: &[&str]) -> Option<String> {
    tools.iter().find(|t| !installed(t)).map(|t| t.to_string())
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds `base.qcow2` (data at 0..2M and 8M..9M) and over it `img.qcow2` with bitmap `b0`
/// and the [`DIRTY`] writes (the last one writes zeroes); returns the top image's path.
pub fn make_chain(dir: &Path) -> PathBuf {
    let base = dir.join("base.qcow2");
    let top = dir.join("img.qcow2");
    let (base_s, top_s) = (base.display().to_string(), top.display().to_string());
    let size = IMAGE_BYTES.to_string();
    run("qemu-img", &["create", "-q", "-f", "qcow2", &base_s, &size]);
    let writes = ["write -P 0x11 0 2M", "write -P 0x12 8M 1M"];
    qemu_io(&base_s, &writes);
    let backing = [
        "create", "-q", "-f", "qcow2", "-b", &base_s, "-F", "qcow2", &top_s,
    ];
    run("qemu-img", &backing);
    run("qemu-img", &["bitmap", "--add", &top_s, "b0"]);
    qemu_io(
        &top_s,
        &[
            "write -P 0x55 1M 64k",
            "write -P 0x66 10M 192k",
            "write -z 20M 64k",
        ],
    );
    top
}

fn qemu_io(image: &str, commands: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    for c in commands {
        args.extend(["-c", c]);
    }
    args.push(image);
    run("qemu-io", &args);
}

/// A server on a Unix socket; killed when dropped.
pub struct Served {
    pub uri: String,
    child: Child,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `qemu-nbd -r -A -B b0 -e 4` on `image`, its socket in `dir`.
pub fn qemu_nbd(dir: &Path, image: &Path) -> Served {
    let sock = dir.join("qemu.sock");
    let args = ["-r", "-A", "-B", "b0", "-t", "-e", "4", "-f", "qcow2", "-k"];
    let mut command = Command::new("qemu-nbd");
    command.args(args).arg(&sock).arg(image);
    serve(command, &sock)
}

/// `zcnbd serve -r` on `image`, or `None` (skipped) when the binary is not built.
pub fn zcnbd(dir: &Path, image: &Path) -> Option<Served> {
    let Some(bin) = zcnbd_bin() else {
        return skip("zcnbd", "the zcnbd binary is not built (cargo build first)");
    };
    let sock = dir.join("zcnbd.sock");
    let mut command = Command::new(bin);
    // -B b0: the image's persistent bitmap.
    command
        .args(["serve", "-r", "-B", "b0", "-s"])
        .arg(&sock)
        .arg(image);
    Some(serve(command, &sock))
}

fn serve(mut command: Command, sock: &Path) -> Served {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {command:?}: {e}"));
    let served = Served {
        uri: format!("nbd+unix:///?socket={}", sock.display()),
        child,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while zcnbd_client::Client::connect(&served.uri).is_err() {
        assert!(Instant::now() < deadline, "{command:?} never came up");
        std::thread::sleep(Duration::from_millis(20));
    }
    served
}

/// What `nbdinfo --map=CONTEXT` says of `uri`, merged (see [`merge`]).
pub fn nbdinfo_map(uri: &str, context: &str) -> Vec<Mapped> {
    let out = Command::new("nbdinfo")
        .arg(format!("--map={context}"))
        .arg(uri)
        .output()
        .expect("run nbdinfo");
    assert!(
        out.status.success(),
        "nbdinfo --map={context}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("nbdinfo prints UTF-8");
    // "offset length type description", one extent a line.
    let parsed = text.lines().map(|line| {
        let mut fields = line.split_whitespace().map(|f| f.parse::<u64>());
        let mut next = || fields.next().and_then(Result::ok);
        let (Some(offset), Some(length), Some(flags)) = (next(), next(), next()) else {
            panic!("nbdinfo line {line:?}");
        };
        (offset, length, u32::try_from(flags).expect("32-bit flags"))
    });
    merge(parsed)
}

/// Joins neighbouring extents with the same flags: servers and nbdinfo may cut a map in
/// different places without meaning anything different.
pub fn merge(extents: impl IntoIterator<Item = Mapped>) -> Vec<Mapped> {
    let mut merged: Vec<Mapped> = Vec::new();
    for (offset, length, flags) in extents {
        match merged.last_mut() {
            Some(last) if last.2 == flags && last.0 + last.1 == offset => last.1 += length,
            _ => merged.push((offset, length, flags)),
        }
    }
    merged
}
