"""Runs: one ``hpcmem submit`` — its directory, its attempts, following them.

A run lives under ``$HPCMEM_HOME/runs/<run_id>/`` with one ``attempt-<n>/`` per
Slurm job. Every step goes to the ledger before it is acted on.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from . import render
from .backends import get_backend
from .backends.base import FINISHED_STATES
from .classify import Verdict, classify, classify_paths
from .errors import HpcmemError
from .jobspec import JobSpec, load_spec
from .ledger import AttemptRow, Ledger, Run
from .plan import Plan
from .sites import Partition, Site, load_site_file

TERMINAL_RUN_STATES = ("succeeded", "failed", "gave_up", "cancelled")


def home_dir() -> Path:
    """Where hpcmem keeps its state: ``$HPCMEM_HOME`` or ``~/.hpcmem``."""
    return Path(os.environ.get("HPCMEM_HOME") or Path.home() / ".hpcmem").expanduser()


def open_ledger(home: Path | None = None) -> Ledger:
    return Ledger((home or home_dir()) / "ledger.sqlite")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def start_run(ledger: Ledger, spec: JobSpec, site: Site, partition: Partition, plan: Plan, *,
              home: Path | None = None, workdir: Path | None = None) -> Run:
    """Record a new run and submit its first attempt with ``plan``."""
    partition.check_plan(plan)  # refuse what cannot run before anything is recorded
    render.check_program(spec)
    run_id = new_run_id()
    run_dir = (home or home_dir()) / "runs" / run_id
    run_dir.mkdir(parents=True)
    shutil.copyfile(spec.path, run_dir / "spec.yaml")
    now = time.time()
    run = Run(run_id=run_id, spec_path=str(spec.path), spec_name=spec.name, site=site.name, site_path=str(site.path),
              partition=partition.name,
              run_dir=str(run_dir), workdir=str(workdir or Path.cwd()), state="running", reason="", created=now,
              updated=now)
    ledger.add_run(run)
    launch_attempt(ledger, run, 1, spec, site, partition, plan)
    return ledger.run(run_id)


def launch_attempt(ledger: Ledger, run: Run, n: int, spec: JobSpec, site: Site, partition: Partition, plan: Plan) -> str:
    """Render attempt ``n``, record it, submit it; returns the job id.

    A refusal by the scheduler marks the attempt ``submit_failed`` and the run
    ``failed`` with the scheduler's message, then re-raises.
    """
    attempt_dir = Path(run.run_dir) / f"attempt-{n}"
    try:
        render.render_attempt(spec, partition, plan, attempt_dir, run_id=run.run_id, attempt=n, workdir=Path(run.workdir))
    except HpcmemError as exc:
        ledger.set_run_state(run.run_id, "failed", f"attempt {n} could not be rendered: {exc}")
        raise
    ledger.add_attempt(run.run_id, n, plan.to_dict(), str(attempt_dir), partition.name)
    ledger.update_attempt(run.run_id, n, state="submitting")
    try:
        job_id = get_backend(site.scheduler).submit(attempt_dir / "job.sbatch", attempt_dir)
    except HpcmemError as exc:
        ledger.update_attempt(run.run_id, n, state="submit_failed")
        ledger.set_run_state(run.run_id, "failed", str(exc))
        raise
    ledger.update_attempt(run.run_id, n, job_id=job_id, state="PENDING", submitted=time.time())
    return job_id


def refresh(ledger: Ledger, run_id: str) -> Run:
    """Poll the scheduler once for the run's unfinished attempts and record what changed."""
    run = ledger.run(run_id)
    if run.state in TERMINAL_RUN_STATES:
        return run
    backend = get_backend(load_site_for(run).scheduler)
    live = [a for a in ledger.attempts(run_id) if a.job_id and not _finished(a.state)]
    if not live:
        return run
    statuses = backend.poll([a.job_id for a in live])
    for attempt in live:
        status = statuses.get(attempt.job_id)
        if status is None or status.state == attempt.state:
            continue
        fields: dict[str, Any] = {"state": status.state, "exit_code": status.exit_code}
        if status.finished:
            fields["finished"] = time.time()
            metrics = read_metrics(Path(attempt.attempt_dir))
            if metrics is not None:
                fields["metrics"] = metrics
            fields["verdict"] = attempt_verdict(Path(attempt.attempt_dir), status).to_dict()
        ledger.update_attempt(run_id, attempt.n, **fields)
        if status.finished:
            if status.succeeded:
                ledger.set_run_state(run_id, "succeeded")
            else:
                ledger.set_run_state(run_id, "failed", f"attempt {attempt.n} (job {attempt.job_id}) ended {status.state}"
                                     + (f" with exit code {status.exit_code}" if status.exit_code else ""))
    return ledger.run(run_id)


def follow(ledger: Ledger, run_id: str, *, interval_s: float = 2.0, on_change: Callable[[Run, list[AttemptRow]], None] | None = None,
           timeout_s: float | None = None) -> Run:
    """Refresh until the run ends (or ``timeout_s`` passes); call ``on_change`` on every refresh."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        run = refresh(ledger, run_id)
        if on_change:
            on_change(run, ledger.attempts(run_id))
        if run.state in TERMINAL_RUN_STATES or (deadline and time.monotonic() > deadline):
            return run
        time.sleep(interval_s)


def cancel_run(ledger: Ledger, run_id: str) -> Run:
    """Cancel what is in flight and mark the run cancelled."""
    run = ledger.run(run_id)
    if run.state in TERMINAL_RUN_STATES:
        return run
    live = [a for a in ledger.attempts(run_id) if a.job_id and not _finished(a.state)]
    if live:
        get_backend(load_site_for(run).scheduler).cancel([a.job_id for a in live])
        for a in live:
            ledger.update_attempt(run_id, a.n, state="CANCELLED", finished=time.time())
    ledger.set_run_state(run_id, "cancelled", "cancelled by the user")
    return ledger.run(run_id)


def run_view(ledger: Ledger, run_id: str) -> dict[str, Any]:
    """A run as ``--json`` shows it."""
    run = ledger.run(run_id)
    return {"run_id": run.run_id, "run_dir": run.run_dir, "state": run.state, "reason": run.reason,
            "spec": run.spec_name, "site": run.site, "partition": run.partition,
            "attempts": [a.to_dict() for a in ledger.attempts(run_id)]}


def attempt_verdict(attempt_dir: Path, status) -> Verdict:
    """Why an attempt ended: the classifier over its logs and the scheduler's record."""
    logs = sorted(attempt_dir.glob("slurm-*.out"))
    if not logs:
        return classify(status, "")
    return classify_paths(logs, record=status)


def read_metrics(attempt_dir: Path) -> dict | None:
    """The attempt's metrics.json, or None when the job left none (or a broken one)."""
    try:
        return json.loads((attempt_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def load_site_for(run: Run) -> Site:
    """The site profile the run was submitted with."""
    return load_site_file(Path(run.site_path))


def _finished(state: str) -> bool:
    """An attempt state that will not change any more (ledger-only states count as unfinished)."""
    return state in FINISHED_STATES or state == "submit_failed"


def status_line(run: Run, attempts: list[AttemptRow]) -> str:
    """One line: run, attempt, job id, state, plan."""
    if not attempts:
        return f"{run.run_id} {run.state}"
    a = attempts[-1]
    plan = render.plan_summary(Plan.from_dict(a.plan))
    return f"{run.run_id} attempt {a.n} job {a.job_id or '-'} {a.state:<13} {plan}"


def spec_for(run: Run) -> JobSpec:
    return load_spec(run.spec_path)

