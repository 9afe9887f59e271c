"""The OOM-retry controller end to end: real Slurm cgroup OOM and real PyTorch allocator errors come back
by themselves; non-OOM failures are not retried; hopeless jobs give up; killing the controller anywhere
never loses or duplicates a Slurm job (checked against sacct)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A job that needs NEED_MIB of real (touched) memory whatever the plan: a fast OOM under a small --mem.
# (It is started by torchrun like every job, which itself needs ~0.35 GiB resident, ~1 GiB of address space.)
MEM_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    mib = int(os.environ.get("NEED_MIB", "1500"))
    block = bytearray(mib * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(1)
    print("done", mib)
    """)


from hpcmem_cli import run_cli as hpcmem  # noqa: E402


def mem_spec(tmp_path, mem_mib=1000, allow="[mem]", max_attempts=4, need_mib=1200):
    (tmp_path / "need_mem.py").write_text(MEM_SCRIPT)
    spec = tmp_path / "needs-memory.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: needs-memory
        command: {{script: need_mem.py}}
        gpus_per_node: 1
        mem_mib: {mem_mib}
        training: {{global_batch: 4, micro_batch: 4}}
        retry: {{max_attempts: {max_attempts}, allow: {allow}}}
        env: {{NEED_MIB: "{need_mib}"}}
        """))
    return spec


@pytest.mark.slurm
def test_cgroup_oom_on_the_cpu_partition_comes_back_and_succeeds(slurm_cluster, tmp_path):
    spec = tmp_path / "clm.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: tiny-clm-too-big
        command:
          module: toolkit.train
          args: [--model, "{REPO}/jobs/models/tiny-gpt2.json", --task, causal-lm, --steps, "2", --warmup-steps, "0"]
        gpus_per_node: 1
        mem_mib: 1200
        training: {{global_batch: 64, micro_batch: 64, seq_len: 512, attention: eager}}
        """))
    result = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--wait", "--json",
                    "--interval", "1", home=tmp_path)
    view = json.loads(result.stdout)
    attempts = view["attempts"]
    assert attempts[0]["state"] == "OUT_OF_MEMORY" and attempts[0]["verdict"]["kind"] == "host_oom"
    assert result.returncode == 0 and view["state"] == "succeeded", json.dumps(view, indent=1)[-3000:]
    assert attempts[-1]["state"] == "COMPLETED"
    # the host OOM states no numbers, but --mem was the limit: the estimate jumps, at most one more attempt fails
    assert sum(a["state"] != "COMPLETED" for a in attempts[1:]) <= 1, [a["decision"]["moves"] for a in attempts[1:]]
    assert {a["plan"]["global_batch"] for a in attempts} == {64}
    assert all(a["decision"]["moves"] for a in attempts[1:])
    assert json.loads((Path(attempts[-1]["attempt_dir"]) / "metrics.json").read_text())["peak_rss_mib"] > 0
    runs = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path, check=True).stdout)
    assert [a["verdict"]["kind"] for a in runs["attempts"]][:1] == ["host_oom"]


def test_a_non_memory_failure_is_not_retried(tmp_path):
    (tmp_path / "broken.py").write_text("raise ValueError('bad learning rate schedule')\n")
    spec = tmp_path / "broken.yaml"
    spec.write_text("name: broken\ncommand: {script: broken.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.2", home=tmp_path)
    view = json.loads(result.stdout)
    assert result.returncode == 1 and view["state"] == "failed"
    (attempt,) = view["attempts"]
    assert attempt["verdict"]["kind"] == "not_oom"
    assert "not retried" in view["reason"] and "ValueError" in view["reason"]


def test_a_job_that_can_never_fit_gives_up_with_a_reason(tmp_path):
    spec = mem_spec(tmp_path, mem_mib=1500, allow="[micro_batch]", max_attempts=3, need_mib=4000)
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.2", home=tmp_path)
    view = json.loads(result.stdout)
    assert result.returncode == 1 and view["state"] == "gave_up", json.dumps(view, indent=1)[-2000:]
    assert 1 <= len(view["attempts"]) <= 3
    assert view["reason"]


def test_a_spec_that_allows_no_moves_gives_up_after_one_attempt(tmp_path):
    spec = mem_spec(tmp_path, mem_mib=1500, allow="[]", max_attempts=5, need_mib=4000)
    result = hpcmem("submit", str(spec), "--site", "local", "--wait", "--json", "--interval", "0.2", home=tmp_path)
    view = json.loads(result.stdout)
    assert view["state"] == "gave_up" and len(view["attempts"]) == 1


def sacct_jobs(run_id):
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-S", "now-3hours", "-o", "JobID,JobName%200"],
                         capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|", 1)) for line in out.splitlines() if f".{run_id}.a" in line]


@pytest.mark.slurm
@pytest.mark.parametrize("point", ["after_plan", "before_sbatch", "after_sbatch", "after_poll", "after_decide"])
def test_killed_controller_resumes_without_losing_or_duplicating_jobs(slurm_cluster, tmp_path, point):
    spec = mem_spec(tmp_path)
    killed = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--wait", "--interval", "0.5",
                    home=tmp_path, env={"HPCMEM_FAULT": point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    finished = hpcmem("watch", run["run_id"], "--interval", "0.5", home=tmp_path)
    view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path, check=True).stdout)
    assert finished.returncode == 0 and view["state"] == "succeeded", json.dumps(view, indent=1)[-3000:]
    assert_jobs_match_sacct(view)


def assert_jobs_match_sacct(view):
    time.sleep(4)  # sacct lags slurmctld by a few seconds
    ledger_ids = [a["job_id"] for a in view["attempts"]]
    jobs = sacct_jobs(view["run_id"])
    names = [name for _, name in jobs]
    assert len(names) == len(set(names)), f"an attempt was submitted twice: {jobs}"
    assert sorted(ledger_ids) == sorted(j for j, _ in jobs), (ledger_ids, jobs)


@pytest.mark.slurm
def test_controller_killed_at_random_moments_many_times(slurm_cluster, tmp_path):
    spec = mem_spec(tmp_path)
    rng = random.Random(7)
    env = {**os.environ, "HPCMEM_HOME": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "submit", str(spec), "--site", "testcluster",
                              "--partition", "cpu", "--wait", "--interval", "0.3"], env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(0.5, 2.0))
    first.kill()
    first.wait()
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    kills = 1
    for _ in range(25):
        view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path, check=True).stdout)
        if view["state"] != "running":
            break
        watcher = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "watch", run["run_id"], "--interval", "0.3",
                                    "--quiet"], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 2.5))
        if watcher.poll() is None:
            watcher.send_signal(signal.SIGKILL)
            kills += 1
        watcher.wait()
    hpcmem("watch", run["run_id"], "--interval", "0.3", "--quiet", home=tmp_path)
    view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path, check=True).stdout)
    assert view["state"] == "succeeded" and kills >= 3, (kills, view["state"])
    assert_jobs_match_sacct(view)


@pytest.mark.slurm
def test_two_tickers_at_once_submit_each_attempt_once(slurm_cluster, tmp_path):
    spec = mem_spec(tmp_path)
    hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", home=tmp_path, check=True)
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    env = {**os.environ, "HPCMEM_HOME": str(tmp_path)}
    deadline = time.time() + 300
    while time.time() < deadline:
        pair = [subprocess.Popen([sys.executable, "-m", "toolkit.cli", "tick"], env=env, cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
        for p in pair:
            p.wait()
        view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path, check=True).stdout)
        if view["state"] != "running":
            break
        time.sleep(0.5)
    assert view["state"] == "succeeded"
    assert_jobs_match_sacct(view)


@pytest.mark.slurm
def test_cancel_stops_the_job_in_flight(slurm_cluster, tmp_path):
    (tmp_path / "sleepy.py").write_text("import time\ntime.sleep(300)\n")
    spec = tmp_path / "sleepy.yaml"
    spec.write_text("name: sleepy\ncommand: {script: sleepy.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", home=tmp_path, check=True)
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    view = json.loads(hpcmem("cancel", run["run_id"], "--json", home=tmp_path, check=True).stdout)
    assert view["state"] == "cancelled" and view["attempts"][0]["state"] == "CANCELLED"
    job_id = view["attempts"][0]["job_id"]
    for _ in range(50):
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if not state or state in ("CANCELLED", "COMPLETED"):
            break
        time.sleep(0.2)
    assert state in ("", "CANCELLED")


def wait_for_end(run_id, home, timeout_s=300):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        view = json.loads(hpcmem("runs", run_id, "--json", home=home, check=True).stdout)
        if view["state"] != "running":
            return view
        time.sleep(1)
    raise AssertionError(f"run {run_id} still running after {timeout_s} s")


@pytest.mark.slurm
def test_detach_hands_the_loop_to_a_slurm_job(slurm_cluster, tmp_path):
    spec = mem_spec(tmp_path)
    out = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--detach", home=tmp_path,
                 check=True).stdout
    assert "controller detached" in out
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    view = wait_for_end(run["run_id"], tmp_path)  # nobody ticks here: the controller job does
    assert view["state"] == "succeeded" and len(view["attempts"]) == 2
    names = [n for _, n in (tuple(l.split("|", 1)) for l in subprocess.run(
        ["sacct", "-n", "-X", "-P", "-S", "now-1hour", "-o", "JobID,JobName%200"], capture_output=True, text=True
    ).stdout.splitlines())]
    assert f"hpcmem-controller.{run['run_id']}" in names


def test_detach_locally_runs_a_background_watcher(tmp_path):
    spec = mem_spec(tmp_path, mem_mib=1500, need_mib=3000)
    hpcmem("submit", str(spec), "--site", "local", "--detach", home=tmp_path, check=True)
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    view = wait_for_end(run["run_id"], tmp_path)
    assert view["state"] == "succeeded" and len(view["attempts"]) >= 2
    assert view["attempts"][0]["verdict"]["kind"] == "cpu_alloc_oom"


@pytest.mark.slurm
def test_a_job_slurm_forgot_is_marked_lost_not_retried(slurm_cluster, tmp_path, monkeypatch):
    """A job id the scheduler never heard of (or forgot) becomes LOST after HPCMEM_LOST_AFTER_S."""
    from toolkit import controller, runs
    from toolkit.jobspec import load_spec
    from toolkit.sites import load_site

    site = load_site("testcluster")
    part = site.partition("cpu")
    spec = load_spec(mem_spec(tmp_path))
    with runs.open_ledger(tmp_path) as ledger:
        run = runs.create_run(ledger, spec, site, part, spec.first_plan(part), home=tmp_path)
        ledger.update_attempt(run.run_id, 1, state="PENDING", job_id="987654", submitted=time.time() - 10)
        assert controller.tick(ledger, run.run_id).state == "running"  # not yet: Slurm may just be slow
        monkeypatch.setenv("HPCMEM_LOST_AFTER_S", "5")
        after = controller.tick(ledger, run.run_id)
        assert after.state == "failed" and "no longer knows job 987654" in after.reason
        assert ledger.attempts(run.run_id)[0].state == "LOST"


@pytest.mark.slurm
def test_detached_controller_requeues_itself_on_its_time_limit(slurm_cluster, tmp_path):
    """The controller job gets a 2-minute limit (the shortest it takes); the run's job outlives it; submitit
    requeues the controller (warned 30 s before its limit, which Slurm may bring up to 60 s earlier, never before
    the handler is up) and the requeued controller finishes the run."""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(150)\nprint('done')\n")
    spec = tmp_path / "slow.yaml"
    spec.write_text("name: slow\ncommand: {script: slow.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    out = hpcmem("submit", str(spec), "--site", "testcluster", "--partition", "cpu", "--detach", home=tmp_path,
                 env={"HPCMEM_CONTROLLER_TIME_MIN": "2"}, check=True).stdout
    assert "controller detached" in out
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path, check=True).stdout)
    view = wait_for_end(run["run_id"], tmp_path, timeout_s=600)
    assert view["state"] == "succeeded"
    name = f"hpcmem-controller.{run['run_id']}"
    lines = subprocess.run(["sacct", "-n", "-P", "-D", "-S", "now-1hour", f"--name={name}", "-X", "-o", "JobID,State"],
                           capture_output=True, text=True).stdout.splitlines()
    assert len(lines) >= 2, lines  # -D shows every start of the requeued job


# ---------------------------------------------------------------- the record decides (issue 10)


def recorded_spec(tmp_path, mem_mib, need_mib):
    """A spec in its own directory, its script relative to it, an argument naming {spec_dir}."""
    (tmp_path / "project").mkdir()
    spec = mem_spec(tmp_path / "project", mem_mib=mem_mib, allow="[mem]", max_attempts=4, need_mib=need_mib)
    text = spec.read_text().replace("command: {script: need_mem.py}",
                                    'command: {script: need_mem.py, args: [--tag, original, "{spec_dir}/data"]}')
    spec.write_text(text)
    return spec


@pytest.mark.parametrize("site", ["local", pytest.param("testcluster", marks=pytest.mark.slurm)])
@pytest.mark.parametrize("change", ["edit", "delete"])
def test_the_run_goes_on_as_recorded_when_the_users_spec_changes(request, tmp_path, site, change):
    """Editing or deleting the user's spec after submit changes nothing: later attempts read runs/<id>/spec.yaml
    (allow, max_attempts, arguments), and its relative script and {spec_dir} still mean the spec's directory."""
    if site == "testcluster":
        request.getfixturevalue("slurm_cluster")
        args, mem, need = ["--partition", "cpu"], 1000, 1200
    else:
        args, mem, need = [], 1500, 3000
    spec = recorded_spec(tmp_path, mem, need)
    original = spec.read_text()
    hpcmem("submit", str(spec), "--site", site, *args, home=tmp_path / "home", check=True)
    (run,) = json.loads(hpcmem("runs", "--json", home=tmp_path / "home", check=True).stdout)
    if change == "edit":  # a run that may not retry at all, with other arguments
        spec.write_text(original.replace("allow: [mem]", "allow: []").replace("max_attempts: 4", "max_attempts: 1")
                        .replace("original", "edited"))
    else:
        spec.unlink()
    hpcmem("watch", run["run_id"], "--interval", "0.5", "--quiet", home=tmp_path / "home")
    view = json.loads(hpcmem("runs", run["run_id"], "--json", home=tmp_path / "home", check=True).stdout)
    assert view["state"] == "succeeded" and len(view["attempts"]) >= 2, json.dumps(view, indent=1)[-3000:]
    assert all("mem" in " ".join(a["decision"]["moves"]) for a in view["attempts"][1:])
    run_dir = Path(view["run_dir"])
    assert (run_dir / "spec.yaml").read_text() == original
    last_script = (Path(view["attempts"][-1]["attempt_dir"]) / "job.sbatch").read_text()
    assert "original" in last_script and "edited" not in last_script
    assert str(spec.parent / "need_mem.py") in last_script and f"{spec.parent}/data" in last_script


# ---------------------------------------------------------------- "maybe submitted" is a type, not a message


def _local_run(tmp_path, monkeypatch, backend):
    from toolkit import controller, runs
    from toolkit.jobspec import load_spec
    from toolkit.sites import load_site

    monkeypatch.setenv("HPCMEM_HOME", str(tmp_path))
    monkeypatch.setattr(controller, "get_backend", lambda name, **kw: backend)
    (tmp_path / "ok.py").write_text("print('ok')\n")
    spec_file = tmp_path / "ok.yaml"
    spec_file.write_text("name: ok\ncommand: {script: ok.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    site = load_site("local")
    part = site.partition(None)
    spec = load_spec(spec_file)
    ledger = runs.open_ledger(tmp_path)
    return ledger, runs.create_run(ledger, spec, site, part, spec.first_plan(part), home=tmp_path)


def test_a_maybe_submitted_attempt_stays_submitting_and_its_job_is_found_by_name(tmp_path, monkeypatch):
    from toolkit import controller
    from toolkit.backends import LocalBackend
    from toolkit.errors import MaybeSubmittedError

    class Unheard(LocalBackend):
        """The job is submitted, but the answer never reaches hpcmem (as when sbatch times out)."""

        def submit(self, script, attempt_dir):
            super().submit(script, attempt_dir)
            raise MaybeSubmittedError("sbatch did not answer within 60 s")

    ledger, run = _local_run(tmp_path, monkeypatch, Unheard(state_dir=tmp_path / "local"))
    with ledger:
        with pytest.raises(MaybeSubmittedError):
            controller.tick(ledger, run.run_id)
        (attempt,) = ledger.attempts(run.run_id)
        assert attempt.state == "submitting" and ledger.run(run.run_id).state == "running"
        controller.tick(ledger, run.run_id)  # looks the job up instead of submitting again
        (attempt,) = ledger.attempts(run.run_id)
        assert attempt.job_id == "local-1" and attempt.state == "PENDING"
        assert controller.follow(ledger, run.run_id, interval_s=0.2, timeout_s=120).state == "succeeded"
    assert [p.name for p in (tmp_path / "local" / "jobs").glob("local-*.json")] == ["local-1.json"]


def test_a_submission_uncertain_for_too_long_is_lost_not_retried_for_ever(tmp_path, monkeypatch):
    from toolkit import controller
    from toolkit.backends import LocalBackend
    from toolkit.errors import MaybeSubmittedError

    class Unreachable(LocalBackend):
        def submit(self, script, attempt_dir):
            raise MaybeSubmittedError("Unable to contact slurm controller (tried 3 times)")

    ledger, run = _local_run(tmp_path, monkeypatch, Unreachable(state_dir=tmp_path / "local"))
    monkeypatch.setenv("HPCMEM_LOST_AFTER_S", "0.5")
    with ledger:
        with pytest.raises(MaybeSubmittedError):
            controller.tick(ledger, run.run_id)
        time.sleep(0.6)
        after = controller.tick(ledger, run.run_id)
        assert after.state == "failed" and "could not be submitted" in after.reason
        assert ledger.attempts(run.run_id)[0].state == "LOST"


@pytest.mark.parametrize("config", ["models/tiny.json", "{spec_dir}/models/tiny.json"])
def test_the_recorded_spec_resolves_its_paths_as_at_submission(tmp_path, monkeypatch, config):
    """runs.spec_for reads runs/<id>/spec.yaml; its script, {spec_dir} and model config still mean the user's
    spec directory when that file is gone and the controller runs from elsewhere (cron, a detached watcher)."""
    import shutil

    from toolkit import runs
    from toolkit.jobspec import load_spec
    from toolkit.sites import load_site

    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "models" / "tiny-gpt2.json", project / "models" / "tiny.json")
    (project / "train.py").write_text("print('x')\n")
    spec_file = project / "s.yaml"
    spec_file.write_text(textwrap.dedent(f"""\
        name: s
        command: {{script: train.py, args: ["{{spec_dir}}/out"]}}
        model: {{config: "{config}"}}
        gpus_per_node: 1
        training: {{global_batch: 1}}
        """))
    monkeypatch.chdir(project)  # as `hpcmem submit s.yaml` from the project directory
    site = load_site("local")
    part = site.partition(None)
    spec = load_spec(spec_file)
    with runs.open_ledger(tmp_path / "home") as ledger:
        run = runs.create_run(ledger, spec, site, part, spec.first_plan(part), home=tmp_path / "home")
    spec_file.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recorded = runs.spec_for(run)
    assert recorded.path == Path(run.run_dir) / "spec.yaml"
    assert recorded.script == project / "train.py" and recorded.spec_dir == project
    assert recorded.model["config"] == str(project / "models" / "tiny.json")
    assert recorded.argv(spec.first_plan(part), {"plan_json": "p", "ds_config": "d", "attempt_dir": "a"})[-1] == \
        f"{project}/out"
    from toolkit.estimate import spec_model

    assert spec_model(recorded).config["model_type"] == "gpt2"
    (Path(run.run_dir) / "spec.yaml").unlink()
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="its recorded spec .* is missing"):
        runs.spec_for(run)
