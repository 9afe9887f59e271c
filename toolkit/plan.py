"""Plan: the knobs of one attempt.

A plan is what the controller changes between attempts and what the job runtime
applies. Its field names are the knob names everywhere: ``--set knob=value``,
plan.json, the ledger, the estimator. Invariant:
``micro_batch * grad_accum * world_size == global_batch``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from . import optimizers, strategies
from .errors import PlanError, UnknownNameError

LAUNCHERS = strategies.names()
"""torchrun (DDP), deepspeed, fsdp: one registered strategy each (toolkit/strategies/)."""
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
OPTIMIZERS = optimizers.names()
"""The rows of the optimizer table (toolkit/optimizers.py)."""
ATTENTIONS = ("eager", "sdpa", "flash")
OFFLOADS = ("none", "cpu", "nvme")

LIMITS = {"nodes": (1, 100_000), "gpus_per_node": (1, 4096), "global_batch": (1, 2**40), "micro_batch": (1, 2**40),
          "grad_accum": (1, 2**40), "seq_len": (1, 2**31), "time_min": (1, 366 * 1440), "mem_mib": (1, 2**40),
          "workers": (0, 1024), "zero_stage": (0, 3)}
"""Every integer knob -> (least, most). The upper bounds are far beyond any real job; they keep values read
from untrusted files (a plan.json beside a log, ``--set``) from driving loops and arithmetic for minutes."""

ALLOC_CONF_OPTIONS = ("backend", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
                      "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc",
                      "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                      "pinned_num_register_threads", "pinned_use_background_threads", "pinned_reserve_segment_size_mb",
                      "pinned_free_catch_all", "graph_capture_record_stream_reuse", "per_process_memory_fraction",
                      "throw_on_cudamalloc_oom")
"""The option names PyTorch's caching allocator reads from PYTORCH_CUDA_ALLOC_CONF (c10/core/AllocatorConfig.h and
c10/cuda/CUDAAllocatorConfig.h of torch 2.x)."""
_ALLOC_VALUE = re.compile(r"[A-Za-z0-9_.]+|\[[0-9>: ,]+\]", re.ASCII)
MAX_ALLOC_CONF = 1024


@dataclass(frozen=True)
class Plan:
    """The knobs of one attempt (sizes in samples, memory in MiB, time in minutes)."""

    launcher: str = "torchrun"
    """Training engine: ``torchrun`` (DDP), ``deepspeed`` (DeepSpeed engine, ZeRO) or ``fsdp`` (PyTorch FSDP2)."""
    nodes: int = 1
    """Nodes of the allocation."""
    gpus_per_node: int = 1
    """Ranks per node: GPUs on a GPU partition, processes on a CPU partition."""
    global_batch: int = 8
    """Samples per optimizer step over all ranks (the effective batch; never changed by retries)."""
    micro_batch: int = 8
    """Samples per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    seq_len: int = 128
    """Tokens per sample."""
    precision: str = "fp32"
    """fp32, fp16-mixed (loss scaling), bf16-mixed or bf16-true (bf16 weights, no fp32 master copy)."""
    optimizer: str = "adamw"
    """A row of toolkit/optimizers.py: adamw (torch foreach), adamw-fused, adamw-perparam, adamw-8bit, adafactor, sgd..."""
    checkpointing: bool = False
    """Activation (gradient) checkpointing."""
    attention: str = "sdpa"
    """eager (stores the attention matrix), sdpa or flash."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (launcher=deepspeed)."""
    offload_optimizer: str = "none"
    """Optimizer state offload: none, cpu or nvme (launcher=deepspeed, ZeRO >= 1; nvme needs ZeRO 3)."""
    offload_params: str = "none"
    """Parameter offload: none, cpu or nvme (deepspeed: ZeRO 3); fsdp: cpu offloads parameters, gradients and
    optimizer state together (CPUOffloadPolicy)."""
    reshard_after_forward: bool = True
    """launcher=fsdp: free each block's gathered weights after its forward (ZeRO-3-like) or keep them for the
    backward (false: ZeRO-2-like, faster, more memory)."""
    reduce_dtype: str = "fp32"
    """launcher=fsdp under mixed precision: gradients are reduced in fp32, or in the 16-bit param dtype (param)."""
    mem_mib: int | None = None
    """Host memory requested per node (Slurm --mem) in MiB; None: the partition's default."""
    time_min: int = 30
    """Wall-clock limit in minutes (Slurm --time)."""
    alloc_conf: str = ""
    """PYTORCH_CUDA_ALLOC_CONF for the job ("" leaves the allocator default)."""
    workers: int = 0
    """Data-loader worker processes per rank."""

    def __post_init__(self):
        for name, choices in CHOICES.items():
            _check_choice(name, getattr(self, name), choices)
        for name, kind in _TYPES.items():
            _check_type(name, kind, getattr(self, name))
        for name, (least, most) in LIMITS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if value < least:
                raise PlanError(f"{name} must be at least {least}, got {value}")
            if value > most:
                raise PlanError(f"{name} must be at most {most}, got {value}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        check_alloc_conf(self.alloc_conf)
        if self.micro_batch * self.grad_accum * self.world_size != self.global_batch:
            raise PlanError(
                f"micro_batch {self.micro_batch} x grad_accum {self.grad_accum} x world_size {self.world_size} "
                f"= {self.micro_batch * self.grad_accum * self.world_size}, not global_batch {self.global_batch}"
            )
        engine = strategies.get(self.launcher)
        for other in strategies.all_strategies():
            for knob in other.own_knobs:
                if other is not engine and getattr(self, knob) != _DEFAULTS[knob]:
                    raise PlanError(f"{knob}={getattr(self, knob)} needs launcher={other.name} "
                                    f"(launcher={self.launcher} runs {engine.title})")
        engine.validate(self)

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def strategy(self) -> strategies.Strategy:
        """The training engine that runs this plan (toolkit/strategies/)."""
        return strategies.get(self.launcher)

    def to_dict(self) -> dict[str, Any]:
        """The knobs as plan.json holds them, with the derived ``world_size``."""
        out = dataclasses.asdict(self)
        out["world_size"] = self.world_size
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Read plan.json (``world_size`` is derived, so it is checked, not taken)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan is a mapping of knob to value, got {type(data).__name__}")
        data = dict(data)
        world = data.pop("world_size", None)
        unknown = set(data) - set(KNOBS)
        if unknown:
            raise UnknownNameError("knob", str(sorted(map(str, unknown))[0]), KNOBS)
        plan = cls(**data)
        if world is not None and world != plan.world_size:
            raise PlanError(f"world_size {world} does not match nodes x gpus_per_node = {plan.world_size}")
        return plan

    def replace(self, **changes) -> "Plan":
        """A new plan with some knobs changed (checked like any other)."""
        return dataclasses.replace(self, **changes)


KNOBS = tuple(f.name for f in fields(Plan))
_TYPES = {f.name: f.type for f in fields(Plan)}
_DEFAULTS = {f.name: f.default for f in fields(Plan)}
CHOICES = {"launcher": LAUNCHERS, "precision": PRECISIONS, "optimizer": OPTIMIZERS, "attention": ATTENTIONS,
           "offload_optimizer": OFFLOADS, "offload_params": OFFLOADS, "reduce_dtype": strategies.fsdp.REDUCE_DTYPES}
"""Every knob with a fixed set of values -> its values (CLI choices, triage's checks)."""


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise PlanError(f"{name} must be one of {', '.join(choices)}; got {_short(value)}")


def _check_type(name: str, kind: str, value: Any) -> None:
    """A knob of the wrong Python type (a string for an integer, a bool for a number) is a PlanError."""
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind in ("int", "int | None"):
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (value is None and kind == "int | None")
    else:
        ok = isinstance(value, str)
    if not ok:
        want = {"bool": "true or false", "int": "an integer", "int | None": "an integer or null"}.get(kind, "a string")
        raise PlanError(f"{name} must be {want}, got {_short(value)}")


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


def check_alloc_conf(text: str) -> None:
    """Refuse a PYTORCH_CUDA_ALLOC_CONF that is not PyTorch's grammar: comma-separated ``name:value`` items
    with names PyTorch knows (``ALLOC_CONF_OPTIONS``) and values of letters, digits, ``_`` and ``.`` (or the
    ``[256:1,>:4]`` list ``roundup_power2_divisions`` takes). "" is the allocator's default."""
    if not isinstance(text, str):
        raise PlanError(f"alloc_conf must be a string, got {_short(text)}")
    if not text:
        return
    if len(text) > MAX_ALLOC_CONF:
        raise PlanError(f"alloc_conf is {len(text)} characters long; at most {MAX_ALLOC_CONF}")
    for item in _alloc_items(text):
        name, sep, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not value:
            raise PlanError(f"alloc_conf item {_short(item)} is not name:value "
                            "(e.g. expandable_segments:True,max_split_size_mb:128)")
        if name not in ALLOC_CONF_OPTIONS:
            raise PlanError(f"alloc_conf: {_short(name)} is not an allocator option PyTorch knows; valid: "
                            + ", ".join(ALLOC_CONF_OPTIONS))
        if not _ALLOC_VALUE.fullmatch(value):
            raise PlanError(f"alloc_conf: {name}: value {_short(value)} is not a number, word or [list]")


def _alloc_items(text: str) -> list[str]:
    """Split at the commas outside ``[...]``."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def parse_knob(name: str, text: str) -> Any:
    """Turn ``--set name=text`` into the knob's typed value; unknown names list the valid ones."""
    if name not in _TYPES:
        raise UnknownNameError("knob", name, KNOBS)
    kind = _TYPES[name]
    if not isinstance(text, str):
        raise PlanError(f"--set {name}: expected text, got {_short(text)}")
    low = text.strip().lower()
    if kind == "bool":
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise PlanError(f"--set {name}: expected true or false, got {_short(text)}")
    if kind in ("int", "int | None"):
        if kind == "int | None" and low in ("", "none", "null"):
            return None
        # ASCII digits only: int() would also take "1_6", " 16", "١٦" and 4300-digit numbers
        if not _INTEGER.fullmatch(text.strip()):
            raise PlanError(f"--set {name}: expected an integer (ASCII digits), got {_short(text)}")
        return int(text.strip())
    return text


_INTEGER = re.compile(r"-?[0-9]{1,30}", re.ASCII)
"""An integer as ``--set`` takes it: ASCII digits (30 at most: the Plan's bounds then say what is too large)."""


def parse_sets(pairs) -> dict[str, Any]:
    """Parse ``["knob=value", ...]`` into a dict of typed knob values."""
    out = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep:
            raise PlanError(f"--set expects knob=value, got {pair!r}")
        out[name.strip()] = parse_knob(name.strip(), value)
    return out


def with_changes(plan: Plan, changes: Mapping[str, Any]) -> Plan:
    """Apply knob changes, re-deriving what must follow to keep the batch invariant.

    When ``micro_batch``, ``nodes`` or ``gpus_per_node`` change and ``grad_accum``
    is not given, accumulation is recomputed so the global batch stays the same.
    """
    changes = dict(changes)
    for name, value in changes.items():  # typed before any arithmetic on them
        if name not in _TYPES:
            raise UnknownNameError("knob", str(name), KNOBS)
        _check_type(name, _TYPES[name], value)
    shape_changed = {"micro_batch", "nodes", "gpus_per_node"} & set(changes)
    if shape_changed and "grad_accum" not in changes and "global_batch" not in changes:
        merged = {**plan.to_dict(), **changes}
        per_step = merged["micro_batch"] * merged["nodes"] * merged["gpus_per_node"]
        if per_step and plan.global_batch % per_step == 0:
            changes["grad_accum"] = plan.global_batch // per_step
    if "global_batch" in changes and "grad_accum" not in changes:
        merged = {**plan.to_dict(), **changes}
        per_step = merged["micro_batch"] * merged["nodes"] * merged["gpus_per_node"]
        if per_step and merged["global_batch"] % per_step == 0:
            changes["grad_accum"] = merged["global_batch"] // per_step
    return plan.replace(**changes)


def apply_overrides(plan: Plan, changes: dict[str, Any]) -> Plan:
    """``plan`` with HF-style changes; the global batch becomes micro_batch x grad_accum x world_size."""
    if not changes:
        return plan
    merged = {**plan.to_dict(), **changes}
    merged.pop("world_size")
    # HF semantics: the flags are taken literally, the global batch follows from them.
    merged["global_batch"] = merged["micro_batch"] * merged["grad_accum"] * merged["nodes"] * merged["gpus_per_node"]
    return Plan.from_dict(merged)
