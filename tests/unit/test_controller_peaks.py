"""controller.data_peak: the attempt's step series read from its directory (metrics.json, else the rank files)."""

import json
from types import SimpleNamespace

from toolkit import controller, peaks
from toolkit.plan import Plan


def leak(n=20):
    steps = [[s, 64, 500.0 + 50.0 * s] for s in range(1, n)]
    return {"plan_seq_len": 64, "steps": steps, "last": steps[-1], "longest_done": [1, 64],
            "current": {"step": n, "seq_len": 64}, "measure": "rss"}


def test_rank_files_of_a_killed_job_are_read(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank-1.json").write_text(json.dumps({"rank": 1, "step_peaks": leak()}))
    (tmp_path / "metrics" / "rank-0.json").write_text("{broken")
    attempt = SimpleNamespace(attempt_dir=str(tmp_path), plan=Plan(seq_len=64).to_dict())
    d = controller.data_peak(attempt)
    assert d.case == peaks.LEAK and d.rank == 1


def test_metrics_json_wins_and_no_series_is_none(tmp_path):
    attempt = SimpleNamespace(attempt_dir=str(tmp_path), plan=Plan(seq_len=64).to_dict())
    assert controller.data_peak(attempt) is None
    (tmp_path / "metrics.json").write_text(json.dumps({"ranks": {"0": {"rank": 0, "step_peaks": {
        "plan_seq_len": 64, "steps": [[1, 64, 500.0]], "last": [1, 64, 500.0], "longest_done": [1, 64],
        "current": {"step": 2, "seq_len": 1024}}}}}))
    assert controller.data_peak(attempt).case == peaks.LONG_BATCH
