"""What triage found, as data: one ``Finding`` per job or log, and the ``--since`` summary.

The JSON these produce is a documented interface for helpdesk tooling (docs/triage.md,
docs/triage.schema.json): field names are stable, memory is in MiB, times in seconds, and a
field that could not be found is null (never left out).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .. import __version__

SCHEMA = "hpcmem.triage/6"
"""/2 (issue 12): the verdict gains cause, confidence, confirm, phase, step, total_steps.
/3 (issue 14): a finding gains ``peaks`` (the data-driven case: toolkit/peaks.py), ``memory_snapshots`` and
``inflight_moves`` (what in-job recovery answered before this ending).
/4 (issue 11): the verdict gains ``deepspeed_version`` (the DeepSpeed the log names, under which the memory
picture and the remedies are estimated).
/5 (issue 11): the job gains ``runtime`` (``estimate.gpu.Runtime`` fields its files state: ``fsdp_no_sync``).
/6 (issue 11): the job gains ``accelerator_config`` (the HF Trainer's flag as written, which the sync_each_batch
remedy merges into)."""
SINCE_SCHEMA = "hpcmem.triage-since/2"
"""/2 (issue 12): a group gains hint and phases; each job its cause, confidence, phase, step, total_steps."""


@dataclass(frozen=True)
class Finding:
    """The diagnosis of one case (a job, an attempt of a run, a log file or a pasted log)."""

    target: str
    """The TARGET as typed."""
    source: str
    """job | run | file | dir | stdin"""
    verdict: Any
    """toolkit.classify.Verdict"""
    facts: Any
    """toolkit.triage.facts.JobFacts"""
    log_paths: tuple = ()
    site: str | None = None
    partition: str | None = None
    plan: Any = None
    """toolkit.plan.Plan as the job ran (known or completed with assumptions), or None."""
    plan_assumed: tuple = ()
    """Knobs of ``plan`` that were not found and took a default."""
    picture: Any = None
    """toolkit.triage.picture.MemoryPicture, for out-of-memory verdicts."""
    remedies: tuple = ()
    """toolkit.triage.remedies.Remedy, best first; empty for failures that are not out-of-memory."""
    where_to_look: tuple = ()
    """For failures that are not out-of-memory: what the failure is and where to look, one sentence each."""
    notes: tuple = ()
    """What a person must know about how this was read (assumptions, what could not be read)."""
    peaks: dict | None = None
    """For an OOM with the attempt's step series: ``peaks.PeakDiagnosis.to_dict()`` (case long_batch, leak,
    first_step or null; reason, evidence, remedies, numbers, rank)."""
    memory_snapshots: tuple = ()
    """The allocator snapshots the job wrote (``snapshot.describe``: path, viewer, summary, error)."""
    inflight_moves: tuple = ()
    """The in-job moves the attempt recorded (metrics.json ``inflight_moves``: step, verdict, from, to,
    global_batch): OOMs hpcmem's runtime answered inside the job before this ending."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "source": self.source,
            "oom": self.verdict.is_oom,
            "verdict": self.verdict.to_dict(),
            "job": self.facts.to_dict(),
            "logs": [str(p) for p in self.log_paths],
            "site": self.site,
            "partition": self.partition,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "plan_assumed": list(self.plan_assumed),
            "memory": self.picture.to_dict() if self.picture is not None else None,
            "remedies": [r.to_dict() for r in self.remedies],
            "where_to_look": list(self.where_to_look),
            "notes": list(self.notes),
            "peaks": self.peaks,
            "memory_snapshots": list(self.memory_snapshots),
            "inflight_moves": [dict(m) for m in self.inflight_moves],
        }


@dataclass(frozen=True)
class TriageReport:
    """Everything one ``hpcmem triage TARGET...`` found."""

    findings: tuple
    generated_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "hpcmem": __version__, "generated_at": _iso(self.generated_at),
                "findings": [f.to_dict() for f in self.findings]}


@dataclass(frozen=True)
class JobRow:
    """One failed job of a ``--since`` group: who, where, why, and where and when it died."""

    job_id: str | None
    user: str | None
    partition: str | None
    reason: str
    cause: str | None = None
    confidence: str = "high"
    phase: str | None = None
    step: int | None = None
    total_steps: int | None = None

    def __iter__(self):  # unpacks as the (job_id, user, partition, reason) tuples of triage-since/1
        return iter((self.job_id, self.user, self.partition, self.reason))

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "user": self.user, "partition": self.partition, "reason": self.reason,
                "cause": self.cause, "confidence": self.confidence, "phase": self.phase, "step": self.step,
                "total_steps": self.total_steps}


@dataclass(frozen=True)
class Group:
    """Failed jobs of one verdict kind in a ``--since`` window."""

    kind: str
    jobs: tuple
    """JobRow per job (or (job_id, user, partition, reason) tuples), oldest first."""
    top_remedies: tuple = ()
    """(move description, count) of the first remedy of each job, most frequent first."""
    hint: str = ""
    """The kind's direction from the failure table (toolkit/failures.py)."""

    def to_dict(self) -> dict[str, Any]:
        rows = [j if isinstance(j, JobRow) else JobRow(*j) for j in self.jobs]
        return {
            "kind": self.kind,
            "count": len(rows),
            "hint": self.hint,
            "users": _counts(j.user for j in rows),
            "partitions": _counts(j.partition for j in rows),
            "phases": _counts(j.phase for j in rows),
            "jobs": [j.to_dict() for j in rows],
            "top_remedies": [{"remedy": m, "count": n} for m, n in self.top_remedies],
        }


@dataclass(frozen=True)
class SinceReport:
    """The morning view: every failed job of a window, grouped by verdict kind (largest group first)."""

    start: float
    end: float
    partition: str | None
    user: str | None
    groups: tuple
    notes: tuple = ()

    @property
    def jobs(self) -> int:
        return sum(len(g.jobs) for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SINCE_SCHEMA, "hpcmem": __version__,
                "window": {"start": _iso(self.start), "end": _iso(self.end)},
                "filters": {"partition": self.partition, "user": self.user},
                "jobs": self.jobs, "groups": [g.to_dict() for g in self.groups], "notes": list(self.notes)}


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        key = v or "?"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
