"""The plan offered to training code in the words of its framework.

``hf_training_args`` gives keyword arguments for ``transformers.TrainingArguments``,
``accelerate_kwargs`` for ``accelerate.Accelerator``, ``hf_model_kwargs`` for
``from_pretrained``/``from_config``. All pure: they read the plan and return dicts.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import HpcmemError
from ..plan import Plan

# Plan optimizer -> TrainingArguments.optim (transformers.training_args.OptimizerNames).
HF_OPTIM = {"adamw": "adamw_torch", "adamw-8bit": "adamw_bnb_8bit", "adafactor": "adafactor", "sgd": "sgd"}

# Plan attention -> transformers attn_implementation.
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}

# Plan precision -> accelerate mixed_precision. bf16-true keeps the model itself in
# bf16 (hf_model_kwargs), so there is nothing left to autocast.
ACCELERATE_PRECISION = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "no"}


def hf_training_args(plan: Plan, ds_config_path: str | os.PathLike | None = None,
                     cpu: bool | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` that apply ``plan``.

    ``ds_config_path`` is the ds_config.json for the deepspeed launcher (default:
    ``HPCMEM_DS_CONFIG``). ``cpu``: the job has no GPU (default: asks torch); then
    ``use_cpu`` is set, without which TrainingArguments refuses bf16. bf16-true also
    needs the model loaded in bf16: see ``hf_model_kwargs``.
    """
    args: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_checkpointing": plan.checkpointing,
        "bf16": plan.precision in ("bf16-mixed", "bf16-true"),
        "fp16": plan.precision == "fp16-mixed",
        "optim": HF_OPTIM[plan.optimizer],
        "dataloader_num_workers": plan.workers,
    }
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    if cpu:
        args["use_cpu"] = True
    if plan.checkpointing:
        # Non-reentrant checkpointing works with DDP's no_sync and with ZeRO-3.
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if plan.uses_deepspeed:
        args["deepspeed"] = str(ds_config_path or _ds_config_from_env())
    return args


def accelerate_kwargs(plan: Plan, ds_config_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` that apply ``plan``.

    With the deepspeed launcher this includes a ``deepspeed_plugin`` built from the
    ds_config.json (which then owns accumulation, so it is not passed twice).
    """
    kwargs: dict[str, Any] = {"mixed_precision": ACCELERATE_PRECISION[plan.precision]}
    if plan.uses_deepspeed:
        from accelerate import DeepSpeedPlugin

        # zero3_init_flag: build ZeRO-3 models partitioned instead of whole on every rank.
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=str(ds_config_path or _ds_config_from_env()),
                                                     zero3_init_flag=plan.zero_stage == 3)
    else:
        kwargs["gradient_accumulation_steps"] = plan.grad_accum
    return kwargs


def hf_model_kwargs(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``AutoModel*.from_pretrained`` / ``from_config``: attention and, for bf16-true, dtype."""
    kwargs: dict[str, Any] = {"attn_implementation": HF_ATTENTION[plan.attention]}
    if plan.precision == "bf16-true":
        kwargs["dtype"] = "bfloat16"
    return kwargs


def _ds_config_from_env() -> str:
    from .jobenv import ENV_DS_CONFIG

    path = os.environ.get(ENV_DS_CONFIG, "").strip()
    if not path:
        raise HpcmemError(f"launcher=deepspeed needs a DeepSpeed config: pass its path or set {ENV_DS_CONFIG}")
    return path
