"""nbdinfo: --json, --size, --is, --can, --list (several exports from a
config file) and --map after trim and write-zeroes."""

import json

import pytest

from support import (
    BACKEND, EXPORT_SIZE, MAX_PAYLOAD, PREFERRED_BLOCK, MiB, expected_caps, handle, pattern,
    require_tools, run,
)


@pytest.fixture(autouse=True)
def _tools():
    require_tools("nbdinfo")


def nbdinfo_json(*args):
    return json.loads(run(["nbdinfo", "--json", *args]).stdout)


def test_json(any_server):
    info = nbdinfo_json(any_server.uri())
    assert info["protocol"] == "newstyle-fixed"
    assert info["TLS"] is False
    assert info["structured"] is True
    (export,) = info["exports"]
    assert export["export-size"] == EXPORT_SIZE
    assert export["contexts"] == ["base:allocation"]
    assert (export["block_size_minimum"], export["block_size_preferred"],
            export["block_size_maximum"]) == (1, PREFERRED_BLOCK, MAX_PAYLOAD)
    assert {k: export[k] for k in expected_caps(any_server.export)} == expected_caps(any_server.export)


def test_size_is_can(any_server):
    uri = any_server.uri()
    assert run(["nbdinfo", "--size", uri]).stdout.strip() == str(EXPORT_SIZE)
    read_only = any_server.export.read_only
    # Exit status: 0 = true, 2 = false.
    assert run(["nbdinfo", "--is", "read-only", uri], check=False).returncode == (0 if read_only else 2)
    caps = expected_caps(any_server.export)
    for feature, cap in [("trim", "can_trim"), ("zero", "can_zero"), ("fua", "can_fua"),
                         ("flush", "can_flush"), ("cache", "can_cache"), ("df", "can_df"),
                         ("multi-conn", "can_multi_conn"), ("fast-zero", "can_fast_zero")]:
        rc = run(["nbdinfo", "--can", feature, uri], check=False).returncode
        assert rc == (0 if caps[cap] else 2), feature


def test_list_several_exports(multi_server, multi_exports):
    info = nbdinfo_json("--list", multi_server.uri(""))
    listed = {e["export-name"]: e for e in info["exports"]}
    assert sorted(listed) == sorted(e.name for e in multi_exports)
    for e in multi_exports:
        got = listed[e.name]
        assert got.get("description") == e.description
        if BACKEND == "zcnbd":  # nbdkit serves one plugin under every name
            assert got["export-size"] == e.size
            assert got["is_read_only"] == e.read_only
            assert got["can_trim"] == (not e.read_only)


def test_list_plain_text(multi_server, multi_exports):
    out = run(["nbdinfo", "--list", multi_server.uri("")]).stdout
    for e in multi_exports:
        assert f"export=\"{e.name}\":" in out, out
        assert f"description: {e.description}" in out


def nbdinfo_map(uri):
    """nbdinfo --map --json -> [(offset, length, type)], checked contiguous."""
    entries = json.loads(run(["nbdinfo", "--map", "--json", uri]).stdout)
    pos = 0
    result = []
    for e in entries:
        assert e["offset"] == pos and e["length"] > 0, entries
        result.append((e["offset"], e["length"], e["type"]))
        pos += e["length"]
    assert pos == EXPORT_SIZE, entries
    return result


def type_at(mapping, offset):
    return next(t for off, length, t in mapping if off <= offset < off + length)


def test_map_after_trim_and_zero(rw_server):
    base = 8 * MiB
    uri = rw_server.uri()
    with handle(uri) as h:
        h.pwrite(pattern(6 * MiB, seed=1), base)
        h.trim(1 * MiB, base + 1 * MiB)
        h.zero(1 * MiB, base + 3 * MiB)
        h.flush()
    mapping = nbdinfo_map(uri)
    expected = {  # range start -> base:allocation type
        base: 0,
        base + 1 * MiB: 3,  # trimmed
        base + 2 * MiB: 0,
        base + 3 * MiB: 3,  # write zeroes without NO_HOLE
        base + 4 * MiB: 0,
        base + 6 * MiB: 3,  # never written
    }
    for start, want in expected.items():
        for probe in (start, start + 1 * MiB - 1):
            assert type_at(mapping, probe) == want, (probe, mapping)
    # Each 1 MiB range is exactly one extent boundary to the next.
    starts = {off for off, _, _ in mapping}
    for start in expected:
        assert start in starts, (start, mapping)


def test_map_fresh_export(any_server):
    export = any_server.export
    mapping = nbdinfo_map(any_server.uri())
    for offset, data in export.initial:
        assert type_at(mapping, offset) == 0
        assert type_at(mapping, offset + len(data) - 1) == 0
    assert type_at(mapping, 32 * MiB) == 3
    assert type_at(mapping, EXPORT_SIZE - 1) == 3
