"""toolkit.runtime.adapters: the plan in HF Trainer and Accelerate terms (checked against the real classes)."""

import json
import warnings

import pytest

from toolkit.errors import HpcmemError
from toolkit.plan import Plan
from toolkit.runtime import accelerate_kwargs, hf_model_kwargs, hf_training_args


@pytest.mark.parametrize("precision, bf16, fp16", [
    ("fp32", False, False), ("fp16-mixed", False, True), ("bf16-mixed", True, False), ("bf16-true", True, False),
])
def test_hf_training_args_precision(precision, bf16, fp16):
    args = hf_training_args(Plan(precision=precision), cpu=True)
    assert (args["bf16"], args["fp16"]) == (bf16, fp16)
    assert args["use_cpu"] is True


@pytest.mark.parametrize("optimizer, optim", [
    ("adamw", "adamw_torch"), ("adamw-8bit", "adamw_bnb_8bit"), ("adafactor", "adafactor"), ("sgd", "sgd"),
])
def test_hf_training_args_optimizer_names(optimizer, optim):
    from transformers.training_args import OptimizerNames

    args = hf_training_args(Plan(optimizer=optimizer), cpu=False)
    assert args["optim"] == optim
    assert optim in {o.value for o in OptimizerNames}
    assert "use_cpu" not in args


def test_hf_training_args_batch_checkpointing_deepspeed(tmp_path):
    plan = Plan(launcher="deepspeed", zero_stage=3, gpus_per_node=2, micro_batch=2, grad_accum=4,
                global_batch=16, checkpointing=True)
    args = hf_training_args(plan, ds_config_path=tmp_path / "ds.json", cpu=True)
    assert args["per_device_train_batch_size"] == 2
    assert args["gradient_accumulation_steps"] == 4
    assert args["gradient_checkpointing"] is True
    assert args["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert args["deepspeed"] == str(tmp_path / "ds.json")


def test_hf_training_args_deepspeed_path_from_env(monkeypatch, tmp_path):
    plan = Plan(launcher="deepspeed", zero_stage=1)
    monkeypatch.delenv("HPCMEM_DS_CONFIG", raising=False)
    with pytest.raises(HpcmemError, match="HPCMEM_DS_CONFIG"):
        hf_training_args(plan, cpu=True)
    monkeypatch.setenv("HPCMEM_DS_CONFIG", str(tmp_path / "ds_config.json"))
    assert hf_training_args(plan, cpu=True)["deepspeed"] == str(tmp_path / "ds_config.json")


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "sgd"])
def test_transformers_accepts_the_training_args(tmp_path, precision, optimizer):
    from transformers import TrainingArguments

    plan = Plan(precision=precision, optimizer=optimizer, checkpointing=True, grad_accum=2, global_batch=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames gradient_checkpointing
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], **hf_training_args(plan))
    assert args.per_device_train_batch_size == 8
    assert args.gradient_accumulation_steps == 2
    assert args.bf16 == precision.startswith("bf16")
    assert args.optim.value == {"adamw": "adamw_torch", "adafactor": "adafactor", "sgd": "sgd"}[optimizer]


@pytest.mark.parametrize("precision, mixed", [
    ("fp32", "no"), ("fp16-mixed", "fp16"), ("bf16-mixed", "bf16"), ("bf16-true", "no"),
])
def test_accelerate_kwargs(precision, mixed):
    kwargs = accelerate_kwargs(Plan(precision=precision, grad_accum=2, global_batch=16))
    assert kwargs == {"mixed_precision": mixed, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_accelerate_accepts_the_kwargs(precision):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    try:
        acc = Accelerator(**accelerate_kwargs(Plan(precision=precision, grad_accum=2, global_batch=16)))
        assert acc.gradient_accumulation_steps == 2
        assert acc.mixed_precision == {"fp32": "no", "bf16-mixed": "bf16"}[precision]
    finally:
        AcceleratorState._reset_state(True)


def test_accelerate_kwargs_deepspeed_plugin(tmp_path):
    import json

    from toolkit.strategies.deepspeed import deepspeed_config

    plan = Plan(launcher="deepspeed", zero_stage=3, precision="bf16-mixed", grad_accum=2, global_batch=16)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(deepspeed_config(plan, gpu=False)))
    kwargs = accelerate_kwargs(plan, path)
    assert kwargs["mixed_precision"] == "bf16"
    assert "gradient_accumulation_steps" not in kwargs  # the DeepSpeed config owns it
    plugin = kwargs["deepspeed_plugin"]
    assert plugin.zero_stage == 3 and plugin.zero3_init_flag is True
    assert plugin.gradient_accumulation_steps == 2


def test_hf_model_kwargs():
    assert hf_model_kwargs(Plan()) == {"attn_implementation": "sdpa"}
    assert hf_model_kwargs(Plan(attention="flash", precision="bf16-true")) == {
        "attn_implementation": "flash_attention_2", "dtype": "bfloat16"}
    assert hf_model_kwargs(Plan(attention="eager"))["attn_implementation"] == "eager"


def test_fsdp_plan_for_accelerate_hf_and_fabric(tmp_path):
    """FSDP's arguments in each framework's words: a real accelerate plugin, HF TrainingArguments' fsdp and
    fsdp_config (with checkpointing by the config, not the Trainer's flag), Lightning Fabric's FSDPStrategy."""
    from accelerate import FullyShardedDataParallelPlugin

    from toolkit.runtime import fabric_kwargs

    plan = Plan(launcher="fsdp", gpus_per_node=2, global_batch=16, micro_batch=4, grad_accum=2,
                precision="bf16-mixed", reshard_after_forward=False, offload_params="cpu", checkpointing=True)
    cfg = tmp_path / "fsdp_config.json"
    cfg.write_text(json.dumps(plan.strategy.config(plan)))
    kwargs = accelerate_kwargs(plan, cfg)
    plugin = kwargs["fsdp_plugin"]
    assert isinstance(plugin, FullyShardedDataParallelPlugin) and plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False and plugin.activation_checkpointing is True
    # accumulation reduce-scatters every micro-batch, as hpcmem's runtime and estimate do (no FSDP no_sync)
    accumulation = kwargs["gradient_accumulation_plugin"]
    assert (accumulation.num_steps, accumulation.sync_each_batch) == (2, True)
    assert "gradient_accumulation_steps" not in kwargs and kwargs["mixed_precision"] == "bf16"
    args = hf_training_args(plan, cfg, cpu=True)
    assert args["fsdp"] == "shard_grad_op auto_wrap offload" and args["fsdp_config"] == str(cfg)
    assert args["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    one = plan.replace(grad_accum=1, global_batch=8)
    assert "accelerator_config" not in hf_training_args(one, cfg, cpu=True)
    assert "--accelerator_config" not in one.strategy.trainer_flags(one, str(cfg))
    assert args["gradient_checkpointing"] is False  # FSDP's own activation checkpointing (fsdp_config) instead
    assert json.loads(cfg.read_text())["mixed_precision_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}

    class Block:  # stands in for a model's transformer block class
        pass

    fabric = fabric_kwargs(plan, {Block})
    assert (fabric["strategy"], fabric["precision"], fabric["devices"]) == ("fsdp", "bf16-mixed", 2)
    assert fabric["strategy_kwargs"] == {"sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": True,
                                         "auto_wrap_policy": {Block}, "activation_checkpointing_policy": {Block}}
    ds = fabric_kwargs(Plan(launcher="deepspeed", zero_stage=3, offload_params="cpu", offload_optimizer="cpu"))
    assert ds["strategy_kwargs"] == {"stage": 3, "offload_optimizer": True, "offload_parameters": True}


def test_hf_trainer_reads_hpcmems_fsdp_accumulation_setting(tmp_path):
    """The HF Trainer command line hpcmem writes for an FSDP plan with accumulation parses into TrainingArguments
    whose accelerator config asks for a gradient sync on every micro-batch (what the estimate assumes), and the
    Trainer's gradient state carries it to the check its accumulation loop makes before it would enter no_sync
    (here without FSDP itself, which needs more than one process)."""
    import torch
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    plan = Plan(launcher="fsdp", gpus_per_node=2, global_batch=16, micro_batch=4, grad_accum=2)
    flags = plan.strategy.trainer_flags(plan, None)
    at = flags.index("--accelerator_config")
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "--gradient_accumulation_steps", "2",
         *flags[at:at + 2]])
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    try:
        assert trainer.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
