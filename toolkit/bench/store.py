"""The results store: one row per benchmark cell per night (columns.py), in one sqlite file.

``append`` writes rows in one transaction with ``INSERT OR IGNORE`` under a UNIQUE index on
``KEY``: an interrupted append stores none of its rows and keeps every earlier one, and a
row already stored is never stored twice. ``load`` reads everything back as a DataFrame
with ``COLUMNS``. A column added to COLUMNS later is added to an existing file on open, and
a store keyed otherwise (before ``matrix`` joined KEY) is re-keyed on open, every row kept.
Default path: ``$HPCMEM_HOME/bench/results.sqlite``.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from ..errors import HpcmemError
from ..resources import home_dir
from .columns import COLUMNS, KEY, NUMERIC, STATUSES

TABLE = "results"
INDEX = "results_key"   # UNIQUE on KEY (a named index, so a later change of KEY can be migrated)
_INTEGER = {"micro_batch", "grad_accum", "world_size", "seq_len", "zero_stage", "steps", "checkpointing"}


def default_path(home: Path | None = None) -> Path:
    """``$HPCMEM_HOME/bench/results.sqlite``."""
    return (home or home_dir()) / "bench" / "results.sqlite"


def _sql_type(column: str) -> str:
    if column in _INTEGER:
        return "INTEGER"
    return "REAL" if column in NUMERIC else "TEXT"


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    path = Path(path)
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path), timeout=30.0, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        columns = ", ".join(f'"{c}" {_sql_type(c)}' for c in COLUMNS)
        db.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} ({columns})")
        present = {row[1] for row in db.execute(f"PRAGMA table_info({TABLE})")}
        for column in COLUMNS:
            if column not in present:  # a store written before this column existed
                db.execute(f'ALTER TABLE {TABLE} ADD COLUMN "{column}" {_sql_type(column)}')
        if _unique_keys(db) != [KEY]:
            _migrate_key(db, path)
        return db
    except (OSError, sqlite3.DatabaseError) as exc:
        raise HpcmemError(f"results store {path}: {exc}") from exc


def _unique_keys(db: sqlite3.Connection) -> list[tuple[str, ...]]:
    """The column tuples of the results table's UNIQUE indexes (inline constraints included)."""
    out = []
    for _, name, unique, *_ in db.execute(f"PRAGMA index_list({TABLE})"):
        if unique:
            out.append(tuple(r[2] for r in db.execute(f'PRAGMA index_info("{name}")')))
    return sorted(out)


def _migrate_key(db: sqlite3.Connection, path: Path) -> None:
    """Make KEY the table's only UNIQUE key, keeping every row, in one transaction.

    A store written before ``matrix`` joined KEY has an inline ``UNIQUE (night, ..., technique)``
    that sqlite cannot drop: the table is rebuilt (rows copied by column name, extra columns
    kept) and renamed into place. Widening a key cannot make stored rows collide. Two
    processes opening an old store at once: the second finds the work done.
    """
    try:
        db.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        raise HpcmemError(f"results store {path} is locked by another writer ({exc}); try again") from exc
    try:
        keys = _unique_keys(db)
        if not keys:  # a new store
            db.execute(f"CREATE UNIQUE INDEX IF NOT EXISTS {INDEX} ON {TABLE} ({', '.join(KEY)})")
        elif keys != [KEY]:
            info = list(db.execute(f"PRAGMA table_info({TABLE})"))
            names = [r[1] for r in info]
            types = {r[1]: r[2] for r in info}
            ordered = [*COLUMNS, *(n for n in names if n not in COLUMNS)]
            definition = ", ".join(f'"{c}" {types.get(c) or _sql_type(c)}' for c in ordered)
            quoted = ", ".join(f'"{c}"' for c in ordered)
            db.execute(f"DROP TABLE IF EXISTS {TABLE}_rekey")
            db.execute(f"CREATE TABLE {TABLE}_rekey ({definition})")
            db.execute(f"INSERT INTO {TABLE}_rekey ({quoted}) SELECT {quoted} FROM {TABLE}")
            db.execute(f"DROP TABLE {TABLE}")
            db.execute(f"ALTER TABLE {TABLE}_rekey RENAME TO {TABLE}")
            db.execute(f"CREATE UNIQUE INDEX {INDEX} ON {TABLE} ({', '.join(KEY)})")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def check_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row as stored: every COLUMNS name (missing ones None); unknown names, a missing key or status refused."""
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise HpcmemError(f"results row: unknown column {sorted(unknown)[0]!r} (columns: toolkit/bench/columns.py)")
    for name in KEY:
        if not row.get(name):
            raise HpcmemError(f"results row: key column {name!r} is empty")
    if row.get("status") not in STATUSES:
        raise HpcmemError(f"results row {_key_text(row)}: status must be one of {', '.join(STATUSES)}; "
                          f"got {row.get('status')!r}")
    out = {c: row.get(c) for c in COLUMNS}
    if isinstance(out["plan_json"], Mapping):
        out["plan_json"] = json.dumps(out["plan_json"], sort_keys=True)
    if out["checkpointing"] is not None:
        out["checkpointing"] = int(bool(out["checkpointing"]))
    return out


def _key_text(row: Mapping[str, Any]) -> str:
    return "/".join(str(row.get(k)) for k in KEY)


def append(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Store ``rows`` in one transaction; returns how many were new (a row whose KEY is stored is skipped).

    If anything fails part-way (a bad row, an interrupt), nothing of this call is stored
    and everything stored before is kept.
    """
    with closing(_connect(path, create=True)) as db:
        placeholders = ", ".join("?" for _ in COLUMNS)
        names = ", ".join(f'"{c}"' for c in COLUMNS)
        sql = f"INSERT OR IGNORE INTO {TABLE} ({names}) VALUES ({placeholders})"
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise HpcmemError(f"results store {path} is locked by another writer ({exc}); try again") from exc
        try:
            before = db.total_changes
            for row in rows:
                checked = check_row(row)
                db.execute(sql, [checked[c] for c in COLUMNS])
            added = db.total_changes - before
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return added


def keys(path: Path) -> set[tuple[str, ...]]:
    """The KEY of every stored row (empty when the store does not exist yet)."""
    if not Path(path).exists():
        return set()
    with closing(_connect(path, create=False)) as db:
        return {tuple(r) for r in db.execute(f"SELECT {', '.join(KEY)} FROM {TABLE}")}


def empty_frame() -> pd.DataFrame:
    return _typed(pd.DataFrame(columns=list(COLUMNS)))


def load(path: Path) -> pd.DataFrame:
    """Every stored row as a DataFrame with COLUMNS (in that order); empty when the store does not exist.

    Numeric columns are floats (NaN where not measured), ``checkpointing`` is bool,
    the rest are str or None. Rows are ordered by night, site, partition, model, technique.
    """
    if not Path(path).exists():
        return empty_frame()
    with closing(_connect(path, create=False)) as db:
        cursor = db.execute(f"SELECT {', '.join(chr(34) + c + chr(34) for c in COLUMNS)} FROM {TABLE} "
                            f"ORDER BY {', '.join(KEY)}")
        frame = pd.DataFrame.from_records(cursor.fetchall(), columns=list(COLUMNS))
    return _typed(frame)


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    for column in NUMERIC:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    frame["checkpointing"] = frame["checkpointing"].map(lambda v: None if v is None or v != v else bool(v))
    return frame


def calibration_metrics(frame: pd.DataFrame, site: str, partition: str) -> list[dict[str, Any]]:
    """Metrics-like dicts for ``toolkit.calibrate.fit_overheads`` from the ok cells of one partition.

    Each stored row holds the job's maxima over ranks (peak allocated, peak reserved, device
    used, MiB); a row with all three is one point, given as a one-rank ``ranks`` record.
    (The maxima may come from different ranks of a multi-GPU cell; on one node the ranks
    of a cell are near-identical, so the point is kept.)
    """
    keys_ = ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib")
    rows = frame[(frame["site"] == site) & (frame["partition"] == partition) & (frame["status"] == "ok")]
    rows = rows.dropna(subset=list(keys_))
    out = []
    for _, row in rows.iterrows():
        point = {k: float(row[k]) for k in keys_}
        out.append({**point, "ranks": {"0": point}, "night": row["night"], "model": row["model"],
                    "technique": row["technique"]})
    return out
