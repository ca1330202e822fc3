"""nbdcopy with several connections (multi-conn): file -> NBD, NBD -> file,
NBD -> NBD; contents compared byte for byte."""

import pytest

from support import (
    EXPORT_SIZE, Export, MiB, assert_export_matches_file, files_equal, handle,
    make_data_image, read_file_range, require_tools, run,
)


@pytest.fixture(autouse=True)
def _tools():
    require_tools("nbdcopy")


def nbdcopy(src, dst, *extra, check=True):
    return run(["nbdcopy", "--connections=4", *extra, src, dst], check=check)


def test_copy_in_and_out(rw_server, data_dir):
    src, dst = data_dir / "src.img", data_dir / "dst.img"
    make_data_image(src, seed=10)
    uri = rw_server.uri()
    nbdcopy(src, uri, "--flush")
    assert_export_matches_file(uri, src)
    nbdcopy(uri, dst)
    assert files_equal(src, dst)


def test_copy_over_existing_data(rw_server, data_dir):
    """Zero ranges of the source must overwrite old data on the export."""
    uri = rw_server.uri()
    old, new = data_dir / "old.img", data_dir / "new.img"
    make_data_image(old, seed=20)
    with open(old, "r+b") as f:  # make the old image dense-ish
        f.seek(20 * MiB)
        f.write(b"\xff" * (4 * MiB))
    make_data_image(new, seed=30)
    nbdcopy(old, uri)
    nbdcopy(new, uri)
    assert_export_matches_file(uri, new)


def test_copy_out_of_read_only(ro_server, data_dir):
    dst = data_dir / "dst.img"
    nbdcopy(ro_server.uri(), dst)
    assert dst.stat().st_size == EXPORT_SIZE
    export = ro_server.export
    # The whole copy, not samples of it.
    assert read_file_range(dst, 0, EXPORT_SIZE) == export.initial_content(0, EXPORT_SIZE)


def test_copy_into_read_only_fails(ro_server, data_dir):
    src = data_dir / "src.img"
    make_data_image(src, seed=40)
    assert nbdcopy(src, ro_server.uri(), check=False).returncode != 0


def test_copy_nbd_to_nbd(servers, export_factory, data_dir):
    src_server = servers(export_factory("file"))
    dst_server = servers(Export(kind="memory"))
    image = data_dir / "image.img"
    make_data_image(image, seed=50)
    nbdcopy(image, src_server.uri())
    nbdcopy(src_server.uri(), dst_server.uri(), "--flush")
    assert_export_matches_file(dst_server.uri(), image)
    with handle(dst_server.uri()) as h:
        assert h.get_size() == EXPORT_SIZE
