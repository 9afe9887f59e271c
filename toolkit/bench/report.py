"""``hpcmem bench report``: the nightly table, trends, regressions and software versions.

``run_report`` reads a results-store DataFrame (columns as in ``columns.py``) and writes
``report.md`` (trend PNGs beside it) or ``report.html`` (PNGs embedded as base64) into
``out_dir``. Each cell (site, partition, model, technique, matrix) is judged on its own latest
night, the newest night it has a row (``since`` drops older nights first, baselines included).
Per partition, matrix and model: the technique table (each cell's latest row, skipped cells
with their reason), the trend over nights, and the software versions of the partition's newest
night against its previous one; then the regressions, newly failing cells and cells a manifest
submitted that have no row yet (pending, ``regress.py``). Exit code 1 when any regression or
newly failing cell is found, else 0 (pending cells are shown, not failures).

An empty store (or nothing on or after ``since``) is an error, not an empty report: a nightly
cron should hear that collect wrote nothing.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from .. import __version__
from ..errors import ConfigError, HpcmemError, UnknownNameError
from ..files import write_atomic
from ..templating import render_template
from . import regress
from .columns import COLUMNS, FAILED_STATUSES, KEY
from .plots import trend_png, trend_series
from .regress import Regression, load_references, text as _text  # noqa: F401  (load_references: this module's API)
from .techniques import NAMES as TECHNIQUE_ORDER

FORMATS = {"markdown": "bench_report.md.j2", "html": "bench_report.html.j2"}
REPORT_FILES = {"markdown": "report.md", "html": "report.html"}
GROUP = ["site", "partition", "matrix", "model"]
VERSIONS = ("torch", "deepspeed", "transformers", "cuda", "driver", "hpcmem")
BASELINE = "vanilla"
_METRICS = ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "peak_rss_mib", "samples_per_s",
            "step_time_s", "predicted_peak_mib")


@dataclass
class ReportOutcome:
    """What a report found and where it is."""

    path: Path                      # report.md or report.html in out_dir
    regressions: list[Regression]
    new_failures: list[dict]        # cells ok on their previous night, failed/missing on their latest night
    exit_code: int                  # 0 clean, 1 regression or newly failing cell
    pending: list[dict] = field(default_factory=list)  # submitted by a manifest, no row yet (not a failure)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "exit_code": self.exit_code,
                "regressions": [r.to_dict() for r in self.regressions], "new_failures": list(self.new_failures),
                "pending": list(self.pending)}


def run_report(frame: pd.DataFrame, *, since: datetime.date | None = None, fmt: str = "markdown", out_dir: Path,
               references: Mapping | None = None, window: int = 7, tolerance: float = 0.10,
               submitted: list[dict] | pd.DataFrame | None = None) -> ReportOutcome:
    """Write the report for ``frame`` into ``out_dir`` and say what regressed.

    ``window``: previous ok nights per cell in the rolling median; ``tolerance``: allowed relative
    change against it (0.10 = 10 %); ``references``: as returned by ``load_references``;
    ``submitted``: the manifests' cells (``collect.submitted_cells``), to name those with no row yet.
    """
    if fmt not in FORMATS:
        raise UnknownNameError("report format", fmt, FORMATS)
    if window < 1 or not tolerance >= 0:
        raise ConfigError(f"bench report: window must be >= 1 night and tolerance >= 0; got {window}, {tolerance}")
    out_dir = writable_dir(out_dir)
    frame = prepare(frame, since)
    nights = regress.cell_nights(frame)
    latest = regress.latest_rows(frame, nights)
    partitions = regress.partition_nights(frame)
    versions = version_table(frame, partitions)
    changed = versions_changed(versions)
    found = regress.against_references(latest, references) + regress.against_median(
        latest, regress.median_baseline(frame, nights, window), tolerance)
    found = [replace(r, versions_changed=changed.get((r.site, r.partition), ())) for r in found]
    failures = regress.new_failures(frame, nights)
    pending = regress.pending_cells(frame, prepare_submitted(submitted, since))
    exit_code = 1 if found or failures else 0

    table = technique_table(latest)
    figures = draw_figures(frame, table, fmt, out_dir)
    context = report_context(frame, partitions, table, versions, figures, found, failures, pending, references,
                             latest, since=since, window=window, tolerance=tolerance, exit_code=exit_code)
    path = out_dir / REPORT_FILES[fmt]
    _write(path, render(FORMATS[fmt], context))
    return ReportOutcome(path, found, failures, exit_code, pending)


# ---------------------------------------------------------------- input


def writable_dir(out_dir: Path) -> Path:
    """``out_dir``, created if needed; HpcmemError in one line when it cannot be written."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HpcmemError(f"{out_dir}: cannot create the report directory: {exc.strerror or exc}") from exc
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise HpcmemError(f"{out_dir}: the report directory is not writable")
    return out_dir


def prepare(frame: pd.DataFrame, since: datetime.date | None) -> pd.DataFrame:
    """The store's rows to report: identity columns checked, absent columns read as not measured,
    nights as 'YYYY-MM-DD' strings from ``since`` on, ``matrix`` "" where not recorded, one row per KEY
    (the last)."""
    required = [*(k for k in KEY if k != "matrix"), "status"]  # no matrix column: one unnamed matrix
    lacking = [c for c in required if c not in frame.columns]
    if lacking:
        raise HpcmemError(f"results store lacks column(s) {', '.join(lacking)} (see toolkit/bench/columns.py)")
    if frame.empty:
        raise HpcmemError("results store is empty: nothing to report (run `hpcmem bench collect` first)")
    frame = frame.reindex(columns=list(dict.fromkeys([*COLUMNS, *frame.columns])))
    frame["night"] = frame["night"].astype(str).str.slice(0, 10)
    frame["matrix"] = frame["matrix"].astype(object).where(frame["matrix"].notna(), "")
    for column in _METRICS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    if since is not None:
        last = frame["night"].max()
        frame = frame[frame["night"] >= since.isoformat()]
        if frame.empty:
            raise HpcmemError(f"results store has no night on or after {since.isoformat()} (latest: {last})")
    return frame.drop_duplicates(list(KEY), keep="last").reset_index(drop=True)


def prepare_submitted(submitted: list[dict] | pd.DataFrame | None, since: datetime.date | None) -> pd.DataFrame:
    """The manifests' cells as a frame (night, site, matrix, partition, model, technique, state), from ``since`` on."""
    columns = ["night", *regress.CELL, "state"]
    frame = pd.DataFrame(submitted if submitted is not None else [], columns=None)
    frame = frame.reindex(columns=columns)
    if since is not None and not frame.empty:
        frame = frame[frame["night"].astype(str) >= since.isoformat()]
    return frame


# ---------------------------------------------------------------- the table


def technique_table(latest: pd.DataFrame) -> pd.DataFrame:
    """The latest night's rows with the table's numbers (pure).

    Adds ``memory_mib`` (peak allocated where the group measured it, else peak RSS), ``memory_kind``,
    ``saving_pct`` (memory saved against the same night's ok vanilla of the same group: 100 * (vanilla
    - memory) / vanilla, ok rows only; cells of one table may come from different nights), ``error_pct`` (estimator: 100 * (predicted - measured) / measured peak
    allocated) and ``on_cpu``. Rows are ordered by group, then technique as in techniques.NAMES.
    """
    table = latest.copy()
    on_gpu = table["peak_allocated_mib"].notna().groupby([table[c] for c in GROUP], dropna=False).transform("any")
    table["memory_kind"] = on_gpu.map({True: "peak allocated", False: "peak RSS"})
    table["memory_mib"] = table["peak_allocated_mib"].where(on_gpu, table["peak_rss_mib"])
    ok = table["status"] == "ok"
    vanilla = table[ok & (table["technique"] == BASELINE)][GROUP + ["night", "memory_mib"]]
    vanilla = vanilla.rename(columns={"memory_mib": "vanilla_mib"})
    table = table.merge(vanilla, on=GROUP + ["night"], how="left")
    saving = 100.0 * (table["vanilla_mib"] - table["memory_mib"]) / table["vanilla_mib"]
    table["saving_pct"] = saving.where(table["status"] == "ok")
    measured = table["peak_allocated_mib"]
    table["error_pct"] = 100.0 * (table["predicted_peak_mib"] - measured) / measured
    table["on_cpu"] = table["gpu_name"].isna() | (table["gpu_name"].astype(str).str.strip() == "")
    table["order"] = technique_rank(table["technique"])
    return table.sort_values([*GROUP, "order", "technique"]).reset_index(drop=True)


def technique_rank(techniques: pd.Series) -> pd.Series:
    """Position in techniques.NAMES (vanilla first); unknown techniques after, by name."""
    rank = {name: i for i, name in enumerate(TECHNIQUE_ORDER)}
    return techniques.map(rank).fillna(len(rank)).astype(int)


# ---------------------------------------------------------------- versions


def version_table(frame: pd.DataFrame, nights: pd.DataFrame) -> pd.DataFrame:
    """Per site, partition and version column (torch, deepspeed, ...): the values on the partition's
    latest and previous night (``nights`` from ``regress.partition_nights``; several values on one
    night joined with ', '; '' when none), and ``changed`` (only where both nights have rows)."""
    rows = frame.merge(nights, on=["site", "partition"])
    rows = rows[(rows["night"] == rows["latest"]) | (rows["night"] == rows["previous"])]
    rows = rows.assign(when=rows["night"].eq(rows["latest"]).map({True: "latest", False: "previous"}))
    long = rows.melt(id_vars=["site", "partition", "when"], value_vars=list(VERSIONS), var_name="name")
    long = long.dropna(subset=["value"]).astype({"value": str})
    long = long[long["value"] != ""].drop_duplicates().sort_values("value")
    joined = long.groupby(["site", "partition", "name", "when"])["value"].agg(", ".join).unstack("when")
    joined = joined.reindex(columns=["latest", "previous"]).reset_index()
    both = rows.assign(latest_seen=rows["when"] == "latest", previous_seen=rows["when"] == "previous")
    both = both.groupby(["site", "partition"], as_index=False)[["latest_seen", "previous_seen"]].any()
    table = both.merge(pd.DataFrame({"name": list(VERSIONS)}), how="cross")
    table = table.merge(joined, on=["site", "partition", "name"], how="left")
    table[["latest", "previous"]] = table[["latest", "previous"]].astype(object).fillna("")
    table["changed"] = table["latest_seen"] & table["previous_seen"] & (table["latest"] != table["previous"])
    table["order"] = table["name"].map({n: i for i, n in enumerate(VERSIONS)})
    table = table.sort_values(["site", "partition", "order"])
    return table[["site", "partition", "name", "latest", "previous", "changed"]].reset_index(drop=True)


def versions_changed(versions: pd.DataFrame) -> dict[tuple[str, str], tuple[str, ...]]:
    """(site, partition) -> ('torch 2.3.0 -> 2.4.0', ...) for the versions that changed."""
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for r in versions[versions["changed"]].itertuples(index=False):
        text = f"{r.name} {r.previous or '(none)'} -> {r.latest or '(none)'}"
        out[(r.site, r.partition)] = out.get((r.site, r.partition), ()) + (text,)
    return out


# ---------------------------------------------------------------- figures


def draw_figures(frame: pd.DataFrame, table: pd.DataFrame, fmt: str, out_dir: Path) -> dict[tuple, str]:
    """One trend PNG per site, partition, matrix and model; (site, partition, matrix, model) -> the image
    source: a file name beside report.md, or a ``data:image/png;base64`` URI for HTML."""
    kinds = table.drop_duplicates(GROUP).set_index(GROUP)["memory_kind"]
    order = list(table.drop_duplicates("technique").sort_values(["order", "technique"])["technique"])
    out = {}
    for group, rows in frame.groupby(GROUP, sort=True):
        if group not in kinds.index:
            continue  # nothing on the latest night: no section shows it
        kind = kinds[group]
        memory = "peak_allocated_mib" if kind == "peak allocated" else "peak_rss_mib"
        extra = sorted(set(rows["technique"]) - set(order))
        series = trend_series(rows, memory, order + extra)
        site, partition, matrix, model = group
        label = [site, partition, model] + ([matrix] if matrix else [])
        png = trend_png(series, title=" / ".join(label), memory_label=kind)
        if fmt == "html":
            out[group] = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        else:
            name = "trend-" + re.sub(r"[^A-Za-z0-9._+-]", "_", "-".join(label)) + ".png"
            _write(out_dir / name, png)
            out[group] = name
    return out


# ---------------------------------------------------------------- context and rendering


def report_context(frame, nights, table, versions, figures, found, failures, pending, references, latest, *, since,
                   window, tolerance, exit_code) -> dict[str, Any]:
    """Everything the templates show, formatted as text (the templates only lay it out; flags are bools).
    ``nights``: ``regress.partition_nights``."""
    by_partition = nights.set_index(["site", "partition"])
    waiting = {tuple(p[c] for c in regress.CELL): p["night"] for p in pending}
    partitions = [partition_section(site, partition, rows, by_partition.loc[(site, partition)],
                                    versions[(versions["site"] == site) & (versions["partition"] == partition)],
                                    figures, waiting)
                  for (site, partition), rows in table.groupby(["site", "partition"], sort=True)]
    return {
        "title": "hpcmem nightly benchmark report", "hpcmem": __version__, "exit_code": exit_code,
        "store": {"rows": len(frame), "cells": len(frame.drop_duplicates(list(regress.CELL))),
                  "nights": frame["night"].nunique(), "first": frame["night"].min(), "last": frame["night"].max()},
        "since": since.isoformat() if since else "", "window": window, "tolerance_pct": _num(100 * tolerance, 1),
        "references": len(regress.references_frame(references)),
        "unmatched_references": unmatched_references(latest, references),
        "regressions": [regression_row(r) for r in found], "new_failures": failures, "partitions": partitions,
        "pending": [dict(p, state=PENDING_STATES.get(p["state"], p["state"]), last_night=p["last_night"] or "-")
                    for p in pending],
    }


PENDING_STATES = {"submitted": "submitted, no row yet (running, or not collected: `hpcmem bench collect`)",
                  "submit_failed": "submission failed, not collected yet (`hpcmem bench collect`)",
                  "planned": "never submitted (run `hpcmem bench run` again for that night)"}


def partition_section(site: str, partition: str, rows: pd.DataFrame, night: pd.Series, versions: pd.DataFrame,
                      figures: dict[tuple, str], waiting: dict[tuple, str]) -> dict[str, Any]:
    """One site:partition: its nights, software versions and one table and figure per matrix and model.
    ``waiting``: cell -> the night it was submitted with no row yet."""
    models = [{"model": model, "matrix": matrix, "memory_label": group["memory_kind"].iloc[0],
               "figure": figures.get((site, partition, matrix, model), ""),
               "rows": [table_row(r, night["latest"], waiting.get(tuple(getattr(r, c) for c in regress.CELL)))
                        for r in group.itertuples(index=False)]}
              for (matrix, model), group in rows.groupby(["matrix", "model"], sort=True)]
    return {"site": site, "partition": partition, "night": night["latest"], "previous": _text(night["previous"]),
            "models": models,
            "versions": [{"name": v.name, "latest": v.latest or "-", "previous": v.previous or "-",
                          "changed": bool(v.changed)} for v in versions.itertuples(index=False)]}


def table_row(r, newest: str = "", waiting: str | None = None) -> dict[str, str]:
    """One technique's table row as text: units in the headers, '-' for not measured. ``newest``: the
    partition's newest night (a row from an older night says its night); ``waiting``: the night this
    cell was submitted with no row yet."""
    skipped = r.status == "skipped"
    if skipped:
        error = "-"
    elif not pd.isna(r.error_pct):
        error = _signed(r.error_pct)
    else:
        error = "n/a on CPU" if r.on_cpu else "n/a"
    baseline = r.technique == BASELINE and r.status == "ok"
    if skipped:
        status = f"skipped: {_text(r.error)}"
    else:
        status = r.status if r.status == "ok" else " ".join(filter(None, [r.status, _paren(r.verdict)]))
    if newest and r.night != newest:
        status += f" (night {r.night})"
    if waiting:
        status += f"; {waiting} pending"
    return {"technique": r.technique, "step_time_s": _num(r.step_time_s, 3), "samples_per_s": _num(r.samples_per_s, 1),
            "memory_mib": _num(r.memory_mib, 0), "saving_pct": "baseline" if baseline else _signed(r.saving_pct),
            "predicted_mib": _num(r.predicted_peak_mib, 0), "error_pct": error, "status": status,
            "detail": "" if skipped else _text(r.error), "failed": r.status in FAILED_STATUSES}


def regression_row(r: Regression) -> dict[str, str]:
    what = "reference" if r.against == "reference" else "median of previous nights"
    matrix = f" [{r.matrix}]" if r.matrix else ""
    return {"cell": f"{r.site}:{r.partition} {r.model} {r.technique}{matrix}", "night": r.night, "metric": r.metric,
            "value": _num(r.value, 1), "baseline": _num(r.baseline, 1), "against": what,
            "change": _signed(100 * r.change), "limit": _signed(100 * r.limit),
            "versions_changed": "; ".join(r.versions_changed) or "-", "matrix": r.matrix}


def unmatched_references(latest: pd.DataFrame, references: Mapping | None) -> list[str]:
    """'site:partition model technique' of declared references, for a site in the store, with no row on
    its latest night (a typo in a references file would otherwise check nothing, silently)."""
    refs = regress.references_frame(references).drop_duplicates(list(regress.REF_CELL))
    refs = refs[refs["site"].isin(latest["site"].unique())]
    hit = refs.merge(latest[list(regress.REF_CELL)].drop_duplicates(), on=list(regress.REF_CELL), how="left",
                     indicator=True)
    lost = hit[hit["_merge"] == "left_only"]
    return [f"{r.site}:{r.partition} {r.model} {r.technique}" for r in lost.itertuples(index=False)]


def render(template: str, context: dict[str, Any]) -> str:
    """Render a report template (toolkit.templating: StrictUndefined, HTML autoescaped, ``md`` filter)."""
    return render_template(template, **context)


def _write(path: Path, data: str | bytes) -> None:
    """Write atomically; an OSError (disk full, permissions) is one line naming the file."""
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise HpcmemError(f"{path}: cannot write: {exc.strerror or exc}") from exc


def _num(value, digits: int) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:,.{digits}f}"


def _signed(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:+.1f} %"


def _paren(value) -> str:
    text = _text(value)
    return f"({text})" if text else ""
