"""Fixtures for the zcnbd interop suite.

Environment:
  ZCNBD_BIN            server binary (default: target/release/zcnbd)
  ZCNBD_TEST_SERVER    "zcnbd" (default) or "nbdkit" to validate the suite
                       against nbdkit; tests marked zcnbd_only are skipped
  ZCNBD_TEST_VERBOSE   pass -v to the server (logs are shown for failed tests)
  CI=true              missing client tools are failures instead of skips
"""

from __future__ import annotations

import faulthandler
import shutil
import tempfile
from pathlib import Path

import pytest

import support
from support import ALL_KINDS, BACKEND, READONLY_KINDS, WRITABLE_KINDS, Export

# Hard per-test limit: a hung server or client dumps all stacks and aborts
# the run instead of blocking CI forever.
TEST_TIME_LIMIT = 120


def pytest_report_header(config):
    target = support.ZCNBD_BIN if BACKEND == "zcnbd" else "nbdkit"
    return f"interop: server backend {BACKEND} ({target}), CI={support.IS_CI}"


def pytest_collection_modifyitems(config, items):
    if BACKEND == "zcnbd":
        return
    for item in items:
        marker = item.get_closest_marker("zcnbd_only")
        if marker:
            why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(reason=f"zcnbd-only: {why}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.test_failed = report.failed


@pytest.fixture(autouse=True)
def _time_limit():
    faulthandler.dump_traceback_later(TEST_TIME_LIMIT, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def _data_root(tmp_path_factory) -> Path:
    """A directory for backing files on a filesystem that supports O_DIRECT
    (tmpfs does not, so /tmp may not do)."""
    candidates = [tmp_path_factory.getbasetemp(), Path("/var/tmp"), support.REPO_ROOT / "target"]
    for base in candidates:
        try:
            base.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix="zcnbd-interop-", dir=base))
        except OSError:
            continue
        if support.supports_o_direct(root):
            yield root
            shutil.rmtree(root, ignore_errors=True)
            return
        shutil.rmtree(root, ignore_errors=True)
    support.missing("no directory supporting O_DIRECT found for --direct exports")


@pytest.fixture
def data_dir(_data_root) -> Path:
    """Per-test directory for backing files and client-side images."""
    d = Path(tempfile.mkdtemp(prefix="t-", dir=_data_root))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers(request):
    """Factory: servers(exports, transport="unix"|"tcp", ...) -> Server.

    At teardown every server still running gets SIGTERM and must exit with
    status 0 within 10 s.  The server log is printed for failed tests."""
    started: list[support.Server] = []

    def start(exports, **kw) -> support.Server:
        server = support.start_server(exports, **kw)
        started.append(server)
        return server

    yield start

    errors = []
    for server in started:
        if getattr(request.node, "test_failed", False):
            print(f"\n{server.describe()}")
        try:
            server.stop()
        except BaseException as e:  # pytest.fail raises an Exception subclass
            errors.append(str(e))
        finally:
            server.cleanup()
    if errors:
        pytest.fail("\n\n".join(errors))


# --- exports parametrized over kinds -----------------------------------------------
@pytest.fixture
def export_factory(data_dir):
    """make(label, **overrides) -> Export, e.g. make("file-ro", name="disk")."""
    return lambda label, **kw: support.make_export(label, data_dir, **kw)


@pytest.fixture(params=WRITABLE_KINDS)
def rw_export(request, export_factory) -> Export:
    return export_factory(request.param)


@pytest.fixture(params=READONLY_KINDS)
def ro_export(request, export_factory) -> Export:
    return export_factory(request.param)


@pytest.fixture(params=ALL_KINDS)
def any_export(request, export_factory) -> Export:
    return export_factory(request.param)


@pytest.fixture
def rw_server(rw_export, servers) -> support.Server:
    return servers(rw_export)


@pytest.fixture
def ro_server(ro_export, servers) -> support.Server:
    return servers(ro_export)


@pytest.fixture
def any_server(any_export, servers) -> support.Server:
    return servers(any_export)


@pytest.fixture
def mem_server(servers) -> support.Server:
    """A single writable 64 MiB memory export, for tests that don't care."""
    return servers(Export(kind="memory"))


@pytest.fixture
def multi_exports(export_factory) -> list[Export]:
    """The exports of a --config server (see multi_server)."""
    return [
        Export(kind="memory", name="mem", description="a memory disk"),
        Export(kind="null", size=1 << 30, name="zero", description="discards writes"),
        export_factory("file", name="disk", description="a file disk"),
        export_factory("memory-ro", name="ro", description="read-only"),
    ]


@pytest.fixture
def multi_server(multi_exports, servers) -> support.Server:
    """A server with several exports (zcnbd --config FILE.toml).  Under nbdkit
    they all share one memory plugin and differ only in name/description."""
    return servers(multi_exports)


# --- Ceph RBD ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def ceph_cluster():
    """One throwaway single-node Ceph cluster for the whole run (tests/ceph/cluster.sh)."""
    if BACKEND != "zcnbd":
        pytest.skip("RBD exports are zcnbd's")
    import ceph

    cluster = ceph.start_cluster()
    yield cluster
    ceph.stop_cluster(cluster)


@pytest.fixture
def rbd_export(ceph_cluster) -> Export:
    """A fresh 64 MiB image of the test cluster, as an export."""
    image = ceph_cluster.new_image("64M")
    return Export(kind="rbd", rbd=image, ceph_conf=ceph_cluster.conf)
