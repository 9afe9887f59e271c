"""metrics.json: one record per rank, merged by rank 0 (shape in docs/architecture.md).

Pure parts: ``step_summary`` (timing of the steps after warm-up), ``merge_ranks``
(the job record from the rank records). Files: ``write_json_atomic``,
``read_rank_files``, ``collect`` (merge whatever rank files an attempt left, also
after the job was killed), ``attempt_rank_records`` (the rank records of an attempt, for
``toolkit/peaks.py``). Memory in MiB, time in seconds.

Each rank record carries ``step_peaks``: its bounded per-step series of sequence length and peak memory
(``peaks.SeriesRecorder``: at most ``peaks.SERIES_CAP`` evenly spaced steps, about 30 KB of JSON per rank
however long the run) and ``memory_snapshot``: the allocator snapshot it wrote on a CUDA OOM (else None).
metrics.json keeps them in ``ranks``; ``memory_snapshots`` lists the snapshot files of all ranks.
"""

from __future__ import annotations

import json
import math
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..files import write_atomic

METRICS_FILE = "metrics.json"
RANKS_DIR = "metrics"

# Per-rank memory figures merged as the max over ranks.
MEMORY_KEYS = ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "peak_rss_mib")

# Resume facts a rank records (rank 0's win): the step resumed from (None: a fresh start), the last complete
# save ({path, step}), how the resume went, the moves made inside the job.
RESUME_KEYS = ("resumed_from_step", "checkpoint", "resume", "inflight_moves")

STATUS_OK, STATUS_FAILED, STATUS_RUNNING, STATUS_INCOMPLETE = "ok", "failed", "running", "incomplete"


def rank_file(attempt_dir: str | os.PathLike, rank: int) -> Path:
    """``<attempt_dir>/metrics/rank-<rank>.json``."""
    return Path(attempt_dir) / RANKS_DIR / f"rank-{rank}.json"


def step_summary(durations_s: Sequence[float], samples: Sequence[int], warmup_steps: int) -> dict[str, Any]:
    """Mean step time and samples/s of the steps after the first ``warmup_steps``.

    When no step is left after warm-up, all steps are used (a short run still
    reports a figure); with no steps at all both are None.
    """
    timed = list(zip(durations_s, samples))
    if len(timed) > warmup_steps:
        timed = timed[warmup_steps:]
    total_s = sum(d for d, _ in timed)
    if not timed or total_s <= 0:
        return {"step_time_s": None, "samples_per_s": None, "timed_steps": 0}
    return {"step_time_s": total_s / len(timed), "samples_per_s": sum(n for _, n in timed) / total_s,
            "timed_steps": len(timed)}


def merge_ranks(records: Iterable[Mapping[str, Any]], world_size: int, plan: Mapping[str, Any] | None = None,
                applied: Mapping[str, Any] | None = None, versions: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The job's metrics.json from the per-rank records.

    Memory: max over ranks. samples_per_s: sum over ranks (each rank trains its own
    samples). step_time_s: the slowest rank. steps: the fewest any rank finished.
    loss: mean of the ranks' last finite losses. status: ``failed`` if any rank
    failed, ``ok`` if every rank of ``world_size`` finished, else ``incomplete``.
    ``versions`` defaults to the first rank record's; ``applied`` adds to the ranks'.
    """
    by_rank = {int(r["rank"]): dict(r) for r in records}
    ordered = [by_rank[k] for k in sorted(by_rank)]
    rank_versions = [r.pop("versions", None) for r in ordered]
    missing = [r for r in range(world_size) if r not in by_rank]
    failed = [r for r in ordered if r.get("status") == STATUS_FAILED]
    if failed:
        status = STATUS_FAILED
    elif not missing and all(r.get("status") == STATUS_OK for r in ordered):
        status = STATUS_OK
    else:
        status = STATUS_INCOMPLETE

    merged_applied: dict[str, Any] = {}
    for source in [r.get("applied") or {} for r in ordered] + [applied or {}]:
        for key, value in source.items():
            if key == "reasons":
                merged_applied.setdefault("reasons", {}).update(
                    {k: v for k, v in value.items() if k not in merged_applied["reasons"]})
            else:
                merged_applied.setdefault(key, value)

    losses = [r["loss"] for r in ordered if _finite(r.get("loss"))]
    rates = [r["samples_per_s"] for r in ordered if _finite(r.get("samples_per_s"))]
    times = [r["step_time_s"] for r in ordered if _finite(r.get("step_time_s"))]
    steps = [r.get("steps", 0) for r in ordered]
    out: dict[str, Any] = {
        "status": status,
        "error": _first_cause(failed),
        "device": ordered[0].get("device") if ordered else None,
        "world_size": world_size,
        "steps": min(steps) if steps else 0,
        "warmup_steps": ordered[0].get("warmup_steps", 0) if ordered else 0,
        "samples_per_s": sum(rates) if rates and len(rates) == len(ordered) else None,
        "step_time_s": max(times) if times else None,
        "loss": sum(losses) / len(losses) if losses else None,
    }
    for key in MEMORY_KEYS:
        values = [r[key] for r in ordered if _finite(r.get(key))]
        out[key] = max(values) if values else None
    # resume facts (docs/resume.md): rank 0's, else the first rank that has them
    for key in RESUME_KEYS:
        values = [r[key] for r in ordered if r.get(key) is not None]
        if any(key in r for r in ordered):
            out[key] = values[0] if values else None
    snapshots = [r["memory_snapshot"] for r in ordered if r.get("memory_snapshot")]
    if snapshots:
        out["memory_snapshots"] = snapshots
    if missing:
        out["missing_ranks"] = missing
    out["ranks"] = {str(r["rank"]): r for r in ordered}
    out["plan"] = dict(plan) if plan is not None else None
    out["applied"] = merged_applied
    out["versions"] = dict(versions) if versions is not None else next((v for v in rank_versions if v), {})
    return out


def _first_cause(failed: list[dict[str, Any]]) -> str | None:
    """The error that ended the job: a rank's own error before another's ``Terminated``
    (torchrun and the deepspeed launcher stop the other ranks when one fails)."""
    errors = [r.get("error") for r in failed if r.get("error")]
    own = [e for e in errors if not e.startswith("Terminated")]
    return (own or errors or [None])[0]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (``files.write_atomic``), creating its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_strict(data), indent=2, sort_keys=True, default=str, allow_nan=False) + "\n"
    return write_atomic(path, text)


def _strict(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity: a diverged loss is written as the text "nan"/"inf".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def read_rank_files(attempt_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every readable ``metrics/rank-*.json`` of an attempt (unreadable ones are skipped)."""
    out = []
    for path in sorted((Path(attempt_dir) / RANKS_DIR).glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "rank" in record:
            out.append(record)
    return out


def collect(attempt_dir: str | os.PathLike, world_size: int | None = None,
            plan: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Merge the rank files of an attempt into its metrics.json; None when there are none.

    ``plan`` defaults to the attempt's plan.json.

    Used by rank 0 at the end of a job and usable afterwards (a job killed by the
    host's OOM killer leaves its last periodic rank records, status ``running``).
    """
    records = read_rank_files(attempt_dir)
    if not records:
        return None
    if plan is None:
        plan = _read_plan_json(Path(attempt_dir) / "plan.json")
    if world_size is None:
        world_size = max(int(r.get("world_size") or 1) for r in records)
    merged = merge_ranks(records, world_size, plan=plan)
    write_json_atomic(Path(attempt_dir) / METRICS_FILE, merged)
    return merged


def attempt_rank_records(attempt_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rank records an attempt left: metrics.json's ``ranks`` when it has them, else the rank files (a job
    the OOM killer ended has only those). Empty when there are none."""
    try:
        merged = json.loads((Path(attempt_dir) / METRICS_FILE).read_text())
    except (OSError, ValueError):
        merged = None
    ranks = merged.get("ranks") if isinstance(merged, dict) else None
    if isinstance(ranks, dict) and ranks:
        return [r for r in ranks.values() if isinstance(r, dict)]
    return read_rank_files(attempt_dir)


def _read_plan_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def versions(packages: Sequence[str] = ("torch", "deepspeed", "transformers", "accelerate")) -> dict[str, Any]:
    """Installed versions of the training stack (read from package metadata, nothing imported)."""
    out: dict[str, Any] = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    from .. import __version__

    out["hpcmem"] = __version__
    return out
