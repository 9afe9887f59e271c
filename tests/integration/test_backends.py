"""The backends for real.

- ``local``: real jobs on this machine (bash, torch under an address-space cap).
- ``slurm`` against fake scheduler commands (bash scripts named ``sbatch``, ``sacct``,
  ... put first on PATH): the hiccups, refusals and disabled accounting that a healthy
  test cluster cannot produce on demand.
- ``slurm`` against the real test cluster (``tests/cluster/slurm-up.sh``), marked
  ``slurm``; skipped only when the Slurm client tools are not installed.
"""

import json
import os
import re
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

import toolkit
from toolkit import proc
from toolkit.backends import LocalBackend, SlurmBackend, get_backend
from toolkit.backends.base import JobStatus
from toolkit.errors import HpcmemError, MaybeSubmittedError, SchedulerError, UnknownNameError


def write_job(directory: Path, body: str, *directives: str, name: str = "job.sbatch") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), body, ""]
    script = directory / name
    script.write_text("\n".join(lines))
    return script


def wait_for(backend, job_id: str, done=lambda s: s.finished, timeout_s: float = 180) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = backend.poll([job_id])[job_id]
        if done(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {status.state} after {timeout_s} s: {status}")
        time.sleep(0.5)


def test_get_backend():
    assert isinstance(get_backend("slurm", tries=2), SlurmBackend)
    assert isinstance(get_backend("local"), LocalBackend)
    with pytest.raises(UnknownNameError, match="unknown backend 'pbs'; valid: local, slurm"):
        get_backend("pbs")


# ================================================================ local


@pytest.fixture
def local(tmp_path):
    return LocalBackend(state_dir=tmp_path / "home" / "local", kill_wait_s=1)


def test_local_job_completes_with_a_slurm_like_environment(local, tmp_path, monkeypatch):
    # left behind by a calling Slurm job: must not reach the local one
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SBATCH_PARTITION", "a100")
    attempt = tmp_path / "runs" / "r1" / "attempt-1"
    script = write_job(attempt, "echo hello from the job; pwd; env | grep -E '^(SLURM|SBATCH|MALLOC)' | sort", "--job-name=quick")
    job_id = local.submit(script, attempt)
    assert re.fullmatch(r"local-\d+", job_id)
    status = wait_for(local, job_id)
    assert (status.state, status.exit_code, status.signal, status.node) == ("COMPLETED", 0, 0, "localhost")
    assert status.succeeded and status.elapsed_s >= 0 and status.max_rss_mib > 0
    log = (attempt / f"slurm-{job_id}.out").read_text()
    assert log.startswith(f"hello from the job\n{attempt}\n")
    env = dict(line.split("=", 1) for line in log.splitlines()[2:])
    assert env["SLURM_JOB_ID"] == job_id and env["SLURM_JOB_NAME"] == "quick"
    assert (env["SLURM_NNODES"], env["SLURM_NODEID"], env["SLURM_PROCID"]) == ("1", "0", "0")
    assert env["SLURM_JOB_NODELIST"] == "localhost" and env["SLURM_SUBMIT_DIR"] == str(attempt)
    assert int(env["SLURM_CPUS_ON_NODE"]) >= 1 and env["MALLOC_ARENA_MAX"] == "2"
    assert "SLURM_ARRAY_TASK_ID" not in env and "SBATCH_PARTITION" not in env and "SLURM_GPUS_ON_NODE" not in env
    result = json.loads((attempt / f"{job_id}.json").read_text())
    assert result["state"] == "COMPLETED" and result["exit_code"] == 0 and result["start"] and result["end"]


def test_local_job_failing_with_exit_3(local, tmp_path):
    script = write_job(tmp_path / "a", "echo about to fail >&2; exit 3")
    job_id = local.submit(script, tmp_path / "a")
    status = wait_for(local, job_id)
    assert (status.state, status.exit_code, status.signal, status.reason) == ("FAILED", 3, 0, "exit code 3")
    assert not status.succeeded
    assert "about to fail" in LocalBackend.log_path(tmp_path / "a", job_id).read_text()


def test_local_job_over_its_memory_cap_gets_pytorchs_allocator_error(local, tmp_path):
    pytest.importorskip("torch")
    script = write_job(
        tmp_path / "a",
        'ulimit -v\npython3 -c "import torch; torch.empty(2**31, dtype=torch.uint8).fill_(1)"',
        "--mem=1500M",
    )
    job_id = local.submit(script, tmp_path / "a")
    status = wait_for(local, job_id)
    assert (status.state, status.exit_code) == ("FAILED", 1)
    log = LocalBackend.log_path(tmp_path / "a", job_id).read_text()
    assert log.splitlines()[0] == str(1500 * 1024)  # RLIMIT_AS in KiB, as bash reports it
    assert "DefaultCPUAllocator: can't allocate memory" in log


def test_local_job_within_its_cap_can_use_torch(local, tmp_path):
    pytest.importorskip("torch")
    script = write_job(tmp_path / "a", 'python3 -c "import torch; print(torch.ones(2**20).sum().item())"', "--mem=1500M")
    job_id = local.submit(script, tmp_path / "a")
    assert wait_for(local, job_id).state == "COMPLETED"
    assert "1048576.0" in LocalBackend.log_path(tmp_path / "a", job_id).read_text()


@pytest.mark.parametrize("directives, default_mib, expected", [
    (["--mem=2G"], None, str(2048 * 1024)),
    (["--mem=0"], 1000, "unlimited"),          # --mem=0: the whole node, as under Slurm
    ([], 1000, str(1000 * 1024)),              # no --mem: the backend's default
    ([], None, "unlimited"),
    (["--mem=2G", "--gpus-per-node=2"], None, "unlimited"),  # CUDA needs its address space
])
def test_local_memory_cap_contract(tmp_path, directives, default_mib, expected):
    backend = LocalBackend(state_dir=tmp_path / "home", default_mem_mib=default_mib)
    script = write_job(tmp_path / "a", 'ulimit -v; echo "gpus=${SLURM_GPUS_ON_NODE:-}"', *directives)
    job_id = backend.submit(script, tmp_path / "a")
    assert wait_for(backend, job_id).state == "COMPLETED"
    lines = LocalBackend.log_path(tmp_path / "a", job_id).read_text().splitlines()
    assert lines[0] == expected
    assert lines[1] == ("gpus=2" if "--gpus-per-node=2" in directives else "gpus=")


def test_local_cancel(local, tmp_path):
    attempt = tmp_path / "a"
    script = write_job(attempt, f"sleep 300 &\necho $! > {attempt}/child.pid\necho started\nwait")
    job_id = local.submit(script, attempt)
    wait_for(local, job_id, done=lambda s: (attempt / "child.pid").exists() and s.state == "RUNNING", timeout_s=30)
    start = time.monotonic()
    local.cancel([job_id])
    assert time.monotonic() - start < 10
    status = local.poll([job_id])[job_id]
    assert status.state == "CANCELLED" and status.finished and not status.succeeded
    assert "CANCELLED AT" in LocalBackend.log_path(attempt, job_id).read_text()
    child = int((attempt / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or _zombie(child), "the job's child survived the cancel"
    local.cancel([job_id])  # cancelling a finished job is a no-op
    assert local.poll([job_id])[job_id].state == "CANCELLED"


def test_local_time_limit(local, tmp_path):
    script = write_job(tmp_path / "a", "echo started; sleep 300", "--time=0:2")  # 0 min 2 s
    job_id = local.submit(script, tmp_path / "a")
    status = wait_for(local, job_id, timeout_s=30)
    assert status.state == "TIMEOUT" and 2 <= status.elapsed_s < 15
    assert "DUE TO TIME LIMIT" in LocalBackend.log_path(tmp_path / "a", job_id).read_text()


def test_local_runner_that_vanishes_is_a_failure(local, tmp_path):
    script = write_job(tmp_path / "a", "sleep 300")
    job_id = local.submit(script, tmp_path / "a")
    pid_file = tmp_path / "a" / f"{job_id}.pid"
    wait_for(local, job_id, done=lambda s: pid_file.exists(), timeout_s=30)
    record = json.loads((local.state_dir / "jobs" / f"{job_id}.json").read_text())
    os.kill(record["runner_pid"], signal.SIGKILL)
    status = wait_for(local, job_id, timeout_s=30)
    assert status.state == "FAILED" and "without recording a result" in status.reason
    assert "its job was killed with it" in status.reason  # nobody's now: it dies as with slurmstepd
    assert wait_for(local, job_id).reason == status.reason  # recorded: every later look says the same


def test_local_accounting_answers_from_its_records(local, tmp_path):
    """The typed accounting queries triage makes, answered by the local backend from its own records."""
    good = local.submit(write_job(tmp_path / "a", "echo fine", "--mem=1500M", "--job-name=good"), tmp_path / "a")
    bad = local.submit(write_job(tmp_path / "b", "exit 3", "--time=5", "--partition=cpu"), tmp_path / "b")
    wait_for(local, good)
    wait_for(local, bad)
    facts = local.job_facts([good, bad, "local-999"])
    assert set(facts) == {good, bad}
    assert (facts[good]["state"], facts[good]["name"], facts[good]["req_tres"]["mem"]) == ("COMPLETED", "good", "1500M")
    assert (facts[bad]["state"], facts[bad]["exit_code"], facts[bad]["timelimit_s"]) == ("FAILED", 3, 300.0)
    assert facts[bad]["partition"] == "cpu" and facts[bad]["end"] and facts[bad]["cluster"] == "local"
    window = local.failed_jobs(time.time() - 600, time.time() + 1)
    assert set(window) == {bad}
    assert local.failed_jobs(time.time() - 600, time.time() + 1, partition="gpu") == {}
    assert local.failed_jobs(time.time() - 900, time.time() - 600) == {}
    scripts = local.batch_scripts([bad, "local-999"])
    assert list(scripts) == [bad] and "exit 3" in scripts[bad]
    remembered = local.controller_facts([bad])
    assert remembered[bad]["stdout"] == str(LocalBackend.log_path((tmp_path / "b").resolve(), bad))
    assert remembered[bad]["command"].endswith("job.sbatch") and remembered[bad]["steps"] == []


def test_every_backend_offers_the_whole_contract():
    import inspect

    from toolkit.backends import BACKENDS
    from toolkit.backends.base import Backend

    abstract = {name for name, value in vars(Backend).items() if getattr(value, "__isabstractmethod__", False)}
    assert {"job_facts", "failed_jobs", "batch_scripts", "controller_facts", "submit", "poll", "find"} <= abstract
    for cls in BACKENDS.values():
        assert not inspect.isabstract(cls), cls


def test_local_ids_are_unique_and_known_to_a_later_process(tmp_path):
    state_dir = tmp_path / "home"
    first, second = LocalBackend(state_dir=state_dir), LocalBackend(state_dir=state_dir)
    ids = [b.submit(write_job(tmp_path / f"a{i}", "true"), tmp_path / f"a{i}") for i, b in enumerate([first, second, first])]
    assert len(set(ids)) == 3
    later = LocalBackend(state_dir=state_dir)  # e.g. the next `hpcmem tick`
    for job_id in ids:
        assert wait_for(later, job_id).state == "COMPLETED"
    statuses = later.poll([*ids, "local-999"])
    assert statuses["local-999"].state == "UNKNOWN" and not statuses["local-999"].finished


def test_local_job_outlives_the_process_that_submitted_it(tmp_path):
    state_dir, attempt = tmp_path / "home", tmp_path / "a"
    script = write_job(attempt, "sleep 2; echo still here")
    code = (
        "import sys; from toolkit.backends import LocalBackend; "
        f"print(LocalBackend(state_dir={str(state_dir)!r}).submit({str(script)!r}, {str(attempt)!r}))"
    )
    job_id = proc.run([sys.executable, "-c", code], timeout=60, cwd=Path(toolkit.__file__).parent.parent).stdout.strip()
    backend = LocalBackend(state_dir=state_dir)
    assert backend.poll([job_id])[job_id].state == "RUNNING"  # its submitter is gone
    assert wait_for(backend, job_id).state == "COMPLETED"
    assert "still here" in LocalBackend.log_path(attempt, job_id).read_text()


def test_local_bad_input(local, tmp_path):
    with pytest.raises(SchedulerError, match="job script not found"):
        local.submit(tmp_path / "missing.sbatch", tmp_path)
    with pytest.raises(SchedulerError, match="not a local job id"):
        local.poll(["12345"])
    with pytest.raises(SchedulerError, match="cannot read #SBATCH --mem=lots"):
        local.submit(write_job(tmp_path / "a", "true", "--mem=lots"), tmp_path / "a")


def test_local_test_only(local, tmp_path):
    ok = write_job(tmp_path / "a", "echo fine", "--mem=1500M", "--time=10")
    assert local.test_only(ok) == "local: job would run on localhost with a 1500 MiB address-space cap and a 600 s time limit"
    broken = write_job(tmp_path / "b", "if then fi (")
    with pytest.raises(SchedulerError, match="syntax error"):
        local.test_only(broken)


def _zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ================================================================ slurm against fake commands


class FakeSlurm:
    """Fake Slurm client commands (bash scripts first on PATH) that log their calls."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.calls_log = bin_dir / "calls.log"

    def command(self, name: str, body: str) -> None:
        path = self.bin_dir / name
        path.write_text(
            "#!/bin/bash\n"
            f'echo "{name} $*" >> {self.bin_dir}/calls.log\n'
            f'n=$(( $(cat {self.bin_dir}/{name}.count 2>/dev/null || echo 0) + 1 )); echo $n > {self.bin_dir}/{name}.count\n'
            f"{body}\n"
        )
        path.chmod(path.stat().st_mode | stat.S_IXUSR)

    def calls(self, name: str | None = None) -> list[str]:
        lines = self.calls_log.read_text().splitlines() if self.calls_log.exists() else []
        return [line for line in lines if name is None or line.split()[0] == name]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    bin_dir = tmp_path / "fake-slurm-bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return FakeSlurm(bin_dir)


@pytest.fixture
def slurm_fast():
    """A Slurm backend whose pauses between tries are recorded, not slept."""
    pauses = []
    backend = SlurmBackend(tries=3, backoff_s=1.0, timeout_s=5, sleep=pauses.append)
    backend.pauses = pauses
    return backend


SACCT_OK = "printf '5|COMPLETED|0:0|00:00:09||vm|None\\n5.batch|COMPLETED|0:0|00:00:09|400K|vm|\\n'"


def test_fake_sacct_hiccups_are_retried_with_backoff(fake, slurm_fast):
    fake.command("sacct", f'if [ $n -le 2 ]; then echo "sacct: error: Socket timed out on send/recv operation" >&2; exit 1; fi\n{SACCT_OK}')
    status = slurm_fast.poll(["5"])["5"]
    assert status.state == "COMPLETED" and status.max_rss_mib == pytest.approx(400 / 1024)
    assert len(fake.calls("sacct")) == 3 and slurm_fast.pauses == [1.0, 2.0]
    assert fake.calls("sacct")[0] == "sacct -P -n -j 5 -o JobID,State,ExitCode,Elapsed,MaxRSS,NodeList,Reason"


def test_fake_sacct_failing_for_good_is_a_scheduler_error(fake, slurm_fast):
    fake.command("sacct", 'echo "sacct: error: Unable to contact slurm controller (connect failure)" >&2; exit 1')
    with pytest.raises(SchedulerError, match=r"^sacct failed 3 times: sacct: error: Unable to contact slurm controller"):
        slurm_fast.poll(["5"])
    assert len(fake.calls("sacct")) == 3 and slurm_fast.pauses == [1.0, 2.0]


def test_fake_sacct_timeout_is_retried(fake):
    fake.command("sacct", f"if [ $n -le 1 ]; then sleep 30; fi\n{SACCT_OK}")
    backend = SlurmBackend(tries=2, backoff_s=0, timeout_s=1)
    assert backend.poll(["5"])["5"].state == "COMPLETED"


def test_fake_accounting_disabled_falls_back_to_squeue_and_scontrol(fake, slurm_fast):
    fake.command("sacct", 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1')
    fake.command("squeue", "printf '5|RUNNING|None|vm|0:42\\n'")
    fake.command("scontrol", """case "$4" in
  6) echo "JobId=6 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 RunTime=00:00:09 NodeList=vm" ;;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
esac""")
    statuses = slurm_fast.poll(["5", "6", "7"])
    assert (statuses["5"].state, statuses["5"].elapsed_s) == ("RUNNING", 42)
    assert (statuses["6"].state, statuses["6"].exit_code) == ("FAILED", 3)
    assert statuses["7"].state == "UNKNOWN" and "accounting unavailable" in statuses["7"].reason
    assert len(fake.calls("sacct")) == 1  # a definite answer: no retries
    assert fake.calls("squeue") == ["squeue -h -t all -j 5,6,7 -o %i|%T|%r|%N|%M"]
    assert fake.calls("scontrol") == ["scontrol show job -o 6", "scontrol show job -o 7"]
    assert slurm_fast.pauses == []


def test_fake_fresh_job_not_yet_in_sacct_is_found_by_squeue(fake, slurm_fast):
    fake.command("sacct", "true")  # slurmdbd has not heard of it yet
    fake.command("squeue", "printf '8|PENDING|Priority||0:00\\n'")
    status = slurm_fast.poll(["8"])["8"]
    assert (status.state, status.reason) == ("PENDING", "Priority")
    assert fake.calls("scontrol") == []


def test_fake_ended_job_not_yet_in_sacct_gets_its_exit_code_from_scontrol(fake, slurm_fast):
    fake.command("sacct", "true")  # slurmdbd is behind (a busy cluster): the job ended but sacct does not list it
    fake.command("squeue", "printf '9|FAILED|NonZeroExitCode|vm|0:03\\n'")
    fake.command("scontrol", 'echo "JobId=9 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 RunTime=00:00:03"')
    status = slurm_fast.poll(["9"])["9"]
    assert (status.state, status.exit_code, status.signal) == ("FAILED", 3, 0)
    assert fake.calls("scontrol") == ["scontrol show job -o 9"]


def test_fake_sbatch_refusal_carries_slurms_message(fake, slurm_fast, tmp_path):
    fake.command("sbatch", 'echo "sbatch: error: invalid partition specified: foo" >&2\n'
                           'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2; exit 1')
    with pytest.raises(SchedulerError) as info:
        slurm_fast.submit(write_job(tmp_path / "a", "true"), tmp_path / "a")
    assert str(info.value) == "sbatch: error: invalid partition specified: foo"
    assert len(fake.calls("sbatch")) == 1  # a refusal is not retried


def test_fake_sbatch_retried_only_when_the_controller_was_never_reached(fake, slurm_fast, tmp_path):
    fake.command("sbatch", 'if [ $n -le 2 ]; then echo "sbatch: error: Batch job submission failed: '
                           'Unable to contact slurm controller (connect failure)" >&2; exit 1; fi; echo "77;testcluster"')
    assert slurm_fast.submit(write_job(tmp_path / "a", "true"), tmp_path / "a") == "77"
    assert len(fake.calls("sbatch")) == 3 and slurm_fast.pauses == [1.0, 2.0]


def test_fake_sbatch_socket_timeout_is_not_retried(fake, slurm_fast, tmp_path):
    # the controller may have queued the job: submitting again could run it twice
    fake.command("sbatch", 'echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1')
    with pytest.raises(MaybeSubmittedError, match="Socket timed out.*may have been queued"):
        slurm_fast.submit(write_job(tmp_path / "a", "true"), tmp_path / "a")
    assert len(fake.calls("sbatch")) == 1


def test_fake_sbatch_never_reaching_the_controller_is_maybe_submitted_not_refused(fake, slurm_fast, tmp_path):
    """After the tries the attempt is not failed: the controller keeps it 'submitting' and tries again later."""
    fake.command("sbatch", 'echo "sbatch: error: Batch job submission failed: Unable to contact slurm controller '
                           '(connect failure)" >&2; exit 1')
    with pytest.raises(MaybeSubmittedError, match="Unable to contact slurm controller.*tried 3 times"):
        slurm_fast.submit(write_job(tmp_path / "a", "true"), tmp_path / "a")
    assert len(fake.calls("sbatch")) == 3


def test_fake_sbatch_that_hangs(fake, tmp_path):
    fake.command("sbatch", "sleep 30")
    backend = SlurmBackend(timeout_s=1)
    with pytest.raises(MaybeSubmittedError, match="may or may not have been submitted"):
        backend.submit(write_job(tmp_path / "a", "true"), tmp_path / "a")


def test_fake_sbatch_sees_a_clean_environment(fake, slurm_fast, tmp_path, monkeypatch):
    for name, value in {"SLURM_JOB_ID": "99", "SLURM_CPUS_PER_TASK": "4", "SBATCH_PARTITION": "a100",
                        "SRUN_CPUS_PER_TASK": "4", "SLURM_CONF": "/etc/slurm/slurm.conf", "KEEP_ME": "yes"}.items():
        monkeypatch.setenv(name, value)
    fake.command("sbatch", f'env > {tmp_path}/sbatch.env; pwd > {tmp_path}/sbatch.cwd; echo 5')
    attempt = tmp_path / "a"
    script = write_job(attempt, "true")
    assert slurm_fast.submit(script, attempt) == "5"
    env = dict(line.split("=", 1) for line in (tmp_path / "sbatch.env").read_text().splitlines() if "=" in line)
    assert not {"SLURM_JOB_ID", "SLURM_CPUS_PER_TASK", "SBATCH_PARTITION", "SRUN_CPUS_PER_TASK"} & set(env)
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and env["KEEP_ME"] == "yes"
    assert (tmp_path / "sbatch.cwd").read_text().strip() == str(attempt)
    assert fake.calls("sbatch") == [f"sbatch --parsable {script}"]


def test_fake_scancel(fake, slurm_fast):
    fake.command("scancel", 'if [ $n -le 1 ]; then echo "scancel: error: Socket timed out on send/recv operation" >&2; exit 1; fi')
    slurm_fast.cancel(["5", "6_2"])
    assert fake.calls("scancel") == ["scancel 5 6_2"] * 2


def test_slurm_job_ids_are_checked_before_reaching_a_command(fake, slurm_fast):
    fake.command("sacct", "true")
    for bad in ["5;rm -rf /", "--format=x", "5 6", ""]:
        with pytest.raises(SchedulerError, match="not a Slurm job id"):
            slurm_fast.poll([bad])
    assert fake.calls() == []
    assert slurm_fast.poll([]) == {}


def test_missing_slurm_commands_are_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(HpcmemError, match="^command not found: sacct$"):
        SlurmBackend().poll(["5"])


# ================================================================ slurm on the real test cluster

needs_slurm = pytest.mark.skipif(
    shutil.which("sinfo") is None,
    reason="Slurm client tools are not installed (no sinfo on PATH); tests/cluster/slurm-up.sh sets up the test cluster",
)


@pytest.fixture
def slurm(slurm_cluster):  # slurm_cluster (tests/conftest.py) starts the test cluster when it is down
    return SlurmBackend(tries=3, backoff_s=1.0)


def small_job(directory: Path, body: str, *directives: str) -> Path:
    """A job for the test cluster's cpu partition, small enough not to queue behind others."""
    return write_job(directory, body, "-p cpu", "--mem=100M", "--time=5", f"--output={directory}/slurm-%j.out",
                     "--job-name=hpcmem-backend-test", *directives)


@pytest.mark.slurm
@needs_slurm
def test_slurm_job_completes(slurm, tmp_path):
    attempt = tmp_path / "attempt-1"
    job_id = slurm.submit(small_job(attempt, "echo hello from slurm; srun true"), attempt)
    assert job_id.isdigit()
    status = wait_for(slurm, job_id)
    assert (status.state, status.exit_code, status.signal) == ("COMPLETED", 0, 0)
    assert status.succeeded and status.node and status.elapsed_s is not None
    assert "hello from slurm" in slurm.log_path(attempt, job_id).read_text()


@pytest.mark.slurm
@needs_slurm
def test_slurm_job_fails_with_its_exit_code(slurm, tmp_path):
    attempt = tmp_path / "attempt-1"
    job_id = slurm.submit(small_job(attempt, "exit 3"), attempt)
    status = wait_for(slurm, job_id)
    assert (status.state, status.exit_code, status.signal) == ("FAILED", 3, 0)


@pytest.mark.slurm
@needs_slurm
def test_slurm_job_over_its_mem_is_out_of_memory(slurm, tmp_path):
    attempt = tmp_path / "attempt-1"
    script = write_job(attempt, "python3 -c \"b = b'x' * (400 * 1024 * 1024); print(len(b))\"", "-p cpu", "--mem=64M",
                       "--time=5", f"--output={attempt}/slurm-%j.out")
    job_id = slurm.submit(script, attempt)
    status = wait_for(slurm, job_id)
    assert status.state == "OUT_OF_MEMORY" and status.signal == 125


@pytest.mark.slurm
@needs_slurm
def test_slurm_refusal_carries_slurms_message(slurm, tmp_path):
    script = small_job(tmp_path / "a", "true", "-p nosuchpartition")
    with pytest.raises(SchedulerError) as info:
        slurm.submit(script, tmp_path / "a")
    assert str(info.value) == "sbatch: error: invalid partition specified: nosuchpartition"
    with pytest.raises(SchedulerError, match="invalid partition specified: nosuchpartition"):
        slurm.test_only(script)


@pytest.mark.slurm
@needs_slurm
def test_slurm_test_only(slurm, tmp_path):
    message = slurm.test_only(small_job(tmp_path / "a", "true"))
    assert message.startswith("sbatch: Job ") and message.endswith("in partition cpu")


@pytest.mark.slurm
@needs_slurm
def test_slurm_cancel(slurm, tmp_path):
    attempt = tmp_path / "attempt-1"
    job_id = slurm.submit(small_job(attempt, "sleep 300"), attempt)
    wait_for(slurm, job_id, done=lambda s: s.state == "RUNNING" or s.finished)
    slurm.cancel([job_id])
    status = wait_for(slurm, job_id, timeout_s=60)
    assert status.state == "CANCELLED" and not status.succeeded
    slurm.cancel([job_id])  # again, once it is over: no error


@pytest.mark.slurm
@needs_slurm
def test_slurm_poll_is_batched_and_knows_unknown_jobs(slurm, tmp_path):
    attempt = tmp_path / "attempt-1"
    job_id = slurm.submit(small_job(attempt, "true"), attempt)
    wait_for(slurm, job_id)
    statuses = slurm.poll([job_id, "99999999"])
    assert statuses[job_id].state == "COMPLETED"
    assert statuses["99999999"].state == "UNKNOWN" and not statuses["99999999"].finished


@pytest.mark.slurm
@needs_slurm
def test_slurm_submit_from_inside_another_job(slurm, tmp_path, monkeypatch):
    """What a calling job leaves in the environment must not redirect or taint the new job."""
    for name, value in {"SLURM_JOB_ID": "424242", "SLURM_JOB_PARTITION": "a100", "SBATCH_PARTITION": "a100",
                        "SLURM_CPUS_PER_TASK": "2", "SRUN_CPUS_PER_TASK": "2", "SLURM_HPCMEM_LEAK": "1"}.items():
        monkeypatch.setenv(name, value)
    attempt = tmp_path / "attempt-1"
    job_id = slurm.submit(small_job(attempt, "env | grep ^SLURM_ | sort"), attempt)
    assert wait_for(slurm, job_id).state == "COMPLETED"
    env = dict(line.split("=", 1) for line in slurm.log_path(attempt, job_id).read_text().splitlines() if "=" in line)
    assert env["SLURM_JOB_PARTITION"] == "cpu"
    assert env["SLURM_JOB_ID"] == job_id
    assert "SLURM_HPCMEM_LEAK" not in env and "SLURM_CPUS_PER_TASK" not in env
