"""Shared helpers for the interop suite: tools, export specs, server processes,
libnbd handles, data patterns.  Fixtures that use these live in conftest.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import nbd  # python3-libnbd, installed for Debian's /usr/bin/python3
except ImportError:  # pragma: no cover - reported by require_libnbd()
    nbd = None

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

REPO_ROOT = Path(__file__).resolve().parents[2]
IS_CI = os.environ.get("CI", "").lower() == "true"
BACKEND = os.environ.get("ZCNBD_TEST_SERVER", "zcnbd")
if BACKEND not in ("zcnbd", "nbdkit"):
    raise RuntimeError(f"ZCNBD_TEST_SERVER must be 'zcnbd' or 'nbdkit', not {BACKEND!r}")
ZCNBD_BIN = Path(os.environ.get("ZCNBD_BIN", REPO_ROOT / "target" / "release" / "zcnbd"))
# Extra `zcnbd serve` options for every server the suite starts, e.g. "--engine portable" or
# "--engine uring --data-path copy": scripts/test.sh runs the suite once per engine/data path.
ZCNBD_SERVE_ARGS = shlex.split(os.environ.get("ZCNBD_SERVE_ARGS", ""))


def serve_configuration() -> tuple[str, str]:
    """(engine, data path) of this run of the suite, with the server's defaults filled in."""
    args = ZCNBD_SERVE_ARGS
    value = lambda flag, default: args[args.index(flag) + 1] if flag in args else default
    engine = value("--engine", "auto")
    return ("uring" if engine == "auto" else engine), value("--data-path", "auto")


def scrape_metrics(port: int, host: str = "127.0.0.1") -> dict[str, int]:
    """A zcnbd server's counters from its --metrics endpoint, by name without the prefix."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    counters = {}
    for line in text.splitlines():
        if line.startswith("zcnbd_"):
            name, value = line.split()
            counters[name.removeprefix("zcnbd_").removesuffix("_total")] = int(value)
    return counters


def settled_metrics(port: int, replies: int, timeout: float = 10.0,
                    host: str = "127.0.0.1") -> dict[str, int]:
    """The counters once the server has counted `replies` replies as sent. A reply is counted
    when its send completes on the server's side, which may be a moment after the client has
    its bytes: a test that scrapes right after its last read would race that."""
    deadline = time.monotonic() + timeout
    while True:
        counters = scrape_metrics(port, host)
        if counters["requests"] >= replies:
            return counters
        assert time.monotonic() < deadline, counters
        time.sleep(0.02)


VERBOSE_SERVER = os.environ.get("ZCNBD_TEST_VERBOSE", "") not in ("", "0")

EXPORT_SIZE = 64 * MiB
PREFERRED_BLOCK = 4096
MAX_PAYLOAD = 64 * MiB  # zcnbd's default --payload-max (and nbdkit's limit)
READY_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0

# Advertised transmission flags, as libnbd reports them.
RW_CAPS = dict(
    is_read_only=False, can_flush=True, can_fua=True, can_trim=True, can_zero=True,
    can_fast_zero=True, can_df=True, can_cache=True, can_multi_conn=True,
)
RO_CAPS = dict(
    is_read_only=True, can_flush=True, can_fua=False, can_trim=False, can_zero=False,
    can_fast_zero=False, can_df=True, can_cache=True, can_multi_conn=True,
)


# --- missing tools: fail on CI, skip elsewhere ------------------------------
def missing(reason: str, hint: str = "run scripts/install-deps.sh"):
    """A prerequisite is absent: fail on CI (CI=true), skip otherwise."""
    if IS_CI:
        pytest.fail(f"{reason} (CI=true, so this is an error; {hint})")
    pytest.skip(reason)


def tool_env() -> dict:
    """Environment for client subprocesses.  Puts this interpreter's directory
    first on PATH, so that e.g. nbdsh (a `python3 -m nbd` wrapper) finds a
    python3 that has the libnbd module."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["LC_ALL"] = "C"
    return env


def require_tools(*names: str) -> None:
    env_path = tool_env()["PATH"]
    absent = [n for n in names if shutil.which(n, path=env_path) is None]
    if absent:
        missing(f"required tool(s) not installed: {', '.join(absent)}")


def require_libnbd() -> None:
    if nbd is None:
        missing(f"python libnbd bindings not importable by {sys.executable} (python3-libnbd)")


def run(argv: list, *, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a client tool; on failure, show its command line and output."""
    argv = [str(a) for a in argv]
    try:
        p = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout, env=tool_env(), **kw,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout}s: {shlex.join(argv)}\n{e.stdout}\n{e.stderr}")
    if check and p.returncode != 0:
        pytest.fail(
            f"exit code {p.returncode}: {shlex.join(argv)}\n"
            f"--- stdout ---\n{p.stdout}\n--- stderr ---\n{p.stderr}"
        )
    return p


# --- data --------------------------------------------------------------------
def pattern(length: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (fast; distinct for distinct seeds)."""
    return random.Random(seed).randbytes(length)


def write_sparse_file(path: Path, size: int, regions: dict[int, bytes] | None = None) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in (regions or {}).items():
            f.seek(offset)
            f.write(data)


def read_file_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def make_data_image(path: Path, seed: int = 0) -> dict[int, bytes]:
    """A sparse 64 MiB raw image with data in a few places."""
    regions = {
        0: pattern(64 * KiB, seed),
        3 * MiB + 7: pattern(1 * MiB + 3, seed + 1),
        40 * MiB: pattern(5 * MiB, seed + 2),
        EXPORT_SIZE - 4096: pattern(4096, seed + 3),
    }
    write_sparse_file(path, EXPORT_SIZE, regions)
    return regions


def files_equal(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(4 * MiB), fb.read(4 * MiB)
            if x != y:
                return False
            if not x:
                return True


def assert_export_matches_file(uri: str, path: Path) -> None:
    """Read the whole export and compare it with a local file."""
    size = path.stat().st_size
    with handle(uri) as h:
        assert h.get_size() == size
        with open(path, "rb") as f:
            for offset in range(0, size, 4 * MiB):
                n = min(4 * MiB, size - offset)
                assert_reads(h, offset, f.read(n))


def supports_o_direct(directory: Path) -> bool:
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


def size_arg(size: int) -> str:
    for suffix, unit in (("G", GiB), ("M", MiB), ("K", KiB)):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


# --- exports -----------------------------------------------------------------
# Backing files of file exports are seeded with this data, so that reads from
# read-only file exports have something non-trivial to check.
SEED_OFFSET = 1 * MiB
SEED_DATA_LEN = 256 * KiB


@dataclass(frozen=True)
class Export:
    """One export, described backend-independently."""

    kind: str  # "memory" | "file" | "null" | "rbd"
    size: int = EXPORT_SIZE
    name: str = ""
    description: str | None = None
    read_only: bool = False
    direct: bool = False
    min_block_size: int | None = None
    path: Path | None = None  # backing file for kind == "file"
    initial: tuple[tuple[int, bytes], ...] = ()  # (offset, data) in the backing file
    max_connections: int | None = None  # clients attached at once (zcnbd only)
    tls_only: bool = False  # only clients under TLS see and use it (zcnbd only)
    rbd: str | None = None  # POOL/IMAGE[@SNAP] for kind == "rbd" (zcnbd only)
    ceph_conf: Path | None = None  # the cluster's ceph.conf for kind == "rbd"
    max_payload: int | None = None  # largest read or write (default MAX_PAYLOAD)
    filters: tuple[str, ...] = ()  # layers, bottom first: NAME or NAME:KEY=VALUE,... (zcnbd only)

    @property
    def label(self) -> str:
        base = "direct" if self.direct else self.kind
        return base + ("-ro" if self.read_only else "")

    @property
    def writable(self) -> bool:
        return not self.read_only

    def initial_content(self, offset: int, length: int) -> bytes:
        """What the export holds in [offset, offset+length) before any write."""
        buf = bytearray(length)
        for off, data in self.initial:
            lo, hi = max(off, offset), min(off + len(data), offset + length)
            if lo < hi:
                buf[lo - offset : hi - offset] = data[lo - off : hi - off]
        return bytes(buf)

    def zcnbd_args(self) -> list[str]:
        if self.kind == "memory":
            args = ["--memory", size_arg(self.size)]
        elif self.kind == "null":
            args = ["--null", size_arg(self.size)]
        elif self.kind == "rbd":
            args = [f"rbd:{self.rbd}", "--ceph-conf", str(self.ceph_conf)]
        else:
            args = [str(self.path)] + (["--direct"] if self.direct else [])
        if self.read_only:
            args.append("-r")
        if self.name:
            args += ["-x", self.name]
        if self.description is not None:
            args += ["--description", self.description]
        if self.min_block_size is not None:
            args += ["--block-size-min", str(self.min_block_size)]
        if self.max_connections is not None:
            args += ["--shared", str(self.max_connections)]
        if self.max_payload is not None:
            args += ["--payload-max", str(self.max_payload)]
        for f in self.filters:
            args += ["--filter", f]
        return args

    def toml(self) -> str:
        lines = ["[[export]]", f"name = {toml_str(self.name)}"]
        if self.description is not None:
            lines.append(f"description = {toml_str(self.description)}")
        if self.kind == "file":
            lines.append(f"file = {toml_str(str(self.path))}")
            lines.append(f"direct = {str(self.direct).lower()}")
        elif self.kind == "rbd":
            lines.append(f"rbd = {toml_str(self.rbd)}")
            lines.append(f"ceph_conf = {toml_str(str(self.ceph_conf))}")
        else:
            lines.append(f"{self.kind} = {toml_str(size_arg(self.size))}")
        lines.append(f"read_only = {str(self.read_only).lower()}")
        if self.max_connections is not None:
            lines.append(f"connections_max = {self.max_connections}")
        if self.max_payload is not None:
            lines.append(f"payload_max = {toml_str(str(self.max_payload))}")
        if self.tls_only:
            lines.append("tls_only = true")
        if self.filters:
            lines.append("filters = [" + ", ".join(toml_str(f) for f in self.filters) + "]")
        return "\n".join(lines) + "\n"


def toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


# Export kinds the data tests are parametrized over.
WRITABLE_KINDS = ("memory", "file", "direct")
READONLY_KINDS = ("memory-ro", "file-ro", "direct-ro")
ALL_KINDS = WRITABLE_KINDS + READONLY_KINDS


def make_export(label: str, directory: Path, **overrides) -> Export:
    """Build an Export for a kind label such as "file-ro", creating and
    seeding its backing file in `directory` if it needs one."""
    base, _, ro = label.partition("-")
    read_only = ro == "ro"
    if base == "memory" or base == "null":
        return Export(kind=base, read_only=read_only, **overrides)
    if base not in ("file", "direct"):
        raise ValueError(label)
    size = overrides.pop("size", EXPORT_SIZE)
    path = overrides.pop("path", None) or directory / f"{label}.img"
    seed = ((SEED_OFFSET, pattern(SEED_DATA_LEN, seed=0x5EED)),)
    write_sparse_file(path, size, dict(seed))
    return Export(
        kind="file", direct=(base == "direct"), read_only=read_only,
        size=size, path=path, initial=seed, **overrides,
    )


# --- server processes ----------------------------------------------------------
def free_tcp_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if pytest dies (e.g. on the
    per-test time limit), so no server outlives the run."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _limit_file_size(limit: int):
    """A preexec function: as _die_with_parent, and file writes past `limit` bytes fail
    with EFBIG (RLIMIT_FSIZE; SIGXFSZ ignored, which survives exec), so tests can make
    the backend's writes fail where they choose."""
    import resource

    def preexec() -> None:
        _die_with_parent()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@dataclass
class Server:
    """A running NBD server process (zcnbd or nbdkit) listening on one
    Unix socket or TCP port."""

    argv: list[str]
    workdir: Path
    exports: list[Export]
    socket_path: Path | None = None
    host: str | None = None
    port: int | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    stopped: bool = False
    extra_cleanup: list = field(default_factory=list)
    file_size_limit: int | None = None

    @property
    def address(self):
        """For RawClient.connect / socket.connect: path or (host, port)."""
        return str(self.socket_path) if self.socket_path else (self.host, self.port)

    def uri(self, name: str | None = None) -> str:
        if name is None:
            name = self.exports[0].name
        if self.socket_path:
            return f"nbd+unix:///{name}?socket={self.socket_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"nbd://{host}:{self.port}/{name}"

    @property
    def export(self) -> Export:
        return self.exports[0]

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> "Server":
        self.log_path = self.workdir / "server.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=self.workdir,
            preexec_fn=(_die_with_parent if self.file_size_limit is None
                        else _limit_file_size(self.file_size_limit)),
        )
        log.close()
        self.wait_ready()
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, AttributeError):
            return ""

    def describe(self) -> str:
        return f"server: {shlex.join(self.argv)}\n--- server log ---\n{self.log()}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before accepting "
                            f"connections\n{self.describe()}")
            try:
                if self.socket_path:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(1)
                    s.connect(str(self.socket_path))
                else:
                    s = socket.create_connection((self.host, self.port), timeout=1)
                s.close()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"server did not accept connections within {READY_TIMEOUT}s\n"
                            f"{self.describe()}")
            time.sleep(0.02)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = STOP_TIMEOUT) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` and require a clean exit (status 0) within STOP_TIMEOUT."""
        if self.stopped:
            return
        self.stopped = True
        if self.proc.poll() is not None:
            pytest.fail(f"server died during the test (status {self.proc.returncode})\n"
                        f"{self.describe()}")
        self.proc.send_signal(sig)
        rc = self.wait_exit()
        if rc is None:
            self.kill()
            pytest.fail(f"server did not exit within {STOP_TIMEOUT}s of "
                        f"{signal.Signals(sig).name}; killed it\n{self.describe()}")
        if rc != 0:
            pytest.fail(f"server exited with status {rc} after {signal.Signals(sig).name} "
                        f"(expected 0)\n{self.describe()}")

    def kill(self) -> None:
        """SIGKILL, no checks (used for crash tests and cleanup)."""
        self.stopped = True
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cleanup(self) -> None:
        self.kill()
        for fn in self.extra_cleanup:
            fn()


def backend_argv(
    exports: list[Export], listen: list[str], workdir: Path, extra_args: list[str]
) -> list[str]:
    """The command line starting `exports` on the selected backend."""
    if BACKEND == "zcnbd":
        argv = [str(ZCNBD_BIN), "serve", *listen, *ZCNBD_SERVE_ARGS]
        if VERBOSE_SERVER:
            argv.append("-v")
        if len(exports) == 1:
            argv += exports[0].zcnbd_args()
        else:
            config = workdir / "exports.toml"
            config.write_text("\n".join(e.toml() for e in exports))
            argv += ["--config", str(config)]
        return argv + extra_args
    return nbdkit_argv(exports, listen, extra_args)


def nbdkit_argv(exports: list[Export], listen: list[str], extra_args: list[str]) -> list[str]:
    """Emulate zcnbd with nbdkit, as far as nbdkit can:

    * blocksize-policy advertises zcnbd's block sizes and enforces them
      (EINVAL for misaligned or oversized requests);
    * exportname restricts names to the configured exports and supplies
      descriptions;
    * several exports (zcnbd --config) all share the first export's plugin,
      so they differ only in name and description.
    """
    first = exports[0]
    argv = ["nbdkit", "--foreground", "--exit-with-parent", *listen]
    if first.read_only:
        argv.append("-r")
    if VERBOSE_SERVER:
        argv.append("-v")
    named = len(exports) > 1 or first.name or first.description is not None
    argv += ["--filter=blocksize-policy"]
    if named:
        argv += ["--filter=exportname"]
    if first.kind == "file":
        argv += ["file", str(first.path)] + (["cache=none"] if first.direct else [])
    else:
        argv += [first.kind, size_arg(first.size)]
    argv += [
        f"blocksize-minimum={first.min_block_size or 1}",
        f"blocksize-preferred={PREFERRED_BLOCK}",
        f"blocksize-maximum={first.max_payload or MAX_PAYLOAD}",
        "blocksize-error-policy=error",
    ]
    if named:
        argv += ["exportname-list=explicit", "exportname-strict=true"]
        argv += [f"exportname={e.name}" for e in exports]
        cases = "".join(
            f"{shlex.quote(e.name)}) printf %s {shlex.quote(e.description)};; "
            for e in exports if e.description is not None
        )
        if cases:
            argv.append(f'exportdesc=script:case "$name" in {cases}esac')
    return argv + extra_args


def start_server(
    exports: Export | list[Export],
    *,
    transport: str = "unix",
    host: str = "127.0.0.1",
    extra_args: list[str] = (),
    file_size_limit: int | None = None,
) -> Server:
    """Start a server (not registered for cleanup: prefer the fixture). With
    `file_size_limit`, the server's file writes at or past that offset fail (EFBIG)."""
    if isinstance(exports, Export):
        exports = [exports]
    if BACKEND == "zcnbd" and not ZCNBD_BIN.exists():
        missing(f"server binary {ZCNBD_BIN} does not exist",
                hint="build it with cargo build --release, or set ZCNBD_BIN")
    if BACKEND == "nbdkit":
        require_tools("nbdkit")
    # A short private directory: Unix socket paths are limited to 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="zcnbd-it-"))
    if transport == "unix":
        sock = workdir / "nbd.sock"
        listen = ["-s", str(sock)] if BACKEND == "zcnbd" else ["-U", str(sock)]
        server = Server([], workdir, exports, socket_path=sock)
    elif transport == "tcp":
        port = free_tcp_port(host)
        if BACKEND == "zcnbd":
            listen = ["-b", host, "-p", str(port)]
        else:
            listen = ["-i", host, "-p", str(port)]
        server = Server([], workdir, exports, host=host, port=port)
    else:
        raise ValueError(transport)
    server.argv = backend_argv(exports, listen, workdir, list(extra_args))
    server.file_size_limit = file_size_limit
    server.extra_cleanup.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    try:
        return server.start()
    except BaseException:
        server.cleanup()
        raise


# --- libnbd helpers ----------------------------------------------------------
def new_handle():
    """An unconnected libnbd handle (skips/fails if libnbd is missing)."""
    require_libnbd()
    return nbd.NBD()


def open_handle(
    uri: str,
    *,
    strict: bool = True,
    meta: bool = True,
    structured: bool = True,
    opt_mode: bool = False,
):
    """A connected libnbd handle (full info requested, base:allocation
    negotiated).  strict=False lets libnbd send requests its own checks would
    refuse (out of bounds, unknown flags, ...), so the server has to judge."""
    h = new_handle()
    h.set_full_info(True)
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    if not structured:
        h.set_request_structured_replies(False)
    if not strict:
        h.set_strict_mode(0)
    if opt_mode:
        h.set_opt_mode(True)
    h.connect_uri(uri)
    return h


@contextlib.contextmanager
def handle(uri: str, **kw):
    h = open_handle(uri, **kw)
    try:
        yield h
    finally:
        close_handle(h)


def close_handle(h) -> None:
    """Graceful NBD_CMD_DISC if still connected, then free the handle (and
    its socket) now rather than whenever the garbage collector runs.
    Calling it again is harmless."""
    if not hasattr(h, "_o"):  # already closed
        return
    with contextlib.suppress(nbd.Error):
        if h.aio_is_ready():
            h.shutdown()
    if hasattr(h, "close"):  # libnbd >= 1.16
        h.close()
    elif hasattr(h, "_o"):  # libnbd 1.14 has no NBD.close(); __del__ does this
        import libnbdmod

        o = h._o
        del h._o
        libnbdmod.close(o)


def wait_for_aio(h, timeout: float = 30.0) -> None:
    """Poll until no libnbd aio command is in flight (fail on a stall)."""
    deadline = time.monotonic() + timeout
    while h.aio_in_flight() > 0:
        if time.monotonic() > deadline:
            pytest.fail(f"{h.aio_in_flight()} requests still in flight after {timeout}s")
        h.poll(1000)


def expect_nbd_error(expected_errno: int, fn, *args, **kw) -> "nbd.Error":
    """Call fn and require it to fail with errno `expected_errno`."""
    try:
        fn(*args, **kw)
    except nbd.Error as e:
        assert e.errnum == expected_errno, (
            f"expected {errno.errorcode[expected_errno]}, got {e.errno} ({e.string})"
        )
        return e
    pytest.fail(f"expected {errno.errorcode[expected_errno]}, but the request succeeded")


def extents(h, offset: int, length: int, flags: int = 0) -> list[tuple[int, int, int]]:
    """base:allocation extents as (offset, length, state), covering at least
    [offset, offset+length), asking again where the server answered short."""
    out: list[tuple[int, int, int]] = []
    pos, end = offset, offset + length

    def cb(metacontext, off, entries, err):
        nonlocal pos
        assert metacontext == nbd.CONTEXT_BASE_ALLOCATION, metacontext
        assert off == pos, f"extents for offset {off}, asked for {pos}"
        for i in range(0, len(entries), 2):
            out.append((pos, entries[i], entries[i + 1]))
            pos += entries[i]
        return 0

    while pos < end:
        before = pos
        h.block_status(end - pos, pos, cb, flags)
        assert pos > before, "block status made no progress"
    return out


def states_in(h, offset: int, length: int) -> set[int]:
    """The set of base:allocation states found in [offset, offset+length)."""
    return {state for off, ln, state in extents(h, offset, length)
            if off < offset + length and off + ln > offset}


def assert_reads(h, offset: int, expected: bytes) -> None:
    got = h.pread(len(expected), offset)
    if got != expected:
        first = next(i for i in range(len(expected)) if got[i] != expected[i])
        pytest.fail(f"data mismatch reading {len(expected)} bytes at {offset}: first "
                    f"difference at +{first} (got {got[first]:#x}, expected {expected[first]:#x})")


def caps(h) -> dict:
    return {name: getattr(h, name)() for name in RW_CAPS}


def expected_caps(export: Export) -> dict:
    """The flags zcnbd advertises for `export` (as libnbd reports them)."""
    expected = dict(RO_CAPS if export.read_only else RW_CAPS)
    if BACKEND == "nbdkit" and export.kind == "file":
        # Known nbdkit difference: its file plugin has no fast zero.
        expected["can_fast_zero"] = False
    return expected
