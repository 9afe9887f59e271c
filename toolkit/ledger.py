"""The ledger: every run and attempt, durably, in sqlite (WAL).

Every step is written here before it is acted on: an attempt row exists (state
``planned``) before its script is rendered and submitted, is marked ``submitting`` right
before sbatch, and gets its job id right after. Writers take sqlite's write lock
with ``BEGIN IMMEDIATE`` so two controllers never interleave a step.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import LedgerError

SCHEMA_VERSION = 1
RUN_STATES = ("running", "succeeded", "failed", "gave_up", "cancelled")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY, spec_path TEXT NOT NULL, spec_name TEXT NOT NULL, site TEXT NOT NULL,
  site_path TEXT NOT NULL, partition TEXT NOT NULL, run_dir TEXT NOT NULL, workdir TEXT NOT NULL, state TEXT NOT NULL,
  reason TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS attempts (
  run_id TEXT NOT NULL REFERENCES runs(run_id), n INTEGER NOT NULL, job_id TEXT, state TEXT NOT NULL,
  plan TEXT NOT NULL, verdict TEXT, metrics TEXT, decision TEXT, attempt_dir TEXT NOT NULL, partition TEXT NOT NULL,
  exit_code INTEGER, created REAL NOT NULL, submitted REAL, finished REAL, updated REAL NOT NULL,
  PRIMARY KEY (run_id, n));
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, n INTEGER, at REAL NOT NULL, what TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Run:
    run_id: str
    spec_path: str
    spec_name: str
    site: str
    site_path: str
    partition: str
    run_dir: str
    workdir: str
    state: str
    reason: str
    created: float
    updated: float


@dataclass(frozen=True)
class AttemptRow:
    run_id: str
    n: int
    job_id: str | None
    state: str
    plan: dict
    verdict: dict | None
    metrics: dict | None
    decision: dict | None
    attempt_dir: str
    partition: str
    exit_code: int | None
    created: float
    submitted: float | None
    finished: float | None
    updated: float

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "job_id": self.job_id, "state": self.state, "verdict": self.verdict, "plan": self.plan,
                "metrics": self.metrics, "decision": self.decision, "attempt_dir": self.attempt_dir,
                "partition": self.partition,
                "exit_code": self.exit_code, "submitted": self.submitted, "finished": self.finished}


class Ledger:
    """One sqlite file; open it, use it, close it (also as a context manager)."""

    def __init__(self, path: Path, timeout_s: float = 30.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"ledger {self.path}: {exc}") from exc

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under sqlite's write lock; committed on success, rolled back on error."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise LedgerError(f"ledger {self.path} is locked by another writer ({exc}); try again") from exc
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        else:
            self.db.execute("COMMIT")

    def _migrate(self) -> None:
        with self.write() as db:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row["value"]) > SCHEMA_VERSION:
                raise LedgerError(f"ledger {self.path} has schema version {row['value']}, newer than this hpcmem "
                                  f"({SCHEMA_VERSION}); upgrade hpcmem")

    # --- runs ---
    def add_run(self, run: Run, first_plan: dict, first_attempt_dir: str) -> None:
        """Record a run together with its first attempt (``planned``), in one transaction."""
        with self.write() as db:
            db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       (run.run_id, run.spec_path, run.spec_name, run.site, run.site_path, run.partition, run.run_dir,
                        run.workdir, run.state, run.reason, run.created, run.updated))
            _event(db, run.run_id, None, "run created")
            _insert_attempt(db, run.run_id, 1, first_plan, first_attempt_dir, run.partition, None)

    def set_run_state(self, run_id: str, state: str, reason: str = "") -> None:
        if state not in RUN_STATES:
            raise ValueError(state)
        with self.write() as db:
            db.execute("UPDATE runs SET state=?, reason=?, updated=? WHERE run_id=?", (state, reason, time.time(), run_id))
            _event(db, run_id, None, f"run {state}" + (f": {reason}" if reason else ""))

    def run(self, run_id: str) -> Run:
        row = self.db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            raise LedgerError(f"no run {run_id!r} in {self.path}")
        return Run(**dict(row))

    def runs(self, states: tuple[str, ...] | None = None) -> list[Run]:
        rows = self.db.execute("SELECT * FROM runs ORDER BY created").fetchall()
        return [Run(**dict(r)) for r in rows if states is None or r["state"] in states]

    # --- attempts ---
    def add_attempt(self, run_id: str, n: int, plan: dict, attempt_dir: str, partition: str,
                    decision: dict | None = None) -> None:
        """Record attempt ``n`` as ``planned`` (with the decision that chose its plan)."""
        with self.write() as db:
            _insert_attempt(db, run_id, n, plan, attempt_dir, partition, decision)

    def update_attempt(self, run_id: str, n: int, **fields: Any) -> None:
        """Set some columns of an attempt (dict values are stored as JSON)."""
        allowed = {"job_id", "state", "verdict", "metrics", "exit_code", "submitted", "finished"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown attempt fields {unknown}")
        values = [json.dumps(v) if isinstance(v, dict) else v for v in fields.values()]
        sets = ", ".join(f"{k}=?" for k in fields)
        with self.write() as db:
            db.execute(f"UPDATE attempts SET {sets}, updated=? WHERE run_id=? AND n=?", (*values, time.time(), run_id, n))
            _event(db, run_id, n, "attempt " + ", ".join(f"{k}={v}" for k, v in fields.items()
                                                         if k in ("job_id", "state", "exit_code")))

    def attempts(self, run_id: str) -> list[AttemptRow]:
        rows = self.db.execute("SELECT * FROM attempts WHERE run_id=? ORDER BY n", (run_id,)).fetchall()
        return [_attempt(r) for r in rows]

    def add_event(self, run_id: str, n: int | None, what: str) -> None:
        with self.write() as db:
            _event(db, run_id, n, what)

    def events(self, run_id: str) -> list[tuple[float, int | None, str]]:
        rows = self.db.execute("SELECT at, n, what FROM events WHERE run_id=? ORDER BY id", (run_id,)).fetchall()
        return [(r["at"], r["n"], r["what"]) for r in rows]


def _attempt(row: sqlite3.Row) -> AttemptRow:
    d = dict(row)
    for key in ("plan", "verdict", "metrics", "decision"):
        d[key] = json.loads(d[key]) if d[key] else None
    return AttemptRow(**d)


def _insert_attempt(db: sqlite3.Connection, run_id: str, n: int, plan: dict, attempt_dir: str, partition: str,
                    decision: dict | None) -> None:
    now = time.time()
    db.execute("INSERT INTO attempts (run_id, n, state, plan, decision, attempt_dir, partition, created, updated) "
               "VALUES (?,?,?,?,?,?,?,?,?)", (run_id, n, "planned", json.dumps(plan),
                                              json.dumps(decision) if decision else None, attempt_dir, partition,
                                              now, now))
    _event(db, run_id, n, "attempt planned" + (f": {', '.join(decision.get('moves', ()))}" if decision else ""))


def _event(db: sqlite3.Connection, run_id: str, n: int | None, what: str) -> None:
    db.execute("INSERT INTO events (run_id, n, at, what) VALUES (?,?,?,?)", (run_id, n, time.time(), what))
