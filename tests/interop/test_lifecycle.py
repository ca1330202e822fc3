"""Server lifecycle: clean exit on SIGTERM/SIGINT (also with clients
connected and requests in flight), clients that vanish."""

import signal
import socket
import time

import pytest

import nbdproto as P
from nbdproto import RawClient, connect_and_go
from support import KiB, MiB, close_handle, handle, nbd, open_handle, pattern, read_file_range


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_zero(mem_server, sig):
    with handle(mem_server.uri()) as h:
        h.pwrite(b"x", 0)
    mem_server.stop(sig)  # asserts exit status 0 within 10 s


@pytest.mark.zcnbd_only(reason="nbdkit waits for connected clients to disconnect")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_idle_clients_connected(servers, export_factory, sig):
    """Idle connected clients (one in transmission, one still negotiating)
    must not keep the server from exiting; acknowledged writes are flushed
    to the file."""
    server = servers(export_factory("file"))
    data = pattern(64 * KiB, seed=1)
    h = open_handle(server.uri())
    negotiating = RawClient.connect(server.address)
    try:
        negotiating.read_greeting()
        h.pwrite(data, 2 * MiB)  # no FUA, no flush: the server flushes on exit
        server.stop(sig)
        assert read_file_range(server.export.path, 2 * MiB, len(data)) == data
    finally:
        negotiating.close()
        close_handle(h)


def test_sigterm_with_requests_in_flight(servers, export_factory):
    """Requests in flight when SIGTERM arrives: the server exits 0 (once the
    client has gone), and every write it acknowledged is in the file. SIGTERM goes only
    once the first write is answered, so requests are on the wire and in the server when
    it arrives, and at least one acknowledged write is checked."""
    server = servers(export_factory("file"))
    h = open_handle(server.uri())
    try:
        writes = []
        for i in range(64):
            buf = nbd.Buffer.from_bytearray(bytearray(pattern(128 * KiB, seed=10 + i)))
            offset = 4 * MiB + i * 128 * KiB
            writes.append((offset, i, h.aio_pwrite(buf, offset)))
        acknowledged = []  # typically all 64
        deadline = time.monotonic() + 10
        for n, (offset, i, cookie) in enumerate(writes):
            if n == 1:
                server.send_signal(signal.SIGTERM)
            try:
                while not h.aio_command_completed(cookie):
                    assert time.monotonic() < deadline, "requests neither completed nor failed"
                    h.poll(1000)
                acknowledged.append((offset, i))
            except nbd.Error:
                break  # server went away (or shut down): later ones may fail too
        assert acknowledged, "no write was acknowledged: the test checked nothing"
        close_handle(h)
        rc = server.wait_exit()
        server.stopped = True
        assert rc == 0, f"exit status {rc}\n{server.describe()}"
        for offset, i in acknowledged:
            assert read_file_range(server.export.path, offset, 128 * KiB) == pattern(128 * KiB, seed=10 + i)
    finally:
        close_handle(h)


def test_other_clients_unaffected_by_a_killed_client(mem_server):
    """A client that dies abruptly (no NBD_CMD_DISC) does not disturb others."""
    survivor = open_handle(mem_server.uri())
    try:
        survivor.pwrite(b"survivor", 0)
        for _ in range(5):
            c = connect_and_go(mem_server.address)
            c.send_request(P.CMD_WRITE, 0, 1 * MiB)  # a write header, then vanish
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            c.close()  # RST
        assert survivor.pread(8, 0) == b"survivor"
    finally:
        close_handle(survivor)
