"""hpcmem doctor: it checks an hpcmem home and rebuilds a lost or damaged ledger from the run directories.

Runs are real local runs (a tiny script), driven in-process by the controller."""

import json
import os
import time
from pathlib import Path

import pytest

from hpcmem_cli import run_cli as hpcmem
from toolkit import controller, runs
from toolkit.doctor import doctor
from toolkit.errors import LedgerError
from toolkit.jobspec import load_spec
from toolkit.sites import load_site


def make_spec(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / f"{name}.py").write_text(body)
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\ncommand: {{script: {name}.py}}\ngpus_per_node: 1\ntraining: {{global_batch: 1}}\n")
    return spec


def start(home: Path, spec: Path, *, follow: bool = True):
    site = load_site("local")
    part = site.partition(None)
    loaded = load_spec(spec)
    with runs.open_ledger(home) as ledger:
        run = controller.start(ledger, loaded, site, part, loaded.first_plan(part), home=home)
        if follow:
            run = controller.follow(ledger, run.run_id, interval_s=0.2, timeout_s=120)
        return run.run_id


def views(home: Path) -> dict:
    with runs.open_ledger(home) as ledger:
        return {r.run_id: runs.run_view(ledger, r.run_id) for r in ledger.runs()}


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HPCMEM_HOME", str(home))
    return home


@pytest.fixture
def two_runs(home, tmp_path):
    ok = start(home, make_spec(tmp_path, "fine", "print('fine')\n"))
    bad = start(home, make_spec(tmp_path, "broken", "raise ValueError('bad schedule')\n"))
    return ok, bad


def test_a_healthy_home_is_healthy(home, two_runs):
    report = doctor(home)
    assert report.healthy, report.text()
    assert any(f.check == "ledger" and f.level == "ok" and "2 runs" in f.message for f in report.findings)
    assert report.to_dict()["healthy"] is True


def test_a_home_that_does_not_exist_or_is_a_file(tmp_path):
    assert doctor(tmp_path / "nothing").healthy
    (tmp_path / "file").write_text("x")
    report = doctor(tmp_path / "file")
    assert not report.healthy and "is not a directory" in report.findings[0].message


@pytest.mark.parametrize("damage", ["truncate", "delete", "garbage"])
def test_a_lost_ledger_is_rebuilt_from_the_run_directories(home, two_runs, damage):
    before = views(home)
    path = home / "ledger.sqlite"
    with runs.open_ledger(home) as ledger:
        ledger.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for side in ("-wal", "-shm"):
        Path(f"{path}{side}").unlink(missing_ok=True)
    if damage == "truncate":
        path.write_bytes(b"")
    elif damage == "delete":
        path.unlink()
    else:
        path.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(LedgerError, match="hpcmem doctor"):
        runs.open_ledger(home)
    found = doctor(home)
    assert not found.healthy and any(f.level == "error" and f.check == "ledger" for f in found.findings)
    repaired = doctor(home, repair=True)
    fixed = [f.message for f in repaired.findings if f.level == "fixed"]
    assert any("rebuilt ledger.sqlite from 2 run directories" in m for m in fixed), repaired.text()
    if damage != "delete":
        assert list(home.glob("ledger.sqlite.damaged-*")), "the damaged ledger is kept"
    after = views(home)
    assert set(after) == set(before)
    for run_id, old in before.items():
        new = after[run_id]
        assert (new["state"], new["reason"], new["spec"], new["site"]) == (old["state"], old["reason"], old["spec"], old["site"])
        for a, b in zip(old["attempts"], new["attempts"], strict=True):
            assert (b["n"], b["job_id"], b["state"], b["plan"], b["metrics"], b["partition"]) == \
                   (a["n"], a["job_id"], a["state"], a["plan"], a["metrics"], a["partition"])
            assert b["verdict"]["kind"] == a["verdict"]["kind"]
    assert doctor(home).healthy


def test_a_running_run_survives_a_lost_ledger_without_a_second_job(home, tmp_path):
    run_id = start(home, make_spec(tmp_path, "slowish", "import time\ntime.sleep(3)\nprint('done')\n"), follow=False)
    (home / "ledger.sqlite").write_bytes(b"")
    for side in ("-wal", "-shm"):
        Path(f"{home / 'ledger.sqlite'}{side}").unlink(missing_ok=True)
    doctor(home, repair=True)
    with runs.open_ledger(home) as ledger:
        assert ledger.run(run_id).state == "running"
        (attempt,) = ledger.attempts(run_id)
        assert attempt.job_id == "local-1"
        run = controller.follow(ledger, run_id, interval_s=0.2, timeout_s=120)
    assert run.state == "succeeded"
    assert sorted(p.name for p in (home / "local" / "jobs").glob("local-*.json")) == ["local-1.json"]


def test_an_orphaned_run_directory_is_reported_and_recorded(home, two_runs):
    ok, _ = two_runs
    with runs.open_ledger(home) as ledger:
        ledger.db.execute("DELETE FROM events WHERE run_id=?", (ok,))
        ledger.db.execute("DELETE FROM attempts WHERE run_id=?", (ok,))
        ledger.db.execute("DELETE FROM runs WHERE run_id=?", (ok,))
    report = doctor(home)
    assert any(f.level == "warn" and f"{ok} has no ledger row" in f.message for f in report.findings)
    doctor(home, repair=True)
    assert views(home)[ok]["state"] == "succeeded"
    assert doctor(home).healthy


def test_a_run_directory_from_an_interrupted_submit_is_recorded_as_failed(home, tmp_path, two_runs):
    site = load_site("local")
    part = site.partition(None)
    spec = load_spec(make_spec(tmp_path, "never", "print('x')\n"))
    with runs.open_ledger(home) as ledger:
        run = runs.create_run(ledger, spec, site, part, spec.first_plan(part), home=home)
        ledger.db.execute("DELETE FROM events WHERE run_id=?", (run.run_id,))
        ledger.db.execute("DELETE FROM attempts WHERE run_id=?", (run.run_id,))
        ledger.db.execute("DELETE FROM runs WHERE run_id=?", (run.run_id,))
    doctor(home, repair=True)
    view = views(home)[run.run_id]
    assert view["state"] == "failed" and "nothing was submitted" in view["reason"]
    assert not (home / "local" / "jobs" / "local-3.json").exists(), "a rebuild submits nothing"


def test_leftovers_and_a_local_job_that_never_started(home, two_runs):
    stale = home / "runs" / two_runs[0] / ".plan.json.x1y2.tmp"
    stale.write_text("half")
    os.utime(stale, (time.time() - 600, time.time() - 600))
    record = {"job_id": "local-9", "attempt_dir": str(home / "runs" / two_runs[0] / "attempt-1"),
              "script": "/nowhere", "log": "/nowhere.out", "submitted": time.time() - 600, "runner_pid": None,
              "runner_start": None, "submitter_pid": 999999, "submitter_start": 1}
    (home / "local" / "jobs" / "local-9.json").write_text(json.dumps(record))
    report = doctor(home)
    text = report.text()
    assert "leftover temporary file" in text and "local-9 never started" in text and not report.healthy
    repaired = doctor(home, repair=True).text()
    assert "removed 1 leftover temporary file" in repaired and "local job local-9 never started: settled as BOOT_FAIL" in repaired
    assert not stale.exists() and doctor(home).healthy


def test_a_damaged_calibration_file_is_reported(home, two_runs):
    (home / "calibration").mkdir()
    (home / "calibration" / "local.calibration.yaml").write_text("- just\n- a list\n")
    report = doctor(home)
    assert any(f.check == "calibration" and f.level == "warn" and "partitions" in f.message for f in report.findings)


def test_doctor_on_the_command_line(home, two_runs):
    healthy = hpcmem("doctor", "--json", home=home)
    assert healthy.returncode == 0 and json.loads(healthy.stdout)["healthy"] is True
    (home / "ledger.sqlite").write_bytes(b"")
    for side in ("-wal", "-shm"):
        Path(f"{home / 'ledger.sqlite'}{side}").unlink(missing_ok=True)
    listed = hpcmem("runs", home=home)
    assert listed.returncode != 0 and "hpcmem doctor --repair" in listed.stderr and "Traceback" not in listed.stderr
    assert len(listed.stderr.strip().splitlines()) == 1
    sick = hpcmem("doctor", home=home)
    assert sick.returncode == 1 and "error ledger:" in sick.stdout
    fixed = hpcmem("doctor", "--repair", home=home)
    assert "fixed ledger: rebuilt ledger.sqlite from 2 run directories" in fixed.stdout
    assert len(json.loads(hpcmem("runs", "--json", home=home, check=True).stdout)) == 2


def test_hpcmem_home_that_is_a_file_is_one_line_everywhere(tmp_path):
    home = tmp_path / "home"
    home.write_text("not a directory\n")
    for args in (["runs"], ["tick"], ["doctor"]):
        result = hpcmem(*args, home=home)
        assert result.returncode != 0 and "Traceback" not in result.stderr, (args, result.stderr)
        assert "not a directory" in result.stderr + result.stdout


@pytest.mark.parametrize("value", ["-1", "nan", "0", "inf"])
def test_a_bad_interval_is_refused_before_anything_is_submitted(tmp_path, value):
    spec = make_spec(tmp_path, "fine", "print('fine')\n")
    home = tmp_path / "home"
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--interval", value, home=home)
    assert result.returncode == 2 and "Invalid value for '--interval'" in result.stderr
    assert not (home / "runs").exists(), "nothing may be submitted"
    watched = hpcmem("watch", "some-run", "--interval", value, home=home)
    assert watched.returncode == 2 and "Invalid value for '--interval'" in watched.stderr
