"""toolkit.predict: the one memory predictor the ladder, the planner, triage's remedies and the controller share,
and the fragmentation-aware fit (issue 11 item 2) as the ladder, triage and the CLI use it. Verdicts built
directly or classified from literal messages, on the shipped site profiles and model configs; the estimates
are the analytic ones with the caching-allocator replay. Pure: no torch, no Slurm (the CLI in a subprocess)."""

import json

import pytest

from toolkit import ladder, planner, predict
from toolkit.classify import Verdict
from toolkit.estimate import estimate, model_ref
from toolkit.jobspec import DEFAULT_ALLOW
from toolkit.plan import Plan
from toolkit.predict import ACTIVATION_SHARES, EXPANDABLE, MARGIN, Predictor, footprint, predicted_peak_mib
from toolkit.sites import load_site
from toolkit.triage import remedies as remedies_mod
from toolkit.triage.remedies import remedies
from hpcmem_cli import run_cli

EX = load_site("example-hpc")
V100 = EX.partition("v100-16gb")
A100 = EX.partition("a100-40gb")
GPT2 = model_ref("gpt2")

FP32 = Plan(global_batch=64, micro_batch=32, grad_accum=2, seq_len=512, precision="fp32", attention="eager")
NUMBERS = {"tried_to_allocate_mib": 4096.0, "total_capacity_mib": 16384.0, "free_mib": 1024.0,
           "process_in_use_mib": 15360.0, "allocated_by_pytorch_mib": 13900.0, "reserved_unallocated_mib": 600.0}
FRAG = Plan(global_batch=32, micro_batch=32, seq_len=512, precision="fp32", attention="eager")
"""GPT-2 fp32, eager attention, micro-batch 32 on an A100-40GB: the allocator model says its tensors fit (about
37.7 GiB allocated) but its reserved peak (about 40.0 GiB) does not; expandable segments make it fit."""


def test_one_margin_everywhere():
    assert ladder.MARGIN is predict.MARGIN and planner.MARGIN is predict.MARGIN and MARGIN == 0.10
    assert not hasattr(remedies_mod, "_Predictor")  # the duplicate predictor is gone
    import toolkit.estimate as est
    assert not hasattr(est, "saving_model")


def test_numbers_only_takes_the_larger_peak_over_the_shares_and_gives_idle_back():
    pred = Predictor(V100, FP32, NUMBERS)
    new = FP32.replace(precision="fp16-mixed")
    prints = [footprint(FP32, NUMBERS, V100.cuda_context_mib, share=s) for s in ACTIVATION_SHARES]
    assert pred.peak(new) == pytest.approx(max(predicted_peak_mib(fp, new) for fp in prints))
    assert pred.demand_mib == pytest.approx(15360.0 + 4096.0)
    # the idle reserved memory (600 MiB stated) is given back by newly setting expandable segments, only then
    expandable = FP32.replace(alloc_conf=EXPANDABLE)
    assert pred.peak(FP32) - pred.peak(expandable) == pytest.approx(600.0)
    # the target: usable x (1 - MARGIN), below the failed plan's demand
    assert pred.target_mib == pytest.approx(min(16384.0 * 0.9, pred.demand_mib - 1.0))
    assert pred.fits(new) == (pred.peak(new) <= pred.target_mib)
    # other models and sequence lengths are beyond the numbers alone; so is a plan with nothing stated
    assert pred.peak(FP32.replace(seq_len=256)) is None and pred.peak(FP32, GPT2) is None
    assert Predictor(V100, FP32, {}).peak(new) is None and not Predictor(V100, FP32, {}).predicts


def test_model_known_scales_the_estimate_by_the_stated_demand():
    pred = Predictor(V100, FP32, NUMBERS, GPT2)
    before = estimate(GPT2, FP32, V100).device_used_mib
    scale = max(1.0, (15360.0 + 4096.0) / before)
    new = FP32.replace(precision="fp16-mixed", micro_batch=8, grad_accum=8)
    assert pred.peak(new) == pytest.approx(estimate(GPT2, new, V100).device_used_mib * scale)
    # expandable segments: the demand it is scaled from loses the idle 600 MiB
    exp = new.replace(alloc_conf=EXPANDABLE)
    exp_scale = max(1.0, (15360.0 + 4096.0 - 600.0) / before)
    assert pred.peak(exp) == pytest.approx(estimate(GPT2, exp, V100).device_used_mib * exp_scale)
    # no numbers (a driver OOM): the failed plan needed at least the usable memory
    blind = Predictor(V100, FP32, {}, GPT2)
    assert blind.demand_mib == V100.gpu_mem_gib * 1024
    # no failure at all (planning): the estimate as it is
    plain = Predictor(A100, model=GPT2)
    assert plain.peak(FP32) == pytest.approx(estimate(GPT2, FP32, A100).device_used_mib)
    p = plain.predict(FRAG)
    assert p.fragmentation_only and p.alloc_conf_fix == EXPANDABLE and p.peak_reserved_mib > 0


def test_fragmented_reads_the_stated_idle_cache_first_then_the_allocator_model():
    # idle 2.5 GiB + free 0.1 GiB cover the 1 GiB request: the allocator's failure (classify's rule), any model
    idle = {"tried_to_allocate_mib": 1024.0, "total_capacity_mib": 16384.0, "free_mib": 100.0,
            "process_in_use_mib": 16200.0, "allocated_by_pytorch_mib": 13000.0, "reserved_unallocated_mib": 2500.0}
    assert predict.idle_could_serve(idle) and Predictor(V100, FP32, idle).fragmented()
    # the message states a small idle cache: not fragmentation, and the estimate does not overrule it
    assert not Predictor(A100, FRAG, {**idle, "reserved_unallocated_mib": 300.0}, GPT2).fragmented()
    # no idle cache stated (a driver OOM): the allocator model of the failed plan decides
    assert Predictor(A100, FRAG, {}, GPT2).fragmented()
    assert not Predictor(A100, FRAG.replace(micro_batch=8, grad_accum=4), {}, GPT2).fragmented()
    assert not Predictor(A100, FRAG, {}).fragmented()  # neither numbers nor model: cannot say


def test_ladder_offers_the_allocator_move_first_when_the_allocator_model_says_fragmentation():
    """A driver OOM states no numbers; the allocator model says the failed plan's tensors fit and its reserved
    peak does not, so the ladder's first move is expandable segments (then on, as the prediction needs)."""
    d = ladder.next_plan(FRAG, Verdict("gpu_driver_oom", {}), A100, allow=DEFAULT_ALLOW, model=GPT2)
    assert d.action == "retry" and d.moves[0] == "alloc_conf:expandable_segments:True"
    assert d.predicted_peak_mib <= A100.gpu_mem_gib * 1024 * (1 - MARGIN)
    assert d.predicted_peak_mib == pytest.approx(Predictor(A100, FRAG, ladder.limit_numbers(FRAG, A100, False),
                                                           GPT2).peak(d.plan))
    # without the model, nothing says it is the allocator's: no allocator move
    plain = ladder.next_plan(FRAG, Verdict("gpu_driver_oom", {}), A100, allow=DEFAULT_ALLOW)
    assert "alloc_conf:expandable_segments:True" not in plain.moves
    # a plain gpu_oom whose numbers show an idle cache that covered the request: the allocator move first
    idle = {"tried_to_allocate_mib": 1024.0, "total_capacity_mib": 16384.0, "free_mib": 100.0,
            "process_in_use_mib": 16200.0, "allocated_by_pytorch_mib": 13000.0, "reserved_unallocated_mib": 2500.0}
    d = ladder.next_plan(FP32, Verdict("gpu_oom", idle), V100, allow=DEFAULT_ALLOW)
    assert d.moves == ("alloc_conf:expandable_segments:True",)


def test_remedies_give_the_allocator_setting_when_the_idle_cache_could_have_served_the_request():
    plan = Plan(gpus_per_node=4, global_batch=128, micro_batch=8, grad_accum=4, seq_len=1024, precision="fp32",
                attention="eager", time_min=240)
    idle = {"tried_to_allocate_mib": 1024.0, "total_capacity_mib": 16147.0, "free_mib": 100.0,
            "process_in_use_mib": 16000.0, "allocated_by_pytorch_mib": 12800.0, "reserved_unallocated_mib": 2600.0}
    out = remedies(Verdict("gpu_oom", idle), plan, V100, GPT2)  # kind not fragmentation: the numbers say it
    assert out[0].moves == ("alloc_conf:expandable_segments:True",) and out[0].slowdown == pytest.approx(1.0)
    assert "alloc_conf=expandable_segments:True" in out[0].set_args
    small = {**idle, "reserved_unallocated_mib": 200.0, "allocated_by_pytorch_mib": 15200.0}
    out = remedies(Verdict("gpu_oom", small), plan, V100, GPT2)
    assert out and all(r.moves[:1] != ("alloc_conf:expandable_segments:True",) for r in out)


def test_planner_adds_the_allocator_move_to_a_fragmentation_only_candidate():
    cands = planner.plan_candidates(GPT2, FRAG, A100, ["alloc_conf", "micro_batch"])
    base = next(c for c in cands if c.plan == FRAG)
    assert base.estimate.fragmentation_only and not base.fits_with_margin()
    data = base.to_dict()
    assert data["fit"] == "fragmentation_only" and data["fragmentation_only"] is True
    assert data["alloc_conf_env"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert data["peak_reserved_mib"] > data["peak_allocated_mib"] and 0 < data["fragmentation"] < 1
    fixed = next(c for c in cands if c.plan == FRAG.replace(alloc_conf=EXPANDABLE))
    assert fixed.moves == ("alloc_conf:expandable_segments:True",) and fixed.throughput == base.throughput
    assert fixed.estimate.fits and not fixed.estimate.fragmentation_only
    # not allowed: no allocator candidate, still reported
    cands = planner.plan_candidates(GPT2, FRAG, A100, ["micro_batch"])
    assert all(EXPANDABLE not in c.plan.alloc_conf for c in cands)


FRAG_ARGS = ["--model", "gpt2", "--site", "example-hpc", "--partition", "a100-40gb", "--precision", "fp32",
             "--attention", "eager", "--seq-len", "512", "--micro-batch", "32"]


def test_estimate_reports_a_fragmentation_only_plan_with_its_allocator_setting(tmp_path):
    out = run_cli("estimate", *FRAG_ARGS, "--json", home=tmp_path, check=True)
    data = json.loads(out.stdout)
    assert data["fit"] == "fragmentation_only" and data["fragmentation_only"] and not data["fits"]
    assert data["alloc_conf_env"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert data["alloc_conf_set"] == "alloc_conf=expandable_segments:True"
    assert data["peak_allocated_mib"] < data["peak_reserved_mib"] and data["fragmentation"] > 0
    text = run_cli("estimate", *FRAG_ARGS, home=tmp_path, check=True).stdout
    assert "peak reserved" in text and "FITS ONLY WITH THE ALLOCATOR SETTING" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes it fit" in text
    # a plan that fits outright says so, without the allocator line
    ok = json.loads(run_cli("estimate", *FRAG_ARGS[:-1], "8", "--json", home=tmp_path, check=True).stdout)
    assert ok["fit"] == "fits" and ok["alloc_conf_env"] is None


def test_plan_reports_fragmentation_only_candidates(tmp_path):
    sets = ["--set", "precision=fp32", "--set", "attention=eager", "--set", "seq_len=512", "--set", "micro_batch=32",
            "--set", "global_batch=128"]
    args = ["plan", "gpt2-clm", "--site", "example-hpc", "--partition", "a100-40gb", *sets]
    data = json.loads(run_cli(*args, "--json", home=tmp_path, check=True).stdout)
    base = next(c for c in data["candidates"] if c["moves"] == [])
    assert base["fit"] == "fragmentation_only" and not base["fits_with_margin"]
    assert base["alloc_conf_env"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert any(c["moves"] == ["alloc_conf:expandable_segments:True"] and c["fits"] for c in data["candidates"])
    text = run_cli(*args, "--top", "3", home=tmp_path, check=True).stdout
    assert "reserved" in text.splitlines()[1] and "alloc:" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes it fit" in text


def test_the_controller_hands_the_specs_model_to_the_ladders_predictor():
    """The controller's only memory-model decision: the spec's model when the estimator reads it on a GPU
    partition (the predictor then scales the estimate by the numbers), else None (numbers only)."""
    from toolkit import controller
    from toolkit.jobspec import load_spec

    spec = load_spec("gpt2-clm")
    ref = controller._estimator_model(spec, A100)
    assert ref is not None and ref.config["n_layer"] == 12
    assert controller._estimator_model(spec, load_site("testcluster").partition("cpu")) is None


def test_on_a_cpu_partition_the_ladder_scales_the_numbers_alone_even_with_a_model():
    """The estimate's figure is device memory: a host OOM on a CPU partition climbs on --mem with the numbers-only
    model whether or not the model is given."""
    cpu = load_site("testcluster").partition("cpu")
    plan = Plan(gpus_per_node=2, global_batch=64, micro_batch=32, grad_accum=1, seq_len=512, mem_mib=6144)
    allow = ("micro_batch", "checkpointing", "fsdp")
    with_model = ladder.next_plan(plan, Verdict("host_oom", {}), cpu, allow=allow, model=GPT2)
    alone = ladder.next_plan(plan, Verdict("host_oom", {}), cpu, allow=allow)
    assert with_model.action == "retry" and with_model.plan == alone.plan
    assert with_model.predicted_peak_mib == alone.predicted_peak_mib <= 6144 / 2 * (1 - MARGIN)


def test_fit_with_the_model_known_is_the_margin_and_the_estimates_own_checks():
    """The planner's fit (Predictor.fits(plan), no failure): the peak within usable x (1 - MARGIN) and the estimate's
    own checks; a CPU-offload plan whose job gets too little host memory (--mem 1 GiB) has a peak far below the
    target but does not fit, and fits again with the partition's host memory."""
    from toolkit import strategies
    from toolkit.plan import with_changes

    base = Plan(global_batch=32, micro_batch=8, grad_accum=4, seq_len=512, precision="bf16-mixed", attention="sdpa")
    offload = with_changes(base, {**strategies.switch_to("deepspeed"), "zero_stage": 2, "offload_optimizer": "cpu"})
    starved = offload.replace(mem_mib=1024)
    pred = Predictor(A100, model=GPT2)
    assert pred.target_for(starved) == pred.target_mib == A100.gpu_mem_gib * 1024 * (1 - MARGIN)
    assert pred.fits(pred.peak(starved)) and not estimate(GPT2, starved, A100).fits
    assert pred.fits(starved) is False and pred.predict(starved).fits is False
    assert pred.fits(offload) is True


def test_on_a_cpu_partition_the_planners_target_is_the_ranks_share_of_the_jobs_host_memory():
    """No GPU: the target is the plan's share of the job's host memory (--mem, else the partition's default) over
    its ranks x (1 - MARGIN), with the model known; the numbers-only predictor still says nothing there."""
    cpu = load_site("testcluster").partition("cpu")
    plan = Plan(global_batch=8, micro_batch=2, grad_accum=2, seq_len=128, gpus_per_node=2)
    pred = Predictor(cpu, model=GPT2)
    assert pred.target_mib is None
    assert pred.target_for(plan) == pytest.approx(cpu.default_mem_mib / 2 * (1 - MARGIN))
    assert pred.target_for(plan.replace(mem_mib=2048)) == pytest.approx(2048 / 2 * (1 - MARGIN))
    peak = pred.peak(plan)
    assert pred.fits(plan) == (peak <= pred.target_for(plan) and estimate(GPT2, plan, cpu).fits)
    assert pred.fits(plan.replace(mem_mib=int(peak))) is False  # the whole share would be the peak: over the margin
    assert Predictor(cpu).target_for(plan) is None and Predictor(cpu).fits(plan) is None
