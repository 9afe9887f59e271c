"""The controller's resume rule (pure on recorded attempts): TIMEOUT and PREEMPTED resubmit the same plan to
resume from the checkpoint, as often as the spec allows, only while each attempt saved something newer."""

from toolkit.controller import resume_decision
from toolkit.ledger import AttemptRow
from toolkit.plan import Plan
from toolkit.sites import load_site

CPU = load_site("testcluster").partition("cpu")
PLAN = Plan(gpus_per_node=2, global_batch=8, micro_batch=4)


def attempt(n, state, saved=None, resumed=None, moves=()):
    metrics = {"checkpoint": {"path": f"/c/step-{saved}", "step": saved} if saved else None,
               "resumed_from_step": resumed}
    return AttemptRow(run_id="r", n=n, job_id=str(n), state=state, plan=PLAN.to_dict(), verdict=None, metrics=metrics,
                      decision={"moves": list(moves)}, attempt_dir=f"/nonexistent/attempt-{n}", partition="cpu",
                      exit_code=0, created=0.0, submitted=0.0, finished=0.0, updated=0.0)


def test_a_time_limit_with_a_new_checkpoint_resumes_the_same_plan():
    last = attempt(1, "TIMEOUT", saved=120)
    d = resume_decision({"TIMEOUT": 2, "PREEMPTED": 1}, last, [last], CPU)
    assert d.action == "retry" and d.plan == PLAN and d.moves == ("resume:TIMEOUT",)
    assert "checkpoint of step 120" in d.reason


def test_resumes_are_counted_per_state_and_need_progress():
    first = attempt(1, "TIMEOUT", saved=120)
    second = attempt(2, "TIMEOUT", saved=250, resumed=120, moves=("resume:TIMEOUT",))
    assert resume_decision({"TIMEOUT": 2}, second, [first, second], CPU).action == "retry"
    third = attempt(3, "TIMEOUT", saved=380, resumed=250, moves=("resume:TIMEOUT",))
    used_up = resume_decision({"TIMEOUT": 2}, third, [first, second, third], CPU)
    assert used_up.action == "stop" and "2 resume(s) after TIMEOUT" in used_up.reason
    stuck = attempt(2, "TIMEOUT", saved=120, resumed=120, moves=("resume:TIMEOUT",))
    no_progress = resume_decision({"TIMEOUT": 3}, stuck, [first, stuck], CPU)
    assert no_progress.action == "stop" and "no checkpoint newer than step 120" in no_progress.reason
    never_saved = attempt(1, "PREEMPTED")
    assert resume_decision({"PREEMPTED": 1}, never_saved, [never_saved], CPU).action == "stop"


def test_other_endings_and_a_spec_that_says_zero_are_not_resumed():
    failed = attempt(1, "FAILED", saved=50)
    assert resume_decision({"TIMEOUT": 1}, failed, [failed], CPU) .reason == ""
    late = attempt(1, "TIMEOUT", saved=50)
    assert resume_decision({"TIMEOUT": 0}, late, [late], CPU).action == "stop"
