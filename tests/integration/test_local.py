"""The embedded default (--site local): the quickstart finishes; a job over its cap fails with PyTorch's own error."""

import json
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


from hpcmem_cli import run_cli as hpcmem  # noqa: E402


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


def over_the_cap_spec(tmp_path, name: str, retry: str) -> Path:
    """Tiny GPT-2 at micro-batch 64 x seq 512 (eager): over the local backend's 1800 MiB address-space cap."""
    spec = tmp_path / "big.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: {name}
        command:
          module: toolkit.train
          args: [--model, "{REPO}/jobs/models/tiny-gpt2.json", --task, causal-lm, --steps, "2", --warmup-steps, "0"]
        gpus_per_node: 1
        mem_mib: 1800
        training: {{global_batch: 64, micro_batch: 64, seq_len: 512, attention: eager}}
        retry: {retry}
        """))
    return spec


def test_local_job_over_its_cap_fails_with_the_allocator_error_then_fits(tmp_path):
    """The first plan dies of PyTorch's real allocator error under the address-space cap; the controller
    comes back by itself with a plan that fits, same global batch. In-job recovery is turned off by the spec
    (``retry: {inflight: false}``, HPCMEM_INFLIGHT=0 in the job) since this is about the controller's resubmit; with it
    on the same error is answered inside the job (test_in_job_recovery_answers_the_same_error_in_one_attempt)."""
    spec = over_the_cap_spec(tmp_path, "over-the-cap", "{inflight: false}")
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.5", home=tmp_path)
    view = json.loads(result.stdout)
    first, last = view["attempts"][0], view["attempts"][-1]
    assert "export HPCMEM_INFLIGHT=0" in (Path(first["attempt_dir"]) / "job.sbatch").read_text()
    log = next(Path(first["attempt_dir"]).glob("slurm-*.out")).read_text()
    assert "DefaultCPUAllocator: can't allocate memory" in log, log[-3000:]
    assert first["state"] == "FAILED" and first["verdict"]["kind"] == "cpu_alloc_oom"
    assert result.returncode == 0 and view["state"] == "succeeded", result.stdout[-3000:]
    assert last["state"] == "COMPLETED" and len(view["attempts"]) >= 2
    assert {a["plan"]["global_batch"] for a in view["attempts"]} == {64}
    assert all(a["decision"]["moves"] for a in view["attempts"][1:])
    assert (Path(last["attempt_dir"]) / "metrics.json").is_file()


def test_in_job_recovery_answers_the_same_error_in_one_attempt(tmp_path):
    """The same job with in-job recovery on (the default): the allocator's error is caught in the step, all ranks
    agree, the micro-batch halves (accumulation doubles) until it fits, and the step is re-run: one attempt,
    COMPLETED, the same global batch, the moves in metrics.json and `hpcmem runs`."""
    spec = over_the_cap_spec(tmp_path, "over-the-cap-in-job", "{}")
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.5", home=tmp_path)
    view = json.loads(result.stdout)
    (attempt,) = view["attempts"]
    log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out")).read_text()
    assert result.returncode == 0 and view["state"] == "succeeded", log[-3000:]
    assert "HPCMEM_INFLIGHT" not in (Path(attempt["attempt_dir"]) / "job.sbatch").read_text()
    assert attempt["state"] == "COMPLETED" and "in-job move" in log
    moves = attempt["inflight_moves"]
    assert moves and all(m["step"] == 1 and m["global_batch"] == 64 for m in moves)
    assert moves[0]["from"]["micro_batch"] == 64 and moves[0]["verdict"]["kind"] == "cpu_alloc_oom"
    micro = moves[-1]["to"]["micro_batch"]
    assert micro < 64 and micro * moves[-1]["to"]["grad_accum"] == 64
    metrics = json.loads((Path(attempt["attempt_dir"]) / "metrics.json").read_text())
    assert metrics["applied"]["micro_batch"] == micro and metrics["plan"]["micro_batch"] == 64
