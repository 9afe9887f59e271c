"""hpcmem triage with the attempt's step series and allocator snapshot next to the log (the command runs for real).

The series are literal (shaped as toolkit/runtime/monitor.py writes them); the snapshot is FAKE (no GPU here):
a literal dict shaped like torch.cuda.memory._snapshot(), from tests/unit/test_triage_snapshot.py.
"""

import json
import pickle
import shutil

from test_triage_cli import LOGS, no_slurm, triage  # noqa: F401 - the fixture is used by name
from test_triage_snapshot import FAKE_SNAPSHOT

LOG = "hf_trainer_gpu_oom_torch22.log"
WHERE = ("--site", "example-hpc", "--partition", "a100-40gb")


def attempt(tmp_path, series):
    d = tmp_path / "attempt-1"
    (d / "metrics").mkdir(parents=True)
    shutil.copy(LOGS / LOG, d / "slurm-1.out")
    (d / "metrics" / "rank-0.json").write_text(json.dumps({"rank": 0, "status": "running", "step_peaks": series}))
    return d


def leak_series():
    steps = [[s, 512, 20000.0 + 150.0 * s] for s in range(1, 40)]
    return {"measure": "max_memory_allocated", "plan_seq_len": 512, "first_step": 1, "every": 1, "cap": 1024,
            "steps": steps, "last": steps[-1], "longest_done": [1, 512], "current": {"step": 40, "seq_len": 512}}


def long_series():
    steps = [[s, 256 + (s * 37) % 256, 30000.0 + (s % 5) * 40] for s in range(1, 200)]
    return {"measure": "max_memory_allocated", "plan_seq_len": 512, "first_step": 1, "every": 1, "cap": 1024,
            "steps": steps, "last": steps[-1], "longest_done": [13, 511], "current": {"step": 200, "seq_len": 4096}}


def test_a_leak_gets_the_code_remedy_not_the_ladder(tmp_path, no_slurm):  # noqa: F811
    d = attempt(tmp_path, leak_series())
    (d / "memory-snapshot-rank0.pickle").write_bytes(pickle.dumps(FAKE_SNAPSHOT))
    f, = triage(d / "slurm-1.out", *WHERE, home=tmp_path, env=no_slurm)
    assert f["oom"] and f["peaks"]["case"] == "leak" and f["remedies"] == []
    assert "loss.item()" in f["peaks"]["remedies"][0]
    snap, = f["memory_snapshots"]
    assert snap["viewer"] == "https://pytorch.org/memory_viz"
    assert snap["summary"]["largest"][0]["stack"][0] == "/home/u/train.py:95 in training_step"
    text = triage(d / "slurm-1.out", *WHERE, home=tmp_path, env=no_slurm, fmt="text")
    assert "Data-driven peak: leak" in text and "not the first-step ladder" in text and "loss.item()" in text
    assert "https://pytorch.org/memory_viz" in text and "/home/u/train.py:95 in training_step" in text
    assert "micro_batch" not in text.split("Remedies")[1]
    md = triage(d / "slurm-1.out", *WHERE, home=tmp_path, env=no_slurm, fmt="markdown")
    assert "**Data-driven peak: leak**" in md and "`/home/u/train.py:95 in training_step`" in md


def test_a_long_batch_gets_length_remedies(tmp_path, no_slurm):  # noqa: F811
    d = attempt(tmp_path, long_series())
    f, = triage(d / "slurm-1.out", *WHERE, home=tmp_path, env=no_slurm)
    assert f["peaks"]["case"] == "long_batch" and f["remedies"] == [] and f["memory_snapshots"] == []
    assert f["peaks"]["numbers"]["seq_len"] == 4096 and f["peaks"]["numbers"]["longest_done"] == 511
    assert any("--max-seq-len 4096" in r for r in f["peaks"]["remedies"])


def test_without_a_case_the_ladder_stays(tmp_path, no_slurm):  # noqa: F811
    first = {"measure": "max_memory_allocated", "plan_seq_len": 512, "steps": [], "last": None,
             "longest_done": None, "current": {"step": 1, "seq_len": 512}}
    d = attempt(tmp_path, first)
    f, = triage(d / "slurm-1.out", *WHERE, home=tmp_path, env=no_slurm)
    assert f["peaks"]["case"] == "first_step" and f["remedies"]
    text = triage(d / "slurm-1.out", *WHERE, home=tmp_path, env=no_slurm, fmt="text")
    assert "Data-driven peak: first_step" in text and "fastest predicted to fit first" in text


def test_no_series_no_peaks(tmp_path, no_slurm):  # noqa: F811
    f, = triage(LOGS / LOG, *WHERE, home=tmp_path, env=no_slurm)
    assert f["peaks"] is None and f["memory_snapshots"] == [] and f["remedies"]
