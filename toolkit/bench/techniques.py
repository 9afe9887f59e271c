"""The classic technique table: each technique is a change to a model's base plan.

``apply(name, base, partition)`` is pure: it returns the cell's plan, or a ``Skip`` saying
why this partition cannot run the technique (bf16 on a V100, fp16 or 8-bit AdamW without a
GPU, NVMe offload without a scratch disk). The baseline is ``vanilla`` (columns.py):
the model's plan as given (fp32, AdamW, no checkpointing, plain DDP).

Every technique keeps the global batch: ``accum`` trains the same samples per optimizer
step in smaller micro-batches, so what is learned does not change.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from ..errors import PlanError, UnknownNameError
from ..plan import Plan, with_changes
from ..sites import Partition
from ..strategies import switch_to

ACCUM_FACTOR = 4
"""``accum`` divides the micro-batch by this (at least 1 sample) and accumulates to the same global batch."""


@dataclass(frozen=True)
class Skip:
    """A cell that is not run, and why (one line a person can read in the morning)."""

    reason: str


def _accum(base: Plan, part: Partition) -> Plan:
    micro = max(1, base.micro_batch // ACCUM_FACTOR)
    while base.global_batch % (micro * base.world_size):  # keep the global batch exact
        micro -= 1
    return with_changes(base, {"micro_batch": micro})


def _mixed(precision: str) -> Callable[[Plan, Partition], Plan | Skip]:
    def change(base: Plan, part: Partition) -> Plan | Skip:
        if not part.has_gpu:
            return Skip(f"{precision}: partition {part.name} has no GPU (mixed precision is a GPU technique; "
                        "a CPU run measures nothing a GPU user needs)")
        if precision.startswith("bf16") and not part.bf16:
            return Skip(f"{precision}: partition {part.name} ({part.gpu_model}) has no bf16")
        return base.replace(precision=precision)
    return change


def _best_precision(part: Partition) -> str:
    """The mixed precision a partition's GPU runs best: bf16 where it has it, else fp16; fp32 without a GPU."""
    if not part.has_gpu:
        return "fp32"
    return "bf16-mixed" if part.bf16 else "fp16-mixed"


def has_bitsandbytes() -> bool:
    """Whether bitsandbytes (8-bit AdamW) is installed in this Python (the nodes are assumed to share it)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def _adamw_8bit(base: Plan, part: Partition) -> Plan | Skip:
    if not part.has_gpu:
        return Skip(f"adamw-8bit: partition {part.name} has no GPU (bitsandbytes' 8-bit AdamW runs on CUDA only)")
    if not has_bitsandbytes():
        return Skip("adamw-8bit: bitsandbytes is not installed (pip install bitsandbytes)")
    return base.replace(optimizer="adamw-8bit")


def _all_together(base: Plan, part: Partition) -> Plan:
    lean = "adamw-8bit" if part.has_gpu and has_bitsandbytes() else "adafactor"
    return _accum(base, part).replace(checkpointing=True, precision=_best_precision(part), optimizer=lean)


def _zero(stage: int, offload: str = "none") -> Callable[[Plan, Partition], Plan | Skip]:
    def change(base: Plan, part: Partition) -> Plan | Skip:
        if offload == "nvme" and not part.nvme_path:
            return Skip(f"zero3-offload-nvme: partition {part.name} has no nvme_path (node-local scratch)")
        return with_changes(base, {**switch_to("deepspeed"), "zero_stage": stage, "offload_optimizer": offload,
                                   "offload_params": offload})
    return change


def _fsdp(reshard: bool = True, offload: str = "none") -> Callable[[Plan, Partition], Plan | Skip]:
    def change(base: Plan, part: Partition) -> Plan | Skip:
        return with_changes(base, {**switch_to("fsdp"), "reshard_after_forward": reshard, "offload_params": offload})
    return change


TECHNIQUES: dict[str, Callable[[Plan, Partition], Plan | Skip]] = {
    "vanilla": lambda base, part: base,
    "accum": _accum,
    "accum+ckpt": lambda base, part: _accum(base, part).replace(checkpointing=True),
    "fp16-mixed": _mixed("fp16-mixed"),
    "bf16-mixed": _mixed("bf16-mixed"),
    "adamw-8bit": _adamw_8bit,
    "adafactor": lambda base, part: base.replace(optimizer="adafactor"),
    "all-together": _all_together,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _zero(3),
    "zero3-offload-cpu": _zero(3, "cpu"),
    "zero3-offload-nvme": _zero(3, "nvme"),
    "fsdp-noreshard": _fsdp(reshard=False),
    "fsdp": _fsdp(),
    "fsdp-offload-cpu": _fsdp(offload="cpu"),
}
"""The table, in the order a report lists it (vanilla first: the baseline)."""

NAMES = tuple(TECHNIQUES)


def apply(name: str, base: Plan, partition: Partition) -> Plan | Skip:
    """The plan of technique ``name`` on ``partition`` from the model's ``base`` plan, or why it is skipped.

    A plan the partition refuses (``Partition.check_plan``: too many ranks, too much --mem, ...)
    is a Skip naming the knob, not an error: the rest of the matrix still runs.
    """
    if name not in TECHNIQUES:
        raise UnknownNameError("technique", name, NAMES)
    plan = TECHNIQUES[name](base, partition)
    if isinstance(plan, Skip):
        return plan
    try:
        partition.check_plan(plan)
    except PlanError as exc:
        return Skip(f"{name}: {exc}")
    return plan
