"""Slurm's text formats, parsed by pure functions. The literal outputs come from the
test cluster (Slurm 22.05) unless a comment says otherwise."""

import time

import pytest

from toolkit.backends.base import JobStatus
from toolkit.backends.slurm import (
    SACCT_FACT_FIELDS, batch_script_command, expand_filename_pattern, parse_batch_scripts, parse_sacct_facts,
    parse_scontrol_facts, parse_tres, sacct_facts_command, sacct_time, sacct_window_command, scontrol_all_command,
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


# ---------------------------------------------------------------- job facts (triage)

# sacct -P -n -j 781,782 -o <SACCT_FACT_FIELDS> on the test cluster: a job that failed with exit 3
# (one srun step), and an array job whose task 2 failed.
SACCT_FACTS = """\
781|781|trx-fail|root|cpu|testcluster|FAILED|3:0|00:00:07|00:02:00||billing=1,cpu=1,mem=200M,node=1|billing=1,cpu=1,mem=200M,node=1|vm|/tmp/trx|2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:51|None
781.batch|781.batch|batch|||testcluster|FAILED|3:0|00:00:07||5120K||cpu=1,mem=200M,node=1|vm||2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:51|
781.0|781.0|true|||testcluster|COMPLETED|0:0|00:00:00||812K||cpu=1,mem=200M,node=1|vm||2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:44|
782_1|783|trx-arr|root|cpu|testcluster|COMPLETED|0:0|00:00:00|02:00:00||billing=1,cpu=1,mem=100M,node=1|billing=1,cpu=1,mem=100M,node=1|vm|/tmp/trx|2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:44|None
782_1.batch|783.batch|batch|||testcluster|COMPLETED|0:0|00:00:00||0||cpu=1,mem=100M,node=1|vm||2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:44|
782_2|782|trx-arr|root|cpu|testcluster|FAILED|5:0|00:00:00|02:00:00||billing=1,cpu=1,mem=100M,node=1|billing=1,cpu=1,mem=100M,node=1|vm|/tmp/trx|2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:44|None
782_2.batch|782.batch|batch|||testcluster|FAILED|5:0|00:00:00||0||cpu=1,mem=100M,node=1|vm||2026-11-21T08:34:44|2026-11-21T08:34:44|2026-11-21T08:34:44|
"""


def test_sacct_facts_of_a_failed_job_with_its_steps():
    facts = parse_sacct_facts(SACCT_FACTS)
    assert set(facts) == {"781", "782_1", "782_2"}
    job = facts["781"]
    assert (job["name"], job["user"], job["partition"], job["cluster"]) == ("trx-fail", "root", "cpu", "testcluster")
    assert (job["state"], job["exit_code"], job["signal"]) == ("FAILED", 3, 0)
    assert (job["elapsed_s"], job["timelimit_s"]) == (7.0, 120.0)
    assert job["max_rss_mib"] == 5.0  # the largest step
    assert job["req_tres"] == {"billing": "1", "cpu": "1", "mem": "200M", "node": "1"}
    assert (job["nodes"], job["workdir"], job["reason"]) == ("vm", "/tmp/trx", None)
    assert (job["submit"], job["end"]) == ("2026-11-21T08:34:44", "2026-11-21T08:34:51")
    assert [s["step"] for s in job["steps"]] == ["781.batch", "781.0"]
    assert job["steps"][1] == {"step": "781.0", "name": "true", "state": "COMPLETED", "exit_code": 0, "signal": 0,
                               "max_rss_mib": pytest.approx(812 / 1024)}
    assert (job["raw_id"], job["array_job_id"], job["array_task_id"]) == ("781", None, None)


def test_sacct_facts_of_array_tasks_keep_their_own_raw_ids():
    facts = parse_sacct_facts(SACCT_FACTS)
    first, second = facts["782_1"], facts["782_2"]
    assert (first["raw_id"], first["array_job_id"], first["array_task_id"], first["state"]) == ("783", "782", "1", "COMPLETED")
    assert (second["raw_id"], second["state"], second["exit_code"]) == ("782", "FAILED", 5)
    assert second["timelimit_s"] == 7200


def test_sacct_facts_out_of_memory_step_and_unlimited_time_and_pending_array():
    text = (
        "8|8|big|ann|cpu|c1|FAILED|1:0|00:01:00|UNLIMITED||cpu=2,mem=1G,node=1,gres/gpu=2|||/w|2026-01-01T00:00:00|Unknown|Unknown|None\n"
        "8.batch|8.batch|batch|||c1|OUT_OF_MEMORY|0:125|00:01:00||1.5G||||||||\n"
        "9_[2-3]|9|arr|ann|cpu|c1|PENDING|0:0|00:00:00|01:00:00||cpu=1|||/w|2026-01-01T00:00:00|Unknown|Unknown|Priority\n"
    )
    facts = parse_sacct_facts(text)
    job = facts["8"]
    assert (job["state"], job["state_text"], job["reason"]) == ("OUT_OF_MEMORY", "FAILED", "step 8.batch ran out of memory")
    assert job["max_rss_mib"] == 1536 and job["timelimit_s"] is None
    assert job["req_tres"]["gres/gpu"] == "2" and job["alloc_tres"] == {} and job["nodes"] is None
    assert (job["start"], job["end"]) == (None, None)
    assert set(facts) == {"8", "9_2", "9_3"}
    assert facts["9_3"]["raw_id"] is None  # the tasks of a pending range have no own id yet
    assert (facts["9_3"]["state"], facts["9_3"]["reason"]) == ("PENDING", "Priority")


def test_parse_tres():
    assert parse_tres("billing=8,cpu=8,gres/gpu:a100=2,gres/gpu=2,mem=64G,node=1") == {
        "billing": "8", "cpu": "8", "gres/gpu:a100": "2", "gres/gpu": "2", "mem": "64G", "node": "1"}
    assert parse_tres("") == {} and parse_tres("junk") == {}


# sacct -B -j 781,782 with AccountingStoreFlags=job_script (a job from before the flag says NONE)
SACCT_B = """\
Batch Script for 781
--------------------------------------------------------------------------------
#!/bin/bash
#SBATCH -J trx-fail
#SBATCH -o /tmp/trx/out-%x-%j.log
echo hi; srun true; exit 3

Batch Script for 782_2
--------------------------------------------------------------------------------
#!/bin/bash
#SBATCH -a 1-2
echo task $SLURM_ARRAY_TASK_ID

Batch Script for 778
--------------------------------------------------------------------------------
NONE

"""


def test_parse_batch_scripts():
    scripts = parse_batch_scripts(SACCT_B)
    assert set(scripts) == {"781", "782_2"}
    assert scripts["781"] == ("#!/bin/bash\n#SBATCH -J trx-fail\n#SBATCH -o /tmp/trx/out-%x-%j.log\n"
                              "echo hi; srun true; exit 3\n")
    assert scripts["782_2"].endswith("echo task $SLURM_ARRAY_TASK_ID\n")
    assert parse_batch_scripts("") == {}


SCONTROL_TASK = (
    "JobId=779 ArrayJobId=779 ArrayTaskId=2 JobName=trx-arr UserId=root(0) GroupId=root(0) JobState=FAILED "
    "Reason=NonZeroExitCode Dependency=(null) ExitCode=5:0 RunTime=00:00:04 TimeLimit=02:00:00 "
    "SubmitTime=2026-11-21T08:34:24 StartTime=2026-11-21T08:34:24 EndTime=2026-11-21T08:34:28 Partition=cpu "
    "NodeList=vm BatchHost=vm NumNodes=1 TRES=cpu=1,mem=100M,node=1,billing=1 MinMemoryNode=100M "
    "Command=/tmp/trx/a.sh WorkDir=/tmp/trx StdErr=/tmp/trx/err-779_2.out StdIn=/dev/null "
    "StdOut=/tmp/my runs/slurm-779_2.out Power= \n"
    "JobId=790 ArrayJobId=790 ArrayTaskId=3-5 JobName=p JobState=PENDING Reason=Priority\n"
)


def test_parse_scontrol_facts():
    facts = parse_scontrol_facts(SCONTROL_TASK)
    assert set(facts) == {"779_2"}  # a pending task range is not one job
    job = facts["779_2"]
    assert (job["raw_id"], job["array_job_id"], job["array_task_id"], job["user"]) == ("779", "779", "2", "root")
    assert (job["state"], job["exit_code"], job["elapsed_s"], job["timelimit_s"]) == ("FAILED", 5, 4.0, 7200.0)
    assert job["alloc_tres"] == {"cpu": "1", "mem": "100M", "node": "1", "billing": "1"}
    assert (job["stdout"], job["stderr"]) == ("/tmp/my runs/slurm-779_2.out", "/tmp/trx/err-779_2.out")
    assert (job["command"], job["workdir"], job["end"]) == ("/tmp/trx/a.sh", "/tmp/trx", "2026-11-21T08:34:28")
    assert job["max_rss_mib"] is None and job["steps"] == []


@pytest.mark.parametrize("pattern, kwargs, expected", [
    ("slurm-%j.out", {"job_id": "42"}, "slurm-42.out"),
    ("slurm-%A_%a.out", {"job_id": "782_1", "raw_id": "783"}, "slurm-782_1.out"),
    ("out-%x-%j.log", {"job_id": "782_1", "raw_id": "783", "job_name": "trx"}, "out-trx-783.log"),
    ("%u/%N/%J.%s.%n.%t", {"job_id": "5", "user": "ann", "node": "gpu[01-04],cpu1"}, "ann/gpu01/5.batch.batch.0.0"),
    ("%4a-%5j-100%%", {"job_id": "7_3"}, "0003-00007-100%"),
    ("/abs/\\\\%j.out", {"job_id": "5"}, "/abs/%j.out"),  # \\ turns patterns off, as in sbatch
    ("plain.log", {"job_id": "5"}, "plain.log"),
])
def test_expand_filename_pattern(pattern, kwargs, expected):
    assert expand_filename_pattern(pattern, **kwargs) == expected


def test_fact_commands_are_argv_lists():
    assert sacct_facts_command(["1", "2_3"]) == ["sacct", "-P", "-n", "-j", "1,2_3", "-o", ",".join(SACCT_FACT_FIELDS)]
    assert "-X" not in sacct_facts_command(["1"])  # steps are needed for MaxRSS and OOM steps
    assert batch_script_command(["1", "2"]) == ["sacct", "-B", "-j", "1,2"]
    assert scontrol_all_command() == ["scontrol", "show", "job", "-o"]


def test_sacct_window_command():
    fields = ",".join(SACCT_FACT_FIELDS)
    assert sacct_window_command("2026-11-21T08:00:00", "2026-11-21T09:00:00") == [
        "sacct", "-P", "-n", "-S", "2026-11-21T08:00:00", "-E", "2026-11-21T09:00:00", "-s", "BF,CA,DL,F,NF,OOM,PR,TO",
        "-o", fields, "-a"]
    argv = sacct_window_command("a", "b", partition="a100", user="ann")
    assert argv[-4:] == ["-u", "ann", "-r", "a100"] and "-a" not in argv


def test_sacct_time_is_local_time(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert sacct_time(1795250100) == "2026-11-21T08:35:00"
    finally:
        monkeypatch.undo()
        time.tzset()


# ---------------------------------------------------------------- the one retry loop (backends.base.retrying)


def test_retrying_is_bounded_and_lets_the_judge_decide():
    from toolkit.backends.base import RETRY, retrying
    from toolkit.errors import CommandError
    from toolkit.proc import CommandNotFoundError

    calls, pauses = [], []

    def failing():
        calls.append(1)
        raise CommandError(["sacct"], 1, stderr="sacct: error: Socket timed out")

    with pytest.raises(CommandError):
        retrying(failing, lambda exc, last: RETRY, tries=3, pause=pauses.append)
    assert len(calls) == 3 and pauses == [1, 2]  # no pause after the last try

    calls.clear()
    assert retrying(failing, lambda exc, last: "an answer", tries=3, pause=pauses.append) == "an answer"
    assert len(calls) == 1

    def judge(exc, last):
        raise SchedulerError("refused") if not last else AssertionError("not reached")

    with pytest.raises(SchedulerError, match="refused"):
        retrying(failing, judge, tries=3, pause=pauses.append)

    def missing():
        raise CommandNotFoundError(["sacct"])

    with pytest.raises(CommandNotFoundError):  # never retried, never judged
        retrying(missing, lambda exc, last: pytest.fail("judged"), tries=3, pause=pauses.append)

    flaky = iter([CommandError(["squeue"], 1), "ok"])

    def once_then_ok():
        item = next(flaky)
        if isinstance(item, Exception):
            raise item
        return item

    assert retrying(once_then_ok, lambda exc, last: RETRY, tries=3, pause=pauses.append) == "ok"
