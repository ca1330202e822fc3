"""zcnbd in front of a real web server: nginx from Debian's packages (scripts/install-deps.sh)
serving a disk image file over HTTP and over HTTPS with a certificate from a test CA. Every
read is compared with the file (nbdcopy and `qemu-img compare`); the filters that matter for a
remote disk are checked on nginx's own access log: the cache filter's second pass asks nginx
for nothing, readahead asks it for fewer, larger ranges, and retry rides out nginx stopped and
started again in the middle of a read. nginx closes a keep-alive connection after a few
requests here (`keepalive_requests`), so the client's connections are replaced all along."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import nbdproto as P
from nbdproto import RawClient
from support import (MiB, ZCNBD_BIN, ZCNBD_SERVE_ARGS, free_tcp_port, handle, require_tools, run,
                     serve_configuration, settled_metrics)
from test_http import _make_ca

pytestmark = pytest.mark.zcnbd_only("the HTTP source is zcnbd's")

KiB = 1024
DISK_BYTES = 16 * MiB
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


class Nginx:
    """nginx (one process, in the foreground) serving `root` on a loopback port, logging
    each request's method, range and status to `access.log`."""

    def __init__(self, root: Path, work: Path, tls: tuple[Path, Path] | None = None,
                 host: str = "127.0.0.1", netns: str | None = None):
        self.root, self.work, self.tls = root, work, tls
        self.host, self.netns = host, netns
        self.port = free_tcp_port()
        self.log = work / "access.log"
        self.proc: subprocess.Popen | None = None

    def conf(self) -> Path:
        w = self.work
        listen = f"{self.host}:{self.port}" + (" ssl" if self.tls else "")
        tls = ""
        if self.tls:
            cert, key = self.tls
            tls = f"ssl_certificate {cert}; ssl_certificate_key {key};"
        text = f"""
daemon off;
master_process off;
pid {w}/nginx.pid;
error_log {w}/error.log;
events {{ worker_connections 256; }}
http {{
    log_format ranges '$request_method $http_range $status';
    access_log {self.log} ranges;
    client_body_temp_path {w}/body; proxy_temp_path {w}/proxy;
    fastcgi_temp_path {w}/fastcgi; uwsgi_temp_path {w}/uwsgi; scgi_temp_path {w}/scgi;
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 20;
    server {{ listen {listen}; server_name localhost; root {self.root}; {tls} }}
}}
"""
        path = w / "nginx.conf"
        path.write_text(text)
        return path

    def start(self) -> "Nginx":
        conf = self.conf()
        argv = [NGINX, "-e", str(self.work / "error.log"), "-c", str(conf)]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            assert self.proc.poll() is None, f"nginx exited: {self.proc.stderr.read()}"
            try:
                with socket_to(self.port, self.host):
                    return self
            except OSError:
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.02)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)

    def url(self, host: str | None = None) -> str:
        return f"{'https' if self.tls else 'http'}://{host or self.host}:{self.port}/disk.img"

    def gets(self) -> list[str]:
        """The GET requests logged so far: their Range headers."""
        if not self.log.exists():
            return []
        return [line.split()[1] for line in self.log.read_text().splitlines()
                if line.startswith("GET ")]


def socket_to(port: int, host: str = "127.0.0.1"):
    import socket
    return socket.create_connection((host, port), timeout=1)


@pytest.fixture
def web(data_dir):
    """Factory: web(tls=None) -> a started Nginx serving data_dir/www/disk.img (random
    bytes); stopped at teardown."""
    require_tools(NGINX)
    www = data_dir / "www"
    www.mkdir()
    (www / "disk.img").write_bytes(random.Random(41).randbytes(DISK_BYTES))
    started = []

    def start(tls=None, host="127.0.0.1", netns=None) -> Nginx:
        work = Path(tempfile.mkdtemp(prefix="nginx-", dir=data_dir))
        server = Nginx(www, work, tls, host, netns).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@contextlib.contextmanager
def zcnbd(tmp_path: Path, url: str, *args: str):
    """zcnbd serving `url` on a Unix socket; its URI."""
    sock = tmp_path / f"z-{time.monotonic_ns()}.sock"
    argv = [str(ZCNBD_BIN), "serve", "-s", str(sock), *ZCNBD_SERVE_ARGS, url, *args]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not sock.exists():
            assert p.poll() is None, f"zcnbd exited: {p.stderr.read()}"
            assert time.monotonic() < deadline, "zcnbd did not start"
            time.sleep(0.02)
        yield f"nbd+unix:///?socket={sock}"
    finally:
        p.terminate()
        assert p.wait(timeout=10) == 0


def disk_of(web_server: Nginx) -> bytes:
    return (web_server.root / "disk.img").read_bytes()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_reads_equal_the_file_nginx_serves(web, data_dir, scheme):
    require_tools("nbdcopy", "qemu-img")
    extra: list[str] = []
    if scheme == "https":
        ca, cert, key = _make_ca(data_dir)
        server = web(tls=(cert, key))
        extra = ["--http-cafile", str(ca)]
    else:
        server = web()
    data = disk_of(server)
    with zcnbd(data_dir, server.url("localhost"), "--http-connections", "4", *extra) as uri:
        copy = data_dir / "copy.img"
        run(["nbdcopy", "--connections=4", uri, str(copy)])
        assert copy.read_bytes() == data
        run(["qemu-img", "compare", "-f", "raw", "-F", "raw",
             str(server.root / "disk.img"), uri])
        rng = random.Random(2)
        with handle(uri) as h:
            for _ in range(100):
                length = rng.choice([1, 4096, 65536, MiB])
                offset = rng.randrange(0, DISK_BYTES - length + 1)
                assert h.pread(length, offset) == data[offset:offset + length]
    gets = server.gets()
    assert gets and all(r.startswith("bytes=") for r in gets), gets[:5]


def test_cache_second_pass_asks_nginx_for_nothing(web, data_dir):
    server = web()
    data = disk_of(server)
    cache_dir = data_dir / "cache"
    cache_dir.mkdir()
    with zcnbd(data_dir, server.url(), "--filter", "cache:cache-on-read=yes",
               "--cache-dir", str(cache_dir)) as uri, handle(uri) as h:
        first = b"".join(h.pread(MiB, at) for at in range(0, DISK_BYTES, MiB))
        asked = len(server.gets())
        assert first == data and asked >= DISK_BYTES // MiB, asked
        second = b"".join(h.pread(64 * KiB, at) for at in range(0, DISK_BYTES, 64 * KiB))
        assert second == data
        assert len(server.gets()) == asked, server.gets()[asked:][:5]


def test_readahead_asks_nginx_fewer_larger_ranges(web, data_dir):
    server = web()
    data = disk_of(server)
    with zcnbd(data_dir, server.url(), "--filter", "readahead:max=1M") as uri, handle(uri) as h:
        got = b"".join(h.pread(32 * KiB, at) for at in range(0, 4 * MiB, 32 * KiB))
    assert got == data[:4 * MiB]
    # 128 reads of 32 KiB; windows growing to 1 MiB: a handful of ranges.
    asked = server.gets()
    assert 4 <= len(asked) <= 20, asked


def test_retry_rides_out_nginx_stopped_and_started_mid_read(web, data_dir):
    server = web()
    data = disk_of(server)
    with zcnbd(data_dir, server.url(), "--filter", "retry:retries=10,retry-delay=100ms",
               "--http-timeout", "2s") as uri, handle(uri) as h:
        assert h.pread(MiB, 0) == data[:MiB]
        server.stop()
        restart = threading.Timer(0.7, server.start)
        restart.start()
        started = time.monotonic()
        assert h.pread(MiB, 5 * MiB) == data[5 * MiB:6 * MiB]
        assert time.monotonic() - started >= 0.5
        assert h.pread(4 * MiB, 8 * MiB) == data[8 * MiB:12 * MiB]
        # The reads may finish while the restart still waits to see nginx listening: it
        # must be done before the fixture stops nginx (a CI run caught the thread's
        # assertion that nginx had exited).
        restart.join()


def test_plain_http_bodies_go_socket_to_socket_on_the_ring(web, data_dir):
    """On the io_uring engine (not the copy baseline), a plain-HTTP source's bodies are
    spliced from nginx's socket into a pipe and from the pipe to the client: the counters
    say so, and the bytes are the file's. Elsewhere they go through a buffer."""
    server = web()
    data = disk_of(server)
    port = free_tcp_port()
    with zcnbd(data_dir, server.url(), "--metrics", f"127.0.0.1:{port}") as uri, handle(uri) as h:
        for i in range(8):
            assert h.pread(MiB, i * MiB) == data[i * MiB:(i + 1) * MiB]
        assert h.pread(4096, 5 * MiB + 7) == data[5 * MiB + 7:5 * MiB + 7 + 4096]
        c = settled_metrics(port, replies=9)
    read = 8 * MiB + 4096
    assert c["read_bytes"] == read, c
    args = ZCNBD_SERVE_ARGS
    engine = args[args.index("--engine") + 1] if "--engine" in args else "uring"
    data_path = args[args.index("--data-path") + 1] if "--data-path" in args else "auto"
    if engine == "uring" and data_path != "copy":
        # What came with a response's head is copied into the pipe; what a full pipe left
        # over (its tail) is copied and sent plainly after it.
        assert c["sent_splice_bytes"] + c["sent_plain_bytes"] == read, c
        assert c["sent_plain_bytes"] <= c["copied_bytes"], c
        assert c["upstream_spliced_bytes"] + c["copied_bytes"] == read, c
        assert c["upstream_spliced_bytes"] >= read * 8 // 10, c
    else:
        assert c["upstream_spliced_bytes"] == 0 and c["sent_splice_bytes"] == 0, c


@contextlib.contextmanager
def small_segments(mtu: int):
    """A network namespace behind a veth pair of this MTU whose namespace end sends TCP
    segments no larger than an Ethernet frame's (`gso_max_size 1500`), as a web server on
    another host's arrive (one buffer each): its name and address."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    tag = os.getpid() % 100000
    name, host_if, ns_if = f"zcnbd-web-{os.getpid()}", f"zw{tag}h", f"zw{tag}n"
    host_ip, ns_ip = "10.213.78.1", "10.213.78.2"

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)
    ip("netns", "add", name)
    try:
        ip("link", "add", host_if, "mtu", str(mtu), "type", "veth", "peer", "name", ns_if,
           "mtu", str(mtu))
        ip("link", "set", ns_if, "netns", name)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", name, "link", "set", ns_if, "gso_max_size", "1500")
        ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        ip("-n", name, "link", "set", ns_if, "up")
        yield name, ns_ip
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)


@pytest.mark.parametrize("mtu", [1500, 576])
def test_bodies_in_small_segments_go_on_into_more_pipes(web, data_dir, mtu):
    """A web server on another host sends its body in segments of a network frame, and a
    pipe holds one segment (or part of one) per buffer: a pipe of 1 MiB (256 buffers) takes
    about a third of a 1 MiB body in Ethernet's 1500-byte frames. The body goes on into up
    to MORE_PIPES_MAX more pipes, and only what they cannot take is read into a buffer and
    sent after them (docs/guides/http.md). Each read is the file's, every byte counted once.
    Since the body is waited for with a receive low-water mark, 576-byte frames queue and
    coalesce into fewer buffers before they are spliced: most of the time nothing is left
    for the buffer, never half."""
    engine, data_path = serve_configuration()
    if engine != "uring" or data_path == "copy":
        pytest.skip("bodies are spliced on the io_uring engine's data paths only")
    with small_segments(mtu) as (netns, ns_ip):
        server = web(host=ns_ip, netns=netns)
        data = disk_of(server)
        port = free_tcp_port()
        with zcnbd(data_dir, server.url(), "--metrics", f"127.0.0.1:{port}") as uri, \
                handle(uri) as h:
            for i in (0, 3, 1, 2):
                assert h.pread(MiB, i * MiB + 100) == data[i * MiB + 100:(i + 1) * MiB + 100]
            c = settled_metrics(port, replies=4)
        server.stop()
    read = 4 * MiB
    print("SEG", mtu, c["upstream_spliced_bytes"], c["copied_bytes"])
    assert c["read_bytes"] == read, c
    assert c["upstream_spliced_bytes"] + c["copied_bytes"] == read, c
    assert c["sent_splice_bytes"] + c["sent_plain_bytes"] == read, c
    assert c["sent_splice_bytes"] >= c["upstream_spliced_bytes"], c
    if mtu == 1500:
        assert c["upstream_spliced_bytes"] == read, c
    else:
        assert c["copied_bytes"] < read // 2, c


def read_slowly(client: RawClient, n: int) -> bytes:
    """`n` bytes in 32 KiB pieces, 2 ms apart: the server's socket fills again and again."""
    got = bytearray()
    while len(got) < n:
        got += client.recv_exact(min(32 * KiB, n - len(got)))
        time.sleep(0.002)
    return bytes(got)


@pytest.mark.parametrize("layers", [[], ["--filter", "cache:cache-on-read=yes",
                                         "--splice-min-bytes", "64K"]],
                         ids=["piped", "cache-held"])
def test_a_slow_reader_of_spliced_replies_gets_every_byte(web, data_dir, layers):
    """Eight 1 MiB reads pipelined by a client that then reads its replies slowly, from the
    source's pipes (plain HTTP) or from the cache file's held blocks (read once before,
    spliced from 64 KiB). On the io_uring engine a piped source's socket is nonblocking and
    the ring thread splices each pipe on to it itself, resuming on a writability poll when
    it is full; the cache's blocks go by io_uring's splice. Every byte arrives once, in
    order, and another client is served meanwhile."""
    server = web()
    data = disk_of(server)
    extra = list(layers)
    if layers:
        cache_dir = data_dir / "cache"
        cache_dir.mkdir()
        extra += ["--cache-dir", str(cache_dir)]
    with zcnbd(data_dir, server.url(), *extra) as uri:
        if layers:
            with handle(uri) as h:
                assert h.pread(DISK_BYTES, 0) == data
        client = RawClient.connect(uri.split("socket=", 1)[1], timeout=10)
        with client:
            client.handshake()
            client.export = client.go("")
            offsets = {}
            for i in range(8):
                offset = (i * 5 + 3) * MiB % (DISK_BYTES - MiB) + i * 4096
                offsets[client.send_request(P.CMD_READ, offset=offset, length=MiB)] = offset
            time.sleep(0.3)
            with handle(uri) as other:
                assert other.pread(4096, 12345) == data[12345:12345 + 4096]
            for _ in range(len(offsets)):
                header = client.recv_exact(16)
                magic, error, cookie = struct.unpack(">IIQ", header)
                assert magic == P.SIMPLE_REPLY_MAGIC and error == 0, (magic, error)
                offset = offsets.pop(cookie)
                assert read_slowly(client, MiB) == data[offset:offset + MiB], offset
