"""Filters (layers) with options, checked through libnbd with numbers: `delay` adds its time
to the requests it names and no others; `error` fails the share of requests its rate says,
with its errno, only while its trigger file exists; bad options refuse the start with one
line that says what the filter takes."""

import contextlib
import errno
import json
import subprocess
import threading
import time

import nbd
import pytest

from support import (
    ZCNBD_BIN,
    ZCNBD_SERVE_ARGS,
    Export,
    expect_nbd_error,
    handle,
    pattern,
    require_tools,
    run,
)

KiB = 1024


def filtered(servers, *filters_and_options, exports=None):
    extra = []
    for item in filters_and_options:
        extra += ["--filter-opt", item] if "." in item.split("=")[0] else ["--filter", item]
    return servers(exports or Export(kind="memory"), extra_args=extra)


def timed(fn, *args):
    start = time.monotonic()
    fn(*args)
    return time.monotonic() - start


def test_delay_adds_its_time_to_reads_and_not_to_writes(servers):
    server = filtered(servers, "delay", "delay.rdelay=200ms")
    with handle(server.uri()) as h:
        h.pwrite(b"x" * 4096, 0)
        reads = [timed(h.pread, 4096, 0) for _ in range(3)]
        writes = [timed(h.pwrite, b"y" * 4096, 0) for _ in range(3)]
    # 200 ms each, with up to 400 ms for a loaded machine; writes have no delay (under the
    # read delay even when the machine is busy).
    assert all(0.2 <= t < 0.6 for t in reads), reads
    assert all(t < 0.2 for t in writes), writes


def test_delay_options_in_the_filter_entry_and_toml_alike(servers):
    exports = [Export(kind="memory", name="slow", filters=("delay:wdelay=300ms",)),
               Export(kind="memory", name="fast")]
    server = servers(exports)
    with handle(server.uri("slow")) as slow, handle(server.uri("fast")) as fast:
        assert timed(slow.pwrite, b"z" * 512, 0) >= 0.3
        assert timed(fast.pwrite, b"z" * 512, 0) < 0.3
        assert timed(slow.pread, 512, 0) < 0.3


def test_error_fails_every_request_with_its_errno(servers):
    server = filtered(servers, "error", "error.error=ENOSPC", "error.error-pwrite-rate=1")
    with handle(server.uri()) as h:
        assert h.pread(4096, 0) == bytes(4096)
        expect_nbd_error(errno.ENOSPC, h.pwrite, b"x" * 4096, 0)


def test_error_rate_fails_about_that_share(servers):
    server = filtered(servers, "error:error-rate=25%")
    failed = 0
    with handle(server.uri()) as h:
        for _ in range(800):
            try:
                h.pread(512, 0)
            except nbd.Error as e:
                assert e.errnum == errno.EIO, e
                failed += 1
    # 200 expected: the bounds are about 6 standard deviations wide.
    assert 125 <= failed <= 275, failed


def test_error_file_turns_failures_on_and_off(servers, tmp_path):
    trigger = tmp_path / "fail-now"
    server = filtered(servers, "error", "error.error-rate=1", f"error.error-file={trigger}")
    with handle(server.uri()) as h:
        h.pread(512, 0)
        trigger.touch()
        expect_nbd_error(errno.EIO, h.pread, 512, 0)
        trigger.unlink()
        h.pread(512, 0)


@pytest.mark.parametrize("args, says", [
    (["--filter", "delay:speed=1"], 'filter delay has no option "speed" (it has: '),
    (["--filter", "delay", "--filter-opt", "delay.rdelay=soon"], "is not a duration"),
    (["--filter", "error:error=EBOGUS"], "no errno"),
    (["--filter-opt", "delay.rdelay=1"], "no --filter delay"),
    (["--filter", "cow"], 'no filter is called "cow"'),
])
def test_bad_filter_options_refuse_the_start_saying_why(tmp_path, args, says):
    p = run([ZCNBD_BIN, "serve", *ZCNBD_SERVE_ARGS, "--memory", "1M",
             "-s", tmp_path / "nbd.sock", *args], check=False, timeout=20)
    assert p.returncode != 0
    assert says in p.stderr, p.stderr
    assert "server ready" not in p.stderr


def sfdisk(image, script):
    """Writes a partition table with sfdisk; each partition's (offset, length) in bytes."""
    p = subprocess.run(["sfdisk", "--no-reread", "--no-tell-kernel", "-q", str(image)],
                       input=script, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    table = json.loads(run(["sfdisk", "--json", image]).stdout)["partitiontable"]
    return [(q["start"] * 512, q["size"] * 512) for q in table["partitions"]]


@pytest.mark.parametrize("label, script, number", [
    ("gpt", "label: gpt\n,4MiB\n,6MiB\n", 2),
    # An extended partition (2) with two logical ones: 5 and 6.
    ("dos", "label: dos\np1 : start=2048, size=4096, type=83\n"
            "p2 : start=6144, size=20480, type=5\np5 : start=8192, size=6144, type=83\n"
            "p6 : start=16384, size=8192, type=83\n", 6),
])
def test_partition_serves_one_partition_of_the_disk(servers, tmp_path, label, script, number):
    require_tools("sfdisk")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(16 * 1024 * KiB)
    parts = dict(enumerate(sfdisk(image, script), start=1))
    if label == "dos":
        # sfdisk lists the primary partitions, then the logical ones: 1, 2, 5, 6.
        parts = {1: parts[1], 2: parts[2], 5: parts[3], 6: parts[4]}
    start, size = parts[number]
    data = pattern(size, seed=number)
    with open(image, "r+b") as f:
        f.seek(start)
        f.write(data)
    export = Export(kind="file", path=image, size=16 * 1024 * KiB,
                    filters=(f"partition:partition={number}",))
    server = servers(export)
    with handle(server.uri()) as h:
        assert h.get_size() == size
        assert h.pread(size, 0) == data
        h.pwrite(b"written through", size - 15)
    with open(image, "rb") as f:
        f.seek(start + size - 15)
        assert f.read(15) == b"written through"
        f.seek(start + size)
        assert f.read(15) != b"written through"


def test_partition_refuses_a_disk_without_that_partition(tmp_path):
    image = tmp_path / "blank.img"
    with open(image, "wb") as f:
        f.truncate(1024 * KiB)
    for filters, says in ((["--filter", "partition:partition=1"], "no partition table"),
                          (["--filter", "partition"], "give partition=N")):
        p = run([ZCNBD_BIN, "serve", *ZCNBD_SERVE_ARGS, image, "-s", tmp_path / "nbd.sock",
                 *filters], check=False, timeout=20)
        assert p.returncode != 0
        assert says in p.stderr, p.stderr


def test_log_writes_a_line_per_request(servers, tmp_path):
    log = tmp_path / "requests.log"
    server = filtered(servers, f"log:logfile={log}")
    with handle(server.uri()) as h:
        h.pwrite(b"x" * 4096, 0x10000, nbd.CMD_FLAG_FUA)
        assert h.pread(512, 0x10000) == b"x" * 512
        h.flush()
        h.zero(8192, 0)
    lines = log.read_text().splitlines()
    ours = [line.split(" ", 2)[2] for line in lines if " -> " in line]
    want = ["Write offset=0x10000 count=0x1000 fua=1 -> ok",
            "Read offset=0x10000 count=0x200 -> ok",
            "Flush -> ok",
            "Zero offset=0x0 count=0x2000"]
    # The server may flush when the client leaves.
    assert len(ours) >= 4 and all(o.startswith("Flush") for o in ours[4:]), lines
    for got, expected in zip(ours, want):
        assert got.startswith(expected), (got, expected)
    ids = [int(line.split(" ")[1].removeprefix("id=")) for line in lines]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), lines


def wait_for_socket(sock, process, what):
    for _ in range(500):
        if sock.exists() or process.poll() is not None:
            break
        time.sleep(0.02)
    if not sock.exists():
        err = process.stderr.read() if process.stderr and process.poll() is not None else ""
        pytest.fail(f"{what} did not listen: {err}")


@contextlib.contextmanager
def nbdkit(tmp_path, name, *args):
    """nbdkit on a Unix socket with `args` (filters, plugin, parameters); its URI."""
    require_tools("nbdkit")
    sock = tmp_path / f"{name}.sock"
    p = subprocess.Popen(["nbdkit", "-f", "--exit-with-parent", "-U", str(sock), *args],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        wait_for_socket(sock, p, "nbdkit")
        yield f"nbd+unix:///?socket={sock}"
    finally:
        p.terminate()
        p.wait(timeout=10)


@contextlib.contextmanager
def proxy(tmp_path, upstream, *args):
    """zcnbd serving the NBD export at `upstream` with `args` (its filters); its URI."""
    sock = tmp_path / "proxy.sock"
    argv = [str(ZCNBD_BIN), "serve", "-s", str(sock), *ZCNBD_SERVE_ARGS, upstream, *args]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for_socket(sock, p, "zcnbd")
        yield f"nbd+unix:///?socket={sock}"
    finally:
        p.terminate()
        p.wait(timeout=10)


@pytest.fixture
def strict_nbdkit(tmp_path):
    """nbdkit serving 16 MiB of memory that refuses requests not aligned to 4 KiB or larger
    than 64 KiB (its blocksize-policy filter): the upstream the blocksize filter is for."""
    with nbdkit(tmp_path, "strict", "--filter=blocksize-policy", "memory", "16M",
                "blocksize-minimum=4096", "blocksize-preferred=4096",
                "blocksize-maximum=65536", "blocksize-error-policy=error") as uri:
        yield uri


def test_blocksize_serves_any_request_from_a_strict_upstream(strict_nbdkit, tmp_path):
    with proxy(tmp_path, strict_nbdkit, "--filter", "blocksize:minblock=4K,maxdata=64K") as uri:
        model = bytearray(16 * 1024 * KiB)
        with handle(uri) as h:
            assert h.get_block_size(nbd.SIZE_MINIMUM) == 1
            writes = [(1, b"\x01"), (4095, b"ab"), (70_000, pattern(1024 * KiB + 3, seed=7)),
                      (5 * 1024 * KiB + 17, pattern(4096, seed=8))]
            for offset, data in writes:
                h.pwrite(data, offset)
                model[offset:offset + len(data)] = data
            for offset, length in ((0, 1), (4095, 2), (69_999, 1024 * KiB + 5), (0, 8 * 1024 * KiB)):
                assert h.pread(length, offset) == model[offset:offset + length], (offset, length)
        # The upstream itself holds what was written.
        with handle(strict_nbdkit) as up:
            for at in range(0, 8 * 1024 * KiB, 64 * KiB):
                assert up.pread(64 * KiB, at) == model[at:at + 64 * KiB], at


def test_rate_keeps_to_its_rate_and_changes_while_serving(servers, tmp_path):
    control = tmp_path / "control.sock"
    # 1 MiB/s with a quarter second's burst: 1 MiB more than the burst takes ~0.75 s.
    server = servers(Export(kind="memory", size=16 * 1024 * KiB,
                            filters=("rate:rate=8M,burstiness=0.25",)),
                     extra_args=["--control", str(control)])
    with handle(server.uri()) as h:
        h.pread(256 * KiB, 0)
        took = timed(lambda: [h.pread(64 * KiB, i * 64 * KiB) for i in range(16)])
        assert 0.6 <= took < 2.5, took
        run([ZCNBD_BIN, "filter", "-c", control, "rate.rate=0"])
        took = timed(lambda: [h.pread(1024 * KiB, i * 1024 * KiB) for i in range(8)])
        assert took < 0.5, took
        p = run([ZCNBD_BIN, "filter", "-c", control, "rate.burstiness=1"], check=False)
        assert p.returncode == 1 and "cannot be changed while serving" in p.stderr, p.stderr
        p = run([ZCNBD_BIN, "filter", "-c", control, "delay.rdelay=1"], check=False)
        assert p.returncode == 1 and 'no filter "delay"' in p.stderr, p.stderr


def test_readahead_asks_the_upstream_fewer_larger_reads(tmp_path):
    log = tmp_path / "upstream.log"
    data = pattern(8 * 1024 * KiB, seed=3)
    with nbdkit(tmp_path, "up", "--filter=log", "memory", "8M", f"logfile={log}") as up:
        with handle(up) as h:
            h.pwrite(data, 0)
        log.write_text("")
        with proxy(tmp_path, up, "--filter", "readahead:max=1M") as uri, handle(uri) as h:
            got = b"".join(h.pread(64 * KiB, at) for at in range(0, len(data), 64 * KiB))
            assert got == data
            # Writes drop what was read ahead.
            h.pwrite(b"new" * 1000, 100 * KiB)
            assert h.pread(64 * KiB, 64 * KiB)[36 * KiB:36 * KiB + 3000] == b"new" * 1000
    reads = [line for line in log.read_text().splitlines() if " Read id=" in line]
    # 128 client reads; windows of 128K, 256K, 512K and then 1M: about 11 upstream.
    assert 5 <= len(reads) <= 20, len(reads)


def test_retry_rides_out_a_failing_upstream(tmp_path):
    trigger = tmp_path / "failing"
    with nbdkit(tmp_path, "up", "--filter=error", "memory", "4M", "error-rate=1",
                f"error-file={trigger}") as up:
        with proxy(tmp_path, up, "--filter", "retry:retries=8,retry-delay=50ms") as uri:
            with handle(uri) as h:
                trigger.touch()
                threading.Timer(0.6, trigger.unlink).start()
                took = timed(h.pread, 4096, 0)
                assert took >= 0.5, took
                # Writes are not retried unless asked: a repeated write is not always safe.
                trigger.touch()
                expect_nbd_error(errno.EIO, h.pwrite, b"x" * 512, 0)
                # Reads give up after their retries (50 ms doubling: 12.75 s for 8).
        with proxy(tmp_path, up, "--filter", "retry:retries=2,retry-delay=10ms") as uri:
            with handle(uri) as h:
                expect_nbd_error(errno.EIO, h.pread, 4096, 0)
                trigger.unlink()
                assert h.pread(4096, 0) == bytes(4096)


def upstream_reads(log):
    return [line for line in log.read_text().splitlines() if " Read id=" in line]


def test_cache_keeps_what_was_read_and_writes_back_at_flush(tmp_path):
    log = tmp_path / "upstream.log"
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    data = pattern(4 * 1024 * KiB, seed=5)
    with nbdkit(tmp_path, "up", "--filter=log", "memory", "4M", f"logfile={log}") as up:
        with handle(up) as h:
            h.pwrite(data, 0)
        with proxy(tmp_path, up, "--filter", "cache:cache-on-read=yes",
                   "--cache-dir", str(cache_dir)) as uri, handle(uri) as h:
            log.write_text("")
            assert h.pread(2 * 1024 * KiB, 0) == data[:2 * 1024 * KiB]
            fetched = len(upstream_reads(log))
            assert fetched >= 1
            # The second time, nothing is read from the upstream.
            assert h.pread(2 * 1024 * KiB, 0) == data[:2 * 1024 * KiB]
            assert len(upstream_reads(log)) == fetched
            # Writeback: the upstream has the write only after a FLUSH.
            h.pwrite(b"w" * 4096, 3 * 1024 * KiB)
            with handle(up) as direct:
                assert direct.pread(4096, 3 * 1024 * KiB) == data[3 * 1024 * KiB:][:4096]
                h.flush()
                assert direct.pread(4096, 3 * 1024 * KiB) == b"w" * 4096
            # The cache file is unnamed: the directory stays empty.
            assert list(cache_dir.iterdir()) == []


def test_cache_lets_clients_write_over_a_read_only_upstream(tmp_path):
    data = pattern(1024 * KiB, seed=6)
    with nbdkit(tmp_path, "up", "memory", "1M") as writable:
        with handle(writable) as h:
            h.pwrite(data, 0)
        # The same data, served read-only by a second nbdkit over the first.
        with nbdkit(tmp_path, "ro", "-r", "nbd", f"uri={writable}") as up:
            with proxy(tmp_path, up, "--filter", "cache") as uri, handle(uri) as h:
                assert not h.is_read_only()
                h.pwrite(b"mine" * 1024, 8192)
                h.flush()
                assert h.pread(4096, 8192) == b"mine" * 1024
                assert h.pread(4096, 0) == data[:4096]
        with handle(writable) as h:
            assert h.pread(len(data), 0) == data
