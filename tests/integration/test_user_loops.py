"""Resume for user code (toolkit/runtime/userloops.py): a real Accelerate loop (one process, and two ranks under
torchrun with gloo) and a real HF Trainer, each in its own process as a job would run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[2]

ACCELERATE_LOOP = textwrap.dedent("""
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from toolkit import runtime

    steps, every, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    acc = Accelerator(cpu=True)
    torch.manual_seed(1000 + int(os.environ.get("INIT_SEED", "0")))   # another init: resume must overwrite it
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ckpt = runtime.AccelerateCheckpoints(acc, model, opt, every_steps=every)
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + acc.process_index)   # the data of a step: its number
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step)
    if acc.is_main_process:
        sd = acc.unwrap_model(model).state_dict()
        state = {k: v.tolist() for k, v in sd.items()}
        moments = [opt.state_dict()["state"][i]["exp_avg"].tolist() for i in sorted(opt.state_dict()["state"])]
        with open(out, "w") as fh:
            json.dump({"start": start, "model": state, "exp_avg": moments,
                       "last": None if ckpt.last is None else ckpt.last.step}, fh)
""")


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("HPCMEM_PLAN", None)
    proc = subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _loop(tmp_path: Path, name: str, steps: int, every: int, ckpt: Path | None, nproc: int = 1,
          init_seed: int = 0) -> dict:
    script = tmp_path / "loop.py"
    script.write_text(ACCELERATE_LOOP)
    out = tmp_path / f"{name}.json"
    env = {"INIT_SEED": str(init_seed)}
    if ckpt is not None:
        env["HPCMEM_CHECKPOINT_DIR"] = str(ckpt)
    # Started as a rendered job starts a user's script: through the runner, whose clean teardown keeps gloo's
    # threads from aborting the interpreter's exit (seen here once: "terminate called without an active exception").
    runner = str(ROOT / "toolkit" / "runtime" / "run_script.py")
    if nproc == 1:
        cmd = [sys.executable, runner, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", runner,
               str(script)]
    _run(cmd + [str(steps), str(every), str(out)], env, tmp_path)
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_accelerate_loop_resumes_bitwise(tmp_path, nproc):
    straight = _loop(tmp_path, "straight", 5, 0, None, nproc)
    ckpt = tmp_path / "checkpoints"
    first = _loop(tmp_path, "first", 3, 2, ckpt, nproc)          # saves step 2, ends after step 3 (lost: step 3)
    assert first["start"] == 0 and first["last"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002"]
    marker = json.loads((ckpt / "step-00000002" / "complete").read_text())
    assert marker["format"] == "accelerate" and any(f.startswith("accelerate/") for f in marker["files"])
    second = _loop(tmp_path, "second", 5, 0, ckpt, nproc, init_seed=7)   # another init, resumed over
    assert second["start"] == 2
    assert second["model"] == straight["model"]          # exact floats: model and optimizer as if never stopped
    assert second["exp_avg"] == straight["exp_avg"]
    unresumed = _loop(tmp_path, "fresh", 5, 0, None, nproc, init_seed=7)
    assert unresumed["model"] != straight["model"]       # the comparison can fail: another init differs


def test_accelerate_damaged_newest_save_falls_back(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _loop(tmp_path, "first", 4, 2, ckpt)                       # saves steps 2 and 4
    target = ckpt / "step-00000004" / "accelerate"
    victim = max((p for p in target.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:10])                # truncated: the marker's size disagrees
    again = _loop(tmp_path, "again", 4, 0, ckpt, init_seed=3)
    assert again["start"] == 2
    assert victim.exists()                                       # never deleted


def test_accelerate_outside_hpcmem_saves_nothing(tmp_path):
    out = _loop(tmp_path, "plain", 2, 1, None)
    assert out["start"] == 0 and out["last"] is None


HF_TRAINER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from toolkit import runtime

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.lin(x), y)}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)}

    class Usr1At(TrainerCallback):   # Slurm's --signal=USR1@... arriving during a step
        def __init__(self, step):
            self.step = step
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == self.step:
                os.kill(os.getpid(), signal.SIGUSR1)

    margin, usr1_at = float(sys.argv[2]), int(sys.argv[3])
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=6, per_device_train_batch_size=2,
                             save_strategy="no", report_to=[], use_cpu=True, logging_strategy="no")
    callbacks = [runtime.hf_time_limit_callback(margin_s=margin)] + ([Usr1At(usr1_at)] if usr1_at else [])
    Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=callbacks).train(
        resume_from_checkpoint=runtime.hf_resume_checkpoint(sys.argv[1]))
""")


def _hf(tmp_path: Path, out: Path, margin: float, usr1_at: int, end_in_s: float | None) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "hf.py"
    script.write_text(HF_TRAINER)
    env = {"SLURM_JOB_END_TIME": str(int(time.time() + end_in_s))} if end_in_s else {}
    if not end_in_s:
        env["SLURM_JOB_END_TIME"] = ""
    _run([sys.executable, str(script), str(out), str(margin), str(usr1_at)], env, tmp_path)


def _hf_saves(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) if out.is_dir() else []


def test_hf_trainer_saves_once_before_the_time_limit(tmp_path):
    out = tmp_path / "out"
    _hf(tmp_path, out, margin=3600, usr1_at=0, end_in_s=600)     # already within the margin: save after step 1
    assert _hf_saves(out) == ["checkpoint-1"]                    # once, not at every later step
    assert (out / "checkpoint-1" / "trainer_state.json").exists()


def test_hf_trainer_saves_on_usr1_and_not_otherwise(tmp_path):
    out = tmp_path / "out"
    _hf(tmp_path, out, margin=20, usr1_at=0, end_in_s=None)      # no deadline, no signal: save_strategy "no"
    assert _hf_saves(out) == []
    _hf(tmp_path, out, margin=20, usr1_at=4, end_in_s=None)
    assert _hf_saves(out) == ["checkpoint-4"]


def test_hf_trainer_resumes_from_the_time_limit_save(tmp_path):
    out = tmp_path / "out"
    _hf(tmp_path, out, margin=3600, usr1_at=0, end_in_s=600)
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["global_step"] == 1
    _hf(tmp_path, out, margin=20, usr1_at=5, end_in_s=None)      # the next attempt resumes at step 1, saves at 5
    assert _hf_saves(out) == ["checkpoint-1", "checkpoint-5"]
    assert json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["global_step"] == 5


ACCELERATE_RECOVERY = textwrap.dedent("""
    import json, resource, sys
    import torch
    from accelerate import Accelerator
    from toolkit.plan import Plan
    from toolkit.runtime import inflight

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(1)
    plan = Plan(global_batch=8, micro_batch=int(sys.argv[1]), grad_accum=8 // int(sys.argv[1]))
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    cap = size + 1200 * 2**20                 # what is mapped now + 1200 MiB: 2 samples' "activations" fit, 4 do not
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    held = []

    def micro_batches(plan):
        for _ in range(plan.grad_accum):
            x = torch.randn(plan.micro_batch, 16, generator=gen)
            held.append(torch.ones(plan.micro_batch * 100 * 2**20, dtype=torch.float32))  # 400 MiB a sample
            loss = model(x).pow(2).sum() / plan.global_batch
            acc.backward(loss)
            held.clear()

    recovery = inflight.Recovery(plan, enabled=True)
    state = recovery.capture(gen)
    recovery.run_step(1, micro_batches, discard=lambda: (opt.zero_grad(set_to_none=True), held.clear()),
                      rewind=lambda: recovery.restore(state, gen))
    grad = acc.unwrap_model(model).weight.grad.flatten().tolist()
    opt.step()
    print(json.dumps({"grad": grad, "moves": recovery.moves, "plan": [recovery.plan.micro_batch,
                                                                      recovery.plan.grad_accum]}))
""")


def test_an_accelerate_loop_recovers_in_the_job_with_the_same_gradient(tmp_path):
    """The runtime's in-job recovery helper in an Accelerate loop (``accelerator.backward`` in the step) under a
    real address-space cap: micro-batch 4 cannot allocate, 2 can; the step is re-run from the same data and the
    gradient equals a straight run at micro-batch 2 x 4 (the same global batch)."""
    script = tmp_path / "acc_recovery.py"
    script.write_text(ACCELERATE_RECOVERY)

    def run(micro: int) -> dict:
        full = {"PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "2", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        done = subprocess.run([sys.executable, str(script), str(micro)], env=full, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    recovered, straight = run(4), run(2)
    (move,) = recovered["moves"]
    assert move["verdict"]["kind"] == "cpu_alloc_oom" and move["from"]["micro_batch"] == 4
    assert recovered["plan"] == [2, 4] and straight["moves"] == []
    assert recovered["grad"] == straight["grad"]
