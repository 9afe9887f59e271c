"""The controller's gate on how sure a host OOM is (pure): a lone SIGKILL is retried with a memory move only
when the scheduler's record agrees (sacct MaxRSS near the job's --mem)."""

from toolkit.classify import JobRecord, classify
from toolkit.controller import HOST_CONFIRM_SHARE, host_oom_confirmed
from toolkit.plan import Plan

SIGKILL_LOG = """\
[2024-05-01 10:00:00] step 120/1000 loss 2.31
WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 4242 closing signal SIGTERM
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 4241) of binary: /usr/bin/python3
"""


def lone_sigkill(**numbers):
    verdict = classify(None, SIGKILL_LOG)
    assert verdict.kind == "host_oom" and verdict.confidence == "medium", verdict
    from dataclasses import replace

    return replace(verdict, numbers={**verdict.numbers, **numbers})


def test_a_lone_sigkill_is_retried_only_when_maxrss_reached_the_limit():
    ok, why = host_oom_confirmed(lone_sigkill(max_rss_mib=7900.0), 8192)
    assert ok and why == ""
    ok, why = host_oom_confirmed(lone_sigkill(max_rss_mib=2000.0), 8192)
    assert not ok and "2000 MiB of the 8192 MiB --mem" in why
    ok, why = host_oom_confirmed(lone_sigkill(), 8192)
    assert not ok and "no MaxRSS" in why
    ok, why = host_oom_confirmed(lone_sigkill(max_rss_mib=8000.0), None)
    assert not ok
    assert HOST_CONFIRM_SHARE * 8192 <= 7900


def test_what_the_record_already_confirms_is_never_held_back():
    cgroup = classify(JobRecord(state="OUT_OF_MEMORY", exit_code=0, signal=125), SIGKILL_LOG)
    assert cgroup.kind == "host_oom" and cgroup.confidence == "high"
    assert host_oom_confirmed(cgroup, 8192) == (True, "")
    gpu = classify(None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB "
                         "total capacity; 14.50 GiB already allocated; 2.00 MiB free; 14.90 GiB reserved in total by "
                         "PyTorch)")
    assert gpu.is_oom and host_oom_confirmed(gpu, None) == (True, "")
    assert host_oom_confirmed(classify(None, "ValueError: bad shape"), None) == (True, "")


# -- the next plan starts from what the job's in-job moves left (docs/resume.md "In-job recovery") --

def _run_with_in_job_moves(tmp_path, moves):
    """A real ledger and run on the test cluster's cpu partition whose attempt 1 (micro-batch 64) ended in a cgroup
    OOM after the in-job moves ``moves``; returns (ledger, run, site)."""
    import textwrap

    from toolkit import runs
    from toolkit.jobspec import load_spec
    from toolkit.sites import load_site

    spec_path = tmp_path / "clm.yaml"
    spec_path.write_text(textwrap.dedent("""\
        name: clm
        command: {module: toolkit.train, args: [--steps, "8"]}
        gpus_per_node: 1
        mem_mib: 1200
        training: {global_batch: 64, micro_batch: 64, seq_len: 512}
        retry: {allow: [micro_batch, mem]}
        """))
    site = load_site("testcluster")
    part = site.partition("cpu")
    spec = load_spec(spec_path)
    ledger = runs.open_ledger(tmp_path / "home")
    run = runs.create_run(ledger, spec, site, part, spec.first_plan(part), home=tmp_path / "home")
    verdict = classify(JobRecord(state="OUT_OF_MEMORY", exit_code=0, signal=125), SIGKILL_LOG)
    ledger.update_attempt(run.run_id, 1, state="OUT_OF_MEMORY", exit_code=0, verdict=verdict.to_dict(),
                          metrics={"status": "failed", "inflight_moves": moves, "checkpoint": None})
    return ledger, run, site


def _in_job_move(step, frm, to):
    return {"step": step, "verdict": {"kind": "cpu_alloc_oom", "reason": "RuntimeError: ... can't allocate memory"},
            "from": {"micro_batch": frm, "grad_accum": 64 // frm, "checkpointing": False},
            "to": {"micro_batch": to, "grad_accum": 64 // to, "checkpointing": False}, "global_batch": 64}


def test_the_next_plan_starts_from_the_in_job_moves_not_the_attempts_first_plan(tmp_path):
    from toolkit.controller import _decide, ended_plan

    moves = [_in_job_move(3, 64, 32), _in_job_move(5, 32, 16)]
    ledger, run, site = _run_with_in_job_moves(tmp_path, moves)
    with ledger:
        (last,) = ledger.attempts(run.run_id)
        assert Plan.from_dict(last.plan).micro_batch == 64
        ended = ended_plan(last)
        assert (ended.micro_batch, ended.grad_accum, ended.global_batch) == (16, 4, 64)
        _decide(ledger, ledger.run(run.run_id), last, site)
        first, second = ledger.attempts(run.run_id)
    plan = Plan.from_dict(second.plan)
    assert plan.global_batch == 64 and plan.micro_batch <= 16, second.decision
    # the moves are named from the plan the job ended with (micro-batch 16), never from the 64 that failed in the job
    assert not any("64->" in m or "32->" in m for m in second.decision["moves"]), second.decision
    assert plan.micro_batch * plan.grad_accum == 64


def test_without_in_job_moves_the_next_plan_starts_from_the_attempts_plan(tmp_path):
    from toolkit.controller import _decide

    ledger, run, site = _run_with_in_job_moves(tmp_path, None)
    with ledger:
        (last,) = ledger.attempts(run.run_id)
        _decide(ledger, ledger.run(run.run_id), last, site)
        _, second = ledger.attempts(run.run_id)
    assert Plan.from_dict(second.plan).global_batch == 64
    assert Plan.from_dict(second.plan).micro_batch in (64, 32), second.decision


def test_a_time_limit_resume_keeps_the_plan_the_in_job_moves_left():
    from toolkit.controller import resume_decision
    from toolkit.ledger import AttemptRow
    from toolkit.sites import load_site

    cpu = load_site("testcluster").partition("cpu")
    plan = Plan(global_batch=64, micro_batch=64, grad_accum=1)
    metrics = {"checkpoint": {"path": "/c/step-120", "step": 120}, "resumed_from_step": None,
               "inflight_moves": [_in_job_move(3, 64, 32)]}
    last = AttemptRow(run_id="r", n=1, job_id="1", state="TIMEOUT", plan=plan.to_dict(), verdict=None, metrics=metrics,
                      decision=None, attempt_dir="/nonexistent/attempt-1", partition="cpu", exit_code=0, created=0.0,
                      submitted=0.0, finished=0.0, updated=0.0)
    d = resume_decision({"TIMEOUT": 1}, last, [last], cpu)
    assert d.action == "retry" and (d.plan.micro_batch, d.plan.grad_accum, d.plan.global_batch) == (32, 2, 64)
