"""Resume across attempts on the real test cluster (issue 14, docs/resume.md).

A two-rank job on the cpu partition saves every 2 steps; from step 5 rank 0 really allocates 1200 MiB
(``--oom-at-step 5 --oom-kind fixed --oom-mib 1200``) and the cgroup's OOM killer ends the job
(OUT_OF_MEMORY). The controller's retry (more --mem, the only move allowed) resumes from the step-4 save:
the state it loaded is bitwise the state an uninterrupted run of the same job saved at step 4 (a sha256 of the
gathered model and optimizer state, ``--checkpoint-digest``), and its step-6 save is bitwise the uninterrupted
run's step-6 save (RNG and data position restored too).
"""

import json
import textwrap
from pathlib import Path

import pytest

from hpcmem_cli import run_cli as hpcmem

REPO = Path(__file__).resolve().parents[2]

def spec_text(name, launcher, extra_args="", zero=None, mem_mib=2000, allow="mem"):
    args = ["--model", f"{REPO}/jobs/models/tiny-gpt2.json", "--task", "causal-lm", "--steps", "6",
            "--warmup-steps", "0", "--checkpoint-every-steps", "2", "--checkpoint-digest", *extra_args.split()]
    zero_line = f", zero_stage: {zero}" if zero is not None else ""
    return textwrap.dedent(f"""\
        name: {name}
        command:
          module: toolkit.train
          args: {json.dumps(args)}
        launcher: {launcher}
        gpus_per_node: 2
        mem_mib: {mem_mib}
        time: "00:10:00"
        training: {{global_batch: 8, micro_batch: 4, seq_len: 64{zero_line}}}
        retry: {{max_attempts: 3, allow: [{allow}]}}
        """)


def submit(tmp_path, name, text, site=("--site", "testcluster", "--partition", "cpu")):
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(text)
    result = hpcmem("submit", str(spec), *site, "--wait", "--json", "--interval", "1", home=tmp_path / "home",
                    timeout=600, env={"MALLOC_ARENA_MAX": "2"})
    view = json.loads(result.stdout)
    logs = "\n".join(p.read_text()[-2500:] for a in view["attempts"] for p in Path(a["attempt_dir"]).glob("slurm-*.out"))
    return result, view, logs


def one_minute_spec(name, train_args, retry):
    """A one-rank tiny GPT-2 job with a 1-minute limit on the cpu partition."""
    args = ["--model", f"{REPO}/jobs/models/tiny-gpt2.json", "--task", "causal-lm", "--warmup-steps", "0", *train_args]
    return textwrap.dedent(f"""\
        name: {name}
        command:
          module: toolkit.train
          args: {json.dumps(args)}
        gpus_per_node: 1
        mem_mib: 2000
        time: "00:01:00"
        training: {{global_batch: 2, micro_batch: 2, seq_len: 32}}
        retry: {retry}
        """)


def marker(run_dir, step):
    return json.loads((Path(run_dir) / "checkpoints" / f"step-{step:08d}" / "complete").read_text())


@pytest.mark.slurm
@pytest.mark.parametrize("launcher,zero", [("torchrun", None), ("fsdp", None), ("deepspeed", 2)])
def test_a_cgroup_oom_retry_resumes_at_the_saved_step_with_identical_state(slurm_cluster, tmp_path, launcher, zero):
    ref_result, ref, ref_logs = submit(tmp_path, f"ref-{launcher}", spec_text(f"ref-{launcher}", launcher, zero=zero))
    assert ref_result.returncode == 0 and ref["state"] == "succeeded", ref_logs
    oom_args = "--oom-at-step 5 --oom-rank 0 --oom-kind fixed --oom-mib 1200"
    result, view, logs = submit(tmp_path, f"oom-{launcher}", spec_text(f"oom-{launcher}", launcher, oom_args, zero))
    first, *rest = view["attempts"]
    assert first["state"] == "OUT_OF_MEMORY" and first["verdict"]["kind"] == "host_oom", logs
    assert result.returncode == 0 and view["state"] == "succeeded", logs
    last = rest[-1]
    assert last["state"] == "COMPLETED" and last["plan"]["mem_mib"] > first["plan"]["mem_mib"]

    runs = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path / "home", check=True).stdout)
    shown = {a["n"]: a for a in runs["attempts"]}
    assert shown[1]["resumed_from_step"] is None and shown[1]["checkpoint"]["step"] == 4, logs
    assert shown[len(shown)]["resumed_from_step"] == 4
    assert shown[len(shown)]["checkpoint"]["step"] == 6

    metrics = json.loads((Path(last["attempt_dir"]) / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 4 and metrics["steps"] == 2  # steps 5 and 6 only
    # the state the retry loaded is the uninterrupted run's at step 4, and both end bitwise equal at step 6
    assert metrics["resume"]["digest"] == marker(ref["run_dir"], 4)["digest"]
    assert marker(view["run_dir"], 4)["digest"] == marker(ref["run_dir"], 4)["digest"]
    assert marker(view["run_dir"], 6)["digest"] == marker(ref["run_dir"], 6)["digest"]
    assert set(metrics["resume"]["digest"]) == {"model", "optimizer"}  # DeepSpeed's too: gathered per name


@pytest.mark.slurm
def test_a_cgroup_oom_under_zero2_retried_as_zero3_resumes_with_identical_state(slurm_cluster, tmp_path):
    """DeepSpeed ZeRO-2 -> ZeRO-3 with conversion. The spec allows only ``zero``, so the retry of a cgroup OOM is
    the stage change (same --mem). The rehearsal is armed per layout through a plan placeholder:
    ``--oom-at-step 1{zero_stage}`` is step 12 under ZeRO-2 (the last one: the job dies in it, after the step-8
    save) and step 13 under ZeRO-3 (never reached). The ZeRO-3 retry loads the ZeRO-2 save through its full
    copy (DeepSpeed's tensor-fragment API) and holds bitwise the model and optimizer state an uninterrupted
    ZeRO-2 run saved at step 8. (From there ZeRO-3 reduces gradients in another order: its step 12 is not bitwise
    ZeRO-2's; tests/integration/test_runtime.py compares them to float32 rounding.)"""
    steps = "--steps 12 --checkpoint-every-steps 4"
    ref_result, ref, ref_logs = submit(tmp_path, "ref-zero2", spec_text("ref-zero2", "deepspeed", steps, zero=2))
    assert ref_result.returncode == 0 and ref["state"] == "succeeded", ref_logs
    oom_args = f"{steps} --oom-at-step 1{{zero_stage}} --oom-rank 0 --oom-kind fixed --oom-mib 1200"
    result, view, logs = submit(tmp_path, "oom-zero2", spec_text("oom-zero2", "deepspeed", oom_args, zero=2,
                                                                 allow="zero"))
    first, *rest = view["attempts"]
    assert first["state"] == "OUT_OF_MEMORY" and first["plan"]["zero_stage"] == 2, logs
    assert result.returncode == 0 and view["state"] == "succeeded" and len(rest) == 1, logs
    (last,) = rest
    assert last["state"] == "COMPLETED" and last["plan"]["zero_stage"] == 3
    assert last["plan"]["mem_mib"] == first["plan"]["mem_mib"]

    runs = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path / "home", check=True).stdout)
    shown = {a["n"]: a for a in runs["attempts"]}
    assert shown[1]["checkpoint"]["step"] == 8 and shown[2]["resumed_from_step"] == 8, logs
    metrics = json.loads((Path(last["attempt_dir"]) / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 8 and metrics["steps"] == 4  # steps 9-12 only
    assert metrics["resume"]["from_layout"]["zero_stage"] == 2
    assert set(metrics["resume"]["digest"]) == {"model", "optimizer"}
    assert marker(view["run_dir"], 8)["digest"] == marker(ref["run_dir"], 8)["digest"]
    assert metrics["resume"]["digest"] == marker(ref["run_dir"], 8)["digest"]


@pytest.mark.slurm
def test_a_job_saves_before_its_time_limit_on_slurm(slurm_cluster, tmp_path):
    """A 1-minute job that would train for hours: the runtime's own clock saves before the limit (no signal
    needed), Slurm ends it with TIMEOUT, and the run shows the save. (Retrying a TIMEOUT is the controller's
    decision.) Slurm's USR1 warning (``--signal=B:USR1@20``) may come up to a minute early (seen 13-26 s into a
    1-minute job), so the clock's margin here is 55 s: its save comes first, a signal save may follow."""
    text = one_minute_spec("out-of-time", ["--steps", "1000000", "--checkpoint-margin-s", "55"],
                           "{max_attempts: 1, resume: {TIMEOUT: 0}}")  # one attempt: its saves alone
    result, view, logs = submit(tmp_path, "out-of-time", text)
    first = view["attempts"][0]
    assert first["state"] == "TIMEOUT", logs
    runs = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path / "home", check=True).stdout)
    saved = runs["attempts"][0]["checkpoint"]
    assert saved and saved["step"] > 0, logs
    reasons = [json.loads(m.read_text())["reason"] for m in (Path(view["run_dir"]) / "checkpoints").glob("step-*/complete")]
    assert reasons and reasons.count("time-limit") == 1, (reasons, logs)
    assert set(reasons) <= {"time-limit", "signal"}, reasons


@pytest.mark.slurm
def test_slurm_s_time_limit_warning_reaches_the_trainer_and_it_saves(slurm_cluster, tmp_path):
    """The rendered script asks for ``--signal=B:USR1@20`` (a 1-minute limit) and runs torchrun in the background:
    Slurm's USR1 reaches the batch shell's trap, which writes the save request, and the trainer saves with reason
    ``signal``. The runtime's own deadline save is pushed to 1 s before the limit (``--checkpoint-margin-s 1``),
    so the save comes from the signal, not from the clock."""
    text = one_minute_spec("usr1", ["--steps", "1000000", "--checkpoint-margin-s", "1"],
                           "{max_attempts: 1, resume: {TIMEOUT: 0}}")
    result, view, logs = submit(tmp_path, "usr1", text)
    (attempt,) = view["attempts"]
    assert attempt["state"] == "TIMEOUT", logs
    script = (Path(attempt["attempt_dir"]) / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@20" in script
    full_log = "".join(p.read_text() for p in Path(attempt["attempt_dir"]).glob("slurm-*.out"))  # `logs`: tails
    assert "save requested" in full_log and "(signal)" in full_log, logs
    reasons = [json.loads(m.read_text())["reason"] for m in (Path(view["run_dir"]) / "checkpoints").glob("step-*/complete")]
    assert "signal" in reasons, (reasons, logs)


@pytest.mark.slurm
def test_activations_oom_is_answered_by_a_smaller_micro_batch_that_resumes(slurm_cluster, tmp_path):
    """``--oom-kind activations`` scales with the micro-batch: 450 MiB a sample is 1800 MiB at micro-batch 4 (over
    --mem 2600 with two ranks), 900 MiB at 2. The retry (micro-batch 2 x 2, the same global batch) resumes from
    the step-4 save with the state an uninterrupted micro-batch-4 run had there."""
    ref_result, ref, ref_logs = submit(tmp_path, "ref-act", spec_text("ref-act", "torchrun", mem_mib=2600))
    assert ref_result.returncode == 0 and ref["state"] == "succeeded", ref_logs
    oom_args = "--oom-at-step 5 --oom-rank 0 --oom-kind activations --oom-mib 450"
    result, view, logs = submit(tmp_path, "oom-act", spec_text("oom-act", "torchrun", oom_args, mem_mib=2600,
                                                               allow="micro_batch"))
    first, *rest = view["attempts"]
    assert first["state"] == "OUT_OF_MEMORY", logs
    assert result.returncode == 0 and view["state"] == "succeeded", logs
    last = rest[-1]
    assert last["plan"]["micro_batch"] < first["plan"]["micro_batch"]
    assert last["plan"]["global_batch"] == first["plan"]["global_batch"]
    metrics = json.loads((Path(last["attempt_dir"]) / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 4 and metrics["steps"] == 2
    assert metrics["resume"]["digest"] == marker(ref["run_dir"], 4)["digest"]


def test_in_job_recovery_is_one_job_and_the_run_shows_the_move(tmp_path):
    """The local backend caps a job's address space at its --mem: an activations OOM at step 3 is answered in the
    job (in-job recovery is on by default): one attempt, COMPLETED, the same global batch, the move in hpcmem runs."""
    args = ["--model", f"{REPO}/jobs/models/tiny-gpt2.json", "--task", "causal-lm", "--steps", "4",
            "--warmup-steps", "0", "--oom-at-step", "3", "--oom-mib", "400"]
    text = textwrap.dedent(f"""\
        name: in-job
        command:
          module: toolkit.train
          args: {json.dumps(args)}
        gpus_per_node: 1
        mem_mib: 2000
        env: {{MALLOC_ARENA_MAX: "2"}}
        training: {{global_batch: 8, micro_batch: 4, seq_len: 64}}
        retry: {{max_attempts: 2}}
        """)
    result, view, logs = submit(tmp_path, "in-job", text, site=("--site", "local"))
    assert result.returncode == 0 and view["state"] == "succeeded", logs
    (attempt,) = view["attempts"]
    assert attempt["state"] == "COMPLETED"
    runs = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path / "home", check=True).stdout)
    (move,) = runs["attempts"][0]["inflight_moves"]
    assert move["step"] == 3 and move["to"]["micro_batch"] == 2 and move["global_batch"] == 8
    text = hpcmem("runs", view["run_id"], home=tmp_path / "home", check=True).stdout
    assert "in-job move at step 3" in text and "micro_batch 4 -> 2" in text and "grad_accum 2 -> 4" in text, text
    (finding,) = json.loads(hpcmem("triage", view["run_id"], "--format", "json", home=tmp_path / "home",
                                   check=True).stdout)["findings"]
    assert finding["inflight_moves"] == runs["attempts"][0]["inflight_moves"]
    assert any("in-job recovery answered" in n for n in finding["notes"]), finding["notes"]


@pytest.mark.slurm
def test_a_one_minute_job_finishes_over_several_attempts_each_continuing_the_last(slurm_cluster, tmp_path):
    """Training that needs longer than its 1-minute limit: each attempt saves before the limit, Slurm ends it with
    TIMEOUT, and the controller resubmits the same plan (retry.resume), which resumes where the last one saved."""
    # 2000 steps of at least 50 ms: 100 s of training on any machine, so it needs two or three 1-minute attempts
    text = one_minute_spec("long-run", ["--steps", "2000", "--min-step-s", "0.05"],
                           "{max_attempts: 1, resume: {TIMEOUT: 8}}")
    result, view, logs = submit(tmp_path, "long-run", text)
    attempts = view["attempts"]
    assert result.returncode == 0 and view["state"] == "succeeded", logs
    assert len(attempts) >= 2 and all(a["state"] == "TIMEOUT" for a in attempts[:-1]), logs
    assert attempts[-1]["state"] == "COMPLETED"
    shown = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path / "home", check=True).stdout)["attempts"]
    for before, after in zip(shown, shown[1:]):
        assert after["decision"]["moves"] == ["resume:TIMEOUT"] and after["plan"] == before["plan"]
        assert after["resumed_from_step"] == before["checkpoint"]["step"] > (before["resumed_from_step"] or 0), logs


@pytest.mark.slurm
def test_in_job_recovery_on_the_test_cluster_is_one_slurm_job(slurm_cluster, tmp_path):
    """A forced OOM at step 3 on two ranks answered inside a Slurm job: the job's python runs under an address-space
    cap (``ulimit -v``, so the allocator raises its own error in the process, as CUDA's allocator does on a GPU; the
    cpu partition's cgroup would SIGKILL instead). One Slurm job, COMPLETED, the same global batch, step 3 re-run at
    micro-batch 2 x 2, the move shown by ``hpcmem runs``."""
    import sys

    wrapper = tmp_path / "python-capped"
    wrapper.write_text(f"#!/bin/bash\nulimit -v {2000 * 1024}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    args = ["--model", f"{REPO}/jobs/models/tiny-gpt2.json", "--task", "causal-lm", "--steps", "4",
            "--warmup-steps", "0", "--oom-at-step", "3", "--oom-mib", "400"]
    text = textwrap.dedent(f"""\
        name: in-job-slurm
        command:
          module: toolkit.train
          python: {json.dumps(str(wrapper))}
          args: {json.dumps(args)}
        gpus_per_node: 2
        mem_mib: 6000
        env: {{MALLOC_ARENA_MAX: "2"}}
        training: {{global_batch: 8, micro_batch: 4, seq_len: 64}}
        retry: {{max_attempts: 2, allow: [micro_batch]}}
        """)
    result, view, logs = submit(tmp_path, "in-job-slurm", text)
    assert result.returncode == 0 and view["state"] == "succeeded", logs
    (attempt,) = view["attempts"]
    assert attempt["state"] == "COMPLETED" and attempt["job_id"] and not attempt["job_id"].startswith("local")
    assert "in-job move" in logs and "step 4/4" in logs
    runs = json.loads(hpcmem("runs", view["run_id"], "--json", home=tmp_path / "home", check=True).stdout)
    (move,) = runs["attempts"][0]["inflight_moves"]
    assert move["step"] == 3 and move["verdict"]["kind"] == "cpu_alloc_oom" and move["global_batch"] == 8
    assert move["from"]["micro_batch"] == 4 and (move["to"]["micro_batch"], move["to"]["grad_accum"]) == (2, 2)
    assert runs["attempts"][0]["plan"]["micro_batch"] == 4  # the attempt's plan stays; the move says what changed
