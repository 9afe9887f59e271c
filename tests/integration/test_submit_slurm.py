"""End to end on the real Slurm test cluster: rendered scripts pass sbatch --test-only, and real jobs
(torchrun 2 ranks, DeepSpeed ZeRO 1/2/3, ZeRO-3 with CPU and NVMe offload, FSDP2) train the reference model
through `hpcmem submit --wait`, leaving metrics.json; a job over its --mem ends OUT_OF_MEMORY; a DDP job
killed by the cgroup is answered with an FSDP move and succeeds."""

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
          ("deepspeed", 3, "none", "none"), ("deepspeed", 3, "cpu", "cpu"), ("deepspeed", 3, "nvme", "nvme"),
          ("fsdp", 0, "none", "none"), ("fsdp", 0, "none", "cpu")]


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
    ("cpu", ["gpus_per_node=2", "launcher=fsdp"]),
    ("a100", ["gpus_per_node=2", "launcher=fsdp", "precision=bf16-mixed", "reshard_after_forward=false",
              "checkpointing=true", "offload_params=cpu"]),
], ids=["torchrun-2ranks", "torchrun-v100-fp16", "torchrun-a100-bf16", "zero1", "zero2-bf16", "zero3", "zero3-cpu-offload",
        "zero3-nvme-offload", "fsdp", "fsdp-bf16-noreshard-ckpt-offload"])
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
    if "launcher=fsdp" in sets:
        cfg = json.loads((Path(attempt["attempt_dir"]) / "fsdp_config.json").read_text())
        assert cfg["reshard_after_forward"] == attempt["plan"]["reshard_after_forward"]
        log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out")).read_text()
        assert "FSDP2" in log
        if attempt["plan"]["offload_params"] == "cpu":  # the CPU offload policy needs a GPU: said, not hidden
            assert metrics["applied"]["offload_params"] == "none" and "GPU" in metrics["applied"]["reasons"]["offload_params"]
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


def test_rendered_fsdp_job_runs_under_sbatch(slurm_cluster, tmp_path):
    """The contract: render quickstart for FSDP on the cpu partition, and sbatch runs what was written."""
    out = tmp_path / "r"
    hpcmem("render", "quickstart", "--site", "testcluster", "--partition", "cpu", "--set", "launcher=fsdp",
           "--set", "gpus_per_node=2", "-o", str(out), home=tmp_path)
    assert json.loads((out / "fsdp_config.json").read_text())["version"] == 2
    job = subprocess.run(["sbatch", "--parsable", "--wait", str(out / "job.sbatch")], capture_output=True, text=True,
                         timeout=600, cwd=out)
    log = "".join(p.read_text() for p in out.glob("slurm-*.out"))
    assert job.returncode == 0, log[-4000:]
    assert json.loads((out / "metrics.json").read_text())["status"] == "ok"


# A 63M-parameter GPT-2 shape: DDP's replicated fp32 AdamW states (~1.7 GiB a rank here) do not fit two ranks
# under --mem 2900M, FSDP's shards (~1.1-1.2 GiB a rank) do. glibc's dynamic mmap threshold would keep freed
# all-gather buffers resident (the CPU's own fragmentation); a fixed threshold returns them, as a GPU's
# expandable segments would.
GPT2_63M = {"n_embd": 768, "n_layer": 8, "n_head": 12, "vocab_size": 8192, "n_positions": 256}


def test_cgroup_oom_is_answered_with_an_fsdp_move(slurm_cluster, tmp_path):
    config = json.loads((REPO / "jobs" / "models" / "gpt2.json").read_text())
    (tmp_path / "gpt2-63m.json").write_text(json.dumps({**config, **GPT2_63M}))
    spec = tmp_path / "ddp-too-big.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: ddp-too-big
        command:
          module: toolkit.train
          args: [--model, "{tmp_path}/gpt2-63m.json", --task, causal-lm, --steps, "2"]
        gpus_per_node: 2
        mem_mib: 2900
        env: {{MALLOC_MMAP_THRESHOLD_: "65536"}}
        training: {{global_batch: 4, micro_batch: 2, seq_len: 64}}
        retry: {{max_attempts: 3, allow: [fsdp]}}
        """))
    result = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--wait", "--json",
                    "--interval", "1", home=tmp_path, check=False)
    view = json.loads(result.stdout)
    first, *rest = view["attempts"]
    logs = "\n".join(p.read_text()[-2000:] for a in view["attempts"] for p in Path(a["attempt_dir"]).glob("slurm-*.out"))
    assert first["plan"]["launcher"] == "torchrun" and first["state"] == "OUT_OF_MEMORY", logs
    assert first["verdict"]["kind"] == "host_oom"
    assert rest and all(a["plan"]["launcher"] == "fsdp" for a in rest), logs
    assert result.returncode == 0 and view["state"] == "succeeded", logs
    assert sum(a["state"] != "COMPLETED" for a in rest) <= 1, logs  # a jump under the known --mem, not a rung a failure
    last = rest[-1]
    assert last["plan"]["global_batch"] == first["plan"]["global_batch"] and last["state"] == "COMPLETED"
