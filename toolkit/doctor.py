"""``hpcmem doctor``: check an hpcmem home, and repair what its run directories can repair.

What it checks under ``$HPCMEM_HOME``:

- **the home**: a directory (not a file);
- **the ledger**: it opens, sqlite's integrity check passes, every row reads (JSON, schema version);
  a missing or empty ledger beside run directories was lost;
- **run directories**: each one has its ledger row (an *orphan* has none), each row its directory;
- **locks and leftovers**: run locks held right now (a controller at work), temporary files that a
  killed writer left behind;
- **unfinished attempts**: running runs and where their last attempt stands (``planned``,
  ``submitting``, in the queue), and local jobs whose runner never started;
- **calibration files**: ``calibration/*.calibration.yaml`` read as ``calibrate`` writes them.

``--repair`` (``doctor(home, repair=True)``):

- a lost or damaged ledger is rebuilt from the run directories (``run.json``, ``spec.yaml``,
  ``attempt-<n>/attempt.json`` and ``plan.json``, the job ids their logs and results name, ``metrics.json``,
  ``end.json``; the jobs' states are asked of the run's scheduler once per run) into a new file beside it,
  which replaces it only once the rebuild is complete: the old one is moved aside
  (``ledger.sqlite.damaged-<time>``, never deleted). A rebuild that fails part-way, or that could record
  none of the run directories there are, leaves the home as it was (the lost-ledger guard stays armed);
- orphaned run directories are added to a sound ledger the same way;
- leftover temporary files older than a minute are removed;
- local jobs whose runner never started are settled (BOOT_FAIL, so their run can go on).

A rebuilt run that had not ended is ``running`` again: ``hpcmem tick`` polls its last job, or,
when that attempt had no job yet, looks it up by name before submitting it. A run directory
with no attempt is recorded as failed: nothing was submitted, and a rebuild submits nothing
on its own. Everything done is said in the report.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import runs
from .errors import HpcmemError, LedgerError
from .ledger import Ledger, Run, run_dirs_beside
from .templating import safe_text

LEVELS = ("ok", "info", "warn", "error", "fixed")
_TMP_AGE_S = 60.0
_REBUILDING = ".rebuilding-"
"""``ledger.sqlite.rebuilding-<pid>``: the ledger a repair is rebuilding, put in place once complete."""
_LOCAL_ID = re.compile(r"^(local-[0-9]{1,18})\.json$")
_LOCAL_JOB = re.compile(r"^local-[0-9]{1,18}$")
_SLURM_LOG = re.compile(r"^slurm-([0-9]{1,18}(?:_[0-9]{1,18})?)\.out$")
_ATTEMPT = re.compile(r"^attempt-([1-9][0-9]{0,8})$")
"""Names a run directory holds, in ASCII digits of bounded length (``int`` of them is exact and small)."""


@dataclass(frozen=True)
class Finding:
    check: str
    """home, ledger, runs, locks, attempts, local, calibration"""
    level: str
    """ok, info, warn, error; fixed: a problem --repair repaired"""
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "level": self.level, "message": self.message}


@dataclass
class DoctorReport:
    home: str
    repair: bool
    findings: list[Finding] = field(default_factory=list)
    imported: set[str] = field(default_factory=set)
    """Run directories a repair already tried to record (each is tried and reported once)."""

    def add(self, check: str, level: str, message: str) -> None:
        self.findings.append(Finding(check, level, message))

    @property
    def healthy(self) -> bool:
        """No problem is left: nothing at warn or error level."""
        return not any(f.level in ("warn", "error") for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"home": self.home, "repair": self.repair, "healthy": self.healthy,
                "findings": [f.to_dict() for f in self.findings]}

    def text(self) -> str:
        """The report for a terminal: every message made ``safe_text`` (run directory names and ledger fields
        are anyone's text: an escape sequence or a bidirectional override is shown escaped, never sent)."""
        lines = [f"hpcmem home {safe_text(self.home)}"]
        lines += [f"{f.level:<5} {f.check}: {safe_text(f.message)}" for f in self.findings]
        if not self.healthy and not self.repair:
            lines.append("hpcmem doctor --repair repairs what the run directories can repair")
        return "\n".join(lines) + "\n"


def doctor(home: Path, *, repair: bool = False) -> DoctorReport:
    """Check ``home`` (and repair it with ``repair``); the report says what was found and done."""
    home = Path(home)
    report = DoctorReport(str(home), repair)
    if not home.exists():
        report.add("home", "ok", "does not exist yet (nothing submitted from here)")
        return report
    if not home.is_dir():
        report.add("home", "error", "HPCMEM_HOME is not a directory; point it at a directory (or unset it for ~/.hpcmem)")
        return report
    ledger = _check_ledger(home, report, repair)
    try:
        if ledger is not None:
            _check_run_dirs(home, ledger, report, repair)
            _check_attempts(ledger, report)
        _check_leftovers(home, report, repair)
        _check_local(home, report, repair)
        _check_calibration(home, report)
    finally:
        if ledger is not None:
            ledger.close()
    return report


# ---------------------------------------------------------------- the ledger


def _check_ledger(home: Path, report: DoctorReport, repair: bool) -> Ledger | None:
    path = home / "ledger.sqlite"
    problems: list[str] = []
    ledger = None
    try:
        ledger = Ledger(path)
        problems = ledger.check()
    except LedgerError as exc:
        problems = [str(exc)]
    if not problems:
        count = len(ledger.runs())
        report.add("ledger", "ok", f"{path.name} is sound ({count} run{'' if count == 1 else 's'})")
        return ledger
    if ledger is not None:
        ledger.close()
    for problem in problems[:5]:
        report.add("ledger", "error", problem)
    if not repair:
        return None
    return _rebuild_ledger(home, path, report)


def _rebuild_ledger(home: Path, path: Path, report: DoctorReport) -> Ledger | None:
    """Rebuild the ledger at ``path`` from the run directories into a new file beside it, and put that in
    place (the old one moved aside, kept) only once every directory was tried and at least one was recorded
    (or there is none). A crash part-way, or a rebuild that recorded nothing from the directories there are,
    leaves the home as it was: no new, emptier ledger hides the runs (a missing or empty ledger stays lost)."""
    dirs = run_dirs_beside(path)
    fresh = path.with_name(f"{path.name}{_REBUILDING}{os.getpid()}")
    installed = False
    try:
        _remove_sqlite(fresh)  # what a killed repair with this process id left
        new = Ledger(fresh, rebuilding=True)
        try:
            rebuilt = _import_dirs(home, new, dirs, report)
            new.db.execute("PRAGMA journal_mode=DELETE")  # one self-contained file to move into place
        finally:
            new.close()
        if dirs and not rebuilt:
            which = ("the run directory could not" if len(dirs) == 1
                     else f"none of the {len(dirs)} run directories could")
            report.add("ledger", "error", f"{which} be rebuilt (see above), so {path.name} was left as it was; "
                                          "fix or move away the directories named above and repair again")
            return None
        aside = _install(fresh, path)
        installed = True
    except (LedgerError, OSError, sqlite3.DatabaseError) as exc:  # the home cannot be written, say
        report.add("ledger", "error", f"cannot rebuild {path.name} ({getattr(exc, 'strerror', None) or exc}); "
                                      "it was left as it was")
        return None
    finally:
        if not installed:
            try:
                _remove_sqlite(fresh)
            except OSError:
                pass
    if aside:
        report.add("ledger", "fixed", f"moved the damaged ledger to {aside.name} (kept, not deleted)")
    report.add("ledger", "fixed", f"rebuilt {path.name} from {rebuilt} run director{'y' if rebuilt == 1 else 'ies'}")
    return Ledger(path)


def _install(fresh: Path, path: Path) -> Path | None:
    """Move the ledger at ``path`` aside (with its -wal and -shm) and ``fresh`` into its place; the name it was
    moved to (None when there was none). If ``fresh`` cannot be put in place, the old one is put back."""
    aside = _move_aside(path)
    try:
        os.replace(fresh, path)
    except OSError:
        if aside:
            _move_sqlite(aside, path)
        raise
    return aside


def _move_aside(path: Path) -> Path | None:
    if not any(os.path.lexists(f"{path}{suffix}") for suffix in ("", "-wal", "-shm")):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while any(os.path.lexists(f"{aside}{suffix}") for suffix in ("", "-wal", "-shm")):  # never over an older one
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    _move_sqlite(path, aside)
    return aside


def _move_sqlite(source: Path, target: Path) -> None:
    """Rename a sqlite file with its -wal and -shm (the write-ahead log belongs to its file: left behind, it
    would be played into the next file of that name)."""
    for suffix in ("", "-wal", "-shm"):
        side = Path(f"{source}{suffix}")
        if os.path.lexists(side):
            side.rename(Path(f"{target}{suffix}"))


def _remove_sqlite(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


# ---------------------------------------------------------------- run directories


def _check_run_dirs(home: Path, ledger: Ledger, report: DoctorReport, repair: bool) -> None:
    recorded = {r.run_id: r for r in ledger.runs()}
    dirs = run_dirs_beside(ledger.path)
    orphans = [d for d in dirs if d.name not in recorded]
    for run in recorded.values():
        if not Path(run.run_dir).is_dir():
            report.add("runs", "warn", f"run {run.run_id} is in the ledger but its directory {run.run_dir} is gone")
        elif not (Path(run.run_dir) / runs.SPEC_COPY).is_file() and run.state == "running":
            report.add("runs", "error", f"run {run.run_id} is running but its recorded spec "
                                        f"{Path(run.run_dir) / runs.SPEC_COPY} is gone: its next attempt cannot be planned")
    if not orphans:
        report.add("runs", "ok", f"{len(dirs)} run director{'y' if len(dirs) == 1 else 'ies'}, each in the ledger")
        return
    for d in orphans:
        if str(d) not in report.imported:
            report.add("runs", "warn", f"run directory {d} has no ledger row (orphaned)")
    if repair:
        _import_dirs(home, ledger, orphans, report)


def _import_dirs(home: Path, ledger: Ledger, dirs: list[Path], report: DoctorReport) -> int:
    done = 0
    for run_dir in dirs:
        if str(run_dir) in report.imported:
            continue
        report.imported.add(str(run_dir))
        try:
            run, attempts, note = rebuild_run(run_dir, home)
        except (HpcmemError, OSError, RecursionError) as exc:  # an unreadable directory, a record nested too deeply
            report.add("runs", "error", f"cannot rebuild {run_dir.name}: {_reason(exc)}")
            continue
        try:
            ledger.import_run(run, attempts, [f"rebuilt by hpcmem doctor from {run_dir}"])
        except sqlite3.IntegrityError:
            report.add("runs", "error", f"cannot rebuild {run_dir.name}: run {run.run_id} (its {runs.RUN_RECORD}) is "
                                        "already recorded from another directory")
            continue
        except (LedgerError, RecursionError, ValueError) as exc:  # a plan or metrics nested too deeply to store
            report.add("runs", "error", f"cannot rebuild {run_dir.name}: {_reason(exc)}")
            continue
        done += 1
        report.add("runs", "fixed", f"recorded run {run.run_id} ({run.state}, {len(attempts)} attempt"
                                    f"{'' if len(attempts) == 1 else 's'}){': ' + note if note else ''}")
    return done


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "a record in it is nested too deeply"
    if isinstance(exc, OSError):
        return f"it cannot be read ({exc.strerror or exc})"
    return str(exc)


def rebuild_run(run_dir: Path, home: Path) -> tuple[Run, list[dict], str]:
    """A run's ledger row and attempt rows from its directory, with a note on what could not be known."""
    record = runs.read_run_record(run_dir)
    if record is None:
        raise LedgerError(f"no {runs.RUN_RECORD} in it (a run made by an older hpcmem): its site and partition "
                          "are not known")
    missing = [k for k in ("run_id", "spec_name", "site", "site_path", "partition") if not record.get(k)]
    if missing:
        raise LedgerError(f"{run_dir / runs.RUN_RECORD} lacks {', '.join(missing)}")
    odd = [k for k in ("run_id", "spec_name", "site", "site_path", "partition", "spec_path", "workdir")
           if record.get(k) is not None and not isinstance(record[k], str)]
    if odd:
        raise LedgerError(f"{run_dir / runs.RUN_RECORD}: {', '.join(odd)} must be text")
    end = _read_json(run_dir / runs.END_RECORD)
    end = end if isinstance(end, dict) else None
    now = time.time()
    created = _time(record.get("created")) or run_dir.stat().st_mtime
    numbers = sorted({int(m.group(1)) for p in run_dir.iterdir() if p.is_dir() and (m := _ATTEMPT.match(p.name))})
    attempts = [_rebuild_attempt(run_dir / f"attempt-{n}", n, record, home) for n in numbers]
    attempts = [a for a in attempts if a is not None]
    note = ""
    state, reason = "running", ""
    if end and end.get("state") in ("succeeded", "failed", "gave_up", "cancelled"):
        state, reason = end["state"], str(end.get("reason") or "")
    _poll_states(attempts, record, run_dir, home, last_may_run=state == "running")
    if not attempts:
        plan = record.get("first_plan")
        if not isinstance(plan, dict):
            raise LedgerError("it has no attempt and no first plan in run.json")
        attempts = [{"n": 1, "state": "submit_failed", "plan": plan, "attempt_dir": str(run_dir / "attempt-1"),
                     "partition": record["partition"], "created": created}]
        if state == "running":
            state, reason = "failed", "its submission was interrupted before attempt 1 was written; nothing was submitted"
        note = "nothing had been submitted: recorded as failed"
    elif state != "running":
        for a in attempts:
            if a["state"] in ("planned", "submitting"):
                a["state"] = "submit_failed"
    run = Run(run_id=record["run_id"], spec_path=record.get("spec_path") or str(run_dir / runs.SPEC_COPY),
              spec_name=record["spec_name"], site=record["site"], site_path=record["site_path"],
              partition=record["partition"], run_dir=str(run_dir), workdir=record.get("workdir") or str(run_dir),
              state=state, reason=reason, created=created, updated=now)
    return run, attempts, note


def _time(value: Any) -> float | None:
    """A recorded time (seconds since the epoch): a finite number, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def _rebuild_attempt(attempt_dir: Path, n: int, record: dict, home: Path) -> dict | None:
    info = _read_json(attempt_dir / runs.ATTEMPT_RECORD)
    info = info if isinstance(info, dict) else {}
    plan = info.get("plan")  # the ledger's plan as it was; plan.json (the rendered one) when there is no record
    if not isinstance(plan, dict):
        plan = _read_json(attempt_dir / "plan.json")
        if not isinstance(plan, dict):
            return None  # never rendered: the controller plans it again from what came before
        from .plan import Plan

        known = set(Plan().to_dict())
        plan = {k: v for k, v in plan.items() if k in known}
    job_id = _job_id_of(attempt_dir, home)
    has_script = (attempt_dir / "job.sbatch").is_file()
    return {
        "n": n, "job_id": job_id, "state": "PENDING" if job_id else ("submitting" if has_script else "planned"),
        "plan": plan, "decision": info.get("decision") if isinstance(info.get("decision"), dict) else None,
        "partition": info["partition"] if isinstance(info.get("partition"), str) and info["partition"]
        else record["partition"], "attempt_dir": str(attempt_dir),
        "metrics": runs.read_metrics(attempt_dir), "created": _time(info.get("created")),
        "submitted": attempt_dir.stat().st_mtime if job_id else None,
    }


def _job_id_of(attempt_dir: Path, home: Path) -> str | None:
    """The newest job the attempt directory names: a local result or record, or a Slurm log."""
    local = [m.group(1) for p in attempt_dir.iterdir() if (m := _LOCAL_ID.match(p.name))]
    for path in (home / "local" / "jobs").glob("local-*.json"):
        data = _read_json(path)
        if (isinstance(data, dict) and data.get("attempt_dir") == str(attempt_dir.resolve())
                and isinstance(data.get("job_id"), str) and _LOCAL_JOB.match(data["job_id"])):
            local.append(data["job_id"])
    if local:
        return max(set(local), key=lambda j: int(j.split("-")[1]))
    slurm = [m.group(1) for p in attempt_dir.iterdir() if (m := _SLURM_LOG.match(p.name))]
    return max(slurm, key=lambda j: [int(x) for x in j.split("_")]) if slurm else None


def _poll_states(attempts: list[dict], record: dict, run_dir: Path, home: Path, *, last_may_run: bool) -> None:
    """The jobs' states from the run's scheduler (one batched query; the scheduler of the site the run recorded,
    ``site.json``); what it cannot say stays as it is."""
    ids = [a["job_id"] for a in attempts if a["job_id"]]
    if not ids:
        return
    statuses = {}
    try:
        from .backends import LocalBackend, get_backend

        scheduler = runs.recorded_site(run_dir, record["site_path"]).scheduler
        backend = LocalBackend(state_dir=home / "local") if scheduler == "local" else get_backend(scheduler)
        statuses = backend.poll(ids)
    except (HpcmemError, OSError, RecursionError):
        pass
    from .controller import attempt_verdict

    for a in attempts:
        status = statuses.get(a["job_id"]) if a["job_id"] else None
        if status is not None and status.finished:
            a.update(state=status.state, exit_code=status.exit_code, finished=time.time(),
                     verdict=attempt_verdict(Path(a["attempt_dir"]), status).to_dict())
        elif status is not None and status.state != "UNKNOWN":
            a["state"] = status.state
        elif a["job_id"] and (a is not attempts[-1] or not last_may_run):
            a["state"] = "UNKNOWN"


# ---------------------------------------------------------------- attempts, locks, local jobs, calibration


def _check_attempts(ledger: Ledger, report: DoctorReport) -> None:
    unfinished = 0
    for run in ledger.runs():
        attempts = ledger.attempts(run.run_id)
        if run.state != "running":
            live = [a for a in attempts if not runs.finished(a.state) and a.state not in ("planned", "UNKNOWN")]
            for a in live:
                report.add("attempts", "warn", f"run {run.run_id} is {run.state} but attempt {a.n} is still {a.state}"
                                               f"{f' (job {a.job_id})' if a.job_id else ''}: `hpcmem cancel` cannot "
                                               "reach it; check the scheduler")
            continue
        unfinished += 1
        if not attempts:
            report.add("attempts", "error", f"run {run.run_id} is running but has no attempt")
            continue
        last = attempts[-1]
        where = f"attempt {last.n} is {last.state}" + (f" (job {last.job_id})" if last.job_id else "")
        report.add("attempts", "info", f"run {run.run_id}: {where}; `hpcmem watch {run.run_id}` or `hpcmem tick` "
                                       "moves it on, `hpcmem cancel` stops it")
        if _lock_held(Path(run.run_dir) / ".lock"):
            report.add("locks", "info", f"run {run.run_id}: a controller holds its lock right now")
    if not unfinished:
        report.add("attempts", "ok", "no unfinished run")


def _lock_held(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        with open(path, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def _check_leftovers(home: Path, report: DoctorReport, repair: bool) -> None:
    """Temporary files a killed writer left (``.<name>.<random>.tmp``); removed with --repair when old."""
    now = time.time()
    found = [p for where in (home / "runs", home / "local", home / "calibration") if where.is_dir()
             for p in where.rglob(".*.tmp") if p.is_file() and now - p.stat().st_mtime > _TMP_AGE_S]
    found += [p for p in home.glob(f"ledger.sqlite{_REBUILDING}*")  # a repair killed part-way
              if p.is_file() and now - p.stat().st_mtime > _TMP_AGE_S]
    if not found:
        report.add("locks", "ok", "no leftover temporary files")
        return
    if repair:
        for p in found:
            p.unlink(missing_ok=True)
        report.add("locks", "fixed", f"removed {len(found)} leftover temporary file{'' if len(found) == 1 else 's'}")
    else:
        report.add("locks", "warn", f"{len(found)} leftover temporary file{'' if len(found) == 1 else 's'} from "
                                    f"killed writers (e.g. {found[0]})")


def _check_local(home: Path, report: DoctorReport, repair: bool) -> None:
    jobs = home / "local" / "jobs"
    if not jobs.is_dir():
        return
    from .backends.local import LocalBackend, claim_path, result_path, start_grace_s

    backend = LocalBackend(state_dir=home / "local")
    stuck, damaged = [], []
    for path in sorted(jobs.glob("local-*.json")):
        data = _read_json(path)
        if (not isinstance(data, dict) or not {"job_id", "attempt_dir", "submitted"} <= set(data)
                or not isinstance(data["job_id"], str) or not _LOCAL_JOB.match(data["job_id"])
                or not isinstance(data["attempt_dir"], str) or _time(data["submitted"]) is None):
            damaged.append(path)
            continue
        if (data.get("runner_pid") is None and not claim_path(backend.state_dir, data["job_id"]).exists()
                and not result_path(Path(data["attempt_dir"]), data["job_id"]).exists()
                and time.time() - data["submitted"] > start_grace_s()):
            stuck.append(data["job_id"])
    for path in damaged:
        report.add("local", "warn", f"local job record {path} is damaged (not a job record)")
    if stuck and repair:
        for job_id in stuck:
            state = backend.poll([job_id])[job_id]
            report.add("local", "fixed", f"local job {job_id} never started: settled as {state.state}")
    elif stuck:
        report.add("local", "warn", f"local job{'s' if len(stuck) > 1 else ''} {', '.join(stuck)} never started "
                                    "(the submitting process died first); the next poll settles them")
    if not stuck and not damaged:
        report.add("local", "ok", "local job records are sound")


def _check_calibration(home: Path, report: DoctorReport) -> None:
    directory = home / "calibration"
    files = sorted(directory.glob("*.calibration.yaml")) if directory.is_dir() else []
    for path in files:
        problem = _calibration_problem(path)
        if problem:
            report.add("calibration", "warn", f"{path}: {problem}; run `hpcmem calibrate` again or remove it")
    if files and all(_calibration_problem(p) is None for p in files):
        report.add("calibration", "ok", f"{len(files)} calibration file{'' if len(files) == 1 else 's'} read")


def _calibration_problem(path: Path) -> str | None:
    from .schema import load_yaml

    try:
        doc = load_yaml(path)
    except HpcmemError as exc:
        return str(exc)
    except Exception as exc:  # a YAML library error on a hostile file: report it, do not crash the doctor
        return f"unreadable ({type(exc).__name__})"
    if not isinstance(doc, dict) or not isinstance(doc.get("partitions"), dict):
        return "partitions: expected a mapping of partition name to measurements"
    for name, values in doc["partitions"].items():
        if values is None:
            continue
        if not isinstance(values, dict):
            return f"partitions.{name}: expected a mapping of measurements"
        for key, value in values.items():
            if value is not None and not isinstance(value, (int, float, bool, str, list, dict)):
                return f"partitions.{name}.{key}: unexpected value {value!r}"
    return None


def _read_json(path: Path) -> Any:
    """A JSON record of a run directory or the local scheduler (``runs.load_record``: a regular file, never waited
    on, bounded); None when it is missing or unreadable, nested too deeply included."""
    try:
        return runs.load_record(Path(path))
    except (OSError, LedgerError):
        return None


__all__ = ["DoctorReport", "Finding", "doctor", "rebuild_run"]
