"""QEMU's NBD client: qemu-img (info, convert in and out, compare),
qemu-io (pattern writes/reads, zeroes, discard) and qemu-nbd --list."""

import json
import re

import pytest

from support import (
    BACKEND, EXPORT_SIZE, MAX_PAYLOAD, PREFERRED_BLOCK, KiB, MiB, assert_reads, files_equal,
    handle, make_data_image, read_file_range, require_tools, run,
)


@pytest.fixture(autouse=True)
def _tools():
    require_tools("qemu-img", "qemu-io", "qemu-nbd")


def qemu_io(uri, *commands, check=True):
    argv = ["qemu-io", "-f", "raw"]
    for c in commands:
        argv += ["-c", c]
    p = run(argv + [uri], check=False)
    failed = p.returncode != 0 or re.search(r"Pattern verification failed|error|failed", p.stdout + p.stderr, re.I)
    if check and failed:
        pytest.fail(f"qemu-io failed ({p.returncode}): {commands}\n{p.stdout}\n{p.stderr}")
    return p, bool(failed)


def test_qemu_img_info(any_server):
    p = run(["qemu-img", "info", "--output=json", "-f", "raw", any_server.uri()])
    assert json.loads(p.stdout)["virtual-size"] == EXPORT_SIZE


def test_qemu_img_convert_in_and_out(rw_server, data_dir):
    src, dst = data_dir / "src.img", data_dir / "dst.img"
    regions = make_data_image(src)
    uri = rw_server.uri()
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, uri])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, uri])
    with handle(uri) as h:  # independent check of what arrived
        for offset, data in regions.items():
            assert_reads(h, offset, data)
        assert_reads(h, 20 * MiB, bytes(1 * MiB))
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", uri, dst])
    assert files_equal(src, dst)
    # compare must notice a one-byte change (proves the check above can fail).
    with handle(uri) as h:
        h.pwrite(b"\x01", 30 * MiB)
    p = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, uri], check=False)
    assert p.returncode == 1, p.stdout + p.stderr


def test_qemu_img_convert_out_of_read_only(ro_server, data_dir):
    dst = data_dir / "dst.img"
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", ro_server.uri(), dst])
    export = ro_server.export
    assert dst.stat().st_size == EXPORT_SIZE
    for offset, length in [(0, 4 * MiB), (EXPORT_SIZE - 1 * MiB, 1 * MiB)]:
        assert read_file_range(dst, offset, length) == export.initial_content(offset, length)


def test_qemu_img_convert_into_read_only_fails(ro_server, data_dir):
    src = data_dir / "src.img"
    make_data_image(src)
    p = run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, ro_server.uri()], check=False)
    assert p.returncode != 0
    with handle(ro_server.uri()) as h:
        assert_reads(h, 0, ro_server.export.initial_content(0, 64 * KiB))


# (pattern byte, offset, length): aligned, unaligned, tiny, crossing 4K and
# 1 MiB boundaries, the last byte of the export.
QEMU_IO_WRITES = [
    (0xAB, 0, 1 * MiB),
    (0x11, 1 * MiB + 1, 4097),
    (0x22, 2 * MiB - 3, 7),
    (0x33, 3 * MiB + 4095, 2),
    (0x44, 5 * MiB + 100, 3 * MiB + 17),
    (0x55, EXPORT_SIZE - 1, 1),
]


def test_qemu_io_patterns(rw_server):
    uri = rw_server.uri()
    for byte, offset, length in QEMU_IO_WRITES:
        qemu_io(uri, f"write -P {byte:#x} {offset} {length}", f"read -P {byte:#x} {offset} {length}")
    # All of them still there, in one session, plus untouched gaps.
    qemu_io(uri, *[f"read -P {b:#x} {o} {n}" for b, o, n in QEMU_IO_WRITES],
            f"read -P 0 {1 * MiB + 4097 + 1 * MiB + 1} 100")
    # The check can fail: a wrong pattern is reported.
    _, failed = qemu_io(uri, "read -P 0x12 0 4096", check=False)
    assert failed


def test_qemu_io_zero_and_discard(rw_server):
    uri = rw_server.uri()
    qemu_io(uri, "write -P 0x77 0 4M",
            "write -z 1M 1M", "read -P 0 1M 1M", "read -P 0x77 0 1M", "read -P 0x77 2M 2M",
            "discard 2M 1M", "read -P 0 2M 1M", "read -P 0x77 3M 1M",
            "write -z -u 100 1000", "read -P 0x77 0 100", "read -P 0 100 1000",
            "read -P 0x77 1100 1000")


def test_qemu_io_fua(rw_server):
    qemu_io(rw_server.uri(), "write -f -P 0x5a 8M 64k", "flush", "read -P 0x5a 8M 64k")


def parse_qemu_nbd_list(text):
    """qemu-nbd --list output -> {name: {field: value}}."""
    exports, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*export: '(.*)'$", line)
        if m:
            current = exports.setdefault(m.group(1), {})
            continue
        m = re.match(r"\s*([a-z ]+):\s+(.*)$", line)
        if m and current is not None:
            current[m.group(1)] = m.group(2).strip()
    return exports


def test_qemu_nbd_list(multi_server, multi_exports):
    if multi_server.socket_path:
        argv = ["qemu-nbd", "--list", "-k", multi_server.socket_path]
    else:
        argv = ["qemu-nbd", "--list", "-b", multi_server.host, "-p", multi_server.port]
    listed = parse_qemu_nbd_list(run(argv).stdout)
    assert sorted(listed) == sorted(e.name for e in multi_exports)
    for e in multi_exports:
        info = listed[e.name]
        assert info["description"] == e.description
        assert (info["min block"], info["opt block"], info["max block"]) == (
            "1", str(PREFERRED_BLOCK), str(MAX_PAYLOAD))
        if BACKEND == "zcnbd":  # nbdkit serves one plugin under every name
            assert int(info["size"]) == e.size
            assert ("readonly" in info["flags"]) == e.read_only
