"""Triage reads a ticket's log even when the hpcmem ledger beside it is damaged: a warning, not a failure."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOG = REPO / "tests" / "fixtures" / "logs" / "nccl_cuda_oom.log"


def test_a_damaged_ledger_is_a_warning_and_the_log_is_still_triaged(tmp_path):
    (tmp_path / "ledger.sqlite").write_bytes(b"not a database at all" * 100)
    env = {"HPCMEM_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "toolkit.cli", "triage", str(LOG), "--format", "json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"kind": "nccl_oom"' in out.stdout
    warning = [line for line in out.stderr.splitlines() if line.startswith("hpcmem: warning:")]
    assert len(warning) == 1 and "without the ledger" in warning[0] and "hpcmem doctor" in warning[0]
    assert (tmp_path / "ledger.sqlite").read_bytes().startswith(b"not a database")  # nothing recorded is touched
