"""Reloading `--config` on SIGHUP: new exports appear, removed ones take no new clients while
attached clients finish, unchanged ones keep their open backend (a memory export keeps its
data), and a configuration that cannot be served is logged and the running one kept."""

import errno
import json
import os
import signal
import threading
import time

import pytest

import tls_creds
from support import (
    MiB, Export, close_handle, handle, nbd, open_handle, pattern, require_tools, run, toml_str,
)

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's SIGHUP reload of --config")

RELOADED = "configuration reloaded"
REFUSED = "configuration not reloaded"


def memory(name: str, size: int = 64 * MiB, **kw) -> Export:
    return Export(kind="memory", name=name, size=size, **kw)


def config_path(server):
    return server.workdir / "exports.toml"


def sighup(server, text: str, timeout: float = 10.0) -> str:
    """Writes `text` as the server's config file, sends SIGHUP and waits for the reload's
    outcome in the log: RELOADED or REFUSED."""
    log = server.log()
    before = (log.count(RELOADED), log.count(REFUSED))
    config_path(server).write_text(text)
    server.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while True:
        log = server.log()
        reloaded, refused = log.count(RELOADED), log.count(REFUSED)
        if (reloaded, refused) != before:
            assert reloaded + refused == sum(before) + 1, log
            return RELOADED if reloaded > before[0] else REFUSED
        if time.monotonic() > deadline:
            pytest.fail(f"no reload outcome logged within {timeout}s\n{server.describe()}")
        time.sleep(0.05)


def config(*exports: Export) -> str:
    return "\n".join(e.toml() for e in exports)


def listed(server) -> list[str]:
    require_tools("nbdinfo")
    out = run(["nbdinfo", "--list", "--json", server.uri("")]).stdout
    return sorted(e["export-name"] for e in json.loads(out)["exports"])


def refused_as_unknown(server, name: str) -> None:
    with pytest.raises(nbd.Error) as e:
        close_handle(open_handle(server.uri(name)))
    assert e.value.errnum == errno.ENOENT, e.value


def test_sighup_adds_and_removes_exports_while_attached_clients_keep_working(servers):
    server = servers([memory("a"), memory("b")])
    data_a, data_b = pattern(256 * 1024, seed=1), pattern(256 * 1024, seed=2)
    on_a = open_handle(server.uri("a"))
    on_b = open_handle(server.uri("b"))
    try:
        on_a.pwrite(data_a, 1 * MiB)
        on_b.pwrite(data_b, 2 * MiB)
        assert sighup(server, config(memory("a"), memory("c", 32 * MiB))) == RELOADED
        assert listed(server) == ["a", "c"]
        refused_as_unknown(server, "b")
        with handle(server.uri("c")) as c:
            assert c.get_size() == 32 * MiB
        # The client of the kept export goes on, on the same disk.
        assert on_a.pread(len(data_a), 1 * MiB) == data_a
        on_a.pwrite(data_b, 3 * MiB)
        on_a.flush()
        # A new client of a sees what was written before the reload: the memory export
        # was not reallocated.
        with handle(server.uri("a")) as again:
            assert again.pread(len(data_a), 1 * MiB) == data_a
            assert again.pread(len(data_b), 3 * MiB) == data_b
        # The client of the removed export finishes its work.
        assert on_b.pread(len(data_b), 2 * MiB) == data_b
        on_b.pwrite(data_a, 4 * MiB)
        assert on_b.pread(len(data_a), 4 * MiB) == data_a
        assert "removed export closed" not in server.log()
    finally:
        close_handle(on_b)
    deadline = time.monotonic() + 5
    while "removed export closed" not in server.log():
        if time.monotonic() > deadline:
            pytest.fail(f"b was not closed after its last client left\n{server.describe()}")
        time.sleep(0.05)
    try:
        assert on_a.pread(len(data_a), 1 * MiB) == data_a
    finally:
        close_handle(on_a)


def test_a_config_that_cannot_be_served_keeps_the_running_one(servers, tmp_path):
    server = servers([memory("a"), memory("b")])
    data = pattern(64 * 1024, seed=3)
    with handle(server.uri("a")) as h:
        h.pwrite(data, 0)
        bad = {
            "not TOML": "[[export]\nname = \"c\"\n",
            "no backend": "[[export]]\nname = \"c\"\n",
            "a missing file": config(memory("a")) + "\n[[export]]\nname = \"d\"\n"
            f"file = \"{tmp_path / 'missing.img'}\"\n",
            "a name twice": config(memory("a"), memory("a")),
            "no exports": "",
        }
        for why, text in bad.items():
            assert sighup(server, text) == REFUSED, why
            assert listed(server) == ["a", "b"], why
        assert h.pread(len(data), 0) == data
    assert "missing.img" in server.log()
    # The reloader still works after refusals, and a kept its data through them.
    assert sighup(server, config(memory("a"))) == RELOADED
    assert listed(server) == ["a"]
    with handle(server.uri("a")) as h:
        assert h.pread(len(data), 0) == data


def test_new_settings_keep_the_disk_and_a_new_definition_replaces_it(servers):
    server = servers([memory("a"), memory("b")])
    data = pattern(64 * 1024, seed=4)
    for name in ("a", "b"):
        with handle(server.uri(name)) as h:
            h.pwrite(data, 0)
    on_b = open_handle(server.uri("b"))
    try:
        # a: new description and read-only (the same disk); b: a new size (a new disk).
        new = config(memory("a", description="now read-only", read_only=True),
                     memory("b", 32 * MiB))
        assert sighup(server, new) == RELOADED
        with handle(server.uri("a")) as a:
            assert a.get_export_description() == "now read-only"
            assert a.is_read_only()
            assert a.pread(len(data), 0) == data
        with handle(server.uri("b")) as b:
            assert b.get_size() == 32 * MiB
            assert b.pread(len(data), 0) == bytes(len(data))
        # The client attached before stays on the old disk.
        assert on_b.get_size() == 64 * MiB
        assert on_b.pread(len(data), 0) == data
    finally:
        close_handle(on_b)


def test_sighup_without_config_is_logged_and_ignored(servers):
    server = servers(memory("only"))
    data = pattern(4096, seed=5)
    with handle(server.uri("only")) as h:
        h.pwrite(data, 0)
        server.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "no --config file to re-read" not in server.log():
            if time.monotonic() > deadline:
                pytest.fail(f"SIGHUP not logged\n{server.describe()}")
            time.sleep(0.05)
        assert server.running()
        assert h.pread(len(data), 0) == data


def test_a_lowered_client_limit_counts_the_clients_already_attached(servers):
    server = servers([memory("a"), memory("b")])
    first, second = open_handle(server.uri("a")), open_handle(server.uri("a"))
    try:
        assert sighup(server, config(memory("a", max_connections=2), memory("b"))) == RELOADED
        with pytest.raises(nbd.Error):
            close_handle(open_handle(server.uri("a")))
        assert "export's client limit (2) reached" in server.log()
        close_handle(first)
        with handle(server.uri("a")) as third:
            assert third.get_size() == 64 * MiB
        assert second.pread(512, 0) == bytes(512)
    finally:
        close_handle(first)
        close_handle(second)


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> tls_creds.Creds:
    return tls_creds.make(tmp_path_factory.mktemp("tls"))


def tls_table(**settings) -> str:
    lines = [f"{k} = {toml_str(str(v))}" for k, v in settings.items()]
    return "\n[tls]\n" + "\n".join(lines) + "\n"


def served_with_psk(server, name: str, keys) -> bool:
    """Whether a client holding the key in `keys` (for PSK_USER) can use export `name`."""
    uri = (f"nbds://{tls_creds.PSK_USER}@localhost:{server.port}/{name}"
           f"?tls-psk-file={keys}")
    return run(["nbdinfo", "--size", uri], check=False).returncode == 0


def served_in_plain_text(server, name: str) -> bool:
    return run(["nbdinfo", "--size", server.uri(name)], check=False).returncode == 0


def test_a_reload_loads_the_tls_table_and_its_credentials_anew(servers, creds):
    require_tools("nbdinfo")
    server = servers([memory("a"), memory("b")], transport="tcp")
    exports = config(memory("a"), memory("b"))
    assert sighup(server, exports + tls_table(mode="require", psk=creds.psk)) == RELOADED
    assert served_with_psk(server, "a", creds.psk)
    assert not served_in_plain_text(server, "a")
    # Rotated keys: the old key is refused from now on.
    assert sighup(server, exports + tls_table(mode="require", psk=creds.psk_wrong)) == RELOADED
    assert served_with_psk(server, "a", creds.psk_wrong)
    assert not served_with_psk(server, "a", creds.psk)
    # Credentials that do not load refuse the whole reload: no export c, the same key.
    broken = config(memory("a"), memory("c")) + tls_table(
        mode="require", certificates="/nonexistent/zcnbd-tls")
    assert sighup(server, broken) == REFUSED
    assert "zcnbd-tls" in server.log()
    assert served_with_psk(server, "b", creds.psk_wrong)
    # No [tls] table: TLS off again.
    assert sighup(server, exports) == RELOADED
    assert served_in_plain_text(server, "a")


def test_a_reload_rereads_the_credentials_the_command_line_names(servers, creds, tmp_path):
    require_tools("nbdinfo")
    keys = tmp_path / "keys.psk"
    keys.write_bytes(creds.psk.read_bytes())
    keys.chmod(0o600)
    server = servers([memory("a"), memory("b")], transport="tcp",
                     extra_args=["--tls=require", f"--tls-psk={keys}"])
    assert served_with_psk(server, "a", creds.psk)
    # A [tls] table in the file is not used: the command line's settings replace it.
    off = config(memory("a"), memory("b")) + tls_table(mode="off")
    keys.write_bytes(creds.psk_wrong.read_bytes())
    assert sighup(server, off) == RELOADED
    assert served_with_psk(server, "a", creds.psk_wrong)
    assert not served_with_psk(server, "a", creds.psk)
    assert not served_in_plain_text(server, "a")


def test_clients_of_a_kept_export_connect_throughout_a_run_of_reloads(servers):
    """Handshakes racing swaps: each sees the old set or the new one, so every client of the
    export both sets have attaches, to the same disk."""
    server = servers([memory("a"), memory("b")])
    data = pattern(4096, seed=6)
    with handle(server.uri("a")) as h:
        h.pwrite(data, 0)
    stop = threading.Event()
    sent = 0

    def reload_forever():
        nonlocal sent
        texts = [config(memory("a"), memory("c")), config(memory("a"), memory("b"))]
        while not stop.is_set():
            # Whole files only (rename), so every reload reads a config that can be served.
            tmp = config_path(server).with_suffix(".tmp")
            tmp.write_text(texts[sent % 2])
            os.replace(tmp, config_path(server))
            server.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.005)

    reloader = threading.Thread(target=reload_forever)
    reloader.start()
    connects = 0
    deadline = time.monotonic() + 30
    try:
        while connects < 60 or sent < 30:
            assert time.monotonic() < deadline, f"{connects} clients, {sent} reloads"
            with handle(server.uri("a")) as h:
                assert h.pread(len(data), 0) == data
            connects += 1
    finally:
        stop.set()
        reloader.join()
    assert REFUSED not in server.log()
    deadline = time.monotonic() + 10
    while server.log().count(RELOADED) == 0:
        assert time.monotonic() < deadline, server.describe()
        time.sleep(0.05)
