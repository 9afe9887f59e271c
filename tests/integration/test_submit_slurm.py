"""End to end on the real Slurm test cluster: rendered scripts pass sbatch --test-only, and real jobs
(torchrun 2 ranks, DeepSpeed ZeRO 1/2/3, ZeRO-3 with CPU and NVMe offload) train the reference model
through `hpcmem submit --wait`, leaving metrics.json; a job over its --mem ends OUT_OF_MEMORY."""

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from toolkit import jobspec, render, sites
from hpcmem_cli import run_cli  # noqa: E402

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
TC = sites.load_site("testcluster")


def hpcmem(*args, check=True, **kwargs):
    return run_cli(*args, check=check, **kwargs)


COMBOS = [("torchrun", 0, "none", "none"), ("deepspeed", 1, "none", "none"), ("deepspeed", 2, "cpu", "none"),
          ("deepspeed", 3, "none", "none"), ("deepspeed", 3, "cpu", "cpu"), ("deepspeed", 3, "nvme", "nvme")]


@pytest.mark.parametrize("partition", ["v100", "a100", "cpu"])
@pytest.mark.parametrize("launcher, zero, opt, params", COMBOS)
def test_rendered_scripts_pass_sbatch_test_only(slurm_cluster, tmp_path, partition, launcher, zero, opt, params):
    spec = jobspec.load_spec("quickstart")
    part = TC.partition(partition)
    plan = spec.first_plan(part, {"launcher": launcher, "zero_stage": zero, "offload_optimizer": opt,
                                  "offload_params": params, "gpus_per_node": 2})
    attempt = render.render_attempt(spec, part, plan, tmp_path / "odd dir name" / "attempt-1")
    subprocess.run(["bash", "-n", str(attempt.script)], check=True)
    out = subprocess.run(["sbatch", "--test-only", str(attempt.script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"in partition {part.slurm_partition}" in out.stderr


def submit_json(home, *args):
    result = hpcmem("submit", "quickstart", "--site", "testcluster", *args, "--wait", "--json", "--interval", "1", home=home,
                    check=False)
    view = json.loads(result.stdout)
    return result, view


@pytest.mark.parametrize("partition, sets", [
    ("cpu", ["gpus_per_node=2"]),
    ("v100", ["gpus_per_node=2", "precision=fp16-mixed"]),
    ("a100", ["gpus_per_node=1", "precision=bf16-mixed"]),
    ("v100", ["gpus_per_node=2", "launcher=deepspeed", "zero_stage=1"]),
    ("a100", ["gpus_per_node=2", "launcher=deepspeed", "zero_stage=2", "precision=bf16-mixed"]),
    ("a100", ["gpus_per_node=2", "launcher=deepspeed", "zero_stage=3"]),
    ("cpu", ["gpus_per_node=2", "launcher=deepspeed", "zero_stage=3", "offload_optimizer=cpu", "offload_params=cpu"]),
    ("a100", ["gpus_per_node=2", "launcher=deepspeed", "zero_stage=3", "offload_optimizer=nvme", "offload_params=nvme"]),
], ids=["torchrun-2ranks", "torchrun-v100-fp16", "torchrun-a100-bf16", "zero1", "zero2-bf16", "zero3", "zero3-cpu-offload", "zero3-nvme-offload"])
def test_real_training_jobs(slurm_cluster, tmp_path, partition, sets):
    args = ["--partition", partition]
    for s in sets:
        args += ["--set", s]
    result, view = submit_json(tmp_path, *args)
    (attempt,) = view["attempts"]
    log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out"), None)
    detail = log.read_text()[-4000:] if log else "(no log)"
    assert result.returncode == 0 and view["state"] == "succeeded", detail
    assert attempt["state"] == "COMPLETED" and attempt["job_id"]
    metrics = json.loads((Path(attempt["attempt_dir"]) / "metrics.json").read_text())
    assert metrics["peak_rss_mib"] > 0 and metrics["steps"] > 0
    assert metrics["world_size"] == attempt["plan"]["world_size"]
    assert metrics["plan"] == attempt["plan"]
    if "launcher=deepspeed" in sets:
        cfg = json.loads((Path(attempt["attempt_dir"]) / "ds_config.json").read_text())
        assert cfg["zero_optimization"]["stage"] == attempt["plan"]["zero_stage"]
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", attempt["job_id"], "-o", "State,Partition"],
                           capture_output=True, text=True).stdout
    assert sacct.strip().startswith("COMPLETED")


def test_job_over_its_memory_ends_out_of_memory(slurm_cluster, tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: too-big-for-its-mem
        command:
          module: toolkit.train
          args: [--model, "{REPO}/jobs/models/gpt2.json", --task, causal-lm, --steps, "2"]
        gpus_per_node: 1
        mem_mib: 700
        training: {{global_batch: 2, micro_batch: 2, seq_len: 128}}
        retry: {{max_attempts: 1}}
        """))
    result = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--wait", "--json",
                    "--interval", "1", home=tmp_path, check=False)
    assert result.returncode != 0
    view = json.loads(result.stdout)
    (attempt,) = view["attempts"]
    assert attempt["state"] == "OUT_OF_MEMORY" and attempt["verdict"]["kind"] == "host_oom"
    assert view["state"] == "gave_up"
    log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out")).read_text()
    assert "oom-kill event" in log or "oom_kill event" in log


def test_sbatch_refusal_is_one_line_and_recorded(slurm_cluster, tmp_path):
    sitedir = tmp_path / "sites"
    sitedir.mkdir()
    text = (REPO / "site_configs" / "testcluster.yaml").read_text().replace("site: testcluster", "site: broken")
    (sitedir / "broken.yaml").write_text(text.replace("slurm_partition: cpu", "slurm_partition: nosuchpartition"))
    result = hpcmem("--sites-dir", str(sitedir), "submit", "quickstart", "--site", "broken", "--partition", "cpu",
                    home=tmp_path, check=False)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid partition" in lines[0].lower(), result.stderr
    runs = json.loads(hpcmem("runs", "--json", home=tmp_path).stdout)
    assert runs[0]["state"] == "failed" and runs[0]["attempts"][0]["state"] == "submit_failed"
