"""toolkit.triage.diagnose and lookup: which partition a job ran on, a recovered OOM, where to look. Pure."""

from toolkit.classify import classify
from toolkit.sites import load_site
from toolkit.triage.diagnose import diagnose, pick_partition
from toolkit.triage.facts import Case, JobFacts
from toolkit.triage.lookup import where_to_look

from oom_messages import new_oom

EX = load_site("example-hpc")
V100_32_OOM = classify(None, new_oom(tried=2.0, total=31.74, free=0.4, in_use=31.3, allocated=30.0, unallocated=0.3))
V100_16_OOM = classify(None, new_oom(tried=2.0, total=15.77, free=0.4, in_use=15.3, allocated=14.2, unallocated=0.3))


def test_profiles_sharing_a_slurm_partition_are_told_apart_by_the_stated_capacity():
    assert {p.slurm_partition for p in (EX.partition("v100-16gb"), EX.partition("v100-32gb"))} == {"gpu_v100"}
    big, note = pick_partition(EX, "gpu_v100", V100_32_OOM)
    small, _ = pick_partition(EX, "gpu_v100", V100_16_OOM)
    assert (big.name, small.name) == ("v100-32gb", "v100-16gb") and "31.7 GiB" in note
    assert pick_partition(EX, "v100-16gb", V100_32_OOM)[0].name == "v100-16gb"  # a profile name is taken as said
    unsure, note = pick_partition(EX, "gpu_v100", classify(None, "slurmstepd: error: Detected 1 oom-kill event(s)"))
    assert unsure.name == "v100-16gb" and "--partition" in note


def test_the_stated_capacity_alone_picks_a_card_at_least_that_big():
    assert pick_partition(EX, None, V100_32_OOM)[0].name == "v100-32gb"
    a100_80 = classify(None, new_oom(tried=2.0, total=79.15, free=0.5, in_use=78.4, allocated=75.1, unallocated=1.7))
    assert pick_partition(EX, None, a100_80)[0].name == "a100-80gb"
    part, note = pick_partition(EX, None, classify(None, "ValueError: x"))
    assert part is None and "--partition" in note


def test_a_completed_job_that_caught_an_oom_gets_no_remedies(tmp_path):
    log = tmp_path / "slurm-9.out"
    log.write_text("step 1\n" + new_oom(2.0, 15.77, 0.4, 15.3, 14.2, 0.3) + "\nretrying with batch 4\nstep 2\ndone\n")
    facts = JobFacts(job_id="9", state="COMPLETED", exit_code=0, signal=0, partition="v100-16gb",
                     plan_knobs={"micro_batch": 8, "global_batch": 8})
    finding = diagnose(Case("9", "job", (log,), None, facts), EX)
    assert finding.verdict.kind == "gpu_oom" and finding.remedies == ()
    assert any("recovered" in n for n in finding.notes) and finding.where_to_look
    failed = diagnose(Case("9", "job", (log,), None, JobFacts(**{**facts.__dict__, "state": "FAILED", "exit_code": 1})),
                      EX)
    assert failed.remedies


def test_an_nccl_watchdog_timeout_is_not_the_time_limit():
    text = ("[rank0]:[E ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600046 milliseconds before timing out.")
    advice = where_to_look(classify(None, text))
    assert advice[0].startswith("A collective timed out") and not any("time limit" in a for a in advice)
    timeout = where_to_look(classify({"state": "TIMEOUT"}, "step 5\n"), "TIMEOUT")
    assert timeout[0].startswith("The job reached its time limit")
    assert where_to_look(V100_16_OOM) == []


def test_where_to_look_uses_the_scheduler_state_when_the_log_says_nothing():
    advice = where_to_look(classify(None, "ValueError: bad\n"), "CANCELLED")
    assert any(a.startswith("The job was cancelled") for a in advice)



def test_the_finding_carries_where_when_and_how_sure(tmp_path):
    log = tmp_path / "slurm-11.out"
    log.write_text(" 40%|####      | 4000/10000 [10:00<15:00,  1.50s/it]\nTraceback (most recent call last):\n"
                   '  File "trainer.py", line 9, in evaluate\n  File "model.py", line 3, in forward\n'
                   + new_oom(2.0, 15.77, 0.4, 15.3, 14.2, 0.3) + "\n")
    facts = JobFacts(job_id="11", state="FAILED", exit_code=1, signal=0, partition="v100-16gb",
                     plan_knobs={"micro_batch": 8, "global_batch": 32, "gpus_per_node": 4})
    finding = diagnose(Case("11", "job", (log,), None, facts), EX)
    v = finding.to_dict()["verdict"]
    assert (v["phase"], v["step"], v["total_steps"], v["confidence"]) == ("eval", 4000, 10000, "high")
    titles = [r.title for r in finding.remedies]
    assert "evaluation" in titles[0] and any("4000" in t for t in titles[:2])


def test_where_to_look_reads_the_cause():
    teardown = classify(None, "{'train_runtime': 1.0, 'train_loss': 2.0}\nSegmentation fault (core dumped)\n")
    assert teardown.cause == "teardown" and "teardown" in where_to_look(teardown)[0]
    assert "completed: nothing failed" not in " ".join(where_to_look(teardown))
    seg = classify(None, "Segmentation fault (core dumped)\n")
    assert seg.cause == "segfault" and "PYTHONFAULTHANDLER" in where_to_look(seg)[0]


FSDP_ACCUMULATION = """#!/bin/bash
#SBATCH --partition=a100-40gb
#SBATCH --gres=gpu:8
torchrun --nproc_per_node 8 run_clm.py --model_name_or_path llama-7b --per_device_train_batch_size 1 \\
   --gradient_accumulation_steps 8 --bf16 --gradient_checkpointing --block_size 512 --fsdp "full_shard auto_wrap"
"""


def test_hf_trainer_fsdp_accumulation_is_estimated_with_its_unsharded_gradients_and_told_to_sync(tmp_path):
    """The HF Trainer accumulates under FSDP with no_sync unless --accelerator_config asks for sync_each_batch
    (scriptread -> JobFacts.runtime -> KnownPlan.runtime -> Runtime.fsdp_no_sync): the picture holds every unit's
    unsharded gradient, and the first remedy is the same plan with a gradient sync on every micro-batch, which
    fits where the job did not (Llama-7B on 4 x A100-40GB)."""
    from toolkit.estimate import estimate, model_ref
    from toolkit.estimate.gpu import Runtime
    from toolkit.triage.sources import cases

    oom = new_oom(tried=1.0, total=39.39, free=0.3, in_use=39.0, allocated=38.6, unallocated=0.2)
    (tmp_path / "slurm-4412.out").write_text("step 3\n" + oom + "\n")
    (tmp_path / "train.sbatch").write_text(FSDP_ACCUMULATION)
    [case] = cases(str(tmp_path / "slurm-4412.out"))
    assert case.facts.runtime == {"fsdp_no_sync": True}
    finding = diagnose(case, EX)
    assert finding.plan.launcher == "fsdp" and finding.plan.grad_accum == 8 and finding.plan.reduce_dtype == "param"
    assert any("unsharded gradient between micro-batches" in n for n in finding.notes)  # the report says why
    first = finding.remedies[0]
    assert first.title.startswith("Reduce the gradients on every micro-batch (sync_each_batch)") and first.fits
    assert first.plan is None and first.trainer_args == (
        """--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": true}}'""",)
    # what it saves: the estimate of the plan as the job ran it, less the same plan syncing every micro-batch (the
    # unsharded gradients, kept in the bf16 the Trainer reduces in, less the fp32 shards syncing keeps)
    then, now = (estimate(model_ref("llama-7b"), finding.plan, EX.partition("a100-40gb"),
                          runtime=Runtime(fsdp_no_sync=kept)).device_used_mib for kept in (True, False))
    assert then - now > 2 * 6.7e9 / 2**20 * 0.5 and f"{(then - now) / 1024:.1f} GiB" in first.title
    # the job that already syncs every micro-batch gets no such advice, and its estimate holds only shards
    synced = FSDP_ACCUMULATION.replace('auto_wrap"', 'auto_wrap" --accelerator_config '
                                       '\'{"gradient_accumulation_kwargs": {"sync_each_batch": true}}\'')
    (tmp_path / "train.sbatch").write_text(synced)
    [case] = cases(str(tmp_path / "slurm-4412.out"))
    assert case.facts.runtime == {"fsdp_no_sync": False}
    again = diagnose(case, EX)
    assert not any("sync_each_batch" in r.title for r in again.remedies)
    assert not any("unsharded gradient between micro-batches" in n for n in again.notes)
    assert again.picture.estimate.device_used_mib < finding.picture.estimate.device_used_mib - 0.5 * 2 * 6.7e9 / 2**20


def _fsdp_job(tmp_path, script: str):
    from toolkit.triage.sources import cases

    oom = new_oom(tried=1.0, total=39.39, free=0.3, in_use=39.0, allocated=38.6, unallocated=0.2)
    (tmp_path / "slurm-4412.out").write_text("step 3\n" + oom + "\n")
    (tmp_path / "train.sbatch").write_text(script)
    [case] = cases(str(tmp_path / "slurm-4412.out"))
    return case, diagnose(case, EX)


def test_hf_trainer_fsdp_in_mixed_precision_reduces_in_the_16_bit_dtype(tmp_path):
    """Accelerate builds FSDP's mixed-precision policy from --bf16 with reduce_dtype bf16
    (FullyShardedDataParallelPlugin.set_mixed_precision), and the Trainer passes an fsdp_config's
    mixed_precision_policy on to nothing (transformers 5.24): the plan read from the flags reduces in the 16-bit
    dtype whatever the fsdp_config says, and the unsharded gradients no_sync keeps are bf16, half fp32's."""
    from toolkit.estimate import estimate, model_ref
    from toolkit.estimate.gpu import Runtime

    policy = """ --fsdp_config '{"mixed_precision_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}'"""
    case, ran = _fsdp_job(tmp_path, FSDP_ACCUMULATION.replace('auto_wrap"', 'auto_wrap"' + policy))
    assert ran.plan.reduce_dtype == "param" and case.facts.knob_sources["reduce_dtype"].startswith("trainer args")
    held = {r: estimate(model_ref("llama-7b"), ran.plan.replace(reduce_dtype=r), EX.partition("a100-40gb"),
                        runtime=Runtime(fsdp_no_sync=True)).components["grads"] for r in ("fp32", "param")}
    assert ran.picture.estimate.components["grads"] == held["param"]
    assert held["fp32"] > 1.9 * held["param"] > 1.9 * 6.7e9 * 2 / 2**20
    _, fp16 = _fsdp_job(tmp_path, FSDP_ACCUMULATION.replace("--bf16", "--fp16"))
    _, fp32 = _fsdp_job(tmp_path, FSDP_ACCUMULATION.replace("--bf16 ", ""))
    assert fp16.plan.reduce_dtype == "param" and fp32.plan.reduce_dtype == "fp32"  # no autocast: nothing to say


def test_remedies_of_an_fsdp_accumulation_without_sync_are_predicted_and_flagged_as_hpcmem_writes_them(tmp_path):
    """Every plan hpcmem offers for such a job syncs each micro-batch (its Trainer flags carry sync_each_batch), so
    each move is predicted under that runtime (Predictor.changed_runtime) and says the flag; the flag is merged into
    the job's own --accelerator_config (the Trainer takes the last one given) and never dropped."""
    from toolkit.estimate import estimate, model_ref
    from toolkit.estimate.gpu import Runtime
    from toolkit.triage.changes import trainer_arg_changes
    from toolkit.triage.remedies import _Maker
    from toolkit.triage.picture import fill_plan

    own = """--accelerator_config '{"split_batches": true}'"""
    case, finding = _fsdp_job(tmp_path, FSDP_ACCUMULATION.replace("--block_size 512", "--block_size 512 " + own))
    assert case.facts.runtime == {"fsdp_no_sync": True} and case.facts.accelerator_config == '{"split_batches": true}'
    merged = ("--accelerator_config "
              """'{"split_batches": true, "gradient_accumulation_kwargs": {"sync_each_batch": true}}'""")
    moves = [r for r in finding.remedies if r.plan is not None and r.plan != finding.plan]  # not a smaller model
    assert moves and all(merged in r.trainer_args for r in moves if r.plan.grad_accum > 1)
    # predicted as they will run, syncing every micro-batch: each the estimate under that runtime, scaled by the
    # one factor the OOM's stated demand sets for the whole run (the failed plan as it ran against the demand)
    plans = [r.plan for r in moves]
    synced = [estimate(model_ref("llama-7b"), p, EX.partition("a100-40gb"),
                       runtime=Runtime(fsdp_no_sync=False)).device_used_mib for p in plans]
    kept = [estimate(model_ref("llama-7b"), p, EX.partition("a100-40gb"),
                     runtime=Runtime(fsdp_no_sync=True)).device_used_mib for p in plans]
    scales = [r.predicted_peak_mib / e for r, e in zip(moves, synced)]
    assert max(scales) - min(scales) < 1e-6 and scales[0] >= 1.0
    as_ran = [r.predicted_peak_mib / e for r, e in zip(moves, kept)]  # under no_sync the ratios would not agree
    assert max(as_ran) - min(as_ran) > 1e-3
    assert any(k > s + 1024 for k, s, p in zip(kept, synced, plans) if p.grad_accum > 1)  # it matters
    assert any(r.trainer_args == (merged,) for r in finding.remedies if r.plan is None)  # the sync advice
    # a move to no accumulation keeps the job's own flag; a file is set, not replaced
    failed = finding.plan
    known = fill_plan(failed)
    one = failed.replace(micro_batch=1, grad_accum=1, global_batch=failed.world_size)
    assert not any("accelerator_config" in a for a in trainer_arg_changes(failed, one, accelerator_config=own))
    assert trainer_arg_changes(failed, one) == ("--gradient_accumulation_steps 1", "drop --accelerator_config")
    maker = _Maker(EX.partition("a100-40gb"), type(known)(known.plan, accelerator_config="acc.json"), None, None,
                   None, failed)
    assert maker.trainer_args(failed, failed) == (
        """set {"gradient_accumulation_kwargs": {"sync_each_batch": true}} in the job's --accelerator_config acc.json""",)
    # a job whose own config already syncs is told nothing of it
    asks = '{"gradient_accumulation_kwargs": {"sync_each_batch": true}}'
    assert trainer_arg_changes(failed, failed, accelerator_config=asks) == ()
