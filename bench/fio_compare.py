#!/usr/bin/python3
"""fio_compare: several NBD servers side by side under fio, in one run.

Starts each target server on a free TCP port on 127.0.0.1, prefills every
export (sequential 1 MiB writes over --size, so reads see data, not holes),
then runs the fio matrix

    for each repeat:                          (target order rotates per repeat)
        loopback ceiling (iperf3, with and without -Z)
        for each rw, for each bs, for each numjobs:
            for each target: one fio run of --runtime seconds

so every cell is measured for all targets back to back.  The machine is
assumed to be noisy: only ratios between targets measured side by side
mean much, and they are what the tables lead with.

Per fio run it records IOPS, MiB/s, completion latency p50/p99 (fio's clat),
server CPU (utime+stime of the server process, all threads, from
/proc/PID/stat) and client CPU (fio and its job processes, from
getrusage(RUSAGE_CHILDREN)), both as CPU seconds per GiB moved.

Output: a table per rw pattern on stdout (medians over repeats, spread,
ratios to the FIRST target), optionally the same as Markdown with a machine
description (--markdown) and every raw measurement as JSON (--json).
Progress and errors go to stderr.

Targets are LABEL=SPEC (see --help).  Example:

    bench/fio_compare.py --quick
    bench/fio_compare.py zc=zcnbd:memory kit=nbdkit:memory qemu=qemu-nbd:file \\
        --markdown /tmp/bench.md --json /tmp/bench.json
    bench/fio_compare.py zc=zcnbd:memory:tls kit=nbdkit:memory:tls qemu=qemu-nbd:file:tls

A `tls` ARG starts the server requiring TLS with X.509 certificates made for the run
(certtool, in the scratch dir), and fio connects with nbds://: its URI cannot name local
files, so libnbd reads them from $HOME/.pki/libnbd, with HOME set to a scratch directory
for the fio processes of TLS targets.

Ceph RBD: zcnbd and qemu-nbd serve an existing image (zcnbd:rbd:POOL/IMAGE,
qemu-nbd:rbd:POOL/IMAGE) of the cluster $CEPH_CONF names, and fio-rbd:POOL/IMAGE
measures fio's own rbd engine, with no NBD in between (KEY=VALUE ARGs go to librbd
through CEPH_ARGS):

    tests/ceph/cluster.sh start /tmp/ceph && export CEPH_CONF=/tmp/ceph/ceph.conf
    rbd create rbd/bench --size 1G
    bench/fio_compare.py --rw randread,randwrite --bs 4k,1m --size 512M --no-ceiling \
        zcnbd=zcnbd:rbd:rbd/bench qemu-nbd=qemu-nbd:rbd:rbd/bench \
        fio-rbd-nocache=fio-rbd:rbd/bench:rbd_cache=false fio-rbd=fio-rbd:rbd/bench

This is a benchmark program, not a test: it never fails because a number is
bad, only when it cannot measure.  Python standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ZCNBD = REPO_ROOT / "target" / "release" / "zcnbd"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOOPBACK = "127.0.0.1"

DEFAULT_TARGETS = ["zcnbd=zcnbd:memory", "nbdkit=nbdkit:memory"]

# Matrix options: full defaults and the --quick preset.  Options given
# explicitly on the command line win over both.
FULL = dict(rw="randread,randwrite,read,write", bs="4k,8k,16k,32k,64k,128k,256k,512k,1m",
            numjobs="1,2", runtime=5, repeat=3, size="1G")
QUICK = dict(rw="randread,randwrite", bs="4k,64k,1m", numjobs="1", runtime=3, repeat=1,
             size="256M")

READY_TIMEOUT = 20.0  # seconds for a server to accept connections
STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL
FIO_GRACE = 120.0  # seconds a timed fio run may take beyond --runtime
LOG_TAIL = 4096  # bytes of a server log kept in reports
CEPH_ENV = ("CEPH_CONF", "CEPH_ARGS")  # what librados reads from the environment


# --- small helpers -----------------------------------------------------------
def log(msg: str) -> None:
    """Progress and diagnostics: stderr, so stdout is only the tables."""
    print(msg, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """'4k', '1m', '1G', '256M', '1MiB', '4096' -> bytes (binary units, like fio)."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def sig3(x: float | None) -> str:
    """Three significant digits, k/M suffixes for big numbers; '-' for None."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    ax = abs(x)
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if ax >= 10 * div or (suffix == "M" and ax >= div):
            x, ax = x / div, ax / div
            break
    else:
        suffix = ""
    if ax >= 100:
        return f"{x:.0f}{suffix}"
    if ax >= 10:
        return f"{x:.1f}{suffix}"
    if ax >= 1:
        return f"{x:.2f}{suffix}"
    return f"{x:.3f}{suffix}" if ax >= 0.001 or ax == 0 else f"{x:.1e}"


def command_output(argv: list[str]) -> str:
    """First line of a command's output, or '' if it cannot run."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (p.stdout or p.stderr).strip().splitlines()
    return lines[0].strip() if lines else ""


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on the loopback address (held until all are picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if this script dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def proc_cpu_seconds(pid: int) -> float | None:
    """utime+stime of a process, all its threads included (/proc/PID/stat 14, 15)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_cpu_seconds() -> float:
    """CPU seconds of all reaped descendants (fio and its job processes)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def errno_text(code: int) -> str:
    """fio's job 'error' field: an errno, though not always a sane one."""
    try:
        return f"{code} ({os.strerror(code)})"
    except (ValueError, OverflowError):
        return str(code)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def tail(path: Path | None, limit: int = LOG_TAIL) -> str:
    """The end of a server log, without terminal colour codes."""
    try:
        data = path.read_bytes()
    except (OSError, AttributeError):
        return ""
    return ANSI_ESCAPE.sub("", data[-limit:].decode(errors="replace"))


# --- targets ---------------------------------------------------------------
@dataclass
class Target:
    """One target under test: an NBD server started by us (argv) or external (nbd:// URI),
    or none at all (fio-rbd: fio's rbd engine is the client)."""

    label: str
    spec: str
    uri: str = ""
    tls: bool = False  # the server requires TLS; fio gets the run's HOME (.pki/libnbd)
    ceph: bool = False  # through librbd, on the cluster $CEPH_CONF names
    fio_engine: list[str] = field(default_factory=list)  # fio's --ioengine and its target
    fio_env: dict[str, str] = field(default_factory=dict)  # added to fio's environment
    argv: list[str] | None = None
    port: int | None = None
    socket: Path | None = None  # a Unix socket the server listens on instead of the port
    file: Path | None = None
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    dead: str | None = None  # why it stopped serving, once it has
    exit_code: int | None = None
    log_tail: str = ""  # end of the server's output, kept when it stops

    @property
    def external(self) -> bool:
        return self.argv is None

    def cpu_seconds(self) -> float | None:
        return proc_cpu_seconds(self.proc.pid) if self.proc else None

    def check_alive(self) -> bool:
        """False (and self.dead set) once our server process has exited."""
        if self.dead:
            return False
        if self.proc is not None and self.proc.poll() is not None:
            self.exit_code = self.proc.returncode
            self.dead = f"server exited with status {self.proc.returncode}"
            log(f"!! {self.label}: {self.dead}; log tail:\n{tail(self.log_path)}")
            return False
        return True

    def describe(self) -> str:
        """The server's command line (fio's engine options for fio-rbd), after the Ceph
        environment it runs with; the URI of an external server."""
        if self.external and not self.ceph:
            return self.uri
        env = {**os.environ, **self.fio_env} if self.ceph else {}
        return shlex.join([f"{k}={env[k]}" for k in CEPH_ENV if env.get(k)]
                          + (self.argv or ["fio", *self.fio_engine]))


def parse_target(text: str) -> tuple[str, str]:
    """'LABEL=SPEC' -> (label, spec); a bare SPEC gets a label from its first word."""
    head, sep, rest = text.partition("=")
    if sep and head and not any(c in head for c in ":/"):
        return head, rest
    label = text.split("://")[0] if "://" in text else text.split(":")[0]
    return label, text


def spec_parts(spec: str) -> tuple[str, str, list[str]]:
    """SERVER:BACKEND[:ARG,ARG...] -> (SERVER, BACKEND, ARGs); an RBD backend keeps its
    image: zcnbd:rbd:POOL/IMAGE:ARGS -> ('zcnbd', 'rbd:POOL/IMAGE', ARGs)."""
    parts = spec.split(":", 2)
    if len(parts) < 2:
        raise ValueError(f"bad target spec {spec!r}: expected SERVER:BACKEND[:ARGS]")
    server, backend, rest = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
    if backend == "rbd":
        image, _, rest = rest.partition(":")
        if "/" not in image:
            raise ValueError(f"bad target spec {spec!r}: expected {server}:rbd:POOL/IMAGE[:ARGS]")
        backend = f"rbd:{image}"
    return server, backend, split_list(rest)


def is_rbd(backend: str) -> bool:
    return backend.startswith("rbd:")


def spec_args(spec: str) -> tuple[list[str], bool]:
    """SPEC's extra ARGs without `tls` and `unix`, and whether `tls` was one of them."""
    extra = spec_parts(spec)[2]
    return [a for a in extra if a not in ("tls", "unix")], "tls" in extra


def spec_unix(spec: str) -> bool:
    """Whether SPEC's server listens on a Unix socket (the `unix` ARG)."""
    return "unix" in spec_parts(spec)[2]


def tls_flags(server: str, certs: Path) -> list[str]:
    """The flags that make SERVER require TLS with the certificates in `certs`."""
    if server == "qemu-nbd":
        # QEMU's server asks for a client certificate by default, and libnbd (1.14, as
        # root) offers none from $HOME/.pki/libnbd: no client certificates for anyone, as
        # for the other servers.
        return ["--object",
                f"tls-creds-x509,id=tls0,endpoint=server,dir={certs},verify-peer=off",
                "--tls-creds", "tls0"]
    return ["--tls=require", f"--tls-certificates={certs}"]


def server_argv(spec: str, port: int, size: str, file: Path | None, zcnbd: Path,
                max_clients: int, tls_certs: Path | None = None,
                unix_socket: Path | None = None) -> list[str]:
    """The command line that serves SPEC on LOOPBACK:port.

    SPEC is SERVER:BACKEND[:ARG,ARG...]; extra ARGs are passed through
    (nbdkit: ARGs starting with '-' go before the plugin name, KEY=VALUE
    plugin parameters after it), except `tls`: require TLS with the server
    certificates in tls_certs, and `unix`: listen on unix_socket instead of the
    port.  An rbd:POOL/IMAGE backend is the image as it
    is (its size, not SIZE), on the cluster the environment names (CEPH_CONF).
    """
    server, backend, _ = spec_parts(spec)
    extra, tls = spec_args(spec)
    if tls:
        if tls_certs is None:
            raise ValueError(f"{spec!r}: TLS needs certificates")
        extra = tls_flags(server.split("@")[0], tls_certs) + extra
    listen = ["-b", LOOPBACK, "-p", str(port)]
    if unix_socket is not None:
        flag = {"nbdkit": "-U", "qemu-nbd": "-k"}.get(server, "-s")
        listen = [flag, str(unix_socket)]
    if server.startswith("zcnbd@"):
        # Another build of zcnbd (before/after tables): zcnbd@PATH:BACKEND[:ARGS].
        server, zcnbd = "zcnbd", Path(server.removeprefix("zcnbd@")).resolve()
        if not zcnbd.is_file():
            raise ValueError(f"{spec!r}: no zcnbd binary at {zcnbd}")
    if server == "zcnbd":
        base = [str(zcnbd), "serve", *listen]
        if backend in ("memory", "null"):
            return [*base, f"--{backend}", size, *extra]
        if backend == "file":
            return [*base, *extra, str(file)]
        if is_rbd(backend):
            return [*base, *extra, backend]
    elif server == "nbdkit":
        flags = [a for a in extra if a.startswith("-")]
        params = [a for a in extra if not a.startswith("-")]
        where = listen if unix_socket is not None else ["-i", LOOPBACK, "-p", str(port)]
        base = ["nbdkit", "-f", "--exit-with-parent", *where, *flags]
        if backend == "memory":
            return [*base, "memory", size, *params]
        if backend == "file":
            return [*base, "file", str(file), *params]
    elif server == "qemu-nbd":
        # --cache=writeback is qemu-nbd's default; on rbd: it turns librbd's cache on.
        base = ["qemu-nbd", "-f", "raw", "-x", "", *listen, "--persistent",
                f"--shared={max_clients}", "--cache=writeback"]
        if backend == "file":
            return [*base, "--aio=threads", *extra, str(file)]
        if is_rbd(backend):  # QEMU's rbd driver: rbd:POOL/IMAGE
            return [*base, *extra, backend]
    raise ValueError(f"unsupported target spec {spec!r} (see --help for the supported ones)")


def prepare_target(label: str, spec: str, port: int, args, scratch: Path,
                   tls: TlsCreds | None = None) -> Target:
    """Build the Target (and its backing file) for LABEL=SPEC; does not start it."""
    t = Target(label=label, spec=spec)
    if spec.startswith(("nbd://", "nbds://", "nbd+unix://", "nbds+unix://")):
        t.uri = spec
        t.fio_engine = nbd_engine(t.uri)
        return t
    if spec.startswith("fio-rbd:"):
        t.ceph = True
        t.fio_engine, t.fio_env = fio_rbd_client(spec)
        return t
    t.port = port
    t.tls = spec_args(spec)[1]
    t.uri = f"{'nbds' if t.tls else 'nbd'}://{LOOPBACK}:{port}/"
    if spec_unix(spec):
        t.socket = scratch / f"{label}.sock"
        t.uri = f"{'nbds' if t.tls else 'nbd'}+unix:///?socket={t.socket}"
    t.fio_engine = nbd_engine(t.uri)
    if t.tls and tls:
        t.fio_env = {"HOME": str(tls.home)}
    backend = spec_parts(spec)[1]
    t.ceph = is_rbd(backend)
    if backend == "file":
        t.file = scratch / f"{label}.img"
        with open(t.file, "wb") as f:
            f.truncate(parse_size(args.size))
        if "--direct" in spec and not supports_o_direct(t.file):
            raise SystemExit(f"{scratch} does not support O_DIRECT (needed by {spec}); "
                             "use --scratch on another file system")
    t.argv = server_argv(spec, port, args.size, t.file, args.zcnbd,
                         max_clients=max(16, 4 * max(int(n) for n in args.numjobs)),
                         tls_certs=tls.server if tls and t.tls else None,
                         unix_socket=t.socket)
    t.log_path = scratch / f"{label}.log"
    return t


def nbd_engine(uri: str) -> list[str]:
    return ["--ioengine=nbd", f"--uri={uri}"]


def fio_rbd_client(spec: str) -> tuple[list[str], dict[str, str]]:
    """fio-rbd:POOL/IMAGE[:KEY=VALUE,...] -> fio's rbd engine options, and the environment
    that hands the KEY=VALUEs to librbd (CEPH_ARGS, after any the environment has)."""
    _, image, conf = spec_parts(spec)
    pool, _, name = image.partition("/")
    if not (pool and name) or "/" in name or not all("=" in kv for kv in conf):
        raise ValueError(f"bad target spec {spec!r}: expected fio-rbd:POOL/IMAGE[:KEY=VALUE,...]")
    engine = ["--ioengine=rbd", "--clientname=admin", f"--pool={pool}", f"--rbdname={name}"]
    if not conf:
        return engine, {}
    ceph_args = [os.environ.get("CEPH_ARGS", ""), *(f"--{kv}" for kv in conf)]
    return engine, {"CEPH_ARGS": " ".join(a for a in ceph_args if a)}


@dataclass(frozen=True)
class TlsCreds:
    server: Path  # ca-cert.pem, server-cert.pem, server-key.pem
    home: Path  # HOME for fio: .pki/libnbd/{ca-cert,client-cert,client-key}.pem


def make_tls_creds(scratch: Path) -> TlsCreds:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, made
    with certtool (gnutls-bin), in the layout nbdkit, QEMU and libnbd read."""
    if not shutil.which("certtool"):
        raise SystemExit("TLS targets need certtool (gnutls-bin; scripts/install-deps.sh)")
    root = scratch / "tls"
    server, home = root / "server", root / "home"
    client = home / ".pki" / "libnbd"
    for d in (server, client):
        d.mkdir(parents=True)

    def certtool(*argv) -> None:
        subprocess.run(["certtool", *map(str, argv)], check=True, capture_output=True)

    def key(path: Path) -> Path:
        certtool("--generate-privkey", "--outfile", path)
        path.chmod(0o600)
        return path

    def template(name: str, lines: list[str]) -> Path:
        path = root / f"{name}.info"
        path.write_text("\n".join(lines + ["expiration_days = 7"]) + "\n")
        return path

    ca_key, ca_cert = key(root / "ca-key.pem"), server / "ca-cert.pem"
    certtool("--generate-self-signed", "--load-privkey", ca_key, "--template",
             template("ca", ['cn = "fio_compare CA"', "ca", "cert_signing_key"]),
             "--outfile", ca_cert)
    shutil.copy(ca_cert, client / "ca-cert.pem")
    for d, stem, lines in (
            (server, "server", ['cn = "localhost"', 'dns_name = "localhost"',
                                'ip_address = "127.0.0.1"', "tls_www_server"]),
            (client, "client", ['cn = "fio_compare client"', "tls_www_client"])):
        certtool("--generate-certificate", "--load-ca-certificate", ca_cert,
                 "--load-ca-privkey", ca_key, "--load-privkey", key(d / f"{stem}-key.pem"),
                 "--template", template(stem, lines + ["signing_key", "encryption_key"]),
                 "--outfile", d / f"{stem}-cert.pem")
    return TlsCreds(server=server, home=home)


def supports_o_direct(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def start_server(t: Target, scratch: Path) -> None:
    if not shutil.which(t.argv[0]):
        raise SystemExit(f"{t.label}: {t.argv[0]} not found"
                         + (" (build it: cargo build --release)" if "zcnbd" in t.argv[0] else ""))
    logf = open(t.log_path, "wb")
    # Own session: Ctrl-C reaches this script, which then stops the servers
    # in order; PR_SET_PDEATHSIG covers this script being killed outright.
    t.proc = subprocess.Popen(t.argv, stdin=subprocess.DEVNULL, stdout=logf,
                              stderr=subprocess.STDOUT, cwd=scratch,
                              env={**os.environ, "NO_COLOR": "1"},
                              start_new_session=True, preexec_fn=_die_with_parent)
    logf.close()


NBD_IHAVEOPT = b"IHAVEOPT"
NBD_OPT_ABORT = 2
NBD_FLAG_C_FIXED_NEWSTYLE = 1


def nbd_probe(host: str, port: int, unix: Path | None = None) -> bool:
    """Connect (to host:port, or the Unix socket), read the newstyle greeting, and leave
    politely (NBD_OPT_ABORT), so that servers do not log a failed handshake for the probe."""
    if unix is not None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(2)
        try:
            conn.connect(str(unix))
        except OSError:
            conn.close()
            raise
    else:
        conn = socket.create_connection((host, port), timeout=2)
    with conn as s:
        greeting = b""
        while len(greeting) < 18:
            chunk = s.recv(18 - len(greeting))
            if not chunk:
                break
            greeting += chunk
        if not greeting.startswith(b"NBDMAGIC"):
            return False
        if greeting[8:16] == NBD_IHAVEOPT:
            s.sendall(struct.pack(">I", NBD_FLAG_C_FIXED_NEWSTYLE) + NBD_IHAVEOPT
                      + struct.pack(">II", NBD_OPT_ABORT, 0))
            try:
                s.recv(64)  # the server's ACK (optional per the spec)
            except OSError:
                pass
        return True


def wait_ready(t: Target, timeout: float = READY_TIMEOUT) -> None:
    """Until the server sends the NBD greeting ('NBDMAGIC') on its port."""
    if not t.uri:
        return  # fio-rbd: no NBD server
    host, port = (LOOPBACK, t.port) if t.port else uri_host_port(t.uri)
    if host is None and t.socket is None:
        return  # an external Unix socket URI: fio will tell
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if t.proc is not None and t.proc.poll() is not None:
            raise SystemExit(f"{t.label}: server exited with status {t.proc.returncode} "
                             f"at startup:\n$ {t.describe()}\n{tail(t.log_path)}")
        try:
            if nbd_probe(host, port, t.socket):
                return
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise SystemExit(f"{t.label}: no NBD greeting on {host}:{port} after {timeout:.0f} s "
                     f"({last})\n{tail(t.log_path) if t.log_path else ''}")


def uri_host_port(uri: str) -> tuple[str | None, int]:
    if not uri.startswith("nbd://"):
        return None, 0
    hostport = uri[len("nbd://"):].split("/")[0]
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        return host, int(rest.lstrip(":") or 10809)
    host, _, port = hostport.partition(":")
    return host or "localhost", int(port or 10809)


def stop_server(t: Target) -> None:
    """SIGTERM, wait, SIGKILL; record how it ended."""
    p = t.proc
    if p is None:
        return
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log(f"!! {t.label}: still running {STOP_TIMEOUT:.0f} s after SIGTERM; SIGKILL")
            p.kill()
            p.wait()
    if t.exit_code is None:
        t.exit_code = p.returncode
    t.log_tail = tail(t.log_path)


# --- fio -------------------------------------------------------------------
PERCENTILES = ("1.000000", "10.000000", "50.000000", "90.000000", "99.000000",
               "99.900000", "99.990000")


def fio_argv(engine: list[str], name: str, rw: str, bs: str, iodepth: int, numjobs: int,
             size: str, runtime: float | None, extra: list[str]) -> list[str]:
    argv = ["fio", f"--name={name}", *engine, f"--rw={rw}",
            f"--bs={bs}", f"--iodepth={iodepth}", f"--numjobs={numjobs}", f"--size={size}",
            "--group_reporting=1", "--norandommap=1", "--randrepeat=0",
            "--output-format=json"]
    if runtime is not None:
        argv += ["--time_based=1", f"--runtime={runtime:g}"]
    return argv + extra


def parse_fio_json(stdout: str) -> dict:
    """fio's JSON report; fio prints 'fio: connected to NBD server' lines first."""
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON in fio's output")
    obj, _ = json.JSONDecoder().raw_decode(stdout[start:])
    return obj


def direction_stats(d: dict) -> dict:
    clat = d.get("clat_ns", {})
    pct = clat.get("percentile", {})
    return {
        "iops": d["iops"], "bw_bytes": d["bw_bytes"], "io_bytes": d["io_bytes"],
        "total_ios": d.get("total_ios"), "runtime_ms": d.get("runtime"),
        "clat_mean_us": clat.get("mean", 0) / 1e3,
        "clat_pct_us": {k.rstrip("0").rstrip("."): pct[k] / 1e3 for k in PERCENTILES if k in pct},
        "lat_mean_us": d.get("lat_ns", {}).get("mean", 0) / 1e3,
    }


def summarize_fio(report: dict) -> dict:
    """Totals over read+write (group_reporting gives one job entry); latency of
    the direction that did most I/O."""
    job = report["jobs"][0]
    dirs = {k: direction_stats(job[k]) for k in ("read", "write") if job[k]["io_bytes"] > 0}
    total_bytes = sum(d["io_bytes"] for d in dirs.values())
    main = max(dirs.values(), key=lambda d: d["io_bytes"]) if dirs else None
    return {
        "fio_error": job.get("error", 0),
        "iops": sum(d["iops"] for d in dirs.values()),
        "mib_s": sum(d["bw_bytes"] for d in dirs.values()) / MiB,
        "bytes": total_bytes,
        "p50_us": main["clat_pct_us"].get("50") if main else None,
        "p99_us": main["clat_pct_us"].get("99") if main else None,
        "fio_usr_pct": job.get("usr_cpu"), "fio_sys_pct": job.get("sys_cpu"),
        "directions": dirs,
    }


def run_fio(t: Target, argv: list[str], cwd: Path, timeout: float) -> dict:
    """One fio run against t with CPU accounting; a dict for the JSON report.
    fio's environment gets t.fio_env: a TLS target's HOME = the run's TLS home (libnbd
    reads .pki/libnbd there), a fio-rbd target's CEPH_ARGS."""
    rec = {"target": t.label, "fio_argv": argv, "loadavg_before": loadavg(),
           "started": datetime.datetime.now().isoformat(timespec="seconds")}
    srv0, cli0, wall0 = t.cpu_seconds(), children_cpu_seconds(), time.monotonic()
    try:
        env = {**os.environ, **t.fio_env} if t.fio_env else None
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                           stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired as e:
        rec.update(ok=False, error=f"fio timed out after {timeout:.0f} s",
                   stderr=(e.stderr or "")[-2000:] if isinstance(e.stderr, str) else "")
        return rec
    srv1, cli1 = t.cpu_seconds(), children_cpu_seconds()
    rec["wall_s"] = time.monotonic() - wall0
    rec["fio_rc"] = p.returncode
    try:
        rec.update(summarize_fio(parse_fio_json(p.stdout)))
    except (ValueError, KeyError, IndexError) as e:
        rec.update(ok=False, error=f"fio exit {p.returncode}, unreadable report ({e})",
                   stderr=p.stderr[-2000:], stdout=p.stdout[-2000:])
        return rec
    gib = rec["bytes"] / GiB
    rec["client_cpu_s"] = cli1 - cli0
    rec["client_cpu_s_per_gib"] = (cli1 - cli0) / gib if gib else None
    if srv0 is not None and srv1 is not None:
        rec["server_cpu_s"] = srv1 - srv0
        rec["server_cpu_s_per_gib"] = (srv1 - srv0) / gib if gib else None
    else:
        rec["server_cpu_s"] = rec["server_cpu_s_per_gib"] = None
    problems = []
    if p.returncode != 0:
        problems.append(f"fio exit status {p.returncode}")
    if rec["fio_error"]:
        problems.append(f"fio job error {errno_text(rec['fio_error'])}")
    if not rec["bytes"]:
        problems.append("no I/O done")
    rec["ok"] = not problems
    if problems:
        rec["error"] = "; ".join(problems)
        rec["stderr"] = p.stderr[-2000:]
    return rec


# --- loopback ceiling ------------------------------------------------------
def port_listening(port: int) -> bool:
    """Is something listening on TCP port (IPv4 or IPv6)?  Read from /proc so
    that checking does not use up iperf3 -1's single test."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def iperf3_ceiling(seconds: float, streams: int, zerocopy: bool) -> dict:
    """One iperf3 run over 127.0.0.1; Gbit/s as the receiver saw it."""
    port = free_ports(1)[0]
    rec = {"streams": streams, "zerocopy": zerocopy, "seconds": seconds}
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-B", LOOPBACK, "-p", str(port)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True,
                           preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 10
        while not port_listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        argv = ["iperf3", "-c", LOOPBACK, "-p", str(port), "-t", f"{seconds:g}", "-J",
                "-P", str(streams)] + (["-Z"] if zerocopy else [])
        p = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                           stdin=subprocess.DEVNULL)
        out = json.loads(p.stdout)
        if "error" in out:
            raise ValueError(out["error"])
        bps = out["end"]["sum_received"]["bits_per_second"]
        rec.update(ok=True, gbit_s=bps / 1e9, mib_s=bps / 8 / MiB,
                   cpu=out["end"].get("cpu_utilization_percent"))
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        rec.update(ok=False, error=str(e))
    finally:
        if srv.poll() is None:
            srv.terminate()
        try:
            srv.wait(5)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    return rec


# --- the run ---------------------------------------------------------------
@dataclass
class Cell:
    rw: str
    bs: str
    numjobs: int

    @property
    def key(self) -> tuple:
        return (self.rw, self.bs, self.numjobs)


@dataclass
class Run:
    """Everything measured; what the reports are made from."""

    args: argparse.Namespace
    targets: list[Target]
    cells: list[Cell]
    machine: dict
    measurements: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    ceiling: list[dict] = field(default_factory=list)
    interrupted: bool = False
    started: str = ""
    finished: str = ""


def machine_info(args, targets: list[Target]) -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, IndexError, ValueError):
        pass
    tools = {"fio": ["fio", "--version"]}
    if args.ceiling:
        tools["iperf3"] = ["iperf3", "--version"]
    for t in targets:
        if t.argv:
            name = "zcnbd" if t.spec.startswith("zcnbd") else t.argv[0]
            tools[name] = [t.argv[0], "--version"]
    if any(t.ceph for t in targets):
        tools["ceph"] = ["rbd", "--version"]
    git = command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"])
    if git and command_output(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                               "--untracked-files=no"]):
        git += " (modified)"
    return {
        "nproc": len(os.sched_getaffinity(0)), "cpu": cpu, "kernel": platform.release(),
        "memory": mem, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "loadavg_start": loadavg(), "git": git,
        "tools": {k: command_output(v) for k, v in tools.items()},
        "command": shlex.join([sys.argv[0], *sys.argv[1:]]),
    }


def prefill(run: Run, scratch: Path) -> None:
    """Sequential 1 MiB writes over the whole export: reads then see data."""
    a = run.args
    for t in run.targets:
        argv = fio_argv(t.fio_engine, "prefill", "write", "1m", a.iodepth, 1, a.size, None,
                        a.fio_arg)
        log(f"prefill {t.label}: {a.size} sequential 1m writes")
        rec = run_fio(t, argv, scratch, timeout=3600)
        rec["phase"] = "prefill"
        run.prefill.append(rec)
        if not rec["ok"]:
            log(f"!! {t.label}: prefill failed: {rec['error']}\n{rec.get('stderr', '')}")
            t.check_alive()
        else:
            log(f"   {sig3(rec['mib_s'])} MiB/s")


def measure_ceiling(run: Run, repeat: int) -> None:
    for nj in sorted(set(c.numjobs for c in run.cells)):
        for zc in (False, True):
            rec = iperf3_ceiling(run.args.runtime, nj, zc)
            rec["repeat"] = repeat
            run.ceiling.append(rec)
            what = f"iperf3 -P {nj}{' -Z' if zc else ''}"
            if rec["ok"]:
                log(f"ceiling {what}: {rec['gbit_s']:.1f} Gbit/s = {sig3(rec['mib_s'])} MiB/s")
            else:
                log(f"!! ceiling {what} failed: {rec['error']}")


def measure(run: Run, scratch: Path) -> None:
    """The interleaved matrix: repeat > cell > target (rotated per repeat)."""
    a = run.args
    n = len(run.targets)
    total = a.repeat * len(run.cells) * n
    done = 0
    t0 = time.monotonic()
    for r in range(a.repeat):
        if a.ceiling:
            measure_ceiling(run, r)
        order = run.targets[r % n:] + run.targets[:r % n]
        for cell in run.cells:
            for slot, t in enumerate(order):
                done += 1
                base = {"repeat": r, "slot": slot, "rw": cell.rw, "bs": cell.bs,
                        "numjobs": cell.numjobs, "iodepth": a.iodepth, "target": t.label}
                if not t.check_alive():
                    run.measurements.append({**base, "ok": False, "error": f"skipped: {t.dead}"})
                    continue
                argv = fio_argv(t.fio_engine, f"{cell.rw}-{cell.bs}-j{cell.numjobs}", cell.rw,
                                cell.bs, a.iodepth, cell.numjobs, a.size, a.runtime, a.fio_arg)
                rec = {**base, **run_fio(t, argv, scratch, timeout=a.runtime + FIO_GRACE)}
                run.measurements.append(rec)
                log(progress_line(done, total, t0, rec))
                if not rec["ok"]:
                    alive = t.check_alive()
                    log(f"!! {t.label} {cell.rw} bs={cell.bs} jobs={cell.numjobs}: "
                        f"{rec['error']}{'' if alive else ' (server died)'}\n"
                        f"{rec.get('stderr', '').strip()}")


def progress_line(done: int, total: int, t0: float, rec: dict) -> str:
    elapsed = time.monotonic() - t0
    eta = elapsed / done * (total - done)
    head = (f"[{done}/{total} eta {eta / 60:.0f}m] r{rec['repeat']} {rec['rw']} "
            f"bs={rec['bs']} j={rec['numjobs']} {rec['target']}:")
    if not rec["ok"]:
        return f"{head} ERROR {rec['error']}"
    return (f"{head} {sig3(rec['iops'])} IOPS {sig3(rec['mib_s'])} MiB/s "
            f"p99 {sig3(rec['p99_us'])} us srv {sig3(rec['server_cpu_s_per_gib'])} "
            f"cli {sig3(rec['client_cpu_s_per_gib'])} CPU s/GiB")


# --- statistics ------------------------------------------------------------
def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread_pct(xs: list) -> float | None:
    """(max - min) / median in %: how far apart the repeats were."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m * 100 if m else None


def paired_ratios(mine: dict, base: dict, metric: str) -> list[float]:
    """Per repeat: my metric / the first target's, when both were measured."""
    out = []
    for r, rec in mine.items():
        b = base.get(r)
        if b and rec.get(metric) is not None and b.get(metric):
            out.append(rec[metric] / b[metric])
    return out


def summarize(run: Run) -> dict:
    """(cell key, label) -> medians, spread and ratios to the first target.

    Ratios are the median of per-repeat paired ratios (the two numbers of a
    pair were measured seconds apart, so slow drift in machine load cancels)."""
    by = {}
    for m in run.measurements:
        if m.get("ok"):
            by.setdefault(((m["rw"], m["bs"], m["numjobs"]), m["target"]), {})[m["repeat"]] = m
    first = run.targets[0].label
    out = {}
    for cell in run.cells:
        base = by.get((cell.key, first), {})
        for t in run.targets:
            recs = by.get((cell.key, t.label), {})
            attempted = sum(1 for m in run.measurements if m["target"] == t.label
                            and (m["rw"], m["bs"], m["numjobs"]) == cell.key)
            col = lambda k: [rec.get(k) for rec in recs.values()]  # noqa: E731
            s = {"n": len(recs), "attempted": attempted}
            for k in ("iops", "mib_s", "p50_us", "p99_us", "server_cpu_s_per_gib",
                      "client_cpu_s_per_gib"):
                s[k] = median(col(k))
            s["mib_s_min"] = min(col("mib_s"), default=None)
            s["mib_s_max"] = max(col("mib_s"), default=None)
            s["spread_pct"] = spread_pct(col("mib_s"))
            s["ratio_mib_s"] = median(paired_ratios(recs, base, "mib_s"))
            s["ratio_cpu"] = median(paired_ratios(recs, base, "server_cpu_s_per_gib"))
            out[(cell.key, t.label)] = s
    return out


def ceiling_summary(run: Run) -> dict:
    """(streams, zerocopy) -> median Gbit/s and MiB/s over repeats."""
    groups = {}
    for c in run.ceiling:
        if c["ok"]:
            groups.setdefault((c["streams"], c["zerocopy"]), []).append(c)
    return {k: {"gbit_s": median([c["gbit_s"] for c in v]),
                "mib_s": median([c["mib_s"] for c in v]), "n": len(v)}
            for k, v in sorted(groups.items())}


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


# --- tables ----------------------------------------------------------------
@dataclass
class Table:
    title: str
    groups: list[str]  # one per column ('' = no group)
    headers: list[str]
    rows: list[list[str]]


def render_text(t: Table) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in t.rows]) for i, h in enumerate(t.headers)]
    # Columns of one group are joined by ' ', groups by ' | '.
    def join(cells: list[str]) -> str:
        out = ""
        for i, c in enumerate(cells):
            if i:
                out += " | " if t.groups[i] != t.groups[i - 1] else " "
            out += c
        return out.rstrip()

    spans = []  # (group, first col, last col)
    for i, g in enumerate(t.groups):
        if spans and spans[-1][0] == g:
            spans[-1][2] = i
        else:
            spans.append([g, i, i])
    group_cells = []
    for g, a, b in spans:
        w = sum(widths[a:b + 1]) + (b - a)
        group_cells.append(g.center(w))
    group_line = " | ".join(group_cells).rstrip()
    header = join([h.rjust(w) for h, w in zip(t.headers, widths)])
    lines = [t.title] + ([group_line] if any(t.groups) else []) + [header, "-" * len(header)]
    lines += [join([c.rjust(w) for c, w in zip(r, widths)]) for r in t.rows]
    return "\n".join(lines)


def render_markdown(t: Table) -> str:
    heads = [f"{g} {h}".strip() if g and g not in ("", " ") else h
             for g, h in zip(t.groups, t.headers)]
    lines = [f"### {t.title}", "", "| " + " | ".join(heads) + " |",
             "|" + "|".join("---:" for _ in heads) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in t.rows]
    return "\n".join(lines)


def cell_tables(run: Run, summary: dict) -> list[Table]:
    """One table per rw pattern: a row per bs x numjobs, columns per target."""
    a = run.args
    first = run.targets[0].label
    tables = []
    for rw in a.rw:
        groups, headers = ["", ""], ["bs", "jobs"]
        for t in run.targets:
            cols = ["IOPS", "MiB/s", "±%", "p50us", "p99us", "srvCPU", "cliCPU"]
            if t.label != first:
                cols += ["xMiB/s", "xCPU"]
            groups += [t.label] * len(cols)
            headers += cols
        rows = []
        for cell in (c for c in run.cells if c.rw == rw):
            row = [cell.bs, str(cell.numjobs)]
            for t in run.targets:
                s = summary[(cell.key, t.label)]
                if not s["n"]:
                    vals = ["ERR" if s["attempted"] else "-"] + ["-"] * 6
                else:
                    mark = "" if s["n"] == s["attempted"] else "*"
                    vals = [sig3(s["iops"]), sig3(s["mib_s"]) + mark,
                            "-" if s["spread_pct"] is None else f"{s['spread_pct']:.0f}",
                            sig3(s["p50_us"]), sig3(s["p99_us"]),
                            sig3(s["server_cpu_s_per_gib"]), sig3(s["client_cpu_s_per_gib"])]
                if t.label != first:
                    vals += [ratio(s["ratio_mib_s"]), ratio(s["ratio_cpu"])]
                row += vals
            rows.append(row)
        reps = f"median of {a.repeat} repeats" if a.repeat > 1 else "1 repeat"
        title = f"{rw}: iodepth {a.iodepth}, {a.runtime:g} s per cell, {reps}, size {a.size}"
        tables.append(Table(title, groups, headers, rows))
    return tables


def ratio(x: float | None) -> str:
    return sig3(x)


def ceiling_tables(run: Run, summary: dict) -> list[Table]:
    """The loopback ceiling, and the largest-block results as % of it."""
    ceil = ceiling_summary(run)
    if not ceil:
        return []
    t1 = Table("Loopback ceiling (iperf3 over 127.0.0.1, one stream per fio job)",
               ["", "", "", ""], ["streams", "sendfile (-Z)", "Gbit/s", "MiB/s"],
               [[str(s), "yes" if zc else "no", f"{v['gbit_s']:.1f}", sig3(v["mib_s"])]
                for (s, zc), v in ceil.items()])
    big = max(run.args.bs, key=parse_size)
    groups, headers = ["", ""], ["rw", "jobs"]
    for t in run.targets:
        groups += [t.label] * 3
        headers += ["MiB/s", "%ceil", "%ceil-Z"]
    rows = []
    for cell in (c for c in run.cells if c.bs == big):
        row = [cell.rw, str(cell.numjobs)]
        plain = ceil.get((cell.numjobs, False), {}).get("mib_s")
        zc = ceil.get((cell.numjobs, True), {}).get("mib_s")
        for t in run.targets:
            m = summary[(cell.key, t.label)]["mib_s"]
            row += [sig3(m), pct(m, plain), pct(m, zc)]
        rows.append(row)
    t2 = Table(f"bs={big} results as % of the loopback ceiling", groups, headers, rows)
    return [t1, t2]


def pct(x: float | None, of: float | None) -> str:
    return "-" if x is None or not of else f"{x / of * 100:.0f}%"


def overall_lines(run: Run, summary: dict) -> list[str]:
    """Geometric means of the paired ratios over all cells, per target."""
    first = run.targets[0].label
    lines = []
    for t in run.targets[1:]:
        rs = [summary[(c.key, t.label)] for c in run.cells]
        g_bw = geomean([s["ratio_mib_s"] for s in rs])
        g_cpu = geomean([s["ratio_cpu"] for s in rs])
        n = sum(1 for s in rs if s["ratio_mib_s"])
        if not n:
            continue
        cpu = f", server CPU per GiB x{ratio(g_cpu)}" if g_cpu else ""
        lines.append(f"{t.label} / {first}: MiB/s x{ratio(g_bw)}{cpu} "
                     f"(geometric mean of the per-cell ratios, {n} cells)")
    return lines


def failure_lines(run: Run) -> list[str]:
    lines = []
    for m in run.prefill + run.measurements:
        if not m.get("ok"):
            where = ("prefill" if m.get("phase") == "prefill"
                     else f"r{m['repeat']} {m['rw']} bs={m['bs']} jobs={m['numjobs']}")
            lines.append(f"{m['target']} {where}: {m['error']}")
    for t in run.targets:
        if t.dead:
            lines.append(f"{t.label}: {t.dead}")
    return lines


LEGEND = """\
IOPS, MiB/s: fio totals (median over repeats); ±%: (max-min)/median of MiB/s over repeats;
p50us/p99us: completion latency percentiles (fio clat, microseconds);
srvCPU: server utime+stime (all threads) per GiB moved, seconds; cliCPU: same for fio
(with librbd's work for fio-rbd); '-' where there is no server process (nbd://, fio-rbd);
xMiB/s, xCPU: ratio to the first target (median of per-repeat pairs; xMiB/s > 1 is faster,
xCPU < 1 is cheaper); '*' after MiB/s: some repeats failed; ERR: all failed."""


def machine_lines(run: Run) -> list[str]:
    m, a = run.machine, run.args
    lines = [f"machine: {m['nproc']} CPUs ({m['cpu']}), {m['memory']} RAM, "
             f"kernel {m['kernel']}, load {m['loadavg_start']} at start",
             f"date: {m['date']}; zcnbd git {m['git'] or '?'}",
             "tools: " + "; ".join(f"{v}" for v in m["tools"].values() if v),
             f"matrix: rw {','.join(a.rw)}; bs {','.join(a.bs)}; numjobs "
             f"{','.join(map(str, a.numjobs))}; iodepth {a.iodepth}; {a.runtime:g} s per cell; "
             f"{a.repeat} repeat(s); size {a.size}",
             f"command: {m['command']}"]
    return lines + [f"target {t.label}: {t.describe()}" for t in run.targets]


def text_report(run: Run) -> str:
    summary = summarize(run)
    parts = ["\n".join(machine_lines(run))]
    if run.interrupted:
        parts.append("INTERRUPTED: partial results")
    parts += [render_text(t) for t in ceiling_tables(run, summary)[:1]]
    parts += [render_text(t) for t in cell_tables(run, summary)]
    parts += [render_text(t) for t in ceiling_tables(run, summary)[1:]]
    parts.append(LEGEND)
    parts.append("\n".join(overall_lines(run, summary)))
    fails = failure_lines(run)
    if fails:
        parts.append("Failures:\n" + "\n".join("  " + f for f in fails))
    return "\n\n".join(p for p in parts if p) + "\n"


def markdown_report(run: Run) -> str:
    summary = summarize(run)
    m, a = run.machine, run.args
    out = ["# fio_compare results", ""]
    if run.interrupted:
        out += ["**Interrupted: partial results.**", ""]
    out += [
        f"- Date: {m['date']} (finished {run.finished})",
        f"- Machine: {m['nproc']} vCPU (`nproc`), {m['cpu']}, {m['memory']} RAM",
        f"- Kernel: `{m['kernel']}`; load average at start: {m['loadavg_start']}",
        f"- zcnbd: git {m['git'] or '?'}",
        "- Tools: " + "; ".join(f"`{v}`" for v in m["tools"].values() if v),
        f"- Matrix: rw `{','.join(a.rw)}`, bs `{','.join(a.bs)}`, numjobs "
        f"`{','.join(map(str, a.numjobs))}`, iodepth {a.iodepth}, {a.runtime:g} s per cell, "
        f"{a.repeat} repeat(s), size {a.size}; targets interleaved per cell, order rotated "
        "per repeat",
        f"- Command: `{m['command']}`",
        "",
        "Targets (the NBD servers this run starts listen on 127.0.0.1 TCP):",
        "",
    ]
    out += [f"- **{t.label}**: `{t.describe()}`" for t in run.targets]
    out.append("")
    ceil = ceiling_tables(run, summary)
    out += [render_markdown(t) + "\n" for t in ceil[:1]]
    out += [render_markdown(t) + "\n" for t in cell_tables(run, summary)]
    out += [render_markdown(t) + "\n" for t in ceil[1:]]
    out += ["Legend:", "", *[f"    {l}" for l in LEGEND.splitlines()], ""]
    out += [f"- {l}" for l in overall_lines(run, summary)]
    fails = failure_lines(run)
    if fails:
        out += ["", "Failures:", "", *[f"- {f}" for f in fails]]
    return "\n".join(out) + "\n"


def json_report(run: Run) -> dict:
    summary = summarize(run)
    a = run.args
    return {
        "interrupted": run.interrupted, "started": run.started, "finished": run.finished,
        "machine": run.machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                   if k not in ("targets",)},
        "targets": [{"label": t.label, "spec": t.spec, "uri": t.uri, "argv": t.argv,
                     "fio_engine": t.fio_engine, "fio_env": t.fio_env,
                     "command": t.describe(),
                     "pid": t.proc.pid if t.proc else None, "dead": t.dead,
                     "exit_code": t.exit_code,
                     "log_tail": t.log_tail}
                    for t in run.targets],
        "ceiling": run.ceiling,
        "prefill": run.prefill,
        "measurements": run.measurements,
        "summary": [{"rw": k[0][0], "bs": k[0][1], "numjobs": k[0][2], "target": k[1], **v}
                    for k, v in summary.items()],
    }


# --- command line ----------------------------------------------------------
TARGET_HELP = """\
targets: LABEL=SPEC, the FIRST one is the baseline for ratios.  SPEC is one of
  zcnbd:memory[:ARG,...]   zcnbd serve --memory SIZE  (+ ARGs, e.g. zcnbd:memory:--threads,4)
  zcnbd:null[:ARG,...]     zcnbd serve --null SIZE    (writes dropped, reads zeroes)
  zcnbd:file[:ARG,...]     zcnbd serve FILE, a SIZE file in the scratch dir
                           (e.g. zcnbd:file:--direct)
  zcnbd@PATH:BACKEND[...]  the same with another zcnbd binary, for before/after tables
                           (e.g. before=zcnbd@/tmp/zcnbd-old:memory after=zcnbd:memory)
  nbdkit:memory[:ARG,...]  nbdkit -f --exit-with-parent memory SIZE
                           (ARGs starting with - go before the plugin, KEY=VALUE after: nbdkit:memory:-t,4)
  nbdkit:file[:ARG,...]    nbdkit ... file FILE
  qemu-nbd:file[:ARG,...]  qemu-nbd -f raw -x '' --persistent --shared=N --cache=writeback
                           --aio=threads FILE (later ARGs override, e.g. qemu-nbd:file:--cache=none)
  zcnbd:rbd:POOL/IMAGE[:ARG,...]
                           zcnbd serve rbd:POOL/IMAGE (+ ARGs): an existing Ceph RBD image of the
                           cluster $CEPH_CONF names, served at its own size (at least --size)
  qemu-nbd:rbd:POOL/IMAGE[:ARG,...]
                           qemu-nbd -f raw -x '' --persistent --shared=N --cache=writeback
                           rbd:POOL/IMAGE (writeback: librbd's cache on, qemu-nbd's default)
  ...:unix[,ARG...]        any of the above on a Unix socket in the scratch dir (nbd+unix://;
                           with tls too: zcnbd:memory:tls,unix)
  ...:tls[,ARG...]         any of the above requiring TLS (zcnbd:memory:tls, nbdkit:memory:tls,
                           qemu-nbd:file:tls): X.509 certificates made for the run, fio connects
                           with nbds:// (HOME=a scratch dir holding .pki/libnbd)
  fio-rbd:POOL/IMAGE[:KEY=VALUE,...]
                           no NBD server: fio --ioengine=rbd --clientname=admin --pool=POOL
                           --rbdname=IMAGE, with CEPH_ARGS="--KEY=VALUE ..." for librbd
                           (e.g. fio-rbd:rbd/bench:rbd_cache=false); no server CPU, and the
                           client CPU includes librbd's
  nbd://HOST:PORT/NAME     an already running server (no server CPU; it gets prefilled = overwritten!)
default: %s""" % " ".join(DEFAULT_TARGETS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fio_compare.py",
        description="Compare NBD servers side by side with fio (IOPS, MiB/s, latency, "
                    "CPU per GiB), interleaved and repeated.",
        epilog=TARGET_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="*", metavar="LABEL=SPEC", help="servers to compare")
    p.add_argument("--rw", help=f"fio rw patterns (default {FULL['rw']})")
    p.add_argument("--bs", help=f"block sizes (default {FULL['bs']})")
    p.add_argument("--numjobs", help=f"fio jobs = NBD connections (default {FULL['numjobs']})")
    p.add_argument("--iodepth", type=int, default=16, help="fio iodepth per job (default 16)")
    p.add_argument("--runtime", type=float, help=f"seconds per cell (default {FULL['runtime']})")
    p.add_argument("--size", help=f"export size and fio --size (default {FULL['size']}; "
                                  "an RBD image keeps its own size)")
    p.add_argument("--repeat", type=int, help=f"passes over the matrix (default {FULL['repeat']})")
    p.add_argument("--quick", action="store_true",
                   help="smoke-test preset: " + "; ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the loopback ceiling with iperf3 each repeat (default on)")
    p.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="write every export once before measuring (default on)")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="also write Markdown tables")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every raw measurement")
    p.add_argument("--zcnbd", type=Path, default=DEFAULT_ZCNBD,
                   help=f"zcnbd binary (default {DEFAULT_ZCNBD.relative_to(REPO_ROOT)})")
    p.add_argument("--scratch", type=Path, default=Path("/var/tmp"),
                   help="where file exports and server logs go (default /var/tmp; a fresh "
                        "subdirectory, removed at the end)")
    p.add_argument("--keep-scratch", action="store_true", help="do not remove the scratch dir")
    p.add_argument("--fio-arg", action="append", default=[], metavar="ARG",
                   help="extra fio argument for every run (repeatable), e.g. --fio-arg=--thread")
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.rw, a.bs = split_list(a.rw), split_list(a.bs)
    a.numjobs = [int(n) for n in split_list(a.numjobs)]
    a.targets = a.targets or list(DEFAULT_TARGETS)
    a.zcnbd = a.zcnbd.resolve()
    if not (a.rw and a.bs and a.numjobs) or a.repeat < 1 or a.runtime <= 0:
        p.error("empty matrix")
    for bs in a.bs + [a.size]:
        try:
            parse_size(bs)
        except ValueError:
            p.error(f"bad size {bs!r}")
    return a


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    labels = [parse_target(t) for t in args.targets]
    if len({lab for lab, _ in labels}) != len(labels):
        raise SystemExit("target labels must be distinct")
    for tool in ["fio"] + (["iperf3"] if args.ceiling else []):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed")

    # SIGTERM behaves like Ctrl-C: stop measuring, report what there is, clean up.
    signal.signal(signal.SIGTERM, _sigterm)
    scratch = Path(tempfile.mkdtemp(prefix="fio_compare.", dir=args.scratch))
    targets: list[Target] = []
    run = None
    try:
        ports = free_ports(len(labels))
        tls = None
        if any(spec_args(spec)[1] for _, spec in labels if "://" not in spec):
            tls = make_tls_creds(scratch)
        targets = [prepare_target(lab, spec, port, args, scratch, tls)
                   for (lab, spec), port in zip(labels, ports)]
        cells = [Cell(rw, bs, nj) for rw in args.rw for bs in args.bs for nj in args.numjobs]
        run = Run(args, targets, cells, machine_info(args, targets),
                  started=datetime.datetime.now().isoformat(timespec="seconds"))
        for t in targets:
            if t.argv:
                log(f"start {t.label}: {t.describe()}")
                start_server(t, scratch)
        for t in targets:
            wait_ready(t)
        per = len(cells) * len(targets) * args.repeat
        log(f"{per} fio runs x {args.runtime:g} s = ~{per * args.runtime / 60:.1f} min "
            f"(+ prefill{', ceiling' if args.ceiling else ''})")
        try:
            if args.prefill:
                prefill(run, scratch)
            measure(run, scratch)
        except KeyboardInterrupt:
            run.interrupted = True
            log("interrupted: reporting partial results")
        except Exception:  # a bug here must not throw away what was measured
            run.interrupted = True
            log("!! internal error; reporting partial results\n" + traceback.format_exc())
    finally:
        for t in targets:
            stop_server(t)
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            log(f"scratch kept: {scratch}")
    run.finished = datetime.datetime.now().isoformat(timespec="seconds")
    for t in targets:
        if t.exit_code not in (None, 0) and not t.dead:
            log(f"!! {t.label}: exit status {t.exit_code} after SIGTERM")
    sys.stdout.write(text_report(run))
    if args.markdown:
        args.markdown.write_text(markdown_report(run))
        log(f"wrote {args.markdown}")
    if args.json:
        args.json.write_text(json.dumps(json_report(run), indent=1, default=str) + "\n")
        log(f"wrote {args.json}")
    return 130 if run.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
