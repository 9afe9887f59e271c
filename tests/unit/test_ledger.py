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


# ---------------------------------------------------------------- a damaged ledger is one clear line


def _filled(path, runs=3):
    with Ledger(path) as led:
        for i in range(runs):
            led.add_run(make_run(f"r{i}"), {"micro_batch": 8, "note": "x" * 2000}, f"/runs/r{i}/attempt-1")
            for _ in range(20):
                led.add_event(f"r{i}", 1, "padding " * 50)
        led.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def test_a_garbage_page_inside_the_ledger_is_a_ledger_error_not_a_traceback(tmp_path):
    path = tmp_path / "ledger.sqlite"
    _filled(path)
    data = bytearray(path.read_bytes())
    assert len(data) >= 4 * 4096
    data[2 * 4096:4 * 4096] = b"\xde\xad\xbe\xef" * 2048  # pages 3-4: table b-tree pages, not the header
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerError, match=r"is damaged .*malformed.*run `hpcmem doctor`") as caught:
        with Ledger(path) as led:
            for run in led.runs():
                led.attempts(run.run_id)
                led.events(run.run_id)
    assert "\n" not in str(caught.value)


def test_bad_json_in_a_row_names_the_row_and_the_repair(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.add_run(make_run(), {"micro_batch": 8}, "/runs/r1/attempt-1")
        led.db.execute("UPDATE attempts SET plan='{not json' WHERE run_id='r1'")
        led.db.execute("UPDATE attempts SET verdict='[1, 2]' WHERE run_id='r1'")
    with Ledger(path) as led:
        with pytest.raises(LedgerError, match=r"run r1 attempt 1: its plan is not valid JSON; run `hpcmem doctor`"):
            led.attempts("r1")
        assert any("its plan is not valid JSON" in p for p in led.check())


@pytest.mark.parametrize("version", ["one", "1.5", ""])
def test_a_schema_version_that_is_not_a_number_is_a_ledger_error(tmp_path, version):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (version,))
    with pytest.raises(LedgerError, match=r"schema version .* is not a number; run `hpcmem doctor`"):
        Ledger(path)


def test_a_file_that_is_not_sqlite_is_a_ledger_error(tmp_path):
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"this is not a database\n" * 500)
    with pytest.raises(LedgerError, match="damaged or not an hpcmem ledger .*hpcmem doctor"):
        Ledger(path)


def test_an_empty_or_missing_ledger_beside_run_directories_is_not_silently_recreated(tmp_path):
    (tmp_path / "runs" / "20260101-000000-abcd").mkdir(parents=True)
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"")
    with pytest.raises(LedgerError, match=r"is empty \(0 bytes\) but 1 run directory exist.*hpcmem doctor --repair"):
        Ledger(path)
    assert path.stat().st_size == 0, "nothing may be written over the evidence"
    path.unlink()
    with pytest.raises(LedgerError, match="is missing but 1 run directory exist"):
        Ledger(path)
    with Ledger(path, rebuilding=True) as led:  # what doctor --repair does
        assert led.runs() == []


def test_a_new_home_gets_a_new_ledger(tmp_path):
    path = tmp_path / "fresh" / "ledger.sqlite"
    with Ledger(path) as led:
        assert led.runs() == [] and led.check() == []
    path.unlink()
    (tmp_path / "fresh" / "ledger.sqlite-wal").unlink(missing_ok=True)
    path.write_bytes(b"")  # 0 bytes and no run directory: nothing was lost
    with Ledger(path) as led:
        assert led.runs() == []


def test_hpcmem_home_that_is_a_file_is_one_line(tmp_path):
    home = tmp_path / "home"
    home.write_text("oops\n")
    with pytest.raises(LedgerError, match="HPCMEM_HOME must be a directory"):
        Ledger(home / "ledger.sqlite")
    from toolkit.runs import open_ledger

    with pytest.raises(LedgerError, match=r"^HPCMEM_HOME .* is not a directory"):
        open_ledger(home)
