"""Hostile records in an hpcmem home: the ledger, run directories and what `runs` and `doctor` make of them.

Every home is built here on literal data: a ledger row or a run.json nested deeper than Python parses, ledger
fields and run-directory names holding terminal escapes (CSI, an OSC title, U+202E). The rule
(docs/hostile-input.md): one line or a correct result, never a traceback; text output terminal-safe, JSON exact;
and a repair that cannot finish leaves the home as it was (a lost ledger stays lost, never an empty new one).
"""

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest

from hpcmem_cli import run_cli as hpcmem
from toolkit import doctor as doctor_module
from toolkit import runs
from toolkit.doctor import doctor
from toolkit.errors import LedgerError
from toolkit.ledger import Ledger, Run
from toolkit.plan import Plan

RID = "20261121-083000-ab12"
DEEP = '{"a":' + "[" * 100_000 + "]" * 100_000 + "}"
"""Valid JSON, nested far deeper than Python's recursion limit lets json.loads go."""
ESC, OSC_TITLE, RLO = "\x1b[31m", "\x1b]0;PWNED\x07", "\u202e"
RAW = ("\x1b", "\x07", "\u202e")


def record_run(home: Path, run_id: str = RID, **columns) -> Path:
    """A run in ``home``'s ledger (with attempt 1), then ``columns`` of its runs/attempts rows set as they are."""
    home.mkdir(parents=True, exist_ok=True)
    now = time.time()
    run_dir = home / "runs" / run_id
    run = Run(run_id=run_id, spec_path="/x/spec.yaml", spec_name="n", site="local", site_path="/x/local.yaml",
              partition="default", run_dir=str(run_dir), workdir="/tmp", state="running", reason="", created=now,
              updated=now)
    path = home / "ledger.sqlite"
    with Ledger(path) as ledger:
        ledger.add_run(run, Plan().to_dict(), str(run_dir / "attempt-1"))
        for table in ("runs", "attempts"):
            names = [k.split(".", 1)[1] for k in columns if k.startswith(f"{table}.")]
            for name in names:
                ledger.db.execute(f"UPDATE {table} SET {name}=? WHERE run_id=?", (columns[f"{table}.{name}"], run_id))
    return path


def run_json(run_id: str = "20260101-000000-aaaa") -> str:
    return json.dumps({"run_id": run_id, "spec_name": "s", "site": "local", "site_path": "/nowhere/local.yaml",
                       "partition": "default", "workdir": "/tmp", "created": 1.0, "first_plan": Plan().to_dict()})


def snapshot(home: Path) -> dict:
    """Every path under ``home`` with the bytes of each file (symlinks as their target): to compare before/after."""
    out = {}
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(home))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_bytes()
    return out


def one_line_error(result) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------- 1. a plan nested too deeply


@pytest.mark.parametrize("column", ["plan", "verdict", "metrics", "decision"])
def test_a_deeply_nested_attempt_column_is_a_damaged_ledger_not_a_recursion_error(tmp_path, column):
    path = record_run(tmp_path / "home", **{f"attempts.{column}": DEEP})
    with Ledger(path) as ledger:
        with pytest.raises(LedgerError, match=f"its {column} is not valid JSON \\(nested too deeply\\).*hpcmem doctor"):
            ledger.attempts(RID)
        with pytest.raises(LedgerError, match="nested too deeply"):
            runs.run_view(ledger, RID)
        (problem,) = ledger.check()
        assert "nested too deeply" in problem


def test_doctor_reports_a_deep_plan_and_repair_keeps_the_ledger_aside(tmp_path):
    home = tmp_path / "home"
    path = record_run(home, **{"attempts.plan": DEEP})
    before = path.read_bytes()
    report = doctor(home)
    assert not report.healthy
    assert any(f.check == "ledger" and f.level == "error" and "nested too deeply" in f.message for f in report.findings)
    repaired = doctor(home, repair=True)
    (aside,) = home.glob("ledger.sqlite.damaged-*")
    assert aside.read_bytes() == before, "the damaged ledger is kept as it was"
    assert any(f.level == "fixed" and aside.name in f.message for f in repaired.findings)
    assert doctor(home).findings[0].message.startswith("ledger.sqlite is sound")


def test_a_deep_plan_is_one_line_on_the_command_line(tmp_path):
    home = tmp_path / "home"
    record_run(home, **{"attempts.plan": DEEP})
    for args in (["runs"], ["runs", RID], ["runs", "--json"]):
        line = one_line_error(hpcmem(*args, home=home))
        assert "nested too deeply" in line and "hpcmem doctor" in line, (args, line)
    sick = hpcmem("doctor", home=home)
    assert sick.returncode == 1 and "Traceback" not in sick.stderr and "nested too deeply" in sick.stdout
    as_json = hpcmem("doctor", "--json", home=home)
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["healthy"] is False


# ---------------------------------------------------------------- 2. a repair that cannot finish


def lost_ledger_home(home: Path) -> Path:
    """The probe's home: no ledger, a run directory whose run.json is nested too deeply, a junk one named with
    an escape sequence."""
    (home / "runs" / RID).mkdir(parents=True)
    (home / "runs" / RID / "run.json").write_text(DEEP)
    (home / "runs" / f"junk{ESC}").mkdir()
    return home


def test_a_repair_that_rebuilds_nothing_leaves_a_lost_ledger_lost(tmp_path):
    home = lost_ledger_home(tmp_path / "home")
    before = snapshot(home)
    report = doctor(home, repair=True)  # no RecursionError
    assert snapshot(home) == before, "no new, empty ledger.sqlite (nor anything else) is left behind"
    errors = [f.message for f in report.findings if f.level == "error"]
    assert any(f"cannot rebuild {RID}" in m and "nested too deeply" in m for m in errors), errors
    assert any("left as it was" in m for m in errors) and not report.healthy
    with pytest.raises(LedgerError, match="the ledger was lost, not new"):
        runs.open_ledger(home)  # the lost-ledger guard still holds
    assert any("was lost, not new" in f.message for f in doctor(home).findings)


def test_the_lost_ledger_repair_on_the_command_line(tmp_path):
    home = lost_ledger_home(tmp_path / "home")
    before = snapshot(home)
    repaired = hpcmem("doctor", "--repair", home=home)
    assert repaired.returncode == 1 and "Traceback" not in repaired.stderr, repaired.stderr
    assert "\x1b" not in repaired.stdout and "junk\\x1b[31m" in repaired.stdout
    assert snapshot(home) == before
    line = one_line_error(hpcmem("runs", home=home))
    assert "the ledger was lost, not new" in line
    checked = hpcmem("doctor", home=home)
    assert checked.returncode == 1 and "is sound" not in checked.stdout and "was lost, not new" in checked.stdout


@pytest.mark.parametrize("ledger", ["missing", "empty", "garbage"])
def test_a_crash_part_way_through_a_repair_leaves_the_home_as_it_was(tmp_path, monkeypatch, ledger):
    home = tmp_path / "home"
    for name in ("20260101-000000-aaaa", "20260101-000000-bbbb"):
        (home / "runs" / name).mkdir(parents=True)
        (home / "runs" / name / "run.json").write_text(run_json(name))
    if ledger != "missing":
        (home / "ledger.sqlite").write_bytes(b"" if ledger == "empty" else b"\x00garbage" * 1000)
    before = snapshot(home)
    real = doctor_module.rebuild_run

    def crash_on_the_second(run_dir, home_):
        if run_dir.name.endswith("bbbb"):
            raise RuntimeError("killed part-way")
        return real(run_dir, home_)

    monkeypatch.setattr(doctor_module, "rebuild_run", crash_on_the_second)
    with pytest.raises(RuntimeError, match="killed part-way"):
        doctor(home, repair=True)
    assert snapshot(home) == before, "the first run rebuilt is not put in place, the old ledger not moved"
    monkeypatch.setattr(doctor_module, "rebuild_run", real)
    report = doctor(home, repair=True)  # and a repair that completes still works
    assert any("rebuilt ledger.sqlite from 2 run directories" in f.message for f in report.findings), report.text()
    assert doctor(home).healthy
    if ledger != "missing":
        (aside,) = home.glob("ledger.sqlite.damaged-*")
        assert aside.read_bytes() == before["ledger.sqlite"]


def test_a_partial_rebuild_is_put_in_place_and_names_what_it_could_not_rebuild(tmp_path):
    home = lost_ledger_home(tmp_path / "home")
    good = "20260101-000000-aaaa"
    (home / "runs" / good).mkdir()
    (home / "runs" / good / "run.json").write_text(run_json(good))
    report = doctor(home, repair=True)
    assert any("rebuilt ledger.sqlite from 1 run directory" in f.message for f in report.findings), report.text()
    with runs.open_ledger(home) as ledger:
        assert [r.run_id for r in ledger.runs()] == [good]
    assert not list(home.glob("ledger.sqlite.rebuilding-*"))
    later = doctor(home)  # the two it could not rebuild are still named
    assert sum("has no ledger row" in f.message for f in later.findings) == 2


def test_hostile_run_directories_are_named_never_a_traceback(tmp_path):
    """run.json fields of the wrong type, odd attempt directories, records that are not objects, a FIFO."""
    home = tmp_path / "home"
    cases = {
        "typed": {"run_id": {"x": 1}, "spec_name": "s", "site": "local", "site_path": "/x", "partition": "p"},
        "list": [1, 2],
        "bigint": '{"run_id": ' + "9" * 5000 + "}",
    }
    for name, body in cases.items():
        (home / "runs" / name).mkdir(parents=True)
        (home / "runs" / name / "run.json").write_text(body if isinstance(body, str) else json.dumps(body))
    odd = home / "runs" / "odd"
    odd.mkdir()
    odd.joinpath("run.json").write_text(json.dumps({**json.loads(run_json("odd")), "created": "yesterday"}))
    odd.joinpath("end.json").write_text("[1]")
    for attempt in ("attempt-" + "9" * 200, "attempt-\u0661", "attempt-1", "attempt-01"):
        odd.joinpath(attempt).mkdir()
    odd.joinpath("attempt-1", "attempt.json").write_text("[1, 2]")
    odd.joinpath("attempt-1", "plan.json").write_text(json.dumps({"micro_batch": 2}))
    odd.joinpath("attempt-1", "metrics.json").write_text(DEEP)
    odd.joinpath("attempt-1", f"slurm-{'9' * 200}.out").write_text("")
    (home / "runs" / "fifo").mkdir()
    os.mkfifo(home / "runs" / "fifo" / "run.json")  # never waited on
    report = doctor(home, repair=True)
    errors = {f.message.split(":")[0] for f in report.findings if f.message.startswith("cannot rebuild")}
    assert errors == {f"cannot rebuild {n}" for n in ("typed", "list", "bigint", "fifo")}, report.text()
    with runs.open_ledger(home) as ledger:
        (attempt,) = ledger.attempts("odd")
        assert (attempt.plan, attempt.metrics, attempt.job_id) == ({"micro_batch": 2}, None, None)


def test_records_in_a_run_directory_are_read_bounded(tmp_path):
    os.mkfifo(tmp_path / "metrics.json")
    assert runs.read_metrics(tmp_path) is None  # a FIFO: not waited on
    os.unlink(tmp_path / "metrics.json")
    for body in (DEEP, "[1, 2]", "{not json"):
        (tmp_path / "metrics.json").write_text(body)
        assert runs.read_metrics(tmp_path) is None
    (tmp_path / "run.json").write_text(DEEP)
    with pytest.raises(LedgerError, match="run.json is unreadable \\(not valid JSON: nested too deeply\\)"):
        runs.read_run_record(tmp_path)
    (tmp_path / "site.json").write_text(DEEP)
    with pytest.raises(LedgerError, match="site.json is unreadable.*nested too deeply"):
        runs.recorded_site(tmp_path, "/nowhere")


def test_a_long_schema_version_is_named_in_a_short_line(tmp_path):
    path = record_run(tmp_path / "home")
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", ("9" * 5000,))
    db.commit()
    db.close()
    with pytest.raises(LedgerError) as caught:
        Ledger(path)
    assert len(str(caught.value)) < 500 and "schema version" in str(caught.value)


# ---------------------------------------------------------------- 3. terminal escapes in what is shown


def escape_home(home: Path) -> Path:
    record_run(home, **{"runs.reason": f"{OSC_TITLE}\x1b[2J", "runs.spec_name": f"a{ESC}red{RLO}",
                        "attempts.job_id": "\x1b[5m1", "attempts.state": f"failed{ESC}",
                        "attempts.verdict": json.dumps({"kind": f"{ESC}x"}),
                        "attempts.decision": json.dumps({"moves": [f"m{OSC_TITLE}"]}),
                        "attempts.metrics": json.dumps({"peak_rss_mib": "lots", "resumed_from_step": f"1{ESC}",
                                                        "inflight_moves": [{"step": f"2{RLO}"}]})})
    (home / "runs" / f"junk{ESC}").mkdir(parents=True)
    return home


def test_runs_text_is_terminal_safe_and_json_exact(tmp_path):
    home = escape_home(tmp_path / "home")
    with runs.open_ledger(home) as ledger:
        views = [runs.run_view(ledger, r.run_id) for r in ledger.runs()]
        status = runs.status_line(ledger.run(RID), ledger.attempts(RID))
    text = runs.views_text(views)
    for raw in RAW:
        assert raw not in text and raw not in status
    assert "\\x1b]0;PWNED\\x07" in text and "a\\x1b[31mred\\u202e" in text and "[\\x1b[31mx]" in text
    assert "after: m\\x1b]0;PWNED\\x07" in text and "resumed from step 1\\x1b[31m" in text
    assert "peak_rss" not in text, "a peak that is not a number is left out, not a ValueError"
    assert len(text.splitlines()) == 4
    assert all(raw not in line for line in runs.resume_lines(views[0]["attempts"][0]) for raw in RAW)
    exact = json.loads(json.dumps(views))  # JSON keeps the values as recorded (json.dumps escapes them)
    assert exact[0]["reason"] == f"{OSC_TITLE}\x1b[2J" and exact[0]["spec"] == f"a{ESC}red{RLO}"


def test_runs_text_of_a_plain_run_is_unchanged(tmp_path):
    home = tmp_path / "home"
    record_run(home, **{"attempts.metrics": json.dumps({"peak_rss_mib": 1234.4}),
                        "attempts.verdict": json.dumps({"kind": "oom_gpu"}),
                        "attempts.decision": json.dumps({"moves": ["micro_batch 8 -> 4"]}), "attempts.job_id": "42"})
    with runs.open_ledger(home) as ledger:
        views = [runs.run_view(ledger, RID)]
    lines = runs.views_text(views).splitlines()
    assert lines[0] == f"{RID}  running    n on local:default"
    assert lines[1] == (f"  attempt 1: job 42 planned [oom_gpu] peak_rss=1234MiB after: micro_batch 8 -> 4  "
                        f"{home / 'runs' / RID / 'attempt-1'}")
    assert runs.views_text([]) == ""


def test_doctor_text_is_terminal_safe_and_json_exact(tmp_path):
    home = escape_home(tmp_path / "home")
    report = doctor(home)
    text = report.text()
    for raw in RAW:
        assert raw not in text
    assert f"run directory {home / 'runs'}/junk\\x1b[31m has no ledger row" in text
    assert "job \\x1b[5m1" in text
    messages = [f["message"] for f in json.loads(json.dumps(report.to_dict()))["findings"]]
    assert any(f"junk{ESC} has no ledger row" in m for m in messages), "JSON keeps the name as it is"


def test_doctor_on_the_command_line_is_terminal_safe(tmp_path):
    home = escape_home(tmp_path / "home")
    for args in (["doctor"], ["doctor", "--repair"]):
        result = hpcmem(*args, home=home)
        assert "Traceback" not in result.stderr, result.stderr
        for raw in RAW:
            assert raw not in result.stdout, args
        assert "junk\\x1b[31m" in result.stdout
    as_json = hpcmem("doctor", "--json", home=home)
    findings = json.loads(as_json.stdout)["findings"]
    assert any(f"junk{ESC}" in f["message"] for f in findings)


def test_runs_on_the_command_line_is_terminal_safe(tmp_path):
    home = escape_home(tmp_path / "home")
    for args in (["runs"], ["runs", RID]):
        result = hpcmem(*args, home=home)
        assert result.returncode == 0 and not any(raw in result.stdout for raw in RAW), result.stderr
        assert "\\x1b]0;PWNED\\x07" in result.stdout
    assert json.loads(hpcmem("runs", "--json", home=home).stdout)[0]["reason"] == f"{OSC_TITLE}\x1b[2J"
