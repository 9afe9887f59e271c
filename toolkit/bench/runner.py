"""``bench run``: one fixed-plan run per cell, submitted through the normal path, and the night's manifest.

Each cell becomes a run in the ledger like any ``hpcmem submit`` (``runs.create_run`` then
``controller.tick``: the same rendering, submission and classification), from a job spec
written for the cell with ``retry: {max_attempts: 1, allow: []}``: the plan is the
measurement, so nothing is retried or changed.

The manifest ``$HPCMEM_HOME/bench/<night>-<matrix>-<site>.json`` lists every cell (run id, or
why it was skipped); it is rewritten atomically after each run is recorded and before it is
submitted, so ``bench collect`` finds every submitted cell. Running ``bench run`` again for the
same night resumes: cells that already have a run are not submitted again.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from .. import controller, runs
from ..errors import ConfigError, HpcmemError
from ..jobspec import load_spec
from ..ledger import Ledger
from ..plan import Plan
from ..resources import home_dir
from ..runtime.metrics import write_json_atomic
from ..sites import Site, format_minutes
from .matrix import Cell, Matrix, expand

MANIFEST_VERSION = 1
_NIGHT = re.compile(r"\d{4}-\d{2}-\d{2}")


def bench_dir(home: Path | None = None) -> Path:
    """``$HPCMEM_HOME/bench``: manifests, cell specs and (by default) the results store."""
    return (home or home_dir()) / "bench"


def parse_night(text: str | None, option: str = "--night") -> str:
    """``YYYY-MM-DD`` (checked; ``option`` names the flag in the error), or today's local date when None."""
    if text is None:
        return dt.date.today().isoformat()
    if not _NIGHT.fullmatch(text):
        raise ConfigError(f"{option} {text!r}: expected a date YYYY-MM-DD")
    try:
        dt.date.fromisoformat(text)
    except ValueError as exc:
        raise ConfigError(f"{option} {text!r}: {exc}") from exc
    return text


def manifest_path(home: Path, night: str, matrix: str, site: str) -> Path:
    return bench_dir(home) / f"{night}-{matrix}-{site}.json"


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest as written by ``bench run`` (a broken one is an error naming it: nothing is overwritten)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HpcmemError(f"bench manifest {path} is not readable: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise HpcmemError(f"bench manifest {path}: no 'cells' list")
    return data


def cell_key(cell: dict[str, Any]) -> tuple[str, str, str]:
    return cell["partition"], cell["model"], cell["technique"]


def cell_spec(matrix: Matrix, cell: Cell, night: str, site: Site) -> dict[str, Any]:
    """The job spec document of one cell: the reference trainer, the cell's plan, no retry (pure)."""
    plan, model = cell.plan, cell.model
    training = {k: v for k, v in plan.to_dict().items()
                if k in ("global_batch", "micro_batch", "seq_len", "precision", "optimizer", "checkpointing",
                         "attention", "zero_stage", "offload_optimizer", "offload_params", "alloc_conf", "workers")}
    spec = {
        "name": f"bench.{model.name}.{cell.technique}",
        "description": f"bench {matrix.name} {night} {site.name}:{cell.partition} {model.name} {cell.technique}",
        "command": {"module": "toolkit.train",
                    "args": ["--model", model.config, "--task", model.task, "--steps", str(matrix.steps),
                             "--warmup-steps", str(matrix.warmup_steps)]},
        "launcher": plan.launcher, "nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node,
        "time": format_minutes(plan.time_min), "mem_mib": plan.mem_mib,
        "model": {"config": model.config, "task": model.task},
        "training": training,
        "retry": {"max_attempts": 1, "allow": []},
    }
    if model.num_labels is not None:
        spec["model"]["num_labels"] = model.num_labels
    return spec


def run_matrix(ledger: Ledger, matrix: Matrix, site: Site, *, partition: str | None = None, only: str | None = None,
               night: str | None = None, home: Path | None = None) -> dict[str, Any]:
    """Submit every cell of ``matrix`` on ``site`` not yet submitted this night; returns the manifest.

    A cell the scheduler refuses is recorded with the reason (its run is failed in the ledger and
    collected as a failed row); the other cells still go.
    """
    home = home or home_dir()
    night = parse_night(night)
    cells = expand(matrix, site, partition, only)
    if not cells:
        raise ConfigError(f"matrix {matrix.name}: no cell on {site.name}" + (f" matches --only {only!r}" if only else ""))
    path = manifest_path(home, night, matrix.name, site.name)
    with _manifest_lock(path):
        return _run_cells(ledger, matrix, site, cells, path, night, home)


@contextmanager
def _manifest_lock(path: Path) -> Iterator[None]:
    """One ``bench run`` per manifest at a time (two at once would submit the same cells twice)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HpcmemError(f"another `hpcmem bench run` is submitting {path.name}; try again when it is done") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_cells(ledger: Ledger, matrix: Matrix, site: Site, cells: list[Cell], path: Path, night: str,
               home: Path) -> dict[str, Any]:
    manifest = read_manifest(path) if path.exists() else {
        "version": MANIFEST_VERSION, "night": night, "matrix": matrix.name, "matrix_path": str(matrix.path),
        "site": site.name, "site_path": str(site.path), "steps": matrix.steps, "warmup_steps": matrix.warmup_steps,
        "created": time.time(), "cells": []}
    known = {cell_key(c): c for c in manifest["cells"]}
    for cell in cells:
        entry = known.get((cell.partition, cell.model.name, cell.technique))
        if entry is None:
            entry = _entry(cell)
            manifest["cells"].append(entry)
            known[cell_key(entry)] = entry
        if entry.get("run_id") or cell.plan is None:
            continue
        _submit_cell(ledger, matrix, cell, entry, manifest, path, night, site, home)
    write_json_atomic(path, manifest)
    manifest["path"] = str(path)
    return manifest


def _entry(cell: Cell) -> dict[str, Any]:
    m = cell.model
    return {"partition": cell.partition, "model": m.name, "technique": cell.technique, "config": m.config,
            "task": m.task, "num_labels": m.num_labels, "plan": cell.plan.to_dict() if cell.plan else None,
            "status": "skipped" if cell.plan is None else "planned", "reason": cell.skip, "run_id": None}


def _submit_cell(ledger: Ledger, matrix: Matrix, cell: Cell, entry: dict, manifest: dict, path: Path, night: str,
                 site: Site, home: Path) -> None:
    spec_file = bench_dir(home) / "specs" / f"{night}-{matrix.name}-{site.name}" / \
        f"{cell.partition}.{cell.model.name}.{cell.technique}.yaml"
    run_id = _adopt(ledger, spec_file)  # a run recorded just before a crash, before the manifest said so
    if run_id is None:
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        spec_file.write_text(yaml.safe_dump(cell_spec(matrix, cell, night, site), sort_keys=False))
        run = runs.create_run(ledger, load_spec(spec_file), site, site.partition(cell.partition),
                              Plan.from_dict(entry["plan"]), home=home)
        run_id = run.run_id
    entry.update(run_id=run_id, status="submitted", spec=str(spec_file))
    write_json_atomic(path, manifest)  # durable before the job exists
    try:
        controller.tick(ledger, run_id)
    except HpcmemError as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        still = ledger.run(run_id).state == "running"  # "may or may not have been submitted": the next tick looks
        entry.update(status="submitted" if still else "submit_failed", reason=reason)
    attempt = ledger.attempts(run_id)[-1]
    entry["job_id"] = attempt.job_id


def _adopt(ledger: Ledger, spec_file: Path) -> str | None:
    if not spec_file.exists():
        return None
    mine = [r for r in ledger.runs() if Path(r.spec_path) == spec_file.resolve()]
    return mine[-1].run_id if mine else None
