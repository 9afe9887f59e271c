"""FSDP2's memory on one real CPU rank against the analytic estimate (benchmarks/fsdp_cpu_check.py).

hpcmem's own FSDP2 sharding of a small LLaMA whose root unit (embedding, final norm, untied head) is about ten
layers' worth runs one gloo rank; what the CPU allocator hands out in a steady-state step is compared with
``estimate_analytic`` on a CPU partition. The cases picked (fp32, plain SGD, 1 x 16 tokens, with and without
resharding) peak at the backward's end: the embedding's gradient made while the head's unsharded gradient is held
for the root's reduction, the layers' units all resharded. Before session 20 the estimate counted two (or all)
gathered units and a layer's reduction buffers there: +7.5 / +12.5 %. On one rank FSDP2 copies the reduce-scatter
input into its output itself, so the figures are FSDP2's buffers, not gloo's. The benchmark's bf16-mixed cases are
not asserted here: a CPU's bf16 kernels and their scratch buffers differ from machine to machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
HANG_S = 600
BACKWARD_END_CASES = "4,5"  # fsdp_cpu_check.CASES: fp32, plain SGD, little activation


def test_fsdp2_backward_end_on_a_cpu_rank_is_estimated_within_two_percent():
    result = subprocess.run([sys.executable, "benchmarks/fsdp_cpu_check.py", "--json", "--cases",
                             BACKWARD_END_CASES], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-3000:]
    # (the profiler may print lines of its own around the JSON object)
    out = result.stdout
    start = out.rindex("{", 0, out.index('"config"'))
    rows = json.JSONDecoder().raw_decode(out[start:])[0]["rows"]
    assert len(rows) == 2
    for row in rows:  # before session 20: +7.5 % and +12.5 %
        assert abs(row["error_pct"]) <= 2.0, row
        assert any(n.startswith("peak at the backward end") for n in row["estimate_notes"]), row
