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
Prints one line per check for the lab: NAME pass|fail DETAIL.
"""

from __future__ import annotations

import struct
import sys

MAGIC = 0x6A736677736872
FLUSH, FUA, DISCARD, MARK = 1, 2, 4, 8
ROUND_BYTES = 256 * 1024


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


def main() -> int:
    log_path, device_bytes = sys.argv[1], int(sys.argv[2])
    with open(log_path, "rb") as f:
        log = f.read()
    device = bytearray(device_bytes)
    flushes = marks = 0
    failures = []
    for flags, offset, size, data, mark in entries(log):
        if data is not None:
            device[offset:offset + size] = data
        elif flags & DISCARD:
            device[offset:offset + size] = bytes(size)
        if flags & FLUSH:
            flushes += 1
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
        return 0
    if failures:
        print(f"host/log-writes-raw fail 0 {failures[0]} ({len(failures)} marks failed)")
    else:
        print(f"host/log-writes-raw pass 0 replayed to {marks} marks ({flushes} flushes): "
              "every acknowledged FLUSH's writes on the device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
