"""From a TARGET (what support staff typed) to the cases to triage, with every job fact found.

A TARGET is a Slurm job id (``123``, an array task ``123_4``), an hpcmem run id
(``20261121-083000-ab12``, ``RUN:N`` for attempt N), a log file (plain or gzip), a directory
of a job's logs, or ``-`` (standard input). ``target_kind`` says which (pure); ``cases``
turns one into ``Case`` values; ``job_cases`` does it for many job ids with one batched
query of each kind, and ``window_cases`` for every job that ended badly in a time window
(what ``--since`` needs).

Where things are looked for, best first:

- the scheduler record: sacct (one call for all ids; steps folded in), else what scontrol
  still remembers (``MinJobAge`` after the end);
- the hpcmem ledger: a job named ``<spec>.<run>.a<n>`` (``render.job_name``), a log under
  ``runs/<run>/attempt-<n>/``, or a run id: the attempt's directory, plan and earlier attempts;
- the log: the attempt directory's ``slurm-<id>.out``, scontrol's StdOut/StdErr, the
  script's ``--output``/``--error`` pattern (expanded, relative to WorkDir), WorkDir's
  ``slurm-%j.out`` (``slurm-%A_%a.out`` for array tasks);
- the job script: the attempt's ``job.sbatch``, ``sacct -B`` (``AccountingStoreFlags=job_script``),
  the ``Command`` scontrol names, a script next to the log; then its DeepSpeed config and the
  plan.json next to the log (``facts.add_files_near``).

Nothing here raises for a job that cannot be found or a scheduler that cannot answer: the
case says so in ``facts.missing``. Only a TARGET that is none of the kinds is an error.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

from ..backends.base import Backend, COMPLETED
from ..backends.slurm import expand_filename_pattern
from ..errors import HpcmemError
from . import facts as F
from .facts import Case, FactsBuilder

JOB_ID = re.compile(r"^\d+(_\d+)?$")
RUN_ID = re.compile(r"^(\d{8}-\d{6}-[0-9a-f]{4})(?::(\d+))?$")
_JOB_NAME_RUN = re.compile(r"\.(\d{8}-\d{6}-[0-9a-f]{4})\.a(\d+)$")
_ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")
_LOG_SUFFIXES = (".out", ".err", ".log", ".txt")
_NOT_LOGS = (".json", ".sbatch", ".slurm", ".sh", ".py", ".yaml", ".yml", ".lock", ".sqlite")
# Where a log names its own job: hpcmem's first line, slurmstepd's messages.
_LOG_JOB_ID = (
    re.compile(r"hpcmem: job (\d+(?:_\d+)?) attempt \d+"),
    re.compile(r"StepId=(\d+(?:_\d+)?)\.(?:batch|extern|\d+)"),
    re.compile(r"\*\*\* JOB (\d+(?:_\d+)?) ON \S+ CANCELLED"),
)
_SLURM_LOG_NAME = re.compile(r"^slurm-(\d+(?:_\d+)?)\.(?:out|err)(?:\.gz)?$")
STDIN_MAX_BYTES = 256 * 2**20
"""Most bytes of standard input kept (the end of it): more is not a pasted log."""
HEAD_BYTES = 65536


def target_kind(target: str, exists: Callable[[str], bool] = os.path.exists,
                isdir: Callable[[str], bool] = os.path.isdir) -> str:
    """``job``, ``run``, ``file``, ``dir`` or ``stdin`` for a TARGET (pure, given ``exists``/``isdir``).

    A job or run id wins over a file of that name in the current directory (a ticket names jobs,
    not files called ``4412``); ``./4412`` is the file. Raises ``HpcmemError`` for anything else.
    """
    if target == "-":
        return "stdin"
    if JOB_ID.match(target):
        return "job"
    if RUN_ID.match(target):
        return "run"
    if target and exists(target):
        return "dir" if isdir(target) else "file"
    if "/" in target or re.search(r"\.(out|err|log|txt|gz)$", target):
        raise HpcmemError(f"triage target {target!r}: no such file or directory")
    raise HpcmemError(f"triage target {target!r} is not a job id (123, 123_4), a run id (20261121-083000-ab12[:N]), "
                      f"an existing log file or directory, or - (stdin)")


def cases(target: str, *, backend: Backend | None = None, ledger=None, stdin: BinaryIO | None = None) -> list[Case]:
    """The cases one TARGET stands for (see the module docstring).

    ``backend``: a ``SlurmBackend`` or None (no Slurm here); ``ledger``: a ``toolkit.ledger.Ledger``
    or None; ``stdin``: a binary stream for ``-``. An array job id without a task gives its
    failed tasks (all tasks when none failed).
    """
    kind = target_kind(target)
    if kind == "job":
        return job_cases([target], backend=backend, ledger=ledger)
    if kind == "run":
        return [_run_case(target, backend, ledger)]
    if kind == "stdin":
        return [_stdin_case(target, stdin, backend, ledger)]
    return [_path_case(target, kind, backend, ledger)]


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
    jobs: list[_Job] = []
    for asked, target in zip(job_ids, targets):
        found = resolve_ids(asked, records)
        if not found:
            job = _Job(target, "job", asked)
            job.builder.set(None, job_id=asked)
            if gathering.sacct_answered:
                job.builder.miss(f"job {asked} is not known to sacct on this cluster "
                                 f"(another cluster, or older than accounting keeps)")
            jobs.append(job)
        for job_id in found:
            job = _Job(target, "job", job_id, record=records[job_id])
            jobs.append(job)
    gathering.complete(jobs)
    return [job.case() for job in jobs]


def window_cases(backend, start_s: float, end_s: float, *, partition: str | None = None, user: str | None = None,
                 ledger=None) -> list[Case]:
    """A case for every job that ended badly between ``start_s`` and ``end_s`` (unix seconds), oldest
    first: one sacct call lists them with their facts, then as ``job_cases`` (one ``sacct -B``, one
    scontrol). Raises ``SchedulerError`` when sacct cannot answer: a window needs accounting."""
    records = backend.failed_jobs(start_s, end_s, partition=partition, user=user)
    ids = sorted(records, key=lambda i: [int(p) for p in re.findall(r"\d+", i)])
    return job_cases(ids, backend=backend, ledger=ledger, records=records)


def resolve_ids(asked: str, records: dict[str, dict]) -> list[str]:
    """Which records a typed job id means (pure): itself; an array job's tasks (the failed ones,
    or all when none failed); or the array task whose own (raw) id it is."""
    tasks = sorted((k for k in records if k.startswith(f"{asked}_")), key=lambda k: int(k.split("_")[1]))
    if tasks and "_" not in asked:
        failed = [k for k in tasks if records[k].get("state") not in (COMPLETED, "PENDING", "RUNNING")]
        return failed or tasks
    if asked in records:
        return [asked]
    return [k for k, r in records.items() if r.get("raw_id") == asked][:1]


# ---------------------------------------------------------------- one job while it is gathered


@dataclass
class _Job:
    target: str
    kind: str
    job_id: str | None
    record: dict | None = None
    log_paths: list[Path] = field(default_factory=list)
    log_text: str | None = None
    script: dict | None = None
    attempt: Any = None
    script_tried: list[str] = field(default_factory=list)
    fallback: dict = field(default_factory=dict)
    builder: FactsBuilder = field(default_factory=FactsBuilder)

    def case(self) -> Case:
        return Case(target=self.target, kind=self.kind, log_paths=tuple(self.log_paths), log_text=self.log_text,
                    facts=self.builder.build())


class _Gathering:
    """The scheduler and the ledger, asked once per kind of question for all jobs of a call."""

    def __init__(self, backend: Backend | None, ledger):
        self.backend, self.ledger = backend, ledger
        self.sacct_answered = False
        self.sacct_problem: str | None = None

    # -- scheduler records

    def records(self, job_ids: list[str]) -> dict[str, dict]:
        """sacct's records for the ids (scontrol's when sacct cannot answer)."""
        ids = [i for i in job_ids if JOB_ID.match(i or "")]
        if not ids:
            return {}
        if self.backend is None or not hasattr(self.backend, "job_facts"):
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

    # -- everything else, for jobs whose record (if any) is known

    def complete(self, jobs: list[_Job]) -> None:
        for job in jobs:
            if self.sacct_problem and job.job_id:
                job.builder.miss(self.sacct_problem)
            if job.record:
                F.add_record(job.builder, job.record, F.SACCT if self.sacct_answered else F.SCONTROL)
            self.find_attempt(job)
            job.builder.set(F.LEDGER, **job.fallback)
        self.find_scripts([j for j in jobs if j.script is None and j.job_id])
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
            ref = _attempt_of_path(job.log_paths[0])
        if ref is None and job.job_id and not name:
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
        if (attempt_dir / F.PLAN_JSON).is_file():
            F.add_plan_json(job.builder, attempt_dir / F.PLAN_JSON)
        job.builder.knobs({k: v for k, v in (attempt.plan or {}).items() if k != "world_size"}, F.LEDGER)
        spec = Path(run.run_dir) / "spec.yaml"
        if spec.is_file():
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
            if script is not None and script.is_file():
                self.script_from_file(job, script)
            else:
                rest.append(job)
        kept: dict[str, str] = {}
        asked = [j.job_id for j in rest if JOB_ID.match(j.job_id or "") and j.record is not None]
        if asked and self.sacct_answered:
            try:
                kept = self.backend.batch_scripts(asked)
            except HpcmemError as exc:
                for job in rest:
                    job.script_tried.append(f"sacct -B failed ({exc})")
        elif asked:
            for job in rest:
                job.script_tried.append("sacct -B cannot answer")
        for job in rest:
            text = kept.get(job.job_id)
            if text is not None:
                job.script = F.add_script(job.builder, text, f"sacct -B -j {job.job_id}", self._dirs(job))
            elif self.sacct_answered and job.record is not None:
                job.script_tried.append("accounting kept no script (that needs AccountingStoreFlags=job_script)")
            if job.script is None:
                self.script_from_command(job, (job.record or {}).get("command"))

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
                                           and Backend.log_path(Path(j.attempt.attempt_dir), j.job_id).is_file())]
        remembered: dict[str, dict] = {}
        asked = [j.job_id for j in unknown if JOB_ID.match(j.job_id or "")]
        if asked and self.backend is not None and hasattr(self.backend, "controller_facts"):
            try:
                remembered = self.backend.controller_facts(asked)
            except HpcmemError:
                remembered = {}
        for job in jobs:
            if not job.job_id:
                continue
            extra = remembered.get(job.job_id) or {}
            if extra:
                F.add_record(job.builder, extra, F.SCONTROL)
                self.script_from_command(job, extra.get("command"))
            candidates = log_candidates(job.job_id, job.record or {}, extra, job.script or {}, job.attempt)
            for _origin, paths in candidates:
                found = [p for p in dict.fromkeys(paths) if p.is_file()]
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


def log_candidates(job_id: str, record: dict, remembered: dict, script: dict,
                   attempt=None) -> list[tuple[str, tuple[Path, ...]]]:
    """Where the log of ``job_id`` may be, best first: (origin, (output file, [error file])) (pure).

    ``record``: sacct facts; ``remembered``: scontrol facts (StdOut/StdErr already expanded);
    ``script``: ``read_script`` of the batch script; ``attempt``: its ledger row. Relative
    patterns are relative to the job's WorkDir (this directory when unknown).
    """
    info = {**record, **{k: v for k, v in remembered.items() if v is not None}}
    workdir = Path(info.get("workdir") or ".")
    out: list[tuple[str, tuple[Path, ...]]] = []
    if attempt is not None:
        out.append(("hpcmem attempt directory", (Backend.log_path(Path(attempt.attempt_dir), job_id),)))
    if remembered.get("stdout"):
        out.append(("scontrol StdOut/StdErr",
                    tuple(Path(remembered[k]) for k in ("stdout", "stderr") if remembered.get(k))))
    expand = {"job_id": job_id, "raw_id": info.get("raw_id"), "user": info.get("user"), "job_name": info.get("name"),
              "node": info.get("nodes")}

    def place(pattern: str) -> Path:
        path = Path(expand_filename_pattern(pattern, **expand))
        return path if path.is_absolute() else workdir / path
    default = "slurm-%A_%a.out" if "_" in job_id else "slurm-%j.out"
    if script.get("output") or script.get("error"):
        output = place(script.get("output") or default)
        out.append(("#SBATCH --output/--error", (output, *([place(script["error"])] if script.get("error") else []))))
    else:
        out.append((f"default {default} in " + ("WorkDir" if info.get("workdir") else "this directory"),
                    (place(default),)))
    return out


def _attempt_of_path(path: Path) -> tuple[str, int] | None:
    """``.../runs/<run_id>/attempt-<n>/x`` -> (run_id, n)."""
    parent = Path(path).resolve().parent
    match = _ATTEMPT_DIR.match(parent.name)
    if match and RUN_ID.match(parent.parent.name):
        return parent.parent.name, int(match.group(1))
    return None


# ---------------------------------------------------------------- runs, files, directories, stdin


def _run_case(target: str, backend: Backend | None, ledger) -> Case:
    run_id, n = RUN_ID.match(target).groups()
    job = _Job(target, "run", None)
    job.builder.set(None, run_id=run_id)
    gathering = _Gathering(backend, ledger)
    if ledger is None:
        job.builder.miss("no hpcmem ledger here: the run's attempts cannot be looked up")
        return job.case()
    if not gathering.use_attempt(job, run_id, int(n) if n else None):
        return job.case()
    if job.job_id and JOB_ID.match(job.job_id):
        records = gathering.records([job.job_id])
        job.record = records.get(job.job_id)
        if job.record is None and gathering.sacct_answered:
            job.builder.miss(f"job {job.job_id} is not known to sacct on this cluster")
    elif job.job_id:
        job.builder.miss(f"job {job.job_id} ran on the local backend: no Slurm record")
    else:
        job.builder.miss(f"attempt {job.attempt.n} of run {run_id} was never submitted (state {job.attempt.state})")
    gathering.complete([job])
    return job.case()


def _path_case(target: str, kind: str, backend: Backend | None, ledger) -> Case:
    path = Path(target)
    logs = [path] if kind == "file" else log_files(path)
    job = _Job(target, kind, job_id_of_logs(logs), log_paths=list(logs))
    if kind == "dir" and not logs:
        job.builder.miss(f"no log files in {path} (looked for *.out, *.err, *.log, *.txt and their .gz)")
    return _complete_log_case(job, backend, ledger)


def _stdin_case(target: str, stdin: BinaryIO | None, backend: Backend | None, ledger) -> Case:
    job = _Job(target, "stdin", None)
    data = b""
    if stdin is None:
        job.builder.miss("no standard input to read")
    else:
        data = stdin.read(STDIN_MAX_BYTES + 1)
        if len(data) > STDIN_MAX_BYTES:
            data = data[:STDIN_MAX_BYTES]
            job.builder.miss(f"standard input is larger than {STDIN_MAX_BYTES} bytes: only its start was read")
    text, damaged = decode_log_bytes(data)
    if damaged:
        job.builder.miss("the gzip data on standard input is truncated or corrupt: what could be decompressed is used")
    job.log_text = text
    job.job_id = job_id_in_text(text[:HEAD_BYTES] + "\n" + text[-HEAD_BYTES:])
    return _complete_log_case(job, backend, ledger)


def _complete_log_case(job: _Job, backend: Backend | None, ledger) -> Case:
    """A case that starts from a log (file, directory, stdin): the job it names, then everything else."""
    gathering = _Gathering(backend, ledger)
    ref = _attempt_of_path(job.log_paths[0]) if job.log_paths else None
    if ref and ledger is not None:
        gathering.use_attempt(job, *ref)
    if job.job_id:
        job.builder.set(None, job_id=job.job_id)
        records = gathering.records([job.job_id])
        found = resolve_ids(job.job_id, records)
        job.record = records[found[0]] if len(found) == 1 else None
        if job.record is None and gathering.sacct_answered:
            job.builder.miss(f"job {job.job_id} named by the log is not known to sacct on this cluster")
    elif job.kind != "dir" or job.log_paths:
        job.builder.miss("the log names no Slurm job id (slurm-<id>.out, 'hpcmem: job <id>', StepId=<id>.batch)")
    gathering.complete([job])
    return job.case()


def log_files(directory: Path) -> list[Path]:
    """The log files of a directory in rank/file order (numbers compared as numbers); for an hpcmem run
    directory without logs of its own, those of its last attempt."""
    directory = Path(directory)
    try:
        entries = [p for p in directory.iterdir() if p.is_file() and _looks_like_log(p.name)]
    except OSError:
        return []
    if not entries:
        attempts = sorted((p for p in directory.glob("attempt-*") if p.is_dir() and _ATTEMPT_DIR.match(p.name)),
                          key=lambda p: int(p.name.split("-")[1]))
        if attempts:
            return log_files(attempts[-1])
    return sorted(entries, key=lambda p: _natural(p.name))


def job_id_of_logs(paths: list[Path]) -> str | None:
    """The one job id the logs name (``slurm-<id>.out`` names, else the first lines of the first log)."""
    named = {m.group(1) for m in (_SLURM_LOG_NAME.match(p.name) for p in paths) if m}
    if len(named) == 1:
        return named.pop()
    if named or not paths:
        return None
    return job_id_in_text(_head_text(paths[0]))


def job_id_in_text(text: str) -> str | None:
    """The job id a log names: hpcmem's ``hpcmem: job N attempt``, slurmstepd's ``StepId=N.batch`` or
    ``*** JOB N ON node CANCELLED`` (pure)."""
    for pattern in _LOG_JOB_ID:
        match = pattern.search(text)
        if match:
            return match.group(1)
    return None


def decode_log_bytes(data: bytes) -> tuple[str, bool]:
    """Log bytes (plain or gzip, by magic) -> (text, damaged). Invalid UTF-8 is replaced, never raised;
    a truncated or corrupt gzip gives what could be decompressed and ``damaged`` True (pure)."""
    damaged = False
    if data[:2] == b"\x1f\x8b":
        out, rest = [], data
        try:
            while rest[:2] == b"\x1f\x8b":
                inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                out.append(inflater.decompress(rest))
                if not inflater.eof:
                    damaged = True
                    break
                rest = inflater.unused_data
        except zlib.error:
            damaged = True
        data = b"".join(out)
    return data.decode("utf-8", errors="replace"), damaged


def _head_text(path: Path) -> str:
    """The first ``HEAD_BYTES`` (decompressed) of a log, and the last of a plain one, as text."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(HEAD_BYTES)
            if head[:2] == b"\x1f\x8b":
                inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                try:
                    return inflater.decompress(head, HEAD_BYTES).decode("utf-8", errors="replace")
                except zlib.error:
                    return ""
            size = os.fstat(handle.fileno()).st_size
            if size > 2 * HEAD_BYTES:
                handle.seek(size - HEAD_BYTES)
                head += b"\n" + handle.read(HEAD_BYTES)
            return head.decode("utf-8", errors="replace")
    except OSError:
        return ""


def _looks_like_log(name: str) -> bool:
    base = name.removesuffix(".gz")
    if base.endswith(_NOT_LOGS) or name.startswith("."):
        return False
    return base.endswith(_LOG_SUFFIXES)


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

