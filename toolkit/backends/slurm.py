"""The Slurm backend, and Slurm's text formats.

Three separate steps, as in submitit: ``*_command`` builds an argv, ``_query`` /
``_submit`` run it through ``toolkit.proc`` (with bounded retries), and the
``parse_*`` functions turn Slurm's output into ``JobStatus`` values. The parsers and
the directive readers are pure and tested on literal text.

Polling: one ``sacct -P -n -j ID,ID -o ...`` call *without* ``-X``, so that every job
comes with its steps (``123.batch``, ``123.extern``, ``123.0``). The steps are folded
into their job: the job line gives state, exit code, elapsed time, nodes and reason;
MaxRSS is the largest over the job and its steps (with ``-X`` MaxRSS would be empty, as
it is only measured on steps). When accounting is off or slurmdbd cannot be reached,
or sacct does not know a fresh job yet, the controller is asked instead:
``squeue`` for the jobs it still lists, then ``scontrol show job`` one by one; a job
nobody knows is UNKNOWN.

Retries (one loop, ``base.retrying``): a query that fails with a non-zero exit or a timeout
(socket timed out, controller unreachable, ...) is tried ``tries`` times with ``backoff_s``,
2x, 4x ... between tries, then raises ``SchedulerError``. ``sbatch`` is retried only when the
controller could not be contacted at all: any other failure may have created the job,
and submitting twice is worse than failing once. An sbatch that timed out, or a controller
still unreachable after the tries, raises ``MaybeSubmittedError``: the controller keeps the
attempt ``submitting`` and looks the job up by name before it submits again.

Environment: jobs started from inside another Slurm job must behave as from a login
node, so every Slurm command runs without the caller's ``SLURM_*``, ``SBATCH_*``,
``SRUN_*`` and ``SALLOC_*`` variables (``SLURM_CONF`` stays: it says where the cluster's
configuration is, not what the calling job was).
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

from .. import proc
from ..errors import CommandError, MaybeSubmittedError, SchedulerError
from .base import (
    ACTIVE_STATES, CANCELLED, FAILED, OUT_OF_MEMORY, PENDING, RETRY, RUNNING, STATES, UNKNOWN,
    Backend, JobStatus, retrying,
)

SACCT_FIELDS = ("JobID", "State", "ExitCode", "Elapsed", "MaxRSS", "NodeList", "Reason")
SQUEUE_FORMAT = "%i|%T|%r|%N|%M"  # job id, long state, reason, nodes, time used

# Slurm states that are not in the normalized vocabulary, and what they mean for us.
_STATE_ALIASES = {
    "REQUEUED": PENDING, "REQUEUE_FED": PENDING, "REQUEUE_HOLD": PENDING, "RESV_DEL_HOLD": PENDING,
    "CONFIGURING": PENDING, "POWER_UP_NODE": PENDING,
    "SUSPENDED": RUNNING, "STOPPED": RUNNING, "SIGNALING": RUNNING, "STAGE_OUT": RUNNING,
    "RESIZING": RUNNING, "UPDATE_DB": RUNNING,
    "REVOKED": CANCELLED, "SPECIAL_EXIT": FAILED,
}
_SLURM_STATES = tuple(s for s in STATES if s != UNKNOWN) + tuple(_STATE_ALIASES)

# Messages that mean "ask the controller instead", not "try again".
_ACCOUNTING_OFF = (
    "accounting storage is disabled",
    "problem talking to the database",
    "slurmdbd",
)
_INVALID_JOB = "invalid job id specified"
_ALREADY_DONE = ("already completing or completed", "job has already finished")
# The only sbatch failure that certainly did not create a job.
_SBATCH_NOT_CONNECTED = "unable to contact slurm controller"
# sbatch failures after which the job may exist all the same (the controller may have queued it).
_SBATCH_MAYBE_QUEUED = ("socket timed out", "timed out on send/recv", "zero bytes were transmitted or received")

_JOB_ID = re.compile(r"^\d+(_\d+)?$")
_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
_ENV_KEEP = frozenset({"SLURM_CONF"})


# ---------------------------------------------------------------- pure: values


def normalize_state(text: str) -> str:
    """Slurm's state text -> one of ``STATES``.

    Handles ``CANCELLED by 1000``, fixed-width truncation (``OUT_OF_ME+``) and Slurm
    states outside the vocabulary (REQUEUED -> PENDING, SUSPENDED -> RUNNING ...).
    Anything unrecognised is UNKNOWN.
    """
    words = text.strip().upper().split()
    if not words:
        return UNKNOWN
    word = words[0]
    if word.endswith("+"):
        prefix = word[:-1]
        meanings = {_STATE_ALIASES.get(s, s) for s in _SLURM_STATES if s.startswith(prefix)}
        return meanings.pop() if len(meanings) == 1 else UNKNOWN
    if word in _STATE_ALIASES:
        return _STATE_ALIASES[word]
    return word if word in STATES else UNKNOWN


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """``"code:signal"`` -> (code, signal); empty or malformed -> (None, None)."""
    code, sep, sig = text.strip().partition(":")
    try:
        return int(code), int(sig) if sep else 0
    except ValueError:
        return None, None


def parse_duration_s(text: str) -> float | None:
    """Slurm elapsed time ``[D-][HH:]MM:SS[.mmm]`` -> seconds; empty/INVALID/UNLIMITED -> None."""
    text = text.strip()
    days = 0
    if "-" in text:
        day_text, _, text = text.partition("-")
        if not day_text.isdigit():
            return None
        days = int(day_text)
    parts = text.split(":")
    if not 2 <= len(parts) <= 3:
        return None
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        return None
    seconds = 0.0
    for number in numbers:
        seconds = seconds * 60 + number
    return days * 86400 + seconds


def parse_mem_mib(text: str, default_unit: str = "B") -> float | None:
    """A Slurm memory size -> MiB: ``1234K``, ``12.5M``, ``2G``, ``1T``; empty -> None.

    A bare number is in ``default_unit``: bytes for sacct's MaxRSS, megabytes for
    sbatch's ``--mem``.
    """
    text = text.strip().upper()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTP]?)B?", text)
    if not match:
        return None
    number, unit = float(match.group(1)), match.group(2) or default_unit.upper()
    scale = {"B": 1 / 1024**2, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2, "P": 1024**3}[unit]
    return number * scale


def parse_time_limit_s(text: str) -> float | None:
    """sbatch ``--time`` -> seconds; UNLIMITED/INFINITE/empty -> None.

    Forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.
    """
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days = 0
    if "-" in text:
        day_text, _, text = text.partition("-")
        days = int(day_text)
        parts = [int(p) for p in text.split(":")]
        parts += [0] * (3 - len(parts))  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = parts
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, (minutes, seconds) = 0, parts
        else:
            hours, minutes, seconds = parts
    return float(days * 86400 + hours * 3600 + minutes * 60 + seconds)


def _none_if_empty(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "None", "(null)", "None assigned", "n/a") else text


def _expand_job_ids(text: str) -> list[str]:
    """``123``, ``123_4`` -> itself; a pending array ``123_[1-3,7%2]`` -> each task id."""
    match = re.fullmatch(r"(\d+)_\[([\d,\-]+)(%\d+)?\]", text)
    if not match:
        return [text]
    base, ids = match.group(1), []
    for part in match.group(2).split(","):
        low, _, high = part.partition("-")
        ids += [f"{base}_{n}" for n in range(int(low), int(high or low) + 1)]
    return ids


def _status(job_id, state_text, *, exit_text="", elapsed_text="", rss_mib=None, node="", reason="", raw=""):
    state = normalize_state(state_text)
    code, sig = parse_exit_code(exit_text) if state not in ACTIVE_STATES else (None, None)
    reason = _none_if_empty(reason)
    by = re.match(r"CANCELLED by (\d+)", state_text.strip())
    if by and reason is None:
        reason = f"cancelled by uid {by.group(1)}"
    return JobStatus(
        job_id=job_id, state=state, exit_code=code, signal=sig, elapsed_s=parse_duration_s(elapsed_text),
        max_rss_mib=rss_mib, node=_none_if_empty(node), reason=reason, raw=raw,
    )


# ---------------------------------------------------------------- pure: parsers


def parse_sbatch(text: str) -> str:
    """``sbatch --parsable`` output (``jobid[;cluster]``) -> the job id.

    Warnings may precede the id; the id is the last non-empty line. The cluster
    suffix is dropped (hpcmem talks to one cluster).
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    job_id = lines[-1].split(";")[0].strip() if lines else ""
    if not _JOB_ID.match(job_id):
        raise SchedulerError(f"sbatch printed no job id: {text.strip()!r}")
    return job_id


def parse_sacct(text: str) -> dict[str, JobStatus]:
    """``sacct -P -n -o JobID,State,ExitCode,Elapsed,MaxRSS,NodeList,Reason`` -> status per job.

    Step lines (``123.batch``, ``123.0``, ``123_4.extern``) are folded into their job:
    MaxRSS is the largest of the job and its steps; a FAILED job with an
    OUT_OF_MEMORY step is OUT_OF_MEMORY; a PENDING job with steps is RUNNING (slurmdbd
    can lag behind the job's first step). Array tasks keep their ``123_4`` id.
    """
    jobs: dict[str, list[str]] = {}
    steps: dict[str, list[list[str]]] = {}
    raw: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|", len(SACCT_FIELDS) - 1)
        fields += [""] * (len(SACCT_FIELDS) - len(fields))
        job_id, _, step = fields[0].strip().partition(".")
        for one in _expand_job_ids(job_id):
            raw.setdefault(one, []).append(line)
            if step:
                steps.setdefault(one, []).append(fields)
            else:
                jobs[one] = fields
    out = {}
    for job_id, (_jid, state, exit_code, elapsed, rss, nodes, reason) in jobs.items():
        rss_values = [parse_mem_mib(f[4]) for f in [jobs[job_id], *steps.get(job_id, [])]]
        rss_values = [v for v in rss_values if v is not None]
        status = _status(
            job_id, state, exit_text=exit_code, elapsed_text=elapsed, rss_mib=max(rss_values, default=None),
            node=nodes, reason=reason, raw="\n".join(raw[job_id]),
        )
        job_steps = steps.get(job_id, [])
        oom_steps = [f[0] for f in job_steps if normalize_state(f[1]) == OUT_OF_MEMORY]
        if status.state == FAILED and oom_steps:
            status = replace(status, state=OUT_OF_MEMORY, reason=f"step {oom_steps[0]} ran out of memory")
        elif status.state == PENDING and job_steps:
            # slurmdbd records the job's start after its first step: a step means it runs.
            status = replace(status, state=RUNNING, reason=None)
        out[job_id] = status
    return out


def parse_squeue(text: str) -> dict[str, JobStatus]:
    """``squeue -h -o '%i|%T|%r|%N|%M'`` -> status per job (no exit codes: squeue has none)."""
    out = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        fields += [""] * (5 - len(fields))
        job_id, state, reason, nodes, used = (f.strip() for f in fields[:5])
        for one in _expand_job_ids(job_id):
            out[one] = _status(one, state, elapsed_text=used, node=nodes, reason=reason, raw=line)
    return out


def parse_scontrol(text: str) -> dict[str, JobStatus]:
    """``scontrol show job -o ID`` (one ``Key=Value ...`` line per job) -> status per job.

    An array task is keyed ``ArrayJobId_ArrayTaskId`` like everywhere else.
    """
    out = {}
    for line in text.splitlines():
        pairs = parse_key_values(line)
        if "JobId" not in pairs or "JobState" not in pairs:
            continue
        job_id = pairs["JobId"]
        task = pairs.get("ArrayTaskId", "")
        if task.isdigit() and pairs.get("ArrayJobId", "").isdigit():
            job_id = f"{pairs['ArrayJobId']}_{task}"
        out[job_id] = _status(
            job_id, pairs["JobState"], exit_text=pairs.get("ExitCode", ""), elapsed_text=pairs.get("RunTime", ""),
            node=pairs.get("NodeList", ""), reason=pairs.get("Reason", ""), raw=line.strip(),
        )
    return out


def parse_key_values(line: str) -> dict[str, str]:
    """scontrol's one-line ``Key=Value Key=Value`` -> dict.

    A value may contain ``=`` (``TRES=cpu=1,mem=6G``) or spaces (``Command=/my runs/x``):
    a word that does not start with ``Key=`` continues the previous value.
    """
    pairs: dict[str, str] = {}
    key = None
    for word in line.split():
        match = re.match(r"([A-Za-z][A-Za-z0-9_/:]*)=(.*)", word)
        if match:
            key, value = match.groups()
            pairs[key] = value
        elif key is not None:
            pairs[key] += " " + word
    return pairs


def first_error_line(text: str) -> str:
    """Slurm's own message from a command's output: the first ``error:`` line, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error:" in line.lower():
            return line
    return lines[-1] if lines else ""


# ---------------------------------------------------------------- pure: job scripts and environment


_SHORT_OPTIONS = {
    "-J": "job-name", "-t": "time", "-o": "output", "-e": "error", "-p": "partition", "-N": "nodes",
    "-n": "ntasks", "-c": "cpus-per-task", "-G": "gpus", "-D": "chdir", "-A": "account", "-q": "qos",
    "-C": "constraint",
}


def read_directives(script_text: str) -> dict[str, str]:
    """The ``#SBATCH`` options of a job script, long names without dashes -> value.

    Like sbatch, reading stops at the first line that is neither blank nor a comment.
    ``--mem=4G``, ``--mem 4G``, ``-t 10`` and quoted values are understood; a flag
    without a value maps to ``""``; a later option overrides an earlier one.
    """
    options: dict[str, str] = {}
    for line in script_text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break
        if not stripped.startswith("#SBATCH"):
            continue
        try:
            words = shlex.split(stripped[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        i = 0
        while i < len(words):
            word = words[i]
            if word.startswith("--"):
                name, sep, value = word[2:].partition("=")
                if not sep and i + 1 < len(words) and not words[i + 1].startswith("-"):
                    value, i = words[i + 1], i + 1
                options[name] = value
            elif word[:2] in _SHORT_OPTIONS:
                name, value = _SHORT_OPTIONS[word[:2]], word[2:]
                if not value and i + 1 < len(words):
                    value, i = words[i + 1], i + 1
                options[name] = value.lstrip("=")
            i += 1
    return options


def gpus_requested(directives: Mapping[str, str]) -> int:
    """GPUs per node a job script asks for (``--gpus-per-node``, ``--gres=gpu``, ``--gpus``); 0 if none."""
    for key in ("gpus-per-node", "gpus"):
        if key in directives:
            count = directives[key].rsplit(":", 1)[-1]
            return int(count) if count.isdigit() else 1
    for gres in directives.get("gres", "").split(","):
        parts = gres.split(":")
        if parts[0] == "gpu":
            return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return 0


def clean_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without what a calling Slurm job leaves behind (see the module docstring)."""
    return {k: v for k, v in environ.items() if k in _ENV_KEEP or not k.startswith(_ENV_PREFIXES)}


# ---------------------------------------------------------------- pure: commands


def sbatch_command(script: Path, *, test_only: bool = False) -> list[str]:
    return ["sbatch", "--test-only" if test_only else "--parsable", os.fspath(script)]


def sacct_command(job_ids: Iterable[str]) -> list[str]:
    return ["sacct", "-P", "-n", "-j", ",".join(job_ids), "-o", ",".join(SACCT_FIELDS)]


def squeue_command(job_ids: Iterable[str]) -> list[str]:
    return ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", SQUEUE_FORMAT]


def scontrol_command(job_id: str) -> list[str]:
    return ["scontrol", "show", "job", "-o", job_id]


def find_squeue_command(job_name: str) -> list[str]:
    return ["squeue", "-h", "-t", "all", f"--name={job_name}", "-o", "%i"]


def find_sacct_command(job_name: str) -> list[str]:
    return ["sacct", "-n", "-X", "-P", f"--name={job_name}", "-S", "now-30days", "-o", "JobID"]


def parse_job_ids(text: str) -> list[str]:
    """Job ids, one per line (blank lines ignored), sorted oldest first."""
    ids = [line.strip() for line in text.splitlines() if line.strip()]
    return sorted(set(ids), key=lambda i: [int(p) for p in re.findall(r"\d+", i)] or [0])


def scancel_command(job_ids: Iterable[str]) -> list[str]:
    return ["scancel", *job_ids]


# ---------------------------------------------------------------- pure: job facts (for triage)

SACCT_FACT_FIELDS = (
    "JobID", "JobIDRaw", "JobName", "User", "Partition", "Cluster", "State", "ExitCode", "Elapsed", "Timelimit",
    "MaxRSS", "ReqTRES", "AllocTRES", "NodeList", "WorkDir", "Submit", "Start", "End", "Reason",
)
"""What ``sacct_facts_command`` asks for: everything triage says about a job."""

_ARRAY_TASK = re.compile(r"^(\d+)_(\d+)$")
_BATCH_HEADER = re.compile(r"^Batch Script for (\S+)\s*$")


def sacct_facts_command(job_ids: Iterable[str]) -> list[str]:
    """``sacct`` for the facts of many jobs in one call (with their steps: no ``-X``).

    A bare array job id (``123``) brings all its tasks (``123_1``, ``123_2`` ...).
    """
    return ["sacct", "-P", "-n", "-j", ",".join(job_ids), "-o", ",".join(SACCT_FACT_FIELDS)]


WINDOW_STATES = "BF,CA,DL,F,NF,OOM,PR,TO"
"""The states ``sacct_window_command`` asks for: every way a job can end badly."""


def sacct_window_command(start: str, end: str, *, partition: str | None = None, user: str | None = None) -> list[str]:
    """``sacct`` for every job that ended badly between ``start`` and ``end`` (sacct times, e.g.
    ``2026-11-21T08:00:00``), all users unless ``user``, with their steps; fields as ``sacct_facts_command``."""
    argv = ["sacct", "-P", "-n", "-S", start, "-E", end, "-s", WINDOW_STATES, "-o", ",".join(SACCT_FACT_FIELDS)]
    argv += ["-u", user] if user else ["-a"]
    return argv + (["-r", partition] if partition else [])


def sacct_time(seconds: float) -> str:
    """Unix seconds -> sacct's local ``YYYY-MM-DDTHH:MM:SS`` (sacct reads times in the local zone)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(seconds))


def batch_script_command(job_ids: Iterable[str]) -> list[str]:
    """``sacct -B``: the batch scripts accounting kept (needs ``AccountingStoreFlags=job_script``)."""
    return ["sacct", "-B", "-j", ",".join(job_ids)]


def scontrol_all_command() -> list[str]:
    """``scontrol show job -o``: every job the controller still remembers, one line each."""
    return ["scontrol", "show", "job", "-o"]


def parse_tres(text: str) -> dict[str, str]:
    """A TRES list ``billing=1,cpu=8,mem=6G,node=1,gres/gpu=2`` -> ``{"cpu": "8", "mem": "6G", ...}``."""
    out = {}
    for item in text.strip().split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_sacct_facts(text: str) -> dict[str, dict]:
    """``sacct -P -n -o <SACCT_FACT_FIELDS>`` -> one dict of facts per job (array tasks as ``123_4``).

    Steps are folded into their job as ``parse_sacct`` does (MaxRSS in MiB is the largest of the
    job and its steps; a FAILED job with an OUT_OF_MEMORY step is OUT_OF_MEMORY) and listed under
    ``steps``. Keys: job_id, raw_id, array_job_id, array_task_id, name, user, partition, cluster,
    state (normalized), state_text, exit_code, signal, elapsed_s, timelimit_s, max_rss_mib,
    req_tres, alloc_tres (dicts), nodes, workdir, submit, start, end, reason, steps.
    """
    width = len(SACCT_FACT_FIELDS)
    jobs: dict[str, dict[str, str]] = {}
    steps: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        values = line.split("|", width - 1)
        values += [""] * (width - len(values))
        row = dict(zip(SACCT_FACT_FIELDS, (v.strip() for v in values)))
        job_id, _, step = row["JobID"].partition(".")
        for one in _expand_job_ids(job_id):
            if step:
                steps.setdefault(one, []).append({**row, "step": f"{one}.{step}"})
            else:
                jobs[one] = {**row, "JobIDRaw": row["JobIDRaw"] if one == job_id else ""}
    return {job_id: _sacct_job_facts(job_id, row, steps.get(job_id, [])) for job_id, row in jobs.items()}


def _sacct_job_facts(job_id: str, row: Mapping[str, str], steps: list[dict[str, str]]) -> dict:
    rss = [parse_mem_mib(r["MaxRSS"]) for r in [row, *steps]]
    rss = [v for v in rss if v]  # 0: the step was never sampled (killed first), not "used nothing"
    status = _status(job_id, row["State"], exit_text=row["ExitCode"], elapsed_text=row["Elapsed"],
                     rss_mib=max(rss, default=None), node=row["NodeList"], reason=row["Reason"])
    oom_steps = [s["step"] for s in steps if normalize_state(s["State"]) == OUT_OF_MEMORY]
    state, reason = status.state, status.reason
    if state == FAILED and oom_steps:
        state, reason = OUT_OF_MEMORY, f"step {oom_steps[0]} ran out of memory"
    elif state == PENDING and steps:
        state, reason = RUNNING, None
    return {
        **_array_ids(job_id),
        "job_id": job_id, "raw_id": _none_if_empty(row["JobIDRaw"]),
        "name": _none_if_empty(row["JobName"]), "user": _none_if_empty(row["User"]),
        "partition": _none_if_empty(row["Partition"]), "cluster": _none_if_empty(row["Cluster"]),
        "state": state, "state_text": row["State"], "exit_code": status.exit_code, "signal": status.signal,
        "elapsed_s": status.elapsed_s, "timelimit_s": parse_duration_s(row["Timelimit"]),
        "max_rss_mib": status.max_rss_mib, "req_tres": parse_tres(row["ReqTRES"]),
        "alloc_tres": parse_tres(row["AllocTRES"]), "nodes": status.node, "workdir": _none_if_empty(row["WorkDir"]),
        "submit": _time_or_none(row["Submit"]), "start": _time_or_none(row["Start"]), "end": _time_or_none(row["End"]),
        "reason": reason,
        "steps": [_step_facts(s) for s in steps],
    }


def _step_facts(row: Mapping[str, str]) -> dict:
    code, sig = parse_exit_code(row["ExitCode"])
    return {"step": row["step"], "name": _none_if_empty(row["JobName"]), "state": normalize_state(row["State"]),
            "exit_code": code, "signal": sig, "max_rss_mib": parse_mem_mib(row["MaxRSS"])}


def _array_ids(job_id: str) -> dict:
    match = _ARRAY_TASK.match(job_id)
    return {"array_job_id": match.group(1) if match else None, "array_task_id": match.group(2) if match else None}


def _time_or_none(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "Unknown", "None", "N/A") else text


def parse_batch_scripts(text: str) -> dict[str, str]:
    """``sacct -B -j ID,...`` -> job id -> the batch script accounting kept.

    Each script follows a ``Batch Script for ID`` line and a line of dashes; a job whose
    script was not kept (``NONE``: stored before ``AccountingStoreFlags=job_script``) is left out.
    """
    lines = text.splitlines()
    starts = [i for i in range(len(lines) - 1)
              if _BATCH_HEADER.match(lines[i]) and lines[i + 1].strip() and set(lines[i + 1].strip()) == {"-"}]
    out = {}
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        body = "\n".join(lines[i + 2:end]).rstrip("\n")
        if body.strip() and body.strip() != "NONE":
            out[_BATCH_HEADER.match(lines[i]).group(1)] = body + "\n"
    return out


def parse_scontrol_facts(text: str) -> dict[str, dict]:
    """``scontrol show job -o`` -> facts per job, with the keys of ``parse_sacct_facts`` (no steps,
    no MaxRSS: the controller does not measure) plus ``stdout``, ``stderr`` and ``command`` (paths).

    Array tasks are keyed ``ArrayJobId_ArrayTaskId``; a pending array's ``1-3`` task range is skipped.
    """
    out = {}
    for line in text.splitlines():
        pairs = parse_key_values(line)
        if "JobId" not in pairs or "JobState" not in pairs:
            continue
        job_id, task = pairs["JobId"], pairs.get("ArrayTaskId", "")
        if pairs.get("ArrayJobId", "").isdigit():
            if not task.isdigit():
                continue
            job_id = f"{pairs['ArrayJobId']}_{task}"
        status = _status(job_id, pairs["JobState"], exit_text=pairs.get("ExitCode", ""),
                         elapsed_text=pairs.get("RunTime", ""), node=pairs.get("NodeList", ""),
                         reason=pairs.get("Reason", ""))
        tres = pairs.get("TRES", "")
        out[job_id] = {
            **_array_ids(job_id),
            "job_id": job_id, "raw_id": pairs["JobId"], "name": _none_if_empty(pairs.get("JobName", "")),
            "user": _none_if_empty(pairs.get("UserId", "").split("(")[0]),
            "partition": _none_if_empty(pairs.get("Partition", "")), "cluster": None,
            "state": status.state, "state_text": pairs["JobState"], "exit_code": status.exit_code,
            "signal": status.signal, "elapsed_s": status.elapsed_s,
            "timelimit_s": parse_duration_s(pairs.get("TimeLimit", "")), "max_rss_mib": None,
            "req_tres": parse_tres(pairs.get("ReqTRES", tres)), "alloc_tres": parse_tres(tres),
            "nodes": status.node, "workdir": _none_if_empty(pairs.get("WorkDir", "")),
            "submit": _time_or_none(pairs.get("SubmitTime", "")), "start": _time_or_none(pairs.get("StartTime", "")),
            "end": _time_or_none(pairs.get("EndTime", "")), "reason": status.reason, "steps": [],
            "stdout": _none_if_empty(pairs.get("StdOut", "")), "stderr": _none_if_empty(pairs.get("StdErr", "")),
            "command": _none_if_empty(pairs.get("Command", "")),
        }
    return out


_FILENAME_FIELD = re.compile(r"%(\d*)([%AajJNnstux])")


def expand_filename_pattern(pattern: str, *, job_id: str, raw_id: str | None = None, user: str | None = None,
                            job_name: str | None = None, node: str | None = None) -> str:
    """An sbatch ``--output``/``--error`` pattern -> the file name of the batch step's output.

    ``job_id`` is ``123`` or ``123_4`` (array task); ``raw_id`` the task's own job id (``%j``;
    when unknown: the job id, or for a task the array's id, which is right for its last task). ``%A`` array job, ``%a`` task, ``%j`` job id, ``%J`` ``jobid.batch``,
    ``%x`` name, ``%u`` user, ``%N`` first node, ``%n``/``%t`` 0, ``%s`` ``batch``, ``%%`` ``%``;
    a number after ``%`` zero-pads (``%4a``). A pattern holding ``\\\\`` is taken literally, as sbatch does.
    """
    if "\\\\" in pattern:
        return pattern.replace("\\\\", "")
    match = _ARRAY_TASK.match(job_id)
    array_job, task = (match.group(1), match.group(2)) if match else (job_id, "4294967294")
    own = raw_id or array_job
    values = {"A": array_job, "a": task, "j": own, "J": f"{own}.batch", "x": job_name or "", "u": user or "",
              "N": _first_node(node or ""), "n": "0", "t": "0", "s": "batch"}

    def sub(m: re.Match) -> str:
        width, code = m.groups()
        if code == "%":
            return "%" + width
        value = values[code]
        return value.zfill(int(width)) if width and value.isdigit() else value
    return _FILENAME_FIELD.sub(sub, pattern)


def _first_node(nodelist: str) -> str:
    """``n[01-04,07],m1`` -> ``n01``; ``vm`` -> ``vm``."""
    match = re.match(r"([^,\[]*)(?:\[([^\],-]+))?", nodelist.strip())
    return (match.group(1) + (match.group(2) or "")) if match else ""


# ---------------------------------------------------------------- the backend


class SlurmBackend(Backend):
    """Submits with sbatch, polls with sacct (or squeue/scontrol), cancels with scancel."""

    name = "slurm"

    def __init__(
        self,
        *,
        tries: int = 3,
        backoff_s: float = 1.0,
        timeout_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        """``tries``: attempts per query; ``backoff_s``: first pause between them (doubles);
        ``timeout_s``: limit per command; ``sleep`` is replaceable to keep tests fast."""
        if tries < 1:
            raise ValueError(f"tries must be at least 1, got {tries}")
        self.tries, self.backoff_s, self.timeout_s, self._sleep = tries, backoff_s, timeout_s, sleep

    # -- submit

    def submit(self, script: Path, attempt_dir: Path) -> str:
        """``sbatch --parsable SCRIPT`` from ``attempt_dir`` (so SLURM_SUBMIT_DIR is the attempt)."""
        done = self._sbatch(sbatch_command(Path(script).resolve()), Path(attempt_dir))
        return parse_sbatch(done.stdout)

    def test_only(self, script: Path) -> str:
        """``sbatch --test-only``: Slurm's message (``sbatch: Job N to start at ... in partition P``)."""
        script = Path(script).resolve()
        done = self._sbatch(sbatch_command(script, test_only=True), script.parent)
        lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return lines[-1] if lines else "sbatch: job accepted"

    def _sbatch(self, argv: list[str], cwd: Path) -> proc.Completed:
        """sbatch, retried only while the controller cannot be contacted (nothing was created then)."""
        def judge(exc: CommandError, last: bool):
            if isinstance(exc, proc.CommandTimeoutError):
                raise MaybeSubmittedError(
                    f"sbatch did not answer within {self.timeout_s:g} s; the job may or may not have been "
                    f"submitted (check squeue)") from exc
            message = _message(exc)
            if any(m in message.lower() for m in _SBATCH_MAYBE_QUEUED):
                raise MaybeSubmittedError(f"{message} (the job may have been queued all the same)") from exc
            if _SBATCH_NOT_CONNECTED not in message.lower():
                raise SchedulerError(message) from exc
            if last:  # nothing was submitted, but the refusal is the controller's absence, not the job's
                raise MaybeSubmittedError(f"{message} (tried {self.tries} times; the next step tries again)") from exc
            return RETRY
        return self._retrying(lambda: proc.run(argv, timeout=self.timeout_s, env=clean_environment(os.environ), cwd=cwd),
                              judge)

    def _retrying(self, call, judge):
        return retrying(call, judge, tries=self.tries, pause=self._pause)

    # -- poll

    def poll(self, job_ids: list[str]) -> dict[str, JobStatus]:
        ids = _check_ids(job_ids)
        if not ids:
            return {}
        found: dict[str, JobStatus] = {}
        why_missing = "not known to sacct, squeue or scontrol"
        try:
            found = parse_sacct(self._query(sacct_command(ids)))
        except _AccountingUnavailable as exc:
            why_missing = f"accounting unavailable ({exc}) and the controller no longer lists it"
        missing = [i for i in ids if i not in found]
        if missing:
            found.update(parse_squeue(self._query(squeue_command(missing))))
        # squeue has no exit code: a job it shows as ended (sacct not caught up yet) is asked of scontrol too
        ended = [i for i in missing if i in found and found[i].finished]
        for job_id in [i for i in ids if i not in found] + ended:
            found.update(parse_scontrol(self._query(scontrol_command(job_id))))
        return {i: found.get(i) or JobStatus(i, UNKNOWN, reason=why_missing) for i in ids}

    def _query(self, argv: list[str]) -> str:
        """Run a read-only Slurm command with bounded retries; an unknown job id is empty output."""
        def judge(exc: CommandError, last: bool):
            message = _message(exc)
            low = message.lower()
            if _INVALID_JOB in low:
                return proc.Completed(argv, exc.returncode or 1, "", exc.stderr)
            if argv[0] == "sacct" and any(m in low for m in _ACCOUNTING_OFF):
                raise _AccountingUnavailable(message) from exc
            if last:
                raise SchedulerError(f"{argv[0]} failed {self.tries} times: {message}") from exc
            return RETRY
        return self._retrying(lambda: proc.run(argv, timeout=self.timeout_s, env=clean_environment(os.environ)),
                              judge).stdout

    # -- find

    def find(self, job_name: str, attempt_dir: Path) -> str | None:
        """The newest job called ``job_name``: squeue first (it knows a job the moment sbatch returns), then sacct."""
        ids = parse_job_ids(self._query(find_squeue_command(job_name)))
        if not ids:
            try:
                ids = parse_job_ids(self._query(find_sacct_command(job_name)))
            except _AccountingUnavailable:
                ids = []
        return ids[-1] if ids else None

    # -- cancel

    def cancel(self, job_ids: list[str]) -> None:
        ids = _check_ids(job_ids)
        if not ids:
            return
        def judge(exc: CommandError, last: bool):
            message = _message(exc)
            low = message.lower()
            if _INVALID_JOB in low or any(m in low for m in _ALREADY_DONE):
                return None  # finished (or forgotten) jobs need no cancelling
            if last:
                raise SchedulerError(f"scancel failed {self.tries} times: {message}") from exc
            return RETRY
        self._retrying(lambda: proc.run(scancel_command(ids), timeout=self.timeout_s, env=clean_environment(os.environ)),
                       judge)

    # -- facts (triage)

    def job_facts(self, job_ids: list[str]) -> dict[str, dict]:
        """Everything sacct knows of the jobs, in one call (``parse_sacct_facts``); a bare array
        job id brings its tasks, an unknown id is simply absent. Raises ``SchedulerError``
        ("accounting unavailable: ...") when accounting is off or slurmdbd cannot be reached, and
        ``proc.CommandNotFoundError`` when sacct is not installed."""
        ids = _check_ids(job_ids)
        if not ids:
            return {}
        return parse_sacct_facts(self._accounting(sacct_facts_command(ids)))

    def failed_jobs(self, start_s: float, end_s: float, *, partition: str | None = None,
                    user: str | None = None) -> dict[str, dict]:
        """Facts (``parse_sacct_facts``) of every job that ended badly between ``start_s`` and ``end_s``
        (unix seconds), in one sacct call; errors as ``job_facts``."""
        argv = sacct_window_command(sacct_time(start_s), sacct_time(end_s), partition=partition, user=user)
        return parse_sacct_facts(self._accounting(argv))

    def batch_scripts(self, job_ids: list[str]) -> dict[str, str]:
        """The batch scripts accounting kept (``sacct -B``, one call); jobs without one are absent.
        Errors as ``job_facts``."""
        ids = _check_ids(job_ids)
        if not ids:
            return {}
        return parse_batch_scripts(self._accounting(batch_script_command(ids)))

    def _accounting(self, argv: list[str]) -> str:
        """``_query`` for the accounting queries triage makes: accounting off is a SchedulerError."""
        try:
            return self._query(argv)
        except _AccountingUnavailable as exc:
            raise SchedulerError(f"accounting unavailable: {exc}") from exc

    def controller_facts(self, job_ids: list[str], one_by_one_max: int = 10) -> dict[str, dict]:
        """What the controller still remembers of the jobs (``parse_scontrol_facts``: StdOut, StdErr,
        Command, WorkDir ...; it forgets a job MinJobAge after it ends). Up to ``one_by_one_max`` ids are
        asked one by one, more with one ``scontrol show job`` of every job. A bare array id brings its tasks."""
        ids = _check_ids(job_ids)
        if len(ids) > one_by_one_max:
            found = parse_scontrol_facts(self._query(scontrol_all_command()))
            wanted = set(ids)
            return {k: v for k, v in found.items()
                    if k in wanted or v["raw_id"] in wanted or v["array_job_id"] in wanted}
        found = {}
        for job_id in ids:
            found.update(parse_scontrol_facts(self._query(scontrol_command(job_id))))
        return found

    def _pause(self, attempt: int) -> None:
        self._sleep(self.backoff_s * 2 ** (attempt - 1))


def _message(exc: CommandError) -> str:
    """Slurm's own words from a failed command (its first ``error:`` line), else the error itself."""
    return first_error_line(exc.stderr + "\n" + exc.stdout) or str(exc)


class _AccountingUnavailable(Exception):
    """sacct cannot answer because accounting is off or slurmdbd is unreachable."""


def _check_ids(job_ids: Iterable[str]) -> list[str]:
    ids = list(dict.fromkeys(str(i) for i in job_ids))
    for job_id in ids:
        if not _JOB_ID.match(job_id):
            raise SchedulerError(f"not a Slurm job id: {job_id!r}")
    return ids
