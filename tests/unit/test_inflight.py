"""In-job recovery's pure parts (toolkit/runtime/inflight.py): the switch, the moves in order, the plan an attempt
ended with, and the spec's ``retry.inflight`` reaching the rendered job. The moves on real processes and real
allocator errors: tests/integration/test_runtime.py and test_resume.py."""

import textwrap

import pytest

from toolkit.errors import ConfigError
from toolkit.jobspec import load_spec
from toolkit.plan import Plan
from toolkit.runtime import inflight

PLAN = Plan(gpus_per_node=2, global_batch=48, micro_batch=12, grad_accum=2)


def test_the_switch_is_on_unless_the_environment_turns_it_off():
    assert inflight.enabled({}) and inflight.enabled({"HPCMEM_INFLIGHT": "1"}) and inflight.enabled({"HPCMEM_INFLIGHT": " on"})
    assert not inflight.enabled({"HPCMEM_INFLIGHT": "0"}) and not inflight.enabled({"HPCMEM_INFLIGHT": "False"})
    with pytest.raises(ConfigError, match="HPCMEM_INFLIGHT='maybe': expected true or false"):
        inflight.enabled({"HPCMEM_INFLIGHT": "maybe"})


def test_the_helper_follows_the_jobs_switch_unless_told(monkeypatch):
    monkeypatch.setenv("HPCMEM_INFLIGHT", "0")
    assert not inflight.Recovery(PLAN).enabled and inflight.Recovery(PLAN, enabled=True).enabled
    monkeypatch.delenv("HPCMEM_INFLIGHT")
    assert inflight.Recovery(PLAN).enabled and not inflight.Recovery(PLAN, enabled=False).enabled
    calls = []
    assert inflight.Recovery(PLAN, enabled=False).run_step(1, lambda plan: calls.append(plan) or "done") == "done"
    assert calls == [PLAN]


def test_the_micro_batch_goes_down_to_a_divisor_keeping_the_global_batch():
    # 24 samples per rank: 12 -> 6 -> 3; 15 -> 5 (7 does not divide 15)
    assert inflight.smaller_micro_batch(PLAN) == 6
    assert inflight.smaller_micro_batch(PLAN.replace(micro_batch=6, grad_accum=4)) == 3
    assert inflight.smaller_micro_batch(Plan(global_batch=15, micro_batch=15, grad_accum=1)) == 5  # 7 does not divide
    assert inflight.smaller_micro_batch(Plan(global_batch=8, micro_batch=1, grad_accum=8)) is None


def test_after_micro_batch_one_checkpointing_then_nothing():
    one = Plan(global_batch=8, micro_batch=1, grad_accum=8)
    assert inflight.next_move(PLAN, can_checkpoint=True) == {"micro_batch": 6}
    assert inflight.next_move(one, can_checkpoint=True) == {"checkpointing": True}
    assert inflight.next_move(one, can_checkpoint=False) is None
    assert inflight.next_move(one.replace(checkpointing=True), can_checkpoint=True) is None


def move(frm: Plan, to: Plan) -> dict:
    return {"step": 3, "verdict": {"kind": "gpu_oom", "reason": "x"},
            "from": {k: getattr(frm, k) for k in inflight.MOVE_KNOBS},
            "to": {k: getattr(to, k) for k in inflight.MOVE_KNOBS}, "global_batch": to.global_batch}


def test_the_plan_an_attempt_ended_with_is_its_last_moves_to():
    six = PLAN.replace(micro_batch=6, grad_accum=4)
    three = PLAN.replace(micro_batch=3, grad_accum=8)
    assert inflight.plan_after_moves(PLAN, None) == PLAN and inflight.plan_after_moves(PLAN, []) == PLAN
    assert inflight.plan_after_moves(PLAN, [move(PLAN, six), move(six, three)]) == three
    ckpt = three.replace(checkpointing=True)
    assert inflight.plan_after_moves(PLAN, [move(PLAN, six), move(six, three), move(three, ckpt)]) == ckpt
    # an older record (no checkpointing key) still applies its micro-batch and accumulation
    old = {"to": {"micro_batch": 6, "grad_accum": 4}}
    assert inflight.plan_after_moves(PLAN, [old]) == six
    # a record that would change the global batch is not ours: ignored
    assert inflight.plan_after_moves(PLAN, [{"to": {"micro_batch": 6, "grad_accum": 1}}]) == PLAN


SPEC = """\
name: s
command: {module: toolkit.train}
training: {global_batch: 8}
"""


def test_the_spec_switch_reaches_the_jobs_environment(tmp_path):
    on = tmp_path / "on.yaml"
    on.write_text(SPEC)
    assert load_spec(on).inflight and "HPCMEM_INFLIGHT" not in dict(load_spec(on).env)
    off = tmp_path / "off.yaml"
    off.write_text(SPEC + "retry: {inflight: false}\nenv: {X: '1'}\n")
    spec = load_spec(off)
    assert not spec.inflight and spec.env == (("HPCMEM_INFLIGHT", "0"), ("X", "1"))
    from toolkit import render
    from toolkit.sites import load_site

    part = load_site("local").partition(None)
    script = render.render_attempt(spec, part, spec.first_plan(part), tmp_path / "a1").script.read_text()
    assert "export HPCMEM_INFLIGHT=0" in script
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPEC + "retry: {inflight: sometimes}\n")
    with pytest.raises(ConfigError, match="inflight"):
        load_spec(bad)


USER_LOOP = r'''
import json, resource, sys
import torch
from toolkit.plan import Plan
from toolkit.runtime import inflight

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
gen = torch.Generator().manual_seed(1)
plan = Plan(global_batch=8, micro_batch=int(sys.argv[1]), grad_accum=8 // int(sys.argv[1]))
cap = int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
held = []

def micro_batches(plan):
    for _ in range(plan.grad_accum):
        x = torch.randn(plan.micro_batch, 16, generator=gen)
        # like activations: 400 MiB a sample, really allocated and written, held to the end of the backward
        held.append(torch.ones(plan.micro_batch * 100 * 2**20, dtype=torch.float32))
        loss = model(x).pow(2).sum() / plan.global_batch
        loss.backward()
        held.clear()

recovery = inflight.Recovery(plan, enabled=True)
state = recovery.capture(gen)
recovery.run_step(1, micro_batches, discard=lambda: (model.zero_grad(set_to_none=True), held.clear()),
                  rewind=lambda: recovery.restore(state, gen))
print(json.dumps({"grad": model.weight.grad.flatten().tolist(), "moves": recovery.moves,
                  "plan": [recovery.plan.micro_batch, recovery.plan.grad_accum]}))
'''


def test_a_plain_pytorch_loop_recovers_from_the_allocators_own_error_with_the_same_gradient(tmp_path):
    """A user's loop with Recovery.run_step under a real address-space cap: micro-batch 4 cannot allocate its
    "activations" (the CPU allocator's own error), 2 can; the step is re-run from the same data, and the gradient
    is the one a straight run at micro-batch 2 x 4 computes (the same global batch, the same samples)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "loop.py"
    script.write_text(USER_LOOP)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "MALLOC_ARENA_MAX": "2", "PATH": "/usr/bin:/bin"}

    def run(micro):
        done = subprocess.run([sys.executable, str(script), str(micro), "2000"], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    recovered, straight = run(4), run(2)
    (move,) = recovered["moves"]
    assert "can't allocate memory" in move["verdict"]["reason"] and move["verdict"]["kind"] == "cpu_alloc_oom"
    assert move["from"]["micro_batch"] == 4 and move["to"] == {"micro_batch": 2, "grad_accum": 4, "checkpointing": False}
    assert recovered["plan"] == [2, 4] and straight["moves"] == []
    assert recovered["grad"] == straight["grad"]


@pytest.mark.parametrize("case, moved", [("leak", False), ("long_batch", True), (None, True)])
def test_a_leak_in_the_step_series_is_not_answered_inside_the_job(case, moved):
    """A smaller micro-batch only postpones a leak: with the series showing one, the OOM ends the job (the
    controller then gives up with the code remedy); any other case is answered with the next move."""
    from toolkit.peaks import PeakDiagnosis

    tries = []

    def step(plan):
        tries.append(plan.micro_batch)
        if plan.micro_batch == 12:
            raise MemoryError("out of memory")
        return "done"

    recovery = inflight.Recovery(PLAN, enabled=True, data_peak=lambda: PeakDiagnosis(case))
    if moved:
        assert recovery.run_step(7, step) == "done"
        assert tries == [12, 6] and recovery.plan.micro_batch == 6 and recovery.plan.global_batch == 48
    else:
        with pytest.raises(MemoryError):
            recovery.run_step(7, step)
        assert tries == [12] and recovery.plan == PLAN
