"""toolkit.triage.picture: the memory picture of a failed job, from Verdicts classified from literal messages, on
the shipped site profiles and model configs. Pure: no torch, no Slurm."""

import json
from pathlib import Path

import pytest

from toolkit.classify import Verdict, classify, classify_file
from toolkit.errors import UnknownNameError
from toolkit.estimate import estimate, model_ref
from toolkit.plan import Plan
from toolkit.sites import load_site
from toolkit.triage.picture import fill_plan, memory_picture

from oom_messages import new_oom

EX = load_site("example-hpc")
V100 = EX.partition("v100-16gb")
A100 = EX.partition("a100-40gb")
LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
GPT2 = model_ref("gpt2")
LLAMA = model_ref("llama-7b")


V100_OOM = classify(None, new_oom(tried=2.0, total=15.77, free=0.4, in_use=15.36, allocated=14.2, unallocated=0.3))
GPT2_FP32 = Plan(gpus_per_node=4, global_batch=128, micro_batch=8, grad_accum=4, seq_len=1024, precision="fp32")


def test_v100_oom_sets_the_message_against_the_estimate():
    pic = memory_picture(V100_OOM, GPT2_FP32, V100, GPT2)
    n = V100_OOM.numbers
    assert pic.capacity_mib == n["total_capacity_mib"] < V100.gpu_mem_gib * 1024  # the message's, not the profile's
    assert pic.demand_mib == pytest.approx(n["process_in_use_mib"] + n["tried_to_allocate_mib"])
    assert pic.demand_mib > pic.capacity_mib  # it did not fit
    assert pic.estimate == estimate(GPT2, GPT2_FP32, V100)
    assert pic.plan == GPT2_FP32 and pic.stated == n
    assert "fragmentation" not in pic.flags and "other_process" not in pic.flags
    text = " ".join(pic.lines)
    assert "14.2 GiB allocated" in text and "2.0 GiB more" in text and "15.8 GiB" in text
    assert "The estimate for this plan" in text and "activations" in text
    assert any("not calibrated" in note for note in pic.notes)


def test_fragmentation_and_other_process_are_flagged():
    frag = classify_file(LOGS / "lightning_gpu_oom_torch113_fragmentation.log")
    pic = memory_picture(frag, GPT2_FP32.replace(precision="fp16-mixed"), V100, GPT2)
    assert "fragmentation" in pic.flags
    assert "reserved in total" in " ".join(pic.lines)  # the old wording's numbers are used
    other = classify(None, new_oom(tried=2.0, total=15.77, free=1.0, in_use=6.7, allocated=6.0, unallocated=0.2,
                                   other=8.0))
    pic = memory_picture(other, GPT2_FP32, V100, GPT2)
    assert "other_process" in pic.flags
    assert pic.usable_mib == pytest.approx(pic.capacity_mib - other.numbers["other_process_mib"])
    assert "Other processes held 8.0 GiB" in " ".join(pic.lines)


def test_an_estimate_below_what_the_message_shows_is_flagged_low():
    # a micro-batch of 1 at seq 128 cannot need 17 GiB: something the model does not know holds the memory
    small = Plan(global_batch=1, micro_batch=1, seq_len=128, precision="fp16-mixed")
    pic = memory_picture(V100_OOM, small, V100, GPT2)
    assert pic.estimate.device_used_mib * 1.1 < pic.demand_mib
    assert "estimate_low" in pic.flags and "more than the model knows" in " ".join(pic.lines)
    assert "estimate_low" not in memory_picture(V100_OOM, GPT2_FP32, V100, GPT2).flags


def test_host_pressure_under_cpu_offload():
    verdict = classify_file(LOGS / "deepspeed_cgroup_oom_slurm2205.log")
    assert verdict.kind == "host_oom"
    plan = {"launcher": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
            "gpus_per_node": 2, "precision": "fp16-mixed", "seq_len": 2048, "micro_batch": 1}
    pic = memory_picture(verdict, plan, V100, LLAMA, max_rss_mib=120_000, mem_request_mib=128_000)
    assert "host_pressure_offload" in pic.flags
    assert pic.estimate.host_mib_per_node > 0
    text = " ".join(pic.lines)
    assert "peak resident memory was 117.2 GiB of its --mem 125.0 GiB" in text and "Offloading keeps" in text
    # the same plan without offload is no offload pressure, and a job far below its --mem neither
    calm = memory_picture(V100_OOM, GPT2_FP32, V100, GPT2, max_rss_mib=10_000, mem_request_mib=128_000)
    assert "host_pressure_offload" not in calm.flags


def test_unknown_model_or_plan_gives_no_estimate_and_says_why():
    pic = memory_picture(V100_OOM, GPT2_FP32, V100, None)
    assert pic.estimate is None and any("model is unknown" in note for note in pic.notes)
    assert pic.demand_mib is not None  # the message's numbers still speak
    pic = memory_picture(V100_OOM, None, V100, GPT2)
    assert pic.estimate is None and pic.plan is None and any("plan is unknown" in note for note in pic.notes)
    pic = memory_picture(Verdict("gpu_driver_oom"), GPT2_FP32, None, GPT2)
    assert pic.capacity_mib is None and pic.lines == ("The message states no memory sizes.",)


def test_partly_known_plan_is_estimated_with_assumptions_named():
    known = {"micro_batch": 8, "global_batch": 128, "gpus_per_node": 4, "precision": "fp32"}
    pic = memory_picture(V100_OOM, known, V100, GPT2)
    assert pic.estimate is not None and pic.plan.grad_accum == 4
    assumed = " ".join(pic.notes)
    assert "seq_len=128" in assumed and "attention=sdpa" in assumed and "micro_batch" not in assumed


def test_fill_plan_keeps_the_batch_invariant_and_follows_zero():
    r = fill_plan({"world_size": 8, "global_batch": 256})
    assert r.plan.world_size == 8 and r.plan.micro_batch * r.plan.grad_accum * 8 == 256
    assert r.known and "gpus_per_node=8" not in r.assumed
    r = fill_plan({"zero_stage": 2, "micro_batch": 4, "grad_accum": 2, "seq_len": None})  # None: not known
    assert r.plan.launcher == "deepspeed" and r.plan.global_batch == 8
    assert "grad_accum=2" not in r.assumed and "seq_len=128" in r.assumed
    r = fill_plan({"launcher": "torchrun", "zero_stage": 3, "offload_params": "cpu"})  # torchrun started DeepSpeed
    assert r.plan.launcher == "deepspeed"
    r = fill_plan({"micro_batch": 4, "grad_accum": 2, "global_batch": 100})  # disagrees: micro and accum win
    assert r.plan.global_batch == 8
    r = fill_plan({"time_min": 10_000}, V100)
    assert r.plan.time_min == V100.max_time_min
    assert not fill_plan(None).known and not fill_plan({}).known
    assert fill_plan(GPT2_FP32).plan == GPT2_FP32 and fill_plan(GPT2_FP32).assumed == ()
    known = fill_plan({"micro_batch": 2})
    assert fill_plan(known) is known
    with pytest.raises(UnknownNameError):
        fill_plan({"batch_size": 8})


def test_to_dict_is_json_with_rounded_mib():
    pic = memory_picture(V100_OOM, GPT2_FP32, V100, GPT2, max_rss_mib=12345.678)
    data = json.loads(json.dumps(pic.to_dict()))
    assert {"estimate", "stated", "capacity_mib", "demand_mib", "usable_mib", "flags", "lines", "notes", "plan",
            "max_rss_mib", "mem_request_mib"} == set(data)
    assert data["max_rss_mib"] == 12345.7
    assert all(v == round(v, 1) for v in data["stated"].values())
    assert all(v == round(v, 1) for v in data["estimate"]["components"].values())
    assert json.loads(json.dumps(memory_picture(V100_OOM, None, None, None).to_dict()))["estimate"] is None


def test_nccl_shm_is_host_pressure_by_its_cause_from_the_failure_table():
    verdict = classify(None, "node1:1:2 [0] include/shm.h:48 NCCL WARN Error while creating shared memory segment "
                             "nccl-shm-recv-b7 (size 4460544)\n")
    assert verdict.kind == "nccl_oom" and verdict.cause == "shm"  # no "/dev/shm" in the text: the cause says it
    plan = {"launcher": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
            "gpus_per_node": 2, "precision": "fp16-mixed", "seq_len": 2048, "micro_batch": 1}
    pic = memory_picture(verdict, plan, V100, LLAMA, max_rss_mib=None, mem_request_mib=None)
    assert "host_pressure_offload" in pic.flags  # the verdict alone says host memory (no --mem to compare)
    device = classify(None, "node1:1:2 [1] include/alloc.h:36 NCCL WARN Failed to CUDA calloc 6291456 bytes\n")
    assert device.cause == "device" and device.numbers["nccl_bytes"] == 6291456
    assert "host_pressure_offload" not in memory_picture(device, plan, V100, LLAMA, max_rss_mib=None,
                                                         mem_request_mib=None).flags
