"""Durability of file exports: once a FUA write (or a write followed by a
flush) is acknowledged, the data is in the file, even if the server is
killed with SIGKILL right after."""

import pytest

from support import KiB, MiB, handle, nbd, pattern, read_file_range

FILE_KINDS = ["file", "direct"]


def kill_and_read(server, offset, length):
    server.kill()
    return read_file_range(server.export.path, offset, length)


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("how", ["fua", "flush"])
def test_acknowledged_write_survives_kill(servers, export_factory, kind, how):
    server = servers(export_factory(kind))
    data = pattern(256 * KiB + 3, seed=1)
    offset = 5 * MiB + 1
    with handle(server.uri()) as h:
        if how == "fua":
            h.pwrite(data, offset, nbd.CMD_FLAG_FUA)
        else:
            h.pwrite(data, offset)
            h.flush()
        assert kill_and_read(server, offset, len(data)) == data


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_many_fua_writes_survive_kill(servers, export_factory, kind):
    server = servers(export_factory(kind))
    writes = [(i * 300 * KiB + i, pattern(4096 + i, seed=i)) for i in range(20)]
    with handle(server.uri()) as h:
        for offset, data in writes:
            h.pwrite(data, offset + 8 * MiB, nbd.CMD_FLAG_FUA)
        server.kill()
    for offset, data in writes:
        assert read_file_range(server.export.path, offset + 8 * MiB, len(data)) == data


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("command", ["zero", "trim"])
def test_acknowledged_zeroing_survives_kill(servers, export_factory, kind, command):
    server = servers(export_factory(kind))
    offset, length = 4 * MiB, 1 * MiB
    with handle(server.uri()) as h:
        h.pwrite(pattern(length, seed=2), offset)
        h.flush()
        getattr(h, command)(length, offset, nbd.CMD_FLAG_FUA)
        assert kill_and_read(server, offset, length) == bytes(length)
