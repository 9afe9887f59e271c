"""``bench collect``: the finished cells of every manifest -> rows of the results store.

For each submitted cell not yet stored, the cell's run is ticked (the controller's own step:
poll, classify, decide); once the run has ended, its attempt's metrics.json, the ledger's
verdict and the analytic estimate for the same plan and partition make one row (``build_row``,
pure). Status: ``ok``; ``failed`` (the job failed: its verdict and error are kept, with what the
rank files saw); ``missing`` (the job ended well but left no metrics.json); ``incomplete``
(a rank's record is missing); ``skipped`` (the matrix skipped the cell on this partition: the
manifest's reason, stored at once). Unfinished cells wait for the next collect. Rows are appended
per manifest in one transaction (store.py), so an interrupted collect loses and duplicates nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from .. import controller, runs
from ..errors import HpcmemError
from ..ledger import AttemptRow, Ledger, Run
from ..runtime.metrics import merge_ranks, read_rank_files
from ..sites import Partition, load_site_file
from . import store
from .columns import COLUMNS
from .runner import bench_dir, read_manifest

VERSION_KEYS = ("torch", "deepspeed", "transformers", "cuda", "driver", "hpcmem")
PLAN_COLUMNS = ("launcher", "precision", "optimizer", "attention", "offload_optimizer", "offload_params",
                "micro_batch", "grad_accum", "world_size", "seq_len", "zero_stage", "checkpointing")
MEASURED = ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "peak_rss_mib", "samples_per_s",
            "step_time_s", "steps")


def manifests(home: Path | None = None) -> list[Path]:
    """Every manifest under ``$HPCMEM_HOME/bench/``, oldest night first."""
    return sorted(bench_dir(home).glob("*.json"))


def row_key(manifest: dict[str, Any], cell: dict[str, Any]) -> tuple[str, ...]:
    """The store KEY of a manifest cell (columns.KEY order)."""
    return manifest["night"], manifest["site"], cell["partition"], cell["model"], cell["technique"], manifest["matrix"]


def submitted_cells(home: Path | None = None) -> list[dict[str, Any]]:
    """Every cell a manifest meant to run (not skipped), as ``night, site, matrix, partition, model,
    technique, run_id, state`` (the manifest's status: submitted, submit_failed, planned = never
    submitted). The report compares them with the store to say which cells have no row yet.
    An unreadable manifest is left out (``collect`` names it as a problem)."""
    out = []
    for path in manifests(home):
        try:
            manifest = read_manifest(path)
        except HpcmemError:
            continue
        for cell in manifest["cells"]:
            if cell.get("status") != "skipped":
                out.append({"night": manifest["night"], "site": manifest["site"], "matrix": manifest["matrix"],
                            "partition": cell["partition"], "model": cell["model"], "technique": cell["technique"],
                            "run_id": cell.get("run_id") or "", "state": cell.get("status") or "planned"})
    return out


def attempt_metrics(attempt: AttemptRow) -> tuple[dict | None, bool]:
    """(metrics, from_file): the ledger's copy of metrics.json, else the file, else the merged rank files.

    ``from_file`` is False when only rank files were left (a job killed before rank 0 wrote metrics.json).
    """
    if attempt.metrics:
        return attempt.metrics, True
    found = runs.read_metrics(Path(attempt.attempt_dir))
    if found is not None:
        return found, True
    records = read_rank_files(attempt.attempt_dir)
    if records:
        world = max(int(r.get("world_size") or 1) for r in records)
        return merge_ranks(records, world, plan=attempt.plan), False
    return None, False


def row_status(run_state: str, metrics: dict | None, from_file: bool) -> str:
    """ok | failed | missing | incomplete, from how the run ended and what it left (pure)."""
    if run_state != "succeeded":
        return "failed"
    if metrics is None or not from_file:
        return "missing"
    if metrics.get("status") == "ok":
        return "ok"
    return "failed" if metrics.get("status") == "failed" else "incomplete"


def build_row(manifest: dict[str, Any], cell: dict[str, Any], run: Run, attempt: AttemptRow | None,
              metrics: dict | None, from_file: bool, predicted: Any, now: float) -> dict[str, Any]:
    """One results row (COLUMNS) for a finished cell (pure). ``predicted``: an Estimate or None."""
    plan = (attempt.plan if attempt else None) or cell.get("plan") or {}
    status = row_status(run.state, metrics, from_file)
    m = metrics or {}
    versions = m.get("versions") or {}
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(night=manifest["night"], site=manifest["site"], partition=cell["partition"], model=cell["model"],
               technique=cell["technique"], matrix=manifest["matrix"], plan_json=json.dumps(plan, sort_keys=True))
    row.update({k: plan.get(k) for k in PLAN_COLUMNS})
    row.update({k: versions.get(k) for k in VERSION_KEYS})
    row["gpu_name"] = m.get("gpu_name") or next((r.get("gpu_name") for r in (m.get("ranks") or {}).values()
                                                 if isinstance(r, dict) and r.get("gpu_name")), None)
    row.update({k: _number(m.get(k)) for k in MEASURED})
    row["status"] = status
    verdict = (attempt.verdict or {}) if attempt else {}
    row["verdict"] = "" if status == "ok" else (verdict.get("kind") or "unknown")
    row["error"] = "" if status == "ok" else _first_line(m.get("error") or run.reason
                                                         or ("no metrics.json" if status == "missing" else ""))
    if predicted is not None:
        row.update(predicted_peak_mib=predicted.peak_allocated_mib, predicted_device_mib=predicted.device_used_mib,
                   predicted_host_mib=predicted.host_mib_per_node)
    row.update(job_id=(attempt.job_id if attempt else None) or "", run_id=run.run_id, collected_at=now)
    return row


def skipped_row(manifest: dict[str, Any], cell: dict[str, Any], now: float) -> dict[str, Any]:
    """The row of a cell the matrix skipped on this partition (pure): status ``skipped``, the reason
    as ``error``, nothing measured, so the report can show it and never count it as a failure."""
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(night=manifest["night"], site=manifest["site"], partition=cell["partition"], model=cell["model"],
               technique=cell["technique"], matrix=manifest["matrix"], status="skipped", verdict="",
               error=_first_line(cell.get("reason") or "skipped"), job_id="", run_id="", collected_at=now)
    return row


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if value == value else None  # NaN -> None


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:500] if lines else ""


def predict(cell: dict[str, Any], partition: Partition | None):
    """The analytic estimate for the cell's plan and partition, or None when it cannot be made."""
    from ..estimate import estimate, model_ref
    from ..plan import Plan

    if partition is None or not cell.get("plan"):
        return None
    try:
        return estimate(model_ref(cell["config"], cell.get("task", "causal-lm"), cell.get("num_labels")),
                        Plan.from_dict(cell["plan"]), partition)
    except (HpcmemError, KeyError, TypeError, ValueError):
        return None


def _advance(ledger: Ledger, run_id: str, max_steps: int = 3) -> Run:
    """Tick a run; while the next step is ours (the job ended, the decision is due), take it now."""
    run = ledger.run(run_id)
    for _ in range(max_steps):
        if run.state in runs.TERMINAL_RUN_STATES:
            break
        try:
            run = controller.tick(ledger, run_id)
        except HpcmemError as exc:  # a scheduler hiccup: the controller recorded what it could; try next time
            ledger.add_event(run_id, None, f"bench collect: tick failed, will retry: {exc}")
            return ledger.run(run_id)
        last = ledger.attempts(run_id)[-1]
        if not runs.finished(last.state):
            break
    return run


def collect(ledger: Ledger, store_path: Path, home: Path | None = None,
            now: Callable[[], float] = time.time) -> dict[str, Any]:
    """One pass over every manifest: store the rows of finished cells; returns what happened.

    ``{"added": n, "rows": [new rows], "pending": [labels], "not_submitted": [labels],
    "skipped": n, "problems": [one line each], "store": path}``.
    """
    stored = store.keys(store_path)
    out: dict[str, Any] = {"added": 0, "rows": [], "pending": [], "not_submitted": [], "skipped": 0,
                           "problems": [], "store": str(store_path)}
    for path in manifests(home):
        try:
            manifest = read_manifest(path)
        except HpcmemError as exc:
            out["problems"].append(str(exc))
            continue
        rows = _manifest_rows(ledger, manifest, stored, out, now)
        if rows:
            out["added"] += store.append(store_path, rows)
            out["rows"] += rows
            stored |= {row_key(manifest, r) for r in rows}
    return out


def _manifest_rows(ledger: Ledger, manifest: dict, stored: set, out: dict, now) -> list[dict[str, Any]]:
    rows, partitions = [], _partitions(manifest)
    for cell in manifest["cells"]:
        label = "/".join(row_key(manifest, cell))
        if cell.get("status") == "skipped":
            out["skipped"] += 1
            if row_key(manifest, cell) not in stored:
                rows.append(skipped_row(manifest, cell, now()))
            continue
        if row_key(manifest, cell) in stored:
            continue
        if not cell.get("run_id"):
            out["not_submitted"].append(label)
            continue
        try:
            run = _advance(ledger, cell["run_id"])
        except HpcmemError as exc:
            out["problems"].append(f"{label}: {exc}")
            continue
        if run.state not in runs.TERMINAL_RUN_STATES:
            out["pending"].append(label)
            continue
        attempts = ledger.attempts(run.run_id)
        attempt = attempts[-1] if attempts else None
        metrics, from_file = attempt_metrics(attempt) if attempt else (None, False)
        rows.append(build_row(manifest, cell, run, attempt, metrics, from_file,
                              predict(cell, partitions.get(cell["partition"])), now()))
    return rows


def _partitions(manifest: dict) -> dict[str, Partition]:
    """The manifest site's partitions as loaded now (calibration applied); {} when the profile is gone."""
    try:
        return dict(load_site_file(Path(manifest["site_path"])).partitions)
    except (HpcmemError, KeyError, OSError):
        return {}


def collect_wait(ledger: Ledger, store_path: Path, home: Path | None = None, interval_s: float = 5.0,
                 timeout_s: float | None = None, on_pass: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Collect until no cell is pending (or ``timeout_s`` passes); the summary adds up every pass."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    total: dict[str, Any] | None = None
    while True:
        result = collect(ledger, store_path, home)
        if total is None:
            total = result
        else:
            total.update(added=total["added"] + result["added"], rows=total["rows"] + result["rows"],
                         pending=result["pending"], not_submitted=result["not_submitted"],
                         problems=result["problems"], skipped=result["skipped"])
        if on_pass:
            on_pass(result)
        if not result["pending"] or (deadline is not None and time.monotonic() > deadline):
            return total
        time.sleep(interval_s)
