"""The ledger: every run and attempt, durably, in sqlite (WAL).

Every step is written here before it is acted on: an attempt row exists (state
``planned``) before its script is rendered and submitted, is marked ``submitting`` right
before sbatch, and gets its job id right after. Writers take sqlite's write lock
with ``BEGIN IMMEDIATE`` so two controllers never interleave a step.

A damaged ledger (a garbage page, a row whose JSON does not parse, a schema version
that is not a number) is a ``LedgerError``: one line that names the file and points to
``hpcmem doctor``, never a traceback. A ledger that is missing or empty (0 bytes) while
run directories exist beside it was lost, not new: it is not silently re-created
(``hpcmem doctor --repair`` rebuilds it from the run directories).
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
REPAIR_HINT = "run `hpcmem doctor` to check it (`hpcmem doctor --repair` rebuilds it from the run directories)"
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

    def __init__(self, path: Path, timeout_s: float = 30.0, *, rebuilding: bool = False):
        """Open (or create) the ledger at ``path``. ``rebuilding``: create it even though run directories
        exist beside it (``hpcmem doctor --repair`` does, to rebuild it from them)."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LedgerError(f"cannot create the hpcmem home {self.path.parent} ({exc.strerror or exc}); "
                              "HPCMEM_HOME must be a directory") from None
        if self.path.is_dir():
            raise LedgerError(f"ledger {self.path} is a directory, not a file")
        if not rebuilding:
            _refuse_lost(self.path)
        self.db = None
        try:
            self.db = sqlite3.connect(str(self.path), timeout=timeout_s, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except (sqlite3.DatabaseError, LedgerError) as exc:
            if self.db is not None:
                self.db.close()
            if isinstance(exc, LedgerError):
                raise
            raise _damaged(self.path, exc) from None

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
            if "locked" in str(exc) or "busy" in str(exc):
                raise LedgerError(f"ledger {self.path} is locked by another writer ({exc}); try again") from None
            raise _damaged(self.path, exc) from None
        except sqlite3.DatabaseError as exc:
            raise _damaged(self.path, exc) from None
        try:
            yield self.db
        except BaseException as exc:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.DatabaseError:
                pass
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.IntegrityError):
                raise _damaged(self.path, exc) from None
            raise
        else:
            try:
                self.db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                raise _damaged(self.path, exc) from None

    def _query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        """A read; a damaged file is a LedgerError."""
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise _damaged(self.path, exc) from None

    def _migrate(self) -> None:
        with self.write() as db:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                return
            text = str(row["value"])
            shown = repr(text if len(text) <= 40 else text[:40] + "...")  # one short line, whatever it holds
            try:
                version = int(text.strip())
            except ValueError:
                raise LedgerError(f"ledger {self.path} is damaged: its schema version {shown} is not a "
                                  f"number; {REPAIR_HINT}") from None
            if version > SCHEMA_VERSION:
                raise LedgerError(f"ledger {self.path} has schema version {shown}, newer than this hpcmem "
                                  f"({SCHEMA_VERSION}); upgrade hpcmem")

    def check(self) -> list[str]:
        """What is wrong inside the ledger (sqlite's integrity check, unreadable rows); empty when sound."""
        problems = []
        try:
            result = [r[0] for r in self.db.execute("PRAGMA integrity_check").fetchall()]
        except sqlite3.DatabaseError as exc:
            return [f"sqlite integrity check failed: {exc}"]
        if result != ["ok"]:
            problems += [f"sqlite: {line}" for line in result[:5]]
        try:
            for row in self.db.execute("SELECT run_id FROM runs").fetchall():
                try:
                    self.run(row["run_id"])
                    self.attempts(row["run_id"])
                except LedgerError as exc:
                    problems.append(str(exc))
        except sqlite3.DatabaseError as exc:
            problems.append(f"the runs table cannot be read: {exc}")
        return problems

    def import_run(self, run: Run, attempts: list[dict[str, Any]], events: list[str] = ()) -> None:
        """Insert a run with its attempts as they are (``hpcmem doctor --repair``: rows rebuilt from a run
        directory). Each attempt dict has the ``attempts`` columns (plan, verdict, metrics, decision as dicts)."""
        with self.write() as db:
            db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       (run.run_id, run.spec_path, run.spec_name, run.site, run.site_path, run.partition, run.run_dir,
                        run.workdir, run.state, run.reason, run.created, run.updated))
            for a in attempts:
                db.execute(
                    "INSERT INTO attempts (run_id, n, job_id, state, plan, verdict, metrics, decision, attempt_dir, "
                    "partition, exit_code, created, submitted, finished, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (run.run_id, a["n"], a.get("job_id"), a["state"], json.dumps(a.get("plan") or {}),
                     *(json.dumps(a[k]) if a.get(k) else None for k in ("verdict", "metrics", "decision")),
                     a["attempt_dir"], a["partition"], a.get("exit_code"), a.get("created") or run.created,
                     a.get("submitted"), a.get("finished"), time.time()))
            for what in events:
                _event(db, run.run_id, None, what)

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
        rows = self._query("SELECT * FROM runs WHERE run_id=?", (run_id,))
        if not rows:
            raise LedgerError(f"no run {run_id!r} in {self.path}")
        return self._run(rows[0])

    def runs(self, states: tuple[str, ...] | None = None) -> list[Run]:
        rows = self._query("SELECT * FROM runs ORDER BY created")
        return [self._run(r) for r in rows if states is None or r["state"] in states]

    def _run(self, row: sqlite3.Row) -> Run:
        try:
            return Run(**dict(row))
        except TypeError as exc:
            raise LedgerError(f"ledger {self.path} is damaged: a runs row does not fit ({exc}); {REPAIR_HINT}") from None

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
        rows = self._query("SELECT * FROM attempts WHERE run_id=? ORDER BY n", (run_id,))
        return [_attempt(r, self.path) for r in rows]

    def add_event(self, run_id: str, n: int | None, what: str) -> None:
        with self.write() as db:
            _event(db, run_id, n, what)

    def events(self, run_id: str) -> list[tuple[float, int | None, str]]:
        rows = self._query("SELECT at, n, what FROM events WHERE run_id=? ORDER BY id", (run_id,))
        return [(r["at"], r["n"], r["what"]) for r in rows]


def _attempt(row: sqlite3.Row, path: Path) -> AttemptRow:
    d = dict(row)
    for key in ("plan", "verdict", "metrics", "decision"):
        try:
            d[key] = json.loads(d[key]) if d[key] else None
        except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply to parse
            why = " (nested too deeply)" if isinstance(exc, RecursionError) else ""
            raise LedgerError(f"ledger {path} is damaged: run {d.get('run_id')} attempt {d.get('n')}: its {key} is not "
                              f"valid JSON{why}; {REPAIR_HINT}") from None
        if key == "plan" and not isinstance(d[key], dict) or d[key] is not None and not isinstance(d[key], dict):
            raise LedgerError(f"ledger {path} is damaged: run {d.get('run_id')} attempt {d.get('n')}: its {key} is "
                              f"not a JSON object; {REPAIR_HINT}")
    try:
        return AttemptRow(**d)
    except TypeError as exc:
        raise LedgerError(f"ledger {path} is damaged: an attempts row does not fit ({exc}); {REPAIR_HINT}") from None


def _damaged(path: Path, exc: Exception) -> LedgerError:
    return LedgerError(f"ledger {path} is damaged or not an hpcmem ledger ({exc}); {REPAIR_HINT}")


def run_dirs_beside(path: Path) -> list[Path]:
    """The run directories in the hpcmem home that holds the ledger ``path``."""
    runs = Path(path).parent / "runs"
    try:
        return sorted(p for p in runs.iterdir() if p.is_dir())
    except OSError:
        return []


def _refuse_lost(path: Path) -> None:
    """A missing or 0-byte ledger beside existing run directories was lost: say so instead of starting afresh."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = None
    except OSError as exc:
        raise LedgerError(f"ledger {path} cannot be read ({exc.strerror or exc})") from None
    if size:
        return
    wal = Path(f"{path}-wal")
    if wal.exists() and wal.stat().st_size > 0:
        return  # its content is still in the write-ahead log
    found = run_dirs_beside(path)
    if not found:
        return
    what = "is missing" if size is None else "is empty (0 bytes)"
    raise LedgerError(f"ledger {path} {what} but {len(found)} run director{'y' if len(found) == 1 else 'ies'} exist "
                      f"under {path.parent / 'runs'}: the ledger was lost, not new. Run `hpcmem doctor --repair` to "
                      "rebuild it from the run directories (nothing was changed)")


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
