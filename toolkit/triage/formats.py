"""Triage reports for people: ``text`` (terminal, colour on a TTY) and ``markdown`` (a ticket reply).

Both read the same JSON-ready dicts ``--format json`` prints (report.py), so the three formats
cannot disagree; logs and file names are untrusted, so those dicts are made terminal-safe first, in one
place (``safe_report``: control characters escaped, evidence cut around its error). Python turns the
data into short phrases (``job_lines``, ``remedy_lines``...); the templates (templates/triage.*.j2) lay
them out.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..runtime.inflight import move_text
from ..templating import clip_around, mib_text, render_template, safe_data
from .changes import slowdown_text

FORMATS = ("text", "markdown", "json")

_COLOURS = {"bad": "31;1", "good": "32", "warn": "33", "head": "1", "dim": "2"}
_KIND_STYLE = {"not_oom": "warn", "unknown": "warn"}


EVIDENCE_WIDTH = 1000
"""Longest evidence line shown (characters): a 200 MB single-line log shows the part around its error."""


def render_report(report: Mapping[str, Any], fmt: str, colour: bool = False) -> str:
    """A TriageReport dict (``TriageReport.to_dict()``) as text or markdown; logs and file names are untrusted,
    so every string is made safe first (``safe_report``)."""
    report = safe_report(report)
    findings = [finding_view(f) for f in report["findings"]]
    return _render(fmt, "triage", findings=findings, report=report, colour=colour)


def render_since(report: Mapping[str, Any], fmt: str, colour: bool = False) -> str:
    """A SinceReport dict as text or markdown (made safe like ``render_report``)."""
    return _render(fmt, "triage-since", report=safe_report(report), colour=colour)


def safe_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report with every evidence line cut to ``EVIDENCE_WIDTH`` around its error (``clip_around``) and every
    string, at any depth, terminal-safe (``templating.safe_data``: control characters, ESC above all, and
    bidirectional overrides shown escaped). Done once here, for both formats and every template, on a terminal
    and in a pipe alike; colour is added after, by ``paint``."""
    return safe_data(clip_evidence(report))


def clip_evidence(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report with every evidence line cut to ``EVIDENCE_WIDTH`` around its error: for every format, JSON
    too (a single-line log's 8 MiB line is no evidence anyone reads; what was cut is said in the line)."""
    report = dict(report)
    findings = []
    for f in report.get("findings") or ():
        verdict = f.get("verdict") if isinstance(f, Mapping) else None
        if isinstance(verdict, Mapping) and verdict.get("evidence"):
            evidence = [{**e, "text": clip_around(e["text"], EVIDENCE_WIDTH)}
                        if isinstance(e, Mapping) and isinstance(e.get("text"), str) else e for e in verdict["evidence"]]
            f = {**f, "verdict": {**verdict, "evidence": evidence}}
        findings.append(f)
    if "findings" in report:
        report["findings"] = findings
    return report


def _render(fmt: str, stem: str, colour: bool, **context: Any) -> str:
    ext = {"text": "txt", "markdown": "md"}[fmt]
    paint = (lambda text, style: f"\033[{_COLOURS[style]}m{text}\033[0m") if colour else (lambda text, style: text)
    return render_template(f"{stem}.{ext}.j2", trim=True, paint=paint, mib=mib_text, kind_style=kind_style, **context).rstrip() + "\n"


def kind_style(kind: str) -> str:
    return _KIND_STYLE.get(kind, "bad")


# --------------------------------------------------------------------------- phrases


def finding_view(f: Mapping[str, Any]) -> dict[str, Any]:
    """The finding dict plus the phrases the templates print."""
    return {**f, "title": _title(f), "job_lines": job_lines(f["job"], f.get("partition")),
            "plan_line": plan_line(f.get("plan"), f.get("plan_assumed") or (), f["job"].get("knob_sources") or {}),
            "rank_lines": rank_lines(f["verdict"].get("ranks") or ()),
            "attempt_lines": attempt_lines(f["job"].get("attempts") or ()),
            "remedy_views": [remedy_view(r, f.get("notes") or ()) for r in f.get("remedies") or ()],
            "inflight_lines": [move_text(m) for m in f.get("inflight_moves") or ()]}


def _title(f: Mapping[str, Any]) -> str:
    job = f["job"]
    who = f"job {job['job_id']}" if job.get("job_id") else f["target"]
    if job.get("run_id"):
        who += f" (hpcmem run {job['run_id']}, attempt {job.get('attempt') or '?'})"
    return who


def job_lines(job: Mapping[str, Any], partition: str | None) -> list[str]:
    """What the scheduler and the files say about the job, a few lines."""
    lines = []
    state = job.get("state")
    if state:
        code = "" if job.get("exit_code") is None else f", exit {job['exit_code']}:{job.get('signal') or 0}"
        ran = ""
        if job.get("elapsed_s") is not None:
            ran = f", ran {duration(job['elapsed_s'])}"
            if job.get("timelimit_s"):
                ran += f" of {duration(job['timelimit_s'])}"
        lines.append(f"{state}{code}{ran}")
    where = []
    if partition or job.get("partition"):
        where.append(f"partition {job.get('partition') or partition}")
    if job.get("nodes"):
        where.append(f"node {job['nodes']}")
    if job.get("user"):
        where.append(f"user {job['user']}")
    if job.get("name"):
        where.append(f"name {job['name']}")
    if where:
        lines.append(", ".join(where))
    if job.get("max_rss_mib") is not None:
        lines.append(f"largest resident memory (MaxRSS) {mib_text(job['max_rss_mib'])}")
    for label, key in (("requested", "req_tres"), ("allocated", "alloc_tres")):
        if job.get(key):
            lines.append(f"{label}: " + ",".join(f"{k}={v}" for k, v in job[key].items()))
    if job.get("sources"):
        lines.append("from: " + ", ".join(job["sources"]))
    return lines


def plan_line(plan: Mapping[str, Any] | None, assumed, sources: Mapping[str, str]) -> str:
    if not plan:
        return "not found (no plan.json, DeepSpeed config or batch arguments in the job script)"
    parts = [f"micro-batch {plan['micro_batch']} x accumulation {plan['grad_accum']} x {plan['world_size']} ranks "
             f"= global batch {plan['global_batch']}", plan["precision"], plan["optimizer"], f"attention {plan['attention']}",
             "checkpointing" if plan["checkpointing"] else "no checkpointing", f"seq {plan['seq_len']}"]
    if plan["zero_stage"]:
        parts.append(f"ZeRO {plan['zero_stage']}")
    for what in ("offload_optimizer", "offload_params"):
        if plan[what] != "none":
            parts.append(f"{what.replace('_', ' ')} to {plan[what]}")
    text = ", ".join(parts)
    if assumed:
        text += f" (assumed: {', '.join(assumed)})"
    where = sorted(set(sources.values()))
    if where:
        text += f" [from {', '.join(where)}]"
    return text


def rank_lines(ranks) -> list[str]:
    out = []
    for n, r in enumerate(ranks):
        when = "failed first" if n == 0 else "then"
        where = f"{r['file']}:" if r.get("file") else "line "
        out.append(f"rank {r['rank']} {when}: {r['kind']}, {r['what']} ({where}{r['line']})")
    return out


def attempt_lines(attempts) -> list[str]:
    out = []
    for a in attempts:
        a = dict(a)
        bits = [f"attempt {a.get('n', '?')}", f"job {a.get('job_id') or '-'}", a.get("state") or "?"]
        if a.get("verdict"):
            bits.append(str(a["verdict"]))
        if a.get("plan_text"):
            bits.append(str(a["plan_text"]))
        out.append(", ".join(bits))
    return out


def remedy_view(r: Mapping[str, Any], said: Iterable[str] = ()) -> dict[str, Any]:
    """The remedy plus its figures in words; sentences the finding's notes already say are left out of its note."""
    note = r.get("note") or ""
    for sentence in said:
        note = note.replace(sentence, "")
    fit = {True: "fits", False: "does NOT fit", None: "fit not predicted"}[r.get("fits")]
    peak = r.get("predicted_peak_mib")
    figures = [f"predicted peak {mib_text(peak)} per GPU" if peak is not None else "peak not predicted", fit]
    if note.lstrip().startswith(("Predicted peak", "Peak not predicted")):
        figures = []  # the note says peak and fit in full
    if r.get("slowdown") is not None:
        figures.append(slowdown_text(r["slowdown"]))
    return {**r, "figures": ", ".join(figures), "note": " ".join(note.split())}  # figures may be "" (see note)


def duration(seconds: float) -> str:
    """Seconds as [D-]HH:MM:SS."""
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}-{text}" if days else text
