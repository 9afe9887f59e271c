"""Runs: one ``hpcmem submit`` — where it lives, how it is recorded, how it is shown.

A run lives under ``$HPCMEM_HOME/runs/<run_id>/`` with one ``attempt-<n>/`` per
job. The controller (toolkit/controller.py) moves it forward; this module holds
what both the controller and the CLI need to find, lock and show it.
"""

from __future__ import annotations

import fcntl
import json
import secrets
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from . import render
from .backends.base import FINISHED_STATES
from .errors import HpcmemError
from .jobspec import JobSpec, load_spec
from .logtail import read_tail
from .ledger import AttemptRow, Ledger, Run
from .plan import Plan
from .resources import home_dir
from .sites import Partition, Site, load_site_file

TERMINAL_RUN_STATES = ("succeeded", "failed", "gave_up", "cancelled")


def open_ledger(home: Path | None = None) -> Ledger:
    return Ledger((home or home_dir()) / "ledger.sqlite")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def create_run(ledger: Ledger, spec: JobSpec, site: Site, partition: Partition, plan: Plan, *,
               home: Path | None = None, workdir: Path | None = None) -> Run:
    """Record a new run (state ``running``) and its first attempt (``planned``), after checking the plan can run."""
    partition.check_plan(plan)  # refuse what cannot run before anything is recorded
    render.check_program(spec)
    run_id = new_run_id()
    run_dir = (home or home_dir()) / "runs" / run_id
    run_dir.mkdir(parents=True)
    shutil.copyfile(spec.path, run_dir / "spec.yaml")
    now = time.time()
    run = Run(run_id=run_id, spec_path=str(spec.path), spec_name=spec.name, site=site.name, site_path=str(site.path),
              partition=partition.name, run_dir=str(run_dir), workdir=str(workdir or Path.cwd()), state="running",
              reason="", created=now, updated=now)
    ledger.add_run(run, plan.to_dict(), str(run_dir / "attempt-1"))
    return run


@contextmanager
def run_lock(run: Run, wait_s: float = 0.0) -> Iterator[bool]:
    """An exclusive lock on one run (a file lock in its directory): yields whether it was taken.

    One controller step at a time per run, across processes and hosts sharing the
    run directory; ``wait_s`` > 0 waits that long for it.
    """
    path = Path(run.run_dir) / ".lock"
    with open(path, "a") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_view(ledger: Ledger, run_id: str) -> dict[str, Any]:
    """A run as ``--json`` shows it."""
    run = ledger.run(run_id)
    return {"run_id": run.run_id, "run_dir": run.run_dir, "state": run.state, "reason": run.reason,
            "spec": run.spec_name, "site": run.site, "partition": run.partition,
            "attempts": [a.to_dict() for a in ledger.attempts(run_id)]}


def read_metrics(attempt_dir: Path) -> dict | None:
    """The attempt's metrics.json, or None when the job left none (or a broken one)."""
    try:
        return json.loads((attempt_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def load_site_for(run: Run) -> Site:
    """The site profile the run was submitted with."""
    return load_site_file(Path(run.site_path))


def spec_for(run: Run) -> JobSpec:
    return load_spec(run.spec_path)


def finished(state: str) -> bool:
    """An attempt state that will not change any more (ledger-only states count as unfinished)."""
    return state in FINISHED_STATES or state in ("submit_failed", "LOST")


def status_line(run: Run, attempts: list[AttemptRow]) -> str:
    """One line: run, attempt, job id, state, plan, and the job's last progress line while it runs."""
    if not attempts:
        return f"{run.run_id} {run.state}"
    a = attempts[-1]
    plan = render.plan_summary(Plan.from_dict(a.plan))
    line = f"{run.run_id} attempt {a.n} job {a.job_id or '-'} {a.state:<13} {plan}"
    progress = last_progress(Path(a.attempt_dir)) if a.state == "RUNNING" else ""
    return f"{line} | {progress}" if progress else line


def last_progress(attempt_dir: Path, max_bytes: int = 16384) -> str:
    """The last ``step N/M ...`` line a job printed (the reference trainer's progress), or ""."""
    for log in sorted(attempt_dir.glob("slurm-*.out"))[-1:]:
        try:
            text = read_tail(log, max_bytes).text
        except HpcmemError:
            return ""
        for line in reversed(text.splitlines()):
            if line.lstrip().startswith("step "):
                return line.strip()
    return ""
