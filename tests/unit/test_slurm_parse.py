"""Slurm's text formats, parsed by pure functions. The literal outputs come from the
test cluster (Slurm 22.05) unless a comment says otherwise."""

import pytest

from toolkit.backends.base import JobStatus
from toolkit.backends.slurm import (
    clean_environment, first_error_line, gpus_requested, normalize_state, parse_duration_s, parse_exit_code,
    parse_key_values, parse_mem_mib, parse_sacct, parse_sbatch, parse_scontrol, parse_squeue, parse_time_limit_s,
    read_directives, sacct_command, sbatch_command, scancel_command, scontrol_command, squeue_command,
)
from toolkit.errors import SchedulerError

# ---------------------------------------------------------------- sbatch


@pytest.mark.parametrize("text, job_id", [
    ("5\n", "5"),
    ("5;testcluster\n", "5"),
    ("  1234567 \n", "1234567"),
    ("sbatch: warning: can't honor --ntasks-per-node\n77;big\n", "77"),
])
def test_parse_sbatch(text, job_id):
    assert parse_sbatch(text) == job_id


@pytest.mark.parametrize("text", ["", "\n", "Submitted batch job 5\n", "abc;x"])
def test_parse_sbatch_without_an_id_is_a_scheduler_error(text):
    with pytest.raises(SchedulerError, match="no job id"):
        parse_sbatch(text)


def test_first_error_line_is_slurms_own_message():
    refusal = (
        "sbatch: error: invalid partition specified: foo\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    )
    assert first_error_line(refusal) == "sbatch: error: invalid partition specified: foo"
    test_only_refusal = "sbatch: error: invalid partition specified: foo\nallocation failure: Invalid partition name specified\n"
    assert first_error_line(test_only_refusal) == "sbatch: error: invalid partition specified: foo"
    assert first_error_line("something odd\nlast words\n") == "last words"
    assert first_error_line("") == ""


# ---------------------------------------------------------------- sacct

SACCT_DONE = """\
5|COMPLETED|0:0|00:00:09||vm|None
5.batch|COMPLETED|0:0|00:00:09|400K|vm|
5.0|COMPLETED|0:0|00:00:00|0|vm|
6|FAILED|3:0|00:00:09||vm|None
6.batch|FAILED|3:0|00:00:09|400K|vm|
6.0|COMPLETED|0:0|00:00:00|0|vm|
"""


def test_sacct_folds_steps_into_their_job():
    jobs = parse_sacct(SACCT_DONE)
    assert set(jobs) == {"5", "6"}
    ok, bad = jobs["5"], jobs["6"]
    assert (ok.state, ok.exit_code, ok.signal, ok.elapsed_s, ok.node, ok.reason) == ("COMPLETED", 0, 0, 9.0, "vm", None)
    assert ok.max_rss_mib == pytest.approx(400 / 1024)
    assert ok.succeeded and ok.finished
    assert (bad.state, bad.exit_code, bad.signal) == ("FAILED", 3, 0)
    assert not bad.succeeded and bad.finished
    assert bad.raw.splitlines() == SACCT_DONE.splitlines()[3:]


def test_sacct_max_rss_is_the_largest_step():
    text = (
        "42|COMPLETED|0:0|01:02:03||n[1-2]|None\n"
        "42.batch|COMPLETED|0:0|01:02:03|1.5G|n1|\n"
        "42.extern|COMPLETED|0:0|01:02:03|1024K|n[1-2]|\n"
        "42.0|COMPLETED|0:0|01:02:00|2500M|n[1-2]|\n"
    )
    job = parse_sacct(text)["42"]
    assert job.max_rss_mib == 2500
    assert job.elapsed_s == 3723
    assert job.node == "n[1-2]"


def test_sacct_out_of_memory():
    text = (
        "3|OUT_OF_MEMORY|0:125|00:00:00||vm|None\n"
        "3.batch|OUT_OF_MEMORY|0:125|00:00:00|0|vm|\n"
    )
    job = parse_sacct(text)["3"]
    assert (job.state, job.exit_code, job.signal) == ("OUT_OF_MEMORY", 0, 125)
    assert job.max_rss_mib == 0
    assert job.finished and not job.succeeded


def test_sacct_failed_job_with_an_oom_step_is_out_of_memory():
    # older Slurm marks only the step
    text = "8|FAILED|1:0|00:01:00||vm|None\n8.batch|OUT_OF_MEMORY|0:125|00:01:00|9G|vm|\n"
    job = parse_sacct(text)["8"]
    assert job.state == "OUT_OF_MEMORY"
    assert "8.batch" in job.reason


def test_sacct_cancelled_by_uid():
    text = "11|CANCELLED by 0|0:0|00:00:01||vm|None\n11.batch|CANCELLED|0:15|00:00:02|216K|vm|\n"
    job = parse_sacct(text)["11"]
    assert job.state == "CANCELLED"
    assert job.reason == "cancelled by uid 0"
    assert (job.exit_code, job.signal) == (0, 0)
    assert job.elapsed_s == 1


def test_sacct_truncated_states():
    # fixed-width output (``sacct -o State``, no -P) truncates with "+"
    text = "12|OUT_OF_ME+|0:125|00:00:03||vm|None\n13|CANCELLED+|0:0|00:00:01||vm|None\n14|NODE_FAIL|1:0|00:10:00||vm|None\n"
    jobs = parse_sacct(text)
    assert [jobs[i].state for i in ("12", "13", "14")] == ["OUT_OF_MEMORY", "CANCELLED", "NODE_FAIL"]


def test_sacct_array_tasks_keep_their_ids():
    text = (
        "7_1|COMPLETED|0:0|00:00:09||vm|None\n"
        "7_1.batch|COMPLETED|0:0|00:00:09|400K|vm|\n"
        "7_2|FAILED|2:0|00:00:09||vm|None\n"
        "7_2.batch|FAILED|2:0|00:00:09|404K|vm|\n"
        "7_[3-5,9]|PENDING|0:0|00:00:00||None assigned|Resources\n"
    )
    jobs = parse_sacct(text)
    assert set(jobs) == {"7_1", "7_2", "7_3", "7_4", "7_5", "7_9"}
    assert jobs["7_2"].exit_code == 2
    assert jobs["7_1"].max_rss_mib == pytest.approx(400 / 1024)
    pending = jobs["7_4"]
    assert (pending.state, pending.node, pending.reason, pending.exit_code) == ("PENDING", None, "Resources", None)


def test_sacct_lagging_behind_a_started_job():
    # seen on the test cluster: slurmdbd still says PENDING while the batch step runs
    text = (
        "5|PENDING|0:0|00:00:07||vm|None\n"
        "5.batch|RUNNING|0:0|00:00:07||vm|\n"
        "5.0|COMPLETED|0:0|00:00:00|0|vm|\n"
    )
    job = parse_sacct(text)["5"]
    assert job.state == "RUNNING"
    assert job.exit_code is None and not job.finished


def test_sacct_running_and_pending_have_no_exit_code_yet():
    text = "20|RUNNING|0:0|1-02:03:04||vm|None\n21|PENDING|0:0|00:00:00||None assigned|Priority\n"
    jobs = parse_sacct(text)
    assert (jobs["20"].state, jobs["20"].exit_code, jobs["20"].elapsed_s) == ("RUNNING", None, 93784)
    assert (jobs["21"].state, jobs["21"].reason, jobs["21"].node) == ("PENDING", "Priority", None)


@pytest.mark.parametrize("text", ["", "\n", "  \n\n"])
def test_sacct_empty_output(text):
    assert parse_sacct(text) == {}


def test_sacct_timeout_and_requeue():
    text = "30|TIMEOUT|0:0|00:30:00||vm|None\n31|REQUEUED|0:0|00:00:05||vm|None\n32|PREEMPTED|0:15|00:02:00||vm|None\n"
    jobs = parse_sacct(text)
    assert jobs["30"].state == "TIMEOUT" and jobs["30"].finished
    assert jobs["31"].state == "PENDING" and not jobs["31"].finished
    assert jobs["32"].state == "PREEMPTED" and jobs["32"].finished


# ---------------------------------------------------------------- squeue and scontrol


def test_parse_squeue():
    text = (
        "5|RUNNING|None|vm|0:01\n"
        "6|PENDING|Priority||0:00\n"
        "7_[1-3]|PENDING|None||0:00\n"
        "9|COMPLETING|None|vm|1-00:00:05\n"
        "10|FAILED|NonZeroExitCode|vm|0:09\n"
    )
    jobs = parse_squeue(text)
    assert set(jobs) == {"5", "6", "7_1", "7_2", "7_3", "9", "10"}
    assert (jobs["5"].state, jobs["5"].node, jobs["5"].elapsed_s, jobs["5"].reason) == ("RUNNING", "vm", 1, None)
    assert (jobs["6"].state, jobs["6"].reason, jobs["6"].node) == ("PENDING", "Priority", None)
    assert jobs["9"].state == "COMPLETING" and jobs["9"].elapsed_s == 86405
    # squeue has no exit codes: a finished job says so, its code stays unknown
    assert (jobs["10"].state, jobs["10"].exit_code, jobs["10"].reason) == ("FAILED", None, "NonZeroExitCode")
    assert parse_squeue("") == {}


SCONTROL_RUNNING = (
    "JobId=5 JobName=ok.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901755 Nice=0 Account=hpcmem "
    "QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "RunTime=00:00:01 TimeLimit=00:02:00 TimeMin=N/A SubmitTime=2026-11-21T05:51:17 Partition=cpu "
    "AllocNode:Sid=localhost:5156 ReqNodeList=(null) ExcNodeList=(null) NodeList=vm BatchHost=vm NumNodes=1 "
    "TRES=cpu=1,mem=200M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* "
    "Command=/tmp/my runs/ok.sh WorkDir=/tmp/my runs StdOut=/tmp/my runs/slurm-5.out Power= \n"
)


def test_parse_scontrol():
    jobs = parse_scontrol(SCONTROL_RUNNING)
    job = jobs["5"]
    assert (job.state, job.elapsed_s, job.node, job.reason, job.exit_code) == ("RUNNING", 1, "vm", None, None)
    failed = parse_scontrol("JobId=6 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 RunTime=00:00:09 NodeList=vm")
    assert (failed["6"].state, failed["6"].exit_code, failed["6"].signal, failed["6"].reason) == ("FAILED", 3, 0, "NonZeroExitCode")


def test_parse_scontrol_array_task_and_oom():
    text = (
        "JobId=9 ArrayJobId=7 ArrayTaskId=2 JobName=ok.sh JobState=OUT_OF_MEMORY Reason=OutOfMemory "
        "ExitCode=0:125 RunTime=00:00:08 NodeList=vm\n"
    )
    job = parse_scontrol(text)["7_2"]
    assert (job.job_id, job.state, job.exit_code, job.signal, job.reason) == ("7_2", "OUT_OF_MEMORY", 0, 125, "OutOfMemory")


def test_parse_scontrol_ignores_errors_and_blank_output():
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified\n") == {}
    assert parse_scontrol("") == {}


def test_parse_key_values_keeps_spaces_and_equals_in_values():
    pairs = parse_key_values(SCONTROL_RUNNING)
    assert pairs["Command"] == "/tmp/my runs/ok.sh"
    assert pairs["StdOut"] == "/tmp/my runs/slurm-5.out"
    assert pairs["TRES"] == "cpu=1,mem=200M,node=1,billing=1"
    assert pairs["AllocNode:Sid"] == "localhost:5156"
    assert pairs["Power"] == ""


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("text, state", [
    ("COMPLETED", "COMPLETED"), ("CANCELLED by 1000", "CANCELLED"), ("OUT_OF_ME+", "OUT_OF_MEMORY"),
    ("CANCELLED+", "CANCELLED"), ("RUNNING", "RUNNING"), ("completing", "COMPLETING"), ("REQUEUED", "PENDING"),
    ("REQUEUE+", "PENDING"), ("SUSPENDED", "RUNNING"), ("BOOT_FAIL", "BOOT_FAIL"), ("DEADLINE", "DEADLINE"),
    ("CONFIGURING", "PENDING"), ("REVOKED", "CANCELLED"), ("", "UNKNOWN"), ("WEIRD", "UNKNOWN"), ("C+", "UNKNOWN"),
])
def test_normalize_state(text, state):
    assert normalize_state(text) == state


@pytest.mark.parametrize("text, expected", [
    ("0:0", (0, 0)), ("3:0", (3, 0)), ("0:125", (0, 125)), ("0:9", (0, 9)), ("1", (1, 0)), ("", (None, None)),
    ("x:y", (None, None)),
])
def test_parse_exit_code(text, expected):
    assert parse_exit_code(text) == expected


@pytest.mark.parametrize("text, seconds", [
    ("00:00:09", 9), ("01:02:03", 3723), ("1-02:03:04", 93784), ("12:34.567", 754.567), ("0:05", 5),
    ("2-00:00:00", 172800), ("", None), ("INVALID", None), ("UNLIMITED", None), ("x-00:00:01", None),
])
def test_parse_duration_s(text, seconds):
    assert parse_duration_s(text) == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize("text, unit, mib", [
    ("1024K", "B", 1), ("400K", "B", 400 / 1024), ("12.5M", "B", 12.5), ("2G", "B", 2048), ("1T", "B", 1024**2),
    ("0", "B", 0), ("1048576", "B", 1), ("", "B", None), ("lots", "B", None),
    ("1500", "M", 1500), ("1500M", "M", 1500), ("4G", "M", 4096), ("16gb", "M", 16384),
])
def test_parse_mem_mib(text, unit, mib):
    assert parse_mem_mib(text, default_unit=unit) == (pytest.approx(mib) if mib is not None else None)


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("1:30", 90), ("0:2", 2), ("01:00:00", 3600), ("2-0", 172800), ("1-02", 93600),
    ("1-02:03", 93780), ("1-02:03:04", 93784), ("UNLIMITED", None), ("infinite", None), ("", None),
])
def test_parse_time_limit_s(text, seconds):
    assert parse_time_limit_s(text) == seconds


# ---------------------------------------------------------------- job scripts and environment

SCRIPT = """\
#!/bin/bash
# hpcmem job (rendered)
#SBATCH --job-name="my job 'x'"
#SBATCH -p cpu
#SBATCH --mem=1500M
#SBATCH --time 0:30:00   # half an hour
#SBATCH -N1
#SBATCH --gpus-per-node=a100:2
#SBATCH --exclusive
#SBATCH --output=/runs/a b/slurm-%j.out

set -euo pipefail
#SBATCH --mem=1M
echo hi
"""


def test_read_directives_like_sbatch():
    d = read_directives(SCRIPT)
    assert d["job-name"] == "my job 'x'"
    assert d["partition"] == "cpu"
    assert d["mem"] == "1500M"  # the #SBATCH after the first command is ignored, as by sbatch
    assert d["time"] == "0:30:00"
    assert d["nodes"] == "1"
    assert d["exclusive"] == ""
    assert d["output"] == "/runs/a"  # unquoted spaces split, as in sbatch
    assert gpus_requested(d) == 2


@pytest.mark.parametrize("directives, gpus", [
    ({}, 0), ({"gpus-per-node": "4"}, 4), ({"gpus-per-node": "v100:2"}, 2), ({"gres": "gpu:a100:8"}, 8),
    ({"gres": "gpu:3"}, 3), ({"gres": "gpu"}, 1), ({"gres": "nvme:1,gpu:v100:2"}, 2), ({"gpus": "1"}, 1),
])
def test_gpus_requested(directives, gpus):
    assert gpus_requested(directives) == gpus


def test_clean_environment_drops_what_a_calling_job_left():
    env = {
        "PATH": "/usr/bin", "HOME": "/root", "SLURM_JOB_ID": "99", "SLURM_CPUS_PER_TASK": "4", "SBATCH_PARTITION": "a100",
        "SRUN_CPUS_PER_TASK": "4", "SALLOC_ACCOUNT": "x", "SLURM_CONF": "/etc/slurm/slurm.conf", "MY_SLURM_X": "keep",
    }
    assert clean_environment(env) == {
        "PATH": "/usr/bin", "HOME": "/root", "SLURM_CONF": "/etc/slurm/slurm.conf", "MY_SLURM_X": "keep",
    }


def test_commands_are_argv_lists():
    assert sbatch_command("/a b/job.sbatch") == ["sbatch", "--parsable", "/a b/job.sbatch"]
    assert sbatch_command("j.sh", test_only=True) == ["sbatch", "--test-only", "j.sh"]
    assert sacct_command(["1", "2_3"]) == [
        "sacct", "-P", "-n", "-j", "1,2_3", "-o", "JobID,State,ExitCode,Elapsed,MaxRSS,NodeList,Reason",
    ]
    assert squeue_command(["4"]) == ["squeue", "-h", "-t", "all", "-j", "4", "-o", "%i|%T|%r|%N|%M"]
    assert scontrol_command("5") == ["scontrol", "show", "job", "-o", "5"]
    assert scancel_command(["5", "6"]) == ["scancel", "5", "6"]


def test_job_status_checks_its_state_and_round_trips():
    status = JobStatus("1", "FAILED", exit_code=1, signal=0, elapsed_s=2.0, max_rss_mib=3.0, node="vm", reason="x")
    assert JobStatus.from_dict(status.to_dict()) == status
    with pytest.raises(ValueError, match="state must be one of"):
        JobStatus("1", "DONE")
    assert not JobStatus("1", "UNKNOWN").finished
    assert not JobStatus("1", "COMPLETED", exit_code=0, signal=9).succeeded
