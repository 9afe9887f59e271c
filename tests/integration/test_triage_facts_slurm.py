"""Triage's job facts on the real Slurm test cluster: real failed jobs (one with its own --output pattern and a
DeepSpeed config, one array job with a failing task) and a real hpcmem run, found by job id, array id, run id
and log; a job id of another cluster and a machine whose sacct is missing give cases that say so."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from hpcmem_cli import run_cli
from toolkit.backends.slurm import SlurmBackend
from toolkit.runs import open_ledger
from toolkit.triage.sources import cases, target_cases, window_cases

pytestmark = pytest.mark.slurm

FAILING = """#!/bin/bash
#SBATCH -p cpu
#SBATCH --job-name=triage-fail
#SBATCH --mem=300M
#SBATCH --time=5
#SBATCH --output=%x-%j.log
echo "starting"
if false; then
  torchrun --nproc_per_node=2 train.py --model_name_or_path gpt2 \\
    --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --bf16 --deepspeed ds.json
fi
srun true
echo "about to fail" >&2
exit 3
"""

ARRAY = """#!/bin/bash
#SBATCH -p cpu
#SBATCH --job-name=triage-array
#SBATCH --mem=100M
#SBATCH --time=5
#SBATCH --array=1-2
echo "task $SLURM_ARRAY_TASK_ID"
[ "$SLURM_ARRAY_TASK_ID" = 2 ] && exit 5
exit 0
"""


def settled(backend: SlurmBackend, ids: list[str], count: int, timeout_s: float = 90) -> dict:
    """sacct's facts once ``count`` jobs are there and all finished (sacct lags the end by seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        facts = backend.job_facts(ids)
        if len(facts) >= count and all(f["state"] not in ("PENDING", "RUNNING", "COMPLETING") for f in facts.values()):
            return facts
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {ids} not finished in sacct after {timeout_s} s: {facts}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Submit the two jobs and an hpcmem run (quickstart on cpu), wait until sacct has them all."""
    backend = SlurmBackend(tries=3, backoff_s=1.0)
    started = time.time() - 2
    work = tmp_path_factory.mktemp("triage-jobs")
    (work / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                              "zero_optimization": {"stage": 2}}))
    (work / "fail.sbatch").write_text(FAILING)
    (work / "array.sbatch").write_text(ARRAY)
    failing = backend.submit(work / "fail.sbatch", work)
    array = backend.submit(work / "array.sbatch", work)
    home = tmp_path_factory.mktemp("hpcmem-home")
    run_cli("submit", "quickstart", "--site", "testcluster", "--partition", "cpu", "--wait", home=home, check=True,
            timeout=300)
    with open_ledger(home) as ledger:
        run = ledger.runs()[-1]
        run_job = ledger.attempts(run.run_id)[-1].job_id
    settled(backend, [failing, array, run_job], count=4)
    return {"backend": backend, "work": work, "failing": failing, "array": array, "home": home, "run": run,
            "run_job": run_job, "started": started}


def test_a_failed_job_by_id(jobs):
    [case] = cases(jobs["failing"], backend=jobs["backend"])
    facts = case.facts
    assert (case.kind, facts.job_id, facts.name, facts.partition) == ("job", jobs["failing"], "triage-fail", "cpu")
    assert (facts.state, facts.exit_code, facts.signal) == ("FAILED", 3, 0)
    assert facts.elapsed_s is not None and facts.timelimit_s == 300
    assert facts.req_tres["mem"] == "300M" and facts.alloc_tres["cpu"] == "1"
    assert facts.workdir == str(jobs["work"]) and facts.nodes and facts.user
    assert [s["step"] for s in facts.steps] == [f"{jobs['failing']}.batch", f"{jobs['failing']}.0"]
    # the log named by the script's own --output pattern
    log = jobs["work"] / f"triage-fail-{jobs['failing']}.log"
    assert case.log_paths == (log,)
    assert "about to fail" in log.read_text()
    # the script as accounting kept it (AccountingStoreFlags=job_script), with its DeepSpeed config
    assert facts.script_path == f"sacct -B -j {jobs['failing']}"
    assert facts.ds_config_path == str(jobs["work"] / "ds.json")
    knobs, where = facts.plan_knobs, facts.knob_sources
    assert (knobs["gpus_per_node"], knobs["micro_batch"], knobs["grad_accum"]) == (2, 4, 2)
    assert (knobs["precision"], knobs["zero_stage"], knobs["launcher"], knobs["mem_mib"]) == ("bf16-mixed", 2,
                                                                                             "deepspeed", 300)
    assert (where["micro_batch"], where["zero_stage"], where["mem_mib"]) == ("trainer args", "ds_config.json",
                                                                             "job script")
    assert facts.model == "gpt2"
    assert {"sacct", "job script", "ds_config.json", "trainer args"} <= set(facts.sources)
    assert facts.missing == ()


def test_an_array_job_gives_its_failed_task(jobs):
    array = jobs["array"]
    [case] = cases(array, backend=jobs["backend"])
    facts = case.facts
    assert (facts.job_id, facts.state, facts.exit_code) == (f"{array}_2", "FAILED", 5)
    assert case.log_paths == (jobs["work"] / f"slurm-{array}_2.out",)
    assert case.log_paths[0].read_text() == "task 2\n"
    [ok] = cases(f"{array}_1", backend=jobs["backend"])
    assert (ok.facts.state, ok.log_paths) == ("COMPLETED", (jobs["work"] / f"slurm-{array}_1.out",))


def test_a_run_id_and_its_job_id_through_the_ledger(jobs):
    run, job_id = jobs["run"], jobs["run_job"]
    with open_ledger(jobs["home"]) as ledger:
        [by_run] = cases(run.run_id, backend=jobs["backend"], ledger=ledger)
        [by_job] = cases(job_id, backend=jobs["backend"], ledger=ledger)
        [by_log] = cases(str(by_run.log_paths[0]), backend=jobs["backend"], ledger=ledger)
    attempt_dir = Path(run.run_dir) / "attempt-1"
    for case in (by_run, by_job, by_log):
        facts = case.facts
        assert case.log_paths == (attempt_dir / f"slurm-{job_id}.out",)
        assert (facts.run_id, facts.attempt, facts.job_id, facts.site) == (run.run_id, 1, job_id, "testcluster")
        assert (facts.state, facts.exit_code, facts.partition) == ("COMPLETED", 0, "cpu")
        assert facts.name == f"quickstart.{run.run_id}.a1"
        assert facts.max_rss_mib > 50  # torch was imported and trained
        assert facts.plan_knobs["micro_batch"] == 8 and facts.knob_sources["micro_batch"] == "plan.json"
        assert (facts.model, facts.task) == ("tiny-gpt2", "causal-lm")
        assert facts.script_path == str(attempt_dir / "job.sbatch")
        assert facts.attempts == ()
        assert {"sacct", "ledger", "plan.json"} <= set(facts.sources)


def test_a_job_of_another_cluster(jobs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [case] = cases("99999999", backend=jobs["backend"])
    assert (case.facts.job_id, case.facts.state, case.log_paths) == ("99999999", None, ())
    assert case.facts.missing[0] == ("job 99999999 is not known to sacct on this cluster "
                                     "(another cluster, or older than accounting keeps)")


def test_without_sacct_the_controller_still_answers(jobs, tmp_path, monkeypatch):
    # a login node where sacct is missing: scontrol remembers the job for MinJobAge (300 s) after its end
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("scontrol"), bin_dir / "scontrol")
    monkeypatch.setenv("PATH", str(bin_dir))
    [case] = cases(jobs["failing"], backend=SlurmBackend(tries=1))
    facts = case.facts
    assert facts.missing[0] == "sacct unavailable: command not found: sacct"
    assert (facts.state, facts.exit_code, facts.partition) == ("FAILED", 3, "cpu")
    assert "scontrol" in facts.sources and "sacct" not in facts.sources
    assert case.log_paths == (jobs["work"] / f"triage-fail-{jobs['failing']}.log",)
    assert facts.script_path == str(jobs["work"] / "fail.sbatch")  # scontrol's Command


def test_a_window_of_failed_jobs(jobs):
    found = {c.facts.job_id: c for c in window_cases(jobs["backend"], jobs["started"], time.time() + 60,
                                                      partition="cpu")}
    failing, array = jobs["failing"], jobs["array"]
    assert {failing, f"{array}_2"} <= set(found)
    assert f"{array}_1" not in found and jobs["run_job"] not in found  # they completed
    assert found[failing].log_paths == (jobs["work"] / f"triage-fail-{failing}.log",)
    assert found[failing].facts.script_path == f"sacct -B -j {failing}"
    assert found[f"{array}_2"].facts.exit_code == 5
    other = window_cases(jobs["backend"], jobs["started"], time.time() + 60, partition="v100")
    assert not {c.facts.job_id for c in other} & {failing, f"{array}_2"}


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def test_a_ticket_log_of_another_cluster_is_not_this_cluster_job(jobs, tmp_path):
    # a real log from another cluster (JOB 4720 ON gpu-node-09, 2024), attached to a ticket as slurm-<id>.out
    # with the id of a job this cluster knows: its record must not be merged in
    failing = jobs["failing"]
    ticket = tmp_path / "ticket" / f"slurm-{failing}.out"
    ticket.parent.mkdir()
    shutil.copy(FIXTURES / "time_limit_after_oom.log", ticket)
    [case] = cases(str(ticket), backend=jobs["backend"])
    facts = case.facts
    assert (facts.job_id, facts.state, facts.partition, facts.nodes, facts.script_path) == (failing, None, None, None,
                                                                                             None)
    assert "sacct" not in facts.sources and case.log_paths == (ticket,)
    [why] = [m for m in facts.missing if "not the same job" in m]
    assert why.startswith(f"job {failing} here ran on node ") and f"from {jobs['work']}" in why
    assert f"this log ({ticket}) is from node gpu-node-09 and is dated 2024-05-02" in why


def test_a_log_at_the_job_output_path_is_that_job(jobs, tmp_path):
    array = jobs["array"]
    own = jobs["work"] / f"slurm-{array}_2.out"
    [case] = cases(str(own), backend=jobs["backend"])
    assert (case.facts.job_id, case.facts.state, case.facts.exit_code) == (f"{array}_2", "FAILED", 5)
    assert not any("not the same job" in m or "on its id alone" in m for m in case.facts.missing)
    # a copy elsewhere that shows nothing to compare: the id alone ties it, and the case says so
    copy = tmp_path / own.name
    shutil.copy(own, copy)
    [copied] = cases(str(copy), backend=jobs["backend"])
    assert copied.facts.state == "FAILED"
    assert any(m.startswith(f"this log ({copy}) is not at job {array}_2's output path") and "on its id alone" in m
               for m in copied.facts.missing)


def test_many_targets_cost_one_sacct_and_one_sacct_b_in_target_order(jobs, tmp_path, monkeypatch):
    # a real sacct behind a shim that notes each call
    calls = tmp_path / "sacct-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "sacct"
    shim.write_text(f'#!/bin/bash\necho "$*" >> {calls}\nexec {shutil.which("sacct")} "$@"\n')
    shim.chmod(0o755)
    os.symlink(shutil.which("scontrol"), bin_dir / "scontrol")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    failing, array = jobs["failing"], jobs["array"]
    log = jobs["work"] / f"slurm-{array}_1.out"
    with open_ledger(jobs["home"]) as ledger:
        found = target_cases([failing, str(log), array, jobs["run_job"], jobs["run"].run_id],
                             backend=SlurmBackend(tries=1), ledger=ledger)
    assert [(c.target, c.facts.job_id) for c in found] == [
        (failing, failing), (str(log), f"{array}_1"), (array, f"{array}_2"), (jobs["run_job"], jobs["run_job"]),
        (jobs["run"].run_id, jobs["run_job"])]
    assert [c.facts.state for c in found] == ["FAILED", "COMPLETED", "FAILED", "COMPLETED", "COMPLETED"]
    made = calls.read_text().splitlines()
    assert len([c for c in made if c.startswith("-P -n -j ")]) == 1, made
    assert len([c for c in made if c.startswith("-B ")]) == 1, made
    assert len(made) == 2, made
