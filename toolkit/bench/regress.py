"""Regressions in the results store: what got worse on the latest night, and what stopped working.

Three checks, all on each site's latest night (pure functions on a results-store DataFrame,
columns as in ``columns.py``):

- against declared **references** per ``site:partition`` (ReFrame style): ``[value, lower, upper]``,
  lower and upper relative tolerances, ``null`` unbounded; a measurement outside
  ``[value * (1 + lower), value * (1 + upper)]`` is a regression, in either direction;
- against the **rolling median** of the cell's previous ``window`` ok nights: a memory metric
  (MiB) up by more than ``tolerance``, or samples/s down by more than ``tolerance``;
- **newly failing** cells: ok on the site's previous night, failed, incomplete, missing or absent
  on the latest one.

Only ok rows are compared with a baseline; failed rows are reported, never a crash.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from ..errors import ConfigError
from ..resources import data_dir
from ..schema import load_schema, load_yaml, validate

CELL = ("site", "partition", "model", "technique")
"""A cell across nights: the same benchmark on the same partition."""

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
    return pd.DataFrame(rows, columns=[*CELL, "metric", "reference", "lower", "upper"])


# ---------------------------------------------------------------- nights


def site_nights(frame: pd.DataFrame) -> pd.DataFrame:
    """Per site: its ``latest`` night and its ``previous`` one (None when it has a single night)."""
    rows = []
    for site, nights in frame.groupby("site", sort=True)["night"].unique().items():
        ordered = sorted(nights)
        rows.append((site, ordered[-1], ordered[-2] if len(ordered) > 1 else None))
    return pd.DataFrame(rows, columns=["site", "latest", "previous"])


def latest_rows(frame: pd.DataFrame, nights: pd.DataFrame) -> pd.DataFrame:
    """The rows of each site's latest night."""
    latest = frame.merge(nights[["site", "latest"]], on="site")
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
    hits = measured.merge(refs, on=[*CELL, "metric"])
    change = hits["value"] / hits["reference"] - 1.0
    low, high = change < hits["lower"], change > hits["upper"]
    hits = hits.assign(change=change, limit=hits["lower"].where(low, hits["upper"]))[low | high]
    return _regressions(hits.rename(columns={"reference": "baseline"}), "reference")


def median_baseline(frame: pd.DataFrame, nights: pd.DataFrame, window: int) -> pd.DataFrame:
    """Per cell, the median of each memory and speed metric over its last ``window`` ok rows before
    its site's latest night (cells without such rows are absent)."""
    metrics = [*MEMORY_METRICS, *SPEED_METRICS]
    before = frame.merge(nights[["site", "latest"]], on="site")
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
    """Cells ok on their site's previous night and not ok (failed, incomplete, missing, or no row)
    on its latest night, as dicts: the cell, ``night``, ``status``, ``verdict``, ``error``, ``previous_night``."""
    both = nights.dropna(subset=["previous"])
    if both.empty:
        return []
    rows = frame.merge(both, on="site")
    before = rows[(rows["night"] == rows["previous"]) & (rows["status"] == "ok")][[*CELL, "latest", "previous"]]
    now = rows[rows["night"] == rows["latest"]][[*CELL, "status", "verdict", "error"]]
    joined = before.merge(now, on=list(CELL), how="left", indicator=True)
    absent = joined["_merge"] == "left_only"
    joined["status"] = joined["status"].where(~absent, "missing")
    joined["error"] = joined["error"].where(~absent, "no row for this cell on this night")
    joined = joined[joined["status"] != "ok"].sort_values(list(CELL))
    return [{"site": r.site, "partition": r.partition, "model": r.model, "technique": r.technique,
             "night": r.latest, "status": r.status, "verdict": _text(r.verdict), "error": _text(r.error),
             "previous_night": r.previous} for r in joined.itertuples(index=False)]


# ---------------------------------------------------------------- helpers


def _long(rows: pd.DataFrame, metrics, ids: list[str]) -> pd.DataFrame:
    """``ids``, metric, value: one row per measured (non-null) metric."""
    present = [m for m in metrics if m in rows.columns]
    long = rows.melt(id_vars=ids, value_vars=present, var_name="metric", value_name="value")
    return long.dropna(subset=["value"])


def _regressions(hits: pd.DataFrame, against: str) -> list[Regression]:
    hits = hits.sort_values([*CELL, "metric"])
    return [Regression(r.site, r.partition, r.model, r.technique, r.night, r.metric, float(r.value),
                       float(r.baseline), float(r.change), float(r.limit), against)
            for r in hits.itertuples(index=False)]


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
