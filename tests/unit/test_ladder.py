"""toolkit.ladder: the next plan after an OOM, on the shipped site profiles, with verdicts built directly or
classified from literal messages. Pure: no torch, no Slurm."""

import json
import math
from pathlib import Path

import pytest

from toolkit import sites
from toolkit.classify import OOM_KINDS, Verdict, classify, classify_file
from toolkit.errors import UnknownNameError
from toolkit.jobspec import DEFAULT_ALLOW
from toolkit.ladder import (
    ALLOW_NAMES,
    MARGIN,
    Decision,
    footprint,
    next_plan,
    slowdown,
)
from toolkit.plan import Plan
from toolkit.predict import Predictor, activation_units, state_bytes_per_param

EX = sites.load_site("example-hpc")
TC = sites.load_site("testcluster")
V100 = EX.partition("v100-16gb")
A100 = EX.partition("a100-40gb")
A100_80 = EX.partition("a100-80gb")
CPU = TC.partition("cpu")
TC_A100 = TC.partition("a100")
LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"

FP32 = Plan(global_batch=64, micro_batch=32, grad_accum=2, seq_len=512, precision="fp32", attention="eager")
"""A plain first plan: fp32, eager attention, micro-batch 32, no memory savings yet."""


def saving_mib(plan, new_plan, numbers):
    """What the one predictor says ``new_plan`` saves against the failed ``plan`` (numbers only, on a V100)."""
    pred = Predictor(V100, plan, numbers)
    return pred.demand_mib - pred.peak(new_plan)


def new_oom(tried, total, free, in_use, allocated, unallocated):
    """A PyTorch >= 2.1 caching-allocator message (sizes in GiB)."""
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried:.2f} GiB. GPU 0 has a total capacity "
        f"of {total:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch memory, this process has "
        f"{in_use:.2f} GiB memory in use. Of the allocated memory {allocated:.2f} GiB is allocated by PyTorch, and "
        f"{unallocated:.2f} GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


def gap_mib(verdict, capacity_mib=None):
    """What the message says must be saved: in use + tried - (1 - MARGIN) x capacity."""
    n = verdict.numbers
    total = n["total_capacity_mib"] if capacity_mib is None else capacity_mib
    in_use = n.get("process_in_use_mib", n.get("total_capacity_mib", 0) - n.get("free_mib", 0))
    return in_use + n["tried_to_allocate_mib"] - total * (1 - MARGIN)


def walk(plan, kind, partition, allow=ALLOW_NAMES, bigger=(), numbers=None, limit=40):
    """Climb the ladder failure after failure (same verdict each time) until it stops; the decisions."""
    decisions, tried = [], []
    for attempt in range(1, limit):
        d = next_plan(plan, Verdict(kind, numbers or {}), partition, allow=allow, tried=tried,
                      attempts_made=attempt, max_attempts=limit, bigger=bigger)
        decisions.append(d)
        if d.action != "retry":
            return decisions
        tried.append((plan, partition))
        plan, partition = d.plan, d.partition
    raise AssertionError("the ladder did not end")


def assert_keeps_what_is_learned(before, after, partition):
    assert after.global_batch == before.global_batch
    assert after.seq_len == before.seq_len
    assert after.micro_batch * after.grad_accum * after.world_size == after.global_batch
    assert after.precision == before.precision or after.precision in ("fp16-mixed", "bf16-mixed")
    assert after.optimizer == before.optimizer or after.optimizer in ("adamw-8bit", "adafactor")
    partition.check_plan(after)


# ------------------------------------------------------------------ not a memory move


@pytest.mark.parametrize("text", [
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "slurmstepd: error: *** JOB 123 ON node1 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***",
    "OSError: [Errno 28] No space left on device",
    "ModuleNotFoundError: No module named 'transformers'",
    "everything looked fine",
])
def test_not_oom_and_unknown_are_never_retried(text):
    verdict = classify(None, text)
    assert verdict.kind in ("not_oom", "unknown")
    d = next_plan(FP32, verdict, V100, allow=ALLOW_NAMES, attempts_made=1, max_attempts=6)
    assert (d.action, d.plan, d.moves) == ("stop", None, ())
    assert "No memory move" in d.reason


def test_not_oom_fixture_stops_even_with_every_move_allowed():
    d = next_plan(FP32, classify_file(LOGS / "illegal_memory_access.log"), A100, allow=ALLOW_NAMES)
    assert d.action == "stop" and "not a memory failure" in d.reason


def test_another_process_on_the_gpu_is_not_a_memory_move():
    verdict = Verdict("gpu_oom_other_process", {"tried_to_allocate_mib": 2048.0, "total_capacity_mib": 16384.0,
                                                "free_mib": 100.0, "other_process_mib": 8000.0})
    d = next_plan(FP32, verdict, V100, allow=ALLOW_NAMES)
    assert (d.action, d.plan) == ("stop", None)
    assert "Another process holds the GPU; not a memory move" in d.reason


# ------------------------------------------------------------------ every OOM kind


@pytest.mark.parametrize("kind", [k for k in OOM_KINDS if k != "gpu_oom_other_process"])
def test_every_oom_kind_gets_a_memory_move(kind):
    plan = FP32.replace(workers=4)
    d = next_plan(plan, Verdict(kind), TC_A100, allow=ALLOW_NAMES)
    assert d.action == "retry" and d.moves and d.plan != plan
    assert_keeps_what_is_learned(plan, d.plan, TC_A100)
    host = kind in ("host_oom", "cpu_alloc_oom")
    assert d.moves[0].startswith("mem_mib:" if host else ("alloc_conf:" if "fragmentation" in kind else "precision:"))


def test_nccl_shared_memory_goes_to_the_host_ladder_device_memory_to_the_gpu_ladder():
    shm = classify_file(LOGS / "nccl_shm_full.log")
    device = classify_file(LOGS / "nccl_cuda_oom.log")
    assert shm.kind == device.kind == "nccl_oom"
    assert next_plan(FP32, shm, A100, allow=DEFAULT_ALLOW).moves[0].startswith("mem_mib:")
    assert next_plan(FP32, device, A100, allow=DEFAULT_ALLOW).moves == ("precision:bf16-mixed",)


# ------------------------------------------------------------------ rung order per GPU


def test_rung_order_on_v100_fp16_and_no_flash():
    *decisions, last = walk(FP32, "gpu_oom", V100)  # no numbers stated: one rung per failure
    moves = [d.moves for d in decisions]
    assert moves[:3] == [("precision:fp16-mixed",), ("attention:sdpa",), ("micro_batch:32->16",)]
    flat = [m for ms in moves for m in ms]
    assert not any("bf16" in m or "flash" in m for m in flat)
    order = ["precision:", "attention:", "micro_batch:", "checkpointing", "optimizer:adamw-8bit",
             "optimizer:adafactor", "offload_optimizer:cpu", "offload_params:cpu"]
    firsts = [next(i for i, m in enumerate(flat) if m.startswith(name)) for name in order]
    assert firsts == sorted(firsts)
    # with weights, gradients and optimizer states all on the host, a GPU holds a gathered layer, the buckets and
    # the activations of micro-batch 1, which more GPUs do not shrink: no move is left
    assert last.action == "give_up" and not any(m.startswith("gpus_per_node:") for m in flat)


def test_rung_order_on_a100_bf16_and_flash():
    moves = [d.moves for d in walk(FP32, "gpu_oom", A100)[:2]]
    assert moves == [("precision:bf16-mixed",), ("attention:flash",)]


def test_flash_only_for_16_bit_and_where_the_gpu_has_it():
    on_a100 = next_plan(FP32, Verdict("gpu_oom"), A100, allow=("attention",))
    assert on_a100.moves == ("attention:sdpa",)  # fp32 kept: flash kernels are 16-bit only
    mixed = FP32.replace(precision="fp16-mixed")
    assert next_plan(mixed, Verdict("gpu_oom"), V100, allow=("attention",)).moves == ("attention:sdpa",)
    assert next_plan(mixed, Verdict("gpu_oom"), A100, allow=("attention",)).moves == ("attention:flash",)


def test_zero_stages_climb_one_at_a_time_on_several_gpus_and_switch_the_launcher():
    plan = Plan(gpus_per_node=4, global_batch=64, micro_batch=1, grad_accum=16, precision="bf16-mixed",
                checkpointing=True)
    stages = [d for d in walk(plan, "gpu_oom", A100, allow=("zero", "offload"))[:-1]]
    assert [d.moves for d in stages] == [("zero:0->1",), ("zero:1->2",), ("zero:2->3",),
                                         ("offload_optimizer:cpu",), ("offload_params:cpu",)]
    assert stages[0].plan.launcher == "deepspeed"


def test_zero_alone_on_one_gpu_saves_nothing_so_offload_brings_it():
    plan = FP32.replace(precision="fp16-mixed", attention="sdpa", micro_batch=1, grad_accum=64, checkpointing=True)
    d = next_plan(plan, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW)
    assert d.moves == ("zero:0->2", "offload_optimizer:cpu")
    assert next_plan(plan, Verdict("gpu_oom"), V100, allow=("zero",)).action == "give_up"


def test_nvme_offload_where_cpu_offload_is_not_allowed():
    plan = Plan(launcher="deepspeed", zero_stage=3, precision="bf16-mixed", global_batch=8, micro_batch=1,
                grad_accum=8, checkpointing=True)
    d = next_plan(plan, Verdict("gpu_oom"), A100, allow=("nvme",))
    assert d.moves == ("offload_optimizer:nvme",)
    assert next_plan(d.plan, Verdict("gpu_oom"), A100, allow=("nvme",), tried=[plan]).moves == (
        "offload_params:nvme",)
    nvme_less = sites.Partition(**{**A100.__dict__, "nvme_path": None})
    assert next_plan(plan, Verdict("gpu_oom"), nvme_less, allow=("nvme",)).action == "give_up"


# ------------------------------------------------------------------ allow lists


@pytest.mark.parametrize("allow, first", [
    (("checkpointing",), ("checkpointing",)),
    (("micro_batch",), ("micro_batch:32->16",)),
    (("optimizer",), ("optimizer:adamw-8bit",)),
    (("precision", "checkpointing"), ("precision:fp16-mixed",)),
])
def test_allow_list_restricts_moves(allow, first):
    decisions = walk(FP32, "gpu_oom", V100, allow=allow)
    assert decisions[0].moves == first
    names = {m.split(":")[0] for d in decisions for m in d.moves}
    allowed = {"precision", "attention", "micro_batch", "checkpointing", "optimizer"} & set(allow)
    assert names <= allowed
    assert decisions[-1].action == "give_up"


def test_optimizer_and_gpus_are_not_in_the_default_allow_list():
    decisions = walk(FP32, "gpu_oom", V100, allow=DEFAULT_ALLOW)
    names = {m.split(":")[0] for d in decisions for m in d.moves}
    assert not names & {"optimizer", "gpus_per_node", "partition"}


def test_unknown_allow_name_is_refused():
    with pytest.raises(UnknownNameError, match="valid: .*micro_batch"):
        next_plan(FP32, Verdict("gpu_oom"), V100, allow=("microbatch",))


# ------------------------------------------------------------------ invariants on every plan


@pytest.mark.parametrize("kind", ["gpu_oom", "gpu_driver_oom", "host_oom", "cpu_alloc_oom"])
@pytest.mark.parametrize("partition", [V100, A100, CPU, TC_A100], ids=lambda p: p.name)
def test_every_returned_plan_keeps_what_is_learned_and_is_new(kind, partition):
    start = FP32.replace(gpus_per_node=2, grad_accum=1, workers=2)
    decisions = walk(start, kind, partition, bigger=(A100, A100_80))
    seen = {(tuple(sorted(start.replace(time_min=1).to_dict().items())), partition.name)}
    plan = start
    for d in decisions[:-1]:
        assert_keeps_what_is_learned(start, d.plan, d.partition)
        key = (tuple(sorted(d.plan.replace(time_min=1).to_dict().items())), d.partition.name)
        assert key not in seen, f"{d.moves} repeats a tried plan"
        seen.add(key)
        assert d.plan.time_min >= plan.time_min or d.partition is not partition
        plan = d.plan
    assert decisions[-1].action == "give_up"


# ------------------------------------------------------------------ time


def test_time_scales_with_the_slowdown_of_the_moves():
    plan = FP32.replace(precision="fp16-mixed", attention="sdpa", time_min=60)
    ckpt = next_plan(plan, Verdict("gpu_oom"), V100, allow=("checkpointing",))
    assert ckpt.plan.time_min == math.ceil(60 * 1.33)
    micro = next_plan(plan, Verdict("gpu_oom"), V100, allow=("micro_batch",))
    assert micro.plan.time_min == math.ceil(60 * 1.05)
    precision = next_plan(FP32.replace(time_min=60), Verdict("gpu_oom"), V100, allow=("precision",))
    assert precision.plan.time_min == 60  # faster, never shortened
    assert slowdown(plan, plan.replace(launcher="deepspeed", zero_stage=3, offload_optimizer="nvme",
                                       offload_params="nvme")) == pytest.approx(1.15 * 2.0 * 2.0)


def test_time_is_capped_at_the_partition_limit():
    plan = FP32.replace(precision="fp16-mixed", attention="sdpa", time_min=110)  # testcluster: 2 h at most
    d = next_plan(plan, Verdict("gpu_oom"), TC.partition("v100"), allow=("checkpointing",))
    assert d.plan.time_min == TC.partition("v100").max_time_min == 120


# ------------------------------------------------------------------ using the numbers


def test_numbers_drive_a_multi_rung_jump_to_a_fitting_plan():
    # 4 GiB asked with 1 GiB free on a 16 GiB V100, fp32, micro-batch 32, eager attention.
    verdict = classify(None, new_oom(tried=4.0, total=15.77, free=1.0, in_use=14.76, allocated=13.90,
                                     unallocated=0.25))
    assert verdict.kind == "gpu_oom"
    d = next_plan(FP32, verdict, V100, allow=DEFAULT_ALLOW)
    assert d.action == "retry" and len(d.moves) >= 2
    assert d.moves[0] == "precision:fp16-mixed"
    saving = saving_mib(FP32, d.plan, verdict.numbers)
    assert saving >= gap_mib(verdict)
    assert d.predicted_peak_mib <= verdict.numbers["total_capacity_mib"] * (1 - MARGIN)
    assert_keeps_what_is_learned(FP32, d.plan, V100)
    # the same failure without numbers: one rung
    assert next_plan(FP32, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW).moves == ("precision:fp16-mixed",)


def test_a_larger_gap_climbs_further():
    verdict = Verdict("gpu_oom", {"tried_to_allocate_mib": 4 * 1024.0, "total_capacity_mib": 16384.0,
                                  "free_mib": 512.0})
    plan = FP32.replace(attention="sdpa")
    d = next_plan(plan, verdict, V100, allow=DEFAULT_ALLOW)
    assert d.moves == ("precision:fp16-mixed", "micro_batch:32->4")
    assert saving_mib(plan, d.plan, verdict.numbers) >= gap_mib(verdict)
    # the largest micro-batch that fits: twice as much is predicted not to
    larger = d.plan.replace(micro_batch=8, grad_accum=8)
    assert saving_mib(plan, larger, verdict.numbers) < gap_mib(verdict)


def test_a_later_rung_can_make_an_earlier_one_unnecessary():
    # 16 GiB asked on a 16 GiB card: activations alone cannot close the gap, CPU offload must come; with it
    # neither checkpointing nor a smaller micro-batch is needed any more, so neither is kept.
    verdict = Verdict("gpu_oom", {"tried_to_allocate_mib": 16 * 1024.0, "total_capacity_mib": 16384.0,
                                  "free_mib": 512.0})
    d = next_plan(FP32, verdict, V100, allow=DEFAULT_ALLOW)
    assert d.moves == ("precision:fp16-mixed", "attention:sdpa", "zero:0->2", "offload_optimizer:cpu")
    assert d.plan.micro_batch == FP32.micro_batch and not d.plan.checkpointing
    assert saving_mib(FP32, d.plan, verdict.numbers) >= gap_mib(verdict)
    assert d.plan.time_min == math.ceil(FP32.time_min * 1.05 * 1.5)


@pytest.mark.parametrize("log", ["hf_trainer_gpu_oom_torch22.log", "torchrun_rank_oom_childfailed.log",
                                 "time_limit_after_oom.log"])
def test_fixture_ooms_with_numbers_get_one_predicted_fitting_decision(log):
    verdict = classify_file(LOGS / log)
    part = A100_80 if "childfailed" in log else A100
    plan = Plan(gpus_per_node=part.gpus_per_node, global_batch=128, micro_batch=8, grad_accum=16 // part.gpus_per_node,
                precision="bf16-mixed", seq_len=1024) if "childfailed" in log else FP32
    d = next_plan(plan, verdict, part, allow=DEFAULT_ALLOW)
    assert d.action == "retry"
    assert d.predicted_peak_mib <= verdict.numbers["total_capacity_mib"] * (1 - MARGIN)


def test_old_pytorch_wording_numbers_are_used():
    verdict = classify_file(LOGS / "lightning_gpu_oom_torch113_fragmentation.log")
    assert verdict.kind == "gpu_oom_fragmentation" and "reserved_total_mib" in verdict.numbers
    fp = footprint(FP32, verdict.numbers, V100.cuda_context_mib)
    n = verdict.numbers
    assert fp.idle_mib == pytest.approx(n["reserved_total_mib"] - n["already_allocated_mib"])
    d = next_plan(FP32, verdict, V100, allow=DEFAULT_ALLOW)
    assert d.moves == ("alloc_conf:expandable_segments:True",)  # the idle 2.4 GiB is enough
    assert d.predicted_peak_mib < fp.demand_mib


def fake_job_peak(plan, share, tensors, first=FP32, context=420.0):
    """The true peak (MiB) of a FAKE GPU job (no GPU here): the ladder's scaling laws, with a true activation
    share at the first plan that the ladder does not know."""
    act = tensors * share * activation_units(plan) / activation_units(first)
    states = tensors * (1 - share) * state_bytes_per_param(plan) / state_bytes_per_param(first)
    return context + act + states


def failures_until_it_fits(share, over, capacity=15.77 * 1024, allow=DEFAULT_ALLOW):
    """Run the fake job through the ladder, each OOM message made from its true peak; failed attempts."""
    tensors = capacity * over - 420.0
    plan, tried = FP32, []
    for failures in range(10):
        peak = fake_job_peak(plan, share, tensors)
        if peak <= capacity:
            return failures
        free = 64.0
        numbers = {"tried_to_allocate_mib": peak - (capacity - free), "total_capacity_mib": capacity,
                   "free_mib": free}
        d = next_plan(plan, Verdict("gpu_oom", numbers), V100, allow=allow, tried=tried, max_attempts=20)
        assert d.action == "retry", d.reason
        tried.append(plan)
        plan = d.plan
    raise AssertionError("never fits")


@pytest.mark.parametrize("share", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("over", [1.05, 1.3, 1.6, 2.0, 3.0, 4.0])
def test_fake_jobs_fit_after_one_failure_when_the_message_states_numbers(share, over):
    assert failures_until_it_fits(share, over) == 1


def test_fake_jobs_with_a_split_outside_the_assumed_range_fit_after_two_at_most():
    assert max(failures_until_it_fits(share, over) for share in (0.1, 0.15, 0.2, 0.8, 0.9)
               for over in (1.1, 1.5, 2.0, 3.0)) <= 2


def test_nothing_fits_here_so_a_bigger_partition_from_the_original_plan():
    plan = FP32.replace(precision="fp16-mixed", attention="sdpa")
    verdict = Verdict("gpu_oom", {"tried_to_allocate_mib": 30 * 1024.0, "total_capacity_mib": 16384.0,
                                  "free_mib": 100.0})
    allow = ("micro_batch", "partition")
    d = next_plan(plan, verdict, V100, allow=allow, bigger=[EX.partition("v100-32gb"), A100, A100_80])
    assert d.partition.name == "a100-40gb" and d.moves[-1] == "partition:a100-40gb"  # v100-32gb is too small
    assert d.plan.precision == "fp16-mixed"  # kept as is; bf16 would be a move of its own
    no_partition = next_plan(plan, verdict, V100, allow=("micro_batch",), bigger=[A100])
    assert no_partition.partition is V100
    assert "no allowed plan is predicted to fit" in no_partition.reason and no_partition.plan.micro_batch == 1
    again = next_plan(no_partition.plan, verdict, V100, allow=("micro_batch",), tried=[plan])
    assert again.action == "give_up"


def test_more_gpus_keep_the_global_batch_and_help_only_with_zero():
    plan = Plan(launcher="deepspeed", zero_stage=3, gpus_per_node=1, global_batch=64, micro_batch=4, grad_accum=16,
                precision="bf16-mixed", checkpointing=True)
    d = next_plan(plan, Verdict("gpu_oom"), A100, allow=("gpus",))
    assert d.moves == ("gpus_per_node:1->2",) and d.plan.grad_accum == 8 and d.plan.global_batch == 64
    ddp = Plan(gpus_per_node=1, global_batch=64, micro_batch=4, grad_accum=16)
    assert next_plan(ddp, Verdict("gpu_oom"), A100, allow=("gpus",)).action == "give_up"


# ------------------------------------------------------------------ fragmentation


def test_fragmentation_sets_the_allocator_first_then_is_a_plain_gpu_oom():
    verdict = classify(None, new_oom(tried=2.0, total=39.39, free=1.2, in_use=38.18, allocated=31.0,
                                     unallocated=6.5))
    assert verdict.kind == "gpu_oom_fragmentation"
    plan = FP32.replace(precision="bf16-mixed", attention="flash", micro_batch=8, grad_accum=8)
    d = next_plan(plan, verdict, A100, allow=DEFAULT_ALLOW)
    assert d.moves == ("alloc_conf:expandable_segments:True",) and d.plan.alloc_conf == "expandable_segments:True"
    assert d.plan.time_min == plan.time_min
    again = next_plan(d.plan, verdict, A100, allow=DEFAULT_ALLOW, tried=[plan])
    assert again.moves[0].startswith("micro_batch:8->")
    kept = next_plan(plan.replace(alloc_conf="max_split_size_mb:128"), verdict, A100, allow=DEFAULT_ALLOW)
    assert kept.plan.alloc_conf == "max_split_size_mb:128,expandable_segments:True"
    not_allowed = next_plan(plan, verdict, A100, allow=("micro_batch",))
    assert not_allowed.moves[0].startswith("micro_batch:8->")


# ------------------------------------------------------------------ tried, attempts, giving up


def test_a_tried_plan_is_never_returned_the_ladder_skips_on():
    first = next_plan(FP32, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW)
    assert first.moves == ("precision:fp16-mixed",)
    # the fp16 plan already failed (with another time limit: same knobs): skip to the next rung
    skip = next_plan(FP32, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW, tried=[first.plan.replace(time_min=99)])
    assert skip.moves == ("attention:sdpa",)
    # tried elsewhere does not count here
    elsewhere = next_plan(FP32, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW, tried=[(first.plan, A100)])
    assert elsewhere.moves == ("precision:fp16-mixed",)
    # within a rung: the halved micro-batch failed, the next smaller one is offered
    mixed = FP32.replace(precision="fp16-mixed", attention="sdpa")
    halved = mixed.replace(micro_batch=16, grad_accum=4)
    assert next_plan(mixed, Verdict("gpu_oom"), V100, allow=("micro_batch",), tried=[halved]).moves == (
        "micro_batch:32->8",)


def test_tried_plans_are_skipped_by_the_numbers_jump_too():
    verdict = Verdict("gpu_oom", {"tried_to_allocate_mib": 4096.0, "total_capacity_mib": 16384.0, "free_mib": 1024.0})
    plan = FP32.replace(attention="sdpa")
    d = next_plan(plan, verdict, V100, allow=DEFAULT_ALLOW)
    skip = next_plan(plan, verdict, V100, allow=DEFAULT_ALLOW, tried=[d.plan])
    assert skip.plan.replace(time_min=1) != d.plan.replace(time_min=1)
    assert skip.predicted_peak_mib <= 16384.0 * (1 - MARGIN)


def test_give_up_after_max_attempts_says_what_was_tried():
    second = FP32.replace(precision="fp16-mixed")
    d = next_plan(second, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW, tried=[FP32], attempts_made=2,
                  max_attempts=2)
    assert (d.action, d.plan) == ("give_up", None)
    assert "2 of 2 allowed attempts" in d.reason and "tried 2 plan(s)" in d.reason
    assert "precision:fp16-mixed" in d.reason and "(fp32, micro 32x2 on 1, eager, adamw)" in d.reason


def test_give_up_when_nothing_is_allowed():
    d = next_plan(FP32, Verdict("gpu_oom"), V100, allow=())
    assert d.action == "give_up"
    assert "no memory move is left" in d.reason and "not allowed: alloc_conf, precision" in d.reason
    numbers = Verdict("gpu_oom", {"tried_to_allocate_mib": 4096.0, "total_capacity_mib": 16384.0, "free_mib": 10.0})
    d = next_plan(FP32, numbers, V100, allow=())
    assert d.action == "give_up" and "to save" in d.reason


def test_the_whole_ladder_ends_in_give_up_with_a_reason():
    decisions = walk(FP32, "gpu_oom", V100, allow=ALLOW_NAMES, bigger=(A100, A100_80))
    assert decisions[-1].action == "give_up"
    assert "v100-16gb, a100-40gb, a100-80gb" in decisions[-1].reason
    assert {d.partition.name for d in decisions} == {"v100-16gb", "a100-40gb", "a100-80gb"}


# ------------------------------------------------------------------ host ladder


def test_host_ladder_on_the_cpu_partition():
    plan = Plan(gpus_per_node=2, global_batch=16, micro_batch=8, grad_accum=1, workers=2)
    decisions = walk(plan, "host_oom", CPU, allow=DEFAULT_ALLOW)
    moves = [d.moves for d in decisions[:-1]]
    cap = int(CPU.host_mem_gib * 1024 * 0.95)
    assert moves[:2] == [("mem_mib:default->12288",), (f"mem_mib:12288->{cap}",)]
    assert moves[2:4] == [("workers:2->1",), ("workers:1->0",)]
    assert moves[4:] == [("micro_batch:8->4",), ("micro_batch:4->2",), ("micro_batch:2->1",), ("checkpointing",),
                         ("zero:0->1",), ("zero:1->2",), ("zero:2->3",)]
    assert all(d.plan.mem_mib <= CPU.host_mem_gib * 1024 for d in decisions[:-1])
    assert decisions[-1].action == "give_up"


def test_cpu_allocator_numbers_size_the_memory_request():
    verdict = classify(None, "RuntimeError: [enforce fail at alloc_cpu.cpp:83] data. DefaultCPUAllocator: can't "
                             "allocate memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot "
                             "allocate memory)")
    assert verdict.kind == "cpu_alloc_oom"
    d = next_plan(FP32, verdict, CPU, allow=DEFAULT_ALLOW)
    assert d.plan.mem_mib == math.ceil((6144 + 8192) * 1.1)
    # at the node's limit the request cannot be met by --mem alone: one more move in the same decision
    d2 = next_plan(d.plan.replace(workers=2), verdict, CPU, allow=DEFAULT_ALLOW, tried=[FP32])
    assert d2.moves == ("workers:2->1", f"mem_mib:{d.plan.mem_mib}->{int(CPU.host_mem_gib * 1024 * 0.95)}")


def test_host_oom_with_cpu_offload_moves_it_to_nvme_then_asks_for_memory():
    plan = Plan(launcher="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_params="cpu", global_batch=8,
                micro_batch=8, precision="bf16-mixed")
    verdict = classify_file(LOGS / "deepspeed_cgroup_oom_slurm2205.log")
    assert verdict.kind == "host_oom"
    d = next_plan(plan, verdict, TC_A100, allow=DEFAULT_ALLOW)
    assert d.moves == ("offload_optimizer:nvme", "offload_params:nvme")
    assert d.plan.time_min == math.ceil(plan.time_min * (2.0 / 1.5) ** 2)
    without_nvme = next_plan(plan, verdict, TC_A100, allow=tuple(a for a in DEFAULT_ALLOW if a != "nvme"))
    assert without_nvme.moves == ("mem_mib:default->12288",)
    only_offload = next_plan(plan, verdict, TC_A100, allow=("offload",))
    assert only_offload.moves == ("offload_params:none",)  # less CPU offload: parameters back on the GPU


def test_host_ladder_never_touches_gpu_rungs_on_a_gpu_partition():
    decisions = walk(FP32.replace(workers=4), "host_oom", TC_A100, allow=DEFAULT_ALLOW)
    names = {m.split(":")[0] for d in decisions for m in d.moves}
    assert names == {"mem_mib", "workers"}


# ------------------------------------------------------------------ the seams


def test_with_the_model_the_ladder_predicts_with_the_one_predictor():
    """Given the model, the ladder's predicted peak is the predictor's: the estimate scaled by the stated demand
    (the controller passes the spec's model); without it, the numbers alone. Both use one margin."""
    from toolkit.estimate import model_ref

    verdict = Verdict("gpu_oom", {"tried_to_allocate_mib": 4096.0, "total_capacity_mib": 16384.0, "free_mib": 1024.0})
    gpt2 = model_ref("gpt2")
    d = next_plan(FP32, verdict, V100, allow=DEFAULT_ALLOW, model=gpt2)
    pred = Predictor(V100, FP32, verdict.numbers, gpt2)
    assert d.action == "retry" and d.predicted_peak_mib == pytest.approx(pred.peak(d.plan))
    scale = max(1.0, pred.demand_mib / pred.estimate(FP32).device_used_mib)
    assert d.predicted_peak_mib == pytest.approx(pred.estimate(d.plan).device_used_mib * scale)
    assert d.predicted_peak_mib <= pred.target_mib == pytest.approx(
        min(16384.0 * (1 - MARGIN), pred.demand_mib - 1.0))
    alone = next_plan(FP32, verdict, V100, allow=DEFAULT_ALLOW)
    assert alone.predicted_peak_mib == pytest.approx(Predictor(V100, FP32, verdict.numbers).peak(alone.plan))


def test_decision_to_dict_is_json():
    d = next_plan(FP32, Verdict("gpu_oom"), V100, allow=DEFAULT_ALLOW)
    out = json.loads(json.dumps(d.to_dict()))
    assert out["action"] == "retry" and out["partition"] == "v100-16gb" and out["site"] == "example-hpc"
    assert out["moves"] == ["precision:fp16-mixed"] and out["plan"]["precision"] == "fp16-mixed"
    stop = Decision("stop", None, V100, reason="x").to_dict()
    assert stop["plan"] is None and stop["moves"] == []


def test_a_failure_without_numbers_jumps_to_what_fits_under_the_known_limit():
    """Driver and NCCL OOMs state no numbers, but the card's memory is the limit they reached; a host OOM on a CPU
    partition reached --mem. The ladder climbs as many rungs as the memory model needs, in one decision."""
    d = next_plan(FP32, Verdict("gpu_driver_oom", {}), V100, allow=DEFAULT_ALLOW)
    assert d.action == "retry" and d.predicted_peak_mib is not None
    assert d.predicted_peak_mib <= V100.gpu_mem_gib * 1024 * (1 - MARGIN)
    # the same failure as a caching-allocator OOM with its numbers lost: one rung, no prediction
    one = next_plan(FP32, Verdict("gpu_oom", {}), V100, allow=DEFAULT_ALLOW)
    assert len(one.moves) == 1 and one.predicted_peak_mib is None
    # host OOM on a CPU partition, --mem not allowed to grow: micro-batch, checkpointing, sharding until it fits
    cpu_plan = Plan(gpus_per_node=2, global_batch=64, micro_batch=32, grad_accum=1, seq_len=512, mem_mib=6144)
    jump = next_plan(cpu_plan, Verdict("host_oom", {}), CPU, allow=("micro_batch", "checkpointing", "fsdp"))
    assert jump.action == "retry" and jump.predicted_peak_mib <= 6144 / 2 * (1 - MARGIN)
    assert "--mem is the limit" in jump.reason


def test_under_a_memory_fraction_cap_the_target_is_the_cap_not_the_card():
    """A real H100 line (benchmarks/results/gpu-session-20261127-logs): GPT-2 bf16 micro-batch 16 on a card capped
    at 16 GiB beside another job, 49 GiB of the 79 GiB card free. The target is the cap (plus the CUDA context the
    cap does not count) less the margin, not the card less the other job: the controller once read its target as
    the failed demand itself (17.16 GiB)."""
    from toolkit.predict import footprint
    from test_classify import H100_CAPPED_OOMS

    verdict = classify(None, H100_CAPPED_OOMS[1])
    plan = Plan(global_batch=16, micro_batch=16, seq_len=512, precision="bf16-mixed")
    fp = footprint(plan, verdict.numbers)
    fixed = 15.62 * 1024 - 13.94 * 1024 - 965.01  # this process's use outside the allocator's figures
    assert fp.usable_mib == pytest.approx(16 * 1024 + fixed, abs=1)
    partition = sites.load_site("example-hpc").partition("a100-80gb")
    d = next_plan(plan, verdict, partition, allow=DEFAULT_ALLOW)
    assert d.action == "retry"
    assert d.predicted_peak_mib <= (16 * 1024 + fixed) * (1 - MARGIN)
    # the same cap on a card the other jobs left short (66 GiB theirs, 500 MiB free): the card's room binds
    short = classify(None, H100_CAPPED_OOMS[1].replace("48.86 GiB is free", "500.00 MiB is free")
                     .replace("14.68 GiB", "66.00 GiB"))
    card = short.numbers["total_capacity_mib"] - short.numbers["other_process_mib"]
    assert footprint(plan, short.numbers).usable_mib == pytest.approx(card) and card < 16 * 1024
