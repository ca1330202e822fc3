"""The data-path counters prove which path each byte took: for the engine and data path this
run of the suite uses (ZCNBD_SERVE_ARGS), a memory export's reads and writes must be counted
under the mechanism that configuration is documented to use, with exactly the expected number
of bytes copied by the server itself."""

import os
import shlex
import shutil
import socket
import subprocess
import time

import nbd

import pytest

from support import (KiB, MiB, ZCNBD_BIN, ZCNBD_SERVE_ARGS, free_tcp_port, handle, pattern, run,
                     scrape_metrics, serve_configuration, settled_metrics)

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's own counters")

SMALL, LARGE = 4 * KiB, 1 * MiB


def test_counters_show_the_configured_path(servers, export_factory):
    port = free_tcp_port()
    server = servers(export_factory("memory"), extra_args=["--metrics", f"127.0.0.1:{port}"])
    small, large = pattern(SMALL, seed=3), pattern(LARGE, seed=4)
    with handle(server.uri()) as h:
        # The large write first: after a small write, up to 16 KiB of the next payload may
        # arrive with its header and be copied from the stage (unit-tested in the engine).
        h.pwrite(large, MiB)
        h.pwrite(small, 0)
        assert h.pread(SMALL, 0) == small
        assert h.pread(LARGE, MiB) == large
    c = scrape_metrics(port)
    moved = SMALL + LARGE
    assert c["read_bytes"] == moved and c["write_bytes"] == moved, c
    engine, data_path = serve_configuration()
    if engine == "portable":
        # Reads sent from the export's mapping, writes received into it: no copy of ours.
        assert c["copied_bytes"] == 0 and c["received_in_place_bytes"] == moved, c
        assert c["ring_enters"] == 0 and c["sent_plain_bytes"] == moved, c
        return
    assert c["ring_enters"] > 0, c
    expected = {
        # Reads straight from the mapping; writes of every size in place.
        "auto": dict(copied_bytes=0, received_in_place_bytes=moved,
                     sent_plain_bytes=moved, sent_splice_bytes=0),
        "zerocopy": dict(copied_bytes=0, received_in_place_bytes=moved,
                         sent_plain_bytes=0, sent_splice_bytes=moved),
        "copy": dict(copied_bytes=2 * moved, received_in_place_bytes=0,
                     sent_plain_bytes=moved, sent_splice_bytes=0),
    }[data_path]
    assert {k: c[k] for k in expected} == expected, (shlex.join(ZCNBD_SERVE_ARGS), c)
    # Spliced memory-export replies are sent by the ring thread itself: the header by send,
    # the data by sendfile (at least one call each); everything else goes through the ring.
    spliced_reads = 2 if data_path == "zerocopy" else 0
    assert c["syscalls"] >= 2 * spliced_reads, c
    if spliced_reads == 0:
        assert c["syscalls"] == 0, c


def test_replies_larger_than_the_socket_buffer_arrive_whole(servers, export_factory):
    """32 MiB of read replies queued while the client is not reading: the server's socket
    fills up, sends and sendfile calls stop short, and each reply resumes when the socket
    drains (on io_uring, after a writability poll). Every byte must arrive, in order, on
    every path."""
    port = free_tcp_port()
    server = servers(export_factory("memory"), transport="tcp",
                     extra_args=["--metrics", f"127.0.0.1:{port}"])
    blocks = [pattern(LARGE, seed=100 + i) for i in range(32)]
    with handle(server.uri()) as h:
        for i, block in enumerate(blocks):
            h.pwrite(block, i * LARGE)
        buffers = [nbd.Buffer(LARGE) for _ in blocks]
        cookies = [h.aio_pread(buf, i * LARGE) for i, buf in enumerate(buffers)]
        deadline = time.monotonic() + 30
        while h.aio_in_flight() > 0:
            assert time.monotonic() < deadline, "replies stopped coming"
            h.poll(1000)
        assert all(h.aio_command_completed(c) for c in cookies)
        for block, buf in zip(blocks, buffers):
            assert buf.to_bytearray() == block
    c = scrape_metrics(port)
    if serve_configuration() == ("uring", "zerocopy"):
        assert c["sent_splice_bytes"] == 32 * LARGE, c


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("limit", [None, 0, 16 * KiB, 2 * MiB])
def test_auto_receives_writes_of_every_size_in_place_unless_limited(
        servers, export_factory, transport, limit):
    """io_uring `auto`: memory-export writes of every size are received in place, on TCP
    whatever its congestion control and on Unix sockets (measured faster, with less server
    CPU, on Linux 6.18: docs/benchmarks/large-requests.md); --receive-in-place-max-bytes sends longer
    ones through a buffer."""
    if serve_configuration() != ("uring", "auto"):
        pytest.skip("the in-place limit is io_uring auto's")
    port = free_tcp_port()
    args = ["--metrics", f"127.0.0.1:{port}"]
    if limit is not None:
        args += ["--receive-in-place-max-bytes", str(limit)]
    server = servers(export_factory("memory"), transport=transport, extra_args=args)
    small, large = pattern(SMALL, seed=9), pattern(LARGE, seed=10)
    with handle(server.uri()) as h:
        # The large write first: after a small write, up to 16 KiB of the next write's
        # payload may arrive with its header and be copied from the stage (unit-tested in
        # the engine), which would blur the in-place count this test is about.
        h.pwrite(large, MiB)
        h.pwrite(small, 0)
        assert h.pread(LARGE, MiB) == large
        assert h.pread(SMALL, 0) == small
    c = scrape_metrics(port)
    in_place = sum(n for n in (SMALL, LARGE) if limit is None or n <= limit)
    assert c["received_in_place_bytes"] == in_place, c
    assert c["copied_bytes"] == SMALL + LARGE - in_place, c


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _wait_listening(host: str, port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {host}:{port}"
            time.sleep(0.05)


class _Namespace:
    """A network namespace reached over a veth pair: servers started in it see a client in
    the root namespace at another address, as a client on another host."""

    SERVER_IP, CLIENT_IP = "10.213.77.2", "10.213.77.1"

    def __init__(self):
        tag = os.getpid() % 100000
        self.name = f"zcnbd-peer-{os.getpid()}"
        self.host_if, self.ns_if = f"zp{tag}h", f"zp{tag}n"
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.CLIENT_IP}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{self.SERVER_IP}/30", "dev", self.ns_if)
            _ip("-n", self.name, "link", "set", self.ns_if, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def serve_tcp(self, *args: str) -> tuple[str, int]:
        """`zcnbd serve ARGS` listening on the namespace's address, its metrics there too, once
        it listens: (its nbd:// URI, the metrics endpoint's address for settled_metrics)."""
        ip, port, metrics = self.SERVER_IP, 10809, 9109
        proc = self.serve(*args, "-b", ip, "-p", str(port), "--metrics", f"{ip}:{metrics}")
        _wait_listening(ip, port, proc)
        return f"nbd://{ip}:{port}", metrics

    def serve(self, *args: str) -> subprocess.Popen:
        """`zcnbd serve ARGS` in the namespace (with the suite's ZCNBD_SERVE_ARGS)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.name, str(ZCNBD_BIN), "serve", *ZCNBD_SERVE_ARGS, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)


def _needs_a_namespace() -> None:
    if serve_configuration() != ("uring", "auto"):
        pytest.skip("the per-connection choice is io_uring auto's")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")


def test_auto_sends_large_memory_reads_by_sendfile_to_a_peer_on_another_host():
    """io_uring `auto`: a memory export's first reads of 256 KiB or more go by sendfile to a
    peer that is not on this host (the ring's trials start with it) - here a server in a
    network namespace, reached over a veth pair, whose peer is at another address
    (docs/benchmarks/large-requests.md measured it there) - and smaller ones from the
    mapping. test_counters_show_the_configured_path checks that a loopback peer gets no
    sendfile."""
    _needs_a_namespace()
    with _Namespace() as ns:
        uri, metrics = ns.serve_tcp("--memory", "16M")
        large, small = pattern(MiB, seed=31), pattern(64 * KiB, seed=32)
        with handle(uri) as h:
            h.pwrite(large, 0)
            h.pwrite(small, 4 * MiB)
            assert h.pread(MiB, 0) == large
            assert h.pread(64 * KiB, 4 * MiB) == small
        c = settled_metrics(metrics, 4, host=ns.SERVER_IP)
    assert c["sent_splice_bytes"] == MiB, c
    assert c["sent_plain_bytes"] == 64 * KiB, c


def test_the_ring_tries_both_ways_for_large_reads_to_a_peer_on_another_host():
    """io_uring `auto`: while a peer on another host reads 256 KiB or more at a time, the
    ring sends by sendfile for at least 30 ms and 32 MiB (after 4 MiB), then from the mapping
    as long, and keeps whichever paid (engine/uring/sendfile_trial.rs): after 256 MiB of
    1 MiB reads both ways have sent bytes, whichever this CPU favours (a pause of 10 ms
    between reads starts a trial again: the reads leave room for a few)."""
    _needs_a_namespace()
    with _Namespace() as ns:
        uri, metrics = ns.serve_tcp("--memory", "16M")
        data = pattern(16 * MiB, seed=33)
        with handle(uri) as h:
            for at in range(0, 16 * MiB, MiB):
                h.pwrite(data[at:at + MiB], at)
            for i in range(256):
                at = (i % 16) * MiB
                assert h.pread(MiB, at) == data[at:at + MiB], i
        c = settled_metrics(metrics, 16 + 256, host=ns.SERVER_IP)
    assert c["sent_splice_bytes"] >= 36 * MiB, c
    assert c["sent_plain_bytes"] > 0, c
    assert c["sent_splice_bytes"] + c["sent_plain_bytes"] == 256 * MiB, c


def test_auto_splices_large_upstream_reads_to_a_peer_on_another_host(tmp_path):
    """io_uring `auto`, an NBD proxy: an upstream's read payloads of 256 KiB or more are
    spliced from its socket to a client on another host (a network namespace, as above),
    smaller ones received into memory; test_upstream.py checks that a client on this host
    gets no splicing unless asked."""
    _needs_a_namespace()
    sock = tmp_path / "upstream.sock"
    with _Namespace() as ns:
        upstream = ns.serve("--memory", "16M", "-s", str(sock))
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert upstream.poll() is None and time.monotonic() < deadline, "no upstream"
            time.sleep(0.05)
        uri, metrics = ns.serve_tcp(f"nbd+unix:///?socket={sock}")
        large, small = pattern(MiB, seed=41), pattern(64 * KiB, seed=42)
        with handle(uri) as h:
            h.pwrite(large, 0)
            h.pwrite(small, 4 * MiB)
            h.flush()
            assert h.pread(MiB, 0) == large
            assert h.pread(64 * KiB, 4 * MiB) == small
        c = settled_metrics(metrics, 5, host=ns.SERVER_IP)
    # A pipe that filled before its read ended sends the rest from memory after it.
    assert MiB * 8 // 10 <= c["upstream_spliced_bytes"] <= MiB, c
    assert c["sent_splice_bytes"] >= c["upstream_spliced_bytes"], c
    # Every other byte, read or written, is copied once by the proxy.
    moved = 2 * (MiB + 64 * KiB)
    assert c["upstream_spliced_bytes"] + c["copied_bytes"] == moved, c


def test_direct_counters_show_registered_buffers(servers, export_factory):
    """On io_uring (not the copy baseline), aligned O_DIRECT reads and writes go through the
    ring's registered buffers (READ_FIXED / WRITE_FIXED) with no copy by the server, and read
    replies leave by plain or zero-copy send (loopback reports zero-copy sends as copied)."""
    port = free_tcp_port()
    server = servers(export_factory("direct"), transport="tcp",
                     extra_args=["--metrics", f"127.0.0.1:{port}"])
    small, large = pattern(SMALL, seed=5), pattern(LARGE, seed=6)
    with handle(server.uri()) as h:
        h.pwrite(small, 0)
        h.pwrite(large, MiB)
        assert h.pread(SMALL, 0) == small
        assert h.pread(LARGE, MiB) == large
    c = scrape_metrics(port)
    moved = SMALL + LARGE
    assert c["read_bytes"] == moved and c["write_bytes"] == moved, c
    engine, data_path = serve_configuration()
    if engine == "portable":
        assert c["fixed_io_bytes"] == 0 and c["copied_bytes"] == 2 * moved, c
        return
    # O_DIRECT moves data by DMA into the server's buffer: not a copy by the server.
    assert c["copied_bytes"] == 0, c
    sent = c["sent_plain_bytes"] + c["sent_zerocopy_bytes"] + c["sent_zerocopy_copied_bytes"]
    assert sent == moved, c
    fixed = 0 if data_path == "copy" else 2 * moved
    assert c["fixed_io_bytes"] == fixed and c["fixed_buffer_misses"] == 0, c


def test_blocks_the_cache_holds_are_read_from_its_file_by_the_engine(servers, export_factory):
    """The cache filter's held blocks are places: a second read of them is answered by the
    io_uring engine from the cache file itself (spliced, with --splice-min-bytes 0), not by
    the filter's `pread` on a worker (copied); a block not yet held is read through the
    filter. A write to a held block goes through the filter and is read back."""
    engine, data_path = serve_configuration()
    if engine != "uring" or data_path == "copy":
        pytest.skip("the io_uring engine splices file places outside the copy path")
    port = free_tcp_port()
    export = export_factory("file", filters=("cache:cache-on-read=yes",))
    args = ["--metrics", f"127.0.0.1:{port}", "--splice-min-bytes", "0"]
    server = servers(export, transport="tcp", extra_args=args)
    with handle(server.uri()) as h:
        first = h.pread(LARGE, 0)
        c = settled_metrics(port, replies=1)
        assert c["sent_splice_bytes"] == 0 and c["copied_bytes"] == LARGE, c
        assert h.pread(LARGE, 0) == first
        assert h.pread(SMALL, 8 * SMALL) == first[8 * SMALL:9 * SMALL]
        c = settled_metrics(port, replies=3)
        assert c["sent_splice_bytes"] == LARGE + SMALL and c["copied_bytes"] == LARGE, c
        new = pattern(SMALL, seed=11)
        h.pwrite(new, 3 * SMALL)
        assert h.pread(SMALL, 3 * SMALL) == new
    c = settled_metrics(port, replies=5)
    assert c["sent_splice_bytes"] == LARGE + 2 * SMALL, c


def test_direct_requests_larger_than_the_registered_region_fall_back(servers, export_factory):
    """A region of two pages holds a 4 KiB write (one page) or a 4 KiB read (header page +
    data page), not 1 MiB: those use pooled buffers, with the same data on the wire."""
    engine, data_path = serve_configuration()
    if engine != "uring" or data_path == "copy":
        pytest.skip("registered buffers are used by the io_uring engine outside the copy path")
    port = free_tcp_port()
    args = ["--metrics", f"127.0.0.1:{port}", "--fixed-buffer-bytes-max", str(2 * SMALL)]
    server = servers(export_factory("direct"), transport="tcp", extra_args=args)
    small, large = pattern(SMALL, seed=7), pattern(LARGE, seed=8)
    with handle(server.uri()) as h:
        h.pwrite(small, 0)
        h.pwrite(large, MiB)
        assert h.pread(SMALL, 0) == small
        assert h.pread(LARGE, MiB) == large
    c = scrape_metrics(port)
    assert c["fixed_io_bytes"] == 2 * SMALL and c["fixed_buffer_misses"] == 2, c
    assert c["copied_bytes"] == 0, c


def test_buffered_file_writes_spliced_through_a_pipe(servers, export_factory):
    """Buffered-file writes on io_uring: `auto` splices those of 512 KiB and more (without
    FUA) from the socket through a pipe into the file, `zerocopy` every one without FUA,
    `copy` none. Every byte lands where it belongs, also for payloads larger than the pipe
    (1 MiB) and for many writes in flight."""
    port = free_tcp_port()
    export = export_factory("file")
    server = servers(export, transport="tcp", extra_args=["--metrics", f"127.0.0.1:{port}"])
    writes = [(0, SMALL, 0), (MiB, LARGE, 0), (2 * MiB, LARGE, nbd.CMD_FLAG_FUA),
              (4 * MiB, 5 * MiB + 4 * KiB, 0)]
    writes += [(16 * MiB + i * 128 * KiB, 128 * KiB, 0) for i in range(24)]
    data = {off: pattern(n, seed=50 + i) for i, (off, n, _) in enumerate(writes)}
    with handle(server.uri()) as h:
        for off, n, flags in writes[:4]:
            h.pwrite(data[off], off, flags)
        cookies = [h.aio_pwrite(nbd.Buffer.from_bytearray(data[off]), off)
                   for off, _, _ in writes[4:]]
        deadline = time.monotonic() + 30
        while h.aio_in_flight() > 0:
            assert time.monotonic() < deadline, "write replies stopped coming"
            h.poll(1000)
        assert all(h.aio_command_completed(c) for c in cookies)
        h.flush()
        for off, n, _ in writes:
            assert h.pread(n, off) == data[off], off
    with open(export.path, "rb") as f:
        for off, n, _ in writes:
            f.seek(off)
            assert f.read(n) == data[off], off
    c = scrape_metrics(port)
    engine, data_path = serve_configuration()
    spliceable = [n for _, n, flags in writes if not flags]
    flag = "--receive-splice-min-bytes"
    args = ZCNBD_SERVE_ARGS
    splice_min = int(args[args.index(flag) + 1]) if flag in args else 512 * KiB
    expected = {
        ("uring", "auto"): sum(n for n in spliceable if n >= splice_min),
        ("uring", "zerocopy"): sum(spliceable),
    }.get((engine, data_path), 0)
    assert c["received_splice_bytes"] == expected, c
    assert c["write_bytes"] == sum(n for _, n, _ in writes), c


def test_failed_file_writes_leave_the_connection_in_step(servers, export_factory):
    """Writes the backend file refuses (EFBIG past the server's RLIMIT_FSIZE) get an error
    reply after their whole payload is taken off the socket - spliced or received - and
    the requests behind them, already on the wire, are read and answered correctly."""
    limit = 8 * MiB
    export = export_factory("file")
    server = servers(export, file_size_limit=limit)
    good = pattern(LARGE, seed=70)
    bad = [(limit, SMALL), (limit, LARGE), (limit - MiB, 3 * MiB), (limit + MiB, 2 * MiB)]
    with handle(server.uri()) as h:
        cookies = []
        for i, (off, n) in enumerate(bad):
            cookies.append((False, h.aio_pwrite(nbd.Buffer.from_bytearray(pattern(n, seed=i)), off)))
            cookies.append((True, h.aio_pwrite(nbd.Buffer.from_bytearray(good), i * MiB)))
        deadline = time.monotonic() + 30
        while h.aio_in_flight() > 0:
            assert time.monotonic() < deadline, "write replies stopped coming"
            h.poll(1000)
        for ok, cookie in cookies:
            if ok:
                assert h.aio_command_completed(cookie)
            else:
                with pytest.raises(nbd.Error):
                    h.aio_command_completed(cookie)
        for i in range(len(bad)):
            assert h.pread(LARGE, i * MiB) == good


def test_requests_sent_with_go_stay_on_the_configured_engine(servers, export_factory):
    """A client that sends its first request in the same packet as NBD_OPT_GO: the request
    bytes the handshake read are handed to the transmission engine, which serves the whole
    connection (before, io_uring silently left such a connection to the portable engine,
    where a read of written memory is copied)."""
    import struct

    import nbdproto as P

    port = free_tcp_port()
    server = servers(export_factory("memory"), extra_args=["--metrics", f"127.0.0.1:{port}"])
    client = P.RawClient.connect(server.address)
    client.read_greeting()
    data = pattern(64 * KiB, seed=9)
    option = lambda o, d=b"": struct.pack(">QII", P.IHAVEOPT, o, len(d)) + d
    burst = struct.pack(">I", P.FLAG_C_FIXED_NEWSTYLE | P.FLAG_C_NO_ZEROES)
    burst += option(P.OPT_STRUCTURED_REPLY) + option(P.OPT_GO, client.go_data("", []))
    burst += struct.pack(">IHHQQI", P.REQUEST_MAGIC, 0, P.CMD_WRITE, 77, 0, len(data)) + data
    client.send(burst)
    assert client.recv_option_reply().type == P.REP_ACK
    client.structured = True
    while (reply := client.recv_option_reply()).type != P.REP_ACK:
        assert reply.type == P.REP_INFO, reply
    write = client.recv_reply()
    assert (write.cookie, write.error) == (77, 0)
    before = scrape_metrics(port)
    assert client.read(0, len(data)).data == data
    after = scrape_metrics(port)
    copied = after["copied_bytes"] - before["copied_bytes"]
    entered = after["ring_enters"] - before["ring_enters"]
    engine, data_path = serve_configuration()
    # Both engines send a read of written memory from the export's mapping, except io_uring's
    # copy baseline; the ring is entered only if the ring serves the connection.
    expected = len(data) if data_path == "copy" else 0
    assert copied == expected, (engine, data_path, copied)
    assert (entered > 0) == (engine == "uring"), (engine, data_path, entered)
    client.close()


@pytest.mark.parametrize("coalesce_max_us", [None, "0"], ids=["default", "off"])
def test_a_pipelining_client_gets_coalescing_trials_unless_turned_off(
        servers, export_factory, coalesce_max_us):
    """`zcnbd bench` keeps 16 reads in flight, refilled a burst at a time: a ring's trials
    include 20 ms of coalesced waits (whatever they then choose), counted in
    waits_coalesced, and with --coalesce-max-us 0 none. The portable reader's trials include
    20 ms of overlapping either way, its replies sent four at a time while the rest of a
    burst waits (sends_overlapped). (The portable reader holds replies only while fewer than
    four are queued, and a reader this busy finds more at every wait: its waits_coalesced
    may stay 0.)"""
    port = free_tcp_port()
    extra = ["--metrics", f"127.0.0.1:{port}"]
    if coalesce_max_us is not None:
        extra += ["--coalesce-max-us", coalesce_max_us]
    server = servers(export_factory("memory"), extra_args=extra)
    bench = [str(ZCNBD_BIN), "bench", server.uri(), "--rw", "randread", "--bs", "4k",
             "--iodepth", "16", "--runtime", "1s", "--size", "16M", "--no-ceiling"]
    counter = "waits_coalesced" if serve_configuration()[0] == "uring" else "sends_overlapped"
    # A round of trials needs ~90 ms of steady pipelining; a loaded machine may void a few.
    for _ in range(3):
        run(bench, timeout=60)
        c = scrape_metrics(port)
        if c["requests"] > 10_000 and (counter == "waits_coalesced" and coalesce_max_us == "0"
                                       or c[counter] > 0):
            break
    assert c["requests"] > 10_000, c
    if coalesce_max_us == "0":
        assert c["waits_coalesced"] == 0, c
    if coalesce_max_us is None or counter == "sends_overlapped":
        assert c[counter] > 0, c
