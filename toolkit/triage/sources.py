"""From TARGETs (what support staff typed) to the cases to triage, with every job fact found.

``target_cases`` turns TARGETs into ``Case`` values in target order (``cases`` does it for one);
what a TARGET is: ``targets.target_kind``. All the TARGETs of one call are gathered together:
every job id they name (typed, an hpcmem run's, a log's) goes into one sacct call, and the
batch scripts into one ``sacct -B``. ``job_cases`` does the same for a list of job ids, and
``window_cases`` for every job that ended badly in a time window (what ``--since`` needs).

Where things are looked for, best first:

- the scheduler record: sacct (one call for all ids; steps folded in), else what scontrol
  still remembers (``MinJobAge`` after the end);
- the hpcmem ledger: a job named ``<spec>.<run>.a<n>`` (``render.job_name``), a log under
  ``runs/<run>/attempt-<n>/``, or a run id: the attempt's directory, plan and earlier attempts;
- the log: ``logfind.log_candidates`` (attempt directory, scontrol's StdOut/StdErr, the script's
  ``--output``/``--error`` pattern, WorkDir's ``slurm-%j.out``);
- the job script: the attempt's ``job.sbatch``, ``sacct -B`` (``AccountingStoreFlags=job_script``),
  the ``Command`` scontrol names, a script next to the log; then its DeepSpeed config and the
  plan.json next to the log (``facts.add_files_near``).

A case that starts from a log (a file, a directory, standard input) takes the record of the job
the log names only when the log agrees with it (``logmatch.same_job``: its path, the nodes and
dates it shows); a log of another cluster whose id exists here keeps its own facts and says why
in ``facts.missing``. A directory holding several jobs' logs gives one case per job
(``logfind.group_logs``). Standard input is read once, in bounded chunks, keeping its end
(``logtail.read_stream_tail``: plain or gzip).

Nothing here raises for a job that cannot be found or a scheduler that cannot answer: the
case says so in ``facts.missing``. Only a TARGET that is none of the kinds is an error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from ..backends.base import Backend
from ..errors import HpcmemError
from ..logtail import DEFAULT_MAX_BYTES, LogError, read_stream_tail
from . import facts as F
from .facts import Case, FactsBuilder
from .logfind import (HEAD_BYTES, attempt_of_path, clue_text, group_logs, job_id_in_text, job_id_of_logs,
                      log_candidates, log_files)
from .logmatch import log_clues, same_job
from .scriptread import read_script
from .targets import JOB_ID, RUN_ID, id_order, resolve_ids, target_kind

__all__ = ["cases", "target_cases", "job_cases", "window_cases", "log_candidates", "target_kind", "resolve_ids",
           "log_files", "job_id_of_logs", "job_id_in_text", "group_logs"]

_JOB_NAME_RUN = re.compile(r"\.(\d{8}-\d{6}-[0-9a-f]{4})\.a(\d+)$")


def cases(target: str, *, backend: Backend | None = None, ledger=None, stdin: BinaryIO | None = None) -> list[Case]:
    """The cases one TARGET stands for (see ``target_cases``)."""
    return target_cases([target], backend=backend, ledger=ledger, stdin=stdin)


def target_cases(targets: Iterable[str], *, backend: Backend | None = None, ledger=None,
                 stdin: BinaryIO | None = None) -> list[Case]:
    """The cases TARGETs stand for, in target order (a target may give several: an array job's failed
    tasks, a directory's jobs). ``backend``: a ``Backend`` (its accounting queries) or None (no scheduler here); ``ledger``: a
    ``toolkit.ledger.Ledger`` or None; ``stdin``: a binary stream for ``-``. One sacct call for every
    job id of all targets, at most one ``sacct -B``. Raises ``HpcmemError`` for a TARGET of no kind
    (before anything is read)."""
    targets = list(targets)
    kinds = [target_kind(t) for t in targets]
    gathering = _Gathering(backend, ledger)
    found: list[list[_Job] | None] = []
    for target, kind in zip(targets, kinds):
        if kind == "job":
            found.append(None)  # known once sacct has answered (an array id stands for its tasks)
        elif kind == "run":
            found.append([gathering.run_job(target)])
        elif kind == "stdin":
            found.append([_stdin_job(target, stdin)])
        else:
            found.append(_path_jobs(target, kind))
    for jobs in found:
        for job in jobs or ():
            gathering.attempt_of_log(job)
    asked = [t for t, k in zip(targets, kinds) if k == "job"]
    asked += [j.job_id for jobs in found for j in jobs or () if j.job_id and not j.skip]
    records = gathering.records(asked)
    for i, (target, kind) in enumerate(zip(targets, kinds)):
        if kind == "job":
            found[i] = gathering.typed_jobs(target, target, records)
        elif kind == "run":
            gathering.run_record(found[i][0], records)
    every = [j for jobs in found for j in jobs]
    gathering.check_logs([j for j in every if j.kind in ("file", "dir", "stdin")], records,
                         others=[j.job_id for j in every if j.record is not None and j.job_id])
    gathering.complete([j for j in every if not j.skip])
    return [job.case() for job in every]


def job_cases(job_ids: list[str], *, backend: Backend | None = None, ledger=None,
              targets: list[str] | None = None, records: dict[str, dict] | None = None) -> list[Case]:
    """Cases for many Slurm job ids with one sacct call (plus at most one ``sacct -B`` and the
    scontrol lookups for jobs whose log is not known otherwise). ``targets``: how each id was typed;
    ``records``: sacct's facts when the caller has them already (no sacct call then)."""
    targets = targets or list(job_ids)
    gathering = _Gathering(backend, ledger)
    if records is None:
        records = gathering.records(list(job_ids))
    else:
        gathering.sacct_answered = True
    jobs = [job for asked, target in zip(job_ids, targets) for job in gathering.typed_jobs(asked, target, records)]
    gathering.complete(jobs)
    return [job.case() for job in jobs]


def window_cases(backend, start_s: float, end_s: float, *, partition: str | None = None, user: str | None = None,
                 ledger=None) -> list[Case]:
    """A case for every job that ended badly between ``start_s`` and ``end_s`` (unix seconds), oldest
    first: one sacct call lists them with their facts, then as ``job_cases`` (one ``sacct -B``, one
    scontrol). Raises ``SchedulerError`` when sacct cannot answer: a window needs accounting."""
    records = backend.failed_jobs(start_s, end_s, partition=partition, user=user)
    return job_cases(sorted(records, key=id_order), backend=backend, ledger=ledger, records=records)


# ---------------------------------------------------------------- one job while it is gathered


@dataclass
class _Job:
    target: str
    kind: str
    job_id: str | None
    record: dict | None = None
    log_paths: list[Path] = field(default_factory=list)
    log_text: str | None = None
    log_first_line: int | None = None
    clues: str = ""
    """The first and last lines of the log(s): where the job id, nodes and dates are read."""
    script: dict | None = None
    attempt: Any = None
    script_tried: list[str] = field(default_factory=list)
    fallback: dict = field(default_factory=dict)
    foreign: bool = False
    """The log names a job id this cluster knows, but shows another job: no scheduler lookups by that id."""
    skip: bool = False
    """Nothing more to gather (a run id without a ledger or attempt): the case says why already."""
    builder: FactsBuilder = field(default_factory=FactsBuilder)

    def case(self) -> Case:
        return Case(target=self.target, kind=self.kind, log_paths=tuple(self.log_paths), log_text=self.log_text,
                    facts=self.builder.build(), log_first_line=self.log_first_line)


class _Gathering:
    """The scheduler and the ledger, asked once per kind of question for all jobs of a call."""

    def __init__(self, backend: Backend | None, ledger):
        self.backend, self.ledger = backend, ledger
        self.sacct_answered = False
        self.sacct_problem: str | None = None
        self._scripts: dict[str, str] = {}
        self._scripts_asked: set[str] = set()
        self._scripts_problem: str | None = None
        self._remembered: dict[str, dict] = {}
        self._remembered_asked: set[str] = set()

    # -- scheduler records

    def records(self, job_ids: list[str]) -> dict[str, dict]:
        """sacct's records for the ids, in one call (scontrol's when sacct cannot answer)."""
        ids = list(dict.fromkeys(i for i in job_ids if JOB_ID.match(i or "")))
        if not ids:
            return {}
        if self.backend is None:
            self.sacct_problem = "no Slurm scheduler on this machine: job facts come from files only"
            return {}
        try:
            found = self.backend.job_facts(ids)
            self.sacct_answered = True
            return found
        except HpcmemError as exc:
            self.sacct_problem = f"sacct unavailable: {exc}"
        try:
            return self.backend.controller_facts(ids)
        except HpcmemError as exc:
            self.sacct_problem += f"; scontrol unavailable too: {exc}"
            return {}

    def batch_scripts(self, job_ids: list[str]) -> dict[str, str]:
        """The scripts accounting kept (``sacct -B``), asking only for ids not asked before in this call."""
        new = [i for i in dict.fromkeys(job_ids) if i not in self._scripts_asked and JOB_ID.match(i or "")]
        if new and self.sacct_answered and self._scripts_problem is None:
            self._scripts_asked.update(new)
            try:
                self._scripts.update(self.backend.batch_scripts(new))
            except HpcmemError as exc:
                self._scripts_problem = f"sacct -B failed ({exc})"
        return {i: self._scripts[i] for i in job_ids if i in self._scripts}

    def remembered(self, job_ids: list[str]) -> dict[str, dict]:
        """What scontrol still remembers of the jobs, asking only for ids not asked before in this call."""
        new = [i for i in dict.fromkeys(job_ids) if i not in self._remembered_asked and JOB_ID.match(i or "")]
        if new and self.backend is not None:
            self._remembered_asked.update(new)
            try:
                self._remembered.update(self.backend.controller_facts(new))
            except HpcmemError:
                pass
        return {i: self._remembered[i] for i in job_ids if i in self._remembered}

    # -- typed job ids and run ids

    def typed_jobs(self, asked: str, target: str, records: dict[str, dict]) -> list[_Job]:
        """The jobs a typed id means (an array job: its failed tasks), or one that says it is unknown."""
        found = resolve_ids(asked, records)
        if found:
            return [_Job(target, "job", job_id, record=records[job_id]) for job_id in found]
        job = _Job(target, "job", asked)
        job.builder.set(None, job_id=asked)
        if self.sacct_answered:
            job.builder.miss(f"job {asked} is not known to sacct on this cluster "
                             f"(another cluster, or older than accounting keeps)")
        return [job]

    def run_job(self, target: str) -> _Job:
        """An hpcmem run id (``RUN`` or ``RUN:N``): its attempt from the ledger (its record comes later)."""
        run_id, n = RUN_ID.match(target).groups()
        job = _Job(target, "run", None)
        job.builder.set(None, run_id=run_id)
        if self.ledger is None:
            job.builder.miss("no hpcmem ledger here: the run's attempts cannot be looked up")
            job.skip = True
        elif not self.use_attempt(job, run_id, int(n) if n else None):
            job.skip = True
        return job

    def run_record(self, job: _Job, records: dict[str, dict]) -> None:
        if job.skip:
            return
        if job.job_id and JOB_ID.match(job.job_id):
            job.record = records.get(job.job_id)
            if job.record is None and self.sacct_answered:
                job.builder.miss(f"job {job.job_id} is not known to sacct on this cluster")
        elif job.job_id:
            job.builder.miss(f"job {job.job_id} ran on the local backend: no Slurm record")
        else:
            job.builder.miss(f"attempt {job.attempt.n} of run {job.builder.get('run_id')} was never submitted "
                             f"(state {job.attempt.state})")

    # -- cases that start from a log

    def attempt_of_log(self, job: _Job) -> None:
        """A log inside ``runs/<run>/attempt-<n>/`` is that ledger attempt (its job id, when the log names none)."""
        if job.kind not in ("file", "dir") or not job.log_paths or self.ledger is None:
            return
        ref = attempt_of_path(job.log_paths[0])
        if ref is not None:
            self.use_attempt(job, *ref)

    def check_logs(self, jobs: list[_Job], records: dict[str, dict], others: Iterable[str] = ()) -> None:
        """Give each log case the record of the job its log names, when the log agrees with it
        (``logmatch.same_job``); otherwise say why not. ``others``: job ids of the call's other cases,
        whose scripts are asked for in the same ``sacct -B``."""
        pending = []
        for job in jobs:
            if job.skip:
                continue
            if not job.job_id:
                if job.kind != "dir" or job.log_paths:
                    job.builder.miss("the log names no Slurm job id (slurm-<id>.out, 'hpcmem: job <id>', "
                                     "StepId=<id>.batch)")
                continue
            job.builder.set(None, job_id=job.job_id)
            found = resolve_ids(job.job_id, records)
            if len(found) == 1:
                pending.append((job, found[0]))
            elif found:
                job.builder.miss(f"job {job.job_id} named by the log is an array job here ({len(found)} tasks): "
                                 f"which task the log is cannot be told, so no record is used")
            elif self.sacct_answered:
                job.builder.miss(f"job {job.job_id} named by the log is not known to sacct on this cluster")
        if not pending:
            return
        ids = [i for _job, i in pending]
        scripts = self.batch_scripts([*ids, *others])
        remembered = self.remembered(ids)
        for job, job_id in pending:
            record = records[job_id]
            script = read_script(scripts[job_id]) if job_id in scripts else {}
            attempt = job.attempt if job.attempt is not None and job.attempt.job_id == job_id else None
            expected = [p for _origin, paths in log_candidates(job_id, record, remembered.get(job_id) or {},
                                                               script, attempt) for p in paths]
            clues = log_clues(job.clues, job.log_paths[0] if job.log_paths else None,
                              attempt_of_path(job.log_paths[0]) if job.log_paths else None,
                              job.attempt.job_id if job.attempt is not None else None)
            same, sentence = same_job(clues, job_id, record, expected)
            if sentence:
                job.builder.miss(sentence)
            if same:
                job.record = record
            else:
                job.foreign = True

    # -- everything else, for jobs whose record (if any) is known

    def complete(self, jobs: list[_Job]) -> None:
        for job in jobs:
            if self.sacct_problem and job.job_id:
                job.builder.miss(self.sacct_problem)
            if job.record:
                F.add_record(job.builder, job.record, F.SACCT if self.sacct_answered else F.SCONTROL)
            self.find_attempt(job)
            job.builder.set(F.LEDGER, **job.fallback)
        self.find_scripts([j for j in jobs if j.script is None and j.job_id and not j.foreign])
        self.find_logs([j for j in jobs if j.kind in ("job", "run")])
        for job in jobs:
            self.files_near(job)

    def find_attempt(self, job: _Job) -> None:
        """The ledger attempt the job is, by its Slurm name, its log's directory, or (no name known) its id."""
        if self.ledger is None or job.attempt is not None:
            return
        ref = None
        name = (job.record or {}).get("name") or ""
        match = _JOB_NAME_RUN.search(name)
        if match:
            ref = match.group(1), int(match.group(2))
        elif job.log_paths:
            ref = attempt_of_path(job.log_paths[0])
        if ref is None and job.job_id and not name and not job.foreign:
            ref = self._attempt_by_job_id(job.job_id)
        if ref is not None:
            self.use_attempt(job, *ref)

    def use_attempt(self, job: _Job, run_id: str, n: int | None) -> bool:
        """Facts of ledger attempt ``n`` of ``run_id`` (the last submitted one when None)."""
        try:
            run = self.ledger.run(run_id)
            attempts = self.ledger.attempts(run_id)
        except HpcmemError as exc:
            job.builder.miss(f"hpcmem ledger: {exc}")
            return False
        chosen = [a for a in attempts if a.n == n] if n is not None else \
            ([a for a in attempts if a.job_id] or attempts)[-1:]
        if not chosen:
            have = ", ".join(str(a.n) for a in attempts) or "none"
            job.builder.miss(f"run {run_id} has no attempt {n} (attempts: {have})")
            job.builder.set(F.LEDGER, run_id=run_id, site=run.site)
            return False
        attempt = chosen[0]
        job.attempt = attempt
        if job.job_id is None and attempt.job_id:
            job.job_id = attempt.job_id
        job.builder.set(F.LEDGER, run_id=run_id, attempt=attempt.n, site=run.site, job_id=attempt.job_id,
                        attempts=F.ledger_attempts(attempts, attempt.n))
        # the scheduler's record, when there is one, says these better: they are added after it
        job.fallback = {"partition": attempt.partition, "state": attempt.state, "exit_code": attempt.exit_code}
        attempt_dir = Path(attempt.attempt_dir)
        if F.is_file(attempt_dir / F.PLAN_JSON):
            F.add_plan_json(job.builder, attempt_dir / F.PLAN_JSON)
        job.builder.knobs({k: v for k, v in (attempt.plan or {}).items() if k != "world_size"}, F.LEDGER)
        spec = Path(run.run_dir) / "spec.yaml"
        if F.is_file(spec):
            F.add_spec(job.builder, spec)
        return True

    def _attempt_by_job_id(self, job_id: str) -> tuple[str, int] | None:
        try:
            for run in reversed(self.ledger.runs()):
                for attempt in self.ledger.attempts(run.run_id):
                    if attempt.job_id == job_id:
                        return run.run_id, attempt.n
        except HpcmemError:
            return None
        return None

    # -- scripts

    def find_scripts(self, jobs: list[_Job]) -> None:
        """The attempt's job.sbatch, else one ``sacct -B`` for the rest, else scontrol's Command."""
        rest = []
        for job in jobs:
            script = Path(job.attempt.attempt_dir) / "job.sbatch" if job.attempt is not None else None
            if script is not None and F.is_file(script):
                self.script_from_file(job, script)
            else:
                rest.append(job)
        asked = [j.job_id for j in rest if JOB_ID.match(j.job_id or "") and j.record is not None]
        kept = self.batch_scripts(asked) if asked else {}
        for job in rest:
            text = kept.get(job.job_id)
            if text is not None:
                job.script = F.add_script(job.builder, text, f"sacct -B -j {job.job_id}", self._dirs(job))
            elif job.job_id in asked:
                job.script_tried.append(self._why_no_script())
            if job.script is None:
                self.script_from_command(job, (job.record or {}).get("command"))

    def _why_no_script(self) -> str:
        if not self.sacct_answered:
            return "sacct -B cannot answer"
        if self._scripts_problem:
            return self._scripts_problem
        return "accounting kept no script (that needs AccountingStoreFlags=job_script)"

    def script_from_command(self, job: _Job, command: str | None) -> None:
        """The script scontrol names as the job's Command, while that file still exists."""
        if not command or job.script is not None:
            return
        if os.path.isfile(command):
            self.script_from_file(job, Path(command))
        else:
            job.script_tried.append(f"scontrol's Command {command} is gone")

    def script_from_file(self, job: _Job, path: Path) -> None:
        text = F.read_text(job.builder, path, "job script")
        if text is not None:
            job.script = F.add_script(job.builder, text, str(path), self._dirs(job, path.parent))

    def _dirs(self, job: _Job, *more: Path) -> list[Path]:
        workdir = job.builder.get("workdir")
        dirs = [*more, *([Path(workdir)] if workdir else [])]
        if job.attempt is not None:
            dirs.insert(0, Path(job.attempt.attempt_dir))
        return list(dict.fromkeys(dirs))

    # -- logs

    def find_logs(self, jobs: list[_Job]) -> None:
        """Each job's log: the first place in ``log_candidates`` that has it (stdout, and stderr when separate)."""
        unknown = [j for j in jobs if not (j.attempt is not None and j.job_id
                                           and F.is_file(Backend.log_path(Path(j.attempt.attempt_dir), j.job_id)))]
        remembered = self.remembered([j.job_id for j in unknown if JOB_ID.match(j.job_id or "")])
        for job in jobs:
            if not job.job_id:
                continue
            extra = remembered.get(job.job_id) or {}
            if extra:
                F.add_record(job.builder, extra, F.SCONTROL)
                self.script_from_command(job, extra.get("command"))
            candidates = log_candidates(job.job_id, job.record or {}, extra, job.script or {}, job.attempt)
            for _origin, paths in candidates:
                found = [p for p in dict.fromkeys(paths) if F.is_file(p)]
                if found:
                    job.log_paths = found
                    break
            if not job.log_paths:
                tried = "; ".join(f"{', '.join(map(str, dict.fromkeys(paths)))} ({origin})"
                                  for origin, paths in candidates)
                job.builder.miss(f"no log found for job {job.job_id}: tried {tried} (none exists here)")

    # -- files next to the log

    def files_near(self, job: _Job) -> None:
        """plan.json, job script and DeepSpeed config next to the logs (and in the attempt directory)."""
        dirs = [p.parent for p in job.log_paths]
        if job.attempt is not None:
            dirs.insert(0, Path(job.attempt.attempt_dir))
        workdir = job.builder.get("workdir")
        extra = [Path(workdir)] if workdir else []
        for directory in dict.fromkeys(dirs):
            F.add_files_near(job.builder, directory, extra)
        if job.builder.get("script_path") is None:
            tried = [*job.script_tried]
            if dirs:
                tried.append("none next to the log (job.sbatch, or one *.sbatch/*.slurm/*.sh with #SBATCH lines)")
            job.builder.miss("job script not found" + (f": {'; '.join(tried)}" if tried else ""))


# ---------------------------------------------------------------- files, directories, stdin


def _path_jobs(target: str, kind: str) -> list[_Job]:
    """A log file: one job; a directory: one job per job id its logs name (``logfind.group_logs``)."""
    path = Path(target)
    if kind == "file":
        return [_log_job(target, kind, job_id_of_logs([path]), [path])]
    logs = log_files(path)
    if not logs:
        job = _Job(target, kind, None)
        job.builder.miss(f"no log files in {path} (looked for *.out, *.err, *.log, *.txt and their .gz)")
        return [job]
    groups = group_logs(logs)
    jobs = [_log_job(target, kind, job_id, paths) for job_id, paths in groups]
    named = [job_id for job_id, _paths in groups if job_id]
    for job in jobs:
        if job.job_id is None and named:
            job.builder.miss(f"{', '.join(p.name for p in job.log_paths)} in {path} name no job id, and the directory "
                             f"holds logs of jobs {', '.join(named)}: triaged on their own")
    return jobs


def _log_job(target: str, kind: str, job_id: str | None, paths: list[Path]) -> _Job:
    job = _Job(target, kind, job_id, log_paths=list(paths))
    job.clues = "\n".join(clue_text(p) for p in paths[:8])  # the first files say where the job ran
    return job


def _stdin_job(target: str, stdin: BinaryIO | None, max_bytes: int = DEFAULT_MAX_BYTES) -> _Job:
    """A log on standard input (plain or gzip), read once in bounded chunks; its end is kept."""
    job = _Job(target, "stdin", None)
    if stdin is None:
        job.builder.miss("no standard input to read")
        return job
    try:
        tail = read_stream_tail(stdin, max_bytes, head_bytes=HEAD_BYTES)
    except LogError as exc:
        job.builder.miss(str(exc))
        return job
    if tail.damaged:
        job.builder.miss("the gzip data on standard input is damaged (truncated or corrupt): "
                         + ("what could be decompressed is used" if tail.text else "nothing could be decompressed"))
    elif tail.truncated:
        job.builder.miss(f"standard input holds {tail.size} bytes: only its last {max_bytes} were read, from line "
                         f"{tail.first_line} of the input (evidence line numbers count from there)")
    job.log_text = tail.text if tail.text or not tail.damaged else None
    job.log_first_line = tail.first_line
    job.clues = (tail.head or "") + "\n" + tail.text[:HEAD_BYTES] + "\n" + tail.text[-HEAD_BYTES:]
    job.job_id = job_id_in_text(job.clues)
    return job
