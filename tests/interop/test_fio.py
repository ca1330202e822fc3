"""fio with its nbd ioengine (libnbd): random mixed I/O at queue depth 16
with crc32c verification, a couple of seconds at most per job."""

import json
import os
import shutil
import subprocess

import pytest

from support import ZCNBD_BIN, handle, missing, require_tools, run, serve_configuration

FIO_RUNTIME = 3  # seconds; an upper bound, the jobs below finish sooner


@pytest.fixture(autouse=True)
def _tools():
    require_tools("fio")
    if run(["fio", "--enghelp=nbd"], check=False).returncode != 0:
        missing("fio was built without the nbd ioengine")


def fio(uri, data_dir, *options, check=True):
    """Run one fio job; return (exit status, job result from --output JSON)."""
    out = data_dir / "fio.json"
    argv = [
        "fio", "--name=interop", "--ioengine=nbd", f"--uri={uri}",
        f"--runtime={FIO_RUNTIME}", "--output-format=json", f"--output={out}",
        *options,
    ]
    # cwd: fio may leave *-verify.state files behind
    p = run(argv, check=False, timeout=60, cwd=data_dir)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = None
    if check:
        assert p.returncode == 0 and result is not None, (
            f"fio failed ({p.returncode}):\n{p.stdout}\n{p.stderr}\n{out.read_text() if out.exists() else ''}")
    return p.returncode, result


def totals(result):
    """Sum of the per-job error codes and bytes moved."""
    jobs = result["jobs"]
    return (
        sum(j["error"] for j in jobs),
        sum(j["read"]["io_bytes"] for j in jobs),
        sum(j["write"]["io_bytes"] for j in jobs),
    )


VERIFIED_RANDRW = ["--rw=randrw", "--iodepth=16", "--size=16M",
                   "--verify=crc32c", "--verify_fatal=1", "--verify_backlog=256"]


@pytest.mark.parametrize("bs", ["4k", "64k"])
def test_randrw_verify(rw_server, data_dir, bs):
    _, result = fio(rw_server.uri(), data_dir, f"--bs={bs}", *VERIFIED_RANDRW)
    errors, read, written = totals(result)
    assert errors == 0
    assert written > 0
    # Every written block is read back for verification, plus random reads.
    assert read >= written


def test_randrw_verify_two_jobs(mem_server, data_dir):
    """Two jobs (two NBD connections) on disjoint halves, concurrently."""
    _, result = fio(mem_server.uri(), data_dir, "--bs=16k", "--numjobs=2",
                    "--offset_increment=16M", "--group_reporting=0", *VERIFIED_RANDRW)
    errors, read, written = totals(result)
    assert len(result["jobs"]) == 2 and errors == 0 and written > 0 and read >= written


def test_randread_read_only(ro_server, data_dir):
    _, result = fio(ro_server.uri(), data_dir, "--rw=randread", "--bs=4k", "--iodepth=16",
                    "--size=32M", "--time_based=1", "--runtime=1")
    errors, read, written = totals(result)
    assert errors == 0 and read > 0 and written == 0


def test_verify_detects_corruption(mem_server, data_dir):
    """Negative control: fio's verification really checks what the server
    returns, so the tests above can fail."""
    uri = mem_server.uri()
    common = ["--rw=write", "--bs=4k", "--size=1M", "--verify=crc32c"]
    fio(uri, data_dir, *common, "--do_verify=0")
    fio(uri, data_dir, *common, "--verify_only")  # intact: passes
    with handle(uri) as h:
        h.pwrite(b"corrupt" * 10, 8192 + 100)
    rc, _ = fio(uri, data_dir, *common, "--verify_only", check=False)
    assert rc != 0


def test_zcnbd_bench_drives_cells_with_fio(data_dir):
    """`zcnbd bench --client fio`: fio's nbd engine runs every cell, a TLS target included
    (libnbd finds the run's certificates through HOME); the JSON names fio as the client and
    every cell moved data without errors, with the zcnbd server's CPU measured."""
    require_tools("nbdkit", "certtool")
    engine, data_path = serve_configuration()
    zcnbd = f"zcnbd:memory:tls:--engine={engine}:--data-path={data_path}"
    out = data_dir / "bench.json"
    run([str(ZCNBD_BIN), "bench", "--client", "fio", "--rw", "randread,randwrite",
         "--bs", "4k", "--iodepth", "1,8", "--runtime", "500ms", "--size", "16M",
         "--no-ceiling", "--json", str(out), zcnbd, "nbdkit:memory"], timeout=120)
    report = json.loads(out.read_text())
    assert report["workload"]["client"].startswith("fio-"), report["workload"]
    assert len(report["cells"]) == 2 * 2 * 2
    for cell in report["cells"]:
        for s in cell["samples"]:
            assert s["errors"] == 0 and s["mib_s"] > 0 and s["lat_p99_us"] > 0, cell
            if cell["target"] == zcnbd:
                assert s["server_cpu_s_per_gib"] is not None, cell


def test_zcnbd_bench_refuses_fio_only_targets_without_fio(data_dir):
    """fio-rbd: has no NBD server: zcnbd's own client cannot measure it, and says which
    client can."""
    p = run([str(ZCNBD_BIN), "bench", "fio-rbd:rbd/image"], check=False)
    assert p.returncode == 1 and "--client fio" in p.stderr, p.stderr


def test_zcnbd_bench_netns_measures_each_ends_receive_threads(data_dir):
    """`zcnbd bench --netns`: the servers in a namespace of their own, each end of the veth
    pair receiving in a NAPI thread of its own, whose CPU the JSON gives beside the server's;
    the namespace and the pair are gone after the run."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("ethtool")):
        pytest.skip("needs root, iproute2 and ethtool")
    out = data_dir / "netns.json"
    run([str(ZCNBD_BIN), "bench", "--netns", "--rw", "randread,randwrite", "--bs", "1m",
         "--runtime", "500ms", "--size", "16M", "--json", str(out), "zcnbd:memory"],
        timeout=120)
    report = json.loads(out.read_text())
    assert "NAPI threads" in report["workload"]["network"], report["workload"]
    moved = 0.0
    for cell in report["cells"]:
        for s in cell["samples"]:
            assert s["errors"] == 0 and s["mib_s"] > 0, cell
            assert s["server_receive_cpu_s_per_gib"] is not None, cell
            assert s["client_receive_cpu_s_per_gib"] is not None, cell
            moved += s["server_receive_cpu_s_per_gib"] + s["client_receive_cpu_s_per_gib"]
    # The threads did the receiving (tick-counted: some ticks in a second of 1 MiB requests).
    assert moved > 0, report["cells"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "zcnbd-bench-" not in left, left


def test_zcnbd_bench_web_targets_leave_no_nginx_behind(data_dir):
    """A web target's nginx (a master and a worker per CPU) serves the run's reads, and is
    stopped with its workers at the end."""
    require_tools("nginx")
    out = data_dir / "web.json"
    run([str(ZCNBD_BIN), "bench", "--rw", "randread", "--bs", "64k", "--runtime", "500ms",
         "--size", "16M", "--no-ceiling", "--json", str(out), "zcnbd:web"], timeout=120)
    report = json.loads(out.read_text())
    for cell in report["cells"]:
        for s in cell["samples"]:
            assert s["errors"] == 0 and s["mib_s"] > 0, cell
    # Workers are named "nginx: worker process"; they hold the run's error log open.
    assert _holding("zcnbd-bench-web.") == [], "nginx processes were left behind"


def _holding(fragment):
    """The processes with a descriptor open on a path containing `fragment`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(fragment in link for link in links):
            found.append(pid)
    return found
