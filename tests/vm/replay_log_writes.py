#!/usr/bin/python3
"""Replays a dm-log-writes log (the kernel's log-writes target: every write, flush, FUA and
discard a device received, in completion order, and marks set by `dmsetup message`) onto an
empty device, and checks the guest's crash-consistency rounds at every mark.

The log (drivers/md/dm-log-writes.c, little-endian, in blocks of the logged device's sector
size S): block 0 is the super block (magic 0x6a736677736872, version 1, entry count, S); then
one block per entry header (sector and sector count in S-sized units, flags, data length;
a mark's text at byte 32 of its header block) followed by the entry's data (none for a
discard, a flush or a mark). Plain writes wait in the target until the next flush and are
logged just before it; FUA writes as they complete.

    replay_log_writes.py LOG DEVICE_BYTES

The guest (guest.d/26-log-writes.sh) wrote, for round r = 1, 2, ...: 256 KiB of byte r at
r x 256 KiB through zcnbd, sent FLUSH, and after FLUSH's reply set the mark "round-r". Replayed
to each mark, every earlier round's range must read back whole: a FLUSH zcnbd acknowledged
covers every write acknowledged before it, on the device itself, not in a page cache.

Then (from the mark "qcow2-made") the device holds a qcow2 image over a raw backing file of
8 MiB of 0xee, written through zcnbd as `QCOW2_ROUNDS` says. Replayed to every entry from
there, as a power cut at that moment would leave the device: `qemu-img check` finds no
corruption (leaked clusters are allowed, as QEMU leaves them), every 4 KiB block reads a
value that block held at some time (its backing data, zeroes after a trim, or any value
written there: never another block's data or stale bytes), and at each mark every block
reads exactly what was acknowledged.

Last (from the mark "bitmap-fs") the device holds an ext4 file system with a raw export and
its tracked bitmap's file, written as `BITMAP_ROUNDS` says. Replayed to every entry, the
journal repaired (`e2fsck -fy`, what a mount does) and the bitmap file read (`debugfs`): it
is absent, new, or marked in use (all dirty at the next start) anywhere, or closed cleanly
with every round written so far in its bits; at "b-stopped" it is closed cleanly.
Prints one line per check for the lab: NAME pass|fail DETAIL.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile

MAGIC = 0x6A736677736872
FLUSH, FUA, DISCARD, MARK = 1, 2, 4, 8
ROUND_BYTES = 256 * 1024
KIB, MIB = 1024, 1 << 20
BLOCK = 4096
QCOW2_BYTES = 24 * MIB
BASE_BYTES, BASE_BYTE = 8 * MIB, 0xEE
QCOW2_ROUNDS = 6


def qcow2_ops():
    """The guest's qcow2 workload in order: ("trim", at, len), ("write", at, len, byte) and
    ("mark", name)."""
    for r in range(1, QCOW2_ROUNDS + 1):
        at = r * MIB
        if r > 1:
            yield ("trim", at - MIB, 128 * KIB)
        yield ("write", at, 128 * KIB, 0x40 + r)
        yield ("write", at + 516 * KIB, 4 * KIB, 0x60 + r)
        yield ("mark", f"q-round-{r}")
        yield ("write", at + 768 * KIB, 64 * KIB, 0x80 + r)
        yield ("mark", f"q-fua-{r}")


class Qcow2Model:
    """What each 4 KiB block of the guest's qcow2 may read, and must read at each mark."""

    def __init__(self):
        blocks = QCOW2_BYTES // BLOCK
        start = [BASE_BYTE if b * BLOCK < BASE_BYTES else 0 for b in range(blocks)]
        self.allowed = [{v} for v in start]
        self.at_mark = {}
        now = list(start)
        for op in qcow2_ops():
            if op[0] == "mark":
                self.at_mark[op[1]] = list(now)
                continue
            value = 0 if op[0] == "trim" else op[3]
            for b in range(op[1] // BLOCK, (op[1] + op[2]) // BLOCK):
                now[b] = value
                self.allowed[b].add(value)


class Qcow2Replay:
    """Checks the device's image as replayed so far (see the module's documentation)."""

    def __init__(self, work: str):
        self.work = work
        self.model = Qcow2Model()
        self.base = os.path.join(work, "base.raw")
        with open(self.base, "wb") as f:
            f.write(bytes([BASE_BYTE]) * BASE_BYTES)
        self.points = 0
        self.marks = 0
        self.leaks = 0
        self.failure = None
        self.done = False

    def check(self, device: bytearray, entry: int, mark: str | None) -> None:
        if self.failure:
            return
        self.points += 1
        image = os.path.join(self.work, "image.qcow2")
        with open(image, "wb") as f:
            f.write(device)
        run = lambda *args: subprocess.run(["qemu-img", *args], capture_output=True, text=True)
        rebase = run("rebase", "-u", "-f", "qcow2", "-b", self.base, "-F", "raw", image)
        if rebase.returncode != 0:
            self.failure = f"entry {entry}: not an image qemu-img opens: {rebase.stderr.strip()}"
            return
        checked = run("check", "-f", "qcow2", image)
        if checked.returncode == 3:
            self.leaks += 1
        elif checked.returncode != 0:
            why = " ".join(checked.stdout.split()[:24])
            self.failure = f"entry {entry}: qemu-img check: {why}"
            return
        raw = os.path.join(self.work, "image.raw")
        converted = run("convert", "-f", "qcow2", "-O", "raw", image, raw)
        if converted.returncode != 0:
            self.failure = f"entry {entry}: qemu-img convert: {converted.stderr.strip()}"
            return
        with open(raw, "rb") as f:
            data = f.read()
        expected = self.model.at_mark.get(mark) if mark else None
        if mark:
            self.marks += 1
        for b in range(QCOW2_BYTES // BLOCK):
            block = data[b * BLOCK:(b + 1) * BLOCK]
            value = block[0]
            if block != bytes([value]) * BLOCK or value not in self.model.allowed[b]:
                self.failure = (f"entry {entry}: block at {b * BLOCK} reads "
                                f"{block[:8].hex()}..., which it never held")
                return
            if expected is not None and value != expected[b]:
                self.failure = (f"at mark {mark}: block at {b * BLOCK} reads {value:#x}, "
                                f"acknowledged {expected[b]:#x}")
                return

    def result(self) -> str:
        if self.failure:
            return f"host/log-writes-qcow2 fail 0 {self.failure}"
        if self.marks != 2 * QCOW2_ROUNDS:
            return f"host/log-writes-qcow2 fail 0 {self.marks} of {2 * QCOW2_ROUNDS} marks in the log"
        return (f"host/log-writes-qcow2 pass 0 replayed to {self.points} points ({self.marks} marks): "
                f"qemu-img check consistent ({self.leaks} with leaked clusters), no block read "
                "another's data, every acknowledged write at its mark")


def entries(log: bytes):
    """(flags, byte offset, data or None, mark text or None) for each logged entry."""
    magic, version, count, sector = struct.unpack_from("<QQQI", log, 0)
    if magic != MAGIC or version != 1 or sector not in (512, 1024, 2048, 4096):
        raise ValueError(f"not a log-writes log (magic {magic:#x}, version {version}, sector {sector})")
    pos = sector
    for _ in range(count):
        if pos + sector > len(log):
            raise ValueError("the log ends inside an entry")
        start, sectors, flags, data_len = struct.unpack_from("<QQQQ", log, pos)
        mark = log[pos + 32:pos + 32 + data_len].decode(errors="replace") if flags & MARK else None
        data_at = pos + sector
        size = sectors * sector
        data = None
        if not flags & (DISCARD | MARK) and size:
            data = log[data_at:data_at + size]
            pos = data_at + size
        else:
            pos = data_at
        yield flags, start * sector, size, data, mark


BITMAP_FILE = "disk.raw.b0.zcnbd-bitmap"
BITMAP_GRANULE = 64 * KIB


def bitmap_round_granules(r: int) -> range:
    """Round r of the bitmap phase: 64 KiB at r MiB."""
    return range(r * MIB // BITMAP_GRANULE, (r * MIB + 64 * KIB) // BITMAP_GRANULE)


class BitmapReplay:
    """Checks the tracked bitmap's file in the device's file system as replayed so far."""

    def __init__(self, work: str):
        self.work = work
        self.points = self.clean = 0
        self.rounds = 0  # rounds whose FLUSH was acknowledged (marks seen)
        self.failure = None
        self.stopped_clean = None

    def read(self, device: bytearray) -> bytes | None:
        image = os.path.join(self.work, "fs.img")
        with open(image, "wb") as f:
            f.write(device)
        fsck = subprocess.run(["e2fsck", "-fy", image], capture_output=True, text=True)
        if fsck.returncode not in (0, 1):
            raise ValueError(f"e2fsck could not repair the file system ({fsck.returncode})")
        out = os.path.join(self.work, "bitmap")
        if os.path.exists(out):
            os.remove(out)
        subprocess.run(["debugfs", "-R", f"dump /{BITMAP_FILE} {out}", image],
                       capture_output=True)
        if not os.path.exists(out):
            return None
        with open(out, "rb") as f:
            return f.read()

    def check(self, device: bytearray, entry: int, mark: str | None) -> None:
        if self.failure:
            return
        if mark and mark.startswith("b-round-"):
            self.rounds = int(mark.removeprefix("b-round-"))
        self.points += 1
        try:
            data = self.read(device)
        except ValueError as e:
            self.failure = f"entry {entry}: {e}"
            return
        if mark == "b-stopped":
            self.stopped_clean = False
        if not data:
            return  # not made yet, or made empty: a new bitmap
        if len(data) < 88 or data[:8] != b"ZCNBDBM\0":
            self.failure = f"entry {entry}: the bitmap file is torn ({len(data)} bytes)"
            return
        version, flags, granularity, size = struct.unpack_from("<IIQQ", data, 8)
        if flags & 1:
            return  # in use: all dirty at the next start
        words = data[88:]
        if version != 2 or granularity != BITMAP_GRANULE or len(words) * 8 * granularity < size:
            self.failure = f"entry {entry}: a clean bitmap file with a bad header or length"
            return
        self.clean += 1
        if mark == "b-stopped":
            self.stopped_clean = True
        for r in range(1, 4):
            for g in bitmap_round_granules(r):
                if not words[g // 8] >> (g % 8) & 1:
                    self.failure = (f"entry {entry}: saved clean, but round {r}'s write at "
                                    f"{g * granularity} is not in it")
                    return

    def result(self) -> str:
        if self.failure:
            return f"host/log-writes-bitmap fail 0 {self.failure}"
        if self.stopped_clean is not True:
            return "host/log-writes-bitmap fail 0 at b-stopped the bitmap file is not closed cleanly"
        return (f"host/log-writes-bitmap pass 0 replayed to {self.points} points: the bitmap "
                f"file absent, new or in use everywhere but {self.clean}, where it was closed "
                "cleanly with every round's write in it")


def main() -> int:
    log_path, device_bytes = sys.argv[1], int(sys.argv[2])
    os.environ["PATH"] += ":/usr/sbin:/sbin"  # e2fsck, debugfs
    with open(log_path, "rb") as f:
        log = f.read()
    device = bytearray(device_bytes)
    flushes = marks = 0
    failures = []
    work = tempfile.TemporaryDirectory()
    qcow2 = bitmap = None
    for entry, (flags, offset, size, data, mark) in enumerate(entries(log)):
        if data is not None:
            device[offset:offset + size] = data
        elif flags & DISCARD:
            device[offset:offset + size] = bytes(size)
        if flags & FLUSH:
            flushes += 1
        if mark == "qcow2-made":
            qcow2 = Qcow2Replay(work.name)
        if mark == "qcow2-done" and qcow2:
            qcow2.done = True
        if mark == "bitmap-fs":
            bitmap = BitmapReplay(work.name)
        if qcow2 and not qcow2.done and (
                data is not None or flags & DISCARD or (mark or "").startswith("q-")):
            qcow2.check(device, entry, mark)
        if bitmap and (data is not None or flags & DISCARD or (mark or "").startswith("b-")):
            bitmap.check(device, entry, mark)
        if mark and mark.startswith("round-"):
            marks += 1
            r = int(mark.removeprefix("round-"))
            for k in range(1, r + 1):
                got = device[k * ROUND_BYTES:(k + 1) * ROUND_BYTES]
                if got != bytes([k]) * ROUND_BYTES:
                    failures.append(f"at mark {mark}: round {k}'s flushed write is not on the device")
                    break
    if marks == 0:
        print("host/log-writes-raw fail 0 no round marks in the log")
    elif failures:
        print(f"host/log-writes-raw fail 0 {failures[0]} ({len(failures)} marks failed)")
    else:
        print(f"host/log-writes-raw pass 0 replayed to {marks} marks ({flushes} flushes): "
              "every acknowledged FLUSH's writes on the device")
    print(qcow2.result() if qcow2 else "host/log-writes-qcow2 fail 0 no qcow2-made mark in the log")
    print(bitmap.result() if bitmap else "host/log-writes-bitmap fail 0 no bitmap-fs mark in the log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
