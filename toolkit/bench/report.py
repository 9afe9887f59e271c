"""``hpcmem bench report``: the nightly table, trends, regressions and software versions.

``run_report`` reads a results-store DataFrame (columns as in ``columns.py``) and writes
``report.md`` (trend PNGs beside it) or ``report.html`` (PNGs embedded as base64) into
``out_dir``. For each site, the latest night is the newest night that site has in the store
(``since`` drops older nights first, baselines included). Per partition and model: the
technique table of the latest night, the trend over nights, and the software versions with
what changed since the site's previous night; then the regressions and newly failing cells
(``regress.py``). Exit code 1 when any regression or newly failing cell is found, else 0.

An empty store (or nothing on or after ``since``) is an error, not an empty report: a nightly
cron should hear that collect wrote nothing.
"""

from __future__ import annotations

import base64
import datetime
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from .. import __version__
from ..errors import ConfigError, HpcmemError, UnknownNameError
from ..templating import render_template
from . import regress
from .columns import COLUMNS, KEY
from .plots import trend_png, trend_series
from .regress import Regression, load_references  # noqa: F401  (load_references: part of this module's API)
from .techniques import NAMES as TECHNIQUE_ORDER

FORMATS = {"markdown": "bench_report.md.j2", "html": "bench_report.html.j2"}
REPORT_FILES = {"markdown": "report.md", "html": "report.html"}
GROUP = ["site", "partition", "model"]
VERSIONS = ("torch", "deepspeed", "transformers", "cuda", "driver", "hpcmem")
BASELINE = "vanilla"
_METRICS = ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "peak_rss_mib", "samples_per_s",
            "step_time_s", "predicted_peak_mib")


@dataclass
class ReportOutcome:
    """What a report found and where it is."""

    path: Path                      # report.md or report.html in out_dir
    regressions: list[Regression]
    new_failures: list[dict]        # cells ok on the previous night, failed/missing on the latest night
    exit_code: int                  # 0 clean, 1 regression or newly failing cell

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "exit_code": self.exit_code,
                "regressions": [r.to_dict() for r in self.regressions], "new_failures": list(self.new_failures)}


def run_report(frame: pd.DataFrame, *, since: datetime.date | None = None, fmt: str = "markdown", out_dir: Path,
               references: Mapping | None = None, window: int = 7, tolerance: float = 0.10) -> ReportOutcome:
    """Write the report for ``frame`` into ``out_dir`` and say what regressed.

    ``window``: previous ok nights per cell in the rolling median; ``tolerance``: allowed relative
    change against it (0.10 = 10 %); ``references``: as returned by ``load_references``.
    """
    if fmt not in FORMATS:
        raise UnknownNameError("report format", fmt, FORMATS)
    if window < 1 or not tolerance >= 0:
        raise ConfigError(f"bench report: window must be >= 1 night and tolerance >= 0; got {window}, {tolerance}")
    out_dir = writable_dir(out_dir)
    frame = prepare(frame, since)
    nights = regress.site_nights(frame)
    latest = regress.latest_rows(frame, nights)
    versions = version_table(frame, nights)
    changed = versions_changed(versions)
    found = regress.against_references(latest, references) + regress.against_median(
        latest, regress.median_baseline(frame, nights, window), tolerance)
    found = [replace(r, versions_changed=changed.get((r.site, r.partition), ())) for r in found]
    failures = regress.new_failures(frame, nights)
    exit_code = 1 if found or failures else 0

    table = technique_table(latest)
    figures = draw_figures(frame, table, fmt, out_dir)
    context = report_context(frame, nights, table, versions, figures, found, failures, references, latest,
                             since=since, window=window, tolerance=tolerance, exit_code=exit_code)
    path = out_dir / REPORT_FILES[fmt]
    _write(path, render(FORMATS[fmt], context))
    return ReportOutcome(path, found, failures, exit_code)


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
    nights as 'YYYY-MM-DD' strings from ``since`` on, one row per KEY (the last)."""
    required = [*KEY, "status"]
    lacking = [c for c in required if c not in frame.columns]
    if lacking:
        raise HpcmemError(f"results store lacks column(s) {', '.join(lacking)} (see toolkit/bench/columns.py)")
    if frame.empty:
        raise HpcmemError("results store is empty: nothing to report (run `hpcmem bench collect` first)")
    frame = frame.reindex(columns=list(dict.fromkeys([*COLUMNS, *frame.columns])))
    frame["night"] = frame["night"].astype(str).str.slice(0, 10)
    for column in _METRICS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    if since is not None:
        last = frame["night"].max()
        frame = frame[frame["night"] >= since.isoformat()]
        if frame.empty:
            raise HpcmemError(f"results store has no night on or after {since.isoformat()} (latest: {last})")
    return frame.drop_duplicates(list(KEY), keep="last").reset_index(drop=True)


# ---------------------------------------------------------------- the table


def technique_table(latest: pd.DataFrame) -> pd.DataFrame:
    """The latest night's rows with the table's numbers (pure).

    Adds ``memory_mib`` (peak allocated where the group measured it, else peak RSS), ``memory_kind``,
    ``saving_pct`` (memory saved against the same night's ok vanilla: 100 * (vanilla - memory) /
    vanilla, ok rows only), ``error_pct`` (estimator: 100 * (predicted - measured) / measured peak
    allocated) and ``on_cpu``. Rows are ordered by group, then technique as in techniques.NAMES.
    """
    table = latest.copy()
    on_gpu = table["peak_allocated_mib"].notna().groupby([table[c] for c in GROUP]).transform("any")
    table["memory_kind"] = on_gpu.map({True: "peak allocated", False: "peak RSS"})
    table["memory_mib"] = table["peak_allocated_mib"].where(on_gpu, table["peak_rss_mib"])
    ok = table["status"] == "ok"
    vanilla = table[ok & (table["technique"] == BASELINE)][GROUP + ["memory_mib"]]
    vanilla = vanilla.rename(columns={"memory_mib": "vanilla_mib"})
    table = table.merge(vanilla, on=GROUP, how="left")
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
    """Per site, partition and version column (torch, deepspeed, ...): the values on the site's latest
    and previous night (several values on one night joined with ', '; '' when none), and ``changed``
    (only where the partition has rows on both nights)."""
    rows = frame.merge(nights, on="site")
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
    """One trend PNG per site, partition and model; (site, partition, model) -> the image source:
    a file name beside report.md, or a ``data:image/png;base64`` URI for HTML."""
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
        png = trend_png(series, title=" / ".join(group), memory_label=kind)
        if fmt == "html":
            out[group] = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        else:
            name = "trend-" + re.sub(r"[^A-Za-z0-9._+-]", "_", "-".join(group)) + ".png"
            _write_bytes(out_dir / name, png)
            out[group] = name
    return out


# ---------------------------------------------------------------- context and rendering


def report_context(frame, nights, table, versions, figures, found, failures, references, latest, *, since, window,
                   tolerance, exit_code) -> dict[str, Any]:
    """Everything the templates show, formatted as text (the templates only lay it out)."""
    by_site = nights.set_index("site")
    partitions = [partition_section(site, partition, rows, by_site.loc[site],
                                    versions[(versions["site"] == site) & (versions["partition"] == partition)], figures)
                  for (site, partition), rows in table.groupby(["site", "partition"], sort=True)]
    return {
        "title": "hpcmem nightly benchmark report", "hpcmem": __version__, "exit_code": exit_code,
        "store": {"rows": len(frame), "cells": len(frame.drop_duplicates(list(regress.CELL))),
                  "nights": frame["night"].nunique(), "first": frame["night"].min(), "last": frame["night"].max()},
        "since": since.isoformat() if since else "", "window": window, "tolerance_pct": _num(100 * tolerance, 1),
        "references": len(regress.references_frame(references)),
        "unmatched_references": unmatched_references(latest, references),
        "regressions": [regression_row(r) for r in found], "new_failures": failures, "partitions": partitions,
    }


def partition_section(site: str, partition: str, rows: pd.DataFrame, night: pd.Series, versions: pd.DataFrame,
                      figures: dict[tuple, str]) -> dict[str, Any]:
    """One site:partition: its nights, software versions and one table and figure per model."""
    models = [{"model": model, "memory_label": group["memory_kind"].iloc[0],
               "figure": figures.get((site, partition, model), ""),
               "rows": [table_row(r) for r in group.itertuples(index=False)]}
              for model, group in rows.groupby("model", sort=True)]
    return {"site": site, "partition": partition, "night": night["latest"], "previous": _text(night["previous"]),
            "models": models,
            "versions": [{"name": v.name, "latest": v.latest or "-", "previous": v.previous or "-",
                          "changed": bool(v.changed)} for v in versions.itertuples(index=False)]}


def table_row(r) -> dict[str, str]:
    """One technique's table row as text: units in the headers, '-' for not measured."""
    if not pd.isna(r.error_pct):
        error = _signed(r.error_pct)
    else:
        error = "n/a on CPU" if r.on_cpu else "n/a"
    baseline = r.technique == BASELINE and r.status == "ok"
    status = r.status if r.status == "ok" else " ".join(filter(None, [r.status, _paren(r.verdict)]))
    return {"technique": r.technique, "step_time_s": _num(r.step_time_s, 3), "samples_per_s": _num(r.samples_per_s, 1),
            "memory_mib": _num(r.memory_mib, 0), "saving_pct": "baseline" if baseline else _signed(r.saving_pct),
            "predicted_mib": _num(r.predicted_peak_mib, 0), "error_pct": error, "status": status,
            "detail": _text(r.error)}


def regression_row(r: Regression) -> dict[str, str]:
    what = "reference" if r.against == "reference" else "median of previous nights"
    return {"cell": f"{r.site}:{r.partition} {r.model} {r.technique}", "night": r.night, "metric": r.metric,
            "value": _num(r.value, 1), "baseline": _num(r.baseline, 1), "against": what,
            "change": _signed(100 * r.change), "limit": _signed(100 * r.limit),
            "versions_changed": "; ".join(r.versions_changed) or "-"}


def unmatched_references(latest: pd.DataFrame, references: Mapping | None) -> list[str]:
    """'site:partition model technique' of declared references, for a site in the store, with no row on
    its latest night (a typo in a references file would otherwise check nothing, silently)."""
    refs = regress.references_frame(references).drop_duplicates(list(regress.CELL))
    refs = refs[refs["site"].isin(latest["site"].unique())]
    hit = refs.merge(latest[list(regress.CELL)].drop_duplicates(), on=list(regress.CELL), how="left", indicator=True)
    lost = hit[hit["_merge"] == "left_only"]
    return [f"{r.site}:{r.partition} {r.model} {r.technique}" for r in lost.itertuples(index=False)]


def render(template: str, context: dict[str, Any]) -> str:
    """Render a report template (toolkit.templating: StrictUndefined, HTML autoescaped, ``md`` filter)."""
    return render_template(template, **context)


def _write(path: Path, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """Write atomically; an OSError (disk full, permissions) is one line naming the file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise HpcmemError(f"{path}: cannot write: {exc.strerror or exc}") from exc


def _num(value, digits: int) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:,.{digits}f}"


def _signed(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:+.1f} %"


def _paren(value) -> str:
    text = _text(value)
    return f"({text})" if text else ""


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
