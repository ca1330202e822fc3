"""Every NBD command and command flag, driven through libnbd (what nbdsh
scripts do), with data contents and block status checked exactly."""

import errno

import pytest

from support import (
    BACKEND, EXPORT_SIZE, MAX_PAYLOAD, Export, KiB, MiB, assert_reads, close_handle, extents, handle,
    nbd, open_handle, pattern, require_tools, run, states_in, wait_for_aio,
)

HOLE_ZERO = 3  # nbd.STATE_HOLE | nbd.STATE_ZERO (no libnbd needed at import)
DATA = 0

# (offset, length) pairs, deliberately including unaligned ones, the very
# first and last bytes of the export, and a range crossing a 32 MiB boundary.
# They don't overlap each other or the seeded region of file exports (1 MiB).
IO_RANGES = [
    (0, 4096),
    (4096 + 1, 1),
    (3 * MiB - 3, 7),
    (5 * MiB + 4095, 2),
    (6 * MiB + 12345, 77777),
    (8 * MiB, 1 * MiB),
    (32 * MiB - 100, 1 * MiB + 200),
    (EXPORT_SIZE - 1000, 1000),
]


def test_write_read_roundtrip(rw_server):
    with handle(rw_server.uri()) as h:
        for i, (offset, length) in enumerate(IO_RANGES):
            data = pattern(length, seed=i)
            h.pwrite(data, offset)
            assert_reads(h, offset, data)
        # Later writes must not have disturbed earlier ones.
        for i, (offset, length) in enumerate(IO_RANGES):
            assert_reads(h, offset, pattern(length, seed=i))
        # Nor the gaps between them.
        assert_reads(h, 4096 + 2, bytes(4096))
        assert_reads(h, 9 * MiB, bytes(64 * KiB))


def test_initial_content(any_server):
    export = any_server.export
    with handle(any_server.uri()) as h:
        for offset, length in [(0, 2 * MiB), (30 * MiB, 4 * MiB), (EXPORT_SIZE - 4096, 4096)]:
            assert_reads(h, offset, export.initial_content(offset, length))


def test_max_payload_write_and_read(rw_server):
    data = pattern(MAX_PAYLOAD, seed=32)
    with handle(rw_server.uri()) as h:
        h.pwrite(data, EXPORT_SIZE - MAX_PAYLOAD)
        assert_reads(h, EXPORT_SIZE - MAX_PAYLOAD, data)


def test_data_persists_across_connections(rw_server):
    data = pattern(100 * KiB, seed=3)
    with handle(rw_server.uri()) as h:
        h.pwrite(data, 7 * MiB + 3)
    with handle(rw_server.uri()) as h:
        assert_reads(h, 7 * MiB + 3, data)


def test_fua_write(rw_server):
    data = pattern(64 * KiB, seed=4)
    with handle(rw_server.uri()) as h:
        h.pwrite(data, 2 * MiB + 512, nbd.CMD_FLAG_FUA)
        assert_reads(h, 2 * MiB + 512, data)


def test_flush(rw_server):
    data = pattern(64 * KiB, seed=5)
    with handle(rw_server.uri()) as h:
        h.pwrite(data, 2 * MiB)
        h.flush()
        assert_reads(h, 2 * MiB, data)


def test_flush_on_read_only(ro_server):
    with handle(ro_server.uri()) as h:
        h.flush()


def test_trim_reads_zero_and_is_a_hole(rw_server):
    offset, length = 8 * MiB, 2 * MiB
    with handle(rw_server.uri()) as h:
        h.pwrite(pattern(length, seed=6), offset)
        assert states_in(h, offset, length) == {DATA}
        h.trim(length, offset)
        assert_reads(h, offset, bytes(length))
        assert states_in(h, offset, length) == {HOLE_ZERO}
        # Neighbours are untouched.
        h.pwrite(b"x" * 10, offset - 10)
        h.pwrite(b"y" * 10, offset + length)
        h.trim(length, offset)
        assert h.pread(10, offset - 10) == b"x" * 10
        assert h.pread(10, offset + length) == b"y" * 10


def test_trim_with_fua(rw_server):
    offset, length = 8 * MiB, 1 * MiB
    with handle(rw_server.uri()) as h:
        h.pwrite(pattern(length, seed=7), offset)
        h.trim(length, offset, nbd.CMD_FLAG_FUA)
        assert_reads(h, offset, bytes(length))


def test_write_zeroes_leaves_hole(rw_server):
    offset, length = 12 * MiB, 2 * MiB
    with handle(rw_server.uri()) as h:
        h.pwrite(pattern(length, seed=8), offset)
        h.zero(length, offset)
        assert_reads(h, offset, bytes(length))
        assert states_in(h, offset, length) == {HOLE_ZERO}


def test_write_zeroes_unaligned(rw_server):
    offset, length = 12 * MiB, 64 * KiB
    data = pattern(length, seed=9)
    with handle(rw_server.uri()) as h:
        h.pwrite(data, offset)
        h.zero(1000, offset + 17)
        expected = data[:17] + bytes(1000) + data[1017:]
        assert_reads(h, offset, expected)


def test_write_zeroes_no_hole(rw_server):
    offset, length = 14 * MiB, 1 * MiB
    with handle(rw_server.uri()) as h:
        h.pwrite(pattern(length, seed=10), offset)
        h.zero(length, offset, nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FUA)
        assert_reads(h, offset, bytes(length))


def test_write_zeroes_fast_zero(rw_server):
    offset, length = 16 * MiB, 1 * MiB
    data = pattern(length, seed=11)
    with handle(rw_server.uri()) as h:
        if not h.can_fast_zero():  # zcnbd always advertises it (see test_nbdsh_handshake)
            pytest.skip("server does not advertise fast zero")
        h.pwrite(data, offset)
        try:
            h.zero(length, offset, nbd.CMD_FLAG_FAST_ZERO)
        except nbd.Error as e:
            # The spec allows "not fast" (then the data must be unchanged), but zcnbd's
            # memory and file exports zero by punching holes or ZERO_RANGE, which tmpfs and
            # ext4 do fast: a server that always says "not fast" fails here.
            assert BACKEND != "zcnbd", f"zcnbd's {rw_server.export.label} export: {e}"
            assert e.errnum == errno.ENOTSUP, e
            assert_reads(h, offset, data)
        else:
            assert_reads(h, offset, bytes(length))


def test_cache(any_server):
    export = any_server.export
    with handle(any_server.uri()) as h:
        h.cache(4 * MiB, 0)
        h.cache(1, EXPORT_SIZE - 1)
        assert_reads(h, 0, export.initial_content(0, 4 * MiB))


def test_block_status_covers_export(any_server):
    export = any_server.export
    with handle(any_server.uri()) as h:
        ext = extents(h, 0, EXPORT_SIZE)
        # Contiguous extents, non-empty, starting at 0, reaching the end.
        pos = 0
        for off, length, state in ext:
            assert off == pos and length > 0
            assert state & ~HOLE_ZERO == 0, f"undefined state bits {state:#x}"
            pos += length
        assert pos >= EXPORT_SIZE
        # Anything marked zero must read as zeroes; seeded data must not be
        # reported as zero.
        for off, length, state in ext:
            if state & nbd.STATE_ZERO and off < EXPORT_SIZE:
                n = min(length, EXPORT_SIZE - off, 4 * MiB)
                assert_reads(h, off, bytes(n))
        for offset, data in export.initial:
            assert not any(s & nbd.STATE_ZERO for s in states_in(h, offset, len(data)))


def test_block_status_over_4gib_never_reports_data_as_a_hole(servers):
    """A compact (32-bit) block status reply cannot describe an extent of 4 GiB: the server
    shortens it and must end the list there. Here data runs from 0 to 4 GiB and a hole
    follows; asked from 0x800 for 0xFFFFFFFF bytes (minimum block size 1), the data extent is
    too long for 32 bits and every extent reported up to 4 GiB must be data - once, the
    extents after the shortened one shifted and 2 KiB of data were reported as hole, which
    a sparse-aware copy skips."""
    data_end = 4 << 30
    server = servers(Export(kind="memory", size=8 << 30))
    with handle(server.uri()) as h:
        # Written data (4 GiB of the memory export's pages, about 2 s on loopback).
        chunk = bytes([0x5A]) * (32 * MiB)
        for at in range(0, data_end, len(chunk)):
            h.pwrite(chunk[: data_end - at], at)
        got = []
        h.block_status(0xFFFFFFFF, 0x800, lambda ctx, off, entries, err: got.append(
            (off, list(entries))) or 0)
        assert len(got) == 1, got
        off, entries = got[0]
        assert off == 0x800
        pos = off
        for i in range(0, len(entries), 2):
            length, state = entries[i], entries[i + 1]
            assert length > 0
            if pos < data_end:
                assert state == DATA, f"extent at {pos:#x} ({length:#x} bytes) says {state}"
            pos += length


def test_block_status_req_one(rw_server):
    base = 20 * MiB
    with handle(rw_server.uri()) as h:
        h.trim(4 * MiB, base)  # fresh file/memory exports are sparse anyway
        h.pwrite(pattern(1 * MiB, seed=12), base + 1 * MiB)
        for offset, request, state, max_len in [
            (base, 4 * MiB, HOLE_ZERO, 1 * MiB),
            (base + 1 * MiB, 4 * MiB, DATA, 1 * MiB),
            (base + 1 * MiB + 4096, 8192, DATA, 8192),
            (base + 3 * MiB, 512, HOLE_ZERO, 512),
        ]:
            got = []
            h.block_status(request, offset, lambda ctx, off, entries, err: got.append(
                (ctx, off, list(entries))) or 0, nbd.CMD_FLAG_REQ_ONE)
            assert len(got) == 1, got
            ctx, off, entries = got[0]
            assert (ctx, off) == (nbd.CONTEXT_BASE_ALLOCATION, offset)
            assert len(entries) == 2, f"REQ_ONE must give exactly one extent: {entries}"
            length, st = entries
            assert 0 < length <= max_len
            assert st == state


def test_read_df_is_one_chunk(rw_server):
    base = 24 * MiB
    data = pattern(64 * KiB, seed=13)
    with handle(rw_server.uri()) as h:
        assert h.can_df()
        h.trim(256 * KiB, base)
        h.pwrite(data, base + 64 * KiB)  # hole, data, hole
        expected = bytes(64 * KiB) + data + bytes(128 * KiB)
        for flags in (0, nbd.CMD_FLAG_DF):
            chunks = []

            def chunk(buf, offset, status, err):
                chunks.append((offset, len(buf), status))
                return 0

            got = h.pread_structured(len(expected), base, chunk, flags)
            assert got == expected
            # Chunks tile the request exactly.
            chunks.sort()
            pos = base
            for offset, length, status in chunks:
                assert offset == pos and status in (nbd.READ_DATA, nbd.READ_HOLE)
                pos += length
            assert pos == base + len(expected)
            if flags & nbd.CMD_FLAG_DF:
                assert len(chunks) == 1, f"DF read was fragmented: {chunks}"


def test_pipelined_requests(rw_server):
    """64 requests in flight at once; replies may come in any order."""
    n, size = 64, 64 * KiB
    h = open_handle(rw_server.uri())
    try:
        cookies = []
        for i in range(n):
            buf = nbd.Buffer.from_bytearray(bytearray(pattern(size, seed=100 + i)))
            cookies.append(h.aio_pwrite(buf, (2 * i + 1) * size))
        wait_for_aio(h)
        for c in cookies:
            assert h.aio_command_completed(c)
        reads = []
        for i in range(n):
            buf = nbd.Buffer(size)
            reads.append((i, buf, h.aio_pread(buf, (2 * i + 1) * size)))
        wait_for_aio(h)
        for i, buf, c in reads:
            assert h.aio_command_completed(c)
            assert buf.to_bytearray() == pattern(size, seed=100 + i), f"request {i}"
    finally:
        close_handle(h)


def test_multi_conn_flush_visibility(rw_server):
    """CAN_MULTI_CONN: after a flush (or FUA) on one connection, another
    connection sees the data."""
    a = open_handle(rw_server.uri())
    b = open_handle(rw_server.uri())
    try:
        assert a.can_multi_conn() and b.can_multi_conn()
        assert_reads(b, 10 * MiB, bytes(4096))  # b may have looked before
        data = pattern(128 * KiB, seed=14)
        a.pwrite(data, 10 * MiB)
        a.flush()
        assert_reads(b, 10 * MiB, data)
        data2 = pattern(4096, seed=15)
        b.pwrite(data2, 10 * MiB + 1, nbd.CMD_FLAG_FUA)
        assert_reads(a, 10 * MiB + 1, data2)
    finally:
        close_handle(a)
        close_handle(b)


def test_null_export(servers):
    """--null: writes are accepted and discarded, reads return zeroes."""
    server = servers(Export(kind="null", size=1 << 30))
    with handle(server.uri()) as h:
        assert h.get_size() == 1 << 30
        assert not h.is_read_only()
        h.pwrite(pattern(4096, seed=16), 4096)
        h.flush()
        assert_reads(h, 4096, bytes(4096))
        assert_reads(h, (1 << 30) - 512, bytes(512))


def test_nbdsh_command_line(rw_server):
    """The nbdsh program itself, with a script given via -c."""
    require_tools("nbdsh")
    script = [
        "buf = b'nbdsh!' * 1000",
        "h.pwrite(buf, 4097, nbd.CMD_FLAG_FUA)",
        "assert h.pread(len(buf), 4097) == buf",
        "h.zero(6000, 4097)",
        "assert h.pread(6000, 4097) == bytearray(6000)",
        "print(h.get_size(), h.can_multi_conn())",
    ]
    argv = ["nbdsh", "-u", rw_server.uri()]
    for line in script:
        argv += ["-c", line]
    assert run(argv).stdout.split() == [str(EXPORT_SIZE), "True"]
