"""The embedded default (--site local): the quickstart finishes; a job over its cap fails with PyTorch's own error."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def hpcmem(*args, home, timeout=900):
    env = {**os.environ, "HPCMEM_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "toolkit.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def test_quickstart_runs_locally(tmp_path):
    result = hpcmem("submit", "quickstart", "--site", "local", "--wait", "--json", "--interval", "0.5", home=tmp_path)
    view = json.loads(result.stdout)
    (attempt,) = view["attempts"]
    log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out")).read_text()
    assert result.returncode == 0 and view["state"] == "succeeded", log[-3000:]
    assert "step 8/8" in log
    metrics = json.loads((Path(attempt["attempt_dir"]) / "metrics.json").read_text())
    assert metrics["peak_rss_mib"] > 0 and metrics["steps"] >= 1
    assert attempt["metrics"]["peak_rss_mib"] == metrics["peak_rss_mib"]


def test_local_job_over_its_cap_fails_with_the_allocator_error(tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: over-the-cap
        command:
          module: toolkit.train
          args: [--model, "{REPO}/jobs/models/gpt2.json", --task, causal-lm, --steps, "2"]
        gpus_per_node: 1
        mem_mib: 2500
        training: {{global_batch: 8, micro_batch: 8, seq_len: 512}}
        """))
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.5", home=tmp_path)
    assert result.returncode == 1
    view = json.loads(result.stdout)
    (attempt,) = view["attempts"]
    assert attempt["state"] == "FAILED" and view["state"] == "failed"
    log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out")).read_text()
    assert "DefaultCPUAllocator: can't allocate memory" in log, log[-3000:]
