"""The DeepSpeed JSON config for a plan (pure).

Batch fields come straight from the plan, so DeepSpeed's own check
``train_batch_size == micro * accum * world`` holds by the plan's invariant.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan

# Buffers DeepSpeed stages parameters through when they live on NVMe. One buffer
# must hold the largest single parameter; they are allocated up front (count x size
# x element bytes per rank), so they are sized to the model when it is known.
NVME_PARAM_BUFFER_DEFAULT = 100_000_000  # DeepSpeed's own default, when the model is unknown
NVME_PARAM_BUFFER_MIN = 1_000_000
NVME_PARAM_BUFFERS = 5
# Parameters kept in CPU memory at once when the rest is on NVMe (elements).
NVME_MAX_IN_CPU = 1_000_000_000

# Used when the config owns the optimizer (ZeRO-Offload): DeepSpeed then builds
# its CPU Adam, much faster than torch's AdamW stepping on the host.
ADAMW_PARAMS = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def deepspeed_config(plan: Plan, nvme_path: str | None = None, gpu: bool = True,
                     largest_param: int | None = None) -> dict[str, Any]:
    """The ds_config.json dict for ``plan``.

    ``nvme_path`` is the partition's NVMe scratch directory (needed when anything is
    offloaded to NVMe); ``gpu`` says whether the ranks have GPUs (pinned host memory
    only makes sense with one); ``largest_param`` (elements) sizes the NVMe parameter
    buffers.
    """
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(plan, nvme_path, gpu, largest_param),
    }
    if plan.precision == "fp16-mixed":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    elif plan.precision == "bf16-mixed" or (plan.precision == "bf16-true" and plan.zero_stage == 0):
        cfg["bf16"] = {"enabled": True}
    elif plan.precision == "bf16-true":
        # No fp32 master copy: bf16 weights, grads and optimizer states (DeepSpeed allows it from ZeRO 1 on).
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    if plan.offload_optimizer != "none":
        if plan.optimizer == "adamw":
            cfg["optimizer"] = {"type": "AdamW", "params": dict(ADAMW_PARAMS)}
        else:
            # The training code brings its own optimizer (8-bit AdamW, Adafactor, SGD).
            cfg["zero_force_ds_cpu_optimizer"] = False
    if plan.zero_stage >= 1 and plan.optimizer != "adamw":
        cfg["zero_allow_untested_optimizer"] = True  # ZeRO otherwise refuses SGD and Adafactor
    if "nvme" in (plan.offload_optimizer, plan.offload_params):
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                      "single_submit": False, "overlap_events": True}
    if plan.checkpointing:
        cfg["activation_checkpointing"] = {"partition_activations": plan.zero_stage == 3 and plan.world_size > 1,
                                           "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False,
                                           "synchronize_checkpoint_boundary": False}
    return cfg


def _zero_section(plan: Plan, nvme_path: str | None, gpu: bool, largest_param: int | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage == 0:
        return zero
    zero.update({"contiguous_gradients": True, "overlap_comm": gpu,
                 "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000})
    if plan.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": 50_000_000,
                     "stage3_param_persistence_threshold": 100_000,
                     "stage3_max_live_parameters": 1_000_000_000,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(plan.offload_optimizer, nvme_path, gpu, buffers=4)
    if plan.offload_params != "none":
        zero["offload_param"] = _offload(plan.offload_params, nvme_path, gpu, buffers=NVME_PARAM_BUFFERS)
        if plan.offload_params == "nvme":
            zero["offload_param"].update({"buffer_size": nvme_buffer_elements(largest_param), "max_in_cpu": NVME_MAX_IN_CPU})
    return zero


def nvme_buffer_elements(largest_param: int | None) -> int:
    """One NVMe parameter buffer: the largest parameter, rounded up to a million elements."""
    if not largest_param:
        return NVME_PARAM_BUFFER_DEFAULT
    return max(NVME_PARAM_BUFFER_MIN, -(-int(largest_param) // 1_000_000) * 1_000_000)


def _offload(device: str, nvme_path: str | None, gpu: bool, buffers: int) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": gpu}
    if device == "nvme":
        if not nvme_path:
            from .errors import PlanError
            raise PlanError("offload to nvme needs the partition's nvme_path")
        section.update({"nvme_path": nvme_path, "buffer_count": buffers})
    return section
