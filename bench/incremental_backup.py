#!/usr/bin/env python3
"""An incremental backup through a dirty bitmap against a full copy (issue 24), on one export
served by zcnbd with a tracked bitmap (-B backup, --control):

  1. full backup: `nbdcopy` of the whole export into a file (what every backup starts with);
  2. checkpoint: `zcnbd bitmap clear backup`;
  3. changes: CHANGED of the export rewritten, by a libnbd client, in writes of WRITE bytes
     at random offsets (seeded);
  4. incremental backup: a libnbd program asks block status of qemu:dirty-bitmap:backup and
     reads only the dirty extents into a copy of the full backup; the copy must then equal
     the export (`qemu-img compare`).

Prints a table (time and bytes read by each backup) and, with --json FILE, writes the numbers.

  bench/incremental_backup.py [--size 4G] [--changed 0.01] [--write 1M] [--dir /dev/shm/x]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbd

CONTEXT = "qemu:dirty-bitmap:backup"
DIRTY = 1


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def dirty_extents(h: nbd.NBD, size: int) -> list[tuple[int, int]]:
    dirty, offset = [], 0
    while offset < size:
        got = []

        def cb(meta, off, entries, err):
            if meta == CONTEXT:
                got.extend(zip(entries[0::2], entries[1::2]))
            return 0

        h.block_status(min(size - offset, 1 << 30), offset, cb)
        for length, flags in got:
            if flags & DIRTY:
                dirty.append((offset, length))
            offset += length
    return dirty


def incremental(uri: str, copy: Path) -> tuple[int, int]:
    """Reads the dirty extents into `copy`; returns (bytes read, extents)."""
    h = nbd.NBD()
    h.add_meta_context(CONTEXT)
    h.connect_uri(uri)
    assert h.can_meta_context(CONTEXT)
    extents = dirty_extents(h, h.get_size())
    read = 0
    with open(copy, "r+b") as f:
        for off, length in extents:
            while length:
                n = min(length, 32 << 20)
                f.seek(off)
                f.write(h.pread(n, off))
                read, off, length = read + n, off + n, length - n
    h.shutdown()
    return read, len(extents)


def change(uri: str, size: int, changed: float, write: int, seed: int) -> int:
    h = nbd.NBD()
    h.connect_uri(uri)
    rng = random.Random(seed)
    count = max(1, int(size * changed) // write)
    data = rng.randbytes(write)
    for _ in range(count):
        h.pwrite(data, rng.randrange(size // write) * write)
    h.flush()
    h.shutdown()
    return count * write


def timed(fn):
    start = time.monotonic()
    result = fn()
    return time.monotonic() - start, result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="4G")
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--write", default="1M", help="bytes per changing write")
    p.add_argument("--dir", default="/dev/shm/zcnbd-backup", help="scratch (removed at the end)")
    p.add_argument("--zcnbd", default=str(Path(__file__).resolve().parent.parent / "target/release/zcnbd"))
    p.add_argument("--json")
    a = p.parse_args()
    size, write = size_arg(a.size), size_arg(a.write)
    scratch = Path(a.dir)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    server = None
    try:
        disk = scratch / "disk.img"
        with open(disk, "wb") as f:
            chunk = random.Random(1).randbytes(64 << 20)
            for _ in range(size // len(chunk)):
                f.write(chunk)
        sock, ctl = scratch / "nbd.sock", scratch / "ctl.sock"
        server = subprocess.Popen([a.zcnbd, "serve", str(disk), "-s", str(sock), "--control", str(ctl),
                                   "-B", "backup"], stderr=subprocess.DEVNULL)
        while not sock.exists():
            time.sleep(0.05)
        uri = f"nbd+unix:///?socket={sock}"
        full = scratch / "full.img"
        full_s, _ = timed(lambda: subprocess.run(["nbdcopy", uri, str(full)], check=True))
        subprocess.run([a.zcnbd, "bitmap", "-c", str(ctl), "clear", "backup"], check=True,
                       stdout=subprocess.DEVNULL)
        written = change(uri, size, a.changed, write, seed=2)
        incr = scratch / "incr.img"
        shutil.copyfile(full, incr)
        incr_s, (read, extents) = timed(lambda: incremental(uri, incr))
        subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "raw", str(incr), uri], check=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "cpu": cpu_model(), "kernel": platform.release(), "size": size, "changed_fraction": a.changed,
        "write_bytes": write, "written_bytes": written, "granularity": 65536,
        "full": {"seconds": full_s, "bytes_read": size},
        "incremental": {"seconds": incr_s, "bytes_read": read, "extents": extents},
    }
    gib = 1 << 30
    print(f"Incremental backup of a {size / gib:.0f} GiB file export, {a.changed:.0%} changed in "
          f"{write // 1024} KiB writes ({written >> 20} MiB), bitmap granularity 64 KiB; {result['cpu']}")
    print()
    print("| backup | bytes read | time | ratio to full |")
    print("|---|---|---|---|")
    print(f"| full (nbdcopy) | {size >> 20} MiB | {full_s:.2f} s | 1.00 |")
    print(f"| incremental ({extents} dirty extents) | {read >> 20} MiB | {incr_s:.2f} s "
          f"| {incr_s / full_s:.3f} time, {read / size:.3f} bytes |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
