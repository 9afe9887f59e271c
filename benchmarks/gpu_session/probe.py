"""What the first GPU session raised, probed on the card (benchmarks/gpu_session/run.sh runs it):

    python3 benchmarks/gpu_session/probe.py checkpointing   # activation checkpointing under each history setting
    python3 benchmarks/gpu_session/probe.py context         # NVML used - reserved as a process's kernels load

``checkpointing``: gpu_replay.py's GPT-2 bf16-mixed case with activation checkpointing died in its first
backward ("SystemError: ... run_backward ... returned NULL without setting an exception") while the allocator
recorded its history with Python stacks, which the job runtime also does by default. Each setting of
``torch.cuda.memory._record_memory_history`` (off; stacks python, the runtime's; stacks all; no stack context)
times each precision and checkpoint flavour runs two steps of GPT-2 in a fresh process; the table says which
combinations survive.

``context``: nvidia-smi's used memory minus what PyTorch reserved, in one process, after each stage: the
context alone, a matrix product (what ``hpcmem calibrate`` measured until now), then training steps of models
of growing size in each precision. It shows how much device memory the lazily loaded kernels add outside the
allocator: the CUDA context as a training job sees it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CKPT_CHILD = r"""
import json, sys, torch
from toolkit.estimate.measure import train_setup
from toolkit.models import load_model_config
from toolkit.plan import Plan
setting, precision, reentrant = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
kwargs = {"python": dict(stacks="python"), "all": dict(stacks="all"), "no-context": dict(context=None)}.get(setting)
if kwargs is not None:
    torch.cuda.memory._record_memory_history(max_entries=100_000, **kwargs)
plan = Plan(global_batch=4, micro_batch=4, seq_len=512, precision=precision, checkpointing=not reentrant)
model, opt, scaler, step = train_setup(load_model_config("gpt2"), "causal-lm", plan, device="cuda")
if reentrant:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
for _ in range(2):
    step()
torch.cuda.synchronize()
print(json.dumps({"ok": True, "max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}))
"""

CONTEXT_CHILD = r"""
import gc, json, torch, pynvml
from toolkit.devices import visible_nvml_handle
from toolkit.estimate.measure import train_setup
from toolkit.models import load_model_config
from toolkit.plan import Plan
pynvml.nvmlInit()
handle = visible_nvml_handle(pynvml, 0)
used = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
base = used()
rows = []
def mark(stage):
    torch.cuda.synchronize()
    rows.append({"stage": stage, "used_mib": round(used() - base, 1), "reserved_mib": torch.cuda.memory_reserved() / 2**20,
                 "outside_mib": round(used() - base - torch.cuda.memory_reserved() / 2**20, 1)})
torch.zeros(1, device="cuda"); mark("context (torch.zeros(1))")
torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda"); mark("64x64 fp32 matmul")
for model, task, precision, mb, seq in (("tiny-gpt2", "causal-lm", "fp32", 2, 128),
                                        ("tiny-gpt2", "causal-lm", "fp16-mixed", 2, 128),
                                        ("tiny-gpt2", "causal-lm", "bf16-mixed", 2, 128),
                                        ("gpt2", "causal-lm", "fp32", 4, 512), ("gpt2", "causal-lm", "bf16-mixed", 4, 512),
                                        ("bert-large", "seq-cls", "fp16-mixed", 4, 512),
                                        ("vit-base", "image-cls", "fp32", 16, 1),
                                        ("gpt2", "causal-lm", "bf16-mixed", 16, 1024)):
    plan = Plan(global_batch=mb, micro_batch=mb, seq_len=seq, precision=precision)
    m, opt, scaler, step = train_setup(load_model_config(model), task, plan, device="cuda")
    for _ in range(2):
        step()
    del m, opt, scaler, step
    gc.collect()
    torch.cuda.empty_cache()
    mark(f"{model} {precision} mb{mb} s{seq}: 2 steps, cache emptied")
print(json.dumps(rows))
"""


def _run(code: str, *args: str, timeout: float = 240) -> dict:
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"ok": False, "rc": done.returncode, "error": (tail or ["(no output)"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpointing() -> list[dict]:
    cases = [(setting, precision, "0") for setting in ("off", "python", "all", "no-context")
             for precision in ("fp32", "bf16-mixed")]
    cases += [("python", "bf16-mixed", "1"), ("off", "bf16-mixed", "1")]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: _run(CKPT_CHILD, *c), cases))
    rows = []
    for (setting, precision, reentrant), result in zip(cases, results):
        rows.append({"history": setting, "precision": precision, "use_reentrant": reentrant == "1", **result})
        print(f"history={setting:<10} {precision:<10} use_reentrant={reentrant == '1'!s:<5} "
              f"{'ok' if result.get('ok') else 'FAILED: ' + result.get('error', '')}")
    return rows


def context() -> list[dict]:
    rows = _run(CONTEXT_CHILD, timeout=300)
    if isinstance(rows, dict):
        print(f"context probe failed: {rows.get('error')}")
        return [rows]
    for r in rows:
        print(f"{r['stage']:<52} used {r['used_mib']:>8,.0f}  reserved {r['reserved_mib']:>8,.0f}  "
              f"outside the allocator {r['outside_mib']:>6,.0f} MiB")
    return rows


if __name__ == "__main__":
    what = sys.argv[1]
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    rows = {"checkpointing": checkpointing, "context": context}[what]()
    if out:
        out.write_text(json.dumps(rows, indent=1) + "\n")
