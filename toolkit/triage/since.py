"""``hpcmem triage --since 24h``: every failed job of a window, grouped by verdict kind, with the top remedies.

One batched sacct call lists the window's failed jobs (``sources.window_cases``); each job's log
tail (a short one: the end of a log is where a failure is) is classified with the job's record; jobs
that were hpcmem attempts take their plan from the ledger. The first ladder move of each
out-of-memory job is counted per group, so the morning view says what most of them need.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

from ..failures import KINDS, OOM_KINDS, hint_of
from ..errors import ConfigError, HpcmemError
from .report import Group, JobRow, SinceReport

SINCE_TAIL_BYTES = 256 * 1024
"""Bytes of each log read in a window scan (the failure is at the end; 1,000 jobs stay fast)."""

_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

GENERIC_REMEDY = {k: hint_of(k) for k in OOM_KINDS}
"""What to tell a group when a job's plan is not known (not an hpcmem run): the direction, not numbers."""


def parse_since(text: str, now: float | None = None) -> float:
    """``24h``, ``90m``, ``7d``, ``2w`` back from now, or an ISO date/time -> unix seconds."""
    now = time.time() if now is None else now
    m = _SPAN.match(text)
    if m:
        start = now - float(m.group(1)) * _UNIT_S[m.group(2)]
        if start < 0:  # before 1970: sacct has nothing older, and the clock's conversions overflow
            raise ConfigError(f"--since {text[:40]!r}: reaches back before 1970")
        return start
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"--since {text!r}: expected a span like 24h, 90m, 7d or a date like 2026-11-20") from None
    if when.tzinfo is None:
        when = when.astimezone()  # a bare date/time is local, like sacct's
    return when.astimezone(timezone.utc).timestamp()


def since_report(backend, start: float, end: float, *, partition: str | None = None, user: str | None = None,
                 site=None, ledger=None) -> SinceReport:
    """The window's failed jobs, classified and grouped (largest group first)."""
    from .diagnose import read_verdict
    from .sources import window_cases

    found = window_cases(backend, start, end, partition=partition, user=user, ledger=ledger)  # no sacct: an error
    rows = []
    for case in found:
        facts = case.facts
        verdict = read_verdict(case, SINCE_TAIL_BYTES, [], number_lines=False)
        plan = facts.plan_knobs if facts.run_id else None
        remedy = _first_remedy(verdict, plan, site, facts) if verdict.is_oom else None
        rows.append((facts, verdict, remedy))
    notes = () if rows else ("no failed jobs in the window",)
    return SinceReport(start, end, partition, user, group(rows), notes)


def group(rows: Iterable[tuple[Any, Any, str | None]]) -> tuple[Group, ...]:
    """(facts, verdict, first remedy or None) rows -> groups by verdict kind, largest first, OOM kinds before ties.

    Each job keeps where and when it died (phase, step) and how sure the verdict is; the group counts its phases."""
    by_kind: dict[str, list] = {}
    remedies: dict[str, Counter] = {}
    causes: dict[str, Counter] = {}
    for facts, verdict, remedy in rows:
        by_kind.setdefault(verdict.kind, []).append(JobRow(
            facts.job_id, facts.user, facts.partition, verdict.reason, getattr(verdict, "cause", None),
            getattr(verdict, "confidence", "high"), getattr(verdict, "phase", None), getattr(verdict, "step", None),
            getattr(verdict, "total_steps", None)))
        causes.setdefault(verdict.kind, Counter())[getattr(verdict, "cause", None)] += 1
        if remedy:
            remedies.setdefault(verdict.kind, Counter())[remedy] += 1
    order = sorted(by_kind, key=lambda k: (-len(by_kind[k]), k not in OOM_KINDS, KINDS.index(k)))
    return tuple(Group(k, tuple(by_kind[k]), tuple(remedies.get(k, Counter()).most_common(3)),
                       hint_of(k, causes[k].most_common(1)[0][0])) for k in order)


def _first_remedy(verdict, knobs: Mapping | None, site, facts) -> str:
    """The first ladder move for a job whose plan is known (an hpcmem attempt), else the kind's direction."""
    if knobs and site is not None:
        from .. import ladder
        from ..jobspec import DEFAULT_ALLOW
        from .diagnose import pick_partition
        from .picture import fill_plan

        try:
            part, _ = pick_partition(site, facts.partition, verdict)
            if part is not None:
                decision = ladder.next_plan(fill_plan(knobs, part).plan, verdict, part, allow=DEFAULT_ALLOW)
                if decision.action == "retry" and decision.moves:
                    return ", ".join(decision.moves)
        except HpcmemError:
            pass
    return hint_of(verdict.kind, getattr(verdict, "cause", None))
