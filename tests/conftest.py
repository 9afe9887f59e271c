"""Shared fixtures. Markers (setup.cfg): slurm = needs the real test cluster; slow = minutes."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def newest_deepspeed_read(monkeypatch):
    """Estimates in tests assume the newest DeepSpeed whose allocations were read (``gpu.CURRENT_DEEPSPEED``), not
    whichever one this machine has installed (setup.cfg allows >= 0.14): a Runtime that names no version would
    otherwise follow ``gpu.installed_deepspeed``. A test of that rule sets it itself."""
    from toolkit.estimate import gpu

    monkeypatch.setattr(gpu, "installed_deepspeed", lambda: None)


@pytest.fixture
def hpcmem_home(tmp_path, monkeypatch):
    """A fresh $HPCMEM_HOME for one test."""
    home = tmp_path / "home"
    monkeypatch.setenv("HPCMEM_HOME", str(home))
    return home


def slurm_up() -> bool:
    """True when the test cluster answers (sinfo lists a node)."""
    if not shutil.which("sinfo"):
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


@pytest.fixture(scope="session")
def slurm_cluster():
    """The real single-node Slurm test cluster; started by tests/cluster/slurm-up.sh when needed.

    In CI (CI=true) a cluster that cannot be started is a failure, not a skip.
    """
    if not slurm_up():
        script = REPO / "tests" / "cluster" / "slurm-up.sh"
        result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        if result.returncode != 0 or not slurm_up():
            message = f"Slurm test cluster is not up: {result.stdout[-2000:]}{result.stderr[-2000:]}"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
    return "testcluster"
