"""The plan offered to training code in the words of its framework.

``hf_training_args`` gives keyword arguments for ``transformers.TrainingArguments``,
``accelerate_kwargs`` for ``accelerate.Accelerator``, ``fabric_kwargs`` for ``lightning.Fabric``,
``hf_model_kwargs`` for ``from_pretrained``/``from_config``. They read the plan and return dicts; what
differs by engine (DeepSpeed's config, FSDP's plugin) comes from the plan's strategy.
"""

from __future__ import annotations

import os
from typing import Any

from .. import optimizers
from ..errors import HpcmemError
from ..models import HF_ATTENTION
from ..plan import Plan

# Plan precision -> accelerate mixed_precision. bf16-true keeps the model itself in
# bf16 (hf_model_kwargs), so there is nothing left to autocast.
ACCELERATE_PRECISION = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "no"}


def hf_training_args(plan: Plan, ds_config_path: str | os.PathLike | None = None,
                     cpu: bool | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` that apply ``plan``.

    ``ds_config_path`` is the engine's config file (ds_config.json, fsdp_config.json; default: the path in
    the strategy's environment variable, ``HPCMEM_DS_CONFIG`` or ``HPCMEM_FSDP_CONFIG``). ``cpu``: the job has no GPU (default: asks torch); then
    ``use_cpu`` is set, without which TrainingArguments refuses bf16. bf16-true also
    needs the model loaded in bf16: see ``hf_model_kwargs``.
    """
    args: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_checkpointing": plan.checkpointing and not plan.strategy.checkpointing_by_config,
        "bf16": plan.precision in ("bf16-mixed", "bf16-true"),
        "fp16": plan.precision == "fp16-mixed",
        "optim": optimizers.hf_optim(plan.optimizer),
        "dataloader_num_workers": plan.workers,
    }
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    if cpu:
        args["use_cpu"] = True
    if args["gradient_checkpointing"]:
        # Non-reentrant checkpointing works with DDP's no_sync and with ZeRO-3.
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if plan.strategy.config_file:
        args.update(plan.strategy.training_args(plan, str(ds_config_path or _config_from_env(plan))))
    return args


def accelerate_kwargs(plan: Plan, ds_config_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` that apply ``plan``.

    With the deepspeed launcher this includes a ``deepspeed_plugin`` built from the
    ds_config.json (which then owns accumulation, so it is not passed twice); with fsdp an
    ``fsdp_plugin`` (FSDP2: the plan's resharding, offload, checkpointing and mixed precision).
    """
    config = str(ds_config_path or _config_from_env(plan)) if plan.launcher == "deepspeed" else ds_config_path
    return {"mixed_precision": ACCELERATE_PRECISION[plan.precision], **plan.strategy.accelerate_kwargs(plan, config)}


FABRIC_PRECISION = {"fp32": "32-true", "fp16-mixed": "16-mixed", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}


def fabric_kwargs(plan: Plan, block_classes: set | None = None) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Fabric``: precision, devices and the engine's strategy: its name under
    ``strategy`` and the arguments of Lightning's DDPStrategy / DeepSpeedStrategy / FSDPStrategy under
    ``strategy_kwargs`` (build the strategy with them). For FSDP, ``block_classes`` (the model's transformer
    block classes) become its ``auto_wrap_policy`` and, with checkpointing, ``activation_checkpointing_policy``."""
    out = {"precision": FABRIC_PRECISION[plan.precision], "devices": plan.gpus_per_node, "num_nodes": plan.nodes,
           **plan.strategy.fabric_kwargs(plan)}
    if block_classes and plan.launcher == "fsdp":
        out["strategy_kwargs"]["auto_wrap_policy"] = set(block_classes)
        if plan.checkpointing:
            out["strategy_kwargs"]["activation_checkpointing_policy"] = set(block_classes)
    return out


def hf_model_kwargs(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``AutoModel*.from_pretrained`` / ``from_config``: attention and, for bf16-true, dtype."""
    kwargs: dict[str, Any] = {"attn_implementation": HF_ATTENTION[plan.attention]}
    if plan.precision == "bf16-true":
        kwargs["dtype"] = "bfloat16"
    return kwargs


def _config_from_env(plan: Plan) -> str:
    var = plan.strategy.env_var
    path = os.environ.get(var, "").strip()
    if not path:
        raise HpcmemError(f"launcher={plan.launcher} needs its {plan.strategy.config_file}: pass its path or set {var}")
    return path
