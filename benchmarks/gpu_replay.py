"""Issue 11, item 6: real training steps on a GPU, the allocator's own record of them replayed through hpcmem's
allocator model, and the analytic estimate of the same plan beside both.

    python3 benchmarks/gpu_replay.py [--cap-gib 16] [--out benchmarks/results/gpu-replay.json] [--only REGEX]
                                     [--traces DIR]

Each case runs in a fresh process (PYTORCH_CUDA_ALLOC_CONF is read when CUDA starts): the memory fraction is
capped to emulate a smaller card (``torch.cuda.set_per_process_memory_fraction``), the allocator records its
history (``torch.cuda.memory._record_memory_history``) from before the model is built, the model trains
``--steps`` steps as hpcmem's torch loop does (``estimate.measure.train_setup`` on CUDA), and the child
reports ``max_memory_allocated`` / ``max_memory_reserved``, nvidia-smi's used memory (pynvml) and the
allocator's event trace. The parent then prints, per case:

- real: the GPU's peaks;
- replay: ``estimate.cuda_trace.compare`` (the recorded stream through the allocator model under the same
  settings and cap: checks the allocator policy alone, segment count included);
- analytic: ``hpcmem estimate``'s peak allocated and reserved for the same Plan (checks the stream model too).

The analytic estimate is made for the card the script runs on (the ``local`` site's partition, detected by NVML)
with its memory set to the case's cap. Results go to ``--out`` as JSON; with ``--traces DIR`` each case's event
trace is kept there too (``<case>.trace.json.gz``, the fields ``cuda_trace`` reads), so the allocator model can be
replayed against it later on a machine without a GPU. Without a CUDA device the script says so in one line and
exits 2; CI has none, so this runs only on a lent GPU machine (``benchmarks/gpu_session/run.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20

# (name, model, task, plan knobs, PYTORCH_CUDA_ALLOC_CONF[, cap GiB when not --cap-gib])
CASES = (
    ("gpt2 fp32 mb4 s512", "gpt2", "causal-lm", dict(micro_batch=4, seq_len=512, precision="fp32"), ""),
    ("gpt2 fp32 mb4 s512 expandable", "gpt2", "causal-lm", dict(micro_batch=4, seq_len=512, precision="fp32"),
     "expandable_segments:True"),
    ("gpt2 bf16-mixed mb8 s1024 ckpt", "gpt2", "causal-lm",
     dict(micro_batch=8, seq_len=1024, precision="bf16-mixed", checkpointing=True), ""),
    ("bert-large fp16-mixed mb8 s512", "bert-large", "seq-cls",
     dict(micro_batch=8, seq_len=512, precision="fp16-mixed"), ""),
    ("bert-large fp32 mb4 s512 adafactor", "bert-large", "seq-cls",
     dict(micro_batch=4, seq_len=512, precision="fp32", optimizer="adafactor"), ""),
    ("gpt2 bf16-mixed mb16 s512", "gpt2", "causal-lm", dict(micro_batch=16, seq_len=512, precision="bf16-mixed"), ""),
    ("bert-large fp32 mb4 s512 eager 40g", "bert-large", "seq-cls",
     dict(micro_batch=4, seq_len=512, precision="fp32", attention="eager"), "", 40.0),
    ("vit-base fp32 mb64", "vit-base", "image-cls", dict(micro_batch=64, seq_len=1, precision="fp32"), ""),
    # added after the first GPU session (2026-11-27): GradScaler, fused and SGD optimizers, a Llama-family model
    ("gpt2 fp16-mixed mb8 s1024", "gpt2", "causal-lm", dict(micro_batch=8, seq_len=1024, precision="fp16-mixed"), ""),
    ("bert-large bf16-mixed mb8 s512 adamw-fused", "bert-large", "seq-cls",
     dict(micro_batch=8, seq_len=512, precision="bf16-mixed", optimizer="adamw-fused"), ""),
    ("gpt2 fp32 mb8 s512 sgd", "gpt2", "causal-lm", dict(micro_batch=8, seq_len=512, precision="fp32", optimizer="sgd"),
     ""),
    ("tinyllama-1.1b bf16-mixed mb4 s1024 40g", str(REPO / "benchmarks" / "gpu_session" / "models" / "tinyllama-1.1b.json"),
     "causal-lm", dict(micro_batch=4, seq_len=1024, precision="bf16-mixed"), "", 40.0),
)

CHILD = r"""
import json, sys
import torch
from toolkit.estimate.measure import train_setup
from toolkit.models import load_model_config
from toolkit.plan import Plan
case = json.loads(sys.argv[1])
dev = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction calls want an index
total = torch.cuda.get_device_properties(dev).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, case["cap_bytes"] / total), dev)
# before the model; no stacks (they are not kept, and Python stacks broke a checkpointed backward: gpu_session/probe.py)
torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
model, opt, scaler, step = train_setup(load_model_config(case["model"]), case["task"], Plan.from_dict(case["plan"]),
                                       device="cuda")
for _ in range(case["steps"]):
    step()
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
trace = [{"action": e["action"], "addr": int(e.get("addr", 0)), "size": int(e.get("size", 0)),
          "stream": int(e.get("stream", 0))} for e in snap["device_traces"][dev.index]]
used = None
try:  # as nvidia-smi shows it: this process's own, else the device's without the driver's reservation
    import os, pynvml
    from toolkit.devices import nvml_used_bytes, visible_nvml_handle
    pynvml.nvmlInit()
    used = nvml_used_bytes(pynvml, visible_nvml_handle(pynvml, dev.index), os.getpid())
except Exception:
    pass
print(json.dumps({"max_allocated": torch.cuda.max_memory_allocated(dev), "max_reserved": torch.cuda.max_memory_reserved(dev),
                  "nvidia_smi_used": used, "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                  "trace": trace}))
"""


def run_case(name: str, model: str, task: str, knobs: dict, alloc_conf: str, cap_gib: float, steps: int,
             traces: Path | None) -> dict:
    import dataclasses
    import gzip

    from toolkit.estimate import estimate, model_ref
    from toolkit.estimate.cuda_trace import compare
    from toolkit.plan import Plan
    from toolkit.sites import load_site

    plan = Plan(global_batch=knobs["micro_batch"] * knobs.get("grad_accum", 1), alloc_conf=alloc_conf, **knobs)
    payload = json.dumps({"model": model, "task": task, "plan": plan.to_dict(), "steps": steps,
                          "cap_bytes": int(cap_gib * 2**30)})
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    done = subprocess.run([sys.executable, "-c", CHILD, payload], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)  # the whole tail: a first run on a new card has no other record
        return {"case": name, "error": (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
    real = json.loads(done.stdout.strip().splitlines()[-1])
    trace = real.pop("trace")
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in name)
        with gzip.open(traces / f"{slug}.trace.json.gz", "wt") as f:
            json.dump({"case": name, "alloc_conf": alloc_conf, "cap_gib": cap_gib, "plan": plan.to_dict(),
                       "gpu": real["gpu"], "torch": real["torch"], "trace": trace}, f)
    replayed = compare(trace, alloc_conf, capacity=int(cap_gib * 2**30))
    partition = dataclasses.replace(load_site("local").partition("default"), gpu_mem_gib=cap_gib)  # this card, capped
    est = estimate(model_ref(model, task), plan, partition, "analytic")
    return {"case": name, "alloc_conf": alloc_conf, "cap_gib": cap_gib, "real": real, "replay": replayed,
            "analytic": {"peak_allocated_mib": est.peak_allocated_mib, "peak_reserved_mib": est.peak_reserved_mib,
                         "device_used_mib": est.device_used_mib, "gpu_model": partition.gpu_model}}


def _pct(error: float | None) -> str:
    return "" if error is None else f"{100 * error:+.1f}%"


def _err(predicted: float | None, measured: float | None) -> str:
    return _pct((predicted - measured) / measured) if predicted is not None and measured else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-gib", type=float, default=16.0, help="memory fraction cap, as a card of this size")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="", help="run only the cases whose name this regular expression finds")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu-replay.json")
    ap.add_argument("--traces", type=Path, default=None, help="keep each case's event trace here (json.gz)")
    args = ap.parse_args(argv)
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        print("gpu_replay: no CUDA device here: nothing measured (run it on a GPU machine)", file=sys.stderr)
        return 2
    rows = [run_case(*case[:5], case[5] if len(case) > 5 else args.cap_gib, args.steps, args.traces)
            for case in CASES if re.search(args.only, case[0])]
    print(f"{'case':<38} {'real alloc':>10} {'real resv':>10} {'smi used':>9} | {'replay resv':>11} {'err':>7} "
          f"{'segs real/model':>15} | {'analytic alloc':>14} {'err':>7} {'resv':>7} {'err':>7} {'used':>7} {'err':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<38} failed: {r['error']}")
            continue
        real, rep, an = r["real"], r["replay"], r["analytic"]
        used = real["nvidia_smi_used"] / MIB if real["nvidia_smi_used"] else None
        print(f"{r['case']:<38} {real['max_allocated'] / MIB:>10,.0f} {real['max_reserved'] / MIB:>10,.0f} "
              f"{used or 0:>9,.0f} | {rep['model']['peak_reserved'] / MIB:>11,.0f} {_pct(rep['error']):>7} "
              f"{rep['real']['segments_at_peak']:>7}/{rep['model']['segments_at_peak']:<7} | "
              f"{an['peak_allocated_mib']:>14,.0f} {_err(an['peak_allocated_mib'], real['max_allocated'] / MIB):>7} "
              f"{an['peak_reserved_mib']:>7,.0f} {_err(an['peak_reserved_mib'], real['max_reserved'] / MIB):>7} "
              f"{an['device_used_mib']:>7,.0f} {_err(an['device_used_mib'], used):>7}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
