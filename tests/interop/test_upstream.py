"""zcnbd serving what another NBD server serves (`zcnbd serve nbd://...`: nbdkit's nbd plugin,
and the source `zcnbd attach nbd://...` uses): the upstream is zcnbd (this suite's server),
nbdkit or qemu-nbd; real clients (libnbd, qemu-img, qemu-io) go through the proxy and the
result is checked on the upstream directly."""

import errno
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import nbd
import pytest

from support import (
    MiB,
    ZCNBD_BIN,
    ZCNBD_SERVE_ARGS,
    Export,
    Server,
    expect_nbd_error,
    handle,
    require_tools,
    run,
    states_in,
)


@pytest.fixture
def proxies():
    """Factory: proxies(upstream_uri, *extra_args) -> a zcnbd proxy on a Unix socket."""
    started = []

    def start(upstream_uri, *extra):
        workdir = Path(tempfile.mkdtemp(prefix="zcnbd-px-"))
        sock = workdir / "proxy.sock"
        argv = [str(ZCNBD_BIN), "serve", "-s", str(sock), *ZCNBD_SERVE_ARGS, upstream_uri,
                *extra]
        server = Server(argv, workdir, [Export(kind="memory")], socket_path=sock)
        server.extra_cleanup.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
        started.append(server)
        return server.start()

    yield start
    for s in started:
        if s.running():
            s.stop()
        s.cleanup()


@pytest.fixture
def peer():
    """Factory: peer("nbdkit" | "qemu-nbd", path) -> (URI, process) of an upstream server on
    a Unix socket, serving 64 MiB of memory (nbdkit) or the raw file at path (qemu-nbd)."""
    procs = []

    def start(kind, path):
        sock = path.parent / f"{kind}.sock"
        if kind == "nbdkit":
            require_tools("nbdkit")
            argv = ["nbdkit", "-f", "--exit-with-parent", "-U", str(sock), "memory", "64M"]
        else:
            require_tools("qemu-nbd", "qemu-img")
            run(["qemu-img", "create", "-q", "-f", "raw", str(path), "64M"])
            argv = ["qemu-nbd", "-f", "raw", "-k", str(sock), "-t", "-e", "4", str(path)]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        procs.append(p)
        for _ in range(500):
            if sock.exists():
                break
            subprocess.run(["sleep", "0.02"])
        assert sock.exists(), f"{kind} did not listen"
        return f"nbd+unix:///?socket={sock}"

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def test_writes_through_the_proxy_reach_the_upstream(servers, proxies):
    upstream = servers(Export(kind="memory"))
    proxy = proxies(upstream.uri(), "--upstream-connections", "2")
    data = bytes(range(256)) * 4096
    with handle(proxy.uri()) as h:
        assert h.get_size() == upstream.export.size
        h.pwrite(data, 3 * MiB)
        h.flush()
        assert h.pread(len(data), 3 * MiB) == data
    with handle(upstream.uri()) as h:
        assert h.pread(len(data), 3 * MiB) == data


@pytest.mark.parametrize("kind", ["nbdkit", "qemu-nbd"])
def test_peers_as_upstreams_agree_with_qemu_img(kind, peer, proxies, data_dir):
    upstream = peer(kind, data_dir / "upstream.raw")
    proxy = proxies(upstream)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x5a 1M 3M", "-c", "write -z 8M 1M",
         proxy.uri()])
    run(["qemu-io", "-f", "raw", "-r", "-c", "read -P 0x5a 1M 3M", "-c", "read -P 0 8M 1M",
         upstream])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", proxy.uri(), upstream])


def test_a_read_only_upstream_makes_a_read_only_export(servers, proxies):
    upstream = servers(Export(kind="memory", read_only=True))
    proxy = proxies(upstream.uri())
    with handle(proxy.uri()) as h:
        assert h.is_read_only()
        expect_nbd_error(errno.EPERM, h.pwrite, b"x" * 512, 0)
        assert len(h.pread(4096, 0)) == 4096


def test_the_upstreams_minimum_block_size_is_advertised(servers, proxies):
    upstream = servers(Export(kind="memory", min_block_size=4096))
    proxy = proxies(upstream.uri())
    with handle(proxy.uri()) as h:
        assert h.get_block_size(nbd.SIZE_MINIMUM) == 4096


def test_snapshot_leaves_the_upstream_unwritten(servers, proxies):
    upstream = servers(Export(kind="memory"))
    proxy = proxies(upstream.uri(), "--snapshot")
    with handle(proxy.uri()) as h:
        h.pwrite(b"\x77" * 65536, 0)
        assert h.pread(65536, 0) == b"\x77" * 65536
    with handle(upstream.uri()) as h:
        assert h.pread(65536, 0) == bytes(65536)


def test_extents_come_from_the_upstream(servers, proxies):
    upstream = servers(Export(kind="memory"))
    with handle(upstream.uri()) as h:
        h.pwrite(b"\x01" * MiB, 4 * MiB)
    proxy = proxies(upstream.uri())
    with handle(proxy.uri()) as h:
        assert states_in(h, 4 * MiB, MiB) == {0}  # data
        assert 0 not in states_in(h, 16 * MiB, MiB)  # a hole (zeroes)


def test_no_upstream_is_one_line_and_exit_1(data_dir):
    p = run([str(ZCNBD_BIN), "serve", "-s", str(data_dir / "p.sock"),
             f"nbd+unix:///?socket={data_dir / 'nobody.sock'}"], check=False, timeout=30)
    assert p.returncode == 1, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "nobody.sock" in lines[0], p.stderr


def _upstream_on(sock, path):
    p = subprocess.Popen([str(ZCNBD_BIN), "serve", "-s", str(sock), *ZCNBD_SERVE_ARGS, str(path)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    for _ in range(500):
        if sock.exists():
            return p
        time.sleep(0.02)
    p.kill()
    raise AssertionError("the upstream did not listen")


@pytest.mark.parametrize("reconnect", ["20s", "0"])
def test_an_upstream_that_comes_back_is_reconnected(reconnect, proxies, data_dir):
    """The upstream killed and, a second later, started again on its socket: with a reconnect
    time, a read sent meanwhile waits and gets the data flushed before; with 0 it fails at
    once."""
    path = data_dir / "upstream.raw"
    path.write_bytes(bytes(16 * MiB))
    sock = data_dir / "up.sock"
    upstream = _upstream_on(sock, path)
    proxy = proxies(f"nbd+unix:///?socket={sock}", "--reconnect-timeout", reconnect)
    data = b"\xa5" * (256 * 1024)
    try:
        with handle(proxy.uri()) as h:
            h.pwrite(data, MiB)
            h.flush()
            upstream.kill()
            upstream.wait()
            if reconnect == "0":
                with pytest.raises(nbd.Error):
                    h.pread(len(data), MiB)
                return
            restart = threading.Timer(1.0, lambda: restarted.append(_upstream_on(sock, path)))
            restarted = []
            restart.start()
            t0 = time.monotonic()
            assert h.pread(len(data), MiB) == data
            assert time.monotonic() - t0 >= 0.5, "the read did not wait for the upstream"
            restart.join()
            h.pwrite(data, 4 * MiB)
            h.flush()
        assert path.read_bytes()[4 * MiB:4 * MiB + len(data)] == data
    finally:
        # The proxy first: its last flush at exit needs the upstream (or waits for it).
        if proxy.running():
            proxy.stop()
        upstream.kill()
        for p in locals().get("restarted", []):
            p.terminate()
            p.wait(timeout=10)
