"""The words and the lines of a remedy: its title, and what changes in the job script, the DeepSpeed
config and the HF Trainer arguments between two plans (pure; diffs of what hpcmem itself would write)."""

from __future__ import annotations

import json
import shlex
from typing import Any, Mapping

from ..jobspec import hf_trainer_args
from ..plan import Plan
from ..render import cpus_per_task
from ..sites import Partition, format_minutes
from ..strategies.fsdp import with_sync_each_batch
from .scriptread import json_object, sync_each_batch

DS_CONFIG = "ds_config.json"
"""The path hpcmem's Trainer flags name when showing what changes (the engine's own file name otherwise)."""

# --------------------------------------------------------------------------- words


_PRECISION = {"fp16-mixed": "fp16 mixed precision (loss scaling)", "bf16-mixed": "bf16 mixed precision",
              "fp32": "fp32", "bf16-true": "pure bf16"}
_ATTENTION = {"flash": "flash attention", "sdpa": "memory-efficient attention (SDPA)", "eager": "eager attention"}
_OPTIMIZER = {"adamw": "AdamW", "adamw-8bit": "8-bit AdamW", "adafactor": "Adafactor", "sgd": "SGD"}


def title(before: Plan, after: Plan) -> str:
    """What changes from ``before`` to ``after``, in words ("Micro-batch 8 -> 2 with grad_accum 1 -> 4 (same
    global batch) + activation checkpointing")."""
    b, a = before, after
    parts = []
    if a.alloc_conf != b.alloc_conf:
        parts.append(f"PYTORCH_CUDA_ALLOC_CONF={a.alloc_conf or '(default)'}")
    if a.precision != b.precision:
        parts.append(_PRECISION[a.precision])
    if a.attention != b.attention:
        parts.append(_ATTENTION[a.attention])
    if a.seq_len != b.seq_len:
        parts.append(f"sequence length {b.seq_len} -> {a.seq_len}")
    if a.world_size != b.world_size:
        parts.append(f"{b.gpus_per_node} -> {a.gpus_per_node} GPUs per node, micro-batch {b.micro_batch} -> "
                     f"{a.micro_batch} with grad_accum {b.grad_accum} -> {a.grad_accum} (same global batch)")
    elif a.micro_batch != b.micro_batch:
        parts.append(f"micro-batch {b.micro_batch} -> {a.micro_batch} with grad_accum {b.grad_accum} -> "
                     f"{a.grad_accum} (same global batch)")
    if a.checkpointing != b.checkpointing:
        parts.append("activation checkpointing" if a.checkpointing else "no activation checkpointing")
    if a.optimizer != b.optimizer:
        parts.append(_OPTIMIZER[a.optimizer])
    if a.zero_stage != b.zero_stage:
        engine = " (DeepSpeed)" if a.launcher != b.launcher else ""
        parts.append(f"ZeRO stage {b.zero_stage} -> {a.zero_stage}{engine}")
    for knob, what in (("offload_optimizer", "optimizer state"), ("offload_params", "parameters")):
        old, new = getattr(b, knob), getattr(a, knob)
        if old != new:
            parts.append(f"{what} back on the GPU" if new == "none" else f"{what} offloaded to {new.upper()}"
                         if new == "nvme" else f"{what} offloaded to the {new.upper()}")
    if a.mem_mib != b.mem_mib:
        parts.append(f"--mem {_mem(b.mem_mib)} -> {_mem(a.mem_mib)}")
    if a.workers != b.workers:
        parts.append(f"data-loader workers {b.workers} -> {a.workers}")
    text = " + ".join(parts) or "No change"
    return text if text.startswith(("fp", "bf")) else text[0].upper() + text[1:]


def _mem(mib: int | None) -> str:
    return "default" if mib is None else f"{mib}M"


def slowdown_text(x: float | None) -> str:
    """1.33 -> "33 % slower", 0.5 -> "2.0x faster", 1.0 -> "same speed", None -> "unknown"."""
    if x is None:
        return "unknown"
    if abs(x - 1.0) < 0.005:
        return "same speed"
    return f"{(x - 1) * 100:.0f} % slower" if x > 1 else f"{1 / x:.1f}x faster"


# --------------------------------------------------------------------------- the lines that change


def _sbatch(plan: Plan, partition: Partition) -> dict[str, str | None]:
    """The #SBATCH values hpcmem renders (``render.directives``) that a plan changes."""
    out: dict[str, str | None] = {"--nodes": str(plan.nodes)}
    if partition.has_gpu:
        n = plan.gpus_per_node
        out["--gpus-per-node"] = f"{partition.gres_type}:{n}" if partition.gres_type else str(n)
    out["--cpus-per-task"] = str(cpus_per_task(partition, plan))
    out["--time"] = format_minutes(plan.time_min)
    mem = plan.mem_mib or partition.default_mem_mib
    out["--mem"] = f"{mem}M" if mem else None
    return out


def script_changes(old: Plan, new: Plan, partition: Partition) -> tuple[str, ...]:
    """Job-script lines that change from ``old`` to ``new``: #SBATCH values, the allocator setting, the
    launcher and its process count, data-loader workers."""
    out = []
    before, after = _sbatch(old, partition), _sbatch(new, partition)
    for flag in after:
        if before[flag] != after[flag]:
            out.append(f"#SBATCH {flag}={before[flag] or '(not set)'} -> {after[flag] or '(not set)'}")
    if old.alloc_conf != new.alloc_conf:
        out.append(f"export PYTORCH_CUDA_ALLOC_CONF={old.alloc_conf or '(not set)'} -> {new.alloc_conf or '(not set)'}")
    if old.launcher != new.launcher:
        engine = new.strategy
        config = f" with {engine.config_file}" if engine.config_file else ""
        out.append(f"launcher: {old.launcher} -> {new.launcher} ({engine.title}{config}; the training code must use it)")
    if old.gpus_per_node != new.gpus_per_node:
        out.append(f"torchrun --nproc_per_node={old.gpus_per_node} -> {new.gpus_per_node}")
    if old.workers != new.workers:
        out.append(f"data-loader workers per rank (DataLoader num_workers): {old.workers} -> {new.workers}")
    return tuple(out)


def ds_config_changes(old: Plan, new: Plan, partition: Partition, largest_param: int | None = None) -> tuple[str, ...]:
    """Keys (dotted) of the engine's config file (ds_config.json, fsdp_config.json) that change between what
    hpcmem writes for ``old`` and for ``new``; () when neither engine has one. A file that is new (torchrun ->
    deepspeed or fsdp) is said so, then its main keys."""
    configs = [p.strategy.config(p, nvme_path=partition.nvme_path, gpu=partition.has_gpu, largest_param=largest_param)
               for p in (old, new)]
    if configs == [None, None]:
        return ()
    if old.strategy.config_file != new.strategy.config_file and configs[0] is not None:
        configs[0] = None  # another engine's file: the new one is written from scratch
    before, after = (_flat(c) if c is not None else {} for c in configs)
    out = [] if before else [f"{new.strategy.config_file}: (not used) -> written by hpcmem for launcher={new.launcher}"]
    changed = [k for k in sorted(set(before) | set(after)) if before.get(k, _ABSENT) != after.get(k, _ABSENT)]
    main = [k for k in changed if k.endswith(_MAIN_KEYS)]
    out += [f"{k}: {_value(before.get(k, _ABSENT))} -> {_value(after.get(k, _ABSENT))}" for k in main]
    if len(changed) > len(main):
        out.append(f"and {len(changed) - len(main)} settings that follow from these (hpcmem render writes them all)")
    return tuple(out)


_MAIN_KEYS = ("stage", "device", "enabled", "nvme_path", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "zero_allow_untested_optimizer", "partition_activations",
              "reshard_after_forward", "cpu_offload", "activation_checkpointing", "param_dtype", "reduce_dtype")
"""Keys listed by name; the others (buffer sizes, aio, stage-3 tuning) are hpcmem's fixed settings."""


_ABSENT = object()


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _value(value: Any) -> str:
    if value is _ABSENT:
        return "(not set)"
    return value if isinstance(value, str) else json.dumps(value)


AS_HPCMEM_WRITES = object()
"""``trainer_arg_changes``'s default: the job's flags are the ones hpcmem writes for the old plan."""
ACCELERATOR_CONFIG = "--accelerator_config"


def trainer_arg_changes(old: Plan, new: Plan, *, accelerator_config: Any = AS_HPCMEM_WRITES) -> tuple[str, ...]:
    """HF Trainer flags (``jobspec.hf_trainer_args``) that change: the new flag and its value as a shell takes it
    (``--fsdp 'full_shard auto_wrap'``), or ``drop FLAG``.

    ``accelerator_config``: the job's own ``--accelerator_config`` as written (None: it gave none), where its flags
    were read (``KnownPlan.accelerator_config``). The Trainer takes only the last one given, so the gradient sync
    hpcmem asks for with accumulation under FSDP is merged into the job's JSON (said as a setting where the job's is
    a file), nothing is said where the job's already asks for it, and the job's own is never dropped."""
    before, after = _flags(hf_trainer_args(old, DS_CONFIG)), _flags(hf_trainer_args(new, DS_CONFIG))
    extra = []
    if accelerator_config is not AS_HPCMEM_WRITES:
        before.pop(ACCELERATOR_CONFIG, None)
        if after.pop(ACCELERATOR_CONFIG, None) is not None and not sync_each_batch(accelerator_config):
            written = {} if accelerator_config is None else json_object(accelerator_config)
            if written is not None:
                after[ACCELERATOR_CONFIG] = json.dumps(with_sync_each_batch(written))
            else:
                extra.append(f"set {json.dumps(with_sync_each_batch())} in the job's {ACCELERATOR_CONFIG} "
                             f"{shlex.quote(accelerator_config)}")
    out = [f"{flag} {shlex.quote(value)}" if value else flag
           for flag, value in after.items() if before.get(flag) != value]
    out += [f"drop {flag}" for flag in before if flag not in after]
    return tuple(out + extra)


def _flags(args: list[str]) -> dict[str, str]:
    """``["--a", "1", "--b"]`` -> ``{"--a": "1", "--b": ""}``."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else ""
            out[arg] = "" if nxt.startswith("--") else nxt
    return out
