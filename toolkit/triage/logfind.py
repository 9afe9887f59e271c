"""Where a job's log is, which job a log names, and which logs of a directory go together.

- ``log_candidates``: the places a job's log may be, best first (pure): the hpcmem attempt
  directory, scontrol's StdOut/StdErr, the script's ``--output``/``--error`` pattern expanded
  (relative to WorkDir), WorkDir's ``slurm-%j.out`` (``slurm-%A_%a.out`` for array tasks).
- ``job_id_in_text`` / ``named_job_id``: the job id a log names: its file name ``slurm-<id>.out``
  (``.err``, ``.gz``), else hpcmem's first line ``hpcmem: job <id> attempt``, slurmstepd's
  ``StepId=<id>.batch`` or ``*** JOB <id> ON node CANCELLED`` in its first and last 64 KiB.
- ``group_logs``: a directory may hold the logs of several jobs (``slurm-100.out``,
  ``slurm-101.out``): one group per distinct job id, in job id order. A log naming no job id
  goes with the job whose id is a number of its file name (``train-101-rank0.log``); else, when
  the directory holds one job only, with that job (its rank logs: ``rank-0.log`` next to
  ``slurm-100.out``); else it is put in one last group of its own (job id None), never guessed
  into a job. A directory of logs naming no job at all is one group with job id None.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..backends.base import Backend
from ..backends.slurm import expand_filename_pattern
from ..logtail import LogError, read_head, read_tail
from .targets import RUN_ID, id_order

HEAD_BYTES = 65536
"""Bytes read at each end of a log to find the job id and the nodes it names."""

_ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")
_LOG_SUFFIXES = (".out", ".err", ".log", ".txt")
_NOT_LOGS = (".json", ".sbatch", ".slurm", ".sh", ".py", ".yaml", ".yml", ".lock", ".sqlite")
# Where a log names its own job: hpcmem's first line, slurmstepd's messages.
_LOG_JOB_ID = (
    re.compile(r"hpcmem: job (\d+(?:_\d+)?) attempt \d+"),
    re.compile(r"StepId=(\d+(?:_\d+)?)\.(?:batch|extern|\d+)"),
    re.compile(r"slurmstepd: error: .* in step (\d+(?:_\d+)?)\.(?:batch|extern|\d+)\b"),  # Slurm < 21.08's form
    re.compile(r"\*\*\* JOB (\d+(?:_\d+)?) ON \S+ CANCELLED"),
)
_PAD = re.compile(r"%([0-9]+)(?=[%AajJNnstux])")
_SLURM_LOG_NAME = re.compile(r"^slurm-(\d+(?:_\d+)?)\.(?:out|err)(?:\.gz)?$")


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
        # a zero-padding width is at most 10 digits wide in Slurm: %9999999999j must not build a 10 GB name
        pattern = _PAD.sub(lambda m: "%" + str(min(int(m.group(1)[-3:]), 10)), pattern[:4096])
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


def attempt_of_path(path: Path) -> tuple[str, int] | None:
    """``.../runs/<run_id>/attempt-<n>/x`` -> (run_id, n)."""
    try:
        parent = Path(path).resolve().parent
    except (RuntimeError, OSError):  # a symlink loop
        return None
    match = _ATTEMPT_DIR.match(parent.name)
    if match and RUN_ID.match(parent.parent.name):
        return parent.parent.name, int(match.group(1))
    return None


# ---------------------------------------------------------------- which job a log names


def job_id_in_text(text: str) -> str | None:
    """The job id a log names: hpcmem's ``hpcmem: job N attempt``, slurmstepd's ``StepId=N.batch`` or
    ``*** JOB N ON node CANCELLED`` (pure)."""
    for pattern in _LOG_JOB_ID:
        match = pattern.search(text)
        if match:
            return match.group(1)
    return None


def named_job_id(path: Path) -> str | None:
    """The job id a log file names: by its name (``slurm-<id>.out``), else in its first and last lines."""
    match = _SLURM_LOG_NAME.match(Path(path).name)
    return match.group(1) if match else job_id_in_text(clue_text(path))


def job_id_of_logs(paths: list[Path]) -> str | None:
    """The one job id the logs name (None when they name none, or several)."""
    ids = {i for i in (named_job_id(p) for p in paths) if i}
    return ids.pop() if len(ids) == 1 else None


def group_logs(paths: list[Path]) -> list[tuple[str | None, list[Path]]]:
    """The logs of a directory as (job id, logs) groups, one per job (see the module docstring);
    each group keeps the order of ``paths``."""
    named = {p: named_job_id(p) for p in paths}
    ids = sorted({i for i in named.values() if i}, key=id_order)
    if len(ids) <= 1:
        return [(ids[0] if ids else None, list(paths))] if paths else []
    owner = {p: named[p] or _id_in_name(p, ids) for p in paths}
    groups = [(i, [p for p in paths if owner[p] == i]) for i in ids]
    alone = [p for p in paths if owner[p] is None]
    return groups + ([(None, alone)] if alone else [])


def _id_in_name(path: Path, ids: list[str]) -> str | None:
    """The one job id of ``ids`` that is a number (or ``A_T``) of the file name, else None."""
    numbers = set(re.findall(r"\d+(?:_\d+)?", Path(path).name)) | set(re.findall(r"\d+", Path(path).name))
    hits = [i for i in ids if i in numbers]
    return hits[0] if len(hits) == 1 else None


def clue_text(path: Path) -> str:
    """The first ``HEAD_BYTES`` (decompressed) of a log, and the last ``HEAD_BYTES`` of a plain one, as
    text ("" when unreadable): where a log names its job and its nodes."""
    head = read_head(path, HEAD_BYTES)
    try:
        with open(path, "rb") as handle:
            gzip = handle.read(2) == b"\x1f\x8b"
            size = os.fstat(handle.fileno()).st_size
    except OSError:
        return head
    if gzip or size <= 2 * HEAD_BYTES:
        return head
    try:
        return head + "\n" + read_tail(path, HEAD_BYTES).text
    except LogError:
        return head


# ---------------------------------------------------------------- the logs of a directory


MAX_ENTRIES = 10000
"""Most directory entries looked at (a directory of a million files is not a job's logs)."""


def log_files(directory: Path, _descend: bool = True) -> list[Path]:
    """The log files of a directory in rank/file order (numbers compared as numbers); for an hpcmem run
    directory without logs of its own, those of its last attempt (one level down, never further: an
    ``attempt-1`` that is a symlink back up cannot loop). Only regular files count (never a FIFO); at most
    ``MAX_ENTRIES`` entries are looked at."""
    directory = Path(directory)
    try:
        entries = []
        for n, p in enumerate(directory.iterdir()):
            if n >= MAX_ENTRIES:
                break
            if _looks_like_log(p.name) and p.is_file():
                entries.append(p)
    except OSError:
        return []
    if not entries and _descend:
        try:
            attempts = sorted((p for p in directory.glob("attempt-*") if _ATTEMPT_DIR.match(p.name) and p.is_dir()),
                              key=lambda p: int(p.name.split("-")[1]))
        except OSError:
            attempts = []
        if attempts:
            return log_files(attempts[-1], _descend=False)
    return sorted(entries, key=lambda p: _natural(p.name))


def _looks_like_log(name: str) -> bool:
    base = name.removesuffix(".gz")
    if base.endswith(_NOT_LOGS) or name.startswith("."):
        return False
    return base.endswith(_LOG_SUFFIXES)


def _natural(name: str) -> list:
    return [int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", name)]
