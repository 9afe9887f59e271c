"""DeepSpeed: the ZeRO engine, stages 1-3, with CPU offload and NVMe offload (ZeRO-Infinity).

The engine casts the model to 16-bit under mixed precision and keeps an fp32 master copy with the optimizer
states (2 + 2 + 12 = 16 B/param with AdamW), sharded by stage (Rajbhandari et al. 2019), per rank:
stage 1: 4Ψ + 12Ψ/N, stage 2: 2Ψ + 14Ψ/N, stage 3: 16Ψ/N (+ the largest layer gathered). Its config file is
ds_config.json (``config``), whose batch fields come straight from the plan, so DeepSpeed's own check
``train_batch_size == micro * accum * world`` holds by the plan's invariant.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from math import ceil, prod
from pathlib import Path
from typing import Any, Mapping

from .. import optimizers
from ..errors import ConfigError, PlanError
from .base import (AUTOGRAD_GRADIENT, MIXED, SIXTEEN_BIT, Dtypes, Gathered, Layout, ModelStates, Placement,
                   Strategy, get, recipe_sizes, register)

# Buffers DeepSpeed stages parameters through when they live on NVMe. One buffer must hold the largest
# single parameter; they are allocated up front (count x size x element bytes per rank), so they are sized
# to the model when it is known.
NVME_PARAM_BUFFER_DEFAULT = 100_000_000  # DeepSpeed's own default, when the model is unknown
NVME_PARAM_BUFFER_MIN = 1_000_000
NVME_PARAM_BUFFERS = 5
NVME_OPTIMIZER_BUFFERS = 4
"""offload_optimizer buffer_count: AdamW swaps the fp32 weights, two states and the grads of one sub-group
through 4 pinned buffers."""
NVME_MAX_IN_CPU = 1_000_000_000
"""Parameters kept in CPU memory at once when the rest is on NVMe (elements)."""
BUCKET_ELEMENTS = 50_000_000
"""reduce_bucket_size / allgather_bucket_size / stage3_prefetch_bucket_size as ``config`` writes them."""
DS_REDUCE_BUCKET_DEFAULT = 500_000_000
"""DeepSpeed's own ``reduce_bucket_size`` when a ds_config leaves it out (runtime/zero/config.py, 5e8)."""
MAX_PARAM_REDUCE_EVENTS = 2
"""ZeRO-3's ``max_param_reduce_events`` (stage3.py: a constant, the same in v0.9.2, v0.14.2 and 0.19.8)"""
NORM_CHUNK_ELEMENTS = 250_000_000
"""ZeRO-3's ``_constant_buffered_norm2``: a gradient partition's norm is taken in fp64 chunks of this many elements."""
SUB_GROUP_ELEMENTS = 1_000_000_000
"""ZeRO-3 sub_group_size default: the unit the optimizer steps (and swaps to NVMe)."""

OFFLOAD_BUFFER_FACTOR = 1.5
"""DeepSpeed's own estimators multiply offloaded host memory by 1.5 for pinned and staging buffers."""
ADAMW_PARAMS = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
"""Used when the config owns the optimizer (ZeRO-Offload): DeepSpeed then builds its CPU Adam, much faster
than torch's AdamW stepping on the host."""
ZERO_COST = {0: 1.0, 1: 1.02, 2: 1.05, 3: 1.15}
OFFLOAD_COST = {"none": 1.0, "cpu": 1.5, "nvme": 2.0}
"""Step-time factors (coarse judgements from the ZeRO and ZeRO-Infinity papers' throughput tables)."""
PLAN_DS_PRECISION = {"fp32": "fp32", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


ZERO_MOST = 10**15
"""Largest element count a ``zero_optimization`` size may be: far above any setting in use (Lightning's
sub_group_size is 1e12, a 10^15-element bucket would be petabytes); beyond it the arithmetic overflows."""

# DeepSpeed's own defaults for the zero_optimization fields that change device memory, when a ds_config leaves
# them out (runtime/zero/config.py); "auto" is what transformers' Trainer fills in (integrations/deepspeed.py),
# as a function of the model's hidden size (None: no "auto" for that field).
_ZERO_NUMBERS = {  # field: (attribute, default, auto)
    "reduce_bucket_size": ("reduce_bucket_size", DS_REDUCE_BUCKET_DEFAULT, lambda h: h * h),
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", 50_000_000, lambda h: int(0.9 * h * h)),
    "stage3_max_live_parameters": ("max_live_parameters", 1_000_000_000, None),
    "stage3_max_reuse_distance": ("max_reuse_distance", 1_000_000_000, None),
    "stage3_param_persistence_threshold": ("param_persistence_threshold", 100_000, lambda h: 10 * h),
    "sub_group_size": ("sub_group_size", SUB_GROUP_ELEMENTS, None),
}


@dataclass(frozen=True)
class ZeroSettings:
    """The ``zero_optimization`` settings that change what ZeRO puts on each device (read in DeepSpeed 0.19.8;
    the same lifetimes in v0.7's source).

    The gradient buckets (``bucket_bytes``):

    - stage 1 and 2 with ``contiguous_gradients``: ``setup_buckets`` (stage_1_and_2.py) makes one buffer of
      ``reduce_bucket_size`` elements in the 16-bit dtype at the first gradient hook, a second one with
      ``overlap_comm`` (double buffering), and ``_release_ipg_buffers`` frees them in the backward's epilogue;
    - stage 3 with ``contiguous_gradients``: one ``reduce_bucket_size`` buffer in the communication dtype,
      made at start-up and kept (stage3.py, "IPG").

    ``overlap_comm`` defaults to stage == 3 (``overlap_comm_valid``) and ``contiguous_gradients`` to True;
    CPU optimizer offload forces it on at stages 1-2. The stage-3 parameter coordinator's settings
    (prefetch, live, reuse distance, persistence; elements) drive ``zero3_gathered``.

    Stage 3 with ``reduce_scatter`` (the default) reduces each full bucket through
    ``reduce_scatter_coalesced``, which first copies the bucket's gradients into one new flat tensor
    (``torch.cat``, comm/coalesced_collectives.py): ``flush_elements``. With ``overlap_comm`` the gathers run
    on the coordinator's all-gather stream and the reductions on ``reduce_and_partition_stream``, so their
    blocks belong to those streams (``ModelStates.side_streams``).
    """

    reduce_bucket_size: int = _ZERO_NUMBERS["reduce_bucket_size"][1]
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    reduce_scatter: bool = True
    prefetch_bucket_size: int = _ZERO_NUMBERS["stage3_prefetch_bucket_size"][1]
    max_live_parameters: int = _ZERO_NUMBERS["stage3_max_live_parameters"][1]
    max_reuse_distance: int = _ZERO_NUMBERS["stage3_max_reuse_distance"][1]
    param_persistence_threshold: int = _ZERO_NUMBERS["stage3_param_persistence_threshold"][1]
    sub_group_size: int = SUB_GROUP_ELEMENTS
    memory_efficient_linear: bool = True
    """ZeRO-3 may run ``nn.Linear`` through its own autograd function (``zero3_linear_wrapped``)"""

    @classmethod
    def from_config(cls, zero: Mapping[str, Any], *, stage: int, hidden: int | None = None,
                    offload: bool = False) -> "ZeroSettings":
        """From a ``zero_optimization`` section; DeepSpeed's defaults fill what it leaves out, and "auto" is
        what transformers' Trainer fills in. Bad values raise ConfigError naming the field."""
        if not isinstance(zero, Mapping):
            raise ConfigError(f"zero_optimization: expected an object, got {zero!r}"[:200])
        numbers = {}
        for key, (attr, default, auto) in _ZERO_NUMBERS.items():
            value = zero.get(key, default)
            if value == "auto" and auto is not None:
                if not hidden:
                    raise ConfigError(f"zero_optimization.{key}: 'auto' needs the model's hidden size")
                value = auto(hidden)
            positive = key in ("reduce_bucket_size", "sub_group_size")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                    or value in (float("inf"), float("-inf")) or value != int(value) or value < (1 if positive else 0) \
                    or value > ZERO_MOST:
                what = "a positive" if positive else "a non-negative"
                raise ConfigError(f"zero_optimization.{key}: expected {what} whole number up to {ZERO_MOST:.0e}, "
                                  f"got {value!r}"[:200])
            numbers[attr] = int(value)
        flags = {}
        for name, default in (("contiguous_gradients", True), ("overlap_comm", stage == 3), ("reduce_scatter", True),
                              ("memory_efficient_linear", True)):
            value = zero.get(name, default)
            if value is None:
                value = default
            if not isinstance(value, bool):
                raise ConfigError(f"zero_optimization.{name}: expected true or false, got {value!r}"[:200])
            flags[name] = value
        contiguous = flags["contiguous_gradients"] or (offload and stage in (1, 2))
        return cls(contiguous_gradients=contiguous, overlap_comm=flags["overlap_comm"],
                   reduce_scatter=flags["reduce_scatter"], memory_efficient_linear=flags["memory_efficient_linear"],
                   **numbers)

    def deferred_flushes(self, stage: int, gpu: bool) -> int:
        """``ModelStates.deferred_flushes``: ZeRO-3 with ``overlap_comm`` and ``contiguous_gradients`` on a GPU
        (read in v0.9.2, v0.14.2 and 0.19.8: ``free_param`` and ``__add_grad_to_ipg_bucket`` call ``record_stream``;
        ``__reduce_and_partition_ipg_grads`` synchronizes the oldest reduce event once more than
        ``max_param_reduce_events`` (2, not configurable) are outstanding); else 0."""
        on = stage == 3 and gpu and self.overlap_comm and self.contiguous_gradients and self.reduce_bucket_size > 0
        return MAX_PARAM_REDUCE_EVENTS + 1 if on else 0

    def flush_elements(self, stage: int) -> int:
        """Elements of the bucket copy each stage-3 reduction makes (0: none)."""
        return self.reduce_bucket_size if stage == 3 and self.reduce_scatter else 0

    def bucket_bytes(self, stage: int, grad_bytes: float, n_params: float, gpu: bool) -> tuple[float, float]:
        """(kept through the step, alive during the backward only), bytes per rank. On a CPU rank only the
        part a gradient writes becomes resident (``torch.empty`` pages are touched on first write)."""
        if stage == 0 or not self.contiguous_gradients:
            return 0.0, 0.0
        one = grad_bytes * (self.reduce_bucket_size if gpu else min(self.reduce_bucket_size, n_params))
        if stage == 3:
            return one, 0.0
        return 0.0, one * (2 if self.overlap_comm else 1)


def overflow_check(form: str | None, grad_bytes: int) -> tuple[tuple[str, float], ...]:
    """The tensors ZeRO-1/2's overflow check ``_has_inf_or_nan`` holds at once, bytes per element of the tensor it
    checks, by ``Runtime.zero_overflow_check``'s form: ``"sum"``, an fp32 copy (none of an fp32 tensor);
    ``"elementwise"``, that copy, the ``isnan``, ``isinf`` and ``logical_or`` masks and ``.float()`` of the last
    (DeepSpeed PR #8325: "11 bytes of device memory for every 2 bytes of a bf16 gradient"); None, nothing."""
    if form is None:
        return ()
    copy = (("fp32 copy", 4.0),) if grad_bytes != 4 else ()
    if form == "sum":
        return copy
    return copy + (("isnan", 1.0), ("isinf", 1.0), ("either", 1.0), ("either as fp32", 4.0))


def overflow_scan(form: str | None, grad_bytes: int, numel: float) -> tuple[tuple[str, float | None], ...]:
    """The overflow check of one ``numel``-element tensor as a recipe: its tensors (``overflow_check``) made, then
    freed as the function returns."""
    made = [(name, per * numel) for name, per in overflow_check(form, grad_bytes)]
    return (*made, *((name, None) for name, _ in reversed(made)))


def zero12_offload_handover(largest: float, part: float, grad_bytes: int, *, own: bool,
                            check: str | None) -> tuple[tuple[str, float | None], ...]:
    """ZeRO-1/2's hand-over of one gradient to the host under CPU optimizer offload, on the rank that owns
    ``part`` elements of the ``largest`` parameter, as a recipe (``ModelStates.reduce_order``). Read in
    stage_1_and_2.py ``copy_grads_in_partition`` (v0.13.2, v0.14.2, v0.19.6-dev and 0.19.8), one after the other:

    - ``own``: the gradient is a tensor of its own (larger than the bucket, ``extra_large_param_to_reduce``, at
      ZeRO-2, which keeps no gradients) until ``param.grad = None`` ends the hand-over (``AUTOGRAD_GRADIENT``);
    - ``set_norm_for_param_grad_in_gpu``: the rank's slice normed in fp64 (``get_norm_dtype``, fp64 on CUDA);
    - ``update_overflow_tracker_for_param_grad``: the overflow check over the whole gradient, in the form
      ``check`` (``Runtime.zero_overflow_check``; ``overflow_check``);
    - ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: the slice cast to fp32 on the device for the copy.
    """
    order: list[tuple[str, float | None]] = [(AUTOGRAD_GRADIENT, grad_bytes * largest)] if own else []
    order += [("fp64 norm", 8.0 * part), ("fp64 norm", None)]
    order += overflow_scan(check, grad_bytes, largest)
    order += [("fp32 slice", 4.0 * part), ("fp32 slice", None)]
    if own:
        order.append((AUTOGRAD_GRADIENT, None))
    return tuple(order)


def zero_step_scans(part: float, grad_bytes: int, check: str | None) -> tuple[tuple[str, float | None], ...]:
    """The start of DeepSpeed ZeRO's ``step`` without offload on the rank whose largest gradient slice has ``part``
    elements, as a recipe (``ModelStates.step_order``), on the compute stream, slice after slice (the largest sets
    the size). Read in stage_1_and_2.py and stage3.py at v0.7.0, v0.14.2 and 0.19.8:

    - ZeRO-1/2 fp16 only (``if self.dtype == torch.float16: self.check_overflow()``):
      ``has_overflow_partitioned_grads_serial`` runs ``_has_inf_or_nan`` on each slice, in the form ``check``
      (``Runtime.zero_overflow_check``; ``overflow_check``). ZeRO-3 checks its flat buffer on its reduction
      stream instead (``ModelStates.step_check_bytes``): pass None;
    - ``get_grad_norm_direct``: ``g.double().norm(2)`` of each slice (0.19.8: ``.to(get_norm_dtype())``, fp64 on
      CUDA), freed as the next is made.
    """
    return (*overflow_scan(check, grad_bytes, part), ("fp64 norm", 8.0 * part), ("fp64 norm", None))


def zero3_startup(shard: float, dt: Dtypes, opt, sub_group_size: int, bucket: float,
                  master_from_clone: bool = False) -> tuple[tuple[tuple[str, float | None], ...], tuple[float, ...]]:
    """ZeRO-3's device allocations at start-up, in order, and the optimizer states its first step makes
    (``ModelStates.startup`` and ``lazy_states``), per rank, with the partitions on the device. Read in
    DeepSpeed 0.19.8's stage3.py and, where said, v0.14.2's:

    - ``_create_fp16_partitions_with_defragmentation``: ``defragment`` moves the partitions to the host,
      empties the cache and copies them back as one flat 16-bit buffer (``lp_param_buffer``);
    - ``_create_fp32_partitions``, per sub-group: since DeepSpeed PR #7700 (v0.18.3) ``.to(device,
      dtype=fp32)`` then ``.clone()``: the master, and a converted copy of the same size alive until the next
      sub-group's replaces it (a loop variable); none when the weights are fp32 already (the flat buffer is the
      master). Before it (``master_from_clone``, v0.14.2): ``.clone().float()``, a 16-bit clone freed once cast;
      with fp32 weights the clone is a master of its own;
    - ``initialize_optimizer_states``: a zeroed fp32 ``gradient_buffer`` as large as the largest sub-group,
      lent to each sub-group as its ``.grad`` and freed at the function's end; states are not made there
      (torch's and DeepSpeed's optimizers make them lazily, at the first ``step``, v0.14.2 as 0.19.8);
    - ``_setup_for_real_optimizer``: the IPG bucket buffer (``contiguous_gradients``), then the flat 16-bit
      gradient partition buffer (``grad_partitions_flat_buffer``).

    The optimizer sees each sub-group as one flat 1-D fp32 tensor, so its states are those of a vector (a
    factored optimizer keeps a full second moment). Sub-groups close at ``sub_group_size`` elements of partition
    (``_create_fp16_sub_groups``; here split at exactly that size, not at the parameter boundary that closes
    them).
    """
    groups = [float(sub_group_size)] * int(shard // sub_group_size)
    if shard - sum(groups) > 0 or not groups:
        groups.append(shard - sum(groups))
    steps: list[tuple[str, float | None]] = [("lp_param_buffer", dt.param * shard)]
    if master_from_clone and (dt.master or dt.param == 4):
        for g, numel in enumerate(groups):
            if dt.param == 4:  # the fp32 clone is the master; .float() returns it
                steps.append((f"fp32 partition {g}", 4.0 * numel))
            else:
                steps += [(f"clone {g}", dt.param * numel), (f"fp32 partition {g}", 4.0 * numel),
                          (f"clone {g}", None)]
    elif dt.master:
        for g, numel in enumerate(groups):
            steps.append((f"converted {g}", 4.0 * numel))
            if g:
                steps.append((f"converted {g - 1}", None))
            steps.append((f"fp32 partition {g}", 4.0 * numel))
        steps.append((f"converted {len(groups) - 1}", None))
    steps += [("gradient_buffer", 4.0 * max(groups)), ("gradient_buffer", None)]
    if bucket > 0:
        steps.append(("ipg bucket", bucket))
    steps.append(("grad_partitions_flat_buffer", dt.grad * shard))
    lazy = tuple(float(x) for numel in groups for x in opt.state_tensor_bytes((int(numel),), dt.state, dt.gpu))
    return tuple(steps), lazy


def _zero3_modules(other: tuple, layer: tuple, layers: int, tied: bool,
                   causal: bool) -> tuple[list[list[int]], list[int], list[int]]:
    """The model's modules as ZeRO-3 hooks them, each the list of the parameters it owns (indices into the
    element counts returned): the input embeddings, each layer's weights (a bias rides with the weight before
    it), the modules after the layers, and a tied LM head as one more module owning the token embedding.
    Returns (modules in forward order, element counts, the index of each layer's first module followed by the
    index of the first module after the layers, and per module the parameters it multiplies by as a linear
    layer's weight: its own linear weights; the token embedding for a tied head)."""
    sizes: list[int] = []
    modules: list[list[int]] = []
    linear: set[int] = set()
    group_start = [0]

    def add(tensors) -> None:
        group_start[0] = len(modules)
        for _name, dims, kind in tensors:
            sizes.append(prod(dims))
            if kind == "linear":
                linear.add(len(sizes) - 1)
            if kind == "bias" and len(modules) > group_start[0]:
                modules[-1].append(len(sizes) - 1)
            else:
                modules.append([len(sizes) - 1])

    first = [t for t in other if t[2] == "embedding" or t[0].startswith("embeddings")]
    add(first)
    layer_first: list[int] = []
    for _ in range(layers):
        layer_first.append(len(modules))
        add(layer)
    layer_first.append(len(modules))
    add([t for t in other if t not in first])
    viewed = [[p for p in m if p in linear] for m in modules]
    if causal and tied and first:
        modules.append([0])  # the tied LM head: the token embedding, the first parameter
        viewed.append([0])  # multiplied by in the head's nn.Linear (the embedding's lookup saves only the ids)
    return modules, sizes, layer_first, viewed


def zero3_gathers(plan) -> bool:
    """ZeRO-3 gathers weights into new device memory: on more than one rank (``all_gather_coalesced``'s flat
    buffer), or on one rank with offloaded parameters (the host partition copied in). On one rank with the
    partitions on the device, ``all_gather_coalesced`` takes ``_no_gather_coalesced``: each parameter's data
    becomes a view of its own partition, which is the whole parameter, and nothing is allocated
    (partition_parameters.py, DeepSpeed 0.9-0.19)."""
    return plan.zero_stage == 3 and (plan.world_size > 1 or plan.offload_params != "none")


def zero3_gathered(shape, zs: ZeroSettings, *, checkpointing: bool, causal: bool,
                   linear_wrapped: bool = True, stale_counter: bool = False) -> dict[str, int]:
    """Elements of gathered (unsharded) weights DeepSpeed ZeRO-3 holds at each moment of a steady-state step,
    from a run of its parameter coordinator's policy (``PartitionedParameterCoordinator`` in
    runtime/zero/partitioned_param_coordinator.py, DeepSpeed 0.19.8) over the step's module trace:

    - a module's own parameters are gathered before it runs; then, the trace being known from the second step on,
      each module's fetch prefetches the next parameters in trace order, up to ``min(max_live_parameters - live,
      prefetch_bucket_size)`` more elements (a parameter larger than that is still fetched whole), so the prefetched
      window grows until ``max_live_parameters`` elements are live;
    - after a module, a parameter is released unless it was prefetched for a later use or the module trace uses
      it again within ``max_reuse_distance`` elements of parameters (``__params_to_release``); parameters of at
      most ``param_persistence_threshold`` elements stay gathered for good; the embeddings stay gathered through
      their backward (its post-backward hook does not fire: the token ids need no gradient);
    - the trace is the forward, then the backward in reverse, each checkpointed layer recomputing its forward
      just before its backward; the optimizer step releases everything (``_partition_all_parameters``);
    - ``linear_wrapped=False`` (``zero3_linear_wrapped``): ``nn.Linear`` runs torch's own ``F.linear``, whose
      autograd saves a view of the weight (``weight.t()``); releasing the parameter swaps its ``.data`` but the
      view keeps the gathered storage, so a linear weight used with grad (a forward outside checkpointing, a
      recompute) stays gathered until its module's backward. HF GPT-2's ``Conv1D`` (``addmm`` on the parameter
      itself, which autograd saves as the parameter) keeps nothing; its tied head is an ``nn.Linear``;
    - ``stale_counter`` (DeepSpeed before 0.15.4): the coordinator's count of available elements was reset at the
      backward's end (``stage3.py backward``: ``reset_step``), while the embeddings and the persistent parameters
      were still gathered; the step's ``release_and_reset_all`` then subtracted them (``__release_param``), so every
      later step starts that many elements below zero and its prefetch window is that much wider. PR #6662
      (2024-11-05, v0.15.4) resets it at the forward's start instead (read in v0.14.2 and 0.19.8).

    Keys: the moments of ``base.Gathered``; each value is the largest count over that moment's modules."""
    conv1d = shape.model_type == "gpt2"
    return dict(_zero3_moments(tuple(shape.other_tensors), tuple(shape.layer_tensors), shape.layers,
                               bool(shape.tied), causal, checkpointing, zs,
                               "none" if linear_wrapped else ("head" if conv1d else "all"), stale_counter))


def zero3_linear_wrapped(engine_wrapped: bool, zs: ZeroSettings) -> bool:
    """Whether ZeRO-3 runs ``nn.Linear`` through its memory-efficient wrapper (``LinearFunctionForZeroStage3``,
    zero/linear.py, which saves the weight parameter itself, not a view of its gathered data): only with
    ``memory_efficient_linear`` (default true) and where the engine installs it (``Runtime.zero3_linear_wrapped``):
    a model built inside ``zero.Init`` (whose ``__enter__`` patches ``F.linear``), and since DeepSpeed PR #8189
    (merged 2026-07-28) a model passed to ``deepspeed.initialize`` already built (``Init(module=...)`` before it
    converted the parameters without patching: read in v0.14.2 and 0.16.5)."""
    return engine_wrapped and zs.memory_efficient_linear


@lru_cache(maxsize=256)
def _zero3_moments(other: tuple, layer: tuple, layers: int, tied: bool, causal: bool, checkpointing: bool,
                   zs: ZeroSettings, saves: str = "none", stale_counter: bool = False) -> tuple[tuple[str, int], ...]:
    """``saves``: which modules' autograd keeps views of their linear weights (``zero3_gathered``): "none",
    "head" (the modules after the layers only) or "all". ``stale_counter``: see ``zero3_gathered``."""
    modules, sizes, layer_first, viewed = _zero3_modules(other, layer, layers, tied, causal)
    persistent = {p for p, n in enumerate(sizes) if n <= zs.param_persistence_threshold}
    resident = sum(sizes[p] for p in persistent)
    # the coordinator's count starts this far below what is live (DeepSpeed < 0.15.4): the embeddings' and the
    # persistent parameters' elements, subtracted by the previous step's release after its reset
    below = (resident + sum(sizes[p] for m in range(layer_first[0]) for p in modules[m] if p not in persistent)
             if stale_counter else 0)
    n_fwd = len(modules)
    trace = list(range(n_fwd))
    with_grad = [not (checkpointing and layer_first[0] <= m < layer_first[-1]) for m in trace]
    trace.extend(reversed(range(layer_first[-1], n_fwd)))  # the modules after the layers, the head first
    with_grad.extend([False] * (n_fwd - layer_first[-1]))
    marks: dict[str, list[int]] = {"forward_end": [n_fwd - 1], "head_backward": [n_fwd], "last_layer": [],
                                   "first_layer": []}
    for li in reversed(range(layers)):
        lo, hi = layer_first[li], layer_first[li + 1]
        at = len(trace)
        if checkpointing:
            trace.extend(range(lo, hi))
            with_grad.extend([True] * (hi - lo))  # the recompute
        trace.extend(reversed(range(lo, hi)))
        with_grad.extend([False] * (hi - lo))
        if li in (layers - 1, 0):
            marks["last_layer" if li == layers - 1 else "first_layer"] += list(range(at, len(trace)))
    tail = len(trace)
    trace.extend(reversed(range(layer_first[0])))
    with_grad.extend([False] * layer_first[0])
    marks["backward_end"] = list(range(tail, len(trace)))
    # where each parameter is used, and the elements of parameters the trace passes up to each step
    uses: dict[int, list[int]] = {}
    passed = [0]
    for step, m in enumerate(trace):
        for p in modules[m]:
            uses.setdefault(p, []).append(step)
        passed.append(passed[-1] + sum(sizes[p] for p in modules[m]))

    live: set[int] = set()
    n_live = 0
    fetched_for = [-(10 ** 12)] * len(sizes)
    queue = deque((p, step) for step, m in enumerate(trace) for p in sorted(modules[m]) if p not in persistent)
    held: list[int] = []
    # autograd's views of linear weights (saves != "none"): made where a module runs with grad (a forward outside
    # checkpointing, a recompute), dropped at that module's next step, its backward
    saving = [saves == "all" or (saves == "head" and m >= layer_first[-1]) for m in range(len(modules))]
    next_step: dict[int, int] = {}
    last: dict[int, int] = {}
    for step in reversed(range(len(trace))):
        if trace[step] in last:
            next_step[step] = last[trace[step]]
        last[trace[step]] = step
    kept: dict[int, int] = {}  # parameter -> its elements that autograd keeps gathered
    detached: set[int] = set()  # kept parameters the coordinator released since: gathering them again is a copy
    release_at: dict[int, list[int]] = {}
    for step, m in enumerate(trace):
        own = [p for p in modules[m] if p not in persistent]
        for p in own:
            if p not in live:
                live.add(p)
                n_live += sizes[p]
        need = sum(1 for p in own if fetched_for[p] < step)
        for _ in range(min(need, len(queue))):  # this module's own entries leave the queue
            p, used_at = queue.popleft()
            fetched_for[p] = used_at
        budget = min(zs.max_live_parameters - n_live + below, zs.prefetch_bucket_size)
        inflight = 0
        while queue and inflight < budget:
            p, used_at = queue.popleft()
            fetched_for[p] = max(fetched_for[p], used_at)
            if p not in live:
                live.add(p)
                n_live += sizes[p]
                inflight += sizes[p]
        if with_grad[step] and saving[m] and step in next_step:
            for p in viewed[m]:
                if p not in persistent:
                    kept[p] = sizes[p]
                    release_at.setdefault(next_step[step], []).append(p)
        held.append(n_live + sum(n for p, n in kept.items() if p not in live or p in detached))
        for p in release_at.get(step, ()):
            kept.pop(p, None)
            detached.discard(p)
        if step >= tail:  # the embeddings: released only in the backward's epilogue
            continue
        for p in own:
            if fetched_for[p] > step + 1:
                continue  # prefetched for a later use
            later = uses[p][bisect_right(uses[p], step)] if uses[p][-1] > step else None
            if later is not None and passed[later] - passed[step + 1] < zs.max_reuse_distance:
                continue  # used again within the reuse distance
            live.discard(p)
            n_live -= sizes[p]
            if p in kept:
                detached.add(p)
    return tuple((name, resident + max((held[i] for i in steps), default=0)) for name, steps in marks.items())


@register
class DeepSpeed(Strategy):
    name = "deepspeed"
    title = "DeepSpeed"
    template = "deepspeed.sbatch.j2"
    family = "sharded"
    own_knobs = ("zero_stage", "offload_optimizer")
    config_file = "ds_config.json"
    env_var = "HPCMEM_DS_CONFIG"
    sharded = True

    def validate(self, plan) -> None:
        if plan.offload_optimizer != "none" and plan.zero_stage == 0:
            raise PlanError("offload_optimizer needs zero_stage >= 1")
        if plan.offload_optimizer == "nvme" and plan.zero_stage != 3:
            raise PlanError("offload_optimizer=nvme needs zero_stage=3 (ZeRO-Infinity)")
        if plan.offload_params != "none" and plan.zero_stage != 3:
            raise PlanError("offload_params needs zero_stage=3")

    def describe(self, plan) -> str:
        parts = [f"DeepSpeed ZeRO-{plan.zero_stage}"]
        for what, where in (("optimizer", plan.offload_optimizer), ("params", plan.offload_params)):
            if where != "none":
                parts.append(f"{what} offload to {where}")
        return ", ".join(parts)

    def summary(self, plan) -> list[str]:
        out = [f"zero{plan.zero_stage}"] if plan.zero_stage else []
        if plan.offload_optimizer != "none":
            out.append(f"opt->{plan.offload_optimizer}")
        if plan.offload_params != "none":
            out.append(f"params->{plan.offload_params}")
        return out

    # -- rendering ---------------------------------------------------------------------------

    def config(self, plan, *, nvme_path: str | None = None, gpu: bool = True,
               largest_param: int | None = None) -> dict[str, Any]:
        """The ds_config.json dict for ``plan``. ``nvme_path``: the partition's NVMe scratch directory (needed
        when anything is offloaded to NVMe); ``gpu``: the ranks have GPUs (pinned host memory only makes sense
        with one); ``largest_param`` (elements) sizes the NVMe parameter buffers."""
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
        opt = optimizers.get(plan.optimizer)
        if plan.offload_optimizer != "none":
            if opt.deepspeed:
                cfg["optimizer"] = {"type": opt.deepspeed, "params": dict(ADAMW_PARAMS)}
            else:
                # The training code brings its own optimizer (8-bit AdamW, Adafactor, SGD).
                cfg["zero_force_ds_cpu_optimizer"] = False
        if plan.zero_stage >= 1 and opt.family != "adamw":
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

    def context(self, plan, partition) -> dict[str, Any]:
        offload = ", ".join(f"{what} to {where}" for what, where in (("optimizer", plan.offload_optimizer),
                                                                      ("params", plan.offload_params)) if where != "none")
        nvme = partition.nvme_path if "nvme" in (plan.offload_optimizer, plan.offload_params) else ""
        return {"zero_stage": plan.zero_stage, "offload": offload, "nvme_path": nvme or ""}

    # -- training code -----------------------------------------------------------------------

    def trainer_flags(self, plan, config_path: str | None) -> list[str]:
        return ["--deepspeed", config_path] if config_path else []

    def training_args(self, plan, config_path: str | None) -> dict[str, Any]:
        return {"deepspeed": str(config_path)}

    def accelerate_kwargs(self, plan, config_path: str | None) -> dict[str, Any]:
        from accelerate import DeepSpeedPlugin

        # zero3_init_flag: build ZeRO-3 models partitioned instead of whole on every rank. The config owns
        # accumulation, so it is not passed twice.
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=str(config_path), zero3_init_flag=plan.zero_stage == 3)}

    def fabric_kwargs(self, plan) -> dict[str, Any]:
        return {"strategy": "deepspeed", "strategy_kwargs": {"stage": plan.zero_stage,
                "offload_optimizer": plan.offload_optimizer != "none", "offload_parameters": plan.offload_params != "none"}}

    # -- memory ------------------------------------------------------------------------------

    def dtypes(self, plan, gpu: bool) -> Dtypes:
        if plan.precision in (*MIXED, "bf16-true"):  # the engine casts the model to 16-bit, keeps fp32 master + states
            return Dtypes(param=2, compute=2, grad=2, master=4, state=4, autocast=False, gpu=gpu, mask=1 if gpu else 2)
        return super().dtypes(plan, gpu)

    def layout(self, plan) -> Layout:
        half = SIXTEEN_BIT.get(plan.precision)
        if half is None:
            return Layout("float32")
        if plan.precision == "bf16-true" and plan.zero_stage >= 1:
            return Layout("bfloat16", note="DeepSpeed bf16-true (ZeRO >= 1): bf16 weights, gradients and optimizer "
                                           "states, no fp32 master")
        note = "DeepSpeed layout: 16-bit weights and gradients, fp32 master weights in the optimizer, no autocast"
        if plan.precision == "bf16-true":
            note += "; bf16-true under ZeRO-0 keeps fp32 master weights, as DeepSpeed's bf16 mode does"
        return Layout(half, master_weights=True, loss_scaling=plan.precision == "fp16-mixed", note=note)

    def model_states(self, shape, plan, dt: Dtypes, engine_config=None, runtime=None) -> ModelStates:
        psi = float(shape.n_params)
        n = plan.world_size
        stage = plan.zero_stage
        opt = optimizers.get(plan.optimizer)
        shard = psi / n if stage >= 1 else psi  # the parameters whose optimizer state this rank owns
        # a paged optimizer's states: in unified memory next to CUDA partitions, plain host tensors under offload
        # (per parameter, as the rest: ZeRO hands the optimizer flat partitions, all of them large enough to page)
        on_device = dt.gpu and plan.offload_optimizer == "none"
        opt_full = dt.master * psi + opt.state_bytes(shape.shape_counts, dt.state, on_device)
        params = dt.param * (shard if stage == 3 else psi)
        grads = dt.grad * (shard if stage >= 2 else psi)
        optimizer = opt_full * shard / psi
        # the largest gradient slice one rank owns: ZeRO-3 partitions each parameter; ZeRO-1/2 partition the flat
        # model into ranges, so the rank that owns the largest parameter whole has the largest
        largest_slice = (ceil(shape.largest_param_numel / n) if stage == 3
                         else min(shape.largest_param_numel, ceil(psi / n)))
        zero = engine_config if engine_config is not None else _memory_settings(stage, dt.gpu)
        zs = ZeroSettings.from_config(zero, stage=stage, hidden=shape.hidden, offload=plan.offload_optimizer != "none")
        bucket, grad_bucket = zs.bucket_bytes(stage, dt.grad, psi, dt.gpu)
        moments = None
        gathered = 0.0
        if zero3_gathers(plan):  # the parameter coordinator's gathered weights, moment by moment (zero3_gathered)
            wrapped = zero3_linear_wrapped(getattr(runtime, "zero3_linear_wrapped", True), zs)
            held = zero3_gathered(shape, zs, checkpointing=plan.checkpointing, causal=shape.task == "causal-lm",
                                  linear_wrapped=wrapped,
                                  stale_counter=getattr(runtime, "zero3_stale_available_count", False))
            moments = Gathered(**{name: dt.param * n for name, n in held.items()})
            gathered = max(dt.param * n for n in held.values())
        # The step makes an fp32 copy of the gradient partition for the optimizer, which lives through the
        # optimizer's step (then its own transients). ZeRO-1/2 (stage_1_and_2.py step) cast the pre-flattened
        # partition (GradPartitionBufferGroup, DeepSpeed 0.19) to fp32: nothing new with fp32 gradients. ZeRO-3
        # steps one sub-group (sub_group_size elements) at a time (stage3.py _prepare_fp32_grad_for_sub_group):
        # its gradient partitions are flattened into one new tensor, which is cast to fp32 (with fp32 gradients
        # the flattened tensor is the copy) and then freed.
        group = min(shard, zs.sub_group_size) if stage == 3 else shard
        largest = min(shape.largest_param_numel, group)
        cast = 4.0 * group if stage == 3 or dt.grad != 4 else 0.0
        step = cast + opt.step_temp_bytes(group, largest, dt.state, 4, dt.gpu)
        flatten = dt.grad * group if stage == 3 and dt.grad != 4 else 0.0
        host = 0.0
        reduce_order: tuple = ()
        if plan.offload_optimizer != "none":
            # Master copy, states and fp32 grads live on the host and step there; from ZeRO-2 on the grads
            # are reduced through the bucket straight into the host's partition.
            optimizer, step, flatten = 0.0, 0.0, 0.0
            if stage >= 2:
                grads = 0.0
            if stage in (1, 2) and dt.gpu:
                # stage_1_and_2.py copy_grads_in_partition under offload (16-bit gradients): each slice of a
                # parameter's gradient this rank owns has its norm taken in fp64 (set_norm_for_param_grad_in_gpu:
                # .to(get_norm_dtype()), fp64 on CUDA), then is cast to fp32 on the device for the copy to the host
                # (async_inplace_copy_grad_to_fp32_buffer_from_gpu), one after the other. The partitions are
                # ranges of the flat model, so the rank that owns the largest parameter whole has the largest.
                # Between the two, the overflow check scans the whole gradient (update_overflow_tracker_for_param_
                # grad) as the version does it (Runtime.zero_overflow_check). A gradient larger than the bucket is
                # not copied into it (extra_large_param_to_reduce): at ZeRO-2, which keeps no gradients, it is a
                # tensor of its own until handed over.
                largest = shape.largest_param_numel
                own = stage == 2 and zs.contiguous_gradients and largest > zs.reduce_bucket_size
                reduce_order = zero12_offload_handover(largest, largest_slice, dt.grad, own=own,
                                                       check=getattr(runtime, "zero_overflow_check", None))
                if getattr(runtime, "zero_offload_step_fp32_copy", False):
                    step = (dt.master or dt.param) * shard  # the updated fp32 partition, copied to the device
                # and the 16-bit staging buffer as large as the largest parameter, made on the device at start-up
                # and kept (temp_grad_buffer_for_gpu_offload; read in 0.19.8 and v0.14.2)
                bucket += dt.grad * shape.largest_param_numel
            if stage == 3 and dt.gpu:
                # stage3.py partition_grads: each gradient partition is copied back to the device
                # (grad_buffer.to(device)), its norm taken in fp64 chunks (_constant_buffered_norm2,
                # get_norm_dtype: fp64 on CUDA), then cast to the fp32 master dtype on the device before the
                # copy to the host (_offload_grad_partition_at_boundary); the largest partition sets the peak.
                part = shape.largest_param_numel / n
                reduce_order = (("partition", dt.grad * part),
                                ("fp64 norm chunk", 8.0 * min(part, NORM_CHUNK_ELEMENTS)), ("fp64 norm chunk", None),
                                *((("fp32 cast", 4.0 * part), ("fp32 cast", None)) if dt.grad != 4 else ()),
                                ("partition", None))
            if plan.offload_optimizer == "cpu":
                host += OFFLOAD_BUFFER_FACTOR * (opt_full * shard / psi + 4.0 * shard)
            else:  # NVMe: states and grads swap through pinned fp32 buffers, each one sub-group large
                host += NVME_OPTIMIZER_BUFFERS * 4.0 * min(shard, zs.sub_group_size)
        if plan.offload_params != "none":
            params = 0.0
            if plan.offload_params == "cpu":
                host += OFFLOAD_BUFFER_FACTOR * dt.param * shard
            else:  # pinned buffers DeepSpeed stages NVMe parameters through
                host += NVME_PARAM_BUFFERS * nvme_buffer_elements(shape.largest_param_numel) * dt.param
        # ZeRO-3 with fp16 loss scaling checks the flat gradient partition for overflow at the step's start
        # (stage3.py has_overflow: isinf(grad_partitions_flat_buffer).any(), then isnan, under the reduce-and-
        # partition stream; read in v0.14.2 and 0.19.8); offloaded, that buffer is on the host
        check = 1.0 * shard if stage == 3 and dt.gpu and plan.precision == "fp16-mixed" \
            and plan.offload_optimizer == "none" else 0.0
        # the step's scans of each gradient slice (zero_step_scans); bf16 at ZeRO-1 too, since DeepSpeed takes its
        # BF16_Optimizer only when the config asks for fp32 gradient accumulation (engine.py get_data_types)
        step_order: tuple = ()
        if dt.gpu and stage >= 1 and plan.offload_optimizer == "none":
            form = getattr(runtime, "zero_overflow_check", None) if stage < 3 and plan.precision == "fp16-mixed" \
                else None
            step_order = zero_step_scans(largest_slice, dt.grad, form)
        startup, lazy = (), ()
        if stage == 3 and dt.gpu and plan.offload_optimizer == "none" and plan.offload_params == "none":
            startup, lazy = zero3_startup(shard, dt, opt, zs.sub_group_size, bucket,
                                          master_from_clone=getattr(runtime, "zero3_master_from_clone", False))
            # the optimizer's bytes as that start-up and the first step make them: the fp32 partitions it keeps
            # and the flat sub-groups' states
            alive, _ = recipe_sizes(startup)
            optimizer = sum(v for k, v in alive.items() if k.startswith("fp32 partition")) + sum(lazy)
        return ModelStates(params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer,
                           persistent_grads=stage >= 2, buffer_bytes=bucket, gathered_bytes=gathered,
                           step_temp_bytes=step, host_bytes_per_rank=host,
                           reduce_temp_bytes=recipe_sizes(reduce_order)[1], reduce_order=reduce_order,
                           grad_bucket_bytes=grad_bucket, gathered_moments=moments,
                           flush_bucket_elements=zs.flush_elements(stage), side_streams=zs.overlap_comm and dt.gpu,
                           deferred_flushes=zs.deferred_flushes(stage, dt.gpu),
                           deferred_bucket_elements=zs.reduce_bucket_size,
                           step_flatten_bytes=flatten, startup=startup, lazy_states=lazy, step_check_bytes=check,
                           step_order=step_order,
                           paged_optimizer_bytes=opt.paged_bytes(shape.shape_counts, on_device) * shard / psi)

    def placement(self, plan) -> Placement:
        n, stage = plan.world_size, plan.zero_stage
        params = 1.0 / n if stage >= 3 else 1.0
        grads = 1.0 / n if stage >= 2 else 1.0
        optimizer = 1.0 / n if stage >= 1 else 1.0
        host_params = host_optimizer = 0.0
        if plan.offload_optimizer != "none":
            host_optimizer, optimizer = optimizer, 0.0
            if stage >= 2:  # reduced through the bucket straight into the host's partition (model_states)
                grads = 0.0
        if plan.offload_params != "none":
            host_params, params = params, 0.0
        return Placement(params, grads, optimizer, host_params, host_optimizer,
                         nvme="nvme" in (plan.offload_optimizer, plan.offload_params),
                         gathered_layers=1.0 if zero3_gathers(plan) else 0.0)

    def startup_host_bytes(self, shape, plan) -> float:
        if plan.zero_stage == 3:  # zero.Init builds each rank's shard only
            return 4.0 * shape.n_params / plan.world_size
        return 4.0 * shape.n_params

    def cost(self, plan) -> float:
        return (ZERO_COST[plan.zero_stage] * OFFLOAD_COST[plan.offload_optimizer]
                * OFFLOAD_COST[plan.offload_params])


    # -- the runtime side (inside the job): checkpoints (docs/resume.md) ------------------------------------

    def save_state(self, directory, ranks, engine, optimizer=None) -> str:
        """``engine.save_checkpoint`` into ``ds/`` (every rank writes its ZeRO partition) and, when the full state is
        small enough (``full_copy_wanted``), a layout-free copy in ``state.pt``: the fp32 parameters and the
        optimizer's state gathered per parameter name, DDP's own format, so that ZeRO-1/2/3 of any world size, DDP
        and FSDP read it back. Returns the format."""
        import torch

        from ..runtime.checkpoint import FORMAT_DEEPSPEED, STATE_FILE

        engine.save_checkpoint(f"{directory}/ds", tag="state", save_latest=False)
        if full_copy_wanted(engine):
            full = gather_full_state(engine)
            if full is not None:
                torch.save(full, f"{directory}/{STATE_FILE}")
        return FORMAT_DEEPSPEED

    def load_state(self, directory, saved, engine, optimizer=None) -> None:
        """The same world size and ZeRO stage: ``engine.load_checkpoint`` (model, optimizer partitions,
        scheduler). Another layout: the save's full copy (``state.pt``: a DeepSpeed one, or DDP's; an FSDP2 save's
        shards consolidated by ``consolidated_dcp``) set through DeepSpeed's tensor-fragment API
        (``scatter_full_state``); without one, a ZeRO-1/2 save is converted with
        DeepSpeed's universal checkpoint (``ds_to_universal``, by rank 0, into ``.universal-step-<n>`` beside the
        save, which stays as it was) and loaded with ``load_universal_checkpoint``."""
        import torch
        import torch.distributed as dist

        from ..runtime.checkpoint import FORMAT_DCP, FORMAT_DEEPSPEED, STATE_FILE

        layout = saved.layout
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        full_copy = Path(directory) / STATE_FILE
        if saved.format == FORMAT_DCP:  # an FSDP2 save: its shards consolidated once, by rank 0
            full_copy = consolidated_dcp(directory, is_main=engine.global_rank == 0)
            if world > 1:
                dist.barrier()
        same = layout.get("zero_stage") == engine.zero_optimization_stage() and layout.get("world_size") == world
        if saved.format == FORMAT_DEEPSPEED and same:
            path, _client = engine.load_checkpoint(f"{directory}/ds", tag="state")
            if path is None:
                raise ValueError(f"DeepSpeed found no loadable checkpoint in {directory}/ds")
            return
        if full_copy.exists():
            # mmap: the ranks of a node share the file's pages instead of each holding a private copy
            scatter_full_state(engine, torch.load(full_copy, map_location="cpu", weights_only=True, mmap=True))
            return
        if saved.format != FORMAT_DEEPSPEED:
            raise ValueError(f"a {saved.format} save without {STATE_FILE} does not load into DeepSpeed")
        universal = universal_checkpoint(directory, is_main=engine.global_rank == 0)
        if world > 1:
            dist.barrier()
        engine._config.load_universal_checkpoint = True
        try:
            path, _client = engine.load_checkpoint(str(universal), tag="state")
        finally:
            engine._config.load_universal_checkpoint = False
        if path is None:
            raise ValueError(f"DeepSpeed found no loadable universal checkpoint in {universal}")

    def state_digest(self, engine, optimizer=None):
        """sha256 of the gathered fp32 parameters (with the buffers) and the optimizer's state per parameter name
        (rank 0; None on the others): the same for a ZeRO-2 and a ZeRO-3 engine holding the same state. ZeRO-0
        (no ZeRO partitions): the module's state_dict only."""
        from ..runtime.checkpoint import state_digest

        full = gather_full_state(engine)
        if full is not None:
            return state_digest(full["model"], full["optim"])
        if engine.zero_optimization_stage() == 0 and engine.global_rank == 0:
            return state_digest(engine.module.state_dict(), None)
        return None


# -- the full (layout-free) state of a ZeRO engine -----------------------------------------------------------

FULL_COPY_ENV = "HPCMEM_DS_FULL_COPY"
"""``auto`` (default): write the full copy when it is small enough (``FULL_COPY_HOST_SHARE``); ``always``;
``never`` (a layout change then converts only between ZeRO-1/2 layouts, through the universal checkpoint)."""
FULL_COPY_HOST_SHARE = 0.25
"""auto: the full copy (fp32 parameters + two Adam states: 12 bytes a parameter, all of it on rank 0's host at
once) may take at most this share of the host memory this process may use (cgroup, address-space cap, RAM). A
save must not cause the OOM that checkpoints exist to survive; every rank also holds one full parameter (and one
state) at a time while it is gathered."""
FULL_COPY_BYTES_PER_PARAM = 12


def full_copy_wanted(engine) -> bool:
    """Whether a save writes the layout-free copy (a decision every rank takes alike: it gates collectives)."""
    import os

    from ..errors import ConfigError
    from ..runtime.oom import host_limit_bytes

    mode = os.environ.get(FULL_COPY_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "always", "never"):
        raise ConfigError(f"{FULL_COPY_ENV}={mode!r}: expected auto, always or never")
    if mode == "never" or engine.zero_optimization_stage() not in (1, 2, 3):
        return False
    if mode == "always":
        return True
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    fits = FULL_COPY_BYTES_PER_PARAM * numel <= FULL_COPY_HOST_SHARE * host_limit_bytes()
    # Nodes may see different limits (no cgroup, unequal RAM): every rank must take the same branch.
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1 if fits else 0], device=engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fits = bool(flag.item())
    return fits


def _zero_base(engine):
    """The torch optimizer ZeRO steps (over its flat fp32 partitions)."""
    return engine.optimizer.optimizer


def _flats(engine) -> list:
    """The flat fp32 partitions the base optimizer steps (ZeRO-3 puts each sub-group into its param group only
    for its step, so they are read from the ZeRO optimizer)."""
    zopt = engine.optimizer
    if hasattr(zopt, "fp32_partitioned_groups_flat"):
        return list(zopt.fp32_partitioned_groups_flat)
    return [flat for group in zopt.optimizer.param_groups for flat in group["params"]]


def _state_keys(engine) -> tuple[list[str], dict]:
    """The base optimizer's per-element state names (tensors shaped like its flat partition) and its scalar
    state (e.g. Adam's ``step``, the same for every partition) — empty before the first step."""
    import torch

    base = _zero_base(engine)
    for flat in _flats(engine):
        state = base.state.get(flat)
        if state:
            per_element = [k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape]
            scalars = {k: v for k, v in state.items() if k not in per_element}
            return sorted(per_element), scalars
    return [], {}


def _link_optimizer_fragments(engine) -> None:
    """ZeRO-1/2 (and DeepSpeed's bf16 optimizer) point each parameter's fragment at the base optimizer's state only
    at its first step, and never again: after ``load_checkpoint`` (which replaces the state tensors) or before a
    step there is no link, or a stale one. Link anew (views, no copies); ZeRO-3 reads the state directly."""
    zopt = engine.optimizer
    if hasattr(zopt, "_hp_optimizer_states_linked") and any(_zero_base(engine).state.get(f) for f in _flats(engine)):
        zopt._hp_optimizer_states_linked = False
        zopt._lazy_init_hp_params_optimizer_state()


def _hyper(base) -> dict:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    return groups[0] if groups else {}


def gather_full_state(engine) -> dict | None:
    """The engine's full state, DDP's ``state.pt`` format: ``{"model": {name: fp32 tensor} (parameters from ZeRO's
    fp32 master copy, buffers as they are), "optim": {"state": {param name: {key: tensor}}, "param_groups":
    [{hyper-parameters, "params": [names]}]}, "engine": counters}``. A collective (one all-reduce or all-gather
    per parameter and state); rank 0 gets it, the others None. None everywhere for ZeRO-0."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if engine.zero_optimization_stage() not in (1, 2, 3):
        return None
    main = engine.global_rank == 0
    module, base = engine.module, _zero_base(engine)
    per_element, scalars = _state_keys(engine)
    _link_optimizer_fragments(engine)
    model: dict[str, Any] = {}
    state: dict[str, dict] = {}
    names = []
    first_name: dict[int, str] = {}
    for name, p in module.named_parameters():
        first_name[id(p)] = name
        if not p.requires_grad:
            continue
        names.append(name)
        value = safe_get_full_fp32_param(p)
        states = {k: safe_get_full_optimizer_state(p, k) for k in per_element}
        if main:
            model[name] = value.detach().float().cpu().clone()
            entry = {k: v.detach().cpu().clone() for k, v in states.items()}
            entry.update({k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
            if entry:
                state[name] = entry
    if not main:
        return None
    keys = module.state_dict().keys()  # keys only: under ZeRO-3 the parameters there are empty partitions
    for name, p in module.named_parameters(remove_duplicate=False):  # tied weights under each of their names
        if name in keys and name not in model and id(p) in first_name and first_name[id(p)] in model:
            model[name] = model[first_name[id(p)]]
    for name, b in module.named_buffers():
        if name in keys:
            model[name] = b.detach().cpu().clone()
    counters = {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps")
                if isinstance(getattr(engine, k, None), int)}
    return {"model": model, "optim": {"state": state, "param_groups": [{**_hyper(base), "params": names}]},
            "engine": counters}


def scatter_full_state(engine, full: dict) -> None:
    """Set a full state (``gather_full_state``'s, or DDP's ``state.pt``) into a ZeRO-1/2/3 engine of any world
    size through DeepSpeed's tensor-fragment API: each rank writes its own fragment of every fp32 parameter and
    optimizer state (ZeRO-3: its partition, ``safe_set_local_*``), then the 16-bit/working copies are refreshed
    from the fp32 ones as after an optimizer step. Bitwise: nothing is computed, only copied."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise ValueError(f"a full state loads into ZeRO stages 1-3, not {stage}")
    module, zopt = engine.module, engine.optimizer
    base = _zero_base(engine)
    model_sd, optim = full["model"], full.get("optim") or {}
    saved_state = optim.get("state", {})
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    missing = [n for n in names if n not in model_sd]
    if missing:
        raise ValueError(f"the full state has no parameter {missing[0]!r} ({len(missing)} missing)")
    sample = next((saved_state[n] for n in names if n in saved_state), {})
    per_element = sorted(k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0)
    scalars = {k: v for k, v in sample.items() if k not in per_element}
    if sample:
        # The base optimizer creates its state lazily at the first step: create it (zeros, the saved scalars)
        # so that the fragments have somewhere to go; a state already there is overwritten below.
        for flat in _flats(engine):
            st = base.state[flat]
            for k in per_element:
                if k not in st:
                    st[k] = torch.zeros_like(flat)
            for k, v in scalars.items():
                st[k] = v.clone() if torch.is_tensor(v) else v
        hyper = (optim.get("param_groups") or [{}])[0]
        for group in base.param_groups:
            group.update({k: v for k, v in hyper.items() if k != "params" and k in group})
        _link_optimizer_fragments(engine)  # ZeRO-1/2: the fragments point at the new state
    device = engine.device
    if stage == 3:
        group = getattr(zopt, "dp_process_group", None)
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        values = {None: model_sd[name], **{k: saved_state[name][k] for k in per_element if name in saved_state}}
        for key, value in values.items():
            value = value.to(device=device, dtype=torch.float32)
            if stage == 3:
                part = p.ds_tensor.ds_numel
                padded = torch.zeros(part * world, dtype=value.dtype, device=device)
                padded[:value.numel()] = value.flatten()
                local = padded.narrow(0, part * rank, part)
                if key is None:
                    safe_set_local_fp32_param(p, local)
                else:
                    safe_set_local_optimizer_state(p, local, key)
            elif key is None:
                safe_set_full_fp32_param(p, value)
            else:
                safe_set_full_optimizer_state(p, value, key)
    # The working copies from the fp32 masters, as the optimizer's step ends.
    if stage == 3:
        for i in range(len(zopt.fp16_groups)):
            zopt._reassign_or_swap_out_partitioned_parameters(i)
        if zopt.persistent_parameters:
            zopt.persistent_parameters[0].all_gather(zopt.persistent_parameters)
    else:
        zopt.update_lp_params()
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in model_sd:
                b.copy_(model_sd[name].to(b.device, b.dtype))
    for k, v in (full.get("engine") or {}).items():
        setattr(engine, k, v)
    if "engine" not in full and sample and torch.is_tensor(scalars.get("step")):
        engine.global_steps = int(scalars["step"].item())  # a DDP save: its optimizer's step count


def consolidated_dcp(directory, is_main: bool):
    """``<checkpoints>/.full-<step dir>.pt``: an FSDP2 save's ``dcp/`` shards gathered into one full state in DDP's
    format (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``), made once by rank 0 (a temporary
    file renamed into place; the save itself stays as it was). It holds the whole state on rank 0's host while
    it is written, as the DeepSpeed full copy does."""
    import os
    from pathlib import Path

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ..runtime.checkpoint import DCP_DIR

    directory = Path(directory)
    target = directory.parent / f".full-{directory.name}.pt"
    if is_main and not target.exists():
        tmp = directory.parent / f".partial-full-{directory.name}-{os.getpid()}.pt"
        dcp_to_torch_save(directory / DCP_DIR, tmp)
        os.rename(tmp, target)
    return target


def universal_checkpoint(directory, is_main: bool):
    """``<checkpoints>/.universal-<step dir>``: the save in ``directory`` converted by DeepSpeed's ``ds_to_universal``
    (made once, by rank 0, atomically: a temporary directory renamed into place)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    directory = Path(directory)
    target = directory.parent / f".universal-{directory.name}"
    if is_main and not (target / "state").is_dir():
        tmp = directory.parent / f".partial-universal-{directory.name}-{os.getpid()}"
        done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(directory / "ds" / "state"), "--output_folder", str(tmp / "state"),
                               "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise ValueError(f"ds_to_universal failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        # The engine looks for its own stage's model-states name (ZeRO-3: zero_pp_rank_0_...; else mp_rank_...):
        # offer both, as links to the one file the conversion wrote.
        for plain in (tmp / "state").glob("mp_rank_*_model_states.pt"):
            zero3 = plain.with_name(f"zero_pp_rank_0_{plain.name}")
            if not zero3.exists():
                os.link(plain, zero3)
        for zero3 in (tmp / "state").glob("zero_pp_rank_0_mp_rank_*_model_states.pt"):
            plain = zero3.with_name(zero3.name[len("zero_pp_rank_0_"):])
            if not plain.exists():
                os.link(zero3, plain)
        os.rename(tmp, target)
    return target


def _zero_section(plan, nvme_path: str | None, gpu: bool, largest_param: int | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage == 0:
        return zero
    zero.update(_memory_settings(plan.zero_stage, gpu))
    if plan.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(plan.offload_optimizer, nvme_path, gpu, buffers=NVME_OPTIMIZER_BUFFERS)
    if plan.offload_params != "none":
        zero["offload_param"] = _offload(plan.offload_params, nvme_path, gpu, buffers=NVME_PARAM_BUFFERS)
        if plan.offload_params == "nvme":
            zero["offload_param"].update({"buffer_size": nvme_buffer_elements(largest_param), "max_in_cpu": NVME_MAX_IN_CPU})
    return zero


def plan_from_ds_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The plan knobs a user's ds_config.json sets (numbers only; "auto" leaves the plan's), as ``hpcmem-train
    --deepspeed`` and ``hpcmem estimate --ds-config`` take them. A field of the wrong kind is a one-line
    ConfigError naming it."""
    out: dict[str, Any] = {"launcher": "deepspeed"}
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero_optimization: expected an object, got {zero!r}"[:200])
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage!r}"[:200])
    out["zero_stage"] = int(stage)
    for key, knob in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        section = zero.get(key) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"zero_optimization.{key}: expected an object, got {section!r}"[:200])
        device = section.get("device", "none")
        if device not in (None, "none", "cpu", "nvme"):
            raise ConfigError(f"zero_optimization.{key}.device: expected none, cpu or nvme, got {device!r}"[:200])
        out[knob] = device if device in ("cpu", "nvme") else "none"
    for key, knob in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        value = cfg.get(key)
        if value is None or value == "auto":  # "auto": transformers' Trainer fills it in from its own arguments
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}: expected a positive whole number or \"auto\", got {value!r}"[:200])
        out[knob] = value
    if _enabled(cfg, "fp16"):
        out["precision"] = "fp16-mixed"
    elif _enabled(cfg, "bf16") or _enabled(cfg, "bfloat16"):
        out["precision"] = "bf16-mixed"
    return out


def _enabled(cfg: Mapping[str, Any], section: str) -> bool:
    """Whether ``section`` (fp16, bf16) is on; an ``enabled`` other than true, false or "auto" is a ConfigError
    (DeepSpeed's older configs take any truthy value, so a string "false" would switch it on)."""
    value = cfg.get(section) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{section}: expected an object, got {value!r}"[:200])
    enabled = value.get("enabled", False)
    if not isinstance(enabled, bool) and enabled != "auto":
        raise ConfigError(f"{section}.enabled: expected true, false or \"auto\", got {enabled!r}"[:200])
    return enabled is True


def _memory_settings(stage: int, gpu: bool) -> dict[str, Any]:
    """The part of the zero_optimization section hpcmem writes (stage >= 1) that sizes device memory."""
    out: dict[str, Any] = {"contiguous_gradients": True, "overlap_comm": gpu,
                           "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
    if stage == 3:
        out.update({"stage3_prefetch_bucket_size": BUCKET_ELEMENTS, "stage3_param_persistence_threshold": 100_000,
                    "stage3_max_live_parameters": 1_000_000_000})
    return out


def nvme_buffer_elements(largest_param: int | None) -> int:
    """One NVMe parameter buffer: the largest parameter, rounded up to a million elements."""
    if not largest_param:
        return NVME_PARAM_BUFFER_DEFAULT
    return max(NVME_PARAM_BUFFER_MIN, -(-int(largest_param) // 1_000_000) * 1_000_000)


def _offload(device: str, nvme_path: str | None, gpu: bool, buffers: int) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": gpu}
    if device == "nvme":
        if not nvme_path:
            raise PlanError("offload to nvme needs the partition's nvme_path")
        section.update({"nvme_path": nvme_path, "buffer_count": buffers})
    return section


def deepspeed_config(plan, nvme_path: str | None = None, gpu: bool = True, largest_param: int | None = None) -> dict:
    """The ds_config.json dict for ``plan`` (``DeepSpeed().config`` as a function)."""
    return get(DeepSpeed.name).config(plan, nvme_path=nvme_path, gpu=gpu, largest_param=largest_param)
