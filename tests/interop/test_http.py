"""zcnbd serving a file that lives on a web server (`zcnbd serve http://...`, `https://...`:
nbdkit's curl plugin). The web server is Python's ThreadingHTTPServer with a handler that
answers `Range` requests (SimpleHTTPRequestHandler does not); nbdkit's curl plugin on the same
URL is the oracle. Reads are compared with the file and with nbdkit's, writes are refused (and
taken by an overlay with --snapshot), a server that ignores Range is refused at start, HTTPS is
verified with a CA made here by openssl, --http-header reaches the server without ever
reaching the log, even at trace level, and a server that answers some reads badly (short,
another range, longer, chunked junk, a stall, a redirect loop) fails those reads only."""

from __future__ import annotations

import errno
import http.server
import os
import random
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path

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
)

pytestmark = pytest.mark.zcnbd_only("the HTTP source is zcnbd's")

DISK_BYTES = 8 * MiB
TOKEN = "Bearer tok-5f1d2c9a-secret"
QUERY_SECRET = "sig-83e0b7-secret"


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves the server's `path` at any URL: HEAD, and GET with one `bytes=A-B` range
    (or the whole file when the server's `ranges` is off), keep-alive."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _allowed(self) -> bool:
        self.server.seen.append(dict(self.headers))
        token = self.server.token
        if token is not None and self.headers.get("Authorization") != token:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return False
        return True

    def do_HEAD(self):
        if self._allowed():
            self.send_response(200)
            self.send_header("Content-Length", str(self.server.path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes" if self.server.ranges else "none")
            self.end_headers()

    def do_GET(self):
        if not self._allowed():
            return
        size = self.server.path.stat().st_size
        asked = self.headers.get("Range", "")
        if not (self.server.ranges and asked.startswith("bytes=")):
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(self.server.path.read_bytes())
            return
        first, last = asked[len("bytes="):].split("-")
        first, last = int(first), min(int(last or size - 1), size - 1)
        with open(self.server.path, "rb") as f:
            f.seek(first)
            body = f.read(last - first + 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# Where HostileHandler misbehaves: GETs whose range starts in these bytes.
HOSTILE_AT, HOSTILE_LEN = 4 * MiB, MiB


class HostileHandler(RangeHandler):
    """RangeHandler, but a GET whose range starts in [HOSTILE_AT, +HOSTILE_LEN) gets the
    server's `hostile` answer: a short body then a hang-up, another range than asked, a body
    longer than asked, chunked junk, a stall, or a redirect to itself."""

    def do_GET(self):
        asked = self.headers.get("Range", "")
        first = int(asked[len("bytes="):].split("-")[0]) if asked.startswith("bytes=") else 0
        if not HOSTILE_AT <= first < HOSTILE_AT + HOSTILE_LEN:
            return super().do_GET()
        first, last = (int(v) for v in asked[len("bytes="):].split("-"))
        size = self.server.path.stat().st_size
        body = self.server.path.read_bytes()[first:last + 1]
        how = self.server.hostile
        if how == "redirect-loop":
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206)
        if how == "chunked":
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"zz\r\nnot a chunk\r\n")
        elif how == "wrong-range":
            self.send_header("Content-Range", f"bytes {first + 512}-{last + 512}/{size}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        elif how == "long":
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(len(body) + 100))
            self.end_headers()
            self.wfile.write(body + b"x" * 100)
            return
        else:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if how == "stall":
                self.wfile.flush()
                time.sleep(3)
            self.wfile.write(body[:len(body) // 2])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


class WebServer:
    def __init__(self, path: Path, *, ranges=True, token=None, tls: ssl.SSLContext | None = None,
                 hostile: str | None = None):
        handler = HostileHandler if hostile else RangeHandler
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.hostile = hostile
        self.httpd.daemon_threads = True
        self.httpd.path, self.httpd.ranges, self.httpd.token = path, ranges, token
        self.httpd.seen = []
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.scheme = "https" if tls else "http"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, host="127.0.0.1", path="/disk.img") -> str:
        return f"{self.scheme}://{host}:{self.httpd.server_address[1]}{path}"

    @property
    def seen(self) -> list[dict]:
        return self.httpd.seen

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def disk(data_dir) -> Path:
    path = data_dir / "disk.img"
    path.write_bytes(random.Random(37).randbytes(DISK_BYTES))
    return path


@pytest.fixture
def web():
    """Factory: web(path, ranges=, token=, tls=) -> a WebServer, stopped at teardown."""
    started = []

    def start(path, **kw):
        server = WebServer(path, **kw)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def zcnbd_http():
    """Factory: zcnbd_http(url, *extra, env=None) -> a zcnbd serving the URL on a Unix socket."""
    started = []

    def start(url, *extra, env=None):
        workdir = Path(tempfile.mkdtemp(prefix="zcnbd-http-"))
        sock = workdir / "nbd.sock"
        argv = [str(ZCNBD_BIN), "serve", "-s", str(sock), *ZCNBD_SERVE_ARGS, url, *extra]
        server = Server(argv, workdir, [Export(kind="memory")], socket_path=sock)
        server.extra_cleanup.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
        started.append(server)
        if env is None:
            return server.start()
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            return server.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    yield start
    for s in started:
        if s.running():
            s.stop()
        s.cleanup()


def refused_at_start(url, *extra) -> str:
    """Runs zcnbd serve on `url`, which must refuse to start; its output."""
    argv = [str(ZCNBD_BIN), "serve", "-s", "/nonexistent/never.sock", *ZCNBD_SERVE_ARGS, url,
            *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0, f"started: {done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def test_reads_match_the_file_and_nbdkits_curl_plugin(web, zcnbd_http, disk, data_dir):
    require_tools("nbdcopy", "nbdkit")
    server = web(disk)
    proxy = zcnbd_http(server.url(), "--http-connections", "3")
    copy = data_dir / "copy.img"
    run(["nbdcopy", "--connections=4", proxy.uri(), str(copy)])
    assert copy.read_bytes() == disk.read_bytes()
    oracle = data_dir / "nbdkit.img"
    run(["nbdkit", "-f", "--exit-with-parent", "-U", "-", "curl", f"url={server.url()}",
         "--run", f"nbdcopy \"$uri\" {oracle}"])
    assert oracle.read_bytes() == copy.read_bytes()
    data = disk.read_bytes()
    rng = random.Random(1)
    with handle(proxy.uri()) as h:
        assert h.get_size() == DISK_BYTES
        for _ in range(200):
            length = rng.choice([1, 511, 4096, 65536, 1 * MiB])
            offset = rng.randrange(0, DISK_BYTES - length + 1)
            assert h.pread(length, offset) == data[offset:offset + length], (offset, length)


def test_writes_are_refused_and_snapshot_takes_them(web, zcnbd_http, disk):
    server = web(disk)
    proxy = zcnbd_http(server.url())
    with handle(proxy.uri()) as h:
        assert h.is_read_only()
        expect_nbd_error(errno.EPERM, h.pwrite, b"x" * 512, 0)
    proxy.stop()
    overlay = zcnbd_http(server.url(), "--snapshot")
    with handle(overlay.uri()) as h:
        assert not h.is_read_only()
        h.pwrite(b"\x77" * 65536, MiB)
        assert h.pread(65536, MiB) == b"\x77" * 65536
        assert h.pread(4096, 0) == disk.read_bytes()[:4096]
    assert disk.read_bytes()[MiB:MiB + 65536] != b"\x77" * 65536


def test_a_server_that_ignores_range_is_refused_at_start(web, disk):
    server = web(disk, ranges=False)
    out = refused_at_start(server.url())
    assert "ignores Range" in out, out
    assert len(out.strip().splitlines()) <= 3, out


def test_check_probes_the_server(web, disk):
    server = web(disk)
    done = run([str(ZCNBD_BIN), "serve", "--check", server.url()])
    assert f"{DISK_BYTES} bytes" in done.stdout, done.stdout


def _make_ca(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signs for localhost and 127.0.0.1: (ca, cert, key)."""
    require_tools("openssl")
    ca_key, ca, key, csr, cert = (directory / n for n in
                                  ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(["openssl", "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", "/CN=zcnbd test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
    run(["openssl", "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost"])
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)])
    return ca, cert, key


def test_https_is_verified_with_the_ca_file(web, zcnbd_http, disk, data_dir):
    ca, cert, key = _make_ca(data_dir)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = web(disk, tls=context)
    for host in ("localhost", "127.0.0.1"):
        proxy = zcnbd_http(server.url(host), "--http-cafile", str(ca))
        with handle(proxy.uri()) as h:
            assert h.pread(MiB, 3 * MiB) == disk.read_bytes()[3 * MiB:4 * MiB]
        proxy.stop()
    out = refused_at_start(server.url())
    assert "certificate" in out, out
    insecure = zcnbd_http(server.url(), "--http-insecure")
    with handle(insecure.uri()) as h:
        assert h.pread(4096, DISK_BYTES - 4096) == disk.read_bytes()[-4096:]


def test_headers_reach_the_server_and_never_the_log(web, zcnbd_http, disk):
    server = web(disk, token=TOKEN)
    url = server.url(path=f"/disk.img?X-Amz-Signature={QUERY_SECRET}")
    out = refused_at_start(url)
    assert "401" in out and QUERY_SECRET not in out, out
    server.seen.clear()
    proxy = zcnbd_http(url, "-vv", "--http-header", f"Authorization: {TOKEN}",
                       "--http-header", "X-Other: value-2", env={"RUST_LOG": "trace"})
    with handle(proxy.uri()) as h:
        assert h.pread(65536, 0) == disk.read_bytes()[:65536]
    assert server.seen and all(s.get("Authorization") == TOKEN for s in server.seen)
    proxy.stop()
    log = proxy.log()
    assert "2 header(s)" in log or "headers=2" in log, log
    for secret in (TOKEN, "tok-5f1d2c9a", "value-2", QUERY_SECRET):
        assert secret not in log, f"{secret!r} in the log:\n{log}"
    check = run([str(ZCNBD_BIN), "serve", "-vv", "--check", "--http-header",
                 f"Authorization: {TOKEN}", url])
    assert "tok-5f1d2c9a" not in check.stdout + check.stderr
    assert QUERY_SECRET not in check.stdout + check.stderr


def test_a_config_file_serves_urls_with_their_keys(web, zcnbd_http, disk, data_dir):
    server = web(disk, token=TOKEN)
    config = data_dir / "web.toml"
    config.write_text(
        '[[export]]\nname = "web"\n'
        f'url = "{server.url()}"\n'
        f'http_headers = ["Authorization: {TOKEN}"]\n'
        'http_connections = 2\nhttp_timeout = "10s"\n'
        '[[export]]\nname = "web-rw"\n'
        f'url = "{server.url()}"\n'
        f'http_headers = ["Authorization: {TOKEN}"]\nsnapshot = true\n'
    )
    proxy = zcnbd_http("--config", str(config))
    with handle(proxy.uri("web")) as h:
        assert h.is_read_only()
        assert h.pread(MiB, 5 * MiB) == disk.read_bytes()[5 * MiB:6 * MiB]
    with handle(proxy.uri("web-rw")) as h:
        h.pwrite(b"\x55" * 4096, 0)
        assert h.pread(4096, 0) == b"\x55" * 4096
    proxy.stop()
    assert "tok-5f1d2c9a" not in proxy.log()


@pytest.mark.parametrize("how,says", [
    ("short", "short body"),
    ("wrong-range", "not the 4198400-4263935 asked"),
    ("long", "a body of 65636 bytes for a range of 65536"),
    ("chunked", "chunked"),
    ("stall", "--http-timeout"),
    ("redirect-loop", "REDIRECTS_MAX"),
])
def test_a_hostile_web_server_fails_that_read_only(web, zcnbd_http, disk, how, says):
    """A web server that answers reads of one range badly (a short body and a hang-up,
    another range, a longer body, chunked junk, a stall past --http-timeout, a redirect to
    itself): those reads get EIO within the timeout, each logged once with the reason; the
    rest of the disk reads as the file before and after, and zcnbd keeps serving."""
    server = web(disk, hostile=how)
    data = disk.read_bytes()
    proxy = zcnbd_http(server.url(), "--http-timeout", "1s")
    with handle(proxy.uri()) as h:
        assert h.pread(MiB, 0) == data[:MiB]
        started = time.monotonic()
        expect_nbd_error(errno.EIO, h.pread, 64 * 1024, HOSTILE_AT + 4096)
        assert time.monotonic() - started < 10
        assert h.pread(MiB, 6 * MiB) == data[6 * MiB:7 * MiB]
        assert h.pread(4096, HOSTILE_AT - 4096) == data[HOSTILE_AT - 4096:HOSTILE_AT]
    failures = [line for line in proxy.log().splitlines() if "HTTP read failed" in line]
    assert len(failures) == 1 and says in failures[0], failures
