"""Dirty bitmaps for incremental backup (qemu:dirty-bitmap:NAME), as backup tools read them:
bitmaps zcnbd tracks itself (-B NAME on memory and file exports, managed on a running server
with `zcnbd bitmap` through --control), an RBD image's snapshots, and a qcow2 image's
persistent bitmaps (qemu-nbd -B is the oracle). The backup round trip is the proof: a full
copy with nbdcopy, changes (fio with verify, trims, zeroes), then only the extents the bitmap
marks dirty are read with a libnbd script and applied to the copy, which must then equal the
export (qemu-img compare) with fewer bytes copied than the whole."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import socket
import threading
import time
from pathlib import Path

import nbd
import pytest

from support import (
    KiB, MiB, ZCNBD_BIN, Export, handle, pattern, require_tools, run,
)

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's bitmaps (qemu-nbd is the oracle for qcow2)")

G = 64 * KiB  # the default granularity
DIRTY = 1


def bitmap_args(workdir: Path, *names: str) -> tuple[list[str], Path]:
    """-B NAME... and a control socket in `workdir`."""
    ctl = workdir / "ctl.sock"
    args = ["--control", str(ctl)]
    for n in names:
        args += ["-B", n]
    return args, ctl


def wait_for(ctl: Path) -> None:
    """The control socket is made once the server is set up, a moment after its NBD socket
    (bound first) takes connections: wait for it, as `--fork`'s return does."""
    deadline = time.monotonic() + 5
    while not ctl.exists():
        assert time.monotonic() < deadline, f"no control socket at {ctl}"
        time.sleep(0.01)


def control(ctl: Path, *args: str, export: str | None = None, check: bool = True):
    wait_for(ctl)
    argv = [str(ZCNBD_BIN), "bitmap", "-c", str(ctl), "--json"]
    if export is not None:
        argv += ["-x", export]
    out = run(argv + list(args), check=False)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def dirty_map(uri: str, context: str) -> list[tuple[int, int, int]]:
    """The whole export's extents of `context`: (offset, length, flags), neighbours with the
    same flags merged (as `nbdinfo --map` prints them)."""
    out = run(["nbdinfo", "--json", f"--map={context}", uri]).stdout
    merged: list[tuple[int, int, int]] = []
    for e in json.loads(out):
        o, l, t = e["offset"], e["length"], e["type"]
        if merged and merged[-1][2] == t and merged[-1][0] + merged[-1][1] == o:
            merged[-1] = (merged[-1][0], merged[-1][1] + l, t)
        else:
            merged.append((o, l, t))
    return merged


def dirty_ranges(uri: str, context: str) -> list[tuple[int, int]]:
    return [(o, l) for o, l, t in dirty_map(uri, context) if t & DIRTY]


def apply_changes(uri: str, context: str, copy: Path) -> int:
    """The incremental step of a backup, as a backup tool's libnbd script does it: read the
    extents `context` marks dirty and write them into `copy`. Returns the bytes copied."""
    h = nbd.NBD()
    h.add_meta_context(context)
    h.connect_uri(uri)
    assert h.can_meta_context(context), f"{context} not negotiated"
    size = h.get_size()
    dirty, offset = [], 0
    while offset < size:
        got = []

        def cb(meta, off, entries, err):
            if meta == context:
                got.extend(zip(entries[0::2], entries[1::2]))
            return 0

        h.block_status(min(size - offset, 1 << 30), offset, cb)
        assert got, "no extents"
        for length, flags in got:
            if flags & DIRTY:
                dirty.append((offset, length))
            offset += length
    copied = 0
    with open(copy, "r+b") as f:
        for off, length in dirty:
            while length > 0:
                n = min(length, 16 * MiB)
                f.seek(off)
                f.write(h.pread(n, off))
                copied += n
                off += n
                length -= n
    h.shutdown()
    return copied


def change(uri: str) -> None:
    """What a guest does between two backups: fio random writes with verify in one region,
    a trim and a write of zeroes elsewhere; about 3 MiB of a 64 MiB export."""
    require_tools("fio")
    run(["fio", "--name=changes", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
         "--bs=4k", "--offset=8M", "--size=2M", "--io_size=512k", "--verify=crc32c",
         "--do_verify=1", "--verify_state_save=0", "--randseed=7"], timeout=120)
    with handle(uri) as h:
        h.trim(G, 20 * MiB)
        h.zero(2 * G, 40 * MiB + 12345)
        h.flush()


def full_copy(uri: str, dest: Path) -> None:
    require_tools("nbdcopy")
    run(["nbdcopy", uri, str(dest)])


def assert_same(uri: str, copy: Path) -> None:
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", str(copy), uri])


def round_trip(uri: str, context: str, copy: Path, checkpoint) -> int:
    """Full backup, checkpoint, changes, incremental backup: the copy equals the export, and
    fewer bytes were copied than the whole. Returns the bytes the incremental step copied."""
    full_copy(uri, copy)
    checkpoint()
    change(uri)
    copied = apply_changes(uri, context, copy)
    assert_same(uri, copy)
    size = os.path.getsize(copy)
    assert 0 < copied < size // 4, f"copied {copied} of {size}"
    return copied


# --- bitmaps zcnbd tracks ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_tracked_bitmap_records_writes_trims_and_zeroes(servers, export_factory, data_dir, kind):
    args, _ = bitmap_args(data_dir, "b0")
    server = servers(export_factory(kind), extra_args=args)
    uri = server.uri()
    assert dirty_map(uri, "qemu:dirty-bitmap:b0") == [(0, 64 * MiB, 0)]
    with handle(uri) as h:
        h.pwrite(pattern(10, 1), G - 5)          # two granules
        h.trim(G, 10 * MiB)                      # one
        h.zero(3 * G, 20 * MiB + 1)              # four: unaligned
        h.pwrite(pattern(1 * MiB, 2), 30 * MiB)  # sixteen
    assert dirty_ranges(uri, "qemu:dirty-bitmap:b0") == [
        (0, 2 * G), (10 * MiB, G), (20 * MiB, 4 * G), (30 * MiB, 1 * MiB)]
    # NBD_CMD_FLAG_REQ_ONE and the request's length, as for base:allocation.
    h = nbd.NBD()
    h.add_meta_context("qemu:dirty-bitmap:b0")
    h.connect_uri(uri)
    got = []
    h.block_status(G // 2, 0, lambda m, o, e, err: got.append((m, list(e))) or 0,
                   flags=nbd.CMD_FLAG_REQ_ONE)
    assert got == [("qemu:dirty-bitmap:b0", [G // 2, DIRTY])]
    got.clear()
    h.block_status(4 * G, G, lambda m, o, e, err: got.append(list(e)) or 0)
    assert got == [[G, DIRTY, 3 * G, 0]]
    h.shutdown()
    # A context that does not exist is left out, as the spec says.
    h = nbd.NBD()
    h.add_meta_context("qemu:dirty-bitmap:nosuch")
    h.add_meta_context("base:allocation")
    h.connect_uri(uri)
    assert not h.can_meta_context("qemu:dirty-bitmap:nosuch")
    assert h.can_meta_context("base:allocation")
    h.shutdown()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_backup_round_trip_through_a_tracked_bitmap(servers, export_factory, data_dir, kind):
    args, ctl = bitmap_args(data_dir, "backup")
    server = servers(export_factory(kind), extra_args=args)
    copy = data_dir / "copy.img"
    round_trip(server.uri(), "qemu:dirty-bitmap:backup", copy,
               lambda: control(ctl, "clear", "backup"))


def test_tracked_bitmaps_survive_a_clean_restart_and_not_kill_9(servers, export_factory, data_dir):
    export = export_factory("file")
    args, ctl = bitmap_args(data_dir, "b0")
    server = servers(export, extra_args=args)
    with handle(server.uri()) as h:
        h.pwrite(pattern(4096, 3), 5 * MiB)
    server.stop()
    bitmap_file = export.path.parent / f"{export.path.name}.b0.zcnbd-bitmap"
    assert bitmap_file.exists()
    assert "bitmap saved" in server.log()
    server = servers(export, extra_args=args)
    assert "bitmap kept from the last run" in server.log()
    assert dirty_ranges(server.uri(), "qemu:dirty-bitmap:b0") == [(5 * MiB, G)]
    with handle(server.uri()) as h:
        h.pwrite(pattern(4096, 4), 7 * MiB)
    server.kill()
    server.proc.wait(10)
    server = servers(export, extra_args=args)
    assert "not saved cleanly" in server.log()
    # Never silently clean: all dirty, so the next incremental backup copies everything.
    assert dirty_map(server.uri(), "qemu:dirty-bitmap:b0") == [(0, 64 * MiB, DIRTY)]
    # Cleared, it is trusted again from there.
    control(ctl, "clear", "b0")
    assert dirty_ranges(server.uri(), "qemu:dirty-bitmap:b0") == []


@pytest.mark.parametrize("kind", ["file", "qcow2"])
def test_a_file_written_while_zcnbd_was_stopped_makes_its_bitmaps_all_dirty(
        servers, export_factory, data_dir, kind):
    """A bitmap saved cleanly is trusted only while its file is as zcnbd left it: written by
    someone else in between (dd, QEMU), it starts all dirty."""
    if kind == "file":
        export = export_factory("file")
    else:
        require_tools("qemu-img", "qemu-io")
        path = data_dir / "disk.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "64M"])
        export = Export(kind="file", path=path, size=0)
    args, _ = bitmap_args(data_dir, "b0")
    server = servers(export, extra_args=args)
    with handle(server.uri()) as h:
        h.pwrite(pattern(4096, 3), 5 * MiB)
    server.stop()
    # Restarted untouched: the bitmap is kept (an image's open and close wrote nothing zcnbd
    # did not record).
    server = servers(export, extra_args=args)
    assert "bitmap kept from the last run" in server.log()
    assert dirty_ranges(server.uri(), "qemu:dirty-bitmap:b0") == [(5 * MiB, G)]
    server.stop()
    time.sleep(0.02)
    if kind == "file":
        with open(export.path, "r+b") as f:
            f.seek(9 * MiB)
            f.write(b"written while stopped")
    else:
        run(["qemu-io", "-f", "qcow2", "-c", "write -P 7 9M 64k", str(export.path)])
    server = servers(export, extra_args=args)
    assert "changed while zcnbd was stopped" in server.log()
    assert dirty_map(server.uri(), "qemu:dirty-bitmap:b0") == [(0, 64 * MiB, DIRTY)]


def test_bitmaps_are_added_cleared_and_removed_while_a_client_writes(servers, export_factory, data_dir):
    args, ctl = bitmap_args(data_dir)
    server = servers(export_factory("file"), extra_args=args)
    uri = server.uri()
    stop, errors, acked = threading.Event(), [], []

    def writer():
        try:
            with handle(uri) as h:
                i = 0
                while not stop.is_set():
                    off = (i % 256) * G
                    h.pwrite(pattern(4096, i), off)
                    acked.append((time.monotonic(), off))
                    i += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    try:
        time.sleep(0.2)
        # Made while the writer writes: a client that connects now sees it.
        control(ctl, "add", "b1", "--granularity", "128K")
        listed = json.loads(control(ctl, "list").stdout)["bitmaps"]
        assert [(b["name"], b["granularity"]) for b in listed] == [("b1", 128 * KiB)]
        time.sleep(0.3)
        assert dirty_ranges(uri, "qemu:dirty-bitmap:b1"), "writes after the add are recorded"
        old = nbd.NBD()
        old.add_meta_context("qemu:dirty-bitmap:b1")
        old.connect_uri(uri)
        # Cleared while the writer writes: every write acknowledged after the clear is in it.
        cleared_at = time.monotonic()
        control(ctl, "clear", "b1")
        time.sleep(0.3)
        after = {off for at, off in list(acked) if at > cleared_at + 0.05}
        assert after, "the writer stalled"
        dirty = dirty_ranges(uri, "qemu:dirty-bitmap:b1")
        for off in after:
            assert any(o <= off < o + l for o, l in dirty), f"write at {off} acknowledged after the clear is missing"
        # Removed: new clients no longer see it; one that negotiated it gets an error.
        control(ctl, "remove", "b1")
        with pytest.raises(nbd.Error):
            old.block_status(G, 0, lambda *a: 0)
        old.shutdown()
        h = nbd.NBD()
        h.add_meta_context("qemu:dirty-bitmap:b1")
        h.connect_uri(uri)
        assert not h.can_meta_context("qemu:dirty-bitmap:b1")
        h.shutdown()
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors


def test_the_control_socket_refuses_what_it_cannot_do(servers, export_factory, data_dir):
    args, ctl = bitmap_args(data_dir)
    server = servers(export_factory("memory"), extra_args=args)
    wait_for(ctl)
    assert stat.S_IMODE(os.stat(ctl).st_mode) == 0o600
    cases = [
        (["add", ".hidden"], "bitmap name"),
        (["add", "b", "--granularity", "1000"], "granularity"),
        (["clear", "nosuch"], "has no bitmap"),
        (["remove", "nosuch"], "has no bitmap"),
    ]
    for argv, why in cases:
        out = control(ctl, *argv, check=False)
        assert out.returncode != 0 and why in out.stderr, (argv, out.stderr)
    out = control(ctl, "list", export="nosuch", check=False)
    assert out.returncode != 0 and "no export" in out.stderr
    control(ctl, "add", "b")
    out = control(ctl, "add", "b", check=False)
    assert out.returncode != 0 and "already has" in out.stderr
    # Not JSON, and too long: refused, and the server goes on.
    for line in (b"hello\n", b"x" * 10000 + b"\n"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(ctl))
        s.sendall(line)
        reply = json.loads(s.makefile().readline())
        assert reply["ok"] is False and reply["error"], reply
        s.close()
    assert "control request refused" in server.log()
    assert json.loads(control(ctl, "list").stdout)["bitmaps"][0]["name"] == "b"


def test_bitmap_limits_are_named_at_start(data_dir):
    # 4 TiB at 512 bytes: 2^33 bits, over BITMAP_BITS_MAX (2^31).
    out = run([str(ZCNBD_BIN), "serve", "--null", "4T", "-B", "b", "--bitmap-granularity", "512",
               "-s", str(data_dir / "s")], check=False, timeout=20)
    assert out.returncode != 0
    assert "8589934592 bits" in out.stderr and "BITMAP_BITS_MAX" in out.stderr, out.stderr
    # A device (or an RBD image) has no directory of its own for them.
    out = run([str(ZCNBD_BIN), "serve", "/dev/null", "-B", "b", "-s", str(data_dir / "s")],
              check=False, timeout=20)
    assert out.returncode != 0 and "--bitmap-dir" in out.stderr, out.stderr
    assert not Path("/dev/null.b.zcnbd-bitmap").exists()


# --- Ceph RBD snapshots ----------------------------------------------------------------------
def test_rbd_snapshots_are_offered_as_bitmaps_and_back_up_incrementally(
        rbd_export, servers, ceph_cluster, data_dir):
    image = rbd_export.rbd
    with_image = servers(rbd_export)
    with handle(with_image.uri()) as h:
        h.pwrite(pattern(4 * MiB, 1), 0)
        h.flush()
    ceph_cluster.rbd("snap", "create", f"{image}@snap1")
    change(with_image.uri())
    ceph_cluster.rbd("snap", "create", f"{image}@snap2")
    with handle(with_image.uri()) as h:
        h.pwrite(pattern(4096, 9), 50 * MiB)  # after snap2: not in the backup
        h.flush()
    with_image.stop()

    def served(spec: str):
        return servers(Export(kind="rbd", rbd=spec, ceph_conf=rbd_export.ceph_conf))

    snap1, snap2 = served(f"{image}@snap1"), served(f"{image}@snap2")
    contexts = run(["nbdinfo", "--list", "--content", snap2.uri()]).stdout
    assert "qemu:dirty-bitmap:snap1" in contexts and "qemu:dirty-bitmap:snap2" not in contexts
    # The full backup of snap1, then what changed up to snap2 read through snap1's bitmap.
    copy = data_dir / "rbd-copy.img"
    full_copy(snap1.uri(), copy)
    copied = apply_changes(snap2.uri(), "qemu:dirty-bitmap:snap1", copy)
    assert_same(snap2.uri(), copy)
    assert 0 < copied < 64 * MiB // 4, copied
    # The same bytes as Ceph's own export of snap2.
    theirs = data_dir / "rbd-snap2.img"
    ceph_cluster.export_image(f"{image}@snap2", theirs)
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", str(copy), str(theirs)])
    # The image itself offers both snapshots.
    head = served(image)
    contexts = run(["nbdinfo", "--list", "--content", head.uri()]).stdout
    assert "qemu:dirty-bitmap:snap1" in contexts and "qemu:dirty-bitmap:snap2" in contexts
    # Ceph's own answer is the oracle: `rbd diff --from-snap`, neighbours merged.
    theirs = json.loads(ceph_cluster.rbd("diff", "--from-snap", "snap2", "--format", "json",
                                         image).stdout)
    expected: list[tuple[int, int]] = []
    for e in sorted(theirs, key=lambda e: e["offset"]):
        if expected and sum(expected[-1]) == e["offset"]:
            expected[-1] = (expected[-1][0], expected[-1][1] + e["length"])
        else:
            expected.append((e["offset"], e["length"]))
    ours = dirty_ranges(head.uri(), "qemu:dirty-bitmap:snap2")
    assert ours == expected, (ours, theirs)
    assert any(o <= 50 * MiB and 50 * MiB + 4096 <= o + l for o, l in ours)


# --- qcow2 persistent bitmaps (qemu-nbd -B is the oracle) ---------------------------------------
def qcow2_with_bitmaps(path: Path) -> Path:
    """A 64 MiB qcow2 image with bitmaps b0 (64 KiB), b1 (512 bytes), b2 (2 MiB, disabled after
    the first writes), then writes through qemu-io that the enabled ones record."""
    require_tools("qemu-img", "qemu-io", "qemu-nbd", "nbdinfo")
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "64M"])
    run(["qemu-img", "bitmap", "--add", str(path), "b0"])
    run(["qemu-img", "bitmap", "--add", "-g", "512", str(path), "b1"])
    run(["qemu-img", "bitmap", "--add", "-g", "2M", str(path), "b2"])
    qemu_io(path, "write -P 1 1M 64k", "write -P 2 10000 3000")
    run(["qemu-img", "bitmap", "--disable", str(path), "b2"])
    qemu_io(path, "write -P 3 40M 1M", "write -z 50M 128k", "discard 60M 64k")
    return path


def qemu_io(path: Path, *commands: str) -> None:
    argv = ["qemu-io", "-f", "qcow2"]
    for c in commands:
        argv += ["-c", c]
    run(argv + [str(path)])


def qemu_nbd(path: Path, *args: str) -> subprocess.Popen:
    sock = path.parent / "q.sock"
    proc = subprocess.Popen(["qemu-nbd", "-f", "qcow2", "-t", "-k", str(sock), *args, str(path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not sock.exists():
        if proc.poll() is not None:
            return proc
        assert time.monotonic() < deadline, "qemu-nbd did not start"
        time.sleep(0.02)
    proc.uri = f"nbd+unix:///?socket={sock}"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def image_export(path: Path, **kw) -> Export:
    return Export(kind="file", path=path, size=0, **kw)


def test_qcow2_bitmaps_read_as_qemu_nbd_reads_them(servers, data_dir):
    image = qcow2_with_bitmaps(data_dir / "disk.qcow2")
    server = servers(image_export(image, read_only=True), extra_args=["-B", "b0", "-B", "b1", "-B", "b2"])
    contexts = run(["nbdinfo", "--list", "--content", server.uri()]).stdout
    for name in ("b0", "b1", "b2"):
        assert f"qemu:dirty-bitmap:{name}" in contexts
    for name in ("b0", "b1", "b2"):
        q = qemu_nbd(image, "-r", "-B", name)
        try:
            context = f"qemu:dirty-bitmap:{name}"
            ours = run(["nbdinfo", f"--map={context}", server.uri()]).stdout
            theirs = run(["nbdinfo", f"--map={context}", q.uri]).stdout
            assert ours == theirs, f"{name}\n--- zcnbd ---\n{ours}--- qemu-nbd ---\n{theirs}"
            # QEMU's own client reads it the same way (its x-dirty-bitmap hack).
            def qemu_map(sock_uri: str) -> str:
                sock = sock_uri.split("socket=")[1]
                opts = f"driver=nbd,server.type=unix,server.path={sock},x-dirty-bitmap={context}"
                return run(["qemu-img", "map", "--output=json", "--image-opts", opts]).stdout
            assert qemu_map(server.uri()) == qemu_map(q.uri)
        finally:
            stop(q)
    # The written ranges, as QEMU recorded them (b2 stopped recording when disabled).
    assert dirty_ranges(server.uri(), "qemu:dirty-bitmap:b0") == [
        (0, G), (1 * MiB, G), (40 * MiB, 1 * MiB), (50 * MiB, 2 * G), (60 * MiB, G)]
    assert dirty_ranges(server.uri(), "qemu:dirty-bitmap:b2") == [(0, 2 * MiB)]


def test_a_bitmap_in_use_is_refused_as_qemu_nbd_refuses_it(data_dir):
    image = qcow2_with_bitmaps(data_dir / "disk.qcow2")
    # QEMU marks a bitmap in use while it has the image open; killed, it leaves the mark.
    io = subprocess.Popen(["qemu-io", "-f", "qcow2", "-c", "sleep 20000", str(image)])
    time.sleep(1)
    io.kill()
    io.wait(10)
    q = qemu_nbd(image, "-r", "-B", "b0")
    assert q.poll() is not None or q.wait(10) != 0, "qemu-nbd serves an in-use bitmap"
    out = run([str(ZCNBD_BIN), "serve", "-r", "-B", "b0", str(image), "-s", str(data_dir / "s")],
              check=False, timeout=20)
    assert out.returncode != 0 and "b0" in out.stderr and "in use" in out.stderr, out.stderr


def test_a_writable_image_with_bitmaps_needs_invalidate_bitmaps(servers, data_dir):
    image = qcow2_with_bitmaps(data_dir / "disk.qcow2")
    before = image.read_bytes()
    out = run([str(ZCNBD_BIN), "serve", str(image), "-s", str(data_dir / "s")], check=False, timeout=20)
    assert out.returncode != 0 and "--invalidate-bitmaps" in out.stderr and "b0" in out.stderr, out.stderr
    assert image.read_bytes() == before, "a refused open changed the image"
    out = run([str(ZCNBD_BIN), "serve", "-B", "b0", "--invalidate-bitmaps", str(image),
               "-s", str(data_dir / "s")], check=False, timeout=20)
    assert out.returncode != 0 and "-r" in out.stderr, out.stderr
    server = servers(image_export(image), extra_args=["--invalidate-bitmaps"])
    with handle(server.uri()) as h:
        h.pwrite(pattern(4096, 5), 30 * MiB)
        h.flush()
    server.stop()
    assert "marked in use" in server.log()
    # Nobody trusts them afterwards: qemu-nbd refuses (or no longer finds) the bitmap.
    q = qemu_nbd(image, "-r", "-B", "b0")
    assert q.poll() is not None or q.wait(10) != 0, "a stale bitmap is served"
    # QEMU says so itself; the image is consistent, the bitmaps' clusters now unreferenced
    # (leaks, which `qemu-img check -r leaks` gives back).
    out = run(["qemu-img", "check", "--output=json", str(image)], check=False)
    assert "bitmaps are now considered inconsistent" in out.stderr, out.stderr
    report = json.loads(out.stdout)
    assert report.get("corruptions", 0) == 0 and out.returncode in (0, 3), report


def test_backup_round_trip_through_a_qcow2_bitmap(servers, data_dir):
    require_tools("qemu-img", "qemu-io")
    image = data_dir / "vm.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"])
    qemu_io(image, "write -P 7 0 48M")
    # The full backup, and the checkpoint: a new bitmap from here on.
    copy = data_dir / "copy.img"
    run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(image), str(copy)])
    run(["qemu-img", "bitmap", "--add", str(image), "since-full"])
    qemu_io(image, "write -P 8 5M 1M", "write -P 9 33M 4k", "write -z 20M 2M", "discard 40M 1M")
    server = servers(image_export(image, read_only=True), extra_args=["-B", "since-full"])
    copied = apply_changes(server.uri(), "qemu:dirty-bitmap:since-full", copy)
    assert_same(server.uri(), copy)
    assert copied == 1 * MiB + G + 2 * MiB + 1 * MiB, copied
