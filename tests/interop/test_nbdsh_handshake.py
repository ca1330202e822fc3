"""Negotiation as seen by libnbd (the library behind nbdsh): advertised
flags, sizes, block sizes, export names, NBD_OPT_LIST/INFO/GO/ABORT and
meta contexts."""

import pytest

from support import (
    EXPORT_SIZE, MAX_PAYLOAD, PREFERRED_BLOCK, RW_CAPS, Export, assert_reads, caps,
    close_handle, expected_caps, handle, nbd, new_handle, open_handle, pattern,
)


def test_transmission_flags(any_server):
    with handle(any_server.uri()) as h:
        assert caps(h) == expected_caps(any_server.export)
        assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
        assert h.get_protocol() == "newstyle-fixed"
        assert h.get_structured_replies_negotiated()
        assert h.get_size() == EXPORT_SIZE


def test_default_block_sizes(any_server):
    with handle(any_server.uri()) as h:
        assert [h.get_block_size(t) for t in
                (nbd.SIZE_MINIMUM, nbd.SIZE_PREFERRED, nbd.SIZE_MAXIMUM)] == [1, PREFERRED_BLOCK, MAX_PAYLOAD]


@pytest.mark.parametrize("minimum", [512, 4096])
def test_min_block_size_option(servers, minimum):
    server = servers(Export(kind="memory", min_block_size=minimum))
    with handle(server.uri()) as h:
        assert h.get_block_size(nbd.SIZE_MINIMUM) == minimum
        assert h.get_block_size(nbd.SIZE_PREFERRED) == max(minimum, PREFERRED_BLOCK)
        assert h.get_block_size(nbd.SIZE_MAXIMUM) == MAX_PAYLOAD
        data = pattern(2 * minimum, seed=minimum)
        h.pwrite(data, 3 * minimum)
        assert_reads(h, 3 * minimum, data)


def test_export_name_and_description(servers):
    server = servers(Export(kind="memory", name="disk", description="a memory disk"))
    with handle(server.uri()) as h:
        assert h.get_canonical_export_name() == "disk"
        assert h.get_export_description() == "a memory disk"


def test_unknown_export_is_refused(servers):
    server = servers(Export(kind="memory", name="disk"))
    h = new_handle()
    with pytest.raises(nbd.Error):
        h.connect_uri(server.uri("no-such-export"))
    close_handle(h)
    # The refusal must not have hurt the server.
    with handle(server.uri("disk")) as h:
        assert h.get_size() == EXPORT_SIZE


def test_opt_list(servers):
    server = servers(Export(kind="memory", name="disk", description="a memory disk"))
    h = open_handle(server.uri(), opt_mode=True)
    listed = []
    assert h.opt_list(lambda name, desc: listed.append((name, desc)) or 0) == 1
    assert listed == [("disk", "a memory disk")]
    h.opt_abort()
    assert h.aio_is_closed()
    close_handle(h)


def test_opt_info_then_go(servers):
    server = servers(Export(kind="memory", name="disk"))
    h = open_handle(server.uri(), opt_mode=True)
    h.set_export_name("disk")
    h.opt_info()
    assert h.get_size() == EXPORT_SIZE
    assert caps(h) == RW_CAPS
    assert h.get_block_size(nbd.SIZE_PREFERRED) == PREFERRED_BLOCK
    # INFO on an unknown name fails but leaves negotiation usable.
    h.set_export_name("no-such-export")
    with pytest.raises(nbd.Error):
        h.opt_info()
    h.set_export_name("disk")
    h.opt_go()
    assert h.aio_is_ready()
    assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.pwrite(b"hello", 100)
    assert h.pread(5, 100) == b"hello"
    close_handle(h)


def test_opt_list_meta_context(mem_server):
    h = open_handle(mem_server.uri(), opt_mode=True)
    # With one query, base:allocation; with the "base:" wildcard, the same.
    for query in (nbd.CONTEXT_BASE_ALLOCATION, nbd.NAMESPACE_BASE):
        h.clear_meta_contexts()
        h.add_meta_context(query)
        found = []
        n = h.opt_list_meta_context(lambda name: found.append(name) or 0)
        assert found == [nbd.CONTEXT_BASE_ALLOCATION], query
        assert n == 1
    # An unknown namespace is ignored: no contexts, no error.
    h.clear_meta_contexts()
    h.add_meta_context("x-no-such-namespace:thing")
    found = []
    assert h.opt_list_meta_context(lambda name: found.append(name) or 0) == 0
    assert found == []
    h.opt_abort()
    close_handle(h)


def test_without_structured_replies(any_server):
    with handle(any_server.uri(), structured=False) as h:
        assert not h.get_structured_replies_negotiated()
        # DF and meta contexts need structured replies.
        assert not h.can_df()
        assert not h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
        export = any_server.export
        assert h.pread(4096, 8 << 20) == bytes(4096)
        if export.initial:
            offset, data = export.initial[0]
            assert_reads(h, offset, data)
        if export.writable:
            data = pattern(70000, seed=7)
            h.pwrite(data, 123457)
            assert_reads(h, 123457, data)


def test_opt_abort(mem_server):
    h = open_handle(mem_server.uri(), opt_mode=True)
    h.opt_abort()
    assert h.aio_is_closed()
    close_handle(h)
