"""The traced estimate: one real training step of the actual model, on fake tensors, on the CPU.

The model is built inside ``FakeTensorMode`` (tensors with shapes, dtypes and storages
but no data), and ``steps`` training steps (forward, backward, optimizer step,
zero_grad) run under PyTorch's ``MemTracker``, which counts the bytes of live tensor
storages by category after every operator. Nothing of the model's size is allocated:
llama-7b (micro-batch 1, 2048 tokens, bf16-mixed, checkpointing) traces two steps in
about 10 s on 2 cores with a peak RSS under 0.5 GiB.

The step is the one ``toolkit/runtime/train.py`` runs, knob by knob:

  precision      fp32; fp16-/bf16-mixed = fp32 weights under autocast (fp16 also
                 scales the loss; GradScaler's inf check needs real numbers, so its
                 unscale is replayed as an in-place multiply); bf16-true = weights built
                 in bf16. Under launcher=deepspeed the engine's layout instead: 16-bit
                 weights and gradients, fp32 master weights held by the optimizer,
                 no autocast; bf16-true there is all-bf16 from ZeRO 1 on (dsconfig.py sets
                 bf16_master_weights_and_grads) and keeps fp32 masters at ZeRO 0.
  optimizer      torch AdamW, SGD (momentum 0.9), transformers Adafactor, as train.py
                 builds them; adamw-8bit (bitsandbytes, CUDA only) cannot run here: a
                 stand-in keeps its state sizes (uint8 moments, 2 bytes/param; fp32 for
                 tensors under 4096 elements, as bitsandbytes does) and updates in place.
  checkpointing  ``gradient_checkpointing_enable(use_reentrant=False)``
  attention      eager / sdpa; flash runs as sdpa (flash_attention_2 needs CUDA).
  grad_accum     two micro-batches per step when > 1 (the second meets the first's gradients).

The CPU is not the GPU the plan is for. For a GPU partition the trace follows what
CUDA would do where the CPU differs in memory (``target="cuda"``): CUDA's autocast op
policy (e.g. ``pow``, ``softmax``, ``layer_norm`` run in fp32; CPU autocast runs them in
bf16), dropout with a 1-byte mask (CPU keeps a full float noise tensor), sdpa with
dropout on the fused kernel (CPU falls back to the math path and stores the attention
matrix), and torch's multi-tensor (foreach) optimizers, whose step holds one
parameter-sized temporary. ``target="cpu"`` traces exactly the CPU step, which is what
the tests compare with real tensors.

ZeRO and offload cannot run in one CPU process. The unsharded step is traced and the
sharding is arithmetic on the traced categories at every recorded instant (REFERENCE,
Rajbhandari et al.): stage 1 divides optimizer state by the world size, stage 2 also the
gradients, stage 3 also the parameters (plus the largest layer, gathered); offload
takes optimizer state (and parameters) off the GPU onto the host.

MemTracker's categories: Parameter, Buffer, Gradient, Optstate (anything created inside
``optimizer.step``, its temporaries included), Activation (anything created in the
forward pass or a checkpointed recompute, autocast's 16-bit weight copies included),
Temp (anything else created in backward: activation gradients, and a parameter's
gradient for the instant before its hook relabels it), Other (registered from outside:
here DDP's gradient buckets). Quirks handled here:
- it refuses a second forward of the root module unless ``reset_mod_stats`` is called;
- tensors alive before it starts count only when registered with ``track_external``;
- its per-module peak bookkeeping costs O(modules) per operator (two thirds of a 7B
  trace); ``_Tracker`` replaces it by one global sample per operator;
- its module hooks put autograd nodes into reference cycles, so tensors a plain run
  frees at once wait for the garbage collector (see ``_train_step``);
- it rounds to the CUDA allocator's 512 bytes only for CUDA tensors, so traced bytes
  are exact storage sizes.
Fake tensors have quirks of their own: code that reads tensor values cannot run, and
transformers then takes its tracing paths (see ``_unpacked_batches``); a few meta
kernels differ from the real ones (native_layer_norm's mean/rstd stay 16-bit for a
16-bit input: a few KiB).
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._pytree import tree_map_only

from .. import models
from ..errors import ConfigError, HpcmemError, PlanError
from ..optimizers import BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL
from ..plan import Plan
from ..sites import Partition
from . import COMPONENTS, Estimate
from .gpu import paged_states

MIB = 1024 * 1024
CATEGORIES = ("params", "buffers", "grads", "activations", "temporaries", "optimizer", "other")
"""Traced categories in sample order: MemTracker's Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other."""
_TRACKER_NAMES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")
PHASES = ("forward", "backward", "optimizer")
HOST_BUFFER_FACTOR = 1.5
"""DeepSpeed's estimators multiply offloaded host memory by 1.5 for pinned and staging buffers (REFERENCE)."""
LR = 1e-4
LOSS_SCALE = 65536.0
"""GradScaler's initial scale (fp16-mixed)."""


# -- what a model factory returns -------------------------------------------------------

@dataclass(frozen=True)
class TracedModel:
    """A model to trace, from ``model_factory()`` (called inside the fake mode).

    ``make_batch(micro_batch, seq_len)`` makes one input batch: a dict (called as
    ``module(**batch)``), a tuple or list (``module(*batch)``) or one tensor
    (``module(batch)``). ``loss_fn(output, batch)`` turns the output into a scalar loss;
    None takes ``output.loss``, ``output["loss"]`` or a scalar output itself.
    A factory may also return the plain tuple ``(module, make_batch, loss_fn)``.
    """

    module: Any
    make_batch: Callable[[int, int], Any]
    loss_fn: Callable[[Any, Any], Any] | None = None


@dataclass(frozen=True)
class Trace:
    """What one traced run recorded (bytes; one sample per operator)."""

    samples: tuple[tuple[int, int, int, int, int, int, int, int, int], ...]
    """(step, phase index into PHASES, then bytes by CATEGORIES) after every operator."""
    step_ends: tuple[dict[str, int], ...]
    """Bytes by category after each step's zero_grad (what stays between steps)."""
    n_params: int
    largest_layer_bytes: int
    """Parameter bytes of the module with the most of its own (ZeRO-3 gathers one at a time)."""
    seconds: float
    notes: tuple[str, ...] = ()
    paged_bytes: int = 0
    """a paged optimizer's states in CUDA unified memory, outside the allocator (not in the samples)"""

    def peak(self, scale: Mapping[str, float] | None = None, extra: int = 0,
             gathered: float = 0.0) -> tuple[int, dict[str, float]]:
        """(index of the peak sample, bytes by category there) with categories scaled (default 1), plus
        ``gathered`` times the traced parameters in the forward and backward passes (not at the step)."""
        return _scaled_peak(self.samples, scale or {}, extra, gathered)


@dataclass
class _Layout:
    """How a plan's precision lands on tensors in the runtime it names."""

    weight_dtype: Any
    autocast_dtype: Any = None
    master_weights: bool = False
    loss_scaling: bool = False
    notes: list[str] = field(default_factory=list)


# -- the public entry ------------------------------------------------------------------

def estimate_traced(model_config: Mapping[str, Any] | None, task: str, plan: Plan, partition: Partition, *,
                    model_factory: Callable[[], Any] | None = None, allocator_overhead_frac: float | None = None,
                    cuda_context_mib: float | None = None, steps: int = 2, runtime=None,
                    allocator_model: bool = True) -> Estimate:
    """Trace ``steps`` training steps of the plan's model and return its memory per GPU (MiB).

    ``model_config`` is a transformers config dict (``toolkit.models.load_model_config``)
    for ``task`` (causal-lm, seq-cls, image-cls: random ``pixel_values`` of the config's
    image size, the plan's seq_len not used); or ``model_factory`` makes the model (see
    ``TracedModel``; then ``model_config`` and ``task`` are not used). The peak is the
    highest traced total over all steps after ZeRO/offload arithmetic.
    On a GPU partition the step's real alloc/free stream is recorded from a second fake run
    (``record_training``: every storage, in order, seen by ``record.StorageRecorder``) and replayed through the caching-allocator
    model (``allocator.py``) under the plan's ``alloc_conf``: ``peak_reserved_mib`` is its reserved
    peak (for a sharded engine, whose rank the unsharded trace is not, the traced peak plus what the
    allocator adds over the analytic stream of the same plan). ``device_used_mib`` = CUDA context
    (``cuda_context_mib``, default the partition's) + peak reserved + memory outside the allocator.
    ``allocator_overhead_frac`` (a partition's measured reserved/allocated - 1) raises the reserved
    peak where it says more. Capacity is the partition's GPU memory, or
    on a CPU partition each rank's share of the node's memory (``mem_mib`` if the plan
    sets it, else the partition default, else all of it).
    """
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    if allocator_overhead_frac is not None and allocator_overhead_frac < 0:
        raise ConfigError(f"allocator_overhead_frac must be >= 0, got {allocator_overhead_frac}")
    target = "cuda" if partition.has_gpu else "cpu"
    keep_grads = runtime is not None and not runtime.frees_grads
    late_zero = runtime is not None and runtime.grads_through_forward
    trace = trace_training(model_config, task, plan, target=target, model_factory=model_factory, steps=steps,
                           set_to_none=not keep_grads, zero_before_backward=late_zero,
                           logits_fp32=runtime is None or runtime.logits_fp32,
                           softmax_saves_input=runtime is not None and runtime.softmax_saves_input,
                           repeats_kv=runtime is not None and runtime.sdpa_repeats_kv,
                           output_kept=runtime.output_kept if runtime is not None else None,
                           ddp_single_process=runtime is not None and runtime.ddp_single_process)
    notes_extra = ["zero_grad keeps the gradients between steps (the runtime's torch < 2.0)"] if keep_grads else []
    if runtime is not None and runtime.softmax_saves_input:
        notes_extra.append(f"torch {runtime.torch_version}: softmax keeps its input for the backward too (emulated)")
    if runtime is not None and runtime.model_code != "transformers":
        notes_extra.append(f"traced the transformers class of the config, not {runtime.model_code}'s model "
                           "(the analytic method models its differences)")
    if runtime is not None and runtime.rotary_tables:
        notes_extra.append("traced the installed transformers, which computes its rotary tables per forward, not the "
                           "older per-layer tables (the analytic method counts them)")
    if runtime is not None and runtime.loss_chunk_rows:
        notes_extra.append(f"traced one cross-entropy over all rows, not chunks of {runtime.loss_chunk_rows} "
                           "(the analytic method models the chunked loss)")
    if late_zero:
        notes_extra.append("zero_grad is called between the loss and the backward: the previous step's gradients "
                           "live through the forward")
    notes = list(trace.notes) + notes_extra
    try:
        partition.check_plan(plan)
    except PlanError as exc:
        notes.append(f"the partition cannot run this plan as it stands: {exc}")
    engine = _engine_states(model_config, task, plan, runtime, partition.has_gpu)
    gpu, host_bytes, shard_notes = shard(trace, plan, engine)
    notes += shard_notes
    # a paged optimizer's states, outside the allocator: the engine's share where it shards the states, else the
    # traced ones at the placement's share (none offloaded: the stand-in pages nothing then)
    paged = (engine.paged_optimizer_bytes if engine is not None
             else trace.paged_bytes * plan.strategy.placement(plan).optimizer) if partition.has_gpu else 0
    context = partition.cuda_context_mib if cuda_context_mib is None else float(cuda_context_mib)
    dm = None
    if partition.has_gpu and allocator_model:
        dm = _replayed(model_config, task, plan, partition, context, model_factory, runtime, notes)
    return _estimate(gpu, host_bytes, plan, partition, context, allocator_overhead_frac, notes, dm, paged)


def _engine_states(model_config, task: str, plan: Plan, runtime, gpu: bool):
    """DeepSpeed's or FSDP's ModelStates of the plan's model (``strategies.deepspeed``, ``strategies.fsdp``), or None
    (another engine, or a model whose shape the config does not give)."""
    if plan.launcher not in ("deepspeed", "fsdp") or model_config is None:
        return None
    from ..errors import ConfigError as _ConfigError
    from ..modelshape import ModelShape
    from . import analytic as an

    try:
        shape = ModelShape.from_config(model_config, task=task)
    except _ConfigError:
        return None
    return an.model_states(shape, plan, an.dtypes_for(plan, gpu), runtime or an.DEFAULT_RUNTIME)


def _replayed(model_config, task: str, plan: Plan, partition: Partition, context: float, model_factory, runtime,
              notes: list[str]):
    """The caching allocator's view of the plan's step (``device.DeviceMemory``): the recorded stream of
    an unsharded (torchrun) step replayed; for a sharded engine the analytic stream's replay (its
    reserved-over-allocated added to the traced peak by ``_estimate``). None when neither can be had."""
    from .device import plan_device_memory
    from .gpu import DEFAULT_RUNTIME
    from .stream import gemm_workspaces

    capacity = partition.gpu_mem_gib * 1024 - context
    if plan.launcher == "torchrun":

        events = record_training(model_config, task, plan, target="cuda", model_factory=model_factory,
                                 set_to_none=runtime is None or runtime.frees_grads,
                                 zero_before_backward=runtime is not None and runtime.grads_through_forward,
                                 logits_fp32=runtime is None or runtime.logits_fp32,
                                 softmax_saves_input=runtime is not None and runtime.softmax_saves_input,
                                 ddp_side_stream=runtime is not None and runtime.ddp_side_stream,
                                 workspaces=gemm_workspaces(partition.gpu_model, runtime or DEFAULT_RUNTIME),
                                 repeats_kv=runtime is not None and runtime.sdpa_repeats_kv,
                                 output_kept=runtime.output_kept if runtime is not None else None,
                                 ddp_single_process=runtime is not None and runtime.ddp_single_process)
        return plan_device_memory(None, plan, None, None, None, gpu_model=partition.gpu_model,
                                  capacity_mib=capacity, runtime=runtime, events=events)
    if model_config is None:
        notes.append("allocator not replayed: a sharded engine's stream comes from the analytic model, which needs "
                     "a model config")
        return None
    from ..errors import ConfigError as _ConfigError
    from ..modelshape import ModelShape
    from . import analytic as an

    try:
        shape = ModelShape.from_config(model_config, task=task)
    except _ConfigError as exc:
        notes.append(f"allocator not replayed: the analytic stream of a sharded engine needs the model's shape ({exc})")
        return None
    dt = an.dtypes_for(plan, True)
    states = an.model_states(shape, plan, dt, runtime or an.DEFAULT_RUNTIME)
    acts = an.activations(shape, plan, dt, runtime or an.DEFAULT_RUNTIME)
    notes.append(f"{plan.launcher}: the allocator's overhead over the tensors is the analytic stream's, replayed")
    dm = plan_device_memory(shape, plan, dt, states, acts, gpu_model=partition.gpu_model, capacity_mib=capacity,
                            runtime=runtime)
    # the overhead is taken over the analytic method's own allocated peak (its phases) where that is lower than the
    # stream's: the stream holds as allocated the blocks whose frees wait on another stream where it keeps them to
    # the step's end (FSDP1 without its all-gather limiter), which max_memory_allocated does not count
    phased = an.estimate_analytic(shape, plan, partition, runtime=runtime, allocator_model=False).peak_allocated_mib
    if dm is not None and phased < dm.peak_allocated_mib:
        dm = replace(dm, peak_allocated_mib=phased)
    return dm


def trace_training(model_config: Mapping[str, Any] | None, task: str, plan: Plan, *, target: str = "cuda",
                   model_factory: Callable[[], Any] | None = None, steps: int = 2, fake: bool = True,
                   set_to_none: bool = True, zero_before_backward: bool = False, logits_fp32: bool = True,
                   softmax_saves_input: bool = False, repeats_kv: bool = False, output_kept: str | None = None,
                   ddp_single_process: bool = False) -> Trace:
    """Run ``steps`` training steps of the plan's model under MemTracker and record every operator.

    ``target`` "cuda" follows CUDA's behaviour where the CPU's differs in memory, "cpu"
    traces the CPU step as it is. ``fake=False`` runs the same steps on real CPU tensors
    (for checking the trace against reality on small models). ``output_kept``, ``ddp_single_process``:
    the ``Runtime`` fields.
    """
    if target not in ("cuda", "cpu"):
        raise ConfigError(f"target must be cuda or cpu, got {target!r}")
    if not fake and target != "cpu":
        raise ConfigError("real tensors run here on the CPU: fake=False needs target='cpu'")
    if model_factory is None and model_config is None:
        raise ConfigError("estimate_traced needs a model config or a model_factory")
    started = time.perf_counter()
    layout = _layout(plan)
    notes = list(layout.notes)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with (_quiet(), _no_automatic_gc(), mode, _device_behaviour(target, notes, repeats_kv),
          _unpacked_batches(model_factory is None), _value_free_init(fake)):
        traced = _build(model_config, task, plan, layout, target, model_factory, notes, logits_fp32)
        module = traced.module
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = _make_optimizer(plan, params, layout, target, notes)
        buckets = _ddp_buckets(plan, params, notes, ddp_single_process)  # held for the whole trace, as DDP holds them
        tracker = _Tracker()
        tracker.track_external(module, optimizer, *buckets)
        kept = {"rule": output_kept} if output_kept else None
        with tracker, _softmax_saving_input(softmax_saves_input):
            for step in range(steps):
                tracker.step = step
                _train_step(traced, plan, layout, optimizer, tracker, set_to_none, zero_before_backward, kept=kept)
                tracker.step_ends.append(tracker.current())
    if not tracker.samples:
        raise HpcmemError("MemTracker recorded nothing: this torch version's MemTracker differs from the one "
                          "hpcmem knows (torch.distributed._tools.mem_tracker)")
    n_params = sum(p.numel() for p in params)
    if steps == 1:
        notes.append("one step traced: no steady state (optimizer state appears only at its end)")
    if plan.grad_accum > 1:
        notes.append(f"grad_accum {plan.grad_accum}: two micro-batches traced per step (later ones repeat the second)")
    return Trace(samples=tuple(tracker.samples), step_ends=tuple(tracker.step_ends), n_params=n_params,
                 largest_layer_bytes=_largest_layer_bytes(module), seconds=time.perf_counter() - started,
                 notes=tuple(notes), paged_bytes=getattr(getattr(optimizer, "inner", optimizer), "paged_bytes", 0))


def run_training_steps(model_config: Mapping[str, Any] | None, task: str, plan: Plan, *,
                       model_factory: Callable[[], Any] | None = None, steps: int = 2) -> None:
    """The traced steps on real CPU tensors with nothing watching: what a trace is checked against."""
    notes: list[str] = []
    layout = _layout(plan)
    with _quiet():
        traced = _build(model_config, task, plan, layout, "cpu", model_factory, notes)
        params = [p for p in traced.module.parameters() if p.requires_grad]
        optimizer = _make_optimizer(plan, params, layout, "cpu", notes)
        buckets = _ddp_buckets(plan, params, notes)  # noqa: F841 - held like DDP holds them
        for _ in range(steps):
            _train_step(traced, plan, layout, optimizer, None)


# -- ZeRO and offload: arithmetic on the traced categories -------------------------------

def shard(trace: Trace, plan: Plan, engine=None) -> tuple[dict[str, float], float, list[str]]:
    """Per-GPU bytes by category at the sharded peak, host bytes per node, notes.

    The sharded total is recomputed at every traced instant and the highest is taken, so
    the peak may move (e.g. from the optimizer step to the backward pass) once a category
    shrinks. Host memory: each of a node's ranks keeps its shard of what is offloaded
    (optimizer state with fp32 gradients; parameters), times HOST_BUFFER_FACTOR.
    ``engine``: DeepSpeed's own device memory from the strategy's ModelStates of the plan's model, when
    its shape is known: its gathered weights at their largest, its gradient buckets and ZeRO-3 offload's
    hand-over transient are added at the peak instead of one gathered layer (a bound: each at its largest).
    """
    n = plan.world_size
    place = plan.strategy.placement(plan)
    scale = {"params": place.params, "grads": place.grads, "optimizer": place.optimizer}
    extra = int(trace.largest_layer_bytes * place.gathered_layers)
    extras = (f", plus {place.gathered_layers:g} gathered layer(s)", "); communication buckets are not counted")
    if engine is not None and plan.launcher == "deepspeed":
        # with the optimizer offloaded the traced step has nothing on the device: the engine's own step copy (older
        # ZeRO-1/2: the fp32 partition) comes after the hand-over, so the larger of the two
        step_copy = engine.step_temp_bytes if plan.offload_optimizer != "none" else 0.0
        extra = int(engine.gathered_bytes + engine.buffer_bytes + engine.grad_bucket_bytes
                    + max(engine.reduce_temp_bytes, step_copy))
        extras = ("", f"); DeepSpeed's own device memory added at the peak, each part at its largest: "
                      f"{engine.gathered_bytes / MIB:.0f} MiB of gathered weights (its parameter coordinator), "
                      f"{(engine.buffer_bytes + engine.grad_bucket_bytes) / MIB:.0f} MiB of gradient buckets, "
                      f"{max(engine.reduce_temp_bytes, step_copy) / MIB:.0f} MiB handing a gradient to the host "
                      "or copying the stepped partition back")
    # the traced weights are in the engine's layout dtype (FSDP mixed precision: the 16-bit compute copy, the
    # fp32 shards being the master), which is the dtype the gathered weights are kept in
    gathered = place.gathered_params
    fsdp = engine is not None and plan.launcher == "fsdp"
    if fsdp:
        # FSDP's own device memory in the forward and backward, each part at its largest: the gathered units and the
        # root (its moments' largest, in place of the traced weights scaled), the unsharded gradients kept across a
        # no_sync accumulation, a unit's unsharded gradients and the reduction's buffers (or the head's gradient
        # held to the backward's end); the root's reduction at the backward's end is a moment of its own (below)
        gathered = 0.0
        reducing = engine.grad_bucket_bytes + max(engine.reduce_extra_bytes, engine.head_reduce_bytes,
                                                  engine.held_head_bytes)
        extra = int(engine.gathered_bytes + engine.accumulated_grads_bytes + reducing)
        extras = ("", f"); FSDP's own device memory added in the forward and backward, each part at its largest: "
                      f"{engine.gathered_bytes / MIB:.0f} MiB of gathered weights, "
                      f"{engine.accumulated_grads_bytes / MIB:.0f} MiB of gradients kept unsharded across "
                      f"micro-batches, {reducing / MIB:.0f} MiB reducing a unit's gradients")
    notes: list[str] = []
    if plan.strategy.sharded:
        kept = (f", and the whole model's weights gathered from each layer's forward to its backward (x{gathered:.3g})"
                if gathered else "")
        notes.append(f"{plan.strategy.describe(plan)} over {n} rank(s) is arithmetic on the traced unsharded step "
                     f"(on the device: parameters x{place.params:.3g}, gradients x{place.grads:.3g}, optimizer "
                     f"x{place.optimizer:.3g}{extras[0]}{kept}{extras[1]}")
    if fsdp:
        at, gpu = _fsdp_peak(trace, scale, extra, engine)
    else:
        at, gpu = trace.peak(scale, extra, gathered)
    step, phase = trace.samples[at][:2]
    notes.append(f"peak first reached in the {PHASES[phase]} pass of step {step + 1} of {len(trace.step_ends)} "
                 f"({len(trace.samples)} operators traced in {trace.seconds:.1f} s)")
    steady = trace.step_ends[-1]
    ranks_per_node = plan.gpus_per_node
    # fp32 state + the fp32 gradient partition; parameters
    offloaded = (steady["optimizer"] + 4 * trace.n_params) * place.host_optimizer + steady["params"] * place.host_params
    host = 0.0 if place.nvme else offloaded * ranks_per_node * HOST_BUFFER_FACTOR
    nvme = offloaded if place.nvme else 0.0
    if nvme:
        notes.append(f"NVMe offload keeps {nvme * ranks_per_node / MIB:.0f} MiB per node in nvme_path "
                     "(host buffers for it are not counted)")
    return gpu, host, notes


def _fsdp_peak(trace: Trace, scale: Mapping[str, float], extra: int, engine) -> tuple[int, dict[str, float]]:
    """FSDP's peak over the traced step: the forward and backward samples with FSDP's own memory (``extra``), the
    optimizer's without it (nothing is gathered or reduced then), and the root's reduction in the backward's final
    callback: the last backward sample's states (its weights resharded, its own gradient shard not made yet) with
    the root's unsharded gradients and reduce-scatter buffers (``ModelStates.end_reduce_bytes``)."""
    step_phase = PHASES.index("optimizer")
    best: tuple[float, int, dict[str, float]] | None = None
    for i, sample in enumerate(trace.samples):
        total = 0.0
        cats = {}
        for name, b in zip(CATEGORIES, sample[2:]):
            cats[name] = float(scale.get(name, 1.0)) * b
            total += cats[name]
        if sample[1] != step_phase:
            total += extra
        if best is None or total > best[0]:
            best = (total, i, cats)
    total, at, cats = best
    cats = dict(cats)
    if trace.samples[at][1] != step_phase:
        cats["params"] += extra
    last_backward = max((i for i, smp in enumerate(trace.samples) if smp[1] == PHASES.index("backward")), default=None)
    if engine.end_reduce_bytes > 0 and last_backward is not None:
        end = {name: float(scale.get(name, 1.0)) * b for name, b in zip(CATEGORIES, trace.samples[last_backward][2:])}
        end["activations"] = 0.0
        end["grads"] = max(end["grads"] - engine.end_reduce_share, 0.0)
        end["temporaries"] = float(engine.end_reduce_bytes)
        if sum(end.values()) > sum(cats.values()):
            return last_backward, end
    return at, cats


def _scaled_peak(samples: Sequence[tuple], scale: Mapping[str, float], extra: int,
                 gathered: float = 0.0) -> tuple[int, dict[str, float]]:
    optimizer_phase = PHASES.index("optimizer")
    base = [float(scale.get(name, 1.0)) for name in CATEGORIES]
    passes = [f + (gathered if name == "params" else 0.0) for name, f in zip(CATEGORIES, base)]
    best, best_total = 0, -1.0
    for i, sample in enumerate(samples):
        factors = base if sample[1] == optimizer_phase else passes
        total = sum(f * b for f, b in zip(factors, sample[2:]))
        if total > best_total:
            best, best_total = i, total
    factors = base if samples[best][1] == optimizer_phase else passes
    out = {name: f * b for name, f, b in zip(CATEGORIES, factors, samples[best][2:])}
    out["params"] += extra
    return best, out


# -- Estimate --------------------------------------------------------------------------

def _estimate(gpu: Mapping[str, float], host_bytes: float, plan: Plan, partition: Partition, context_mib: float,
              overhead_frac: float | None, notes: list[str], dm=None, paged_bytes: float = 0.0) -> Estimate:
    parts = {"params": (gpu["params"] + gpu["buffers"]) / MIB,
             "grads": (gpu["grads"] + gpu["other"]) / MIB,  # "other" holds only DDP's gradient buckets
             "optimizer": gpu["optimizer"] / MIB, "activations": gpu["activations"] / MIB,
             "temporaries": gpu["temporaries"] / MIB}
    peak = sum(parts.values())
    extras: dict[str, float] = {}
    reserved = peak
    if dm is not None:
        extras = dict(dm.extras_mib)
        if plan.launcher == "torchrun":
            reserved = max(peak, dm.peak_reserved_mib)
        else:
            reserved = peak + max(0.0, dm.peak_reserved_mib - dm.peak_allocated_mib)
        notes.append(f"caching allocator replayed: {reserved:.0f} MiB reserved, {dm.fragmentation:.0%} of it "
                     f"unallocated at its peak, {dm.segments} segments")
        if dm.fragmentation_only:
            notes.append("the tensors fit but the allocator's reserved memory does not (fragmentation)"
                         + (f": PYTORCH_CUDA_ALLOC_CONF={dm.fix} makes it fit" if dm.fix else ""))
    if partition.has_gpu and overhead_frac is not None:
        reserved = max(reserved, peak * (1 + overhead_frac))
    parts["cuda_context"] = context_mib
    parts["allocator_overhead"] = reserved - peak
    components = {name: round(parts[name], 3) for name in COMPONENTS}
    device_used = context_mib + reserved + sum(extras.values())
    host = host_bytes / MIB
    if partition.has_gpu:
        capacity = partition.gpu_mem_gib * 1024
        if paged_bytes > 0:  # resident as the room this method's fit leaves allows, the rest on the host
            paged_host, note = paged_states(paged_bytes / MIB, capacity - device_used, plan.gpus_per_node)
            host += paged_host
            notes.append(note)
        headroom = capacity - device_used
        node_mem = plan.mem_mib or partition.host_mem_gib * 1024
        fits = headroom >= 0 and host <= node_mem and (dm is None or dm.fits or plan.launcher != "torchrun")
        if host > node_mem:
            notes.append(f"offload needs {host:.0f} MiB of host memory per node; the node offers {node_mem:.0f} MiB")
    else:
        node_mem = plan.mem_mib or partition.default_mem_mib or partition.host_mem_gib * 1024
        capacity = node_mem / plan.gpus_per_node
        headroom = capacity - device_used - host / plan.gpus_per_node
        fits = headroom >= 0
        notes.append(f"CPU partition: capacity is each of {plan.gpus_per_node} rank(s)' share of {node_mem:.0f} MiB "
                     "host memory per node; cuda_context stands for each process's own baseline")
    fix = dm.fix if dm is not None and dm.fragmentation_only else None
    return Estimate(method="traced", components=components, peak_allocated_mib=round(peak, 3),
                    device_used_mib=round(device_used, 3), host_mib_per_node=round(host, 3),
                    capacity_mib=round(capacity, 3), headroom_mib=round(headroom, 3), fits=fits, notes=tuple(notes),
                    peak_reserved_mib=round(reserved, 3) if partition.has_gpu else round(peak, 3),
                    fragmentation=dm.fragmentation if dm else 0.0, segments=dm.segments if dm else 0,
                    gpu_extras_mib=extras, fits_allocated=dm.fits_allocated if dm else None,
                    fragmentation_only=bool(dm and dm.fragmentation_only), alloc_conf_fix=fix,
                    fix_device_used_mib=(context_mib + dm.fix_peak_reserved_mib + sum(extras.values())
                                         if fix and dm.fix_peak_reserved_mib is not None else None))


# -- building the model ----------------------------------------------------------------

def _layout(plan: Plan) -> _Layout:
    """Where the plan's precision puts bytes, as its engine sets it up (toolkit/strategies/)."""
    want = plan.strategy.layout(plan)
    out = _Layout(getattr(torch, want.weights), autocast_dtype=getattr(torch, want.autocast) if want.autocast else None,
                  master_weights=want.master_weights, loss_scaling=want.loss_scaling)
    if want.note:
        out.notes.append(want.note)
    return out


def _build(model_config, task, plan: Plan, layout: _Layout, target: str, model_factory,
           notes: list[str], logits_fp32: bool = True) -> TracedModel:
    """The model (already in the fake mode), its batch maker and loss, with checkpointing applied.
    ``logits_fp32=False`` (a causal LM): the loss is ``F.cross_entropy`` on the model's own (16-bit)
    logits, as litgpt and hand-written loops take it, instead of transformers' loss, which upcasts them."""
    if model_factory is not None:
        with _default_dtype(layout.weight_dtype):
            traced = _as_traced_model(model_factory())
        _check_dtypes(traced.module, layout.weight_dtype, notes)
        if plan.checkpointing:
            if hasattr(traced.module, "gradient_checkpointing_enable"):
                traced.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                notes.append("checkpointing asked for, but the module has no gradient_checkpointing_enable(): "
                             "traced without")
        traced.module.train()
        return traced
    from ..models import HF_ATTENTION

    config = models.transformers_config(dict(model_config), task)
    limit = models.max_positions(config)
    if task not in models.IMAGE_TASKS and limit is not None and plan.seq_len > limit:
        raise PlanError(f"seq_len {plan.seq_len} is longer than the model's {limit} positions")
    if task in models.IMAGE_TASKS:
        c, h, w = models.image_input_shape(config)
        notes.append(f"{task}: {c}x{h}x{w} pixels per sample from the model's config; the plan's seq_len "
                     f"({plan.seq_len}) does not apply")
    attention = HF_ATTENTION[plan.attention]
    if plan.attention == "flash":
        attention = "sdpa"
        notes.append("attention=flash traced as sdpa (flash_attention_2 exists only for CUDA; "
                     "neither keeps the attention matrix)")
    dtype = None if layout.weight_dtype == torch.float32 else layout.weight_dtype
    module = models.build_model(config, task, attention, dtype=dtype)
    if plan.checkpointing:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.train()
    if task == "causal-lm" and not logits_fp32:
        notes.append("loss: F.cross_entropy on the model's logits in their own dtype (no fp32 upcast)")
        return TracedModel(module, *_lm_batch_and_plain_loss(config, target))
    return TracedModel(module, _hf_batch_maker(config, task, target))


def _lm_batch_and_plain_loss(config, target: str):
    """A causal LM's batch without labels (so the model computes no loss of its own) and a loss on its
    logits as they come: ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())`` with targets
    already shifted by the data (litgpt, the LLMs-from-scratch book)."""
    vocab = int(config.vocab_size)
    held: dict = {}

    def make_batch(micro_batch: int, seq_len: int) -> dict:
        ids = torch.randint(0, vocab, (micro_batch, seq_len))
        held["targets"] = ids.clone() if target == "cuda" else ids
        return {"input_ids": ids}

    def loss_fn(output, batch):  # noqa: ARG001 - the batch holds no targets (the model must not see them)
        logits = output.logits if hasattr(output, "logits") else output["logits"]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), held.pop("targets").flatten())

    return make_batch, loss_fn


def _hf_batch_maker(config, task: str, target: str) -> Callable[[int, int], dict]:
    if task in models.IMAGE_TASKS:
        # fp32 pixels of the config's image size and integer labels, as train.py makes them;
        # the encoder's sequence (patches + CLS) follows from the config, not from seq_len.
        return lambda micro_batch, seq_len: models.random_image_batch(config, micro_batch)
    vocab = int(config.vocab_size)
    labels_n = int(getattr(config, "num_labels", 2) or 2)

    def make_batch(micro_batch: int, seq_len: int) -> dict:
        ids = torch.randint(0, vocab, (micro_batch, seq_len))
        if task == "causal-lm":
            # train.py moves input_ids and labels to the GPU one by one: two device copies.
            # On the CPU .to() is a no-op and they stay one tensor.
            labels = ids.clone() if target == "cuda" else ids
        else:
            labels = torch.randint(0, labels_n, (micro_batch,))
        return {"input_ids": ids, "labels": labels}

    return make_batch


def _as_traced_model(made: Any) -> TracedModel:
    if isinstance(made, TracedModel):
        return made
    if isinstance(made, (tuple, list)) and len(made) in (2, 3):
        return TracedModel(*made)
    raise ConfigError("model_factory() must return a TracedModel or a tuple (module, make_batch, loss_fn); "
                      f"got {type(made).__name__}")


def _check_dtypes(module, dtype, notes: list[str]) -> None:
    other = sorted({str(p.dtype) for p in module.parameters() if p.is_floating_point() and p.dtype != dtype})
    if other:
        notes.append(f"model_factory built some parameters in {', '.join(other)} where the plan puts weights "
                     f"in {dtype}: traced as built (a fake model cannot be converted afterwards; "
                     "build in torch's default dtype)")


def _largest_layer_bytes(module) -> int:
    best = 0
    for sub in module.modules():
        best = max(best, sum(p.numel() * p.element_size() for p in sub.parameters(recurse=False)))
    return best


def _ddp_buckets(plan: Plan, params: list, notes: list[str], single_process: bool = False) -> list:
    """DistributedDataParallel's gradient buckets (torchrun over several ranks), as flat tensors.

    train.py wraps the model in DDP with its defaults: gradient_as_bucket_view is off, so
    the buckets hold one more copy of every gradient for the all-reduce, from the start.
    MemTracker files them under "Other"; the estimate counts them as gradients.
    """
    from ..strategies.ddp import builds_ddp

    if not builds_ddp(plan, single_process):
        return []
    sizes: dict[Any, int] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    ranks = f"{plan.world_size} rank{'s' if plan.world_size > 1 else ''}"
    notes.append(f"DDP over {ranks}: its gradient buckets hold one more copy of the gradients "
                 "(gradient_as_bucket_view is off by default)")
    return [torch.empty(n, dtype=dtype) for dtype, n in sizes.items()]


# -- optimizers -------------------------------------------------------------------------

def _make_optimizer(plan: Plan, params: list, layout: _Layout, target: str, notes: list[str]):
    if layout.master_weights:
        return _MasterWeights(params, lambda masters: _base_optimizer(plan, masters, target, notes))
    return _base_optimizer(plan, params, target, notes)


def _base_optimizer(plan: Plan, params: list, target: str, notes: list[str]):
    """The plan's optimizer as its row in toolkit/optimizers.py builds it, for the target device.

    torch picks the multi-tensor (foreach) implementation for CUDA tensors and the per-tensor
    loop for CPU ones (the foreach step holds a parameter-sized temporary): the rows that leave
    the choice to torch follow the target. The fused row runs torch's fused kernel (CPU fused
    AdamW on fake tensors: no temporaries, as on CUDA). bitsandbytes' rows cannot run here.
    """
    from .. import optimizers

    row = optimizers.get(plan.optimizer)
    if row.quantized:
        # paged only next to CUDA parameters (offloaded states are host tensors, made plain)
        device = target == "cuda" and plan.offload_optimizer == "none" and plan.offload_params == "none"
        notes.append(f"{row.name} (bitsandbytes) cannot run on the CPU: its state is sized analytically, 2 bytes per "
                     f"parameter (fp32 moments for tensors under {BNB_MIN_8BIT_SIZE} elements; block scales ignored)"
                     + (f"; the states of tensors of {BNB_PAGED_MIN_NUMEL} elements or more are paged, outside the "
                        "allocator" if row.paged and device else ""))
        return _EightBitAdamWStandIn(params, paged=row.paged and device)
    if row.name in ("adamw", "sgd", "sgd-plain"):
        return models.build_optimizer(row.name, params, LR, foreach=target == "cuda")
    if row.name == "adamw-fused":
        return torch.optim.AdamW(params, lr=LR, fused=True)
    return models.build_optimizer(row.name, params, LR)


class _EightBitAdamWStandIn(torch.optim.Optimizer):
    """bitsandbytes AdamW8bit's memory: two uint8 moments per parameter, updated in place. ``paged``
    (PagedAdamW8bit on CUDA): the moments of a parameter of ``BNB_PAGED_MIN_NUMEL`` elements or more are in
    unified memory, outside the caching allocator: not made here, counted in ``paged_bytes``."""

    def __init__(self, params, paged: bool = False):
        super().__init__(params, {"lr": LR})
        self.paged = paged
        self.paged_bytes = 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    if self.paged and p.numel() >= BNB_PAGED_MIN_NUMEL:
                        state["paged"] = True
                        self.paged_bytes += 2 * p.numel()
                    else:
                        dtype = torch.uint8 if p.numel() >= BNB_MIN_8BIT_SIZE else torch.float32
                        state["state1"] = torch.zeros_like(p, dtype=dtype)
                        state["state2"] = torch.zeros_like(p, dtype=dtype)
                p.add_(p.grad, alpha=-group["lr"])  # the fused kernel updates in place


class _MasterWeights(torch.optim.Optimizer):
    """DeepSpeed's mixed precision: fp32 master copies of the 16-bit weights carry the optimizer.

    The masters exist from the start (DeepSpeed makes them at initialize); each step
    copies the 16-bit gradients to fp32, steps the inner optimizer on the masters and
    copies them back into the 16-bit weights.
    """

    def __init__(self, params, make_inner):
        super().__init__(params, {})
        self._pairs = []
        for group in self.param_groups:
            for p in group["params"]:
                master = p.detach().to(torch.float32)
                self.state[p]["master"] = master
                self._pairs.append((p, master))
        self.inner = make_inner([m for _, m in self._pairs])

    @torch.no_grad()
    def step(self, closure=None):
        for p, master in self._pairs:
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, master in self._pairs:
            p.copy_(master)
            master.grad = None


# -- the training step -------------------------------------------------------------------

def _train_step(traced: TracedModel, plan: Plan, layout: _Layout, optimizer, tracker, set_to_none: bool = True,
                zero_before_backward: bool = False, before_backward: Callable[[], None] | None = None,
                kept: dict | None = None) -> None:
    """One optimizer step as train.py runs it: micro-batches under autocast, backward, step, zero_grad.
    ``zero_before_backward``: as loops that call ``optimizer.zero_grad()`` between the loss and the
    backward do, the previous step's gradients stay until the first micro-batch's backward.
    ``before_backward``: called before each micro-batch's ``backward()``.
    ``kept``: a loop that keeps the model's output in a variable (``Runtime.output_kept``), as
    ``kept["output"]``, from one call to the next: rebound once the next forward has returned it (under a
    ``loss_fn`` of the TracedModel's, before that loss for ``kept["rule"]`` "logits", after it for
    "model_output"; a transformers model given labels computes its loss inside the forward).

    ``tracker`` (None when nothing watches) learns the phase. Under it, MemTracker's module
    hooks put autograd nodes into reference cycles, so what a plain run frees when the last
    reference goes waits for the cycle collector: it is run at the points where the plain
    run has let go of a micro-batch (automatic collection is off, for repeatable traces).
    Everything a step creates is still in the youngest generation, so collecting that one
    frees the same (checked) at a fraction of a full collection's cost.
    """
    micro_steps = min(plan.grad_accum, 2)
    for micro in range(micro_steps):
        _set_phase(tracker, 0)
        batch = traced.make_batch(plan.micro_batch, plan.seq_len)
        autocast = (torch.autocast("cpu", dtype=layout.autocast_dtype) if layout.autocast_dtype is not None
                    else contextlib.nullcontext())
        with autocast:
            # The output (logits and all) and the batch go before backward, as in train.py's
            # ``loss = model(**batches.next()).loss``; only the loss's graph keeps what it needs
            # (an image batch's fp32 pixels are freed once autocast has made its 16-bit copy),
            # unless the loop keeps the output (``kept``).
            output = _call(traced.module, batch)
            if kept is not None and kept["rule"] == "logits":
                kept["output"] = output
            loss = _loss(traced, output, batch)
            if kept is not None and kept["rule"] == "model_output":
                kept["output"] = output
            del output
        del batch
        if plan.grad_accum > 1:
            loss = loss / plan.grad_accum
        if layout.loss_scaling:
            loss = loss * LOSS_SCALE
        _set_phase(tracker, 1)
        if zero_before_backward and micro == 0:
            optimizer.zero_grad(set_to_none=set_to_none)
        if before_backward is not None:
            before_backward()
        loss.backward()
        del loss
        if tracker is not None:
            tracker.reset_mod_stats()  # MemTracker refuses a second forward of the root module otherwise
            gc.collect(0)
    _set_phase(tracker, 2)
    if layout.loss_scaling and not layout.master_weights:
        # GradScaler.unscale_ divides the gradients in place; its inf check needs real numbers.
        with torch.no_grad():
            for p in traced.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(1 / LOSS_SCALE)
    optimizer.step()
    if not zero_before_backward:
        optimizer.zero_grad(set_to_none=set_to_none)  # False: torch 1.x's Module.zero_grad kept them, zeroed
    if tracker is not None:
        gc.collect(0)


def _set_phase(tracker, phase: int) -> None:
    if tracker is not None:
        tracker.phase = phase


def _call(module, batch):
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def _loss(traced: TracedModel, output, batch):
    if traced.loss_fn is not None:
        return traced.loss_fn(output, batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        loss = output
    if loss is None:
        raise ConfigError("the model's output has no loss: give the TracedModel a loss_fn(output, batch)")
    return loss


# -- the tracker -----------------------------------------------------------------------

class _Tracker(MemTracker):
    """MemTracker that records one sample per operator instead of per-module peaks.

    MemTracker's own ``_update_peak_stats`` walks every tracked module after every
    operator (two thirds of a 7B trace); only the global total is needed here.
    """

    def __init__(self):
        super().__init__()
        self.samples: list[tuple] = []
        self.step_ends: list[dict[str, int]] = []
        self.step = 0
        self.phase = 0
        """Index into PHASES, set by the training loop (MemTracker's own flags miss ops around the step hooks)."""

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 - MemTracker's hook, called after every operator
        self.samples.append((self.step, self.phase, *self._bytes()))

    def _bytes(self) -> tuple[int, ...]:
        totals = dict.fromkeys(_TRACKER_NAMES, 0)
        for snap in self._curr_mem_snap.values():
            for key, value in snap.items():
                name = getattr(key, "value", key)
                if name in totals:
                    totals[name] += value
        return tuple(totals[name] for name in _TRACKER_NAMES)

    def current(self) -> dict[str, int]:
        return dict(zip(CATEGORIES, self._bytes()))


# -- what CUDA does differently ------------------------------------------------------------

# CUDA autocast policies (aten/src/ATen/autocast_mode.cpp) for ops that have no CPU autocast
# kernel, and which change what is stored when run in fp32 or 16-bit.
_CUDA_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "dist", "pdist", "renorm", "logsumexp",
)
_CUDA_FP32_SET_OPT_DTYPE_OPS = (
    "softmax.int", "log_softmax.int", "cumprod", "cumsum", "sum", "sum.dim_IntList", "linalg_vector_norm",
)
_CUDA_LOWER_PRECISION_OPS = ("addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot")


@contextlib.contextmanager
def _device_behaviour(target: str, notes: list[str], repeats_kv: bool = False) -> Iterator[None]:
    """For target cuda: CUDA's autocast policy, dropout and sdpa kernels while the trace runs.

    They are registered as kernels of a scoped ``torch.library.Library`` (removed on exit),
    at the dispatcher, so they also hold inside backward (checkpoint recomputation).
    ``repeats_kv`` (``Runtime.sdpa_repeats_kv``): the job's model code hands SDPA its keys and values repeated to
    every query head, so they are saved at the query's width.
    """
    if target != "cuda":
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Overriding a previously registered kernel"
            _register_cuda_autocast_policy(lib)
            lib.impl("dropout", _cuda_dropout, "CompositeImplicitAutograd")
            lib.impl("scaled_dot_product_attention", _cuda_sdpa_repeating if repeats_kv else _cuda_sdpa,
                     "CompositeImplicitAutograd")
        yield
    finally:
        lib._destroy()
    notes.append("traced on the CPU as CUDA would run it: CUDA autocast op policy, 1-byte dropout masks, fused sdpa, "
                 "foreach optimizers; tensor sizes are exact (the caching allocator's 512-byte rounding is not added)")


def _register_cuda_autocast_policy(lib) -> None:
    """CUDA's autocast casts as AutocastCPU kernels, for the ops the CPU's autocast leaves alone."""
    for names, wrap in ((_CUDA_FP32_OPS, _fp32_kernel), (_CUDA_FP32_SET_OPT_DTYPE_OPS, _fp32_set_opt_dtype_kernel),
                        (_CUDA_LOWER_PRECISION_OPS, _lower_precision_kernel)):
        for name in names:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU"):
                continue  # the CPU has its own policy for it; keep that
            base, _, overload = name.partition(".")
            packet = getattr(torch.ops.aten, base, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if op is not None:  # else: not in this torch version
                lib.impl(name, wrap(op), "AutocastCPU")


_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _castable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.float() if _castable(t) else t, (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _fp32_set_opt_dtype_kernel(op):
    slot = [a.name for a in op._schema.arguments].index("dtype")

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            given = args[slot] if len(args) > slot else kwargs.get("dtype")
            if args and _castable(args[0]) and given is None:
                if len(args) > slot:
                    args = (*args[:slot], torch.float32, *args[slot + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _lower_precision_kernel(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            dtype = torch.get_autocast_dtype("cpu")
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if _castable(t) else t, (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _cuda_dropout(input, p, train):
    """CUDA's fused dropout keeps a bool mask; the CPU's keeps a float noise tensor as big as the input."""
    if not train or p == 0:
        return input
    return torch.native_dropout(input, p, True)[0]


def _cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """sdpa on a fused kernel, as CUDA runs it (flash, or memory-efficient with a mask or in fp32).

    The CPU falls back to its math path with dropout and stores the attention matrix;
    CUDA's kernels store the output and the logsumexp. Masks become additive float masks
    (sdpa converts boolean ones on every device). Shared key/value heads (GQA, ``enable_gqa``) are
    kept as they are for backward, as CUDA's kernels keep them (``_GroupedSdpa``).
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    if key.shape[-3] != query.shape[-3]:
        return _GroupedSdpa.apply(query, key, value, attn_mask, dropout_p, is_causal, scale)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def _cuda_sdpa_repeating(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """``_cuda_sdpa`` where the job's code repeated the shared key/value heads before SDPA (transformers before
    its PR #39412, torchtune's and litgpt's attention): the repeats are what SDPA saves."""
    if key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    return _cuda_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)


class _GroupedSdpa(torch.autograd.Function):
    """Grouped-query attention as CUDA's kernels run it (flash, memory-efficient, cuDNN: ``enable_gqa``): the
    shared key/value heads are saved for backward at their own width. The CPU's kernel needs them repeated to
    every query head, so the repeats are made and freed inside the forward, and again in the backward, where
    the gradients come out at the query's width and are summed over each group (as flash attention's backward
    makes its expanded key/value gradients and sums them)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale):
        repeat = query.shape[-3] // key.shape[-3]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3), dropout_p, is_causal,
            attn_mask=attn_mask, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.settings = (repeat, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        repeat, dropout_p, is_causal, scale = ctx.settings
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3), out, lse,
            dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        heads = key.shape[-3]
        dk = dk.unflatten(-3, (heads, repeat)).sum(-3)
        dv = dv.unflatten(-3, (heads, repeat)).sum(-3)
        return dq, dk, dv, None, None, None, None


# -- small helpers -------------------------------------------------------------------------

@contextlib.contextmanager
def _unpacked_batches(ours: bool) -> Iterator[None]:
    """Let transformers see what a real run sees: one sequence per row, so no 4-D mask.

    transformers looks at position_ids to find packed sequences; with real numbers it
    finds none and lets sdpa run causal without a mask. Fake tensors have no numbers, so
    it keeps the packing map and builds a (batch, 1, seq, seq) mask that every layer
    saves for backward (GiBs on a 7B model). The batches hpcmem makes (``ours``) are never
    packed: the real answer is None. The computation still runs (its small temporaries
    count). A model factory's batches are its own business and left alone.
    """
    if not ours:
        yield
        return
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def no_packing(position_ids):
        original(position_ids)
        return None

    masking_utils.find_packed_sequence_indices = no_packing
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _value_free_init(fake: bool) -> Iterator[None]:
    """Initialise weights without reading their values while the model is built on fake tensors.

    torch's ``trunc_normal_`` (ViT's initialiser) checks its samples (``mask.any()``), which
    fake tensors cannot answer; a plain ``normal_`` fills the same tensor (the values never
    matter to the memory). transformers keeps its own reference to the torch function.
    """
    if not fake:
        yield
        return
    try:
        from transformers import initialization as hf_init
    except ImportError:  # a model factory without transformers
        hf_init = None
    table = getattr(hf_init, "TORCH_INIT_FUNCTIONS", None)
    original = torch.nn.init.trunc_normal_

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):  # noqa: ARG001 - torch's signature
        with torch.no_grad():
            return tensor.normal_(mean, std)

    torch.nn.init.trunc_normal_ = trunc_normal_
    if isinstance(table, dict) and "trunc_normal_" in table:
        table["trunc_normal_"] = trunc_normal_
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = original
        if isinstance(table, dict) and "trunc_normal_" in table:
            table["trunc_normal_"] = original


@contextlib.contextmanager
def _no_automatic_gc() -> Iterator[None]:
    """Collect cycles only where _train_step says, so that the same trace gives the same bytes."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _KeepInput(torch.autograd.Function):
    """Passes ``out`` through and keeps ``kept`` saved until the backward reaches it: what torch < 1.11's
    softmax node did with its input (``_softmax_backward_data(grad, output, dim, self)``)."""

    @staticmethod
    def forward(ctx, out, kept):
        ctx.save_for_backward(kept)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@contextlib.contextmanager
def _softmax_saving_input(enabled: bool) -> Iterator[None]:
    """Under ``enabled``, ``torch.nn.functional.softmax`` also keeps its input for the backward, as
    autograd did before torch 1.11 (pytorch/pytorch#49600): the model code (which looks the function up
    at call time) runs on today's torch with that era's saved tensors."""
    if not enabled:
        yield
        return
    import torch.nn.functional as F

    original = F.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 - torch's own signature
        out = original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
        if torch.is_grad_enabled() and input.requires_grad:
            kept = input if dtype is None else input.to(dtype)
            out = _KeepInput.apply(out, kept)
        return out

    F.softmax = softmax
    try:
        yield
    finally:
        F.softmax = original


@contextlib.contextmanager
def _default_dtype(dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' and torch's chatter about deprecations while tracing."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a model factory without transformers
        hf_logging = None
    level = hf_logging.get_verbosity() if hf_logging else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        if hf_logging:
            hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            if hf_logging:
                hf_logging.set_verbosity(level)


# -- the recorded stream --------------------------------------------------------------

def record_training(model_config, task: str, plan, *, target: str = "cuda", model_factory=None,
                    steps: int = 2, set_to_none: bool = True, zero_before_backward: bool = False,
                    logits_fp32: bool = True, softmax_saves_input: bool = False,
                    ddp_side_stream: bool = False, workspaces: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                    repeats_kv: bool = False, output_kept: str | None = None,
                    ddp_single_process: bool = False) -> list[tuple]:
    """The alloc/free stream of ``steps`` training steps of the plan's model on fake tensors, as the
    traced method runs them (``traced.trace_training``'s build, optimizer and step), with a
    ``("mark", "step N")`` event before each step. Storage sizes are exact (the allocator model
    rounds them as CUDA's allocator does). Over several torchrun ranks DDP's construction and its buckets'
    rebuild at the second step are the analytic stream's (``stream.ddp_construction``; on Lightning's own
    stream with ``ddp_side_stream``). ``workspaces``: ``stream.gemm_workspaces``, the forward's made before
    the first step, the backward's before its first backward, as the analytic stream places them."""
    from ..strategies.ddp import builds_ddp
    from .record import StorageRecorder
    from .stream import ddp_construction, ddp_rebuild

    layout = _layout(plan)
    notes: list[str] = []
    rec = StorageRecorder()
    with (_quiet(), _no_automatic_gc(), FakeTensorMode(allow_non_fake_inputs=True),
          _device_behaviour(target, notes, repeats_kv), _unpacked_batches(model_factory is None),
          _value_free_init(True)):
        with rec:
            traced = _build(model_config, task, plan, layout, target, model_factory, notes, logits_fp32)
            rec.adopt(traced.module.parameters())
            rec.adopt(traced.module.buffers())
            params = [p for p in traced.module.parameters() if p.requires_grad]
            optimizer = _make_optimizer(plan, params, layout, target, notes)
            sizes = [p.numel() * p.element_size() for p in params]
            first = (ddp_construction(sizes, sizes, rec.external, rec.release, ddp_side_stream)
                     if builds_ddp(plan, ddp_single_process) else None)
            forward_ws, backward_ws = workspaces
            for size in forward_ws:
                rec.external(size)
            pending_ws = list(backward_ws)

            def backward_workspaces() -> None:
                while pending_ws:
                    rec.external(pending_ws.pop(0))

            kept = {"rule": output_kept} if output_kept else None
            for step in range(steps):
                rec.mark(f"step {step + 1}")
                if step == 1 and first is not None:
                    ddp_rebuild(first, sizes, rec.external, rec.release)
                with _softmax_saving_input(softmax_saves_input):
                    _train_step(traced, plan, layout, optimizer, None, set_to_none, zero_before_backward,
                                backward_workspaces, kept)
                gc.collect(0)
        events = rec.closed()
        del traced, params, optimizer, kept
    return events
