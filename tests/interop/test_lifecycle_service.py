"""Running zcnbd the way NBD servers are run for a job or as a service: systemd socket
activation (systemd-socket-activate, libnbd's `nbdinfo [ SERVER ]`), captive `--run`, and
`--fork --pid-file`."""

import json
import os
import signal
import subprocess
import time
import shutil
import tempfile
from pathlib import Path

import pytest

from support import (
    MiB, ZCNBD_BIN, ZCNBD_SERVE_ARGS, Server, free_tcp_port, require_tools, run,
)

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's own command line")


def zcnbd(*args) -> list[str]:
    """A `zcnbd serve` command line with the suite's engine options."""
    return [str(ZCNBD_BIN), "serve", *ZCNBD_SERVE_ARGS, *map(str, args)]


@pytest.fixture
def workdir():
    """A short private directory (Unix socket paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="zcnbd-it-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def export_size(uri: str) -> int:
    return int(run(["nbdinfo", "--size", uri]).stdout)


# --- socket activation ------------------------------------------------------------
def test_nbdinfo_starts_zcnbd_by_socket_activation():
    """libnbd's [ CMD ] syntax: nbdinfo makes a Unix socket, starts the server with
    LISTEN_PID/LISTEN_FDS, talks to it and stops it."""
    require_tools("nbdinfo")
    out = run(["nbdinfo", "--json", "--", "[", *zcnbd("--memory", "1G"), "]"]).stdout
    assert json.loads(out)["exports"][0]["export-size"] == 1 << 30


def activated(workdir: Path, listen: str, **where) -> Server:
    """`zcnbd serve` under systemd-socket-activate, listening on `listen`."""
    require_tools("systemd-socket-activate")
    argv = ["systemd-socket-activate", "-l", listen, *zcnbd("--memory", "64M")]
    server = Server(argv, workdir, [], **where)
    return server.start()  # the readiness probe's connection starts zcnbd


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_systemd_socket_activate(workdir, transport):
    require_tools("nbdinfo", "qemu-img")
    if transport == "tcp":
        port = free_tcp_port()
        server = activated(workdir, f"127.0.0.1:{port}", host="127.0.0.1", port=port)
        uri = f"nbd://127.0.0.1:{port}/"
    else:
        sock = workdir / "activated.sock"
        server = activated(workdir, str(sock), socket_path=sock)
        uri = f"nbd+unix:///?socket={sock}"
    try:
        assert export_size(uri) == 64 * MiB
        info = run(["qemu-img", "info", "--output=json", uri]).stdout
        assert json.loads(info)["virtual-size"] == 64 * MiB
        assert "socket activation" in server.log()
        server.stop()  # SIGTERM: exit 0
    finally:
        server.cleanup()
    if transport == "unix":
        assert sock.exists(), "the passed socket's file belongs to the activator"


# --- captive mode: --run ------------------------------------------------------------
def test_run_gives_the_command_a_uri():
    """nbdkit's idiom: `--run 'CLIENT "$uri"'` on a private Unix socket."""
    require_tools("nbdinfo")
    script = 'nbdinfo --size "$uri" && echo "port=[$port] nbd=$nbd sock=$unixsocket"'
    p = run(zcnbd("--memory", "3M", "--run", script))
    lines = p.stdout.splitlines()
    assert lines[0] == str(3 * MiB), p.stdout
    assert lines[1].startswith("port=[] nbd=nbd+unix:///?socket="), p.stdout
    sock = lines[1].split("sock=", 1)[1]
    assert not Path(sock).exists() and not Path(sock).parent.exists(), "private dir left"


def test_run_on_tcp_with_qemu_img():
    require_tools("qemu-img")
    port = free_tcp_port()
    script = 'qemu-img info --output=json "$uri" && echo "port=$port"'
    p = run(zcnbd("--memory", "2M", "-p", port, "--run", script))
    info, last = p.stdout.rstrip().rsplit("\n", 1)
    assert json.loads(info)["virtual-size"] == 2 * MiB
    assert last == f"port={port}", p.stdout


@pytest.mark.parametrize("script, status", [("exit 3", 3), ("exit 0", 0), ("kill -TERM $$", 143)])
def test_run_passes_the_exit_status_through(script, status):
    p = run(zcnbd("--memory", "1M", "--run", script), check=False)
    assert p.returncode == status, p.stderr
    assert "shut down cleanly" in p.stderr, p.stderr


def test_exit_with_parent(workdir):
    """The parent shell exits: zcnbd gets SIGTERM and shuts down (its socket removed)."""
    sock = workdir / "nbd.sock"
    serve = " ".join(f"'{a}'" for a in zcnbd("--memory", "1M", "-s", sock, "--exit-with-parent"))
    parent = subprocess.Popen(
        ["sh", "-c", f"{serve} 2>/dev/null & while [ ! -S '{sock}' ]; do sleep 0.05; done"],
    )
    assert parent.wait(10) == 0
    deadline = time.monotonic() + 10
    while sock.exists():
        assert time.monotonic() < deadline, "zcnbd outlived its parent"
        time.sleep(0.05)


# --- --fork and --pid-file --------------------------------------------------------------
def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, not reaped by its new parent, has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, pid_file: Path) -> None:
    deadline = time.monotonic() + 10
    while alive(pid) or pid_file.exists():
        assert time.monotonic() < deadline, f"pid {pid} alive={alive(pid)}, {pid_file} left"
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_fork_pid_file_client_then_kill(workdir, transport):
    """qemu-nbd's idiom: the command returns once the server accepts clients, the pid file
    is there, a client connects at once; `kill $(cat FILE)` stops it cleanly."""
    require_tools("nbdinfo")
    pid_file = workdir / "zcnbd.pid"
    if transport == "unix":
        sock = workdir / "nbd.sock"
        listen, uri = ["-s", sock], f"nbd+unix:///?socket={sock}"
    else:
        port = free_tcp_port()
        listen, uri = ["-p", port], f"nbd://127.0.0.1:{port}/"
    p = run(zcnbd("--memory", "4M", *listen, "--fork", "--pid-file", pid_file), timeout=30)
    assert "server ready" in p.stderr, p.stderr
    pid = int(pid_file.read_text())
    try:
        assert pid != os.getpid() and alive(pid)
        assert export_size(uri) == 4 * MiB
        run(["sh", "-c", f"kill $(cat '{pid_file}')"])
        wait_gone(pid, pid_file)
        if transport == "unix":
            assert not sock.exists()
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_pid_file_in_the_foreground(workdir):
    pid_file = workdir / "zcnbd.pid"
    sock = workdir / "nbd.sock"
    server = Server(zcnbd("--memory", "1M", "-s", sock, "--pid-file", pid_file), workdir, [],
                    socket_path=sock)
    try:
        server.start()
        # The socket is bound a moment before the pid file is written (once the listeners
        # accept): wait for the file, as a script would.
        deadline = time.monotonic() + 10
        while not pid_file.exists():
            assert time.monotonic() < deadline, "no pid file within 10 s"
            time.sleep(0.02)
        assert int(pid_file.read_text()) == server.proc.pid
        server.stop()
        assert not pid_file.exists()
    finally:
        server.cleanup()


def test_fork_reports_a_failed_start(workdir):
    """The child fails after the fork (the pid file cannot be written): the parent exits
    with its status, and the error is on the caller's stderr."""
    pid_file = workdir / "no-such-dir" / "zcnbd.pid"
    p = run(zcnbd("--memory", "1M", "-s", workdir / "nbd.sock", "--fork", "--pid-file",
                  pid_file), check=False, timeout=30)
    assert p.returncode != 0
    assert "cannot write the pid file" in p.stderr, p.stderr
    assert not (workdir / "nbd.sock").exists()
