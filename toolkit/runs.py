"""Runs: one ``hpcmem submit`` — where it lives, how it is recorded, how it is shown.

A run lives under ``$HPCMEM_HOME/runs/<run_id>/`` with one ``attempt-<n>/`` per
job. The controller (toolkit/controller.py) moves it forward; this module holds
what both the controller and the CLI need to find, lock and show it.

The run directory is the run's own record, enough to rebuild its ledger rows
(``hpcmem doctor --repair``) and to carry on without the user's files:

- ``spec.yaml``: the job spec as submitted, byte for byte. Later attempts read this copy,
  never the user's file (``spec_for``), so editing or deleting that file changes nothing.
- ``run.json``: where the spec came from and what its relative paths meant when it was
  submitted (spec directory, absolute script, model config), the site and partition, the
  working directory.
- ``site.json``: the site profile as resolved at submission (every partition, ``auto`` values and calibration
  applied). Later attempts and their partitions come from it (``load_site_for``), never the site file again.
- ``attempt-<n>/attempt.json``: the attempt's partition, plan and the decision that chose it.
- ``end.json``: the run's final state and reason, once it has one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import secrets
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from . import __version__, render
from .backends.base import FINISHED_STATES
from .errors import ConfigError, HpcmemError, LedgerError
from .files import write_atomic
from .jobspec import JobSpec, fill_placeholders, load_spec
from .logtail import read_tail
from .ledger import AttemptRow, Ledger, Run
from .plan import Plan
from .resources import home_dir
from .files import read_small_text
from .sites import Partition, Site, load_site_file, site_from_record, site_record
from .templating import safe_text

TERMINAL_RUN_STATES = ("succeeded", "failed", "gave_up", "cancelled")


RUN_RECORD, END_RECORD, ATTEMPT_RECORD, SPEC_COPY = "run.json", "end.json", "attempt.json", "spec.yaml"
SITE_RECORD = "site.json"
RECORD_LIMIT = 64 * 2**20
"""Largest JSON record read from a run directory (run.json, site.json, metrics.json, ...): they are kilobytes."""


def open_ledger(home: Path | None = None) -> Ledger:
    home = home or home_dir()
    if home.exists() and not home.is_dir():
        raise LedgerError(f"HPCMEM_HOME {home} is not a directory; point HPCMEM_HOME at a directory (or unset it "
                          "for ~/.hpcmem)")
    return Ledger(home / "ledger.sqlite")


@dataclasses.dataclass(frozen=True)
class RecordedSpec(JobSpec):
    """A job spec read from a run's copy: its relative paths mean what they meant when it was submitted."""

    origin_dir: Path | None = None
    """The directory of the user's spec file at submission (``{spec_dir}`` and relative paths)."""

    @property
    def spec_dir(self) -> Path:
        return self.origin_dir or self.path.parent


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
    shutil.copyfile(spec.path, run_dir / SPEC_COPY)
    write_atomic(run_dir / SITE_RECORD, json.dumps(site_record(site, partition), indent=2) + "\n")
    now = time.time()
    run = Run(run_id=run_id, spec_path=str(spec.path), spec_name=spec.name, site=site.name, site_path=str(site.path),
              partition=partition.name, run_dir=str(run_dir), workdir=str(workdir or Path.cwd()), state="running",
              reason="", created=now, updated=now)
    write_atomic(run_dir / RUN_RECORD, json.dumps({**run_record(run, spec), "first_plan": plan.to_dict()}, indent=2)
                 + "\n")
    ledger.add_run(run, plan.to_dict(), str(run_dir / "attempt-1"))
    return run


def run_record(run: Run, spec: JobSpec) -> dict[str, Any]:
    """``run.json``: the run's ledger row as created, plus what the spec's relative paths meant."""
    return {
        "run_id": run.run_id, "spec_name": run.spec_name, "spec_path": run.spec_path,
        "spec_dir": str(Path(spec.spec_dir).resolve()), "script": str(spec.script) if spec.script else None,
        "model_config": _model_config_as_submitted(spec, Path(run.workdir)),
        "site": run.site, "site_path": run.site_path, "partition": run.partition, "workdir": run.workdir,
        "created": run.created, "hpcmem": __version__,
    }


def _model_config_as_submitted(spec: JobSpec, workdir: Path) -> str | None:
    """The spec's model config with ``{spec_dir}`` filled in; a relative path made absolute (against the
    working directory, as the estimator reads it, else the spec's directory); a name stays a name."""
    name = (spec.model or {}).get("config")
    if not name:
        return None
    try:
        name = fill_placeholders(str(name), {"spec_dir": str(spec.spec_dir)}, spec.path)
    except HpcmemError:
        return str(name)
    path = Path(name).expanduser()
    if path.is_absolute():
        return str(path)
    for base in (workdir, Path(spec.spec_dir)):
        if (base / path).exists():
            return str((base / path).resolve())
    return name


def load_record(path: Path, limit: int = RECORD_LIMIT) -> Any:
    """A JSON record hpcmem wrote (``run.json``, ``site.json``, ``metrics.json``, ...), read as hostile input: a
    regular file (a FIFO is never waited on) of at most ``limit`` bytes, parsed with its nesting bounded by
    Python's recursion limit. ``FileNotFoundError`` when there is none; anything unreadable (not a regular file,
    too big, not UTF-8, not JSON, nested too deeply) is a one-line ``LedgerError`` naming the file."""
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(str(path))
    try:
        return json.loads(read_small_text(path, "", limit))
    except ConfigError as exc:
        raise LedgerError(f"{path} is unreadable ({str(exc).removeprefix(f'{path}: ')})") from None
    except ValueError as exc:  # also Python's limit on an integer's digits
        raise LedgerError(f"{path} is unreadable (not valid JSON: {exc})") from None
    except RecursionError:
        raise LedgerError(f"{path} is unreadable (not valid JSON: nested too deeply)") from None


def read_run_record(run_dir: Path) -> dict | None:
    """A run directory's ``run.json`` (None when absent: a run made by an older hpcmem); damaged: an error."""
    path = Path(run_dir) / RUN_RECORD
    try:
        data = load_record(path)
    except FileNotFoundError:
        return None
    except LedgerError as exc:
        raise LedgerError(f"{exc}; see `hpcmem doctor`") from None
    if not isinstance(data, dict):
        raise LedgerError(f"{path} is damaged (not a JSON object); see `hpcmem doctor`")
    return data


def end_run(ledger: Ledger, run: Run, state: str, reason: str = "") -> None:
    """Record a run's final state: the ledger first, then ``end.json`` in its directory (for a rebuild)."""
    ledger.set_run_state(run.run_id, state, reason)
    try:
        write_atomic(Path(run.run_dir) / END_RECORD,
                     json.dumps({"state": state, "reason": reason, "at": time.time()}, indent=2) + "\n")
    except OSError:
        pass  # the ledger holds it; only a rebuild would miss it


def write_attempt_record(attempt: AttemptRow) -> None:
    """``attempt.json``: what the ledger knows of an attempt before it is submitted (for a rebuild)."""
    write_atomic(Path(attempt.attempt_dir) / ATTEMPT_RECORD, json.dumps(
        {"run_id": attempt.run_id, "n": attempt.n, "partition": attempt.partition, "plan": attempt.plan,
         "decision": attempt.decision, "created": attempt.created}, indent=2) + "\n")


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
            "attempts": [{**a.to_dict(), **resume_facts(a)} for a in ledger.attempts(run_id)]}


def resume_facts(attempt: AttemptRow) -> dict[str, Any]:
    """``resumed_from_step``, ``checkpoint`` ({path, step} of its last complete save) and ``inflight_moves`` of an
    attempt (docs/resume.md): from its recorded metrics, else from the rank files a killed job left."""
    sources = [attempt.metrics] if isinstance(attempt.metrics, dict) else []
    if not any("checkpoint" in s for s in sources):
        from .runtime.metrics import read_rank_files

        try:
            ranks = read_rank_files(Path(attempt.attempt_dir))
        except (RecursionError, OSError):  # a rank file nested too deeply to parse: shown as if there were none
            ranks = []
        sources += sorted(ranks, key=lambda r: r["rank"] if _is_number(r.get("rank")) else 0)
    out: dict[str, Any] = {"resumed_from_step": None, "checkpoint": None, "inflight_moves": None}
    for key in out:
        out[key] = next((s[key] for s in sources if s.get(key) is not None), None)
    return out


def resume_lines(attempt: Mapping[str, Any]) -> list[str]:
    """What ``hpcmem runs`` prints under an attempt about its checkpoints and in-job moves (from ``run_view``),
    terminal-safe (``templating.safe_text``: the metrics come from files a job wrote)."""
    lines = []
    if attempt.get("resumed_from_step") is not None:
        lines.append(f"resumed from step {attempt['resumed_from_step']}")
    saved = attempt.get("checkpoint")
    if isinstance(saved, Mapping) and saved.get("step") is not None:
        lines.append(f"last checkpoint: step {saved['step']} {saved.get('path', '')}".rstrip())
    from .runtime.inflight import move_text

    moves = attempt.get("inflight_moves")
    lines += [move_text(m) for m in (moves if isinstance(moves, (list, tuple)) else ()) if isinstance(m, Mapping)]
    return [safe_text(line) for line in lines]


def views_text(views: list[Mapping[str, Any]]) -> str:
    """``hpcmem runs`` as text: each run (``run_view``) in a line, its attempts under it. Every recorded value is
    made terminal-safe (``templating.safe_text``: an escape sequence, a newline or a bidirectional override in a
    ledger field is shown escaped, never sent to the terminal); odd values (a peak that is not a number, moves
    that are not a list) are shown as they are or left out, never a traceback."""
    out = []
    for v in views:
        line = (f"{safe_text(v['run_id'])}  {safe_text(v['state']):<10} {safe_text(v['spec'])} on "
                f"{safe_text(v['site'])}:{safe_text(v['partition'])}")
        out.append(line + (f"  ({safe_text(v['reason'])})" if v["reason"] else ""))
        for a in v["attempts"]:
            metrics, verdict, decision = (a.get(k) if isinstance(a.get(k), Mapping) else {}
                                          for k in ("metrics", "verdict", "decision"))
            peak = metrics.get("peak_rss_mib")
            kind = verdict.get("kind")
            moves = decision.get("moves")
            moves = ", ".join(map(str, moves)) if isinstance(moves, (list, tuple)) else ""
            out.append(f"  attempt {safe_text(a['n'])}: job {safe_text(a['job_id'] or '-')} {safe_text(a['state'])}"
                       + (f" [{safe_text(kind)}]" if kind else "")
                       + (f" peak_rss={peak:.0f}MiB" if _is_number(peak) and math.isfinite(peak) and peak else "")
                       + (f" after: {safe_text(moves)}" if moves else "") + f"  {safe_text(a['attempt_dir'])}")
            out += [f"    {line}" for line in resume_lines(a)]
    return "".join(f"{line}\n" for line in out)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(attempt_dir: Path) -> dict | None:
    """The attempt's metrics.json, or None when the job left none (or a broken one: unreadable, not a JSON
    object, nested too deeply)."""
    try:
        data = load_record(Path(attempt_dir) / "metrics.json")
    except (OSError, LedgerError):
        return None
    return data if isinstance(data, dict) else None


def load_site_for(run: Run) -> Site:
    """The site profile as the run recorded it at submission (``site.json``), never the site file again: editing
    or deleting that file changes nothing for a run already submitted. A run made before hpcmem recorded it
    reads its site file, as it did then."""
    return recorded_site(Path(run.run_dir), run.site_path)


def recorded_site(run_dir: Path, site_path: str) -> Site:
    """``load_site_for`` from a run directory and its recorded site path (also for ``hpcmem doctor``, which
    rebuilds runs from their directories)."""
    path = Path(run_dir) / SITE_RECORD
    try:
        data = load_record(path)
    except FileNotFoundError:
        return load_site_file(Path(site_path))
    except LedgerError as exc:
        raise LedgerError(f"{exc}; see `hpcmem doctor`") from None
    try:
        return site_from_record(data, str(path))
    except ConfigError as exc:
        raise LedgerError(f"{exc}; see `hpcmem doctor`") from None


def spec_for(run: Run) -> JobSpec:
    """The job spec as recorded with the run (``runs/<id>/spec.yaml``), never the user's file: its
    ``{spec_dir}``, relative script and model config resolve as they did at submission."""
    copy = Path(run.run_dir) / SPEC_COPY
    if not copy.is_file():
        raise ConfigError(f"run {run.run_id}: its recorded spec {copy} is missing, so its next attempt cannot be "
                          "planned; see `hpcmem doctor`")
    spec = load_spec(copy)
    record = read_run_record(Path(run.run_dir)) or {}
    origin = Path(record.get("spec_dir") or Path(run.spec_path).parent)
    script = spec.script
    if record.get("script"):
        script = Path(record["script"])
    elif script is not None and script.is_relative_to(copy.parent):  # an older run: relative to the user's directory
        script = origin / script.relative_to(copy.parent)
    model = dict(spec.model or {})
    if record.get("model_config") and model.get("config"):
        model["config"] = record["model_config"]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(JobSpec)}
    return RecordedSpec(**{**fields, "script": script, "model": model}, origin_dir=origin)


def finished(state: str) -> bool:
    """An attempt state that will not change any more (ledger-only states count as unfinished)."""
    return state in FINISHED_STATES or state in ("submit_failed", "LOST")


def status_line(run: Run, attempts: list[AttemptRow]) -> str:
    """One line: run, attempt, job id, state, plan, and the job's last progress line while it runs."""
    if not attempts:
        return safe_text(f"{run.run_id} {run.state}")
    a = attempts[-1]
    plan = render.plan_summary(Plan.from_dict(a.plan))
    line = f"{run.run_id} attempt {a.n} job {a.job_id or '-'} {a.state:<13} {plan}"
    progress = last_progress(Path(a.attempt_dir)) if a.state == "RUNNING" else ""
    return safe_text(f"{line} | {progress}" if progress else line)  # ledger fields and a job's log line


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
