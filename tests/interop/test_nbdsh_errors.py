"""Error replies, sent through libnbd with its client-side checks switched
off (strict mode 0) so that the server has to judge every request.  After
each error the same connection must still work."""

import errno

import pytest

from support import (
    BACKEND, EXPORT_SIZE, Export, KiB, MiB, assert_reads, close_handle,
    expect_nbd_error, handle, nbd, open_handle, pattern,
)

S = EXPORT_SIZE


def noop_extent(*args):
    return 0


def assert_alive(h, export=None):
    """The connection survived: a correct request still works."""
    expected = export.initial_content(S - 4096, 4096) if export else bytes(4096)
    assert_reads(h, S - 4096, expected)


# (command, call) for every command that takes an offset and a length;
# each callable takes (h, offset, length, flags).
COMMANDS = {
    "read": lambda h, off, n, fl=0: h.pread(n, off, fl),
    "write": lambda h, off, n, fl=0: h.pwrite(bytes(n), off, fl),
    "trim": lambda h, off, n, fl=0: h.trim(n, off, fl),
    "zero": lambda h, off, n, fl=0: h.zero(n, off, fl),
    "cache": lambda h, off, n, fl=0: h.cache(n, off, fl),
    "block_status": lambda h, off, n, fl=0: h.block_status(n, off, noop_extent, fl),
}
PAST_END_ERRNO = {
    "read": errno.EINVAL, "trim": errno.EINVAL, "cache": errno.EINVAL,
    "block_status": errno.EINVAL, "write": errno.ENOSPC, "zero": errno.ENOSPC,
}


@pytest.mark.parametrize("command", sorted(PAST_END_ERRNO))
@pytest.mark.parametrize("offset,length", [(S, 512), (S - 512, 1024), (S + 1 * MiB, 1)],
                         ids=["at-end", "straddling-end", "far-beyond"])
def test_past_end(rw_server, command, offset, length):
    with handle(rw_server.uri(), strict=False) as h:
        h.pwrite(b"tail", S - 4)
        expect_nbd_error(PAST_END_ERRNO[command], COMMANDS[command], h, offset, length)
        # The part inside the export was not modified.
        assert h.pread(4, S - 4) == b"tail"
        assert_reads(h, S - 4096, bytes(4092) + b"tail")


@pytest.mark.parametrize("command", ["write", "trim", "zero"])
def test_read_only_refuses_writes(ro_server, command):
    export = ro_server.export
    with handle(ro_server.uri(), strict=False) as h:
        expect_nbd_error(errno.EPERM, COMMANDS[command], h, 1 * MiB, 4096)
        expect_nbd_error(errno.EPERM, COMMANDS[command], h, 0, 1)
        assert_reads(h, 0, export.initial_content(0, 2 * MiB))
        assert_alive(h, export)


def test_read_only_refuses_writes_past_end(ro_server):
    """Out of bounds on a read-only export: either error is fine, but it
    must be an error."""
    with handle(ro_server.uri(), strict=False) as h:
        for command in ("write", "zero", "trim"):
            try:
                COMMANDS[command](h, S, 512)
            except nbd.Error as e:
                assert e.errnum in (errno.EPERM, errno.ENOSPC, errno.EINVAL), e
            else:
                pytest.fail(f"{command} past the end of a read-only export succeeded")
        assert_alive(h, ro_server.export)


@pytest.mark.parametrize("flag", [1 << 6, 1 << 7, 1 << 11, 1 << 15], ids=hex)
@pytest.mark.parametrize("command", sorted(COMMANDS) + ["flush"])
def test_unknown_flag(rw_server, command, flag):
    with handle(rw_server.uri(), strict=False) as h:
        h.pwrite(b"keep", 4096)
        if command == "flush":
            expect_nbd_error(errno.EINVAL, h.flush, flag)
        else:
            expect_nbd_error(errno.EINVAL, COMMANDS[command], h, 4096, 4, flag)
        assert h.pread(4, 4096) == b"keep"
        assert_alive(h)


@pytest.mark.parametrize("command", ["read", "write", "trim", "zero", "cache"])
@pytest.mark.parametrize("offset,length", [(1, 512), (512, 100), (4096 + 511, 1024)],
                         ids=["bad-offset", "bad-length", "both"])
def test_misaligned_with_min_block_size(servers, command, offset, length):
    server = servers(Export(kind="memory", min_block_size=512))
    with handle(server.uri(), strict=False) as h:
        if command in ("read", "write"):
            expect_nbd_error(errno.EINVAL, COMMANDS[command], h, offset, length)
        elif BACKEND == "zcnbd":
            # zcnbd's validator refuses every misaligned request with EINVAL.
            expect_nbd_error(errno.EINVAL, COMMANDS[command], h, offset, length)
        else:
            # For commands without payload the spec only says SHOULD (a peer run to check
            # the suite may accept them), but EINVAL is the only acceptable error.
            try:
                COMMANDS[command](h, offset, length)
            except nbd.Error as e:
                assert e.errnum == errno.EINVAL, e
        # Aligned requests still work.
        data = pattern(1024, seed=1)
        h.pwrite(data, 8192)
        assert_reads(h, 8192, data)


@pytest.mark.zcnbd_only(reason="nbdkit answers zero-length requests with EINVAL/ENOSPC")
@pytest.mark.parametrize("command", ["read", "write", "trim", "zero", "cache"])
def test_zero_length_request_succeeds(servers, export_factory, command):
    server = servers(export_factory("file"))
    with handle(server.uri(), strict=False) as h:
        h.pwrite(b"abc", 10)
        result = COMMANDS[command](h, 10, 0)
        if command == "read":
            assert result == b""
        assert h.pread(3, 10) == b"abc"
        assert_alive(h)


# A maximum payload libnbd can be made to exceed (it sends at most 64 MiB).
SMALL_MAX_PAYLOAD = 32 * MiB


def test_oversized_write_payload(servers):
    """A write with a payload over the maximum: EINVAL with the
    connection still usable, or a disconnect.  Either way the server keeps
    serving other connections."""
    mem_server = servers(Export(kind="memory", max_payload=SMALL_MAX_PAYLOAD))
    bystander = open_handle(mem_server.uri())
    h = open_handle(mem_server.uri(), strict=False)
    try:
        bystander.pwrite(b"bystander", 0)
        try:
            h.pwrite(pattern(SMALL_MAX_PAYLOAD + 1 * MiB, seed=2), 0)
        except nbd.Error as e:
            if h.aio_is_ready():
                assert e.errnum == errno.EINVAL, e
                assert_alive(h)
        else:
            pytest.fail("a write over the maximum payload size succeeded")
        assert bystander.pread(9, 0) == b"bystander"
        assert_alive(bystander)
    finally:
        close_handle(h)
        close_handle(bystander)
    with handle(mem_server.uri()) as again:
        assert again.pread(9, 0) == b"bystander"


def test_oversized_read(servers):
    """A read over the maximum payload size: the client broke the rules, so
    EINVAL, EOVERFLOW (explicitly allowed for large structured reads) or a
    disconnect are fine, as is serving it correctly."""
    mem_server = servers(Export(kind="memory", max_payload=SMALL_MAX_PAYLOAD))
    data = pattern(64 * KiB, seed=3)
    with handle(mem_server.uri(), strict=False) as h:
        h.pwrite(data, 0)
        try:
            got = h.pread(SMALL_MAX_PAYLOAD + 1 * MiB, 0)
        except nbd.Error as e:
            if h.aio_is_ready():
                assert e.errnum in (errno.EINVAL, errno.EOVERFLOW), e
        else:
            assert got[: len(data)] == data and not any(got[len(data):])
    with handle(mem_server.uri()) as h:
        assert_reads(h, 0, data)


def test_many_errors_then_data(rw_server):
    """A long mix of failing and valid requests on one connection."""
    with handle(rw_server.uri(), strict=False) as h:
        for i in range(50):
            expect_nbd_error(errno.EINVAL, h.pread, 512, S + i)
            expect_nbd_error(errno.ENOSPC, h.pwrite, b"x" * 512, S + i)
            expect_nbd_error(errno.EINVAL, h.pread, 512, 0, 1 << 6)
            data = pattern(513, seed=i)
            h.pwrite(data, i * 1000)
            assert_reads(h, i * 1000, data)
