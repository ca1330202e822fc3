"""A place an engine holds stays its request's until the I/O completes (issue 34).

zcnbd's engines hold a file offset across network waits: a write's payload lands where its
header was mapped, a read's reply is spliced from the file when the socket takes it. Here the
two regressions a review reproduced, on every engine and data path the suite runs with:

- a qcow2 cluster freed by imago (a write to a trimmed cluster reallocates it) and handed to
  another client's write must never receive a late payload mapped before, nor be sent as the
  late read's data;
- a write cut short by a disconnect is still recorded in a tracked dirty bitmap (its bytes
  may be in the export).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from nbdproto import (
    CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, RawClient, connect_and_go,
)
from support import KiB, MiB, Export, require_tools, run

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's engines and tracked bitmaps")

CLUSTER = 64 * KiB
A, B, C = 0, CLUSTER, 10 * MiB


def qemu_io(path: Path, *commands: str) -> None:
    argv = ["qemu-io", "-f", "qcow2"]
    for c in commands:
        argv += ["-c", c]
    run(argv + [str(path)])


def host_offsets(path: Path) -> dict[int, int]:
    """Guest offset -> host offset of each data run qemu-img maps."""
    out = run(["qemu-img", "map", "--output=json", "-f", "qcow2", str(path)]).stdout
    return {e["start"]: e["offset"] for e in json.loads(out) if e.get("data") and "offset" in e}


def b_below_a(data_dir: Path) -> Path:
    """A qcow2 image (64 KiB clusters) whose guest cluster B (64K) lives at a lower host
    offset than cluster A (0): a write over A and B makes imago move B next to A."""
    require_tools("qemu-img", "qemu-io")
    image = data_dir / "disk.qcow2"
    run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", f"cluster_size={CLUSTER}",
         str(image), "64M"])
    # First 32 MiB of data at 20M, for replies that fill a socket (holes would be tiny), so
    # that the host clusters after A's stay free.
    qemu_io(image, "write -P 0x33 20M 32M", f"write -P 0x11 {B} {CLUSTER}",
            f"write -P 0x22 {A} {CLUSTER}")
    offsets = host_offsets(image)
    assert offsets[B] < offsets[A], offsets
    return image


def image_export(path: Path) -> Export:
    return Export(kind="file", path=path, size=0)


def check_clean(image: Path) -> None:
    out = run(["qemu-img", "check", "-f", "qcow2", str(image)], check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def reuse_b_for_c(address, done: dict) -> None:
    """Another client: trim B (a zero cluster keeping its host cluster), write A and B
    (imago allocates B anew next to A and frees the old one), write C (which gets the freed
    cluster), flush, and read C back."""
    c2 = connect_and_go(address, timeout=60)
    try:
        assert c2.command(CMD_TRIM, B, CLUSTER).error == 0
        assert c2.write(A, b"\xaa" * (2 * CLUSTER)).error == 0
        assert c2.write(C, b"\xcc" * CLUSTER).error == 0
        assert c2.command(CMD_FLUSH).error == 0
        done["c"] = c2.read(C, CLUSTER).data
        c2.disconnect()
    except BaseException as e:  # reported by the test's thread
        done["error"] = e
    finally:
        c2.close()


def test_a_late_write_never_lands_on_a_cluster_reused_for_another(servers, data_dir):
    image = b_below_a(data_dir)
    server = servers(image_export(image))
    c1 = connect_and_go(server.address, timeout=60)
    # The header and half the payload: the write's place is mapped, the rest is awaited.
    cookie = c1.send_request(CMD_WRITE, B, CLUSTER, payload=b"\x77" * (CLUSTER // 2))
    time.sleep(0.2)
    done: dict = {}
    other = threading.Thread(target=reuse_b_for_c, args=(server.address, done))
    other.start()
    # Connection 2 runs on (or waits for connection 1's write to B: either is right).
    other.join(1.0)
    c1.send(b"\x77" * (CLUSTER // 2))
    reply = c1.recv_reply()
    assert (reply.cookie, reply.error) == (cookie, 0)
    other.join(60)
    assert not other.is_alive() and "error" not in done, done
    assert done["c"] == b"\xcc" * CLUSTER, "connection 2 read back what it wrote"
    # C was acknowledged and flushed: nothing a late request did may change it.
    assert c1.read(C, CLUSTER).data == b"\xcc" * CLUSTER, "C holds connection 1's late payload"
    assert c1.read(A, CLUSTER).data == b"\xaa" * CLUSTER
    got_b = c1.read(B, CLUSTER).data
    # Concurrent writes to B: either order, never a mix with anything else.
    assert got_b in (b"\xaa" * CLUSTER, b"\x77" * CLUSTER), got_b[:16]
    c1.disconnect()
    c1.close()
    server.stop()
    check_clean(image)
    # QEMU reads the same.
    out = run(["qemu-io", "-f", "qcow2", "-r", "-c", f"read -P 0xcc {C} {CLUSTER}", str(image)])
    assert "Pattern verification failed" not in out.stdout


def fill_socket_with_replies(c: RawClient, count: int, length: int) -> list[int]:
    """Asks `count` reads of `length` bytes and reads none of their replies, so that the
    replies queue up in the server behind a full socket."""
    return [c.send_request(CMD_READ, 20 * MiB + i * length, length) for i in range(count)]


def test_a_late_read_never_sends_a_cluster_reused_for_another(servers, data_dir):
    image = b_below_a(data_dir)
    server = servers(image_export(image))
    c1 = connect_and_go(server.address, timeout=60)
    c1.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
    # Replies the client does not read fill the socket, then a read of B waits behind them:
    # a read whose data is taken from the file when it is sent.
    cookies = fill_socket_with_replies(c1, 8, 4 * MiB)
    b_cookie = c1.send_request(CMD_READ, B, CLUSTER)
    time.sleep(0.3)
    done: dict = {}
    other = threading.Thread(target=reuse_b_for_c, args=(server.address, done))
    other.start()
    other.join(1.0)
    # Now take every reply: B's must be B's data when it was read, never C's.
    got = {}
    for _ in range(len(cookies) + 1):
        reply = c1.recv_reply(read_length=0)
        got[reply.cookie] = reply
    other.join(60)
    assert not other.is_alive() and "error" not in done, done
    b_reply = got[b_cookie]
    assert b_reply.error == 0
    data = b"".join(ch.payload[8:] for ch in b_reply.chunks if ch.type == 1)
    holes = [ch for ch in b_reply.chunks if ch.type == 2]
    assert holes or data in (b"\x11" * CLUSTER, b"\xaa" * CLUSTER), data[:16]
    assert b"\xcc" not in data, "connection 1 was sent connection 2's data"
    assert done["c"] == b"\xcc" * CLUSTER
    c1.disconnect()
    c1.close()
    server.stop()
    check_clean(image)


# --- dirty bitmaps and writes cut short -------------------------------------------------------
def control(ctl: Path, *args: str) -> str:
    from support import ZCNBD_BIN
    deadline = time.monotonic() + 5
    while not ctl.exists():
        assert time.monotonic() < deadline, f"no control socket at {ctl}"
        time.sleep(0.01)
    out = run([str(ZCNBD_BIN), "bitmap", "-c", str(ctl), "--json", *args])
    return out.stdout


def dirty_ranges(uri: str, context: str) -> list[tuple[int, int]]:
    """The ranges `context` marks dirty, as `nbdinfo --map` prints them."""
    out = run(["nbdinfo", "--json", f"--map={context}", uri]).stdout
    return [(e["offset"], e["length"]) for e in json.loads(out) if e["type"] & 1]


def covered(ranges: list[tuple[int, int]], start: int, length: int) -> bool:
    return any(o <= start and start + length <= o + n for o, n in ranges)


@pytest.mark.parametrize("kind", ["memory", "file", "qcow2"])
def test_a_write_cut_short_by_a_disconnect_is_in_the_bitmap(servers, export_factory, data_dir,
                                                            kind):
    ctl = data_dir / "ctl.sock"
    args = ["--control", str(ctl), "-B", "b0"]
    if kind == "qcow2":
        require_tools("qemu-img")
        image = data_dir / "t.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"])
        # Allocated first, so that an engine may land the payload in place.
        run(["qemu-io", "-f", "qcow2", "-c", "write -P 1 8M 1M", str(image)])
        export = image_export(image)
    else:
        export = export_factory(kind)
    require_tools("nbdinfo")
    server = servers(export, extra_args=args)
    control(ctl, "clear", "b0")
    assert dirty_ranges(server.uri(), "qemu:dirty-bitmap:b0") == []
    c = connect_and_go(server.address)
    c.send_request(CMD_WRITE, 8 * MiB, 1 * MiB, payload=b"\x5a" * (512 * KiB))
    time.sleep(0.3)
    c.close()
    # Whatever of the payload landed (in place, on engines and data paths that receive it
    # there) must be in the bitmap once the server has seen the end of the stream.
    with connect_and_go(server.address) as r:
        data = r.read(8 * MiB, 1 * MiB).data
        r.disconnect()
    landed = [i for i in range(0, len(data), 4096) if data[i:i + 4096] == b"\x5a" * 4096]
    if not landed:
        return
    first, last = 8 * MiB + landed[0], 8 * MiB + landed[-1] + 4096
    deadline = time.monotonic() + 5
    while True:
        ranges = dirty_ranges(server.uri(), "qemu:dirty-bitmap:b0")
        if covered(ranges, first, last - first) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert covered(ranges, first, last - first), (ranges, first, last)


def test_a_client_stalled_inside_a_payload_holds_up_others_only_until_the_payload_timeout(
        servers, data_dir):
    """A write whose payload stops half way may hold its place in the image (io_uring
    engine): another client's trim of that cluster waits for it, but only until
    --payload-timeout-ms disconnects the silent client; other clusters never wait."""
    image = b_below_a(data_dir)
    server = servers(image_export(image), extra_args=["--payload-timeout-ms", "1500"])
    c1 = connect_and_go(server.address, timeout=60)
    c1.send_request(CMD_WRITE, B, CLUSTER, payload=b"\x77" * (CLUSTER // 2))
    time.sleep(0.2)
    c2 = connect_and_go(server.address, timeout=60)
    started = time.monotonic()
    assert c2.write(C, b"\xcc" * CLUSTER).error == 0
    assert time.monotonic() - started < 1.0, "another cluster waited for the stalled client"
    started = time.monotonic()
    assert c2.command(CMD_TRIM, B, CLUSTER).error == 0
    waited = time.monotonic() - started
    assert waited < 10, f"the trim waited {waited:.1f} s"
    assert c2.read(C, CLUSTER).data == b"\xcc" * CLUSTER
    c2.disconnect()
    c2.close()
    # The stalled client was disconnected (on the engines that hold a place for it), or is
    # still there (the others: nothing waited for it).
    c1.close()
    server.stop()
    check_clean(image)
    if "portable" not in " ".join(__import__("support").ZCNBD_SERVE_ARGS):
        assert "payload" in server.log() or waited < 1.0, server.log()[-2000:]
