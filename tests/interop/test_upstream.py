"""zcnbd serving what another NBD server serves (`zcnbd serve nbd://...`: nbdkit's nbd plugin,
and the source `zcnbd attach nbd://...` uses): the upstream is zcnbd (this suite's server),
nbdkit, qemu-nbd or nbd-server, plain and with TLS required; real clients (libnbd, qemu-img,
qemu-io) go through the proxy and the result is checked on the upstream directly."""

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import nbd
import pytest

import nbdproto as P
import tls_creds

from support import (
    MiB,
    free_tcp_port,
    serve_configuration,
    settled_metrics,
    ZCNBD_BIN,
    ZCNBD_SERVE_ARGS,
    Export,
    Server,
    expect_nbd_error,
    handle,
    missing,
    pattern,
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


def _piped_reads_expected() -> bool:
    """Whether this run's proxies splice large reads (the io_uring engine, not the copy
    baseline)."""
    engine, data_path = serve_configuration()
    return engine == "uring" and data_path != "copy"


def test_large_reads_go_from_the_upstreams_socket_to_the_clients(servers, proxies):
    """With --splice-min-bytes 64K, a read of 64 KiB or more through the proxy on the ring
    is spliced from the upstream's socket into a pipe and from the pipe to the client's
    socket, never through user memory (the counters say so); a 4 KiB read is received into
    memory (unless every read is spliced: --data-path zerocopy); the bytes are the
    upstream's either way."""
    upstream = servers(Export(kind="memory"))
    port = free_tcp_port()
    proxy = proxies(upstream.uri(), "--metrics", f"127.0.0.1:{port}", "--splice-min-bytes",
                    "64K")
    data = bytes((i * 7 + i // 4096) % 251 for i in range(8 * MiB))
    with handle(upstream.uri()) as h:
        h.pwrite(data, 0)
        h.flush()
    with handle(proxy.uri()) as h:
        for i in range(6):
            assert h.pread(MiB, i * MiB) == data[i * MiB:(i + 1) * MiB], f"MiB {i}"
        assert h.pread(65536, 6 * MiB) == data[6 * MiB:6 * MiB + 65536]
        assert h.pread(4096, 7 * MiB + 512) == data[7 * MiB + 512:7 * MiB + 4608]
        c = settled_metrics(port, replies=8)
    large, read = 6 * MiB + 65536, 6 * MiB + 65536 + 4096
    assert c["read_bytes"] == read, c
    if _piped_reads_expected():
        # A pipe that filled before its read ended sends the rest from memory after it.
        assert c["upstream_spliced_bytes"] + c["copied_bytes"] == read, c
        assert c["upstream_spliced_bytes"] >= large * 8 // 10, c
        assert c["sent_splice_bytes"] >= c["upstream_spliced_bytes"], c
        if serve_configuration()[1] == "auto":
            assert c["copied_bytes"] >= 4096, c
    else:
        assert c["upstream_spliced_bytes"] == 0 and c["sent_splice_bytes"] == 0, c


def test_a_client_on_this_host_gets_no_spliced_reads_unless_asked(servers, proxies):
    """Without --splice-min-bytes, `auto` splices an upstream's reads only to a client on
    another host (test_counters.py has one in a network namespace): this proxy's client is on
    a Unix socket, so its 1 MiB reads are received into memory; zerocopy splices them."""
    upstream = servers(Export(kind="memory"))
    port = free_tcp_port()
    proxy = proxies(upstream.uri(), "--metrics", f"127.0.0.1:{port}")
    data = pattern(2 * MiB, seed=51)
    with handle(proxy.uri()) as h:
        h.pwrite(data, 0)
        assert h.pread(MiB, 0) == data[:MiB]
        assert h.pread(MiB, MiB) == data[MiB:]
        c = settled_metrics(port, replies=3)
    if _piped_reads_expected() and serve_configuration()[1] == "zerocopy":
        assert c["upstream_spliced_bytes"] >= 2 * MiB * 8 // 10, c
    else:
        assert c["upstream_spliced_bytes"] == 0 and c["sent_splice_bytes"] == 0, c


def test_a_sparse_read_through_the_proxy_splices_its_front_only(peer, proxies, data_dir):
    """qemu-nbd answers a read over a hole with a hole chunk between data chunks: the first
    data chunk goes into the pipe, the hole and what follows it into memory after it, and
    the client gets the bytes in order."""
    path = data_dir / "upstream.raw"
    uri = peer("qemu-nbd", path)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x3c 0 256k", "-c", "write -P 0x4d 768k 256k",
         uri])
    port = free_tcp_port()
    proxy = proxies(uri, "--metrics", f"127.0.0.1:{port}", "--splice-min-bytes", "64K")
    want = b"\x3c" * (256 * 1024) + bytes(512 * 1024) + b"\x4d" * (256 * 1024)
    with handle(proxy.uri()) as h:
        assert h.pread(MiB, 0) == want
        c = settled_metrics(port, replies=1)
    assert c["read_bytes"] == MiB, c
    assert c["upstream_spliced_bytes"] + c["copied_bytes"] == MiB, c
    assert c["upstream_spliced_bytes"] <= 256 * 1024, c
    if _piped_reads_expected():
        assert c["upstream_spliced_bytes"] > 0, c


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


def _upstream_on(sock, path, *extra):
    p = subprocess.Popen([str(ZCNBD_BIN), "serve", "-s", str(sock), *ZCNBD_SERVE_ARGS, str(path),
                          *extra],
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


def test_reads_in_flight_when_the_upstream_dies_are_sent_again(proxies, data_dir):
    """32 reads in flight through a proxy with one worker thread (each read waits 300 ms at
    the upstream) when the upstream is killed, and the upstream back a second later: every
    read gets its data, as the proxy sends what was in flight again on its new connection,
    and soon - no read holds the worker (one at a time, they would take 10 s)."""
    n, size = 32, 64 * 1024
    path = data_dir / "upstream.raw"
    path.write_bytes(b"".join(bytes([i + 1]) * size for i in range(n)))
    sock = data_dir / "up.sock"
    slow = ("--filter", "delay", "--filter-opt", "delay.rdelay=300ms")
    upstream = _upstream_on(sock, path, *slow)
    proxy = proxies(f"nbd+unix:///?socket={sock}", "--reconnect-timeout", "20s",
                    "--threads", "1")
    restarted = []
    try:
        with handle(proxy.uri()) as h:
            bufs = [nbd.Buffer(size) for _ in range(n)]
            t0 = time.monotonic()
            cookies = [h.aio_pread(bufs[i], i * size) for i in range(n)]
            time.sleep(0.1)
            upstream.kill()
            upstream.wait()
            restart = threading.Timer(1.0, lambda: restarted.append(_upstream_on(sock, path, *slow)))
            restart.start()
            deadline = time.monotonic() + 30
            pending = set(cookies)
            while pending:
                assert time.monotonic() < deadline, f"{len(pending)} reads hung"
                h.poll(1000)
                pending = {c for c in pending if not h.aio_command_completed(c)}
            assert time.monotonic() - t0 < 5, "the reads went one at a time"
            restart.join()
            for i, buf in enumerate(bufs):
                assert bytes(buf.to_bytearray()) == bytes([i + 1]) * size, f"read {i}"
    finally:
        if proxy.running():
            proxy.stop()
        upstream.kill()
        for p in restarted:
            p.terminate()
            p.wait(timeout=10)


def test_a_forked_proxy_serves_the_upstream(data_dir):
    """`--fork` forks after the upstream is connected, which only a process of one thread
    may do: the proxy starts no thread of its own before its first request."""
    path = data_dir / "upstream.raw"
    path.write_bytes(b"\x5a" * MiB)
    sock, proxied = data_dir / "up.sock", data_dir / "proxy.sock"
    pid_file = data_dir / "proxy.pid"
    upstream = _upstream_on(sock, path)
    try:
        run([str(ZCNBD_BIN), "serve", "-s", str(proxied), "--fork", "--pid-file", str(pid_file),
             *ZCNBD_SERVE_ARGS, f"nbd+unix:///?socket={sock}"], timeout=30)
        pid = int(pid_file.read_text())
        try:
            with handle(f"nbd+unix:///?socket={proxied}") as h:
                assert h.pread(65536, 4096) == b"\x5a" * 65536
        finally:
            os.kill(pid, signal.SIGTERM)
    finally:
        upstream.kill()


# Metadata contexts through the proxy: qemu-nbd serving a qcow2 over a backing file, with
# persistent dirty bitmaps, is the oracle - nbdinfo through zcnbd must print what it prints
# against qemu-nbd directly (incremental backup through a proxy).

BITMAPS = ("b0", "b1")
PASSED = ["base:allocation", "qemu:allocation-depth",
          "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"]


def _qcow2_chain_with_bitmaps(d: Path) -> Path:
    """top.qcow2 over base.qcow2: data in both layers (allocation depths 0, 1, 2); bitmap b0
    added before two writes, b1 (granularity 512) before the second only."""
    require_tools("qemu-img", "qemu-io", "qemu-nbd", "nbdinfo")
    base, top = d / "base.qcow2", d / "top.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "64M"])
    run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x11 0 4M", "-c", "write -P 0x12 40M 1M",
         str(base)])
    run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(top)])
    run(["qemu-img", "bitmap", "--add", str(top), "b0"])
    run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x21 8M 1M", str(top)])
    run(["qemu-img", "bitmap", "--add", "-g", "512", str(top), "b1"])
    run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x22 20M 64k", "-c", "write -z 30M 1M",
         str(top)])
    return top


def _qemu_nbd(sock: Path, image: Path, *bitmaps: str) -> subprocess.Popen:
    """qemu-nbd serving `image` writable with qemu:allocation-depth and `bitmaps`."""
    if sock.exists():
        sock.unlink()
    argv = ["qemu-nbd", "-f", "qcow2", "-t", "-e", "4", "-A", "-k", str(sock)]
    for b in bitmaps:
        argv += ["-B", b]
    p = subprocess.Popen([*argv, str(image)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(500):
        if sock.exists():
            return p
        if p.poll() is not None:
            raise AssertionError(f"qemu-nbd exited: {p.stderr.read().decode()}")
        time.sleep(0.02)
    p.kill()
    raise AssertionError("qemu-nbd did not listen")


def _stop(p: subprocess.Popen) -> None:
    """A clean stop: qemu-nbd stores its bitmaps (killed, they would be left in use)."""
    p.terminate()
    p.wait(timeout=10)


def _map(uri: str, context: str) -> str:
    return run(["nbdinfo", f"--map={context}", uri]).stdout


def _contexts(uri: str) -> list[str]:
    return sorted(json.loads(run(["nbdinfo", "--json", uri]).stdout)["exports"][0]["contexts"])


def _assert_maps_agree(proxy_uri: str, upstream_uri: str) -> None:
    for context in PASSED:
        theirs = _map(upstream_uri, context)
        ours = _map(proxy_uri, context)
        assert ours == theirs, f"{context}\n--- proxy ---\n{ours}--- qemu-nbd ---\n{theirs}"


@pytest.fixture
def qemu_chain(data_dir):
    """(image, socket, start): start(*bitmaps) runs qemu-nbd on the chain; stopped after."""
    image = _qcow2_chain_with_bitmaps(data_dir)
    sock = data_dir / "qemu.sock"
    procs = []

    def start(*bitmaps):
        procs.append(_qemu_nbd(sock, image, *bitmaps))
        return procs[-1]

    yield image, sock, start
    for p in procs:
        if p.poll() is None:
            _stop(p)


def test_qemu_contexts_pass_through_the_proxy(qemu_chain, proxies):
    _image, sock, start = qemu_chain
    start(*BITMAPS)
    upstream = f"nbd+unix:///?socket={sock}"
    proxy = proxies(upstream, "--upstream-connections", "2")
    # Listed as qemu-nbd lists them (nbdinfo --list/--json asks with LIST_META_CONTEXT).
    assert _contexts(proxy.uri()) == _contexts(upstream) == sorted(PASSED)
    listed = run(["nbdinfo", "--list", "--content", proxy.uri()]).stdout
    assert all(c in listed for c in PASSED), listed
    dirty = _map(proxy.uri(), "qemu:dirty-bitmap:b0")
    assert "dirty" in dirty and "clean" in dirty, dirty
    depth = _map(proxy.uri(), "qemu:allocation-depth")
    assert "backing depth 2" in depth and "local" in depth and "absent" in depth, depth
    _assert_maps_agree(proxy.uri(), upstream)
    # A write through the proxy is in the upstream's bitmaps and depths, seen through it.
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x33 50M 192k", proxy.uri()])
    _assert_maps_agree(proxy.uri(), upstream)
    assert "52428800" in _map(proxy.uri(), "qemu:dirty-bitmap:b1")


def test_one_block_status_answers_every_context_selected(qemu_chain, proxies):
    """A client selecting all four contexts gets each one's extents from one request, the
    same as qemu-nbd gives (libnbd, windows that split extents)."""
    _image, sock, start = qemu_chain
    start(*BITMAPS)
    upstream = f"nbd+unix:///?socket={sock}"
    proxy = proxies(upstream)

    def status(uri, offset, length):
        h = nbd.NBD()
        for c in PASSED:
            h.add_meta_context(c)
        h.connect_uri(uri)
        got = {}

        def cb(context, off, entries, err):
            got[context] = list(entries)
            return 0

        h.block_status(length, offset, cb)
        h.shutdown()
        return got

    def covered(entries, offset, length):
        """(offset, length, flags) of each extent, clipped to the range asked."""
        out, at = [], offset
        for i in range(0, len(entries), 2):
            n = min(entries[i], offset + length - at)
            if n <= 0:
                break
            out.append((at, n, entries[i + 1]))
            at += n
        return out

    for offset, length in [(0, 64 * MiB), (7 * MiB, 2 * MiB + 512), (20 * MiB + 4096, 8192)]:
        ours, theirs = status(proxy.uri(), offset, length), status(upstream, offset, length)
        assert sorted(ours) == sorted(PASSED)
        for c in PASSED:
            ours_c = covered(ours[c], offset, length)
            theirs_c = covered(theirs[c], offset, length)
            assert ours_c == theirs_c, f"{c} at {offset}+{length}: {ours_c} != {theirs_c}"


def test_a_bitmap_named_with_b_is_the_upstreams(qemu_chain, proxies, data_dir):
    """-B b0 on the proxy names the upstream's bitmap: it is served from there, not tracked
    (no --bitmap-dir needed), and the control socket refuses to track one of that name."""
    _image, sock, start = qemu_chain
    start(*BITMAPS)
    upstream = f"nbd+unix:///?socket={sock}"
    ctl = data_dir / "ctl.sock"
    proxy = proxies(upstream, "-B", "b0")
    _assert_maps_agree(proxy.uri(), upstream)
    proxy = proxies(upstream, "--control", str(ctl), "--bitmap-dir", str(data_dir))
    for _ in range(250):
        if ctl.exists():
            break
        time.sleep(0.02)
    add = run([str(ZCNBD_BIN), "bitmap", "-c", str(ctl), "add", "b0"], check=False)
    assert add.returncode != 0 and "of its own" in add.stderr + add.stdout, add
    # Another name is tracked by zcnbd beside the upstream's.
    run([str(ZCNBD_BIN), "bitmap", "-c", str(ctl), "add", "mine"])
    assert _contexts(proxy.uri()) == sorted([*PASSED, "qemu:dirty-bitmap:mine"])
    _assert_maps_agree(proxy.uri(), upstream)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x44 60M 64k", proxy.uri()])
    mine = _map(proxy.uri(), "qemu:dirty-bitmap:mine")
    assert mine.split() == ["0", "62914560", "0", "clean", "62914560", "65536", "1", "dirty",
                            "62980096", "4128768", "0", "clean"], mine


def test_a_context_the_upstream_lost_fails_with_eio_after_a_reconnect(qemu_chain, proxies):
    _image, sock, start = qemu_chain
    qemu = start(*BITMAPS)
    upstream = f"nbd+unix:///?socket={sock}"
    proxy = proxies(upstream, "--reconnect-timeout", "20s")

    def client(*contexts):
        h = nbd.NBD()
        for c in contexts:
            h.add_meta_context(c)
        h.connect_uri(proxy.uri())
        return h

    def contexts_at(h, offset):
        seen = []
        h.block_status(MiB, offset, lambda ctx, off, entries, err: seen.append(ctx) or 0)
        return seen

    both = client("qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1")
    only_b0 = client("qemu:dirty-bitmap:b0")
    assert sorted(contexts_at(both, 8 * MiB)) == ["qemu:dirty-bitmap:b0",
                                                     "qemu:dirty-bitmap:b1"]
    # The upstream comes back without b1.
    _stop(qemu)
    start("b0")
    expect_nbd_error(errno.EIO, both.block_status, MiB, 8 * MiB, lambda *a: 0)
    assert contexts_at(only_b0, 8 * MiB) == ["qemu:dirty-bitmap:b0"]
    assert _map(proxy.uri(), "qemu:dirty-bitmap:b0") == _map(upstream, "qemu:dirty-bitmap:b0")
    both.shutdown()
    only_b0.shutdown()
    assert "no longer offers" in proxy.log()


class _ListingUpstream:
    """A scripted NBD server on a Unix socket that lists `names` for any
    NBD_OPT_LIST_META_CONTEXT, selects those a SET names (ids from 1), and answers block status
    with one extent of flags 1 per selected context (reads: zeroes). Read-only, 16 MiB,
    structured replies only."""

    SIZE = 16 * MiB

    def __init__(self, path: Path, names: list[str], read_reply=None):
        self.names = names
        # read_reply(socket, head, offset, length): answers a read instead (hostile replies).
        self.read_reply = read_reply
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        try:
            with s:
                selected = self._haggle(s)
                if selected is not None:
                    self._transmit(s, selected)
        except (OSError, ConnectionError, struct.error):
            pass  # the client hung up (as it must, on a hostile listing)

    @staticmethod
    def _recv(s: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = s.recv(n - len(data))
            if not more:
                raise ConnectionError("closed")
            data += more
        return data

    @staticmethod
    def _reply(s: socket.socket, option: int, kind: int, data: bytes = b"") -> None:
        s.sendall(struct.pack(">QIII", P.OPT_REPLY_MAGIC, option, kind, len(data)) + data)

    def _haggle(self, s: socket.socket):
        s.sendall(struct.pack(">QQH", P.NBDMAGIC, P.IHAVEOPT,
                              P.FLAG_FIXED_NEWSTYLE | P.FLAG_NO_ZEROES))
        self._recv(s, 4)
        selected: list[int] = []
        while True:
            _magic, option, length = struct.unpack(">QII", self._recv(s, 16))
            data = self._recv(s, length)
            if option == P.OPT_STRUCTURED_REPLY:
                self._reply(s, option, P.REP_ACK)
            elif option == P.OPT_LIST_META_CONTEXT:
                replies = b"".join(
                    struct.pack(">QIII", P.OPT_REPLY_MAGIC, option, P.REP_META_CONTEXT,
                                4 + len(n)) + struct.pack(">I", 0) + n.encode()
                    for n in self.names)
                s.sendall(replies)
                self._reply(s, option, P.REP_ACK)
            elif option == P.OPT_SET_META_CONTEXT:
                selected = []
                (export_len,) = struct.unpack(">I", data[:4])
                at = 4 + export_len
                (count,) = struct.unpack(">I", data[at:at + 4])
                at += 4
                for _ in range(count):
                    (n,) = struct.unpack(">I", data[at:at + 4])
                    name = data[at + 4:at + 4 + n].decode()
                    at += 4 + n
                    if name in self.names:
                        selected.append(len(selected) + 1)
                        self._reply(s, option, P.REP_META_CONTEXT,
                                    struct.pack(">I", selected[-1]) + name.encode())
                self._reply(s, option, P.REP_ACK)
            elif option == P.OPT_GO:
                flags = P.FLAG_HAS_FLAGS | P.FLAG_READ_ONLY
                info = struct.pack(">HQH", P.INFO_EXPORT, self.SIZE, flags)
                self._reply(s, option, P.REP_INFO, info)
                self._reply(s, option, P.REP_ACK)
                return selected
            elif option == P.OPT_ABORT:
                self._reply(s, option, P.REP_ACK)
                return None
            else:
                self._reply(s, option, P.REP_ERR_UNSUP)

    def _transmit(self, s: socket.socket, selected: list[int]) -> None:
        done = 1
        while True:
            _magic, _flags, kind, cookie, offset, length = struct.unpack(
                ">IHHQQI", self._recv(s, 28))
            if kind == P.CMD_DISC:
                return

            def head(ctype, flags, n, cookie=cookie):
                return struct.pack(">IHHQI", P.STRUCTURED_REPLY_MAGIC, flags, ctype, cookie, n)

            if kind == P.CMD_READ and self.read_reply:
                self.read_reply(s, head, offset, length)
            elif kind == P.CMD_READ:
                s.sendall(head(1, done, 8 + length) + struct.pack(">Q", offset) + bytes(length))
            elif kind == 7 and selected:  # NBD_CMD_BLOCK_STATUS
                for i, id_ in enumerate(selected):
                    flags = done if i + 1 == len(selected) else 0
                    s.sendall(head(5, flags, 12) + struct.pack(">III", id_, length, 1))
            else:
                s.sendall(head(0, done, 0))


@pytest.fixture
def listing_upstream(data_dir):
    """Factory: listing_upstream(names) -> the URI of a _ListingUpstream listing them."""
    made = []

    def start(names):
        sock = data_dir / f"listing{len(made)}.sock"
        made.append(_ListingUpstream(sock, names))
        return f"nbd+unix:///?socket={sock}"

    yield start
    for u in made:
        u.close()


def test_an_upstream_listing_contexts_without_end_is_refused_at_start(listing_upstream, data_dir):
    upstream = listing_upstream([f"qemu:dirty-bitmap:{i}" for i in range(5000)])
    p = run([str(ZCNBD_BIN), "serve", "-s", str(data_dir / "p.sock"), upstream],
            check=False, timeout=30)
    assert p.returncode == 1, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than 4096 replies" in lines[0], p.stderr


def test_an_upstream_with_more_contexts_than_fit_passes_the_first(listing_upstream, proxies):
    """41 contexts and a wildcard listed: 32 are selected besides base:allocation (the rest
    and the wildcard counted and logged), 31 offered (the stack's bound, logged too)."""
    bitmaps = [f"qemu:dirty-bitmap:{i}" for i in range(40)]
    names = ["base:allocation", "qemu:dirty-bitmap:", *bitmaps, "qemu:allocation-depth"]
    proxy = proxies(listing_upstream(names))
    contexts = json.loads(run(["nbdinfo", "--json", "--no-content", proxy.uri()]).stdout)
    offered = contexts["exports"][0]["contexts"]
    assert offered == ["base:allocation", *bitmaps[:31]], offered
    assert _map(proxy.uri(), "qemu:dirty-bitmap:7").split() == [
        "0", str(16 * MiB), "1", "dirty"]
    log = proxy.log()
    assert "left_out=10" in log and "META_CONTEXTS_MAX" in log, log


@pytest.mark.zcnbd_only(reason="the upstream's bitmap is one zcnbd tracks (-B on memory)")
def test_a_zcnbd_upstreams_tracked_bitmap_records_writes_through_the_proxy(servers, proxies):
    upstream = servers(Export(kind="memory"), extra_args=["-B", "b0"])
    proxy = proxies(upstream.uri())
    context = "qemu:dirty-bitmap:b0"
    assert _map(proxy.uri(), context).split() == ["0", str(upstream.export.size), "0", "clean"]
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x5a 1M 64k", proxy.uri()])
    ours, theirs = _map(proxy.uri(), context), _map(upstream.uri(), context)
    assert ours == theirs and ours.split()[4:8] == [str(MiB), "65536", "1", "dirty"], ours


def _pattern(offset: int, length: int) -> bytes:
    """The scripted upstream's bytes at [offset, offset + length): each 4 KiB block its own."""
    first, last = offset // 4096, (offset + length - 1) // 4096
    whole = b"".join(bytes([b % 251 + 1]) * 4096 for b in range(first, last + 1))
    return whole[offset - first * 4096:][:length]


def _slow_reply(s, head, offset, length):
    """One data chunk whose payload comes in 64 KiB pieces, 20 ms apart."""
    s.sendall(head(1, 1, 8 + length) + struct.pack(">Q", offset))
    data = _pattern(offset, length)
    for at in range(0, length, 65536):
        s.sendall(data[at:at + 65536])
        time.sleep(0.02)


def _reversed_reply(s, head, offset, length):
    """Two data chunks, the second half first."""
    half = length // 2
    s.sendall(head(1, 0, 8 + length - half) + struct.pack(">Q", offset + half)
              + _pattern(offset + half, length - half))
    s.sendall(head(1, 1, 8 + half) + struct.pack(">Q", offset) + _pattern(offset, half))


def _cut_reply(s, head, offset, length):
    """Half the payload, then the connection closed."""
    s.sendall(head(1, 1, 8 + length) + struct.pack(">Q", offset)
              + _pattern(offset, length // 2))
    s.shutdown(socket.SHUT_RDWR)
    raise ConnectionError("cut short on purpose")


@pytest.mark.parametrize("reply", [_slow_reply, _reversed_reply])
def test_a_spliced_read_whose_upstream_dawdles_or_reorders_gets_its_bytes(
        reply, proxies, data_dir):
    """With --splice-min-bytes, an upstream that sends a read's payload slowly, or its chunks
    out of order: the client gets the bytes in order (what the pipe did not take follows it
    from memory), and a second connection is served meanwhile."""
    sock = data_dir / "hostile.sock"
    upstream = _ListingUpstream(sock, [], read_reply=reply)
    try:
        port = free_tcp_port()
        proxy = proxies(f"nbd+unix:///?socket={sock}", "--splice-min-bytes", "64K",
                        "--metrics", f"127.0.0.1:{port}")
        with handle(proxy.uri()) as h, handle(proxy.uri()) as other:
            for offset in (0, 3 * MiB + 4096):
                assert h.pread(MiB, offset) == _pattern(offset, MiB)
            assert other.pread(65536, 5 * MiB) == _pattern(5 * MiB, 65536)
            c = settled_metrics(port, replies=3)
        assert c["upstream_spliced_bytes"] + c["copied_bytes"] == c["read_bytes"], c
        if reply is _slow_reply and _piped_reads_expected():
            # Every piece came in order: spliced as it came.
            assert c["upstream_spliced_bytes"] >= 2 * MiB, c
    finally:
        upstream.close()


def test_a_spliced_read_cut_short_by_the_upstream_fails_and_the_proxy_goes_on(
        proxies, data_dir):
    """An upstream that sends half a spliced read's payload and hangs up: the read fails with
    EIO (no reconnection asked for), soon - never a hang, never half the bytes as data - and
    the proxy still answers."""
    sock = data_dir / "hostile.sock"
    upstream = _ListingUpstream(sock, [], read_reply=_cut_reply)
    try:
        proxy = proxies(f"nbd+unix:///?socket={sock}", "--splice-min-bytes", "64K",
                        "--reconnect-timeout", "0")
        with handle(proxy.uri()) as h:
            started = time.monotonic()
            expect_nbd_error(errno.EIO, lambda: h.pread(MiB, 0))
            assert time.monotonic() - started < 10
        assert proxy.running()
        with handle(proxy.uri()) as h:
            assert h.get_size() == _ListingUpstream.SIZE
    finally:
        upstream.close()


# Other servers as upstreams over TCP, plain and with TLS required (X.509 from the suite's
# test CA): nbdkit's file plugin, qemu-nbd and nbd-server (from its configuration file), each
# serving a raw file. The proxy connects with nbd:// or nbds:// and a client's certificate;
# what qemu-io writes through the proxy is then in the upstream's file, byte for byte.


def _listening(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() not in (None, 0):
            raise AssertionError(f"{what} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{what} did not listen on port {port}")


@pytest.fixture(scope="module")
def upstream_creds(tmp_path_factory):
    require_tools("certtool", "psktool")
    return tls_creds.make(tmp_path_factory.mktemp("upstream-tls"))


@pytest.fixture
def tcp_peer():
    """Factory: tcp_peer(kind, path, creds=None) -> the URI of nbdkit, qemu-nbd or nbd-server
    serving the raw file `path` (64 MiB, made here) on a TCP port of 127.0.0.1, requiring TLS
    with the test CA's server certificate when `creds` are given (the URI then names the
    client's certificates)."""
    procs, daemons = [], []

    def start(kind, path: Path, creds=None):
        path.write_bytes(b"")
        os.truncate(path, 64 * MiB)
        port = free_tcp_port()
        name = ""
        if kind == "nbdkit":
            require_tools("nbdkit")
            argv = ["nbdkit", "-f", "--exit-with-parent", "-i", "127.0.0.1", "-p", str(port)]
            if creds:
                argv += ["--tls=require", f"--tls-certificates={creds.server}"]
            argv += ["file", str(path)]
        elif kind == "qemu-nbd":
            require_tools("qemu-nbd")
            argv = ["qemu-nbd", "-f", "raw", "-b", "127.0.0.1", "-p", str(port), "-t",
                    "-e", "4"]
            if creds:
                argv += ["--object", f"tls-creds-x509,id=tls0,endpoint=server,dir={creds.server}",
                         "--tls-creds", "tls0"]
            argv.append(str(path))
        else:
            require_tools("nbd-server")
            name = "disk"
            conf = path.parent / f"nbd-server-{port}.conf"
            lines = ["[generic]", "listenaddr = 127.0.0.1", f"port = {port}"]
            if creds:
                lines += ["force_tls = true", f"certfile = {creds.server}/server-cert.pem",
                          f"keyfile = {creds.server}/server-key.pem",
                          f"cacertfile = {creds.server}/ca-cert.pem"]
            lines += [f"[{name}]", f"exportname = {path}"]
            conf.write_text("\n".join(lines) + "\n")
            pidfile = path.parent / f"nbd-server-{port}.pid"
            # It forks into the background (the parent exits 0) and serves each client in a
            # child of its own.
            argv = ["nbd-server", "-C", str(conf), "-p", str(pidfile)]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        procs.append(p)
        _listening(port, p, kind)
        if kind == "nbd-server":
            daemons.append(int(pidfile.read_text().split()[0]))
        if creds:
            return f"nbds://localhost:{port}/{name}?tls-certificates={creds.client}"
        return f"nbd://127.0.0.1:{port}/{name}"

    yield start
    for pid in daemons:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for p in procs:
        if p.poll() is None:
            p.terminate()
        p.wait(timeout=10)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("kind", ["nbdkit", "qemu-nbd", "nbd-server"])
def test_other_servers_as_upstreams_plain_and_tls(kind, tls, tcp_peer, upstream_creds, proxies,
                                                  data_dir):
    path = data_dir / f"{kind}.raw"
    upstream = tcp_peer(kind, path, upstream_creds if tls else None)
    proxy = proxies(upstream, "--upstream-connections", "2")
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x5a 1M 3M", "-c", "write -P 0xa5 60M 1536K",
         "-c", "write -z 8M 1M", proxy.uri()])
    run(["qemu-io", "-f", "raw", "-r", "-c", "read -P 0x5a 1M 3M", "-c", "read -P 0 8M 1M",
         proxy.uri()])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", proxy.uri(), str(path)])
    data = path.read_bytes()
    assert data[MiB:4 * MiB] == b"\x5a" * (3 * MiB)
    assert data[60 * MiB:60 * MiB + 1536 * 1024] == b"\xa5" * (1536 * 1024)
    if tls:
        # The upstream refuses a client without TLS: the proxy's connection was TLS.
        plain = upstream.split("?", 1)[0].replace("nbds://localhost", "nbd://127.0.0.1")
        refused = run(["qemu-io", "-f", "raw", "-r", "-c", "read 0 4k", plain], check=False)
        assert refused.returncode != 0, refused.stdout


@pytest.mark.parametrize("upstream_kind,extra", [
    ("zcnbd", []),
    ("zcnbd", ["--splice-min-bytes", "64K"]),
    ("qemu-nbd", []),
], ids=["zcnbd", "zcnbd-spliced", "qemu-nbd"])
def test_fio_verifies_what_it_wrote_through_the_proxy(upstream_kind, extra, servers, peer,
                                                      proxies, data_dir):
    """fio's crc32c verification (random mixed I/O at queue depth 16, 4 KiB and 64 KiB)
    through the proxy to a writable upstream: a zcnbd memory export (also with every read of
    64 KiB or more spliced from the upstream's socket) or qemu-nbd on a raw file."""
    from test_fio import VERIFIED_RANDRW, fio, totals

    require_tools("fio")
    if run(["fio", "--enghelp=nbd"], check=False).returncode != 0:
        missing("fio was built without the nbd ioengine")
    if upstream_kind == "zcnbd":
        upstream = servers(Export(kind="memory")).uri()
    else:
        upstream = peer("qemu-nbd", data_dir / "upstream.raw")
    proxy = proxies(upstream, "--upstream-connections", "2", *extra)
    for bs in ("4k", "64k"):
        _, result = fio(proxy.uri(), data_dir, f"--bs={bs}", *VERIFIED_RANDRW)
        errors, read, written = totals(result)
        assert errors == 0 and written > 0 and read >= written, (errors, read, written)
