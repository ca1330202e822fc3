"""Starting zcnbd the way a new user does: error messages that name what is wrong, "server
ready" only once clients can connect, and per-export flags such as --rotational."""

import json
import shutil
import socket
import tempfile
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
    assert pages == ["zcnbd-bench.1", "zcnbd-bitmap.1", "zcnbd-serve.1", "zcnbd.1", "zcnbd.toml.5"]
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
