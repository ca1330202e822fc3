"""Serving over TCP: IPv4 and IPv6 loopback."""

import errno
import socket

import pytest

from nbdproto import RawClient
from support import (
    EXPORT_SIZE, Export, MiB, assert_reads, caps, expected_caps, files_equal, handle,
    make_data_image, pattern, require_tools, run,
)


@pytest.fixture
def tcp_server(servers, export_factory):
    return servers(export_factory("file"), transport="tcp")


def test_tcp_nbdsh(tcp_server):
    assert tcp_server.uri().startswith("nbd://127.0.0.1:")
    with handle(tcp_server.uri()) as h:
        assert h.get_size() == EXPORT_SIZE
        assert caps(h) == expected_caps(tcp_server.export)
        data = pattern(1 * MiB + 1, seed=2)
        h.pwrite(data, 7)
        assert_reads(h, 7, data)


def test_tcp_clients(tcp_server, data_dir):
    require_tools("qemu-img", "nbdinfo", "nbdcopy")
    uri = tcp_server.uri()
    src, dst = data_dir / "src.img", data_dir / "dst.img"
    make_data_image(src, seed=3)
    run(["nbdcopy", "--connections=4", src, uri])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, uri])
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", uri, dst])
    assert files_equal(src, dst)
    assert run(["nbdinfo", "--size", uri]).stdout.strip() == str(EXPORT_SIZE)


def test_tcp_raw_handshake(tcp_server):
    with RawClient.connect(tcp_server.address) as c:
        assert c.read_greeting() == 3


def ipv6_loopback_available():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback (::1) here")
def test_tcp_ipv6(servers):
    server = servers(Export(kind="memory"), transport="tcp", host="::1")
    assert server.uri().startswith("nbd://[::1]:")
    with handle(server.uri()) as h:
        h.pwrite(b"v6", 0)
        assert h.pread(2, 0) == b"v6"


def non_loopback_ipv4():
    """This machine's IPv4 address on its default route, if any (a UDP
    "connect" sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_tcp_refuses_other_interfaces(tcp_server):
    """Bound to 127.0.0.1 only: nothing listens on the wildcard address of
    another local IP (when the machine has one)."""
    addr = non_loopback_ipv4()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with socket.socket() as s:
        s.settimeout(2)
        err = s.connect_ex((addr, tcp_server.port))
    assert err in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EAGAIN), err
