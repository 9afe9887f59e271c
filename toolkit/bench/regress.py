"""Regressions in the results store: what got worse on each cell's latest night, and what stopped working.

A cell is (site, partition, model, technique, matrix); its **latest night** is the newest night
it has a row, its **previous night** the one before. Judging per cell (not per site) means a
night that ran only part of a matrix (``bench run -p``/``--only``), a second matrix on the site,
or cells not collected yet hide nothing and accuse nothing. Checks (pure functions on a
results-store DataFrame, columns as in ``columns.py``):

- against declared **references** per ``site:partition`` (ReFrame style): ``[value, lower, upper]``,
  lower and upper relative tolerances, ``null`` unbounded; a measurement outside
  ``[value * (1 + lower), value * (1 + upper)]`` is a regression, in either direction;
- against the **rolling median** of the cell's previous ``window`` ok nights: a memory metric
  (MiB) up by more than ``tolerance``, or samples/s down by more than ``tolerance``;
- **newly failing** cells: the latest row failed, incomplete or missing, the cell's previous row
  that ran (not skipped) ok;
- **pending** cells (not a failure): a manifest submitted them and the store has no row yet.

Only ok rows are compared with a baseline; ``skipped`` rows are neither failures nor baselines.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from ..errors import ConfigError
from .columns import FAILED_STATUSES
from ..resources import data_dir
from ..schema import load_schema, load_yaml, validate

CELL = ("site", "partition", "model", "technique", "matrix")
"""A cell across nights: the same benchmark of the same matrix on the same partition."""

REF_CELL = ("site", "partition", "model", "technique")
"""What a references file names (the reference holds for every matrix that runs the cell)."""

MEMORY_METRICS = ("peak_allocated_mib", "device_used_mib", "peak_rss_mib")
"""Memory (MiB): higher is worse."""

SPEED_METRICS = ("samples_per_s",)
"""Throughput (samples/s): lower is worse."""

REFERENCE_METRICS = ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "peak_rss_mib",
                     "samples_per_s", "step_time_s")
"""Metrics a references file may declare (the schema lists the same)."""

_SITE_PARTITION = re.compile(r"[^:\s]+:[^:\s]+")


@dataclass(frozen=True)
class Regression:
    """One metric of one cell that got worse on ``night``.

    ``change`` is relative to ``baseline`` (0.25 = 25 % higher); ``limit`` is the allowed relative
    bound that was crossed; ``against`` is "reference" or "median". Memory in MiB, speed in samples/s.
    """

    site: str
    partition: str
    model: str
    technique: str
    night: str
    metric: str
    value: float
    baseline: float
    change: float
    limit: float
    against: str
    matrix: str = ""
    versions_changed: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["versions_changed"] = list(self.versions_changed)
        return out


# ---------------------------------------------------------------- references


def load_references(path: str | Path) -> dict:
    """Read and check a references file (``jobs/nightly/references.schema.json``).

    Returns ``{"site:partition": {model: {technique: {metric: [value, lower, upper]}}}}``.
    A bad file raises ConfigError naming the file and the key.
    """
    path = Path(path)
    doc = load_yaml(path)
    if doc is None:
        doc = {}
    validate(doc, load_schema(data_dir("jobs") / "nightly" / "references.schema.json"), str(path))
    for where, models in doc.items():
        if not _SITE_PARTITION.fullmatch(where):
            raise ConfigError(f"{path}: {where}: expected a 'site:partition' key")
        for model, techniques in models.items():
            for technique, metrics in techniques.items():
                for metric, triple in metrics.items():
                    _check_triple(triple, f"{path}: {where}.{model}.{technique}.{metric}")
    return doc


def _check_triple(triple: list, where: str) -> None:
    if len(triple) != 3:
        raise ConfigError(f"{where}: expected [value, lower, upper], got {len(triple)} item(s)")
    value, lower, upper = triple
    if value is None or value <= 0:
        raise ConfigError(f"{where}: the reference value must be a number > 0, got {value!r}")
    if lower is not None and lower > 0:
        raise ConfigError(f"{where}: the lower tolerance must be <= 0 (e.g. -0.1), got {lower}")
    if upper is not None and upper < 0:
        raise ConfigError(f"{where}: the upper tolerance must be >= 0 (e.g. 0.1), got {upper}")


def references_frame(references: Mapping | None) -> pd.DataFrame:
    """The references as rows: site, partition, model, technique, metric, reference, lower, upper."""
    rows = []
    for where, models in (references or {}).items():
        site, _, partition = where.partition(":")
        for model, techniques in models.items():
            for technique, metrics in techniques.items():
                for metric, (value, lower, upper) in metrics.items():
                    rows.append((site, partition, model, technique, metric, float(value),
                                 -math.inf if lower is None else float(lower),
                                 math.inf if upper is None else float(upper)))
    return pd.DataFrame(rows, columns=[*REF_CELL, "metric", "reference", "lower", "upper"])


# ---------------------------------------------------------------- nights


def cell_nights(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell (CELL): its ``latest`` night with a row and its ``previous`` one (None when it has one)."""
    nights = frame[[*CELL, "night"]].drop_duplicates().sort_values([*CELL, "night"])
    nights["previous"] = nights.groupby(list(CELL), sort=False, dropna=False)["night"].shift(1)
    latest = nights.groupby(list(CELL), sort=False, dropna=False).tail(1)
    latest = latest.rename(columns={"night": "latest"}).reset_index(drop=True)
    latest["previous"] = latest["previous"].astype(object).where(latest["previous"].notna(), None)
    return latest


def partition_nights(frame: pd.DataFrame) -> pd.DataFrame:
    """Per site and partition: its newest night (``latest``) and the one before (``previous``, None)."""
    nights = frame[["site", "partition", "night"]].drop_duplicates().sort_values(["site", "partition", "night"])
    nights["previous"] = nights.groupby(["site", "partition"], sort=False)["night"].shift(1)
    latest = nights.groupby(["site", "partition"], sort=False).tail(1).rename(columns={"night": "latest"})
    latest = latest.reset_index(drop=True)
    latest["previous"] = latest["previous"].astype(object).where(latest["previous"].notna(), None)
    return latest


def latest_rows(frame: pd.DataFrame, nights: pd.DataFrame) -> pd.DataFrame:
    """The row of each cell's latest night (``nights`` from ``cell_nights``)."""
    latest = frame.merge(nights[[*CELL, "latest"]], on=list(CELL))
    return latest[latest["night"] == latest["latest"]].drop(columns="latest")


# ---------------------------------------------------------------- checks


def against_references(latest: pd.DataFrame, references: Mapping | None) -> list[Regression]:
    """Latest-night ok measurements outside their declared reference bounds.

    A declared metric the cell did not measure (e.g. peak_allocated_mib on CPU) is not checked.
    """
    refs = references_frame(references)
    if refs.empty:
        return []
    measured = _long(latest[latest["status"] == "ok"], REFERENCE_METRICS, [*CELL, "night"])
    hits = measured.merge(refs, on=[*REF_CELL, "metric"])
    change = hits["value"] / hits["reference"] - 1.0
    low, high = change < hits["lower"], change > hits["upper"]
    hits = hits.assign(change=change, limit=hits["lower"].where(low, hits["upper"]))[low | high]
    return _regressions(hits.rename(columns={"reference": "baseline"}), "reference")


def median_baseline(frame: pd.DataFrame, nights: pd.DataFrame, window: int) -> pd.DataFrame:
    """Per cell, the median of each memory and speed metric over its last ``window`` ok rows before
    its latest night (cells without such rows are absent)."""
    metrics = [*MEMORY_METRICS, *SPEED_METRICS]
    before = frame.merge(nights[[*CELL, "latest"]], on=list(CELL))
    before = before[(before["night"] < before["latest"]) & (before["status"] == "ok")]
    recent = before.sort_values("night").groupby(list(CELL), sort=False).tail(window)
    return recent.groupby(list(CELL), sort=False)[metrics].median().reset_index()


def against_median(latest: pd.DataFrame, baseline: pd.DataFrame, tolerance: float) -> list[Regression]:
    """Latest-night ok measurements worse than the rolling median by more than ``tolerance``
    (a fraction: 0.10 = 10 %): memory above, samples/s below."""
    metrics = [*MEMORY_METRICS, *SPEED_METRICS]
    measured = _long(latest[latest["status"] == "ok"], metrics, [*CELL, "night"])
    base = _long(baseline, metrics, list(CELL)).rename(columns={"value": "baseline"})
    hits = measured.merge(base, on=[*CELL, "metric"])
    hits = hits[hits["baseline"] > 0]
    change = hits["value"] / hits["baseline"] - 1.0
    memory = hits["metric"].isin(MEMORY_METRICS)
    worse = (memory & (change > tolerance)) | (~memory & (change < -tolerance))
    hits = hits.assign(change=change, limit=memory.map({True: tolerance, False: -tolerance}))[worse]
    return _regressions(hits, "median")


def new_failures(frame: pd.DataFrame, nights: pd.DataFrame) -> list[dict]:
    """Cells whose latest row is failed, incomplete or missing while their previous row that ran (not
    skipped) was ok, as dicts: the cell, ``night``, ``status``, ``verdict``, ``error``, ``previous_night``.

    ``nights`` from ``cell_nights(frame)``. A cell skipped on its latest night is not judged; a cell
    with no row on some night was not run then (see ``pending_cells`` for submitted ones).
    """
    ran = frame[frame["status"] != "skipped"]
    if ran.empty:
        return []
    judged = cell_nights(ran).merge(nights[[*CELL, "latest"]].rename(columns={"latest": "last_row"}), on=list(CELL))
    judged = judged[(judged["latest"] == judged["last_row"]) & judged["previous"].notna()]
    now = ran.merge(judged[[*CELL, "latest", "previous"]], on=list(CELL))
    now = now[(now["night"] == now["latest"]) & now["status"].isin(FAILED_STATUSES)]
    was_ok = ran[ran["status"] == "ok"][[*CELL, "night"]].rename(columns={"night": "previous"})
    hits = now.merge(was_ok, on=[*CELL, "previous"]).sort_values(list(CELL))
    return [{"site": r.site, "partition": r.partition, "model": r.model, "technique": r.technique,
             "matrix": text(r.matrix), "night": r.latest, "status": r.status, "verdict": text(r.verdict),
             "error": text(r.error), "previous_night": r.previous} for r in hits.itertuples(index=False)]


def pending_cells(frame: pd.DataFrame, submitted: pd.DataFrame) -> list[dict]:
    """Cells a manifest meant to run (``submitted``: night, site, matrix, partition, model, technique,
    state) with no row in ``frame``: still running, not collected yet, or never submitted (state
    ``planned``). Not failures: ``bench collect`` stores them when they end. As dicts: the cell,
    ``night``, ``state``, ``last_night`` (the cell's latest row, "" when none)."""
    if submitted is None or submitted.empty:
        return []
    have = frame[["night", *CELL]].drop_duplicates()
    lost = submitted.merge(have, on=["night", *CELL], how="left", indicator=True)
    lost = lost[lost["_merge"] == "left_only"].drop(columns="_merge")
    lost = lost.merge(cell_nights(frame)[[*CELL, "latest"]], on=list(CELL), how="left")
    lost = lost.sort_values([*CELL, "night"])
    return [{"site": r.site, "partition": r.partition, "model": r.model, "technique": r.technique,
             "matrix": text(r.matrix), "night": r.night, "state": text(r.state), "last_night": text(r.latest)}
            for r in lost.itertuples(index=False)]


# ---------------------------------------------------------------- helpers


def _long(rows: pd.DataFrame, metrics, ids: list[str]) -> pd.DataFrame:
    """``ids``, metric, value: one row per measured (non-null) metric."""
    present = [m for m in metrics if m in rows.columns]
    long = rows.melt(id_vars=ids, value_vars=present, var_name="metric", value_name="value")
    return long.dropna(subset=["value"])


def _regressions(hits: pd.DataFrame, against: str) -> list[Regression]:
    hits = hits.sort_values([*CELL, "metric"])
    return [Regression(r.site, r.partition, r.model, r.technique, r.night, r.metric, float(r.value),
                       float(r.baseline), float(r.change), float(r.limit), against, text(r.matrix))
            for r in hits.itertuples(index=False)]


def text(value) -> str:
    """A stored text value for display: "" for None or NaN (not recorded), else str."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
