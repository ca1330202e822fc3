"""The systemd units in dist/systemd: systemd accepts them, the service's command line
serves a config file's exports on a socket passed as the .socket unit passes it, and its
reload command makes the server re-read the file."""

import re
import shlex
import shutil
import subprocess
import time

import pytest

from support import REPO_ROOT, ZCNBD_BIN, ZCNBD_SERVE_ARGS, Server, require_tools, run

pytestmark = pytest.mark.zcnbd_only(reason="zcnbd's own units")

UNITS = REPO_ROOT / "dist" / "systemd"


def test_units_verify(tmp_path):
    require_tools("systemd-analyze")
    service = (UNITS / "zcnbd@.service").read_text().replace("/usr/bin/zcnbd", str(ZCNBD_BIN))
    (tmp_path / "zcnbd@.service").write_text(service)
    shutil.copy(UNITS / "zcnbd@.socket", tmp_path)
    p = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "./zcnbd@disk.service", "./zcnbd@disk.socket"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert (p.returncode, p.stderr) == (0, ""), p.stderr


def test_service_command_serves_the_config_on_a_passed_socket(tmp_path):
    """ExecStart= of zcnbd@NAME.service, under systemd-socket-activate listening where
    zcnbd@NAME.socket would (a Unix socket); then ExecReload= (systemctl reload)."""
    require_tools("systemd-socket-activate", "nbdinfo")
    service = (UNITS / "zcnbd@.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", service, re.M).group(1)
    config = tmp_path / "disk.toml"
    config.write_text('[[export]]\nname = "disk"\nmemory = "8M"\n')
    argv = shlex.split(exec_start.replace("/etc/zcnbd/%i.toml", str(config)))
    assert argv[:2] == ["/usr/bin/zcnbd", "serve"], argv
    argv = [str(ZCNBD_BIN), "serve", *ZCNBD_SERVE_ARGS, *argv[2:]]
    sock = tmp_path / "disk.sock"
    server = Server(["systemd-socket-activate", "-l", str(sock), *argv], tmp_path, [],
                    socket_path=sock)
    try:
        server.start()
        size = run(["nbdinfo", "--size", f"nbd+unix:///disk?socket={sock}"]).stdout
        assert int(size) == 8 << 20
        exec_reload = re.search(r"^ExecReload=(.*)$", service, re.M).group(1)
        config.write_text('[[export]]\nname = "disk"\nmemory = "8M"\n'
                          '[[export]]\nname = "more"\nmemory = "4M"\n')
        # systemd-socket-activate execs the service in its own process: MAINPID is its pid.
        run(shlex.split(exec_reload.replace("$MAINPID", str(server.proc.pid))))
        deadline = time.monotonic() + 10
        while "configuration reloaded" not in server.log():
            assert time.monotonic() < deadline, server.describe()
            time.sleep(0.05)
        size = run(["nbdinfo", "--size", f"nbd+unix:///more?socket={sock}"]).stdout
        assert int(size) == 4 << 20
        server.stop()
    finally:
        server.cleanup()
