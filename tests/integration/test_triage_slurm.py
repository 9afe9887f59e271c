"""hpcmem triage on real failed jobs of the Slurm test cluster: by job id, run id and log path, in all formats.

The jobs really fail: a cgroup out-of-memory kill on the cpu partition (raw sbatch, and an hpcmem run
whose only attempt runs out of --mem), a Python error, a time-limit kill and a cancellation. They are
submitted together so their waits overlap (the time limit takes 1-1.5 minutes).
"""

import json
import textwrap
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from hpcmem_cli import run_cli
from toolkit.backends.slurm import SlurmBackend
from toolkit.schema import load_schema, validate

REPO = Path(__file__).resolve().parents[2]
SCHEMA = load_schema(REPO / "docs" / "triage.schema.json")
SINCE_SCHEMA = load_schema(REPO / "docs" / "triage-since.schema.json")

BODIES = {
    "oom": ("--mem=100M", "python3 -c \"import time; b = [b'x' * (40 << 20) for _ in range(12)]; time.sleep(2)\""),
    "error": ("--mem=200M", "echo 'epoch 1 step 3 loss 2.3'\n"
                            "python3 -c \"raise ValueError('learning rate schedule has no steps')\""),
    "timeout": ("--time=1", "echo started; sleep 600"),
    "cancelled": ("--mem=100M", "echo started; sleep 600"),
}

MEM_JOB = textwrap.dedent("""\
    import os, time
    block = bytearray(int(os.environ["NEED_MIB"]) * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(1)
    """)


def _submit_raw(directory: Path, name: str, directive: str, body: str) -> str:
    d = directory / name
    d.mkdir()
    script = d / "job.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH -p cpu\n#SBATCH -J triage-{name}\n#SBATCH {directive}\n"
                      f"#SBATCH --output={d}/slurm-%j.out\n{body}\n")
    return SlurmBackend().submit(script, d)


@pytest.fixture(scope="module")
def failed(slurm_cluster, tmp_path_factory):
    """{name: job id} of the raw jobs, plus the hpcmem run ("run", "run_job"), its home, and "since": a moment
    just before they were submitted (an ISO time for --since)."""
    since = (datetime.now().astimezone() - timedelta(seconds=5)).replace(microsecond=0).isoformat()
    base = tmp_path_factory.mktemp("triage")
    backend = SlurmBackend()
    jobs = {name: _submit_raw(base, name, *body) for name, body in BODIES.items()}
    home = base / "home"
    (base / "need_mem.py").write_text(MEM_JOB)
    spec = base / "needs-memory.yaml"
    spec.write_text(textwrap.dedent("""\
        name: needs-memory
        command: {script: need_mem.py}
        gpus_per_node: 1
        mem_mib: 700
        training: {global_batch: 4, micro_batch: 4}
        retry: {max_attempts: 1, allow: []}
        env: {NEED_MIB: "1500"}
        """))
    view = json.loads(run_cli("submit", spec, "--site", "testcluster", "--partition", "cpu", "--wait", "--json",
                              "--interval", "1", home=home).stdout)
    deadline = time.time() + 60
    while backend.poll([jobs["cancelled"]])[jobs["cancelled"]].state != "RUNNING" and time.time() < deadline:
        time.sleep(1)
    backend.cancel([jobs["cancelled"]])
    deadline = time.time() + 240
    while time.time() < deadline:
        states = backend.poll(list(jobs.values()))
        if all(s.finished for s in states.values()):
            break
        time.sleep(3)
    time.sleep(4)  # sacct lags the end of a job by a few seconds
    return {**jobs, "run": view["run_id"], "run_job": view["attempts"][0]["job_id"], "home": home,
            "dir": base, "since": since}


def triage(*args, home, fmt="json"):
    result = run_cli("triage", *map(str, args), "--site", "testcluster", "--format", fmt, home=home)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    if fmt == "json":
        data = json.loads(result.stdout)
        validate(data, SCHEMA, "triage --format json")
        return data["findings"]
    return result.stdout


@pytest.mark.slurm
def test_cgroup_oom_by_job_id_and_by_log_in_all_formats(failed):
    home = failed["home"]
    f, = triage(failed["oom"], home=home)
    assert f["verdict"]["kind"] == "host_oom" and f["oom"]
    assert f["job"]["state"] == "OUT_OF_MEMORY" and f["job"]["partition"] == "cpu"
    assert f["job"]["max_rss_mib"] is None or f["job"]["max_rss_mib"] > 50
    assert f["logs"] and Path(f["logs"][0]).name == f"slurm-{failed['oom']}.out"
    assert any("oom" in e["text"].lower() for e in f["verdict"]["evidence"])
    assert f["remedies"] and any("mem" in " ".join(r["set_args"]) for r in f["remedies"])
    by_log, = triage(f["logs"][0], home=home)
    assert by_log["verdict"]["kind"] == "host_oom"
    assert by_log["verdict"]["evidence"] == f["verdict"]["evidence"]
    text = triage(failed["oom"], home=home, fmt="text")
    md = triage(failed["oom"], home=home, fmt="markdown")
    assert "host_oom" in text and "\033[" not in text  # no colour when not a terminal
    assert md.startswith("### ") and "`host_oom`" in md and "hpcmem submit" in md


@pytest.mark.slurm
def test_non_oom_failure_gets_no_memory_advice(failed):
    f, = triage(failed["error"], home=failed["home"])
    assert f["verdict"]["kind"] == "not_oom" and not f["oom"]
    assert "ValueError" in f["verdict"]["reason"] and f["job"]["state"] == "FAILED" and f["job"]["exit_code"] == 1
    assert f["remedies"] == [] and f["memory"] is None and f["where_to_look"]
    md = triage(failed["error"], home=failed["home"], fmt="markdown")
    assert "not an out-of-memory failure" in md and "What to change" not in md


@pytest.mark.slurm
def test_time_limit_and_cancelled_jobs(failed):
    home = failed["home"]
    timeout, cancelled = triage(failed["timeout"], failed["cancelled"], home=home)
    assert timeout["job"]["state"] == "TIMEOUT" and timeout["verdict"]["kind"] == "not_oom"
    assert "time limit" in timeout["verdict"]["reason"].lower() and timeout["remedies"] == []
    assert any("--time" in line or "time limit" in line.lower() for line in timeout["where_to_look"])
    assert cancelled["job"]["state"] == "CANCELLED" and cancelled["verdict"]["kind"] == "not_oom"
    assert "cancel" in cancelled["verdict"]["reason"].lower()


@pytest.mark.slurm
def test_hpcmem_run_by_run_id_and_by_its_job_id(failed):
    home = failed["home"]
    by_run, = triage(failed["run"], home=home)
    by_job, = triage(failed["run_job"], home=home)
    for f in (by_run, by_job):
        assert f["verdict"]["kind"] == "host_oom"
        assert f["job"]["run_id"] == failed["run"] and f["job"]["attempt"] == 1
        assert f["plan"]["mem_mib"] == 700 and f["plan"]["global_batch"] == 4 and not f["plan_assumed"]
        assert "ledger" in f["job"]["sources"] or "plan.json" in f["job"]["sources"]
    first = by_run["remedies"][0]
    assert first["plan"]["mem_mib"] > 700 and first["plan"]["global_batch"] == 4
    assert f"--set mem_mib={first['plan']['mem_mib']}" in first["submit_command"]


@pytest.mark.slurm
def test_since_groups_the_windows_failed_jobs_by_kind(failed):
    """The window starts when this module's jobs were submitted (an ISO time), so the JSON and the text report
    below count the same jobs: a span like 30m moves with the clock, and a job of an earlier test can leave it
    between two calls."""
    result = run_cli("triage", "--since", failed["since"], "--site", "testcluster", "--format", "json",
                     home=failed["home"])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    validate(data, SINCE_SCHEMA, "triage --since --format json")
    kind_of = {j["job_id"]: g["kind"] for g in data["groups"] for j in g["jobs"]}
    assert kind_of[failed["oom"]] == "host_oom" and kind_of[failed["run_job"]] == "host_oom"
    assert kind_of[failed["error"]] == "not_oom" and kind_of[failed["timeout"]] == "not_oom"
    assert kind_of[failed["cancelled"]] == "not_oom"
    host = next(g for g in data["groups"] if g["kind"] == "host_oom")
    assert host["count"] >= 2 and host["top_remedies"]
    only_cpu = json.loads(run_cli("triage", "--since", "30m", "--partition", "v100", "--format", "json",
                                  home=failed["home"]).stdout)
    assert failed["oom"] not in {j["job_id"] for g in only_cpu["groups"] for j in g["jobs"]}
    text = run_cli("triage", "--since", failed["since"], "--site", "testcluster", home=failed["home"]).stdout
    assert any(line.startswith("host_oom") and f" {host['count']} jobs" in line for line in text.splitlines())


@pytest.mark.slurm
def test_a_job_id_this_cluster_does_not_know(failed):
    f, = triage("99999999", home=failed["home"])
    assert f["verdict"]["kind"] == "unknown" and f["job"]["missing"]


@pytest.mark.slurm
@pytest.mark.parametrize("name, kind, state", [
    ("oom", "host_oom", "OUT_OF_MEMORY"), ("error", "not_oom", "FAILED"), ("timeout", "not_oom", "TIMEOUT"),
    ("cancelled", "not_oom", "CANCELLED"),
])
def test_every_failed_job_by_id_and_by_log_agrees_in_all_formats(failed, name, kind, state):
    home = failed["home"]
    by_id, = triage(failed[name], home=home)
    assert by_id["verdict"]["kind"] == kind and by_id["job"]["state"] == state and by_id["logs"]
    by_log, = triage(by_id["logs"][0], home=home)
    assert by_log["verdict"]["kind"] == kind and by_log["job"]["job_id"] == failed[name]  # the log found its job
    assert by_log["job"]["state"] == state and by_log["verdict"]["evidence"] == by_id["verdict"]["evidence"]
    for target in (failed[name], by_id["logs"][0]):
        text = triage(target, home=home, fmt="text")
        md = triage(target, home=home, fmt="markdown")
        assert f"job {failed[name]}" in text and f"job {failed[name]}" in md
        assert kind in text and f"`{kind}`" in md and state in text and state in md
        assert ("hpcmem submit" in md) == (kind == "host_oom")
