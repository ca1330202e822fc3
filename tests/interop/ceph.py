"""A throwaway Ceph cluster for the RBD tests (tests/ceph/cluster.sh), and images in it.

Environment:
  ZCNBD_CEPH_CONF   use this running cluster's ceph.conf instead of starting one (its
                    client.admin key must be in the keyring it names; pool `rbd` must exist)
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import REPO_ROOT, missing, require_tools, run

CLUSTER_SH = REPO_ROOT / "tests" / "ceph" / "cluster.sh"
POOL = "rbd"
# cluster.sh's client mount and OSD op timeouts (seconds): a request the cluster leaves
# unanswered fails after this long.
OP_TIMEOUT_S = 10
CEPH_TOOLS = ("ceph-mon", "ceph-osd", "ceph", "rbd", "rados", "ceph-authtool", "monmaptool")


@dataclass
class Cluster:
    conf: Path
    directory: Path | None  # None: not ours (ZCNBD_CEPH_CONF)
    _names = itertools.count()

    def env(self) -> dict:
        return {**os.environ, "CEPH_CONF": str(self.conf)}

    def rbd(self, *args, timeout: float = 60, check: bool = True):
        return run(["rbd", "-c", self.conf, *args], timeout=timeout, check=check)

    def new_image(self, size: str = "64M") -> str:
        """A fresh image in pool `rbd`; returns POOL/IMAGE."""
        name = f"{POOL}/t{os.getpid()}-{next(self._names)}"
        self.rbd("create", name, "--size", size)
        return name

    def export_image(self, spec: str, dest: Path) -> bytes:
        """The image's bytes, read by `rbd export` (not through any NBD server). An export
        the cluster times out (ETIMEDOUT, 110: seen in CI right after the OSD-fault test,
        a continued OSD stalling again) is tried again, up to three times in all: Ceph's
        recovery is not what the callers check."""
        for _ in range(2):
            p = self.rbd("export", spec, dest, check=False)
            if p.returncode == 0:
                return dest.read_bytes()
            dest.unlink(missing_ok=True)
            if p.returncode != errno.ETIMEDOUT:
                break
            print(f"rbd export timed out (the cluster stalled); again:\n{p.stderr}")
        # The last try: its failure is the test's, with the tool's output.
        self.rbd("export", spec, dest)
        return dest.read_bytes()

    def osd(self, action: str) -> None:
        """osd-stop, osd-cont, osd-kill or osd-start (see cluster.sh)."""
        if self.directory is None:
            pytest.skip("ZCNBD_CEPH_CONF names a cluster that is not ours to stop")
        p = run([CLUSTER_SH, action, self.directory], timeout=240)
        if p.stderr:
            # cluster.sh says so when Ceph needed a restart to serve again (shown on failure).
            print(p.stderr)


def start_cluster() -> Cluster:
    given = os.environ.get("ZCNBD_CEPH_CONF")
    if given:
        return Cluster(conf=Path(given), directory=None)
    require_tools(*CEPH_TOOLS)
    directory = Path(tempfile.mkdtemp(prefix="zcnbd-ceph-"))
    p = subprocess.run([CLUSTER_SH, "start", directory], capture_output=True, text=True,
                       timeout=180)
    if p.returncode != 0:
        log = ""
        for f in sorted((directory / "log").glob("*.log")):
            log += f"--- {f.name} (tail) ---\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:]) + "\n"
        subprocess.run([CLUSTER_SH, "stop", directory], timeout=60)
        missing(f"the test Ceph cluster did not start:\n{p.stderr}\n{log}")
    return Cluster(conf=directory / "ceph.conf", directory=directory)


def stop_cluster(cluster: Cluster) -> None:
    if cluster.directory is not None:
        subprocess.run([CLUSTER_SH, "stop", cluster.directory], timeout=60)
        shutil.rmtree(cluster.directory, ignore_errors=True)
