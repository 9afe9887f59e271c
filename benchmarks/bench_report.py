"""`hpcmem bench report` over a year of nightly history (issue 6): goal < 5 s per format.

    python benchmarks/bench_report.py [--cells 100] [--nights 365] [--repeat 3] [--keep DIR]

Builds a synthetic results store (site ``synthetic``: 2 partitions x 5 models x 10 techniques =
100 cells, one row per cell per night, all columns of toolkit/bench/columns.py; about 1 % failed
cells, a torch upgrade two thirds of the way, a memory regression and a newly failing cell on the
last night) and times ``run_report`` for markdown and html in this process. The first call of each
format is reported apart (it pays for importing matplotlib and loading the templates).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from toolkit.bench.columns import COLUMNS
from toolkit.bench.report import run_report

TECHNIQUES = ("vanilla", "accum", "accum+ckpt", "fp16-mixed", "bf16-mixed", "adafactor", "all-together", "zero1",
              "zero2", "zero3-offload-cpu")
SAVING = np.array([0.0, 0.25, 0.55, 0.30, 0.35, 0.20, 0.70, 0.15, 0.30, 0.80])  # of vanilla's memory
SLOWDOWN = np.array([1.0, 1.05, 1.35, 0.55, 0.50, 1.1, 0.8, 1.02, 1.05, 2.5])    # step time vs vanilla
MODELS = ("bert-large", "gpt2", "gpt2-medium", "vit-base", "tiny-gpt2")
PARTITIONS = ("a100", "cpu")


def synthetic_store(cells: int = 100, nights: int = 365, seed: int = 0) -> pd.DataFrame:
    """A results store with ``cells`` cells x ``nights`` nights (vectorized; columns.COLUMNS, in order)."""
    rng = np.random.default_rng(seed)
    grid = [(p, m, t) for p in PARTITIONS for m in MODELS for t in range(len(TECHNIQUES))][:cells]
    part = np.array([g[0] for g in grid]).repeat(nights)
    model = np.array([g[1] for g in grid]).repeat(nights)
    tech = np.array([g[2] for g in grid]).repeat(nights)
    night_index = np.tile(np.arange(nights), len(grid))
    days = pd.Timestamp("2026-11-21") - pd.to_timedelta(nights - 1 - night_index, unit="D")
    gpu = part != "cpu"
    base = 2000.0 + 1500.0 * np.array([MODELS.index(m) for m in model])
    noise = rng.normal(1.0, 0.01, len(part))
    memory = base * (1 - SAVING[tech]) * noise
    speed = 80.0 / SLOWDOWN[tech] * rng.normal(1.0, 0.02, len(part))
    n = len(part)
    frame = pd.DataFrame({
        "night": days.strftime("%Y-%m-%d"), "site": "synthetic", "partition": part, "model": model,
        "technique": np.array(TECHNIQUES)[tech], "matrix": "synthetic", "plan_json": "{}",
        "launcher": np.where(tech >= 7, "deepspeed", "torchrun"), "precision": "fp32", "optimizer": "adamw",
        "attention": "sdpa", "offload_optimizer": "none", "offload_params": "none", "micro_batch": 8,
        "grad_accum": 1, "world_size": 2, "seq_len": 512, "zero_stage": 0, "checkpointing": False,
        "torch": np.where(night_index < 2 * nights // 3, "2.12.0", "2.13.0"), "deepspeed": "0.16.4",
        "transformers": "4.57.0", "cuda": np.where(gpu, "12.4", None), "driver": np.where(gpu, "550.54", None),
        "hpcmem": "0.1.0", "gpu_name": np.where(gpu, "NVIDIA A100-SXM4-40GB", None),
        "peak_allocated_mib": np.where(gpu, memory, np.nan), "peak_reserved_mib": np.where(gpu, memory * 1.06, np.nan),
        "device_used_mib": np.where(gpu, memory * 1.06 + 520, np.nan),
        "peak_rss_mib": np.where(gpu, 3000.0, memory) * rng.normal(1.0, 0.005, n),
        "samples_per_s": speed, "step_time_s": 16 / speed, "steps": 20, "status": "ok", "verdict": "", "error": "",
        "predicted_peak_mib": memory * rng.normal(1.0, 0.04, n), "predicted_device_mib": np.nan,
        "predicted_host_mib": np.nan, "job_id": "0", "run_id": "r", "collected_at": 0.0,
    })
    failed = rng.random(n) < 0.01
    frame.loc[failed, ["status", "verdict", "error"]] = ["failed", "gpu_oom", "CUDA out of memory"]
    frame.loc[failed, ["samples_per_s", "step_time_s"]] = np.nan
    last = frame["night"] == frame["night"].max()
    before = frame["night"] == sorted(frame["night"].unique())[-2]
    cell = (frame["partition"] == "a100") & (frame["model"] == "gpt2")
    frame.loc[last & cell & (frame["technique"] == "zero2"), "peak_allocated_mib"] *= 1.3   # a regression
    frame.loc[before & cell & (frame["technique"] == "zero1"), ["status", "verdict", "error"]] = ["ok", "", ""]
    frame.loc[last & cell & (frame["technique"] == "zero1"), ["status", "verdict", "error", "samples_per_s"]] = [
        "failed", "gpu_oom", "CUDA out of memory. Tried to allocate 2.00 GiB", np.nan]  # newly failing
    return frame[list(COLUMNS)]


def time_format(frame: pd.DataFrame, fmt: str, repeat: int, out: Path) -> dict:
    seconds = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        outcome = run_report(frame, fmt=fmt, out_dir=out / fmt)
        seconds.append(time.perf_counter() - start)
    return {"format": fmt, "first_s": seconds[0], "median_s": statistics.median(seconds[1:]), "max_s": max(seconds),
            "runs": len(seconds), "exit_code": outcome.exit_code, "regressions": len(outcome.regressions),
            "new_failures": len(outcome.new_failures), "bytes": outcome.path.stat().st_size,
            "files": len(list((out / fmt).iterdir()))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--nights", type=int, default=365)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per format after the first")
    parser.add_argument("--keep", type=Path, help="write the reports here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    frame = synthetic_store(args.cells, args.nights)
    built = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        results = [time_format(frame, fmt, args.repeat, out) for fmt in ("markdown", "html")]
    if args.json:
        print(json.dumps({"rows": len(frame), "build_s": built, "results": results}, indent=2))
        return 0
    print(f"synthetic store: {len(frame)} rows ({args.cells} cells x {args.nights} nights), built in {built:.2f} s")
    print(f"{'format':10} {'first (s)':>10} {'median (s)':>11} {'max (s)':>8}  goal   found")
    for r in results:
        verdict = "ok" if r["max_s"] < 5 else "MISSED"
        print(f"{r['format']:10} {r['first_s']:10.2f} {r['median_s']:11.2f} {r['max_s']:8.2f}  < 5 s {verdict:6}"
              f" exit {r['exit_code']}, {r['regressions']} regression(s), {r['new_failures']} newly failing,"
              f" {r['files']} file(s), report {r['bytes'] / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
