"""Disk images (qcow2 and its backing chains, --snapshot overlays, flat VMDK), with QEMU as the
oracle: images are made and written by qemu-img and qemu-io, qemu-nbd serves the same image
beside zcnbd, and `nbdinfo --map` (base:allocation and qemu:allocation-depth) must answer the
same for both; `qemu-img compare` checks the export against the image itself and
`qemu-img check` that zcnbd's writes left it consistent."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import nbd
import pytest

from support import (
    KiB, MiB, ZCNBD_SERVE_ARGS, Export, free_tcp_port, handle, missing, pattern,
    require_tools, run, settled_metrics,
)

pytestmark = pytest.mark.zcnbd_only(reason="disk images are served by zcnbd (qemu-nbd is the oracle)")

SIZE = 64 * MiB


@pytest.fixture(autouse=True)
def _tools():
    require_tools("qemu-img", "qemu-io", "qemu-nbd", "nbdinfo")


# --- making images with QEMU's own tools ------------------------------------------------------
def qcow2(path: Path, size: int = SIZE, *, cluster: int = 64 * KiB, compat: str = "1.1",
          backing: Path | None = None, backing_fmt: str | None = None, opts: str = "") -> Path:
    o = f"cluster_size={cluster},compat={compat}" + (f",{opts}" if opts else "")
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-o", o]
    if backing is not None:
        # Relative to the image, as a chain usually names its backing file.
        argv += ["-b", backing.name, "-F", backing_fmt]
    run(argv + [path, str(size)], cwd=path.parent)
    return path


def qemu_io(image: Path, *commands: str, fmt: str = "qcow2") -> None:
    argv = ["qemu-io", "-f", fmt]
    for c in commands:
        argv += ["-c", c]
    out = run(argv + [image])
    assert "error" not in out.stdout.lower() + out.stderr.lower(), out.stdout + out.stderr


def check_clean(image: Path) -> None:
    """`qemu-img check`: no errors, no leaks."""
    out = run(["qemu-img", "check", "--output=json", image], check=False)
    assert out.returncode == 0, f"qemu-img check {image}:\n{out.stdout}\n{out.stderr}"
    report = json.loads(out.stdout)
    assert report.get("leaks", 0) == 0 and report.get("corruptions", 0) == 0, report


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def qemu_nbd(image: Path, *args: str, fmt: str = "qcow2"):
    """qemu-nbd serving `image` on a Unix socket (with `args`): its URI."""
    sock = image.parent / f"q-{image.name}.sock"
    log_path = image.parent / f"q-{image.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["qemu-nbd", "-f", fmt, "-t", "--shared=4", "-k", str(sock), *args, str(image)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "qemu-nbd did not start"
            time.sleep(0.02)
        yield f"nbd+unix:///?socket={sock}"
    finally:
        proc.terminate()
        proc.wait(10)


def oracle(image: Path, fmt: str = "qcow2"):
    """qemu-nbd serving `image` read-only with qemu:allocation-depth."""
    return qemu_nbd(image, "-r", "-A", fmt=fmt)


def nbd_map(uri: str, context: str = "base:allocation") -> str:
    return run(["nbdinfo", f"--map={context}", uri]).stdout


def image_export(path: Path, **kw) -> Export:
    return Export(kind="file", path=path, size=0, **kw)


def assert_same_as_qemu(servers, image: Path, fmt: str = "qcow2") -> None:
    """zcnbd (read-only) and qemu-nbd on `image`: the same maps, and the same bytes as the
    image itself."""
    server = servers(image_export(image, read_only=True))
    with oracle(image, fmt) as theirs_uri:
        for context in ("base:allocation", "qemu:allocation-depth"):
            ours, theirs = nbd_map(server.uri(), context), nbd_map(theirs_uri, context)
            assert ours == theirs, f"{context} differs\n--- zcnbd ---\n{ours}--- qemu-nbd ---\n{theirs}"
    run(["qemu-img", "compare", "-U", "-f", fmt, "-F", "raw", image, server.uri()])
    server.stop()


def fill(image: Path, cluster: int) -> None:
    """Data, explicit zeroes and untouched clusters, not all aligned to clusters."""
    qemu_io(image,
            f"write -P 0x11 0 {3 * cluster}",
            f"write -P 0x22 {5 * cluster + 512} {cluster}",
            f"write -z {8 * cluster} {2 * cluster}",
            f"write -P 0x33 {1 * MiB} {1 * MiB}",
            f"write -P 0x44 {40 * MiB - 4096} 8192")


# --- reading: the same as QEMU -------------------------------------------------------------------
@pytest.mark.parametrize("cluster,compat", [(4 * KiB, "1.1"), (64 * KiB, "0.10"), (2 * MiB, "1.1")],
                         ids=["4k-v3", "64k-v2", "2m-v3"])
def test_cluster_sizes_and_versions_read_as_qemu_reads_them(servers, data_dir, cluster, compat):
    image = qcow2(data_dir / "disk.qcow2", cluster=cluster, compat=compat)
    fill(image, cluster)
    assert_same_as_qemu(servers, image)


def test_compressed_clusters_read(servers, data_dir):
    raw = data_dir / "src.raw"
    with open(raw, "wb") as f:
        f.truncate(SIZE)
        f.write(b"compressible " * 100000)
        f.seek(20 * MiB)
        f.write(pattern(3 * MiB, seed=7))
    image = data_dir / "compressed.qcow2"
    run(["qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", raw, image])
    assert_same_as_qemu(servers, image)


def chain3(d: Path) -> Path:
    """raw base (data and holes) <- qcow2 middle <- qcow2 top, each layer written."""
    base = d / "base.raw"
    with open(base, "wb") as f:
        f.truncate(SIZE)
        f.seek(0)
        f.write(pattern(4 * MiB, seed=1))
        f.seek(30 * MiB)
        f.write(pattern(2 * MiB, seed=2))
    mid = qcow2(d / "mid.qcow2", backing=base, backing_fmt="raw")
    qemu_io(mid, f"write -P 0x55 {2 * MiB} {1 * MiB}", f"write -z {31 * MiB} {64 * KiB}")
    top = qcow2(d / "top.qcow2", backing=mid, backing_fmt="qcow2")
    qemu_io(top, f"write -P 0x66 {2 * MiB + 512 * KiB} {1 * MiB}", f"write -P 0x77 {50 * MiB} 4096")
    return top


def test_a_backing_chain_of_depth_three_reads_as_qemu_reads_it(servers, data_dir):
    assert_same_as_qemu(servers, chain3(data_dir))


def test_image_exports_offer_allocation_depth_and_raw_files_do_not(servers, data_dir):
    image = qcow2(data_dir / "d.qcow2")
    raw = data_dir / "d.raw"
    raw.write_bytes(b"\0" * MiB)
    for path, wanted in ((image, True), (raw, False)):
        server = servers(image_export(path, read_only=True))
        info = json.loads(run(["nbdinfo", "--json", server.uri()]).stdout)
        contexts = info["exports"][0].get("contexts", [])
        assert ("qemu:allocation-depth" in contexts) == wanted, contexts
        assert "base:allocation" in contexts
        server.stop()


def test_a_probed_image_is_logged_and_format_raw_serves_its_bytes(servers, data_dir):
    image = qcow2(data_dir / "d.qcow2")
    server = servers(image_export(image, read_only=True))
    with handle(server.uri()) as h:
        assert h.get_size() == SIZE
    server.stop()
    assert "disk image" in server.log() and "qcow2" in server.log(), server.log()
    raw = servers(image_export(image, read_only=True), extra_args=["--format", "raw"])
    with handle(raw.uri()) as h:
        assert h.get_size() == image.stat().st_size
        assert h.pread(4, 0) == b"QFI\xfb"


def test_a_flat_vmdk_is_served_read_only(servers, data_dir):
    image = data_dir / "disk.vmdk"
    run(["qemu-img", "create", "-q", "-f", "vmdk", "-o", "subformat=monolithicFlat", image, "8M"])
    qemu_io(image, "write -P 0x5a 1M 64k", fmt="vmdk")
    server = servers(image_export(image))
    with handle(server.uri()) as h:
        assert h.is_read_only()
        assert h.pread(64 * KiB, MiB) == b"\x5a" * (64 * KiB)
    run(["qemu-img", "compare", "-f", "vmdk", "-F", "raw", image, server.uri()])


# --- refusals ------------------------------------------------------------------------------------
def refused(image: Path, *args: str) -> str:
    """Starts zcnbd on `image`, which must fail at start; its output."""
    from support import ZCNBD_BIN
    p = run([ZCNBD_BIN, "serve", "-s", image.parent / "refused.sock", *args, image],
            check=False, timeout=20)
    assert p.returncode != 0, f"zcnbd served {image}\n{p.stdout}{p.stderr}"
    return p.stdout + p.stderr


def test_unservable_images_fail_at_start_naming_file_and_reason(data_dir):
    ext = qcow2(data_dir / "ext.qcow2", opts="extended_l2=on")
    assert "extended L2" in refused(ext)
    luks = data_dir / "luks.qcow2"
    run(["qemu-img", "create", "-q", "--object", "secret,id=s0,data=123456", "-f", "qcow2",
         "-o", "encrypt.format=luks,encrypt.key-secret=s0", luks, "1M"])
    out = refused(luks)
    assert "encrypted" in out and "luks.qcow2" in out, out
    missing_base = qcow2(data_dir / "orphan.qcow2", backing=qcow2(data_dir / "gone.qcow2"),
                         backing_fmt="qcow2")
    (data_dir / "gone.qcow2").unlink()
    assert "gone.qcow2" in refused(missing_base)
    # A loop: a names b, and b is rebased (unsafely) onto a.
    b = qcow2(data_dir / "b.qcow2")
    a = qcow2(data_dir / "a.qcow2", backing=b, backing_fmt="qcow2")
    run(["qemu-img", "rebase", "-u", "-b", "a.qcow2", "-F", "qcow2", b], cwd=data_dir)
    assert "loop" in refused(a)
    # Not a disk: a backing file that is a character device.
    dev = qcow2(data_dir / "dev.qcow2")
    run(["qemu-img", "rebase", "-u", "-b", "/dev/zero", "-F", "raw", dev])
    assert "not a regular file" in refused(dev, "-r")


def test_a_refused_writable_open_leaves_the_image_unchanged(data_dir):
    """The autoclear bits (a persistent bitmap's validity) are cleared by a writable open; a
    chain that cannot be opened must leave the image as it was."""
    base = qcow2(data_dir / "base.qcow2")
    top = qcow2(data_dir / "top.qcow2", backing=base, backing_fmt="qcow2")
    run(["qemu-img", "bitmap", "--add", top, "b0"])
    base.unlink()
    before = sha256(top)
    refused(top)
    assert sha256(top) == before


# --- writing -------------------------------------------------------------------------------------
DIRECT = pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])


@DIRECT
def test_writes_land_as_qemu_would_write_them(servers, data_dir, direct):
    """Partial-cluster writes over a backing file (copy-on-write), allocating writes, writes
    to allocated clusters, zeroes and trims through zcnbd (buffered, and with --direct, as
    qemu-nbd's --cache=none); the same requests through qemu-nbd on a copy; both images must
    read the same, and zcnbd's must check clean."""
    top = chain3(data_dir)
    ref = data_dir / "ref.qcow2"
    shutil.copy(top, ref)
    writes = [(2 * MiB + 100, pattern(5000, 1)), (7 * MiB, pattern(MiB, 2)),
              (50 * MiB + 512, pattern(4096, 3)), (33 * MiB - 4096, pattern(70000, 4))]

    def requests(h):
        for off, data in writes:
            h.pwrite(data, off)
        # libnbd: zero(count, offset), trim(count, offset). Over the base's data, the middle
        # layer's, and the writes above; the trim's ends are not on cluster boundaries.
        h.zero(MiB + 4096, 2 * MiB - 512)
        h.trim(MiB + 100, 64 * KiB + 7)
        h.trim(2 * MiB, 30 * MiB)
        h.flush()

    server = servers(image_export(top, direct=direct))
    with handle(server.uri()) as h:
        assert h.can_multi_conn() and h.can_trim() and h.can_zero()
        requests(h)
        assert h.pread(4096, 2 * MiB) == b"\0" * 4096
    server.stop()
    # The same requests through qemu-nbd (read-write, trims passed on) on the copy.
    with qemu_nbd(ref, "--discard=unmap") as uri, handle(uri) as h:
        requests(h)
    check_clean(top)
    run(["qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", top, ref])
    assert_same_as_qemu(servers, top)


def test_trim_gives_space_back_and_zero_keeps_clusters(servers, data_dir):
    image = qcow2(data_dir / "d.qcow2")
    qemu_io(image, f"write -P 0x11 0 {16 * MiB}")
    used = lambda: image.stat().st_blocks * 512
    before = used()
    server = servers(image_export(image))
    with handle(server.uri()) as h:
        # libnbd: trim(count, offset), zero(count, offset, flags).
        h.trim(8 * MiB, 8 * MiB)
        h.zero(MiB, MiB, nbd.CMD_FLAG_NO_HOLE)
        with pytest.raises(nbd.Error) as e:
            h.zero(100, 10 * MiB, nbd.CMD_FLAG_FAST_ZERO)
        assert e.value.errno == "ENOTSUP", e.value
        h.zero(MiB, 3 * MiB, nbd.CMD_FLAG_FAST_ZERO)
        h.flush()
        assert h.pread(MiB, 0) == b"\x11" * MiB
        for at in (MiB, 3 * MiB, 8 * MiB, 15 * MiB):
            assert h.pread(MiB, at) == b"\0" * MiB, at
        assert h.pread(MiB, 4 * MiB) == b"\x11" * MiB
    server.stop()
    assert used() <= before - 7 * MiB, (before, used())
    check_clean(image)
    assert_same_as_qemu(servers, image)


@DIRECT
def test_fio_verify_with_four_connections(servers, data_dir, direct):
    require_tools("fio")
    top = chain3(data_dir)
    server = servers(image_export(top, direct=direct))
    out = run(["fio", "--name=v", "--ioengine=nbd", f"--uri={server.uri()}", "--rw=randwrite",
               "--bs=16k", "--size=12M", "--numjobs=4", "--offset_increment=14M",
               "--iodepth=8", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
               "--group_reporting"], timeout=300, cwd=data_dir)
    assert "verify" not in out.stderr.lower() or "error" not in out.stderr.lower(), out.stderr
    server.stop()
    check_clean(top)


@DIRECT
def test_fua_and_flush_survive_kill_9(servers, data_dir, direct):
    image = chain3(data_dir)
    server = servers(image_export(image, direct=direct))
    with handle(server.uri()) as h:
        h.pwrite(b"\x91" * (256 * KiB), 10 * MiB, nbd.CMD_FLAG_FUA)
        h.pwrite(b"\x92" * (256 * KiB), 20 * MiB + 4096)
        h.pwrite(b"\x93" * 4096, 50 * MiB)
        h.flush()
        server.kill()
    check_clean(image)
    qemu_io(image, f"read -P 0x91 {10 * MiB} {256 * KiB}",
            f"read -P 0x92 {20 * MiB + 4096} {256 * KiB}", f"read -P 0x93 {50 * MiB} 4096")


# --- throwaway overlays --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qcow2", "raw"])
def test_snapshot_writes_go_to_an_overlay_deleted_at_exit(servers, data_dir, kind, monkeypatch):
    if kind == "qcow2":
        base = chain3(data_dir)
    else:
        base = data_dir / "base.raw"
        base.write_bytes(pattern(SIZE, 5))
    before = sha256(base)
    tmp = data_dir / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    server = servers(image_export(base), extra_args=["--snapshot"])
    with handle(server.uri()) as h:
        assert not h.is_read_only()
        h.pwrite(b"\xee" * MiB, 3 * MiB)
        h.flush()
        assert h.pread(MiB, 3 * MiB) == b"\xee" * MiB
        assert list(tmp.iterdir()) == [], "the overlay has a name"
    server.stop()
    assert sha256(base) == before, "--snapshot wrote to the base"
    assert list(tmp.iterdir()) == []


# --- locks ---------------------------------------------------------------------------------------
def test_qemu_and_zcnbd_refuse_each_other(servers, data_dir):
    image = qcow2(data_dir / "d.qcow2")
    qemu_io(image, "write -P 0x61 0 64k")
    server = servers(image_export(image))
    p = run(["qemu-io", "-f", "qcow2", "-c", "read 0 512", image], check=False)
    assert p.returncode != 0 and "lock" in (p.stdout + p.stderr), p.stdout + p.stderr
    run(["qemu-io", "-U", "-r", "-f", "qcow2", "-c", "read -P 0x61 0 512", image])
    server.stop()
    with qemu_nbd(image):
        out = refused(image)
        assert "lock" in out and "another process" in out, out
        assert "lock" in refused(image, "-r")
        shared = servers(image_export(image, read_only=True), extra_args=["--force-share"])
        with handle(shared.uri()) as h:
            assert h.pread(512, 0) == b"\x61" * 512
        shared.stop()
    assert "read_only" in refused(image, "--force-share")


# --- full disk -----------------------------------------------------------------------------------
@pytest.fixture
def small_fs(data_dir):
    """A 24 MiB tmpfs (needs the right to mount)."""
    mnt = data_dir / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24M", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        missing(f"cannot mount a tmpfs for the full-disk test: {p.stderr.strip()}",
                hint="run the suite as root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_fails_the_write_with_enospc_and_the_image_stays_consistent(servers, small_fs):
    image = qcow2(small_fs / "d.qcow2", size=256 * MiB)
    server = servers(image_export(image))
    failed = None
    with handle(server.uri()) as h:
        for i in range(64):
            try:
                h.pwrite(pattern(MiB, i), i * MiB)
            except nbd.Error as e:
                failed = e
                break
        assert failed is not None, "24 MiB of tmpfs took 64 MiB"
        assert failed.errno == "ENOSPC", failed
        good = i
        for j in range(good):
            assert h.pread(4096, j * MiB) == pattern(MiB, j)[:4096]
        h.flush()
    server.stop()
    check_clean(image)


# --- the data path -------------------------------------------------------------------------------
def test_counters_show_clusters_sent_and_received_in_place(servers, data_dir):
    """On the io_uring engine, 1 MiB reads of clusters the image holds - in the image or in its
    raw base - leave by splice from the files, and writes to clusters it owns are spliced
    into the image file: no copy of ours."""
    args = ZCNBD_SERVE_ARGS
    engine = args[args.index("--engine") + 1] if "--engine" in args else "uring"
    data_path = args[args.index("--data-path") + 1] if "--data-path" in args else "auto"
    if engine == "portable" or data_path == "copy":
        pytest.skip(f"{engine} / {data_path}: reads and writes go through the stack by design")
    top = chain3(data_dir)
    qemu_io(top, f"write -P 0x12 {8 * MiB} {MiB}")
    port = free_tcp_port()
    # --splice-min-bytes: file reads are bounced through a buffer by default (the faster
    # choice under BBR, docs/benchmarks/history.md, section 9); here the splice path is the subject.
    server = servers(image_export(top), extra_args=["--metrics", f"127.0.0.1:{port}",
                                                    "--splice-min-bytes", str(64 * KiB)])
    with handle(server.uri()) as h:
        assert h.pread(MiB, 8 * MiB) == b"\x12" * MiB  # the image's own cluster
        assert h.pread(MiB, 0) == pattern(4 * MiB, seed=1)[:MiB]  # the raw base's
        h.pwrite(b"\x13" * MiB, 8 * MiB)  # allocated: in place
    c = settled_metrics(port, replies=3)
    assert c["sent_splice_bytes"] >= 2 * MiB, c
    assert c["received_splice_bytes"] >= MiB, c
    assert c["copied_bytes"] == 0, c
    server.stop()
    check_clean(top)


def test_direct_moves_data_clusters_with_o_direct(servers, data_dir):
    """--direct on a qcow2 over a raw base: on the io_uring engine 1 MiB reads of the image's
    own clusters and of the base's, and writes to clusters the image owns, are O_DIRECT I/O
    between the files and the ring's registered buffers - no copy of ours, nothing through
    the page cache's splice; an unaligned write and a read around it still land as qemu-nbd
    --cache=none has them."""
    top = chain3(data_dir)
    qemu_io(top, f"write -P 0x12 {8 * MiB} {MiB}")
    ref = data_dir / "ref.qcow2"
    shutil.copy(top, ref)
    port = free_tcp_port()
    server = servers(image_export(top, direct=True), extra_args=["--metrics", f"127.0.0.1:{port}"])
    with handle(server.uri()) as h:
        assert h.pread(MiB, 8 * MiB) == b"\x12" * MiB  # the image's own cluster
        assert h.pread(MiB, 0) == pattern(4 * MiB, seed=1)[:MiB]  # the raw base's
        h.pwrite(b"\x13" * MiB, 8 * MiB)  # allocated: in place
        h.flush()
    c = settled_metrics(port, replies=4)
    args = ZCNBD_SERVE_ARGS
    engine = args[args.index("--engine") + 1] if "--engine" in args else "uring"
    data_path = args[args.index("--data-path") + 1] if "--data-path" in args else "auto"
    if engine == "uring" and data_path != "copy":
        assert c["fixed_io_bytes"] == 3 * MiB and c["copied_bytes"] == 0, c
        assert c["sent_splice_bytes"] == 0 and c["received_splice_bytes"] == 0, c
    with handle(server.uri()) as h:
        h.pwrite(b"\x14" * 1000, 8 * MiB + 4097)
        assert h.pread(8192, 8 * MiB) == b"\x13" * 4097 + b"\x14" * 1000 + b"\x13" * 3095
        h.flush()
    server.stop()
    with qemu_nbd(ref, "--cache=none", "--aio=io_uring") as uri, handle(uri) as h:
        h.pwrite(b"\x13" * MiB, 8 * MiB)
        h.pwrite(b"\x14" * 1000, 8 * MiB + 4097)
    check_clean(top)
    run(["qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", top, ref])
