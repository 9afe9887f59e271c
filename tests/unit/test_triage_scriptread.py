"""Job scripts and DeepSpeed configs read as Plan knobs (toolkit/triage/scriptread.py), on literal text."""

import shlex

import pytest

from toolkit.strategies.deepspeed import deepspeed_config
from toolkit.plan import KNOBS, Plan
from toolkit.triage.scriptread import logical_lines, read_ds_config, read_script

HF_TORCHRUN = r"""#!/bin/bash
#SBATCH --job-name=llama-sft
#SBATCH -p a100
#SBATCH --nodes=1
#SBATCH --gres=gpu:a100:4
#SBATCH --mem=200G
#SBATCH -t 1-00:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.err
module load cuda/12.1   # not a directive
cd /scratch/ann/sft
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
torchrun --nproc_per_node=4 --nnodes 1 train.py \
    --model_name_or_path "meta-llama/Llama-2-7b-hf" \
    --per_device_train_batch_size 4 \
    --gradient_accumulation_steps=8 \
    --bf16 \
    --gradient_checkpointing True \
    --optim adamw_bnb_8bit \
    --model_max_length 2048 \
    --attn_implementation flash_attention_2 \
    --deepspeed configs/ds_zero2.json
"""


def test_hf_trainer_under_torchrun():
    script = read_script(HF_TORCHRUN)
    assert script["knobs"] == {
        "nodes": 1, "gpus_per_node": 4, "mem_mib": 200 * 1024, "time_min": 24 * 60,
        "alloc_conf": "expandable_segments:True",
        "micro_batch": 4, "grad_accum": 8, "precision": "bf16-mixed", "checkpointing": True,
        "optimizer": "adamw-8bit", "seq_len": 2048, "attention": "flash", "launcher": "deepspeed",
    }
    assert script["knob_origin"]["gpus_per_node"] == "job script"  # torchrun's --nproc_per_node
    assert script["knob_origin"]["micro_batch"] == "trainer args"
    assert script["knob_origin"]["mem_mib"] == "job script"
    assert script["model"] == "meta-llama/Llama-2-7b-hf"
    assert script["ds_config"] == "configs/ds_zero2.json"
    assert (script["output"], script["error"]) == ("logs/%x-%j.out", "logs/%x-%j.err")
    assert script["directives"]["partition"] == "a100"
    assert script["launcher_line"].startswith("torchrun --nproc_per_node=4 --nnodes 1 train.py")
    assert script["cd"] == "/scratch/ann/sft"
    assert set(script["knobs"]) <= set(KNOBS)


def test_deepspeed_launcher_and_false_flags():
    text = """#!/bin/bash
#SBATCH --gpus-per-node=v100:2
#SBATCH --nodes=2
deepspeed --num_nodes=2 --num_gpus 8 run_clm.py --deepspeed_config=ds.json --fp16 --bf16 false \\
  --gradient_checkpointing False --optim adafactor --block_size 512 --per_device_train_batch_size $MB
"""
    script = read_script(text)
    knobs = script["knobs"]
    assert (knobs["nodes"], knobs["gpus_per_node"], knobs["launcher"]) == (2, 8, "deepspeed")
    assert knobs["precision"] == "fp16-mixed"  # --bf16 false does not turn bf16 on
    assert knobs["checkpointing"] is False
    assert (knobs["optimizer"], knobs["seq_len"]) == ("adafactor", 512)
    assert "micro_batch" not in knobs  # $MB cannot be read from the script
    assert script["ds_config"] == "ds.json"


@pytest.mark.parametrize("line, knobs", [
    ("python -m torch.distributed.run --nproc-per-node=2 train.py", {"gpus_per_node": 2}),
    ("srun python -m torch.distributed.launch --nproc_per_node 3 --nnodes=2 t.py", {"gpus_per_node": 3, "nodes": 2}),
    ("/opt/venv/bin/torchrun --standalone --nproc_per_node=gpu t.py", {}),  # "gpu": not a number
    ("accelerate launch --num_processes 8 --num_machines 2 t.py", {"gpus_per_node": 4, "nodes": 2}),
    ("python train.py --optim sgd --max_seq_length=128", {"optimizer": "sgd", "seq_len": 128}),
    ("python train.py --optim lion_32bit", {}),  # an optimizer the plan has no name for
    ("python train.py --attn_implementation sdpa --fp16 1", {"attention": "sdpa", "precision": "fp16-mixed"}),
])
def test_launcher_and_trainer_lines(line, knobs):
    assert read_script("#!/bin/bash\n" + line + "\n")["knobs"] == knobs


def test_directives_stop_at_the_first_command_like_sbatch():
    text = "#!/bin/bash\n#SBATCH --mem=4G\necho start\n#SBATCH --mem=64G\n#SBATCH --gpus=4\n"
    script = read_script(text)
    assert script["knobs"] == {"mem_mib": 4096}
    assert script["directives"] == {"mem": "4G"}


def test_ntasks_per_node_counts_ranks_for_srun_jobs():
    text = "#!/bin/bash\n#SBATCH --ntasks-per-node=4\n#SBATCH --mem 8000\nsrun python lightning_train.py\n"
    assert read_script(text)["knobs"] == {"gpus_per_node": 4, "mem_mib": 8000}


def test_unbalanced_quotes_and_comments_do_not_raise():
    text = "#!/bin/bash\n# torchrun --nproc_per_node=8 (commented out)\npython t.py --per_device_train_batch_size 2 --name 'oops\n"
    script = read_script(text)
    assert script["knobs"] == {"micro_batch": 2}
    assert script["launcher_line"] is None


def test_logical_lines_join_continuations_and_drop_comments():
    text = "a \\\n  b \\\n  c\n# comment\n\nd\ne \\\n"
    assert logical_lines(text) == ["a    b    c", "d", "e"]


def test_empty_script():
    script = read_script("")
    assert (script["knobs"], script["directives"], script["model"], script["ds_config"]) == ({}, {}, None, None)


# ---------------------------------------------------------------- DeepSpeed configs


def test_ds_config_hpcmem_renders_reads_back_as_its_plan():
    plan = Plan(launcher="deepspeed", gpus_per_node=2, global_batch=16, micro_batch=2, grad_accum=4,
                precision="bf16-mixed", zero_stage=3, offload_optimizer="cpu", offload_params="nvme")
    knobs = read_ds_config(deepspeed_config(plan, nvme_path="/scratch"))
    assert knobs == {"launcher": "deepspeed", "micro_batch": 2, "grad_accum": 4, "global_batch": 16,
                     "precision": "bf16-mixed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "nvme",
                     "optimizer": "adamw"}


def test_ds_config_hf_style_auto_values_are_skipped():
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    assert read_ds_config(cfg) == {"launcher": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu",
                                   "offload_params": "none"}


@pytest.mark.parametrize("cfg, knobs", [
    ({"fp16": {"enabled": True}}, {"precision": "fp16-mixed"}),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, {"precision": "bf16-true"}),
    ({"bfloat16": {"enabled": True}}, {"precision": "bf16-mixed"}),
    ({"fp16": {"enabled": False}}, {"precision": "fp32"}),
    ({"zero_optimization": {"stage": 1}}, {"zero_stage": 1, "offload_optimizer": "none", "offload_params": "none"}),
    ({"zero_optimization": {"stage": "auto", "offload_param": {"device": "disk"}}}, {}),
    ({"zero_optimization": "bad", "fp16": None, "train_batch_size": True, "optimizer": {"type": "Lamb"}}, {}),
    ({"train_micro_batch_size_per_gpu": 0}, {}),
])
def test_ds_config_fields(cfg, knobs):
    assert read_ds_config(cfg) == {"launcher": "deepspeed", **knobs}


@pytest.mark.parametrize("text", [
    "#!/bin/bash\n#SBATCH --nodes=²\n#SBATCH --ntasks-per-node=³\n#SBATCH --gres=gpu:²\n"
    "torchrun --nproc_per_node=٣ --nnodes ² t.py --per_device_train_batch_size ³ --gradient_accumulation_steps=²\n",
    "#!/bin/bash\n#SBATCH --gpus-per-node=²\npython t.py --max_seq_length ¹²⁸\n",
])
def test_unicode_digits_are_not_numbers_and_never_raise(text):
    script = read_script(text)
    assert script["knobs"] == {}  # Slurm and argparse would refuse these too: nothing guessed


def test_the_partition_directive_is_read():
    assert read_script(HF_TORCHRUN)["partition"] == "a100"  # -p a100
    assert read_script("#!/bin/bash\n#SBATCH --partition=gpu_v100,gpu_a100\n")["partition"] == "gpu_v100,gpu_a100"
    assert read_script("#!/bin/bash\n#SBATCH --partition=$PART\n")["partition"] is None
    assert read_script("#!/bin/bash\necho\n")["partition"] is None


def test_every_knob_has_the_plan_type():
    from toolkit.triage.facts import knob_problem

    for text in (HF_TORCHRUN, "#!/bin/bash\n#SBATCH --mem=0.4M\n#SBATCH -t 0:10\n"):
        knobs = read_script(text)["knobs"]
        assert all(knob_problem(k, v) is None for k, v in knobs.items()), knobs


def test_hf_trainer_fsdp_flags_are_an_fsdp_job():
    text = 'torchrun --nproc_per_node 4 run_clm.py --fsdp "shard_grad_op auto_wrap offload" --fsdp_config f.json --bf16\n'
    knobs = read_script(text)["knobs"]
    assert (knobs["launcher"], knobs["reshard_after_forward"], knobs["offload_params"]) == ("fsdp", False, "cpu")
    assert read_script("python train.py --fsdp full_shard\n")["knobs"]["reshard_after_forward"] is True
    assert "launcher" not in read_script("python train.py --fsdp no_shard\n")["knobs"]
    # what hpcmem itself writes for an FSDP plan reads back as that plan's engine knobs
    from toolkit.jobspec import hf_trainer_args
    from toolkit.plan import Plan

    plan = Plan(launcher="fsdp", gpus_per_node=2, global_batch=16, reshard_after_forward=False, offload_params="cpu")
    back = read_script("torchrun " + " ".join(f"'{a}'" for a in hf_trainer_args(plan, "fsdp_config.json")) + "\n")
    assert {k: back["knobs"][k] for k in ("launcher", "reshard_after_forward", "offload_params")} == \
        {"launcher": "fsdp", "reshard_after_forward": False, "offload_params": "cpu"}


@pytest.mark.parametrize("extra, no_sync", [
    ("", True),  # the Trainer's default: no_sync on every micro-batch but the last
    ("""--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": true}}'""", False),
    ("""--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": false}}'""", True),
    ("""--accelerator_config '{"split_batches": true}'""", True),
    ("--accelerator_config accelerator.json", None),  # a file: not read here
    ("--accelerator_config $ACC", None),
    ("--accelerator_config '{not json'", None),
    ("""--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": "yes"}}'""", None),
    ("""--accelerator_config '{"a": """ + "[" * 3000 + "]" * 3000 + "}'", None),  # deeper than json's stack
])
def test_hf_trainer_fsdp_accumulation_says_whether_it_syncs_every_micro_batch(extra, no_sync):
    text = f'torchrun --nproc_per_node 4 run_clm.py --fsdp "full_shard auto_wrap" --gradient_accumulation_steps 4 {extra}\n'
    assert read_script(text)["runtime"] == ({} if no_sync is None else {"fsdp_no_sync": no_sync})
    # not FSDP: nothing to say
    assert read_script(text.replace('--fsdp "full_shard auto_wrap"', "--fsdp no_shard"))["runtime"] == {}
    assert read_script("python train.py --gradient_accumulation_steps 4\n")["runtime"] == {}


def test_what_hpcmem_writes_for_fsdp_accumulation_reads_back_as_syncing_every_micro_batch():
    from toolkit.jobspec import hf_trainer_args
    from toolkit.plan import Plan

    plan = Plan(launcher="fsdp", gpus_per_node=2, global_batch=16, micro_batch=2, grad_accum=4)
    back = read_script("torchrun " + " ".join(shlex.quote(a) for a in hf_trainer_args(plan, "f.json")) + "\n")
    assert back["runtime"] == {"fsdp_no_sync": False} and back["knobs"]["grad_accum"] == 4
