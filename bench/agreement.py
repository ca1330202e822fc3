#!/usr/bin/python3
"""Checks that `zcnbd bench` and fio's nbd engine (libnbd) measure the same thing: both run
against one zcnbd server, alternating cell by cell, and a table shows each tool's MiB/s and
the ratio bench/fio per cell. A program that prints a table, not a test.

    cargo build --release
    bench/agreement.py [--target zcnbd:memory] [--rw randread,randwrite] [--bs 4k,64k,1m]
                       [--runtime 5] [--repeat 2] [--size 1G]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZCNBD = Path(os.environ.get("ZCNBD_BIN", ROOT / "target" / "release" / "zcnbd"))


def bench_cell(uri: str, rw: str, bs: str, runtime: int, out: Path) -> float:
    subprocess.run(
        [str(ZCNBD), "bench", uri, "--rw", rw, "--bs", bs, "--runtime", f"{runtime}s",
         "--iodepth", "16", "--no-ceiling", "--no-prefill", "--json", str(out)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cells = json.loads(out.read_text())["cells"]
    return cells[0]["samples"][0]["mib_s"]


def fio_cell(uri: str, rw: str, bs: str, runtime: int, size: str) -> float:
    out = subprocess.run(
        ["fio", "--name=agreement", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
         "--iodepth=16", "--numjobs=1", f"--runtime={runtime}", "--time_based", f"--size={size}",
         "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    kib = job["read"]["bw"] + job["write"]["bw"]  # KiB/s
    return kib / 1024.0


def wait_for_port(port: int, server: subprocess.Popen) -> None:
    """Returns once the server accepts connections (it binds after starting its rings)."""
    for _ in range(200):
        if server.poll() is not None:
            raise SystemExit(f"zcnbd serve exited with status {server.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("zcnbd serve did not start listening")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="zcnbd:memory", help="a zcnbd bench target to start")
    p.add_argument("--rw", default="randread,randwrite")
    p.add_argument("--bs", default="4k,64k,1m")
    p.add_argument("--runtime", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--size", default="1G")
    a = p.parse_args()
    port = 20000 + os.getpid() % 20000
    server = subprocess.Popen([str(ZCNBD), "serve", "-p", str(port), "--memory", a.size],
                              stderr=subprocess.DEVNULL)
    uri = f"nbd://127.0.0.1:{port}/"
    try:
        wait_for_port(port, server)
        # Prefill through the bench's own prefill (one short cell).
        subprocess.run([str(ZCNBD), "bench", uri, "--prefill", "--size", a.size, "--rw", "read",
                        "--bs", "1m", "--runtime", "1s", "--no-ceiling"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "cell.json"
            for rw in a.rw.split(","):
                for bs in a.bs.split(","):
                    ours, theirs = [], []
                    for k in range(a.repeat):
                        # Alternate which tool goes first, so drift favours neither.
                        if k % 2 == 0:
                            ours.append(bench_cell(uri, rw, bs, a.runtime, out))
                            theirs.append(fio_cell(uri, rw, bs, a.runtime, a.size))
                        else:
                            theirs.append(fio_cell(uri, rw, bs, a.runtime, a.size))
                            ours.append(bench_cell(uri, rw, bs, a.runtime, out))
                    rows.append((rw, bs, ours, theirs))
    finally:
        server.terminate()
        server.wait()
    print(f"zcnbd bench vs fio --ioengine=nbd, one zcnbd server ({ZCNBD} serve --memory {a.size}),"
          f" iodepth 16, {a.runtime} s per cell, {a.repeat} alternations")
    print(f"{'rw':<10} {'bs':>4} {'bench MiB/s':>24} {'fio MiB/s':>24} {'bench/fio':>9}")
    for rw, bs, ours, theirs in rows:
        mo, mt = sorted(ours)[len(ours) // 2], sorted(theirs)[len(theirs) // 2]
        fmt = lambda v: " ".join(f"{x:.0f}" for x in v)
        print(f"{rw:<10} {bs:>4} {fmt(ours):>24} {fmt(theirs):>24} {mo / mt:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
