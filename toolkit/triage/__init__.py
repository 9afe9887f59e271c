"""Triage: from a ticket's job id, run id or log to a diagnosis and ranked remedies (docs/triage.md).

``run_triage`` and ``run_since`` are what ``hpcmem triage`` calls: they find the cases
(sources.py), diagnose each (diagnose.py) and format the report (report.py, formats.py).
The modules under them know nothing of the command line.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable

from ..errors import HpcmemError, LedgerError
from .report import TriageReport


def run_triage(targets: Iterable[str], site, fmt: str, *, stdin=None, colour: bool = False, max_remedies: int = 5,
               partition: str | None = None, sites_dirs: Iterable[str] = ()) -> str:
    """The report for TARGETs, formatted (``text``, ``markdown`` or ``json``).

    ``partition``: the partition the jobs ran on, for logs whose scheduler record cannot say.
    """
    from .diagnose import diagnose
    from .formats import render_report
    from .sources import target_cases

    backend = _backend()
    with _ledger() as ledger:
        # every target's job ids in one sacct call (and one sacct -B); the cases come in target order
        found = [diagnose(case, site or _case_site(case, sites_dirs, ledger), ledger=ledger, max_remedies=max_remedies,
                          partition=partition)
                 for case in target_cases(list(targets), backend=backend, ledger=ledger, stdin=stdin)]
    data = TriageReport(tuple(found)).to_dict()
    if fmt == "json":
        from .formats import clip_evidence

        return _dump(clip_evidence(data))
    return render_report(data, fmt, colour)


def run_since(since: str, site, fmt: str, *, partition: str | None = None, user: str | None = None,
              colour: bool = False) -> str:
    """The ``--since`` window report, formatted."""
    from .formats import render_since
    from .since import parse_since, since_report

    start, end = parse_since(since), time.time()
    with _ledger() as ledger:
        report = since_report(_backend(), start, end, partition=partition, user=user, site=site, ledger=ledger)
    data = report.to_dict()
    return _dump(data) if fmt == "json" else render_since(data, fmt, colour)


def _dump(data: Any) -> str:
    from ..templating import json_text

    return json_text(data) + "\n"


def _backend():
    from ..backends import get_backend

    return get_backend("slurm", tries=2, backoff_s=0.5, timeout_s=30.0)


class _NoLedger:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _ledger():
    """The hpcmem ledger when this machine has one (triage never creates one)."""
    from ..resources import home_dir
    from ..runs import open_ledger

    if not (home_dir() / "ledger.sqlite").exists():
        return _NoLedger()
    try:
        return open_ledger()
    except LedgerError as exc:  # a ticket's log is still worth reading: go on without the record, and say so
        sys.stderr.write(f"hpcmem: warning: triage goes on without the ledger: {exc}\n")
        return _NoLedger()


def _case_site(case, sites_dirs, ledger=None):
    """The site an hpcmem run was submitted to, when --site was not given: as the run recorded it at submission
    (``runs/<id>/site.json``), else the site file of that name."""
    run_id = getattr(case.facts, "run_id", None)
    if run_id and ledger is not None:
        from ..runs import load_site_for

        try:
            return load_site_for(ledger.run(run_id))
        except (HpcmemError, OSError):
            pass  # the run's record is gone or damaged: the site by name, as before
    name = getattr(case.facts, "site", None)
    if not name:
        return None
    from ..sites import load_site

    try:
        return load_site(name, sites_dirs)
    except HpcmemError:
        return None
