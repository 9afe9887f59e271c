"""Estimator accuracy and speed on this machine (issue 4), printed as tables.

    python benchmarks/estimator.py [--quick] [--no-7b]

1. Accuracy on CPU: for small models (GPT-2, BERT and a ViT on 32 x 32 images) and a grid of
   precisions, optimizers, checkpointing and batch sizes, a real training step's peak of live
   tensor bytes (toolkit.estimate.measure) against the analytic estimate and the traced one (fake
   tensors, CPU behaviour). Goal: peak_allocated within 5 %.
2. Speed: a 100,000-event random stream through the allocator model; the planner's whole candidate
   ladder with the analytic method for the shipped specs (goal < 1 s), and the traced method on the
   7B-class config (goal < 90 s on 2 cores).
GPU accuracy (device_used and peak reserved/allocated against published GPU measurements and hpcmem's own
H100 session) is benchmarks/estimator_gpu.py's; benchmarks/gpu_session/ makes new GPU measurements on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import subprocess
import sys

from toolkit.estimate import ModelRef, estimate
from toolkit.estimate.measure import measured_peak_bytes
from toolkit.estimate.traced import estimate_traced
from toolkit.models import load_model_config
from toolkit.plan import Plan
from toolkit.sites import load_site

MIB = 2**20
CPU = load_site("testcluster").partition("cpu")


def accuracy(quick: bool) -> list[tuple]:
    models = [("tiny-gpt2", "causal-lm"), ("tiny-bert", "seq-cls"), ("tiny-vit", "image-cls")] + (
        [] if quick else [("tiny-gpt2", "seq-cls"), ("tiny-bert", "causal-lm")])
    grid = list(itertools.product(("fp32", "bf16-mixed", "bf16-true"), ("adamw", "sgd", "adafactor"), (False, True),
                                  (2, 8)))
    if quick:
        grid = grid[::5]
    rows = []
    for (name, task), (precision, optimizer, ckpt, micro) in itertools.product(models, grid):
        plan = Plan(global_batch=micro, micro_batch=micro, seq_len=128, precision=precision, optimizer=optimizer,
                    checkpointing=ckpt, mem_mib=16000)
        cfg = load_model_config(name)
        real = measured_peak_bytes(cfg, task, plan) / MIB
        ref = ModelRef(cfg, task, None, name)
        ana = estimate(ref, plan, CPU, "analytic").peak_allocated_mib
        tra = estimate_traced(cfg, task, plan, CPU).peak_allocated_mib
        rows.append((f"{name}/{task}", precision, optimizer, ckpt, micro, real, ana, tra))
    return rows


LADDERS = (("gpt2-clm", "a100-40gb"), ("bert-large-cls", "v100-16gb"), ("llama-7b-zero3-nvme", "a100-40gb"))


def ladder_speed() -> list[tuple]:
    """Each shipped spec's whole candidate ladder, timed in a fresh process as ``hpcmem plan`` runs it: in this
    process, after the accuracy grid, Python's garbage collector walks the grid's leftovers and added 300-450 ms
    to the llama ladder (session 10: 843-1003 ms here, 562 ms after ``gc.freeze()``, 554-666 ms fresh)."""
    code = ("import sys, time\nfrom toolkit import planner\nfrom toolkit.estimate import spec_model\n"
            "from toolkit.jobspec import load_spec\nfrom toolkit.sites import load_site\n"
            "spec = load_spec(sys.argv[1]); partition = load_site('example-hpc').partition(sys.argv[2])\n"
            "t = time.perf_counter()\n"
            "cands = planner.plan_candidates(spec_model(spec), spec.first_plan(partition), partition, spec.allow)\n"
            "print(len(cands), time.perf_counter() - t)")
    out = []
    for job, part in LADDERS:
        n, secs = subprocess.run([sys.executable, "-c", code, job, part], capture_output=True, text=True,
                                 check=True).stdout.split()[-2:]
        out.append((job, part, int(n), float(secs)))
    return out


def traced_7b() -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and predicted peak of tracing llama-7b in a fresh process."""
    code = ("import time, resource; t=time.perf_counter()\n"
            "from toolkit.estimate.traced import estimate_traced\nfrom toolkit.models import load_model_config\n"
            "from toolkit.plan import Plan\nfrom toolkit.sites import load_site\n"
            "p = Plan(global_batch=1, micro_batch=1, seq_len=2048, precision='bf16-mixed', checkpointing=True)\n"
            "e = estimate_traced(load_model_config('llama-7b'), 'causal-lm', p, load_site('example-hpc').partition('a100-80gb'))\n"
            "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024, e.peak_allocated_mib)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return tuple(float(x) for x in out[-3:])


def replay_speed(n: int = 100_000, repeats: int = 3) -> float:
    """Best-of-``repeats`` seconds to replay a random ``n``-event stream (a third small, medium and large
    requests; a little under half the events frees) through the allocator model, unbounded."""
    import random
    import time

    from toolkit.estimate.allocator import replay

    rnd = random.Random(0)
    live, evs, k = [], [], 0
    while len(evs) < n:
        if live and rnd.random() < 0.48:
            evs.append(("free", live.pop(rnd.randrange(len(live)))))
        else:
            size = rnd.choice([rnd.randint(1, 4096), rnd.randint(4096, 2 * MIB), rnd.randint(2 * MIB, 64 * MIB)])
            evs.append(("alloc", k, size))
            live.append(k)
            k += 1
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        replay(evs)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the accuracy grid")
    parser.add_argument("--no-7b", action="store_true", help="skip the 7B traced timing")
    args = parser.parse_args()
    rows = accuracy(args.quick)
    print(f"{'model/task':<20} {'precision':<11} {'optim':<9} {'ckpt':<5} {'mb':>3} {'real MiB':>9} "
          f"{'analytic':>9} {'err%':>6} {'traced':>9} {'err%':>6}")
    errs_a, errs_t = [], []
    for name, prec, opt, ckpt, mb, real, ana, tra in rows:
        ea, et = 100 * (ana - real) / real, 100 * (tra - real) / real
        errs_a.append(abs(ea))
        errs_t.append(abs(et))
        print(f"{name:<20} {prec:<11} {opt:<9} {str(ckpt):<5} {mb:>3} {real:>9.1f} {ana:>9.1f} {ea:>6.1f} {tra:>9.1f} {et:>6.1f}")
    print(f"\npeak_allocated vs real CPU step over {len(rows)} cells: analytic max |err| {max(errs_a):.1f} % "
          f"(mean {sum(errs_a) / len(errs_a):.2f} %), traced max |err| {max(errs_t):.1f} % "
          f"(mean {sum(errs_t) / len(errs_t):.2f} %); goal 5 %")
    print()
    print(f"allocator model: a random 100,000-event stream replays in {replay_speed() * 1000:.0f} ms (best of 3)")
    for job, part, n, secs in ladder_speed():
        print(f"planner, analytic: {job} on {part}: {n} candidates in {secs * 1000:.0f} ms (goal < 1 s)")
    if not args.no_7b:
        secs, rss, peak = traced_7b()
        print(f"traced llama-7b (micro 1, seq 2048, bf16-mixed, checkpointing): {secs:.1f} s, peak RSS {rss:.0f} MiB, "
              f"predicted peak {peak:,.0f} MiB (goal < 90 s, within this machine's 24 GiB)")
    print(f"(benchmark process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
