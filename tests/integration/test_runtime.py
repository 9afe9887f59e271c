"""The job runtime for real: torchrun, the deepspeed launcher and DeepSpeed ZeRO 1-3 on CPU.

Every test starts the reference trainer the way a rendered job script does
(plan.json, ds_config.json, HPCMEM_* variables, DS_ACCELERATOR=cpu) and reads the
metrics.json it leaves. Real torch, real DeepSpeed, gloo between two ranks.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.strategies.deepspeed import deepspeed_config
from toolkit.plan import Plan

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # the first NVMe run JIT-builds DeepSpeed's async_io and cpu_adam ops (minutes)


def _env(attempt: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCMEM_", "SLURM_"))}
    env.update({"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)})
    if attempt is not None:
        env["HPCMEM_PLAN"] = str(attempt / "plan.json")
        env["HPCMEM_ATTEMPT_DIR"] = str(attempt)
        if (attempt / "ds_config.json").exists():
            env["HPCMEM_DS_CONFIG"] = str(attempt / "ds_config.json")
    env.update(extra or {})
    return env


def write_attempt(tmp_path: Path, **knobs) -> tuple[Path, Plan]:
    """An attempt directory with plan.json (and ds_config.json for DeepSpeed), as render would write it."""
    knobs.setdefault("gpus_per_node", 2)
    knobs.setdefault("micro_batch", 4)
    knobs.setdefault("grad_accum", 2)
    knobs.setdefault("seq_len", 64)
    knobs["global_batch"] = knobs["micro_batch"] * knobs["grad_accum"] * knobs["gpus_per_node"]
    plan = Plan(**knobs)
    attempt = tmp_path / "attempt-1"
    attempt.mkdir()
    (attempt / "plan.json").write_text(plan.to_json())
    if plan.launcher == "deepspeed":
        cfg = deepspeed_config(plan, nvme_path=str(tmp_path / "nvme"), gpu=False)
        (attempt / "ds_config.json").write_text(json.dumps(cfg, indent=2))
    return attempt, plan


def run(argv: list[str], env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)


def torchrun(nproc: int, *train_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "toolkit.train", *train_args]


def train_args(model="tiny-gpt2", task="causal-lm", steps=3) -> list[str]:
    return ["--model", model, "--task", task, "--steps", str(steps)]


def check_metrics(attempt: Path, plan: Plan, steps: int = 3, result=None) -> dict:
    detail = f"\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}" if result is not None else ""
    assert (attempt / "metrics.json").exists(), "no metrics.json" + detail
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "ok", m.get("error", "") + detail
    assert m["device"] == "cpu"
    assert m["world_size"] == plan.world_size
    assert m["steps"] == steps
    assert m["peak_rss_mib"] > 0
    assert isinstance(m["loss"], float) and math.isfinite(m["loss"])
    assert m["samples_per_s"] > 0 and m["step_time_s"] > 0
    assert m["peak_allocated_mib"] is None and m["device_used_mib"] is None
    assert m["plan"] == plan.to_dict()
    assert sorted(m["ranks"]) == [str(r) for r in range(plan.world_size)]
    assert all(r["status"] == "ok" and r["steps"] == steps for r in m["ranks"].values())
    assert m["versions"]["torch"] and m["versions"]["deepspeed"]
    assert sorted(p.name for p in (attempt / "metrics").iterdir()) == [f"rank-{r}.json" for r in range(plan.world_size)]
    return m


def progress_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


# -- torchrun (DDP) ------------------------------------------------------------------

def test_ddp_two_ranks(tmp_path):
    attempt, plan = write_attempt(tmp_path)
    result = run(torchrun(2, *train_args()), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    m = check_metrics(attempt, plan, result=result)
    lines = progress_lines(result.stdout)
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]  # rank 0 only, one line per step
    assert "samples/s" in lines[0] and lines[0].endswith("MiB")
    assert m["applied"] == {}


def test_seq_cls_bert_with_checkpointing_and_bf16(tmp_path):
    attempt, plan = write_attempt(tmp_path, precision="bf16-mixed", checkpointing=True, optimizer="adafactor")
    result = run(torchrun(2, *train_args("tiny-bert", "seq-cls")), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    check_metrics(attempt, plan, result=result)
    assert "checkpointing" in result.stdout and "bf16-mixed" in result.stdout


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-true"])
def test_ddp_other_precisions(tmp_path, precision):
    attempt, plan = write_attempt(tmp_path, precision=precision, optimizer="sgd", attention="eager")
    result = run(torchrun(2, *train_args()), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    check_metrics(attempt, plan, result=result)


# -- DeepSpeed ------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_stages(tmp_path, stage):
    attempt, plan = write_attempt(tmp_path, launcher="deepspeed", zero_stage=stage)
    result = run(torchrun(2, *train_args()), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    check_metrics(attempt, plan, result=result)
    assert f"ZeRO-{stage}" in result.stdout


def test_deepspeed_zero3_cpu_offload(tmp_path):
    attempt, plan = write_attempt(tmp_path, launcher="deepspeed", zero_stage=3,
                                  offload_optimizer="cpu", offload_params="cpu", precision="bf16-mixed")
    result = run(torchrun(2, *train_args()), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    check_metrics(attempt, plan, result=result)


@pytest.mark.slow  # on a fresh machine: about 6 minutes on 2 cores; later runs about 20 s
def test_deepspeed_zero3_nvme_offload(tmp_path):
    # ZeRO-Infinity. The first run on a machine JIT-builds DeepSpeed's async_io, cpu_adam,
    # shm_comm and pin_memory ops into ~/.cache/torch_extensions.
    attempt, plan = write_attempt(tmp_path, launcher="deepspeed", zero_stage=3,
                                  offload_optimizer="nvme", offload_params="nvme")
    result = run(torchrun(2, *train_args()), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    check_metrics(attempt, plan, result=result)
    assert list((tmp_path / "nvme").rglob("*.swp")), "nothing was swapped to the NVMe path"


def test_deepspeed_fp16_with_a_client_sgd_on_the_cpu_accelerator(tmp_path):
    # DeepSpeed's CPU accelerator runs fp16 only on CPUs with oneDNN fp16 (AVX512-FP16 / AMX-FP16):
    # the test follows this machine's capability, as the runtime does.
    import torch

    from toolkit.calibrate import cpu_precisions

    attempt, plan = write_attempt(tmp_path, launcher="deepspeed", zero_stage=2, precision="fp16-mixed",
                                  optimizer="sgd", offload_optimizer="cpu")
    result = run(torchrun(2, *train_args()), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    applied = check_metrics(attempt, plan, result=result)["applied"]
    if cpu_precisions(torch)["fp16"]:
        assert applied == {}
    else:
        assert applied["precision"] == "bf16-mixed"
        assert "no fp16" in applied["reasons"]["precision"]
        assert "ran bf16-mixed instead of fp16-mixed" in result.stdout


def test_deepspeed_zero3_seq_cls_adafactor_checkpointing_bf16_true(tmp_path):
    attempt, plan = write_attempt(tmp_path, launcher="deepspeed", zero_stage=3, precision="bf16-true",
                                  optimizer="adafactor", checkpointing=True)
    result = run(torchrun(2, *train_args("tiny-bert", "seq-cls")), _env(attempt))
    assert result.returncode == 0, result.stderr[-6000:]
    m = check_metrics(attempt, plan, result=result)
    # dsconfig's bf16 section keeps fp32 master weights: the runtime says so.
    if not json.loads((attempt / "ds_config.json").read_text())["bf16"].get("bf16_master_weights_and_grads"):
        assert m["applied"]["precision"] == "bf16-mixed" and "master" in m["applied"]["reasons"]["precision"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_launcher_cli(tmp_path):
    # What templates/deepspeed.sbatch.j2 runs on one node: the launcher, with --module for toolkit.train.
    attempt, plan = write_attempt(tmp_path, launcher="deepspeed", zero_stage=2)
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus=2", f"--master_port={_free_port()}",
            "--module", "toolkit.train", *train_args()]
    result = run(argv, _env(attempt))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    check_metrics(attempt, plan, result=result)


# -- outside hpcmem, HF-style flags, failures ---------------------------------------------

def test_single_process_without_a_plan_with_hf_flags(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "toolkit.train", *train_args(steps=2), "--metrics-dir", str(out),
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--bf16",
            "--gradient_checkpointing", "--optim", "adafactor", "--set", "seq_len=32", "--set", "attention=flash"]
    result = run(argv, _env(None))
    assert result.returncode == 0, result.stderr[-6000:]
    expected = Plan(micro_batch=2, grad_accum=2, global_batch=4, precision="bf16-mixed", checkpointing=True,
                    optimizer="adafactor", seq_len=32, attention="flash")
    m = check_metrics(out, expected, steps=2, result=result)
    assert m["applied"]["attention"] == "sdpa" and "CUDA" in m["applied"]["reasons"]["attention"]


def test_deepspeed_config_flag_without_hpcmem(tmp_path):
    plan = Plan(launcher="deepspeed", zero_stage=2, gpus_per_node=2, micro_batch=2, grad_accum=1, global_batch=4)
    cfg = deepspeed_config(plan, gpu=False)
    cfg.update({"train_batch_size": "auto", "gradient_accumulation_steps": "auto"})
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    result = run(torchrun(2, *train_args(steps=2), "--deepspeed", str(tmp_path / "ds.json"),
                          "--metrics-dir", str(out), "--set", "seq_len=32"), _env(None))
    assert result.returncode == 0, result.stderr[-6000:]
    m = check_metrics(out, plan.replace(seq_len=32), steps=2, result=result)
    assert m["plan"]["launcher"] == "deepspeed" and m["plan"]["zero_stage"] == 2


def test_missing_8bit_optimizer_fails_clearly(tmp_path):
    pytest.importorskip("torch")
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed here")
    except ImportError:
        pass
    attempt, plan = write_attempt(tmp_path, gpus_per_node=1, optimizer="adamw-8bit")
    result = run([sys.executable, "-m", "toolkit.train", *train_args()], _env(attempt))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("hpcmem: error: optimizer=adamw-8bit needs bitsandbytes")
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "failed" and "bitsandbytes" in m["error"]


def test_host_oom_surfaces_pytorchs_own_error(tmp_path):
    # As the local backend caps a CPU job: an address-space limit. PyTorch's allocator error must
    # reach the log unchanged, and metrics.json must still say what was seen.
    attempt, plan = write_attempt(tmp_path, gpus_per_node=1, micro_batch=16, grad_accum=1, seq_len=1024)
    limit = 4000 * 2**20  # torch + transformers + GPT-2 fit; the 3.3 GB logits of 16 x 1024 tokens do not

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    # Few malloc arenas: on a many-core machine each thread's arena reserves 64 MiB of address space. In-job
    # recovery off (the spec's retry.inflight: false): this is about the error as the job ends with it.
    env = _env(attempt, {"MALLOC_ARENA_MAX": "2", "HPCMEM_INFLIGHT": "0"})
    result = run([sys.executable, "-m", "toolkit.train", *train_args("gpt2")], env, preexec_fn=cap)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in result.stderr
    assert "Traceback" in result.stderr
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "failed"
    assert "DefaultCPUAllocator: can't allocate memory" in m["error"]
    assert m["peak_rss_mib"] > 0 and m["steps"] == 0
    assert m["plan"] == plan.to_dict()


def test_sigterm_is_recorded(tmp_path):
    # Slurm's time limit and scancel send SIGTERM first: metrics.json says so and the exit is 143.
    attempt, plan = write_attempt(tmp_path, gpus_per_node=1)
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.train", *train_args(steps=100_000)], cwd=REPO,
                            env=_env(attempt), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "failed" and m["error"] == "Terminated: received signal SIGTERM"
    assert m["steps"] >= 2


def test_plan_and_launch_disagree(tmp_path):
    attempt, _ = write_attempt(tmp_path, gpus_per_node=2)
    result = run([sys.executable, "-m", "toolkit.train", *train_args()], _env(attempt))
    assert result.returncode == 2
    assert "world_size 2" in result.stderr and "1 rank(s)" in result.stderr


# -- checkpoints, resume and the OOM rehearsal (docs/resume.md) ---------------------------------------------

def _resume_args(ckdir: Path, steps: int, *extra: str) -> list[str]:
    return [*train_args(steps=steps), "--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", "2",
            "--checkpoint-digest", *extra]


def _saved_digest(ckdir: Path, step: int) -> dict:
    return json.loads((ckdir / f"step-{step:08d}" / "complete").read_text())["digest"]


@pytest.mark.parametrize("first,then", [("torchrun", "fsdp"), ("fsdp", "torchrun")])
def test_a_layout_change_converts_the_checkpoint(tmp_path, first, then):
    """DDP's full state_dict into FSDP2 shards and FSDP2's torch.distributed.checkpoint into DDP: the state
    loaded is bitwise the state saved (digests of the gathered model and optimizer)."""
    ckdir = tmp_path / "checkpoints"
    a1, _ = write_attempt(tmp_path, launcher=first, grad_accum=1)
    result = run(torchrun(2, *_resume_args(ckdir, 2)), _env(a1))
    assert result.returncode == 0, result.stderr[-3000:]
    a2 = tmp_path / "second"
    a2.mkdir()
    (a2 / "plan.json").write_text((a1 / "plan.json").read_text().replace(f'"launcher": "{first}"',
                                                                         f'"launcher": "{then}"'))
    assert json.loads((a2 / "plan.json").read_text())["launcher"] == then
    result = run(torchrun(2, *_resume_args(ckdir, 4)), _env(a2))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((a2 / "metrics.json").read_text())
    assert m["resumed_from_step"] == 2 and m["steps"] == 2 and m["checkpoint"]["step"] == 4
    assert m["resume"]["digest"] == _saved_digest(ckdir, 2)


NO_FULL_COPY = {"HPCMEM_DS_FULL_COPY": "never"}  # a DeepSpeed save as a model too large to gather would have


def test_a_deepspeed_save_without_a_full_copy_is_not_read_by_ddp_and_says_why(tmp_path):
    ckdir = tmp_path / "checkpoints"
    a1, _ = write_attempt(tmp_path, launcher="deepspeed", zero_stage=2, grad_accum=1)
    result = run(torchrun(2, *_resume_args(ckdir, 2)), _env(a1, NO_FULL_COPY))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (ckdir / "step-00000002" / "state.pt").exists()
    a2 = tmp_path / "second"
    a2.mkdir()
    (a2 / "plan.json").write_text((a1 / "plan.json").read_text().replace('"launcher": "deepspeed"',
                                                                         '"launcher": "torchrun"')
                                  .replace('"zero_stage": 2', '"zero_stage": 0'))
    result = run(torchrun(2, *_resume_args(ckdir, 2)), _env(a2))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((a2 / "metrics.json").read_text())
    assert m["resumed_from_step"] is None and m["steps"] == 2
    assert "does not convert" in m["resume"]["restart_reason"]
    assert "not resumed" in result.stderr


def test_a_damaged_newest_save_falls_back_to_the_previous_one(tmp_path):
    ckdir = tmp_path / "checkpoints"
    a1, _ = write_attempt(tmp_path, gpus_per_node=1, grad_accum=1)
    assert run([sys.executable, "-m", "toolkit.train", *_resume_args(ckdir, 4)], _env(a1)).returncode == 0
    state = ckdir / "step-00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    a2 = tmp_path / "second"
    a2.mkdir()
    (a2 / "plan.json").write_text((a1 / "plan.json").read_text())
    result = run([sys.executable, "-m", "toolkit.train", *_resume_args(ckdir, 4)], _env(a2))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((a2 / "metrics.json").read_text())
    assert m["resumed_from_step"] == 2
    assert "step-00000004" in result.stderr and "skipped, kept" in result.stderr
    assert state.exists()


def test_the_job_saves_before_its_time_limit(tmp_path):
    """time_min 1 and a job that started 45 s ago: the save margin (20 s) has passed, the next step saves."""
    import time

    a1, _ = write_attempt(tmp_path, gpus_per_node=1, grad_accum=1, time_min=1)
    ckdir = tmp_path / "checkpoints"
    env = _env(a1, {"HPCMEM_CHECKPOINT_DIR": str(ckdir), "SLURM_JOB_START_TIME": str(int(time.time()) - 45)})
    result = run([sys.executable, "-m", "toolkit.train", *train_args(steps=3)], env)
    assert result.returncode == 0, result.stderr[-3000:]
    saves = sorted(p.name for p in ckdir.iterdir())
    assert saves == ["step-00000001"], saves  # once for the limit, not every step after it
    assert json.loads((ckdir / "step-00000001" / "complete").read_text())["reason"] == "time-limit"


def test_oom_rehearsal_is_the_allocator_s_own_failure_under_an_address_space_cap(tmp_path):
    attempt, plan = write_attempt(tmp_path, gpus_per_node=1, grad_accum=1)
    limit = 3000 * 2**20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = _env(attempt, {"MALLOC_ARENA_MAX": "2", "HPCMEM_INFLIGHT": "0"})  # in-job recovery off, as a spec's
    result = run([sys.executable, "-m", "toolkit.train", *train_args(steps=4), "--oom-at-step", "3"],  # retry.inflight
                 env, preexec_fn=cap)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in result.stderr
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "failed" and m["steps"] == 2


def test_in_job_recovery_answers_an_oom_on_two_ranks_without_a_restart(tmp_path):
    """--oom-at-step 3 (activations, 400 MiB a sample) under a 2000 MiB address-space cap: micro-batch 4 does not
    fit, 2 does. Both ranks fail, agree (one all-reduce), halve the micro-batch, re-run step 3, and finish in the
    same process with the same global batch; metrics.json records the move. In-job recovery is on by default."""
    attempt, plan = write_attempt(tmp_path, micro_batch=4, grad_accum=2)
    limit = 2000 * 2**20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = _env(attempt, {"MALLOC_ARENA_MAX": "2"})
    result = run(torchrun(2, *train_args(steps=4), "--oom-at-step", "3", "--oom-mib", "400"), env, preexec_fn=cap)
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "ok" and m["steps"] == 4
    (move,) = m["inflight_moves"]
    assert move["step"] == 3 and move["verdict"]["kind"] == "cpu_alloc_oom"
    assert move["from"] == {"micro_batch": 4, "grad_accum": 2, "checkpointing": False}
    assert move["to"] == {"micro_batch": 2, "grad_accum": 4, "checkpointing": False}
    assert move["global_batch"] == plan.global_batch
    assert m["applied"]["micro_batch"] == 2 and m["plan"] == plan.to_dict()
    assert "in-job move" in result.stdout


def test_an_oom_on_one_rank_is_agreed_on_before_the_backward(tmp_path):
    """--oom-rank 0: only rank 0 runs out of memory, in step 3's forward. Rank 1 reaches the agreement after its
    forward (Recovery.forward_done: one all-reduce, which rank 0 joins from run_step) instead of DDP's backward
    all-reduce, drops its try, and both halve the micro-batch and finish in the same process. Without the agreement
    rank 1's gradient all-reduce meets rank 0's one-element flag (gloo aborts on the size mismatch)."""
    attempt, plan = write_attempt(tmp_path, micro_batch=4, grad_accum=2)
    limit = 2000 * 2**20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = _env(attempt, {"MALLOC_ARENA_MAX": "2"})
    result = run(torchrun(2, *train_args(steps=4), "--oom-at-step", "3", "--oom-mib", "400", "--oom-rank", "0"),
                 env, preexec_fn=cap)
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "ok" and m["steps"] == 4
    (move,) = m["inflight_moves"]
    assert move["step"] == 3 and move["to"] == {"micro_batch": 2, "grad_accum": 4, "checkpointing": False}
    assert move["global_batch"] == plan.global_batch


def test_a_fixed_oom_is_not_answered_in_the_job(tmp_path):
    """--oom-kind fixed: no micro-batch avoids it; the in-job moves (micro-batch 1, then activation checkpointing,
    really turned on in the model) run out and the allocator's error ends the job."""
    attempt, _ = write_attempt(tmp_path, gpus_per_node=1, micro_batch=2, grad_accum=1)
    limit = 2000 * 2**20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = _env(attempt, {"MALLOC_ARENA_MAX": "2"})
    result = run([sys.executable, "-m", "toolkit.train", *train_args(steps=3), "--oom-at-step", "2",
                  "--oom-kind", "fixed", "--oom-mib", "3000", "--inflight-recovery"], env, preexec_fn=cap)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in result.stderr
    m = json.loads((attempt / "metrics.json").read_text())
    assert m["status"] == "failed", m
    assert [(mv["to"]["micro_batch"], mv["to"]["checkpointing"]) for mv in m["inflight_moves"]] == [(1, False), (1, True)]
    assert m["applied"]["checkpointing"] is True  # the model's own is_gradient_checkpointing after the move


def test_a_deepspeed_zero2_save_converts_to_another_world_size(tmp_path):
    """Without a full copy, ZeRO-2 on two ranks -> ZeRO-2 on one: DeepSpeed's universal checkpoint (ds_to_universal, load_universal);
    the model state loaded is bitwise the state saved; the save itself is left as it was."""
    ckdir = tmp_path / "checkpoints"
    a1, _ = write_attempt(tmp_path, launcher="deepspeed", zero_stage=2, grad_accum=1)
    result = run(torchrun(2, *_resume_args(ckdir, 2)), _env(a1, NO_FULL_COPY))  # else the full copy converts
    assert result.returncode == 0, result.stderr[-3000:]
    before = sorted(p.relative_to(ckdir) for p in (ckdir / "step-00000002").rglob("*"))
    (tmp_path / "one").mkdir()
    a2, _ = write_attempt(tmp_path / "one", launcher="deepspeed", zero_stage=2, gpus_per_node=1, micro_batch=8,
                          grad_accum=1)
    result = run(torchrun(1, *_resume_args(ckdir, 4)), _env(a2))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((a2 / "metrics.json").read_text())
    assert m["resumed_from_step"] == 2 and m["resume"]["from_layout"]["world_size"] == 2
    assert m["resume"]["digest"] == _saved_digest(ckdir, 2)
    assert sorted(p.relative_to(ckdir) for p in (ckdir / "step-00000002").rglob("*")) == before
    assert (ckdir / ".universal-step-00000002" / "state").is_dir()


def _layout_attempt(tmp_path: Path, name: str, launcher: str, zero_stage: int, world: int) -> Path:
    """An attempt of the same global batch (8) as ``write_attempt``'s grad_accum=1 default on two ranks."""
    (tmp_path / name).mkdir()
    attempt, _ = write_attempt(tmp_path / name, launcher=launcher, zero_stage=zero_stage, gpus_per_node=world,
                               micro_batch=8 // world, grad_accum=1)
    return attempt


@pytest.mark.parametrize("first,then", [(("deepspeed", 2, 2), ("deepspeed", 2, 2)),
                                        (("deepspeed", 3, 2), ("torchrun", 0, 2)),
                                        (("torchrun", 0, 2), ("deepspeed", 3, 1)),
                                        (("deepspeed", 2, 2), ("fsdp", 0, 1)),
                                        (("fsdp", 0, 2), ("deepspeed", 3, 2))])
def test_a_layout_change_into_or_out_of_deepspeed_goes_through_the_full_copy(tmp_path, first, then):
    """A DeepSpeed save carries a layout-free copy (state.pt: DDP's format) when the model is small enough:
    the same layout loads ``ds/`` (and its digest, before any step, gathers through fragments linked anew), ZeRO-3 -> DDP, DDP -> ZeRO-3 of another world size, ZeRO-2 -> FSDP2 load bitwise the state saved (the
    digests hash the gathered fp32 parameters and the optimizer's state per parameter name in every layout)."""
    ckdir = tmp_path / "checkpoints"
    a1 = _layout_attempt(tmp_path, "first", *first)
    result = run(torchrun(first[2], *_resume_args(ckdir, 2)), _env(a1))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (ckdir / "step-00000002" / ("dcp" if first[0] == "fsdp" else "state.pt")).exists()
    a2 = _layout_attempt(tmp_path, "then", *then)
    result = run(torchrun(then[2], *_resume_args(ckdir, 4)), _env(a2))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((a2 / "metrics.json").read_text())
    assert m["resumed_from_step"] == 2 and m["steps"] == 2 and m["checkpoint"]["step"] == 4, m["resume"]
    assert set(m["resume"]["digest"]) == {"model", "optimizer"}
    assert m["resume"]["digest"] == _saved_digest(ckdir, 2)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_zero2_to_zero3_resumes_bitwise_and_continues_as_the_uninterrupted_zero2_run(tmp_path, offload):
    """ZeRO-2 x2 saves at steps 2 and 4 (uninterrupted); a ZeRO-3 x2 attempt given only the step-2 save loads it
    bitwise (model and optimizer digests), and its own step 4 agrees with the uninterrupted ZeRO-2 step 4 to
    float32 rounding (ZeRO-3 reduces gradients in another order, so not bitwise), where a ZeRO-3 model that had
    kept its own initial weights would differ by the whole initialisation. ``offload=cpu``: ZeRO-3 with its
    optimizer on the host (DeepSpeed's own optimizer from the config), as the ladder's offload rung makes it."""
    import shutil

    import torch

    ref_dir, ckdir = tmp_path / "ref-checkpoints", tmp_path / "checkpoints"
    a1 = _layout_attempt(tmp_path, "zero2", "deepspeed", 2, 2)
    result = run(torchrun(2, *_resume_args(ref_dir, 4)), _env(a1))
    assert result.returncode == 0, result.stderr[-3000:]
    ckdir.mkdir()
    shutil.copytree(ref_dir / "step-00000002", ckdir / "step-00000002")
    (tmp_path / "zero3").mkdir()
    a2, _ = write_attempt(tmp_path / "zero3", launcher="deepspeed", zero_stage=3, offload_optimizer=offload,
                          grad_accum=1)
    result = run(torchrun(2, *_resume_args(ckdir, 4)), _env(a2))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads((a2 / "metrics.json").read_text())
    assert m["resumed_from_step"] == 2 and m["resume"]["from_layout"]["zero_stage"] == 2
    assert m["resume"]["digest"] == _saved_digest(ref_dir, 2)
    ours = torch.load(ckdir / "step-00000004" / "state.pt", weights_only=True)
    ref = torch.load(ref_dir / "step-00000004" / "state.pt", weights_only=True)
    assert ours["model"].keys() == ref["model"].keys() and ours["engine"]["global_steps"] == 4
    for name, value in ref["model"].items():
        assert torch.allclose(ours["model"][name], value, rtol=0, atol=1e-6), name
    for name, state in ref["optim"]["state"].items():
        assert torch.equal(ours["optim"]["state"][name]["step"], state["step"])
        for key in ("exp_avg", "exp_avg_sq"):  # to 1e-4 of the tensor's scale (near-zero entries cancel)
            gap = (ours["optim"]["state"][name][key] - state[key]).abs().max()
            assert gap <= 1e-4 * state[key].abs().max(), (name, key, gap)

