"""Crash-point sweep: hpcmem is killed (SIGKILL) at every named point of the submit path (``HPCMEM_FAULT``,
``toolkit.backends.base.FAULT_POINTS``), and every run still ends in a terminal state, or is brought there by
``hpcmem watch`` / ``hpcmem cancel``, within a bounded time; no attempt ever has two jobs that ran.

The local backend is swept at every point, the Slurm test cluster at the controller's submit points
(the others are the local backend's own). Bounded: one tiny job per point, each wait capped."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from hpcmem_cli import run_cli as hpcmem
from toolkit.backends.base import FAULT_POINTS

RUNNER_POINTS = [p for p in FAULT_POINTS if p.startswith("runner_")]
SUBMITTER_POINTS = [p for p in FAULT_POINTS if not p.startswith("runner_")]
BOUND_S = 120


def tiny_spec(tmp_path: Path) -> Path:
    (tmp_path / "ok.py").write_text("print('tiny job done')\n")
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\ncommand: {script: ok.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    return spec


def only_run(home: Path) -> dict:
    (run,) = json.loads(hpcmem("runs", "--json", home=home, check=True).stdout)
    return run


def local_jobs_that_ran(home: Path, attempt_dir: str) -> list[str]:
    """The local jobs of an attempt directory whose runner started the script (not abandoned ones)."""
    ran = []
    for record in (home / "local" / "jobs").glob("local-*.json"):
        data = json.loads(record.read_text())
        if data["attempt_dir"] != str(Path(attempt_dir).resolve()):
            continue
        claim = record.with_suffix(".claim")
        if claim.exists() and json.loads(claim.read_text())["by"] == "runner" and \
                Path(attempt_dir, f"{data['job_id']}.pid").exists():
            ran.append(data["job_id"])
    return ran


@pytest.mark.parametrize("point", SUBMITTER_POINTS)
def test_local_submit_killed_at_each_point_is_recovered_by_watch(tmp_path, point):
    spec = tiny_spec(tmp_path)
    started = time.monotonic()
    first = hpcmem("submit", str(spec), "--site", "local", "--wait", "--interval", "0.2", home=tmp_path,
                   env={"HPCMEM_FAULT": point}, timeout=BOUND_S)
    if point != "after_decide":  # reached only after an OOM; the tiny job has none
        assert first.returncode == -signal.SIGKILL, (point, first.stderr[-2000:])
    run = only_run(tmp_path)
    done = hpcmem("watch", run["run_id"], "--interval", "0.2", "--quiet", home=tmp_path, timeout=BOUND_S)
    view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path, check=True).stdout)
    assert done.returncode == 0 and view["state"] == "succeeded", (point, json.dumps(view, indent=1)[-2000:])
    assert time.monotonic() - started < BOUND_S
    for attempt in view["attempts"]:
        ran = local_jobs_that_ran(tmp_path, attempt["attempt_dir"])
        assert ran == [attempt["job_id"]], (point, attempt["n"], ran, attempt["job_id"])


@pytest.mark.parametrize("point", RUNNER_POINTS)
def test_local_runner_killed_at_each_point_ends_the_run(tmp_path, point):
    """The runner dies (the submitter lives): the job is BOOT_FAIL (never started) or FAILED (started, its
    script killed with it); either way the attempt ends, the run ends, nothing is left running."""
    spec = tiny_spec(tmp_path)
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.2", home=tmp_path,
                    env={"HPCMEM_FAULT": point}, timeout=BOUND_S)
    view = json.loads(result.stdout)
    (attempt,) = view["attempts"]
    assert view["state"] == "failed" and result.returncode == 1, json.dumps(view, indent=1)[-2000:]
    recorded = json.loads((Path(attempt["attempt_dir"]) / f"{attempt['job_id']}.json").read_text())
    if point == "runner_after_job_spawn":
        assert attempt["state"] == "FAILED" and "without recording a result" in recorded["reason"], recorded
    else:
        assert attempt["state"] == "BOOT_FAIL" and "before starting the job" in recorded["reason"], recorded
    pid_file = Path(attempt["attempt_dir"]) / f"{attempt['job_id']}.pid"
    if pid_file.exists():
        assert not _running(int(pid_file.read_text())), "the job outlived its runner"


@pytest.mark.parametrize("point", ["local_after_record", "local_after_spawn", "before_sbatch"])
def test_local_submit_killed_then_cancelled_leaves_nothing_running(tmp_path, point):
    spec = tmp_path / "sleepy.yaml"
    (tmp_path / "sleepy.py").write_text("import time\ntime.sleep(300)\n")
    spec.write_text("name: sleepy\ncommand: {script: sleepy.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    killed = hpcmem("submit", str(spec), "--site", "local", "--wait", "--interval", "0.2", home=tmp_path,
                    env={"HPCMEM_FAULT": point}, timeout=BOUND_S)
    assert killed.returncode == -signal.SIGKILL
    run = only_run(tmp_path)
    started = time.monotonic()
    view = json.loads(hpcmem("cancel", run["run_id"], "--json", home=tmp_path, check=True, timeout=BOUND_S).stdout)
    assert view["state"] == "cancelled" and time.monotonic() - started < 60
    for record in (tmp_path / "local" / "jobs").glob("local-*.json"):
        data = json.loads(record.read_text())
        if data.get("runner_pid"):
            _wait_gone(data["runner_pid"])
        pid_file = Path(data["attempt_dir"], f"{data['job_id']}.pid")
        if pid_file.exists():
            _wait_gone(int(pid_file.read_text()))


def test_a_local_job_whose_submitter_died_before_spawning_is_not_pending_forever(tmp_path):
    """Issue 13 item 1: the record says runner_pid null and nobody will ever start the runner."""
    from toolkit.backends import LocalBackend

    attempt = tmp_path / "a"
    attempt.mkdir()
    (attempt / "job.sbatch").write_text("#!/bin/bash\necho hi\n")
    state_dir = tmp_path / "home" / "local"
    code = ("import os, signal; from toolkit.backends import LocalBackend; "
            f"LocalBackend(state_dir={str(state_dir)!r}).submit({str(attempt / 'job.sbatch')!r}, {str(attempt)!r})")
    import subprocess
    import sys

    env = {**os.environ, "HPCMEM_FAULT": "local_after_record"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert done.returncode == -signal.SIGKILL
    backend = LocalBackend(state_dir=state_dir)
    (record,) = (state_dir / "jobs").glob("local-*.json")
    job_id = json.loads(record.read_text())["job_id"]
    status = backend.poll([job_id])[job_id]  # the submitter is dead: no need to wait for the grace period
    assert status.state == "BOOT_FAIL" and "never started" in status.reason
    assert backend.find("any", attempt) is None  # the controller submits the attempt again
    assert backend.poll([job_id])[job_id].state == "BOOT_FAIL"  # and it stays so


# ---------------------------------------------------------------- the Slurm test cluster


@pytest.mark.slurm
@pytest.mark.parametrize("point", ["after_plan", "before_render", "after_render", "before_sbatch", "after_sbatch"])
def test_slurm_submit_killed_at_each_point_is_recovered_by_watch(slurm_cluster, tmp_path, point):
    from test_controller import assert_jobs_match_sacct

    spec = tiny_spec(tmp_path)
    first = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--wait", "--interval", "0.5",
                   home=tmp_path, env={"HPCMEM_FAULT": point}, timeout=BOUND_S)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    run = only_run(tmp_path)
    done = hpcmem("watch", run["run_id"], "--interval", "0.5", "--quiet", home=tmp_path, timeout=BOUND_S)
    view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path, check=True).stdout)
    assert done.returncode == 0 and view["state"] == "succeeded", json.dumps(view, indent=1)[-2000:]
    assert_jobs_match_sacct(view)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs after the cancel"
        time.sleep(0.2)
