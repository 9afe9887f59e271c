"""The results store: durable appends (nothing lost, nothing twice), its columns, rows built from literal
metrics.json and ledger records, and the calibration points it gives."""

import json
import math
import sqlite3
from pathlib import Path

import pytest

from toolkit.bench import store
from toolkit.bench.collect import build_row, collect, row_status, submitted_cells
from toolkit.bench.columns import COLUMNS, KEY, NUMERIC
from toolkit.calibrate import fit_overheads
from toolkit.errors import HpcmemError
from toolkit.ledger import AttemptRow, Ledger, Run


def _row(night="2026-01-01", technique="vanilla", **kw):
    row = {"night": night, "site": "testcluster", "partition": "cpu", "model": "tiny-gpt2", "technique": technique,
           "matrix": "ci-small", "status": "ok", "verdict": "", "error": "", "samples_per_s": 40.0,
           "peak_rss_mib": 900.0, "micro_batch": 8, "checkpointing": False, "run_id": "r1", "job_id": "7"}
    row.update(kw)
    return row


def test_append_twice_adds_nothing_the_second_time(tmp_path):
    path = tmp_path / "results.sqlite"
    rows = [_row(technique=t) for t in ("vanilla", "zero2", "accum+ckpt")]
    assert store.append(path, rows) == 3
    assert store.append(path, rows) == 0
    changed = [_row(technique="vanilla", samples_per_s=1.0), _row(technique="adafactor")]
    assert store.append(path, changed) == 1  # the stored vanilla row is kept as first written
    frame = store.load(path)
    assert len(frame) == 4 and not frame.duplicated(list(KEY)).any()
    assert frame.set_index("technique").loc["vanilla", "samples_per_s"] == 40.0


def test_an_interrupted_append_loses_nothing_stored_and_stores_nothing_half(tmp_path):
    path = tmp_path / "results.sqlite"
    store.append(path, [_row(night="2026-01-01")])

    def interrupted():
        yield _row(night="2026-01-02")
        yield _row(night="2026-01-02", technique="zero2")
        raise KeyboardInterrupt  # Ctrl-C (or a crash) in the middle of a collect

    with pytest.raises(KeyboardInterrupt):
        store.append(path, interrupted())
    assert list(store.load(path)["night"]) == ["2026-01-01"]
    with pytest.raises(HpcmemError, match="status must be one of"):
        store.append(path, [_row(night="2026-01-03"), _row(night="2026-01-03", technique="zero2", status="running")])
    assert list(store.load(path)["night"]) == ["2026-01-01"]
    assert store.append(path, [_row(night="2026-01-02"), _row(night="2026-01-02", technique="zero2")]) == 2
    assert len(store.load(path)) == 3


def test_bad_rows_are_one_line_errors(tmp_path):
    path = tmp_path / "results.sqlite"
    with pytest.raises(HpcmemError, match="unknown column 'samples_per_sec'"):
        store.append(path, [_row(samples_per_sec=3.0)])
    with pytest.raises(HpcmemError, match="key column 'night' is empty"):
        store.append(path, [_row(night="")])
    (tmp_path / "junk.sqlite").write_text("not a database at all " * 100)
    with pytest.raises(HpcmemError, match="results store") as exc:
        store.load(tmp_path / "junk.sqlite")
    assert "\n" not in str(exc.value)


def test_load_gives_the_documented_columns_and_types(tmp_path):
    empty = store.load(tmp_path / "none.sqlite")
    assert list(empty.columns) == list(COLUMNS) and empty.empty
    path = tmp_path / "results.sqlite"
    store.append(path, [_row(), _row(technique="zero3-offload-cpu", status="failed", verdict="host_oom",
                                     error="killed", samples_per_s=None, checkpointing=True,
                                     plan_json={"zero_stage": 3})])
    frame = store.load(path)
    assert list(frame.columns) == list(COLUMNS)
    assert all(frame[c].dtype == "float64" for c in NUMERIC)
    failed = frame[frame.status == "failed"].iloc[0]
    assert math.isnan(failed.samples_per_s) and failed.checkpointing == True and failed.verdict == "host_oom"  # noqa: E712
    assert json.loads(failed.plan_json) == {"zero_stage": 3}
    assert frame[frame.status == "ok"].iloc[0].checkpointing == False  # noqa: E712


def test_a_store_written_before_a_column_existed_gains_it(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE results (night TEXT, site TEXT, partition TEXT, model TEXT, technique TEXT, "
                   "status TEXT, samples_per_s REAL, UNIQUE (night, site, partition, model, technique))")
        db.execute("INSERT INTO results VALUES ('2025-12-31', 'testcluster', 'cpu', 'tiny-gpt2', 'vanilla', 'ok', 41.0)")
    assert store.append(path, [_row()]) == 1
    frame = store.load(path)
    assert list(frame.night) == ["2025-12-31", "2026-01-01"] and math.isnan(frame.iloc[0].peak_rss_mib)


def test_two_matrices_store_the_same_cell_on_the_same_night_twice(tmp_path):
    path = tmp_path / "results.sqlite"
    assert store.append(path, [_row(), _row(matrix="smoke", samples_per_s=30.0)]) == 2
    assert store.append(path, [_row(), _row(matrix="smoke")]) == 0
    assert sorted(store.load(path).matrix) == ["ci-small", "smoke"]


def _old_keyed_store(path: Path) -> None:
    """A store as the first release wrote it: every column (plus one this release does not know),
    UNIQUE on (night, site, partition, model, technique): no matrix in the key."""
    columns = ", ".join(f'"{c}"' for c in COLUMNS)
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE TABLE results ({columns}, note TEXT, UNIQUE (night, site, partition, model, technique))")
        for night, technique in (("2026-01-01", "vanilla"), ("2026-01-01", "zero2"), ("2026-01-02", "vanilla")):
            row = store.check_row(_row(night=night, technique=technique))
            db.execute(f"INSERT INTO results ({columns}, note) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})",
                       [row[c] for c in COLUMNS] + [f"kept {night}"])


def test_a_store_keyed_before_matrix_joined_the_key_is_rekeyed_keeping_every_row(tmp_path):
    path = tmp_path / "old.sqlite"
    _old_keyed_store(path)
    assert len(store.load(path)) == 3  # opening migrates
    with sqlite3.connect(path) as db:
        assert store._unique_keys(db) == [KEY]
        assert sorted(r[0] for r in db.execute("SELECT note FROM results")) == ["kept 2026-01-01"] * 2 + [
            "kept 2026-01-02"]
    assert store.append(path, [_row(), _row(night="2026-01-02")]) == 0        # a second collect adds nothing
    assert store.append(path, [_row(matrix="smoke")]) == 1                    # the old key would have dropped it
    frame = store.load(path)
    assert len(frame) == 4 and not frame.duplicated(list(KEY)).any()
    assert store.append(path, [_row(matrix="smoke")]) == 0 and len(store.load(path)) == 4  # migrated once


def test_collect_stores_skipped_cells_once_and_lists_the_submitted_ones(tmp_path):
    home = tmp_path / "home"
    (home / "bench").mkdir(parents=True)
    manifest = {"version": 1, "night": "2026-01-05", "matrix": "ci-small", "site": "testcluster",
                "site_path": str(tmp_path / "gone.yaml"), "cells": [
                    {"partition": "cpu", "model": "tiny-gpt2", "technique": "fp16-mixed", "status": "skipped",
                     "reason": "fp16 mixed precision needs a GPU (no GPU on cpu)", "run_id": None, "plan": None},
                    {"partition": "cpu", "model": "tiny-gpt2", "technique": "vanilla", "status": "planned",
                     "reason": None, "run_id": None, "plan": {"micro_batch": 8}}]}
    (home / "bench" / "2026-01-05-ci-small-testcluster.json").write_text(json.dumps(manifest))
    path = tmp_path / "results.sqlite"
    with Ledger(home / "ledger.sqlite") as ledger:
        first = collect(ledger, path, home, now=lambda: 5.0)
        second = collect(ledger, path, home, now=lambda: 6.0)
    assert (first["added"], first["skipped"], first["not_submitted"]) == (1, 1, ["2026-01-05/testcluster/cpu/"
                                                                                  "tiny-gpt2/vanilla/ci-small"])
    assert (second["added"], second["skipped"]) == (0, 1)
    [skipped] = store.load(path).to_dict("records")
    assert (skipped["technique"], skipped["status"], skipped["error"]) == (
        "fp16-mixed", "skipped", "fp16 mixed precision needs a GPU (no GPU on cpu)")
    assert math.isnan(skipped["samples_per_s"]) and skipped["collected_at"] == 5.0
    assert [(c["technique"], c["state"]) for c in submitted_cells(home)] == [("vanilla", "planned")]


def _attempt(metrics=None, verdict=None, state="COMPLETED", plan=None):
    return AttemptRow(run_id="r1", n=1, job_id="42", state=state, plan=plan or {"micro_batch": 8, "zero_stage": 3,
                      "launcher": "deepspeed", "checkpointing": False, "precision": "fp32"}, verdict=verdict,
                      metrics=metrics, decision=None, attempt_dir="/nowhere", partition="cpu", exit_code=0,
                      created=0.0, submitted=1.0, finished=2.0, updated=2.0)


def _run(state, reason=""):
    return Run(run_id="r1", spec_path="/s.yaml", spec_name="bench", site="testcluster", site_path="/t.yaml",
               partition="cpu", run_dir="/r", workdir="/w", state=state, reason=reason, created=0.0, updated=0.0)


MANIFEST = {"night": "2026-01-05", "site": "testcluster", "matrix": "ci-small"}
CELL = {"partition": "cpu", "model": "tiny-gpt2", "technique": "zero3-offload-cpu"}
METRICS = {"status": "ok", "samples_per_s": 12.5, "step_time_s": 0.64, "steps": 6, "peak_rss_mib": 1402.0,
           "peak_allocated_mib": None, "device_used_mib": None, "error": None,
           "versions": {"torch": "2.13.0", "deepspeed": "0.18.0", "transformers": "4.57.0", "cuda": None,
                        "driver": None, "hpcmem": "0.1.0"}}


class _Estimate:
    peak_allocated_mib, device_used_mib, host_mib_per_node = 310.0, 310.0, 120.0


def test_an_ok_cell_becomes_a_row_with_plan_versions_measured_and_predicted_values():
    row = build_row(MANIFEST, CELL, _run("succeeded"), _attempt(METRICS), METRICS, True, _Estimate(), 99.0)
    assert set(row) == set(COLUMNS)
    assert (row["status"], row["verdict"], row["error"]) == ("ok", "", "")
    assert (row["night"], row["technique"], row["zero_stage"], row["launcher"]) == ("2026-01-05", "zero3-offload-cpu", 3,
                                                                                     "deepspeed")
    assert (row["samples_per_s"], row["peak_rss_mib"], row["peak_allocated_mib"]) == (12.5, 1402.0, None)
    assert (row["torch"], row["deepspeed"], row["cuda"]) == ("2.13.0", "0.18.0", None)
    assert (row["predicted_peak_mib"], row["predicted_host_mib"]) == (310.0, 120.0)
    assert (row["job_id"], row["run_id"], row["collected_at"]) == ("42", "r1", 99.0)
    assert json.loads(row["plan_json"])["zero_stage"] == 3


def test_a_failed_job_keeps_its_verdict_error_and_what_the_ranks_saw():
    ranks = {**METRICS, "status": "running", "samples_per_s": None, "peak_rss_mib": 640.0}
    row = build_row(MANIFEST, CELL, _run("gave_up", "out of attempts (1)"),
                    _attempt(verdict={"kind": "host_oom"}, state="OUT_OF_MEMORY"), ranks, False, None, 1.0)
    assert (row["status"], row["verdict"], row["peak_rss_mib"]) == ("failed", "host_oom", 640.0)
    assert row["error"] == "out of attempts (1)" and row["predicted_peak_mib"] is None
    bare = build_row(MANIFEST, CELL, _run("failed", "attempt 1 ended FAILED: exit 1\nmore"),
                     _attempt(state="FAILED"), None, False, None, 1.0)
    assert (bare["status"], bare["verdict"], bare["error"]) == ("failed", "unknown", "attempt 1 ended FAILED: exit 1")


@pytest.mark.parametrize("run_state, metrics, from_file, status", [
    ("succeeded", {"status": "ok"}, True, "ok"),
    ("succeeded", None, False, "missing"),
    ("succeeded", {"status": "running"}, False, "missing"),  # only rank files: metrics.json is missing
    ("succeeded", {"status": "incomplete"}, True, "incomplete"),
    ("failed", {"status": "ok"}, True, "failed"),
    ("gave_up", None, False, "failed"),
    ("cancelled", None, False, "failed"),
])
def test_row_status(run_state, metrics, from_file, status):
    assert row_status(run_state, metrics, from_file) == status


def test_a_completed_job_without_metrics_json_is_a_missing_row():
    row = build_row(MANIFEST, CELL, _run("succeeded"), _attempt(verdict={"kind": "not_oom"}), None, False, None, 1.0)
    assert (row["status"], row["verdict"], row["error"]) == ("missing", "not_oom", "no metrics.json")
    assert row["samples_per_s"] is None and row["torch"] is None


def test_calibration_points_from_the_store_feed_fit_overheads(tmp_path):
    path = tmp_path / "results.sqlite"
    gpu = dict(site="example-hpc", partition="a100-40gb")
    store.append(path, [
        _row(night=f"2026-01-0{i}", peak_allocated_mib=1000.0 * i, peak_reserved_mib=1100.0 * i,
             device_used_mib=1100.0 * i + 500, **gpu) for i in range(1, 5)] + [
        _row(night="2026-01-05", status="failed", peak_allocated_mib=10.0, peak_reserved_mib=90.0,
             device_used_mib=999.0, **gpu),                              # a failed cell is not a point
        _row(night="2026-01-01", peak_allocated_mib=None, **gpu, technique="zero2"),  # nothing measured
        _row(night="2026-01-01")])                                       # another partition
    points = store.calibration_metrics(store.load(path), "example-hpc", "a100-40gb")
    assert len(points) == 4
    fitted = fit_overheads(points)
    assert fitted["allocator_overhead_frac"] == pytest.approx(0.1) and fitted["cuda_context_mib"] == pytest.approx(500)
    assert store.calibration_metrics(store.load(path), "testcluster", "cpu") == []


def test_calibrate_from_bench_writes_the_fitted_overheads(tmp_path):
    """`hpcmem calibrate --from-bench` end to end. The GPU rows are FAKE (no GPU here): numbers a GPU night
    would store, with reserved = 1.1 x allocated and 600 MiB of CUDA context."""
    from hpcmem_cli import run_cli

    path = tmp_path / "results.sqlite"
    gpu = dict(site="example-hpc", partition="a100-40gb")
    store.append(path, [_row(night=f"2026-02-0{i}", peak_allocated_mib=2000.0 * i, peak_reserved_mib=2200.0 * i,
                             device_used_mib=2200.0 * i + 600, **gpu) for i in range(1, 4)])
    home = tmp_path / "home"
    out = run_cli("calibrate", "--site", "example-hpc", "--partition", "a100-40gb", "--from-bench", "--store", path,
                  "--json", home=home, check=True)
    measured = json.loads(out.stdout)["measured"]
    assert measured["allocator_overhead_frac"] == pytest.approx(0.1) and measured["cuda_context_mib"] == 600
    assert Path(json.loads(out.stdout)["file"]).is_file()
    cpu_only = run_cli("calibrate", "--site", "testcluster", "--partition", "cpu", "--from-bench", "--store", path,
                       home=home)
    assert cpu_only.returncode == 2 and "benchmark cells" in cpu_only.stderr and cpu_only.stderr.count("\n") == 1
