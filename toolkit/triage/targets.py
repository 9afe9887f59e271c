"""What a triage TARGET is, and which scheduler records a typed job id means (pure).

A TARGET is a Slurm job id (``123``, an array task ``123_4``), an hpcmem run id
(``20261121-083000-ab12``, ``RUN:N`` for attempt N), a log file (plain or gzip), a directory
of a job's logs, or ``-`` (standard input).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Callable

from ..backends.base import COMPLETED
from ..errors import HpcmemError

JOB_ID = re.compile(r"^\d+(_\d+)?$")
RUN_ID = re.compile(r"^(\d{8}-\d{6}-[0-9a-f]{4})(?::(\d+))?$")


def special_file(path: str) -> bool:
    """True for a FIFO, socket or device (what ``open`` may block on or stream for ever); False for a regular
    file, a directory, or a path that cannot be looked at."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def target_kind(target: str, exists: Callable[[str], bool] = os.path.exists,
                isdir: Callable[[str], bool] = os.path.isdir, special: Callable[[str], bool] = special_file) -> str:
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
        if special(target):
            raise HpcmemError(f"triage target {target!r} is not a regular file or directory (a FIFO, socket or "
                              "device): give a log file, or pipe it in with -")
        return "dir" if isdir(target) else "file"
    if "/" in target or re.search(r"\.(out|err|log|txt|gz)$", target):
        raise HpcmemError(f"triage target {target!r}: no such file or directory")
    raise HpcmemError(f"triage target {target!r} is not a job id (123, 123_4), a run id (20261121-083000-ab12[:N]), "
                      f"an existing log file or directory, or - (stdin)")


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


def id_order(job_id: str) -> list[int]:
    """Sort key of a job id: ``12_3`` -> [12, 3] (numbers compared as numbers)."""
    return [int(p) for p in re.findall(r"\d+", job_id)]
