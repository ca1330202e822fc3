"""Starting zcnbd the way a new user does: error messages that name what is wrong, "server
ready" only once clients can connect, and per-export flags such as --rotational."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from support import (
    ZCNBD_BIN, ZCNBD_SERVE_ARGS, Export, Server, require_tools, run,
)

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's own command line")


def zcnbd(*args) -> list[str]:
    """A `zcnbd serve` command line with the suite's engine options."""
    return [str(ZCNBD_BIN), "serve", *ZCNBD_SERVE_ARGS, *map(str, args)]


def nbdinfo_json(uri: str) -> dict:
    require_tools("nbdinfo")
    return json.loads(run(["nbdinfo", "--json", uri]).stdout)


def test_missing_file_is_named(tmp_path):
    missing_path = tmp_path / "missing.img"
    p = run(zcnbd(missing_path, "-s", tmp_path / "nbd.sock"), check=False, timeout=20)
    assert p.returncode != 0
    assert str(missing_path) in p.stderr, p.stderr
    assert "server ready" not in p.stderr


def test_no_ready_before_a_failing_bind():
    with socket.socket() as occupied:
        occupied.bind(("127.0.0.1", 0))
        occupied.listen()
        port = occupied.getsockname()[1]
        p = run(zcnbd("--memory", "1M", "-b", "127.0.0.1", "-p", port), check=False, timeout=20)
    assert p.returncode != 0, p.stderr
    assert "cannot listen" in p.stderr, p.stderr
    assert "server ready" not in p.stderr, p.stderr


def test_rotational_flag(servers):
    server = servers(Export(kind="memory"), extra_args=["--rotational"])
    assert nbdinfo_json(server.uri())["exports"][0]["is_rotational"] is True


def test_not_rotational_by_default(mem_server):
    assert nbdinfo_json(mem_server.uri())["exports"][0]["is_rotational"] is False


def test_rotational_in_config():
    workdir = Path(tempfile.mkdtemp(prefix="zcnbd-it-"))
    config = workdir / "exports.toml"
    config.write_text(
        '[[export]]\nname = "spin"\nmemory = "1M"\nrotational = true\n'
        '[[export]]\nname = "flash"\nmemory = "1M"\n'
    )
    sock = workdir / "nbd.sock"
    server = Server(zcnbd("--config", config, "-s", sock), workdir, [], socket_path=sock)
    server.extra_cleanup.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    try:
        server.start()
        assert nbdinfo_json(server.uri("spin"))["exports"][0]["is_rotational"] is True
        assert nbdinfo_json(server.uri("flash"))["exports"][0]["is_rotational"] is False
        server.stop()
    finally:
        server.cleanup()


def test_generated_man_pages_and_completions(tmp_path):
    """`zcnbd generate-docs DIR`: man pages that groff renders without warnings and man
    shows, and completions bash accepts."""
    run([ZCNBD_BIN, "generate-docs", tmp_path])
    pages = sorted(p.name for p in (tmp_path / "man").iterdir())
    assert pages == ["zcnbd-attach.1", "zcnbd-bench.1", "zcnbd-bitmap.1", "zcnbd-detach.1",
                     "zcnbd-filter.1", "zcnbd-list.1", "zcnbd-serve.1", "zcnbd.1",
                     "zcnbd.toml.5"]
    serve_page = (tmp_path / "man" / "zcnbd-serve.1").read_text()
    for option in ("rotational", "run", "fork", "pid\\-file", "exit\\-with\\-parent"):
        assert f"\\-\\-{option}" in serve_page, option
    if shutil.which("groff"):
        for page in pages:
            p = run(["groff", "-man", "-Tutf8", "-ww", "-z", tmp_path / "man" / page])
            assert p.stderr == "", f"{page}: {p.stderr}"
    if shutil.which("man"):
        shown = run(["man", "-l", "-P", "cat", tmp_path / "man" / "zcnbd-serve.1"]).stdout
        assert "zcnbd-serve" in shown and "--pid-file" in shown.replace("‐", "-")
    completions = tmp_path / "completions"
    assert {p.name for p in completions.iterdir()} == {"zcnbd.bash", "_zcnbd", "zcnbd.fish"}
    assert "--fork" in (completions / "_zcnbd").read_text()
    assert "pid-file" in (completions / "zcnbd.fish").read_text()
    p = run(["bash", "-c", f"source '{completions / 'zcnbd.bash'}' && complete -p zcnbd"])
    assert "zcnbd" in p.stdout


def test_sigterm_as_soon_as_it_listens_is_an_orderly_stop():
    """A SIGTERM that arrives the moment the port accepts (before the accept loop waits for
    signals) still stops the server in order, exit status 0 - not killed by the signal."""
    import signal
    import subprocess
    import time

    from support import free_tcp_port

    for _ in range(10):
        port = free_tcp_port()
        proc = subprocess.Popen(zcnbd("--memory", "64M", "-p", port), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the server never listened"
                    time.sleep(0.001)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
        finally:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag", ["-s", "-k", "-U"])
def test_a_second_server_never_takes_a_live_socket_over(tmp_path, flag):
    """qemu-nbd's -k and nbdkit's -U name the socket too. A second server on the path of a
    running one refuses to start and leaves the path alone; a stale socket (a killed
    server's) is replaced; a server that exits removes the path only if it is its own."""
    sock = tmp_path / "nbd.sock"
    first = Server(zcnbd("--memory", "1M", flag, sock), tmp_path, [Export(kind="memory")],
                   socket_path=sock)
    try:
        first.start()
        p = run(zcnbd("--memory", "1M", "-s", sock), check=False, timeout=20)
        assert p.returncode != 0, p.stderr
        assert f"another server is listening on {sock}" in p.stderr, p.stderr
        # The first server is still reachable at its path.
        assert nbdinfo_json(first.uri())["exports"][0]["export-size"] == 1 << 20
        first.kill()
        assert sock.exists(), "the killed server's socket stays (stale)"
        second = Server(zcnbd("--memory", "2M", "-s", sock), tmp_path / ".", [Export(kind="memory")],
                        socket_path=sock)
        second.start()
        # Another socket put at the path after it started is not removed at its exit.
        sock.unlink()
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(sock))
            second.stop()
            assert sock.exists(), "a socket that is not the server's own was removed"
        sock.unlink()
    finally:
        first.cleanup()


def test_s_given_a_file_says_it_is_the_socket_here(tmp_path):
    """qemu-nbd's habit `-s disk.img` (a snapshot there): never replaced, and the error says
    what -s is here and where the snapshot went."""
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"\0" * 4096)
    p = run(zcnbd("-s", disk, "--memory", "1M"), check=False, timeout=20)
    assert p.returncode != 0
    assert "--snapshot" in p.stderr and "--socket" in p.stderr, p.stderr
    assert disk.read_bytes() == b"\0" * 4096


def start_logged(tmp_path, *args, env=None) -> tuple[subprocess.Popen, Path, Path]:
    """`zcnbd serve ARGS -s SOCK` with standard error in a file; returns once it listens."""
    sock = tmp_path / "nbd.sock"
    log = tmp_path / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(zcnbd(*args, "-s", sock), stdout=subprocess.PIPE,
                                stderr=err, env=env)
    deadline = time.monotonic() + 20
    while "server ready" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    return proc, sock, log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    assert proc.wait(20) == 0


def test_the_log_on_a_pipe_or_file_has_no_colour_and_says_what_is_served(tmp_path):
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"\0" * (1 << 20))
    proc, sock, log = start_logged(tmp_path, disk, "-x", "disk", "-r", "--print-uri")
    uri = proc.stdout.readline().decode().strip()
    stop(proc)
    text = log.read_text()
    assert "\x1b[" not in text, text
    assert uri == f"nbd+unix:///disk?socket={sock}", uri
    line = next(l for l in text.splitlines() if "serving export" in l)
    for part in ("\"disk\"", f"source=file {disk}", "size=1048576", "read_only=true"):
        assert part in line, line
    assert f"connect with {uri}" in text, text


def test_under_journald_each_line_carries_its_priority(tmp_path):
    """systemd sets JOURNAL_STREAM to the device and inode of the stream it gave as standard
    error: then no times (the journal has them) and `<N>` priorities (sd-daemon(3))."""
    log = tmp_path / "stderr.log"
    log.touch()
    st = os.stat(log)
    env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
    env.pop("NO_COLOR", None)
    proc, _, log = start_logged(tmp_path, "--memory", "1M", env=env)
    stop(proc)
    lines = [l for l in log.read_text().splitlines() if l]
    assert lines and all(l[0] == "<" and l[2] == ">" for l in lines), lines
    assert any(l.startswith("<6>") and "server ready" in l for l in lines), lines
    assert not any(l[3:7].isdigit() for l in lines), "a time in a journald line"


def test_bare_zcnbd_prints_usage():
    p = run([ZCNBD_BIN], check=False, timeout=20)
    assert p.returncode == 2
    assert "serve" in p.stdout and "Usage" in p.stdout, p.stdout


def test_fork_logs_to_syslog(tmp_path):
    """With --fork, standard error is gone: the log goes to /dev/log."""
    if os.path.exists("/dev/log"):
        pytest.skip("/dev/log is a running syslog's: not taken over by a test")
    if os.geteuid() != 0:
        pytest.skip("binding /dev/log needs root")
    sock = tmp_path / "nbd.sock"
    pid_file = tmp_path / "pid"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as syslog:
        syslog.bind("/dev/log")
        try:
            run(zcnbd("--memory", "1M", "-s", sock, "--fork", "--pid-file", pid_file))
            syslog.settimeout(10)
            messages = []
            while not any("server ready" in m for m in messages):
                messages.append(syslog.recv(65536).decode())
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
            assert all(m.startswith("<") and "zcnbd[" in m for m in messages), messages
            assert any(m.startswith("<30>") for m in messages), messages  # daemon.info
        finally:
            os.unlink("/dev/log")


@pytest.mark.parametrize("args, expected", [
    (["--memory", "1X"], ["'--memory <SIZE>'", "64K"]),
    (["--memory", "0"], ["'--memory <SIZE>'", "at least 1 byte"]),
    (["-f", "qcow2", "{raw}"], ["not a qcow2 image", "look like raw", "-f raw"]),
    (["{dir}/missing.img"], ["cannot open", "No such file or directory"]),
])
def test_errors_name_the_option_the_value_and_the_fix(tmp_path, args, expected):
    raw = tmp_path / "raw.img"
    raw.write_bytes(b"\0" * 65536)
    args = [a.format(raw=raw, dir=tmp_path) for a in args]
    p = run(zcnbd(*args, "-s", tmp_path / "nbd.sock"), check=False, timeout=20)
    assert p.returncode != 0
    for part in expected:
        assert part in p.stderr, p.stderr
    assert "os error" not in p.stderr and 'export ""' not in p.stderr, p.stderr


def test_check_reports_what_would_be_served_even_while_it_is_served(tmp_path):
    """`--check` (nbdkit's --dump-config use): before a SIGHUP, the edited file is checked -
    files, image chains, TLS - while the running server holds them, and nothing listens."""
    require_tools("qemu-img")
    image = tmp_path / "vm.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"])
    config = tmp_path / "exports.toml"
    config.write_text(f'[[export]]\nname = "vm"\nfile = "{image}"\n'
                      '[[export]]\nname = "m"\nmemory = "1M"\nread_only = true\n')
    sock = tmp_path / "nbd.sock"
    server = Server(zcnbd("--config", config, "-s", sock), tmp_path, [Export(kind="memory")],
                    socket_path=sock)
    try:
        server.start()
        p = run(zcnbd("--config", config, "--check"), timeout=30)
        assert f'export "vm": file {image}, qcow2 (67108864 bytes)' in p.stdout, p.stdout
        assert 'export "m": memory, 1048576 bytes, read-only' in p.stdout, p.stdout
        assert "ok: nothing served" in p.stdout
        config.write_text(f'[[export]]\nname = "vm"\nfile = "{tmp_path}/typo.qcow2"\n')
        p = run(zcnbd("--config", config, "--check"), check=False, timeout=30)
        assert p.returncode == 1 and "typo.qcow2" in p.stderr, p.stderr
        server.stop()
    finally:
        server.cleanup()
