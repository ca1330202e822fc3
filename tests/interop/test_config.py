"""Several exports from one server (zcnbd --config FILE.toml)."""

import errno

import pytest

from support import (
    MiB, close_handle, expect_nbd_error, handle, nbd, new_handle, pattern, read_file_range,
)


def by_name(exports, name):
    return next(e for e in exports if e.name == name)


def test_each_export_reachable_by_name(multi_server, multi_exports):
    for e in multi_exports:
        with handle(multi_server.uri(e.name)) as h:
            assert h.get_canonical_export_name() == e.name
            assert h.get_export_description() == e.description


def test_unknown_name_refused(multi_server):
    h = new_handle()
    with pytest.raises(nbd.Error):
        h.connect_uri(multi_server.uri("no-such-export"))
    close_handle(h)
    with handle(multi_server.uri("mem")) as h2:
        h2.pwrite(b"ok", 0)


@pytest.mark.zcnbd_only(reason="nbdkit emulation serves one plugin under every name")
def test_exports_have_their_own_properties(multi_server, multi_exports):
    for e in multi_exports:
        with handle(multi_server.uri(e.name)) as h:
            assert h.get_size() == e.size, e.name
            assert h.is_read_only() == e.read_only, e.name


@pytest.mark.zcnbd_only(reason="nbdkit emulation serves one plugin under every name")
def test_exports_are_independent(multi_server, multi_exports):
    data = pattern(64 * 1024, seed=1)
    with handle(multi_server.uri("mem")) as mem:
        mem.pwrite(data, 1 * MiB)
    with handle(multi_server.uri("disk")) as disk:
        assert disk.pread(len(data), 1 * MiB) != data
        disk.pwrite(data, 2 * MiB)
        disk.flush()
    assert read_file_range(by_name(multi_exports, "disk").path, 2 * MiB, len(data)) == data
    with handle(multi_server.uri("zero")) as zero:
        zero.pwrite(data, 0)  # discarded
        assert zero.pread(len(data), 0) == bytes(len(data))
    with handle(multi_server.uri("ro"), strict=False) as ro:
        expect_nbd_error(errno.EPERM, ro.pwrite, data, 0)
        assert ro.pread(len(data), 1 * MiB) == bytes(len(data))
    with handle(multi_server.uri("mem")) as mem:
        assert mem.pread(len(data), 1 * MiB) == data
