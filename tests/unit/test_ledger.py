"""The ledger: durable, WAL, refuses a newer schema, a locked writer is a clear error."""

import sqlite3
import time

import pytest

from toolkit.errors import LedgerError
from toolkit.ledger import Ledger, Run


def make_run(run_id="r1"):
    now = time.time()
    return Run(run_id=run_id, spec_path="/s.yaml", spec_name="s", site="local", site_path="/l.yaml",
               partition="default", run_dir="/runs/r1", workdir="/w", state="running", reason="", created=now, updated=now)


def test_runs_and_attempts_round_trip(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.add_run(make_run(), {"micro_batch": 8}, "/runs/r1/attempt-1")
        led.update_attempt("r1", 1, state="submitting")
        led.update_attempt("r1", 1, job_id="42", state="PENDING", submitted=1.0)
        led.update_attempt("r1", 1, state="COMPLETED", metrics={"peak_rss_mib": 10.5}, exit_code=0)
        led.set_run_state("r1", "succeeded")
    with Ledger(path) as led:  # reopened: everything is still there
        (a,) = led.attempts("r1")
        assert (a.job_id, a.state, a.plan, a.metrics, a.exit_code) == ("42", "COMPLETED", {"micro_batch": 8}, {"peak_rss_mib": 10.5}, 0)
        assert led.run("r1").state == "succeeded"
        whats = [w for _, _, w in led.events("r1")]
        assert whats[0] == "run created" and "attempt state=submitting" in whats and whats[-1] == "run succeeded"
        assert led.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_unknown_run_and_duplicate_attempt(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        with pytest.raises(LedgerError, match="no run 'nope'"):
            led.run("nope")
        led.add_run(make_run(), {}, "/a")
        with pytest.raises(sqlite3.IntegrityError):
            led.add_attempt("r1", 1, {}, "/a", "p")
        assert len(led.attempts("r1")) == 1


def test_newer_schema_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as led:
        led.add_run(make_run(), {}, "/a")
        led.db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(LedgerError, match="newer than this hpcmem"):
        Ledger(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM runs").fetchone()[0] == 1


def test_a_held_write_lock_is_a_clear_error(tmp_path):
    path = tmp_path / "l.sqlite"
    Ledger(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LedgerError, match="locked"):
            Ledger(path, timeout_s=0.2)
    finally:
        holder.execute("ROLLBACK")


def test_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "l.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(LedgerError):
        Ledger(path)
    assert path.read_bytes().startswith(b"this is not a database")


def test_status_line_shows_the_jobs_last_progress_line(tmp_path):
    from toolkit.ledger import AttemptRow
    from toolkit.runs import status_line

    (tmp_path / "slurm-7.out").write_text("hpcmem: job 7\nstep 1/8 loss 8.3\nstep 2/8 loss 8.2 samples/s 41\nnoise\n")
    row = AttemptRow(run_id="r1", n=1, job_id="7", state="RUNNING", plan={"micro_batch": 8, "global_batch": 8},
                     verdict=None, metrics=None, decision=None, attempt_dir=str(tmp_path), partition="cpu",
                     exit_code=None, created=0, submitted=0, finished=None, updated=0)
    line = status_line(make_run(), [row])
    assert "attempt 1 job 7 RUNNING" in line and line.endswith("| step 2/8 loss 8.2 samples/s 41")
