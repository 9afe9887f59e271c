"""toolkit.triage.remedies: ranked remedies from a Verdict classified from literal messages, on the shipped site
profiles and model configs. Pure: no torch, no Slurm."""

import json
from pathlib import Path

import pytest

from toolkit import ladder, planner
from toolkit.classify import classify, classify_file
from toolkit.errors import UnknownNameError
from toolkit.estimate import estimate, model_ref
from toolkit.plan import Plan, parse_sets, with_changes
from toolkit.sites import load_site
from toolkit.triage.changes import ds_config_changes, script_changes, slowdown_text, trainer_arg_changes
from toolkit.triage.lookup import where_to_look
from toolkit.triage.remedies import ALL_MOVES, LAST_RESORT, remedies

from oom_messages import new_oom

EX = load_site("example-hpc")
V100 = EX.partition("v100-16gb")
A100 = EX.partition("a100-40gb")
LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
GPT2 = model_ref("gpt2")
BERT = model_ref("bert-large", task="seq-cls", num_labels=2)
LLAMA = model_ref("llama-7b")


# GPT-2 in fp32 on four V100-16GB: 2 GiB asked with 0.4 GiB free.
V100_OOM = classify(None, new_oom(tried=2.0, total=15.77, free=0.4, in_use=15.36, allocated=14.2, unallocated=0.3))
GPT2_FP32 = Plan(gpus_per_node=4, global_batch=128, micro_batch=8, grad_accum=4, seq_len=1024, precision="fp32",
                 attention="eager", time_min=240)
BERT_FP32 = Plan(gpus_per_node=4, global_batch=64, micro_batch=16, grad_accum=1, seq_len=512, precision="fp32",
                 attention="eager", time_min=240)


def target(verdict, partition, margin=planner.MARGIN):
    n = verdict.numbers
    total = n.get("total_capacity_mib", partition.gpu_mem_gib * 1024)
    return (total - n.get("other_process_mib", 0.0)) * (1 - margin)


def assert_keeps_what_is_learned(before, remedy, partition):
    after = remedy.plan
    assert after.global_batch == before.global_batch and after.seq_len == before.seq_len
    assert after.micro_batch * after.grad_accum * after.world_size == after.global_batch
    partition.check_plan(after)
    assert not remedy.changes_result and not remedy.title.startswith(LAST_RESORT)


def assert_round_trip(before, remedy):
    assert with_changes(before, parse_sets(remedy.set_args)) == remedy.plan
    assert remedy.submit_command.startswith("hpcmem submit ")
    assert all(f"--set {arg}" in remedy.submit_command for arg in remedy.set_args)


# ------------------------------------------------------------------ GPU OOM, model known


@pytest.mark.parametrize("model, plan", [(GPT2, GPT2_FP32), (BERT, BERT_FP32)])
def test_v100_remedies_fit_keep_the_batch_and_never_use_bf16_or_flash(model, plan):
    assert V100_OOM.kind == "gpu_oom"
    out = remedies(V100_OOM, plan, V100, model, spec="gpt2-clm")
    assert out and out[0].fits
    for r in out:
        assert r.plan.precision != "bf16-mixed" and r.plan.attention != "flash"
        assert_keeps_what_is_learned(plan, r, V100)
        assert_round_trip(plan, r)
        assert r.predicted_peak_mib is not None
        assert r.fits == (r.predicted_peak_mib <= target(V100_OOM, V100))
    fitting = [r for r in out if r.fits]
    assert out[:len(fitting)] == fitting  # fitting ones first
    assert [r.slowdown for r in fitting] == sorted(r.slowdown for r in fitting)
    # a slower remedy is shown only for needing less memory than every faster one
    peaks = [r.predicted_peak_mib for r in fitting]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)


def test_the_first_remedy_is_the_fastest_candidate_predicted_to_fit():
    out = remedies(V100_OOM, GPT2_FP32, V100, GPT2)
    # the documented correction: scale every estimate by max(1, stated demand / estimate of the failed plan)
    demand = ladder.footprint(GPT2_FP32, V100_OOM.numbers, V100.cuda_context_mib).demand_mib
    scale = max(1.0, demand / estimate(GPT2, GPT2_FP32, V100).device_used_mib)
    best = planner.speed(out[0].plan, V100)
    for cand in planner.candidate_plans(GPT2_FP32, V100, ALL_MOVES):
        if planner.speed(cand, V100) > best * (1 + 1e-9) and cand.micro_batch <= GPT2_FP32.micro_batch:
            assert estimate(GPT2, cand, V100).device_used_mib * scale > target(V100_OOM, V100)
    assert out[0].predicted_peak_mib == pytest.approx(estimate(GPT2, out[0].plan, V100).device_used_mib * scale)
    assert out[0].slowdown < 1.0  # fp32 -> fp16 on a V100 is faster, whatever else is needed


def test_an_estimate_below_the_messages_numbers_is_scaled_up_to_them():
    # GPT-2 at micro-batch 2, seq 256 is estimated far below the 17 GiB the message shows: every candidate's
    # estimate is scaled by the same factor, so the prediction never trusts the low estimate
    plan = Plan(gpus_per_node=4, global_batch=64, micro_batch=2, grad_accum=8, seq_len=256, precision="fp32")
    demand = ladder.footprint(plan, V100_OOM.numbers, V100.cuda_context_mib).demand_mib
    scale = demand / estimate(GPT2, plan, V100).device_used_mib
    assert scale > 1.5
    out = remedies(V100_OOM, plan, V100, GPT2)
    assert out
    for r in out:
        assert r.predicted_peak_mib == pytest.approx(estimate(GPT2, r.plan, V100).device_used_mib * scale)


def test_a100_proposes_bf16_and_the_script_and_trainer_lines_follow():
    verdict = classify_file(LOGS / "hf_trainer_gpu_oom_torch22.log")  # 3.9 GiB asked on a 40 GB A100
    plan = GPT2_FP32.replace(micro_batch=32, grad_accum=1)
    out = remedies(verdict, plan, A100, GPT2, spec="gpt2-clm", site="example-hpc")
    assert out and out[0].fits
    assert any(r.plan.precision == "bf16-mixed" for r in out)
    assert all(r.plan.precision != "fp16-mixed" for r in out)  # bf16 where the GPU has it
    for r in out:
        assert_round_trip(plan, r)
        if r.plan.precision == "bf16-mixed":
            assert "--bf16" in r.trainer_args
        if r.plan.micro_batch != plan.micro_batch:
            assert f"--per_device_train_batch_size {r.plan.micro_batch}" in r.trainer_args
        if r.plan.launcher == "deepspeed":
            assert any(line.startswith("zero_optimization.stage:") for line in r.ds_config_changes)
        elif r.plan.launcher == "fsdp":  # FSDP remedies: its config file and its Trainer flags
            assert r.ds_config_changes[0] == "fsdp_config.json: (not used) -> written by hpcmem for launcher=fsdp"
            assert any(line.startswith("reshard_after_forward:") for line in r.ds_config_changes)
            assert any(arg.startswith("--fsdp ") for arg in r.trainer_args)
        else:
            assert r.ds_config_changes == ()


def test_nothing_in_the_way_of_the_result_changes_when_something_fits():
    out = remedies(V100_OOM, GPT2_FP32, V100, GPT2)
    assert not any(r.changes_result for r in out)


def test_remedies_only_add_savings_to_the_failed_plan():
    plan = GPT2_FP32.replace(precision="fp16-mixed", attention="sdpa", launcher="deepspeed", zero_stage=2,
                             micro_batch=4, grad_accum=8)
    for r in remedies(V100_OOM, plan, V100, GPT2, max_items=20):
        assert r.plan.micro_batch <= plan.micro_batch and r.plan.zero_stage >= plan.zero_stage
        assert r.plan.precision != "fp32"


# ------------------------------------------------------------------ fragmentation, other process


def test_fragmentation_gets_expandable_segments_first_and_keeps_it():
    verdict = classify_file(LOGS / "lightning_gpu_oom_torch113_fragmentation.log")
    assert verdict.kind == "gpu_oom_fragmentation"
    plan = GPT2_FP32.replace(precision="fp16-mixed", attention="sdpa")
    out = remedies(verdict, plan, V100, GPT2)
    assert out[0].moves == ("alloc_conf:" + ladder.EXPANDABLE,)
    assert out[0].set_args == ("alloc_conf=" + ladder.EXPANDABLE,)
    assert out[0].slowdown == pytest.approx(1.0)
    assert any("PYTORCH_CUDA_ALLOC_CONF" in line for line in out[0].script_changes)
    assert all(ladder.EXPANDABLE in r.plan.alloc_conf for r in out)
    # the idle reserved memory it gives back brings the same plan under what the message says it needed
    demand = ladder.footprint(plan, verdict.numbers, V100.cuda_context_mib).demand_mib
    assert out[0].predicted_peak_mib < demand
    plain = remedies(classify(None, new_oom(0.5, 15.78, 0.3, 15.4, 11.8, 0.1)), plan, V100, GPT2)
    assert all(not r.plan.alloc_conf for r in plain)


def test_another_process_on_the_gpu_is_not_a_plan_move():
    verdict = classify(None, new_oom(tried=2.0, total=15.77, free=1.0, in_use=6.7, allocated=6.0, unallocated=0.2,
                                     other=8.0))
    assert verdict.kind == "gpu_oom_other_process"
    (only,) = remedies(verdict, GPT2_FP32, V100, GPT2)
    assert only.moves == () and only.set_args == () and only.plan == GPT2_FP32
    assert any("--exclusive" in line for line in only.script_changes)
    assert "nvidia-smi" in only.note and only.fits  # alone on the card it would have fit


# ------------------------------------------------------------------ host memory


def test_host_oom_asks_for_more_memory_within_the_node():
    verdict = classify_file(LOGS / "torchrun_sigkill_cgroup_slurm2302.log")
    assert verdict.kind == "host_oom"
    plan = GPT2_FP32.replace(mem_mib=32000, workers=4)
    out = remedies(verdict, plan, V100, GPT2)
    assert out and all(r.predicted_peak_mib is None and r.fits is None for r in out)
    first = out[0]
    assert "mem_mib" in {arg.split("=")[0] for arg in first.set_args}
    assert plan.mem_mib < first.plan.mem_mib <= V100.host_mem_gib * 1024
    assert "#SBATCH --mem=32000M -> " in " ".join(first.script_changes)
    assert any(r.plan.workers < plan.workers for r in out)  # fewer data-loader workers further down
    for r in out:
        assert_round_trip(plan, r)
        assert r.plan.precision == plan.precision and r.plan.micro_batch == plan.micro_batch  # no GPU rungs


def test_host_oom_under_cpu_offload_moves_it_to_nvme_first():
    verdict = classify_file(LOGS / "deepspeed_cgroup_oom_slurm2205.log")
    plan = {"launcher": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
            "gpus_per_node": 2, "precision": "fp16-mixed"}
    out = remedies(verdict, plan, V100, LLAMA)
    assert out[0].plan.offload_params == "nvme" or out[0].plan.offload_optimizer == "nvme"
    assert any("device: cpu -> nvme" in line for line in out[0].ds_config_changes)
    assert "assumed" in out[0].note  # micro_batch, seq_len... were not given


# ------------------------------------------------------------------ what is unknown


@pytest.mark.parametrize("log", ["illegal_memory_access.log", "time_limit_after_oom.log"])
def test_not_oom_gets_no_memory_advice_but_where_to_look(log):
    verdict = classify(None, "slurmstepd: error: *** JOB 77 ON n1 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME "
                             "LIMIT ***") if "time_limit" in log else classify_file(LOGS / log)
    assert not verdict.is_oom
    assert remedies(verdict, GPT2_FP32, V100, GPT2) == []
    advice = " ".join(where_to_look(verdict))
    assert ("--time" in advice) if "time_limit" in log else ("CUDA_LAUNCH_BLOCKING=1" in advice)


def test_where_to_look_names_the_tool_for_each_failure():
    cases = {
        "slurmstepd: error: *** JOB 5 ON n1 CANCELLED AT 2024-05-01T10:00:00 ***": "sacct",
        "OSError: [Errno 28] No space left on device": "quota",
        "[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout": "NCCL_DEBUG=INFO",
    }
    for text, needle in cases.items():
        verdict = classify(None, text)
        assert verdict.kind == "not_oom", text
        assert needle in " ".join(where_to_look(verdict)), text
    assert where_to_look(V100_OOM) == []


def test_unknown_model_still_gets_predicted_remedies_from_the_numbers():
    out = remedies(V100_OOM, GPT2_FP32, V100, None)
    assert out and out[0].fits
    for r in out:
        assert r.predicted_peak_mib is not None and "numbers" in r.note
        assert r.plan.precision != "bf16-mixed" and r.plan.attention != "flash"
        assert r.fits == (r.predicted_peak_mib <= target(V100_OOM, V100, ladder.MARGIN))
        assert_round_trip(GPT2_FP32, r)


def test_unknown_plan_gives_the_ladders_moves_in_order_unpredicted():
    out = remedies(V100_OOM, None, V100, GPT2)
    assert len(out) >= 3
    assert all(r.fits is None and r.predicted_peak_mib is None and r.plan is None for r in out)
    assert all("unknown" in r.note for r in out)
    assert out[0].moves == ("precision:fp16-mixed",)  # the defaults are fp32: the cheapest rung first
    knobs = [{m.split(":")[0] for m in r.moves} for r in out]
    assert all(a <= b for a, b in zip(knobs, knobs[1:]))  # each on top of the one before
    assert all("bf16" not in arg and "flash" not in arg for r in out for arg in r.set_args)


def test_no_numbers_and_no_model_walks_the_ladder_without_predictions():
    verdict = classify(None, "RuntimeError: CUDA error: out of memory")
    assert verdict.kind == "gpu_driver_oom" and not verdict.numbers
    plan = GPT2_FP32.replace(precision="fp16-mixed", attention="sdpa")
    out = remedies(verdict, plan, V100, None)
    assert out and all(r.fits is None for r in out)
    assert out[0].moves[0].startswith("micro_batch:")
    for r in out:
        assert_round_trip(plan, r)


def test_partly_known_plan_is_filled_and_says_what_was_assumed():
    known = {"micro_batch": 8, "global_batch": 128, "gpus_per_node": 4, "precision": "fp32", "seq_len": 1024}
    out = remedies(V100_OOM, known, V100, GPT2)
    assert out and out[0].fits
    assert all("assumed" in r.note and "attention=" in r.note for r in out)
    assert all(r.plan.global_batch == 128 and r.plan.world_size == 4 for r in out)


# ------------------------------------------------------------------ last resorts


def test_last_resort_only_when_nothing_fits_and_labelled():
    verdict = classify(None, new_oom(tried=3.0, total=15.77, free=1.0, in_use=14.76, allocated=13.9, unallocated=0.25))
    plan = Plan(launcher="deepspeed", gpus_per_node=4, global_batch=64, micro_batch=1, grad_accum=16, seq_len=2048,
                precision="fp16-mixed", checkpointing=True, zero_stage=3)
    no_offload = [m for m in ALL_MOVES if m not in ("offload", "nvme")]
    out = remedies(verdict, plan, V100, LLAMA, allow=no_offload)
    keep = [r for r in out if not r.changes_result]
    last = [r for r in out if r.changes_result]
    assert keep and all(r.fits is False for r in keep)  # the closest ones, marked
    assert last and out[-len(last):] == last  # after them
    for r in last:
        assert r.title.startswith(LAST_RESORT) and r.fits
        assert r.predicted_peak_mib <= target(verdict, V100)
        assert r.plan.offload_optimizer == r.plan.offload_params == "none"
    # with offload allowed something that keeps the result fits: no last resort
    assert not any(r.changes_result for r in remedies(verdict, plan, V100, LLAMA))


# ------------------------------------------------------------------ the lines that change (pure)


def test_script_ds_config_and_trainer_lines_are_the_diff_of_what_hpcmem_writes():
    old = Plan(launcher="deepspeed", gpus_per_node=2, global_batch=64, micro_batch=8, grad_accum=4,
               precision="bf16-mixed", zero_stage=2)
    new = with_changes(old, {"gpus_per_node": 4, "zero_stage": 3, "offload_optimizer": "cpu", "micro_batch": 2,
                             "checkpointing": True, "precision": "fp16-mixed"})
    lines = script_changes(old, new, A100)
    assert "#SBATCH --gpus-per-node=a100:2 -> a100:4" in lines
    assert "torchrun --nproc_per_node=2 -> 4" in lines
    ds = ds_config_changes(old, new, A100)
    assert "zero_optimization.stage: 2 -> 3" in ds
    assert "zero_optimization.offload_optimizer.device: (not set) -> cpu" in ds
    assert "bf16.enabled: true -> (not set)" in ds and "fp16.enabled: (not set) -> true" in ds
    hf = trainer_arg_changes(old, new)
    assert {"--per_device_train_batch_size 2", "--gradient_accumulation_steps 8", "--gradient_checkpointing",
            "--fp16", "drop --bf16"} <= set(hf)
    assert ds_config_changes(old.replace(launcher="torchrun", zero_stage=0), old.replace(launcher="torchrun",
                                                                                         zero_stage=0), A100) == ()
    assert script_changes(old, old, A100) == () and trainer_arg_changes(old, old) == ()
    # a value a shell would split is quoted; under FSDP, accumulating asks for a gradient sync on every micro-batch
    fsdp = Plan(launcher="fsdp", gpus_per_node=4, global_batch=32, micro_batch=8)
    assert trainer_arg_changes(fsdp, fsdp.replace(micro_batch=2, grad_accum=4)) == (
        "--per_device_train_batch_size 2", "--gradient_accumulation_steps 4",
        """--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": true}}'""")
    assert trainer_arg_changes(fsdp, fsdp.replace(reshard_after_forward=False)) == ("--fsdp 'shard_grad_op auto_wrap'",)


def test_to_dict_is_json_with_rounded_mib():
    for r in remedies(V100_OOM, GPT2_FP32, V100, GPT2) + remedies(V100_OOM, None, V100, None):
        data = json.loads(json.dumps(r.to_dict()))
        assert set(data) == {"title", "moves", "plan", "predicted_peak_mib", "fits", "slowdown", "set_args",
                             "submit_command", "script_changes", "ds_config_changes", "trainer_args",
                             "changes_result", "note"}
        if data["predicted_peak_mib"] is not None:
            assert data["predicted_peak_mib"] == round(data["predicted_peak_mib"], 1)


def test_bad_input_and_the_slowdown_words():
    with pytest.raises(UnknownNameError):
        remedies(V100_OOM, GPT2_FP32, V100, GPT2, allow=["precision", "warp-drive"])
    assert remedies(V100_OOM, GPT2_FP32, V100, GPT2, max_items=2)[:2] == remedies(V100_OOM, GPT2_FP32, V100, GPT2)[:2]
    assert len(remedies(V100_OOM, GPT2_FP32, V100, GPT2, max_items=2)) == 2
    assert slowdown_text(1.33) == "33 % slower" and slowdown_text(0.5) == "2.0x faster"
    assert slowdown_text(1.0) == "same speed" and slowdown_text(None) == "unknown"


# ------------------------------------------------------------------ issue 12: remedies chosen by phase and step


def _at(verdict, **where):
    from dataclasses import replace
    return replace(verdict, **where)


def test_an_oom_in_evaluation_gets_the_eval_batch_and_no_grad_first():
    found = remedies(_at(V100_OOM, phase="eval"), GPT2_FP32, V100, GPT2, max_items=4)
    first = found[0]
    assert first.plan is None and "evaluation" in first.title and "no_grad" in first.note
    assert "model.eval()" in first.note and any("--per_device_eval_batch_size" in a for a in first.trainer_args)
    assert len(found) <= 4 and any(r.plan is not None for r in found[1:])  # the memory moves still follow


def test_an_oom_while_loading_gets_sharded_low_precision_or_meta_device_loading():
    first = remedies(_at(V100_OOM, phase="load"), GPT2_FP32, V100, GPT2)[0]
    assert "loading" in first.title and "meta device" in first.note and "bfloat16" in " ".join(first.trainer_args)
    assert "offload" in first.note


def test_an_oom_at_a_late_step_asks_about_long_batches_and_leaks_first():
    first = remedies(_at(V100_OOM, step=40000, total_steps=100000), GPT2_FP32, V100, GPT2)[0]
    assert "40000" in first.title and "long batch" in first.note and "leak" in first.note


def test_an_early_step_and_a_forward_phase_get_the_plan_moves_only():
    found = remedies(_at(V100_OOM, phase="forward", step=3), GPT2_FP32, V100, GPT2)
    assert found and all(r.plan is not None for r in found)


def test_a_host_kill_while_loading_gets_the_loading_advice_then_the_host_rungs():
    v = classify(None, "Loading checkpoint shards:   0%|          | 0/3 [00:00<?, ?it/s]Killed\n")
    assert v.kind == "host_oom" and v.phase == "load" and v.confidence == "medium"
    found = remedies(v, GPT2_FP32, V100, GPT2)
    assert "loading" in found[0].title and "mmap" in found[0].note


def test_nccl_shm_by_cause_takes_the_host_rungs():
    from toolkit.classify import Verdict
    v = classify(None, "Error while creating shared memory segment /dev/shm/nccl-CsYXMW (size 9637888)\n")
    assert v.kind == "nccl_oom" and v.cause == "shm" and v.numbers == {"nccl_bytes": 9637888}
    plan = GPT2_FP32.replace(mem_mib=32000, workers=4)
    found = remedies(v, plan, V100, GPT2)
    assert found and all(r.predicted_peak_mib is None for r in found)
    assert all(r.plan.precision == plan.precision and r.plan.micro_batch == plan.micro_batch for r in found)
    from toolkit.failures import family_of, is_host
    assert is_host(v) and family_of("nccl_oom", "shm") == "host" and family_of("nccl_oom", "device") == "gpu"
    assert is_host(Verdict("nccl_oom", reason="NCCL could not extend /dev/shm/nccl-1"))  # an older verdict, no cause


def test_triage_widens_with_the_ladders_more_gpus_move():
    """One 'more GPUs, global batch kept' move: triage's copy is gone and ladder.more_gpus gives each larger rank
    count per node whose world divides the global batch, micro-batch the largest divisor up to the current one."""
    from toolkit.triage import remedies as remedies_mod

    assert not hasattr(remedies_mod, "_more_gpu_starts")
    plan = Plan(global_batch=48, micro_batch=16, grad_accum=3, seq_len=512)
    wider = ladder.more_gpus(plan, A100)  # 4 a node: 24 a rank on 2, 16 on 3, 12 on 4
    assert [(p.gpus_per_node, p.micro_batch, p.grad_accum) for p in wider] == [(2, 12, 2), (3, 16, 1), (4, 12, 1)]
    assert all(p.global_batch == 48 for p in wider)
    assert ladder.more_gpus(plan.replace(gpus_per_node=4, micro_batch=12, grad_accum=1), A100) == []


def test_an_older_deepspeed_named_in_the_log_is_estimated_as_it_allocates_and_an_upgrade_is_offered():
    """The engine prints 'DeepSpeed info: version=...' at initialize. Triage estimates the plan under that version
    (estimate.gpu.Runtime): DeepSpeed 0.14.2's ZeRO-Offload hand-over holds an elementwise overflow check of 11 bytes
    per element of the largest gradient (PR #8325), and its step the whole fp32 partition (PR #7309). The first
    remedy is then the same plan on a newer DeepSpeed, predicted without that memory."""
    from toolkit.estimate.gpu import Runtime

    banner = ("[2024-08-06 10:00:01,123] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: version=0.14.2, "
              "git-hash=unknown, git-branch=unknown\n")
    message = new_oom(tried=1.0, total=39.39, free=0.5, in_use=38.8, allocated=37.0, unallocated=1.2)
    plan = Plan(launcher="deepspeed", gpus_per_node=4, global_batch=16, micro_batch=4, grad_accum=1, seq_len=2048,
                precision="bf16-mixed", zero_stage=2, offload_optimizer="cpu", checkpointing=True, time_min=240)
    old = classify(None, banner + message)
    assert old.deepspeed_version == "0.14.2" and classify(None, message).deepspeed_version is None
    assert classify(None, "deepspeed info ................... 0.9.5, unknown, unknown\n" + message
                    ).deepspeed_version == "0.9.5"
    assert old.to_dict()["deepspeed_version"] == "0.14.2" and type(old).from_dict(old.to_dict()) == old

    found = remedies(old, plan, A100, LLAMA)
    first = found[0]
    assert first.title.startswith("Upgrade DeepSpeed 0.14.2 -> 0.19.8") and first.plan is None
    then, now = (estimate(LLAMA, plan, A100, runtime=r).device_used_mib
                 for r in (Runtime(deepspeed_version="0.14.2"), None))
    assert then - now > 1024  # the 11-byte scan of the 131M-element embedding alone is 1.3 GiB
    assert f"{(then - now) / 1024:.1f} GiB" in first.title
    demand = 38.8 * 1024 + 1.0 * 1024  # the message: in use + the request, above both estimates
    assert first.predicted_peak_mib == pytest.approx(demand - (then - now), rel=1e-6)
    assert "PR #8325" in first.note and "PR #7309" in first.note
    # the plan moves after it are predicted under the job's DeepSpeed too
    assert any(r.plan is not None for r in found[1:])
    # nothing to offer: hpcmem's DeepSpeed, no version in the log, or ZeRO-3 (its own hand-over)
    for verdict, p in ((classify(None, banner.replace("0.14.2", "0.19.8") + message), plan),
                       (classify(None, message), plan), (old, plan.replace(zero_stage=3))):
        assert not any(r.title.startswith("Upgrade DeepSpeed") for r in remedies(verdict, p, A100, LLAMA))
