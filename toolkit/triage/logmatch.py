"""Is a log that names job N the log of this cluster's job N? (pure)

A ticket's ``slurm-1858.out`` may come from another cluster where 1858 was another job. Before
the scheduler's record of job N is merged into a case that starts from a log, what the log shows
is compared with the record (``same_job``):

1. **the path** (decides alone): a log lying at one of the job's own output paths (scontrol's
   StdOut/StdErr, the script's ``--output``/``--error`` pattern expanded, ``slurm-%j.out`` in its
   WorkDir, the hpcmem attempt directory; with or without ``.gz``) is that job's. So is a log in the
   hpcmem attempt directory whose ledger row has that job id.
2. **contradictions** (then it is not the same job, and the record is not used): a node the log
   names (hpcmem's first line, ``*** JOB N ON node``, ``srun: error: node:``, torchrun's
   ``host : node``, NCCL's ``node:pid:tid`` prefix) that is not in the record's NodeList; dated
   lines (``YYYY-MM-DD HH:MM:SS``) all more than a day away from the job's start..end; a log in
   the attempt directory of another hpcmem run or attempt than the record's job name says.
3. **agreement**: the nodes named are all in NodeList, or a date falls within the job's run.
4. Neither: nothing to compare. The record is used (support staff mostly triage their own
   cluster's logs), and ``missing`` says that the id alone tied them.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path

_NODE_PATTERNS = (
    re.compile(r"hpcmem: job \S+ attempt \d+ on (\S+) at"),
    re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON (\S+) CANCELLED"),
    re.compile(r"^srun: error: ([\w.-]+): tasks? [\d,-]+:", re.M),
    re.compile(r"^\s*host\s*: ([\w.-]+)\s*$", re.M),
    re.compile(r"^([A-Za-z][\w.-]*):\d+:\d+ \[\d+\] NCCL ", re.M),
)
_NOT_NODES = {"localhost", "127.0.0.1", "none", "(null)"}
_DATE = re.compile(r"\b(20\d\d-[01]\d-[0-3]\d)[T ][0-2]\d:[0-5]\d:[0-5]\d")
_JOB_NAME_RUN = re.compile(r"\.(\d{8}-\d{6}-[0-9a-f]{4})\.a(\d+)$")
_MAX_NAMED = 5


@dataclass(frozen=True)
class LogClues:
    """What a log shows about the job it came from."""

    path: Path | None
    """Where the log lies (None: standard input)."""
    nodes: frozenset = frozenset()
    """Short node names the log mentions."""
    dates: frozenset = frozenset()
    """Dates (``YYYY-MM-DD``) of its time-stamped lines."""
    attempt: tuple | None = None
    """(run id, attempt) when the log lies in an hpcmem attempt directory."""
    attempt_job_id: str | None = None
    """The job id the ledger holds for that attempt."""


def log_clues(text: str, path: Path | None = None, attempt: tuple | None = None,
              attempt_job_id: str | None = None) -> LogClues:
    """The clues in a log's text (its first and last lines are enough)."""
    nodes = {_short(m.group(1)) for p in _NODE_PATTERNS for m in p.finditer(text)}
    return LogClues(path=path, nodes=frozenset(n for n in nodes if n and n not in _NOT_NODES),
                    dates=frozenset(m.group(1) for m in _DATE.finditer(text)), attempt=attempt,
                    attempt_job_id=attempt_job_id)


def same_job(clues: LogClues, job_id: str, record: dict, expected: list[Path]) -> tuple[bool, str | None]:
    """Whether the log is this cluster's job ``job_id`` (``record``: its sacct/scontrol facts;
    ``expected``: the paths its log would have, ``log_candidates``), and a sentence for ``missing``
    when it is not, or when only the id ties them (see the module docstring)."""
    if clues.path is not None and _at(clues.path, expected):
        return True, None
    if clues.attempt is not None and clues.attempt_job_id == job_id:
        return True, None
    here_nodes = expand_nodelist(record.get("nodes") or "")
    foreign = sorted(clues.nodes - here_nodes) if here_nodes else []
    window = _window(record)
    dated_in = window is not None and any(window[0] <= d <= window[1] for d in _dates(clues.dates))
    dated_out = window is not None and bool(clues.dates) and not dated_in and bool(_dates(clues.dates))
    other_attempt = _other_attempt(clues.attempt, record.get("name") or "")
    where = f"this log ({clues.path})" if clues.path is not None else "this log"
    if foreign or dated_out or other_attempt:
        here = [f"ran on {_nodes(sorted(here_nodes))}" if here_nodes else "ran"]
        if record.get("workdir"):
            here.append(f"from {record['workdir']}")
        if dated_out:
            start, end = str(record.get("start"))[:10], str(record.get("end") or "")[:10]
            here.append(f"on {start}" + (f" to {end}" if _dates([end]) and end != start else ""))
        shows = []
        if foreign:
            shows.append(f"is from {_nodes(foreign)}")
        if dated_out:
            shows.append(f"is dated {_names(sorted(clues.dates))}")
        if other_attempt:
            shows.append(f"lies in {other_attempt}, but job {job_id} here is {record.get('name')}")
        return False, (f"job {job_id} here {' '.join(here)}; {where} {' and '.join(shows)}: not the same job, "
                       f"so this cluster's record of job {job_id} is not used")
    if (clues.nodes and not foreign and here_nodes) or dated_in:
        return True, None
    at = f" is not at job {job_id}'s output path ({_names([str(p) for p in expected])})" if clues.path else ""
    return True, (f"{where}{at} and names no node or date to compare with the record: taken as this cluster's "
                  f"job {job_id} on its id alone")


def expand_nodelist(nodelist: str) -> frozenset:
    """A Slurm node list -> the set of short node names (pure): ``n[01-03,07],gpu-node-9`` ->
    {n01, n02, n03, n07, gpu-node-9}; ``None assigned`` and empty -> empty."""
    out: set[str] = set()
    for item in _split_top(nodelist.strip()):
        if not item or item.lower() in ("none", "none assigned", "(null)"):
            continue
        out |= {_short(n) for n in _expand_one(item)}
    return frozenset(out)


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _expand_one(item: str, limit: int = 100000) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not (low.isascii() and low.isdigit()) or (high and not (high.isascii() and high.isdigit())):
            return [item]
        for number in range(int(low), int(high or low) + 1):
            names.append(f"{prefix}{str(number).zfill(len(low))}")
            if len(names) > limit:
                return names
    return [n for name in names for n in _expand_one(name + rest, limit)]


def _short(name: str) -> str:
    return name.strip().rstrip(":").split(".")[0].lower()


def _at(path: Path, expected: list[Path]) -> bool:
    """Whether ``path`` (or it without ``.gz``) is one of ``expected`` (both resolved)."""
    mine = {_resolved(path), _resolved(Path(str(path).removesuffix(".gz")))}
    return any(_resolved(p) in mine for p in expected)


def _resolved(path: Path) -> str:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError):
        return str(path)


def _dates(texts) -> list[dt.date]:
    out = []
    for text in texts:
        try:
            out.append(dt.date.fromisoformat(text))
        except ValueError:
            continue
    return out


def _window(record: dict) -> tuple[dt.date, dt.date] | None:
    """The job's start..end dates, a day of slack each side (time zones); None when it never started."""
    start = _dates([str(record.get("start") or "")[:10]])
    if not start:
        return None
    end = _dates([str(record.get("end") or "")[:10]]) or start
    day = dt.timedelta(days=1)
    return start[0] - day, max(end[0], start[0]) + day


def _other_attempt(attempt: tuple | None, name: str) -> str | None:
    """'attempt 2 of run R' when the log's hpcmem attempt is not the one the job's name says."""
    match = _JOB_NAME_RUN.search(name)
    if attempt is None or match is None:
        return None
    if (match.group(1), int(match.group(2))) == tuple(attempt):
        return None
    return f"attempt {attempt[1]} of hpcmem run {attempt[0]}"


def _nodes(names: list[str]) -> str:
    return ("node " if len(names) == 1 else "nodes ") + _names(names)


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMED])
    return shown + (f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else "")
