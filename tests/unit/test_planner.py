"""The planner and the estimator's use by the CLI and the ladder."""

import json
from pathlib import Path

import pytest

from toolkit import planner
from toolkit.classify import JobRecord, classify
from toolkit.estimate import model_ref, spec_model
from toolkit.jobspec import load_spec
from toolkit.ladder import next_plan
from toolkit.plan import Plan
from toolkit.predict import MARGIN, Predictor
from toolkit.sites import load_site
from hpcmem_cli import run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EX = load_site("example-hpc")


def hpcmem(*args, tmp_path):
    return run_cli(*args, home=tmp_path, env={"HF_HOME": str(tmp_path / "hf")}, timeout=120)


@pytest.mark.parametrize("job, part", [("gpt2-clm", "a100-40gb"), ("bert-large-cls", "v100-16gb"),
                                       ("llama-7b-zero3-nvme", "a100-40gb")])
def test_candidates_keep_what_is_learned_and_respect_the_partition(job, part):
    spec = load_spec(job)
    partition = EX.partition(part)
    base = spec.first_plan(partition)
    cands = planner.plan_candidates(spec_model(spec), base, partition, spec.allow)
    assert cands and any(c.plan == base for c in cands)
    for c in cands:
        assert (c.plan.global_batch, c.plan.seq_len, c.plan.world_size) == (base.global_batch, base.seq_len, base.world_size)
        partition.check_plan(c.plan)
        if "optimizer" not in spec.allow:
            assert c.plan.optimizer == base.optimizer
    assert [c.throughput for c in cands] == sorted((c.throughput for c in cands), reverse=True)
    chosen = planner.choose(cands)
    assert chosen is not None and chosen.fits_with_margin()
    assert all(not c.fits_with_margin() for c in cands if c.throughput > chosen.throughput)


def test_speed_model_orders_moves_as_documented():
    a100, v100 = EX.partition("a100-40gb"), EX.partition("v100-16gb")
    base = Plan(global_batch=32, micro_batch=32, precision="fp32")
    assert planner.speed(base.replace(precision="bf16-mixed"), a100) == pytest.approx(1.6 * planner.speed(base, a100))
    assert planner.speed(base.replace(precision="fp16-mixed"), v100) == pytest.approx(2.0 * planner.speed(base, v100))
    assert planner.speed(base.replace(checkpointing=True), a100) < planner.speed(base, a100)
    assert planner.speed(base.replace(micro_batch=8, grad_accum=4), a100) < planner.speed(base, a100)
    offload = base.replace(launcher="deepspeed", zero_stage=2, offload_optimizer="cpu")
    assert planner.speed(offload, a100) < planner.speed(base.replace(launcher="deepspeed", zero_stage=2), a100)


def test_estimate_json_has_the_documented_fields(tmp_path):
    out = hpcmem("estimate", "gpt2-clm", "--site", "example-hpc", "--partition", "a100-40gb", "--json", tmp_path=tmp_path)
    data = json.loads(out.stdout)
    assert {"components", "peak_allocated_mib", "device_used_mib", "host_mib_per_node", "capacity_mib", "fits",
            "headroom_mib"} <= set(data)
    assert set(data["components"]) == {"params", "grads", "optimizer", "activations", "temporaries", "cuda_context",
                                       "allocator_overhead"}
    assert data["capacity_mib"] == 40 * 1024 and data["device_used_mib"] > data["peak_allocated_mib"]


def test_estimate_with_direct_flags_and_offload(tmp_path):
    args = ["estimate", "--model", "llama-7b", "--site", "example-hpc", "--partition", "a100-80gb", "--precision",
            "bf16-mixed", "--checkpointing", "--zero-stage", "3", "--gpus-per-node", "8", "--seq-len", "2048", "--json"]
    plain = json.loads(hpcmem(*args, tmp_path=tmp_path).stdout)
    offloaded = json.loads(hpcmem(*args, "--offload-optimizer", "cpu", "--offload-params", "cpu", tmp_path=tmp_path).stdout)
    assert offloaded["device_used_mib"] < plain["device_used_mib"]
    assert offloaded["host_mib_per_node"] > plain["host_mib_per_node"]
    table = hpcmem(*args[:-1], tmp_path=tmp_path).stdout
    rows = [l.split() for l in table.splitlines() if l.strip().split(" ")[0] in plain["components"]]
    sizes = [float(r[1].replace(",", "")) for r in rows]
    assert sizes == sorted(sizes, reverse=True)  # the people's view: largest component first


@pytest.mark.parametrize("args, needle", [
    (["estimate", "--model", "acme/not-cached", "--site", "local"], "not in the local Hugging Face cache"),
    (["estimate", "--site", "local"], "give a JOB spec or --model"),
    (["estimate", "--model", "bert-large", "--site", "example-hpc", "--partition", "v100-16gb", "--precision",
      "bf16-mixed"], "no bf16"),
])
def test_estimate_bad_input(tmp_path, args, needle):
    out = hpcmem(*args, tmp_path=tmp_path)
    assert out.returncode != 0 and needle in out.stderr


def test_config_with_missing_fields(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    out = hpcmem("estimate", "--model", str(bad), "--site", "local", tmp_path=tmp_path)
    assert out.returncode != 0 and "missing 'n_embd' or 'hidden_size'" in out.stderr


def test_plan_json_marks_the_chosen_plan(tmp_path):
    out = hpcmem("plan", "gpt2-clm", "--site", "example-hpc", "--partition", "v100-16gb", "--set", "precision=fp16-mixed",
                 "--json", tmp_path=tmp_path)
    data = json.loads(out.stdout)
    chosen = data["chosen"]
    assert chosen["fits_with_margin"] and chosen["plan"]["global_batch"] == 256
    assert max(c["relative_throughput"] for c in data["candidates"] if c["fits_with_margin"]) == chosen["relative_throughput"]


def test_estimator_corrects_the_ladder_with_the_stated_numbers():
    """BERT-large fp32 on a V100 fails with a message whose numbers show only part of the need: with the
    estimator as its memory model the ladder goes to a plan predicted to fit in one step (the ladder's own
    model, which only sees the message, stops short; see benchmarks/README.md)."""
    part = load_site("testcluster").partition("v100")
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.31 GiB. GPU 0 has a total capacity of "
           "15.77 GiB of which 189.44 MiB is free. Including non-PyTorch memory, this process has 15.59 GiB memory in "
           "use. Of the allocated memory 14.24 GiB is allocated by PyTorch, and 875.15 MiB is reserved by PyTorch but "
           "unallocated.")
    plan = Plan(global_batch=32, micro_batch=32, seq_len=512, precision="fp32", attention="eager")
    allow = ["alloc_conf", "precision", "attention", "micro_batch", "checkpointing", "zero", "offload"]
    model = model_ref("bert-large", "seq-cls")
    decision = next_plan(plan, classify(JobRecord("FAILED", 1, 0), msg), part, allow=allow,
                         model=model)
    assert decision.action == "retry"
    from toolkit.estimate import estimate
    assert estimate(model, decision.plan, part).fits
    assert decision.plan.global_batch == 32


def test_submit_plan_starts_from_the_planners_choice(tmp_path):
    chosen = json.loads(hpcmem("plan", "quickstart", "--site", "local", "--set", "micro_batch=16", "--json",
                               tmp_path=tmp_path).stdout)["chosen"]["plan"]
    out = hpcmem("submit", "quickstart", "--site", "local", "--set", "micro_batch=16", "--plan", "--json",
                 tmp_path=tmp_path)
    view = json.loads(out.stdout)
    try:
        assert view["attempts"][0]["plan"] == chosen
    finally:
        hpcmem("cancel", view["run_id"], tmp_path=tmp_path)


@pytest.mark.parametrize("job, part", [("bert-large-cls", "v100-16gb"), ("gpt2-clm", "a100-40gb")])
def test_screening_chooses_what_estimating_every_candidate_would(job, part):
    """The quick lower bound only rules plans out: the plan chosen after screening is the one chosen when every
    candidate gets the full allocator replay, and a screened candidate is never reported as fitting."""
    from toolkit.estimate import estimate

    spec, partition = load_spec(job), EX.partition(part)
    plan, model = spec.first_plan(partition), spec_model(spec)
    quick = planner.plan_candidates(model, plan, partition, spec.allow)
    assert any(c.screened for c in quick) and all(not c.fits_with_margin() for c in quick if c.screened)
    one = Predictor(partition, model=model)  # a fresh predictor: every candidate replayed, fit by the one rule
    full = [planner.Candidate(c.plan, estimate(model, c.plan, partition), c.throughput, c.moves,
                              predicted_fit=bool(one.fits(c.plan))) for c in quick]
    for screened, replayed in zip(quick, full):  # the screen is a lower bound of the replayed estimate
        assert screened.estimate.device_used_mib <= replayed.estimate.device_used_mib + 1e-6
    full.sort(key=lambda c: (-c.throughput, c.estimate.device_used_mib))
    assert planner.choose(quick).plan == planner.choose(full).plan


@pytest.mark.parametrize("job, part", [("gpt2-clm", "a100-40gb"), ("bert-large-cls", "v100-16gb"),
                                       ("quickstart", "a100-80gb"), ("llama-7b-zero3-nvme", "a100-40gb")])
def test_the_ladder_and_the_planner_share_one_move_table(job, part):
    """Every move is one entry of ladder.MOVES: the ladder's GPU rungs are its steps, in its order, and the
    planner's candidates are the product of its axes; so every plan one ladder step offers from a plan (more GPUs
    aside: the planner keeps the world size) is among the planner's candidates from that plan."""
    from toolkit import ladder
    from toolkit.classify import Verdict

    assert ladder.GPU_RUNGS == tuple(m.step for m in ladder.MOVES if m.name != "alloc_conf")
    named = {m.name for m in ladder.MOVES} - {"shard"} | {"zero", "fsdp"}
    assert set(ladder.ALLOW_NAMES) - named == {"partition", "mem", "workers"}  # host and partition moves only
    partition = EX.partition(part)
    spec = load_spec(job)
    allow = tuple(ladder.ALLOW_NAMES)
    checked = 0
    for start in (spec.first_plan(partition), spec.first_plan(partition).replace(precision="fp32", attention="eager")):
        try:
            partition.check_plan(start)
        except Exception:
            continue
        cands = set(planner.candidate_plans(start, partition, allow))
        ctx = ladder._Ctx(partition, partition, frozenset(allow), frozenset(), {}, "gpu_oom",
                          ladder.Predictor(partition))
        offered = [p for m in ladder.MOVES if m.values is not None or m.name in ("offload", "nvme")
                   for p in m.step(start, ctx)]
        missing = [ladder.move_names(start, p) for p in offered if p not in cands]
        assert not missing
        checked += len(offered)
    assert checked


@pytest.mark.parametrize("job, part", [("gpt2-clm", "a100-40gb"), ("bert-large-cls", "v100-16gb")])
def test_the_planner_the_ladder_and_triage_agree_on_fit(job, part):
    """One fit rule: for the same plans and model, the planner's fit (a Predictor with no failure), the ladder's
    (_Ctx.fits) and triage's (remedies._score) give the same answers after an OOM that states the card full, and
    on these GPU examples the one rule reproduces the planner's old rule (the estimate fits and keeps MARGIN of the
    capacity free), so moving the planner onto the Predictor changed no choice."""
    from toolkit import ladder
    from toolkit.estimate import estimate
    from toolkit.triage import remedies

    spec, partition = load_spec(job), EX.partition(part)
    base, model = spec.first_plan(partition), spec_model(spec)
    every = planner.plan_candidates(model, base, partition, spec.allow, fitting=10**6)  # screened: failed the screen
    cands = [c for c in every if not c.screened] + [c for c in every if c.screened][::25]
    for c in cands:
        if c.screened:
            assert not c.fits_with_margin() and estimate(model, c.plan, partition).device_used_mib > (1 - MARGIN) * (
                c.estimate.capacity_mib)
            continue
        old_rule = c.estimate.fits and c.estimate.headroom_mib >= MARGIN * c.estimate.capacity_mib
        assert c.fits_with_margin() == old_rule, c.moves
    # a failed plan the estimator also says is over the card: its stated demand does not rescale the estimate
    usable = partition.gpu_mem_gib * 1024.0
    failed = max(planner.candidate_plans(base, partition, spec.allow),
                 key=lambda p: estimate(model, p, partition, allocator_model=False).device_used_mib)
    numbers = {"tried_to_allocate_mib": 64.0, "total_capacity_mib": usable, "free_mib": 32.0}
    pred = Predictor(partition, failed, numbers, model)
    assert estimate(model, failed, partition).device_used_mib >= pred.demand_mib
    ctx = ladder._Ctx(partition, partition, frozenset(spec.allow), frozenset(), numbers, "gpu_oom", pred,
                      pred.target_mib, model, failed)
    triage = {s.plan: s.fits for s in remedies._score([c.plan for c in cands], pred)}
    planned = {c.plan: c.fits_with_margin() for c in cands}
    laddered = {c.plan: ctx.fits(c.plan) for c in cands}
    assert triage == planned and laddered == planned
    assert set(planned.values()) == {True, False}  # both answers occur: the agreement is not vacuous
    # host memory is part of the one rule: a CPU-offload plan whose job gets 1 GiB of host memory has a peak well
    # within the target, and none of the three offers it
    from toolkit import strategies
    from toolkit.plan import with_changes
    starved = with_changes(base, {**strategies.switch_to("deepspeed"), "zero_stage": 2, "offload_optimizer": "cpu",
                                  "mem_mib": 1024})
    assert pred.peak(starved) <= pred.target_mib and not estimate(model, starved, partition).fits
    assert not Predictor(partition, model=model).fits(starved)
    assert not ctx.fits(starved) and not remedies._score([starved], pred)[0].fits


def test_a_model_without_an_sdpa_path_never_gets_sdpa():
    """Gemma 2 has no SDPA path in transformers (its attention soft-caps the scores): an estimate of it under
    SDPA is refused in one line naming what to use, the planner offers no SDPA candidate, and after an OOM the
    ladder's attention rung (eager -> SDPA on a card without flash) is not taken."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from model_configs import TINY_GEMMA2

    from toolkit.errors import ConfigError
    from toolkit.estimate import ModelRef, estimate

    part = load_site("testcluster").partition("v100")  # no flash attention there
    model = ModelRef({**TINY_GEMMA2, "hidden_size": 1024, "num_hidden_layers": 8}, "causal-lm", None, "gemma2")
    eager = Plan(global_batch=64, micro_batch=64, seq_len=2048, precision="fp16-mixed", attention="eager")
    with pytest.raises(ConfigError, match="eager or flash") as err:
        estimate(model, eager.replace(attention="sdpa"), part)
    assert "\n" not in str(err.value)
    allow = ["attention", "micro_batch", "checkpointing"]
    cands = planner.plan_candidates(model, eager, part, allow)
    assert len(cands) > 1 and {c.plan.attention for c in cands} == {"eager"}
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "15.77 GiB of which 189.44 MiB is free.")
    decision = next_plan(eager, classify(JobRecord("FAILED", 1, 0), msg), part, allow=allow, model=model)
    assert decision.action == "retry" and decision.plan.attention == "eager"
    # the same rung is taken for a model that has the path
    llama = ModelRef({**model.config, "model_type": "llama"}, "causal-lm", None, "llama")
    assert next_plan(eager, classify(JobRecord("FAILED", 1, 0), msg), part, allow=["attention"],
                     model=llama).plan.attention == "sdpa"


def test_gemma2_stays_off_sdpa_through_the_controller_the_bigger_partition_and_triage(tmp_path):
    """Every other path that could put Gemma 2 on SDPA: the controller's model for its ladder (probed on a plan the
    model can run), the move to a bigger partition without flash (eager, not sdpa), and triage's remedies (its
    candidates, and the attention it assumes when the job's files do not say)."""
    import dataclasses
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from model_configs import TINY_GEMMA2

    from toolkit import controller
    from toolkit.estimate import ModelRef
    from toolkit.triage import remedies
    from toolkit.triage.picture import fill_plan

    cfg = {**TINY_GEMMA2, "hidden_size": 1024, "num_hidden_layers": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = dataclasses.replace(load_spec("gpt2-clm"), model={"config": str(tmp_path / "config.json"),
                                                             "task": "causal-lm"})
    site = load_site("testcluster")
    v100 = site.partition("v100")
    model = controller._estimator_model(spec, v100)
    assert model is not None and model.config["model_type"] == "gemma2"
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "15.77 GiB of which 189.44 MiB is free.")
    oom = classify(JobRecord("FAILED", 1, 0), msg)
    eager = Plan(global_batch=64, micro_batch=64, seq_len=2048, precision="fp16-mixed", attention="eager")
    decision = next_plan(eager, oom, v100, allow=["attention", "micro_batch", "checkpointing"], model=model)
    assert decision.action == "retry" and decision.plan.attention == "eager"
    # flash on a small card, a bigger one without flash: the move keeps the model runnable
    small = dataclasses.replace(site.partition("a100"), name="a10", gpu_mem_gib=24.0)
    big = dataclasses.replace(v100, name="v100-32", gpu_mem_gib=32.0)
    flash = eager.replace(attention="flash")
    moved = next_plan(flash, classify(JobRecord("FAILED", 1, 0), "torch.OutOfMemoryError: CUDA out of memory."),
                      small, allow=["partition"], bigger=[big], model=model)
    assert moved.action == "retry" and moved.partition.name == "v100-32" and moved.plan.attention == "eager"
    # triage: remedies for an eager job, and for one whose attention nobody stated (eager assumed, said so)
    found = remedies.remedies(oom, eager, v100, model, allow=["attention", "micro_batch", "checkpointing"])
    assert found and {r.plan.attention for r in found if r.plan} == {"eager"}
    knobs = {"micro_batch": 8, "seq_len": 2048, "precision": "fp16-mixed"}
    assert "attention=eager" in fill_plan(knobs, v100, model).assumed
    assert "attention=sdpa" in fill_plan(knobs, v100).assumed  # a model with the path, or none known
    found = remedies.remedies(oom, knobs, v100, model, allow=["micro_batch", "checkpointing"])
    assert found and {r.plan.attention for r in found if r.plan} == {"eager"}


def test_submit_refuses_an_attention_the_model_cannot_run(tmp_path):
    """`hpcmem submit` of a Gemma 2 spec on sdpa (with or without the planner) is one line naming eager and flash,
    before anything is submitted: the job would fail as it builds the model."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from model_configs import TINY_GEMMA2

    (tmp_path / "gemma2.json").write_text(json.dumps(TINY_GEMMA2))
    text = (Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml").read_text()
    text = text.replace('config: "tiny-gpt2"', f'config: "{tmp_path / "gemma2.json"}"')
    assert str(tmp_path / "gemma2.json") in text
    (tmp_path / "gemma2.yaml").write_text(text)
    for extra in ((), ("--plan",)):
        out = hpcmem("submit", str(tmp_path / "gemma2.yaml"), "--site", "local", *extra, tmp_path=tmp_path)
        assert out.returncode != 0 and "eager or flash" in out.stderr and out.stderr.strip().count("\n") == 0
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
