"""`zcnbd attach`, `detach` and `list` on this host. The devices themselves are tested in the
VM lab (tests/vm/guest.d/17-attach.sh, on a kernel with ublk_drv and nbd); here, what a host
without the drivers gets: one line naming the fix, exit 1, and nothing left behind."""

import os

import pytest

from support import ZCNBD_BIN, run

NO_UBLK = not os.path.exists("/dev/ublk-control")
NO_NBD = not os.path.exists("/sys/module/nbd")


@pytest.mark.skipif(not NO_UBLK, reason="this host has ublk: the VM lab's checks apply")
@pytest.mark.parametrize("argv", [["attach", "--driver", "ublk", "--memory", "16M"],
                                  ["detach", "/dev/ublkb0"]])
def test_without_the_driver_the_error_names_the_module(argv):
    p = run([str(ZCNBD_BIN), *argv], check=False)
    assert p.returncode == 1, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "modprobe ublk_drv" in lines[0], p.stderr
    assert p.stdout == ""


@pytest.mark.skipif(not NO_NBD, reason="this host has nbd.ko: the VM lab's checks apply")
@pytest.mark.parametrize("argv", [["attach", "--driver", "nbd", "--memory", "16M"],
                                  ["detach", "/dev/nbd0"]])
def test_without_nbd_ko_the_error_names_the_module(argv):
    p = run([str(ZCNBD_BIN), *argv], check=False)
    assert p.returncode == 1, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "modprobe nbd" in lines[0], p.stderr
    assert p.stdout == ""


@pytest.mark.skipif(not (NO_UBLK and NO_NBD), reason="this host has a driver")
def test_auto_without_either_driver_names_both_modules():
    p = run([str(ZCNBD_BIN), "attach", "--memory", "16M"], check=False)
    assert p.returncode == 1, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "modprobe ublk_drv" in lines[0] and "modprobe nbd" in lines[0], p.stderr


def test_list_without_devices_prints_only_the_header():
    p = run([str(ZCNBD_BIN), "list"], check=False)
    if not NO_UBLK and p.returncode != 0:
        pytest.skip(f"ublk present but not usable here: {p.stderr.strip()}")
    assert p.returncode == 0, p
    assert p.stdout.split()[:2] == ["DEVICE", "SIZE"]
    assert len(p.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [
    ["attach", "--memory", "16M", "--request-max", "1000"],
    ["attach", "--memory", "16M", "--request-max", "64M"],
    ["attach", "--memory", "16M", "--driver", "loop"],
    ["attach"],
    ["detach"],
])
def test_bad_command_lines_are_refused_before_anything_is_made(argv):
    p = run([str(ZCNBD_BIN), *argv], check=False)
    assert p.returncode == 2, p
    assert "error:" in p.stderr
