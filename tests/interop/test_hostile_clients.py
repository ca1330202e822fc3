"""Hostile and careless clients: none may stall, lock out or slow another.

Clients that stop reading their replies, connections that never finish (or
start) the handshake, clients that go quiet, and more clients than an export
or the server allows.  Each limit is named in the server's log when it bites.
These run against every engine and data path the suite is run with."""

from __future__ import annotations

import socket
import statistics
import struct
import time

import pytest

import nbdproto as P
from nbdproto import RawClient, connect_and_go
from support import KiB, MiB, Export, free_tcp_port, pattern, scrape_metrics, serve_configuration

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's limits and log lines")


def stalled_reader(address, reads: int, length: int) -> RawClient:
    """A client that asks for `reads` reads of `length` bytes and never reads
    the replies (a tiny receive buffer, so the server's sends block at once).
    Simple replies: every reply carries its data, holes or not."""
    sock = socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(address)
    client = RawClient(sock)
    client.handshake()
    client.export = client.go("")
    for i in range(reads):
        client.send_request(P.CMD_READ, offset=(i * length) % (32 * MiB), length=length)
    return client


def timed_reads(address, count: int) -> list[float]:
    """Latencies (s) of `count` 4 KiB reads by a well-behaved client."""
    latencies = []
    with connect_and_go(address) as client:
        client.write(0, pattern(4 * KiB, seed=3))
        for _ in range(count):
            start = time.monotonic()
            reply = client.read(0, 4 * KiB)
            latencies.append(time.monotonic() - start)
            assert reply.error == 0
        client.disconnect()
    return latencies


def p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100)[98]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_clients_that_stop_reading_do_not_slow_others(servers, transport):
    """Four clients with 1 MiB reads they never read (more replies than the
    worker threads); a fifth client is served with p99 under 100 ms."""
    server = servers(Export(kind="memory"), transport=transport)
    stalled = [stalled_reader(server.address, reads=32, length=1 * MiB) for _ in range(4)]
    try:
        time.sleep(0.5)  # let the server's sends block
        latencies = timed_reads(server.address, 300)
        assert p99(latencies) < 0.100, f"p99 {p99(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    finally:
        for client in stalled:
            client.close()


def server_rss(server) -> int:
    """The server's resident memory, in bytes."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_many_stalled_readers_stay_within_the_buffer_memory(servers, export_factory):
    """256 clients pipeline 200 reads of 1 MiB from a file export and never read a reply.
    Each could hold its whole budget (64 MiB, 16 GiB together) in reply buffers; the buffer
    memory of all connections is bounded instead (--buffers-max, 256 MiB here): the server's
    RSS stays under that, plus the idle buffer pool (256 MiB) and 128 MiB for everything
    else (threads, the binary, one largest payload per ring). Each connection keeps a
    reserve the stalled ones cannot take, so a well-behaved client's 4 KiB reads keep p99
    under 100 ms; the log says the limit bit. On io_uring's zerocopy data path the replies
    are spliced from the file and hold no buffer memory at all: there the limit never bites
    and the server copies no byte."""
    limit = 256 * MiB
    port = free_tcp_port()
    args = ["--buffers-max", "256M", "--connections-max", "300", "--handshakes-max", "300",
            "--metrics", f"127.0.0.1:{port}"]
    spliced = serve_configuration() == ("uring", "zerocopy")
    # TCP: a Unix socket's queue takes fewer than 200 requests a client never reads past.
    server = servers(export_factory("file"), transport="tcp", extra_args=args)
    stalled = []
    try:
        for _ in range(256):
            stalled.append(stalled_reader(server.address, reads=200, length=1 * MiB))
        if spliced:
            # Every stalled connection has had its sends block; nothing was bounced.
            time.sleep(3)
            assert "buffers-max" not in server.log()
            counters = scrape_metrics(port)
            assert counters["copied_bytes"] == 0 and counters["sent_splice_bytes"] > 0, counters
        else:
            deadline = time.monotonic() + 20
            while "buffers-max" not in server.log():
                assert time.monotonic() < deadline, "the limit never bit"
                time.sleep(0.1)
            time.sleep(1)  # every stalled connection has taken what it can
        latencies = timed_reads(server.address, 300)
        rss = server_rss(server)
        assert rss < limit + 256 * MiB + 128 * MiB, f"RSS {rss / MiB:.0f} MiB"
        assert p99(latencies) < 0.100, f"p99 {p99(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    finally:
        for client in stalled:
            client.close()


def test_write_timeout_disconnects_a_client_that_stops_reading(servers):
    server = servers(Export(kind="memory"), transport="tcp", extra_args=["--write-timeout-ms", "1000"])
    stalled = stalled_reader(server.address, reads=32, length=1 * MiB)
    try:
        deadline = time.monotonic() + 10
        while "write timeout" not in server.log():
            assert time.monotonic() < deadline, "no write timeout within 10 s"
            time.sleep(0.1)
        # The connection was reset or closed: draining it ends well before 32 MiB.
        received = 0
        stalled.sock.settimeout(5)
        try:
            while chunk := stalled.sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 32 * MiB
    finally:
        stalled.close()
    assert timed_reads(server.address, 10)  # still serving


def test_idle_handshakes_do_not_lock_out_a_client(servers):
    """More silent connections than the default connection limit (256): the
    handshake budget closes the longest-silent ones and a real client is
    served at once."""
    server = servers(Export(kind="memory"), transport="tcp")
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(server.address, timeout=5))
        start = time.monotonic()
        latencies = timed_reads(server.address, 5)
        assert time.monotonic() - start < 2, "the real client waited"
        assert len(latencies) == 5
        assert "handshake limit (64) reached" in server.log()
    finally:
        for s in idle:
            s.close()


def test_handshakes_that_trickle_are_not_the_ones_closed(servers):
    """With a budget of 4, silent connections are closed before a client that
    is slowly but steadily negotiating."""
    server = servers(Export(kind="memory"), extra_args=["--handshakes-max", "4"])
    slow = RawClient.connect(server.address)
    idle = []
    try:
        slow.handshake()
        for i in range(12):
            idle.append(RawClient.connect(server.address))
            time.sleep(0.05)
            assert slow.list_exports() == [("", "")], f"after {i + 1} idle connections"
        slow.go("")
        assert slow.read(0, 4096).error == 0
    finally:
        slow.close()
        for c in idle:
            c.close()


def test_idle_timeout(servers):
    server = servers(Export(kind="memory"), extra_args=["--idle-timeout-ms", "500"])
    with connect_and_go(server.address) as busy, connect_and_go(server.address) as quiet:
        quiet.write(0, b"q" * 512)
        for _ in range(10):  # 1.5 s of a request every 150 ms keeps `busy` attached
            assert busy.read(0, 512).error == 0
            time.sleep(0.15)
        with pytest.raises((P.Closed, ConnectionError)):
            quiet.read(0, 512)
    assert "client idle" in server.log()


def go_refused(address, name: str = "") -> P.OptionReply:
    client = RawClient.connect(address)
    client.handshake()
    _, final = client.info_or_go(P.OPT_GO, name)
    client.close()
    return final


def test_per_export_limit_shared(servers):
    """qemu-nbd's -e/--shared N: the N+1st client's GO is refused by policy
    (the reason is in the log, not in the reply), and its place frees when a
    client leaves."""
    server = servers(Export(kind="memory"), extra_args=["--shared", "2"])
    first = connect_and_go(server.address)
    second = connect_and_go(server.address)
    refused = go_refused(server.address)
    assert refused.type == P.REP_ERR_POLICY
    assert b"limit" not in refused.data
    assert "export's client limit (2) reached" in server.log()
    first.disconnect()
    first.close()
    deadline = time.monotonic() + 5
    while True:
        client = RawClient.connect(server.address)
        client.handshake()
        _, final = client.info_or_go(P.OPT_GO, "")
        if final.type == P.REP_ACK:
            break
        client.close()
        assert time.monotonic() < deadline, "the place never came back"
        time.sleep(0.05)
    assert client.read(0, 512).error == 0
    client.close()
    second.close()


def test_per_export_limit_in_config_and_server_limit(servers, data_dir):
    exports = [
        Export(kind="memory", name="one", max_connections=1),
        Export(kind="memory", name="many"),
    ]
    server = servers(exports, extra_args=["--connections-max", "3"])
    held = [connect_and_go(server.address, "one")]
    assert go_refused(server.address, "one").type == P.REP_ERR_POLICY
    held += [connect_and_go(server.address, "many") for _ in range(2)]
    assert go_refused(server.address, "many").type == P.REP_ERR_POLICY
    assert "connection limit (3) reached" in server.log()
    # NBD_OPT_EXPORT_NAME has no error reply: the refused client is closed.
    client = RawClient.connect(server.address)
    client.handshake()
    client.send_option(P.OPT_EXPORT_NAME, b"many")
    assert client.wait_closed() == b""
    client.close()
    for c in held:
        c.close()


def keepalive_timers(port: int) -> list[str]:
    """The `ss` timer fields of the server's established sockets on `port`."""
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        from support import missing

        missing("ss (iproute2) is needed to see socket timers")
    out = subprocess.run(
        ["ss", "-tno", "state", "established", f"( sport = :{port} )"],
        capture_output=True, text=True, check=True,
    ).stdout
    return [line for line in out.splitlines()[1:] if line.strip()]


@pytest.mark.parametrize("keepalive", [None, "7"], ids=["off", "7s"])
def test_keepalive(servers, keepalive):
    args = ["--keepalive", keepalive] if keepalive else []
    server = servers(Export(kind="memory"), transport="tcp", extra_args=args)
    with connect_and_go(server.address) as client:
        assert client.read(0, 512).error == 0
        # ss shows the socket's pending timer: a retransmission timer ("on") while a reply
        # waits for its ACK, then the keepalive timer if there is one.
        deadline = time.monotonic() + 5
        while True:
            lines = keepalive_timers(server.address[1])
            assert len(lines) == 1, lines
            if "timer:(on" not in lines[0] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ("keepalive" in lines[0]) == bool(keepalive), lines[0]
