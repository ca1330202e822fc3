"""The concurrency model test (issue 34): several connections at once issue random writes,
trims, write-zeroes and reads, overlapping each other and not, with payloads sent whole, in
slow pieces, or cut short by a dropped connection, against a qcow2 image (64 KiB clusters;
4 KiB clusters over a raw backing file), a raw file (alone, and under the cache filter, whose
held blocks are places an engine reads) and a memory export, each with a tracked
dirty bitmap. A model says what every 512-byte unit may hold after each round:

- a unit no request of the round touched holds what it held;
- a unit that only one connection's requests touched, none cut short, holds what those
  requests leave in order (a write's bytes; zeroes; a trim: the old bytes or zeroes);
- a unit that requests of several connections, or a cut-short write, touched holds, byte by
  byte, one of their values or the old one (concurrent copies into one page may tear), never
  anything else (another unit's data, another cluster's, a freed cluster's new owner's);

and after every round (everything flushed): `qemu-img check` finds the image clean, every
unit agrees with the model, every unit that changed is dirty in the bitmap, and so is every
acknowledged write, trim and zero. Seeded: ZCNBD_MODEL_SEED picks the seed (default: fixed
per export kind), ZCNBD_MODEL_ROUNDS the rounds (default 4: the suite's short mode; a long
run for fuzzing sets hundreds), ZCNBD_MODEL_CONNECTIONS the connections (default 4).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nbdproto import (
    CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, CMD_FLUSH, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES,
    connect_and_go,
)
from support import KiB, MiB, ZCNBD_BIN, Export, require_tools, run

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's engines and tracked bitmaps")

UNIT = 512
SIZE = 8 * MiB
UNITS = SIZE // UNIT
ROUNDS = int(os.environ.get("ZCNBD_MODEL_ROUNDS", "4"))
CONNECTIONS = int(os.environ.get("ZCNBD_MODEL_CONNECTIONS", "4"))
OPS_PER_CONNECTION = 12
ZEROES = bytes(UNIT)


@dataclass
class Op:
    conn: int
    seq: int
    kind: str  # write | trim | zero | read
    offset: int
    length: int
    data: bytes = b""
    flags: int = 0
    pieces: int = 1  # a write's payload sent in this many pieces, slowly if more than one
    cut_at: int | None = None  # a write cut short after this many payload bytes
    outcome: str = "pending"  # ok | error | cut

    def units(self) -> range:
        return range(self.offset // UNIT, (self.offset + self.length) // UNIT)

    def value(self, u: int) -> bytes:
        """What this request leaves in unit `u` if it lands."""
        if self.kind == "write":
            at = u * UNIT - self.offset
            return self.data[at:at + UNIT]
        return ZEROES


def random_range(rng: random.Random) -> tuple[int, int]:
    """Half the requests in a hot first MiB (so that they overlap), lengths from a unit to
    256 KiB, clusters and parts of them."""
    length = rng.choice([UNIT, 4 * KiB, 8 * KiB, 60 * KiB, 64 * KiB, 128 * KiB, 256 * KiB])
    hot = rng.random() < 0.5
    top = (1 * MiB if hot else SIZE) - length
    return rng.randrange(0, top // UNIT + 1) * UNIT, length


def plan(rng: random.Random, conn: int) -> list[Op]:
    ops = []
    for seq in range(OPS_PER_CONNECTION):
        offset, length = random_range(rng)
        kind = rng.choices(["write", "trim", "zero", "read"], [6, 1, 1, 2])[0]
        op = Op(conn, seq, kind, offset, length)
        if kind == "write":
            op.data = rng.randbytes(length)
            op.flags = CMD_FLAG_FUA if rng.random() < 0.1 else 0
            op.pieces = rng.choice([1, 1, 1, 2, 4])
            if rng.random() < 0.07:
                op.cut_at = rng.randrange(0, length // UNIT) * UNIT
        elif kind == "zero" and rng.random() < 0.5:
            op.flags = CMD_FLAG_NO_HOLE
        ops.append(op)
    return ops


def run_connection(address, ops: list[Op], rng: random.Random, errors: list) -> None:
    c = connect_and_go(address, timeout=60)
    try:
        for op in ops:
            if op.kind == "write" and op.cut_at is not None:
                # The header and part of the payload, then the connection is dropped.
                c.send_request(CMD_WRITE, op.offset, op.length, op.flags,
                               payload=op.data[:op.cut_at])
                time.sleep(rng.uniform(0, 0.02))
                c.close()
                op.outcome = "cut"
                c = connect_and_go(address, timeout=60)
            elif op.kind == "write":
                step = -(-op.length // op.pieces)
                cookie = c.send_request(CMD_WRITE, op.offset, op.length, op.flags,
                                        payload=op.data[:step])
                for at in range(step, op.length, step):
                    time.sleep(rng.uniform(0.001, 0.01))
                    c.send(op.data[at:at + step])
                reply = c.recv_reply()
                assert reply.cookie == cookie
                op.outcome = "ok" if reply.error == 0 else "error"
            elif op.kind == "read":
                reply = c.read(op.offset, op.length)
                op.outcome = "ok" if reply.error == 0 else "error"
            else:
                cmd = CMD_TRIM if op.kind == "trim" else CMD_WRITE_ZEROES
                reply = c.command(cmd, op.offset, op.length, op.flags)
                op.outcome = "ok" if reply.error == 0 else "error"
        c.disconnect()
    except BaseException as e:  # reported by the round
        errors.append(e)
    finally:
        c.close()


def read_all(address) -> bytes:
    c = connect_and_go(address, timeout=60)
    try:
        assert c.command(CMD_FLUSH).error == 0
        out = bytearray()
        for offset in range(0, SIZE, 1 * MiB):
            reply = c.read(offset, 1 * MiB)
            assert reply.error == 0
            out += reply.data
        c.disconnect()
        return bytes(out)
    finally:
        c.close()


def allowed(u: int, before: bytes, touching: list[Op]) -> tuple[set[bytes], bool]:
    """The values unit `u` may hold after the round, and whether a byte-by-byte mix of them
    is allowed too (a cut-short write)."""
    conns = {op.conn for op in touching}
    cut = any(op.outcome == "cut" for op in touching)
    if len(conns) == 1 and not cut:
        values = {before}
        for op in sorted(touching, key=lambda o: o.seq):
            if op.outcome == "error":
                values.add(op.value(u))
            elif op.kind == "trim":
                values.add(ZEROES)
            else:
                values = {op.value(u)}
        return values, False
    # Concurrent overlapping writes may tear inside a unit (two copies into one page).
    return {before} | {op.value(u) for op in touching}, True


def mixes(actual: bytes, values: set[bytes]) -> bool:
    return all(any(v[i] == b for v in values) for i, b in enumerate(actual))


def dirty_units(uri: str) -> set[int]:
    out = run(["nbdinfo", "--json", "--map=qemu:dirty-bitmap:model", uri]).stdout
    units: set[int] = set()
    for e in json.loads(out):
        if e["type"] & 1:
            units.update(range(e["offset"] // UNIT, (e["offset"] + e["length"]) // UNIT))
    return units


def control(ctl: Path, *args: str) -> None:
    deadline = time.monotonic() + 5
    while not ctl.exists():
        assert time.monotonic() < deadline, f"no control socket at {ctl}"
        time.sleep(0.01)
    run([str(ZCNBD_BIN), "bitmap", "-c", str(ctl), *args])


def check_round(before: bytes, after: bytes, ops: list[Op], dirty: set[int]) -> list[str]:
    touching: dict[int, list[Op]] = {}
    for op in ops:
        if op.kind == "read":
            continue
        for u in op.units():
            touching.setdefault(u, []).append(op)
    problems = []
    for u in range(UNITS):
        old, now = before[u * UNIT:(u + 1) * UNIT], after[u * UNIT:(u + 1) * UNIT]
        ops_here = touching.get(u, [])
        values, mix = allowed(u, old, ops_here) if ops_here else ({old}, False)
        if now not in values and not (mix and mixes(now, values)):
            problems.append(f"unit {u} (offset {u * UNIT}) holds bytes no request of the "
                            f"round left there (touched by {[(o.conn, o.seq, o.kind) for o in ops_here]})")
        if now != old and u not in dirty:
            problems.append(f"unit {u} changed but is clean in the bitmap")
    for op in ops:
        if op.kind != "read" and op.outcome == "ok" and not set(op.units()) <= dirty:
            problems.append(f"acknowledged {op.kind} {op.offset}+{op.length} is not all dirty")
    return problems[:20]


def make_export(kind: str, data_dir: Path, rng: random.Random) -> tuple[Export, Path | None]:
    if kind == "memory":
        return Export(kind="memory", size=SIZE), None
    if kind in ("raw", "raw-cache"):
        path = data_dir / "disk.raw"
        path.write_bytes(rng.randbytes(SIZE))
        # The cache layer keeps 4 KiB blocks of what is read and written, at most 1 MiB of
        # them: reads of held blocks are places in its file, evicted while others read.
        filters = (("cache:cache-on-read=yes,cache-block-size=4K,cache-max-size=1M",)
                   if kind == "raw-cache" else ())
        return Export(kind="file", path=path, size=SIZE, filters=filters), None
    require_tools("qemu-img", "qemu-io")
    image = data_dir / "disk.qcow2"
    if kind == "qcow2-64k":
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=64k",
             str(image), str(SIZE)])
    else:
        base = data_dir / "base.raw"
        base.write_bytes(rng.randbytes(SIZE))
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4k",
             "-b", str(base), "-F", "raw", str(image), str(SIZE)])
    # Some clusters allocated up front, so that writes land in place as well as allocate.
    writes = []
    for _ in range(24):
        offset, length = random_range(rng)
        writes += ["-c", f"write -P {rng.randrange(1, 255)} {offset} {length}"]
    run(["qemu-io", "-f", "qcow2", *writes, str(image)])
    return Export(kind="file", path=image, size=0), image


@pytest.mark.parametrize("kind", ["qcow2-64k", "qcow2-4k-backing", "raw", "raw-cache", "memory"])
def test_concurrent_clients_against_a_model(servers, data_dir, kind):
    require_tools("nbdinfo")
    seed = int(os.environ.get("ZCNBD_MODEL_SEED", "0")) or 1000 + sum(kind.encode())
    rng = random.Random(seed)
    export, image = make_export(kind, data_dir, rng)
    ctl = data_dir / "ctl.sock"
    server = servers(export, extra_args=["--control", str(ctl), "-B", "model"])
    before = read_all(server.address)
    for round_no in range(ROUNDS):
        control(ctl, "clear", "model")
        ops = [plan(rng, conn) for conn in range(CONNECTIONS)]
        errors: list = []
        threads = [
            threading.Thread(target=run_connection,
                             args=(server.address, conn_ops, random.Random(rng.random()), errors))
            for conn_ops in ops
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), f"seed {seed} round {round_no}: hung"
        assert not errors, f"seed {seed} round {round_no}: {errors[0]!r}"
        flat = [op for conn_ops in ops for op in conn_ops]
        failed = [(o.kind, o.offset, o.length) for o in flat if o.outcome == "error"]
        assert not failed, f"seed {seed} round {round_no}: requests failed: {failed}"
        after = read_all(server.address)
        if image is not None:
            out = run(["qemu-img", "check", "-U", "-f", "qcow2", str(image)], check=False)
            assert out.returncode == 0, f"seed {seed} round {round_no}:\n{out.stdout}{out.stderr}"
        problems = check_round(before, after, flat, dirty_units(server.uri()))
        assert not problems, f"seed {seed} round {round_no}:\n" + "\n".join(problems)
        before = after
    server.stop()
    if image is not None:
        out = run(["qemu-img", "check", "-f", "qcow2", str(image)], check=False)
        assert out.returncode == 0, out.stdout + out.stderr
