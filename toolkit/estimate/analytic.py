"""Analytic estimate: a training step's memory from the model's shape, by arithmetic alone.

Three layers, as in accelerate's estimator: the arithmetic here (pure functions of a
``ModelShape``, a ``Plan`` and a ``Partition``, all in bytes), data gathering in the
caller (``ModelShape.from_config``), formatting in the CLI.

What a rank holds (bytes, per GPU):

model states   params, grads, optimizer states, as the runtime (toolkit/runtime/train.py) makes them.
               torchrun: torch autocast keeps fp32 weights and grads under fp16/bf16-mixed
               (the weights are the master copy: 4 + 4 + 8 = 16 B/param with AdamW) and
               bf16-true keeps everything in bf16 (AdamW states too: 2 + 2 + 4 B/param).
               DeepSpeed: 16-bit weights and grads plus an fp32 master copy and the
               states (2 + 2 + 12 = 16 B/param with AdamW), sharded by ZeRO stage:
               1: 4Ψ + 12Ψ/N, 2: 2Ψ + 14Ψ/N, 3: 16Ψ/N (+ the largest layer gathered).
               Optimizer states on top of any master copy: AdamW 2 states; 8-bit AdamW
               1 byte per state + an fp32 absmax per 256-block (32-bit states for tensors
               under 4096 elements, as bitsandbytes does); Adafactor (no momentum) a row
               and a column vector per matrix, a full vector per 1-D tensor; SGD one
               momentum buffer.
activations    what autograd saves in the forward, per transformer layer, tensor by tensor
               for the HF block of the model's family (see ``layer_bytes_per_token``).
               It reduces to Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) bytes for the
               Megatron GPT layer in 16-bit (``korthikanti_layer_bytes``). Eager attention
               stores the a·s² matrix; SDPA and flash do not. Full checkpointing keeps each
               layer's input (s·b·h in the residual's dtype) and recomputes one layer at a
               time in the backward. Outside the layers: embeddings, final norm, the head's
               input, and for a causal LM the fp32 log-probabilities of the loss (4·b·s·V;
               transformers upcasts the logits), plus the input ids and labels.
               An image classifier (ViT, task image-cls) is a pre-LayerNorm encoder on
               s = (image_size / patch_size)^2 + 1 tokens fixed by its config (the plan's
               seq_len does not apply): its layers follow BERT's inventory, and outside
               them it keeps the input pixels (and the patch convolution's 16-bit copy of
               them), the final LayerNorm's input and the classifier's CLS input. Dropout
               keeps a mask: a byte per element on CUDA, a tensor of the input's dtype on
               the CPU. A decoder's classifier builds a KV cache (transformers' use_cache).
               CUDA's autocast runs a few more ops in fp32 than the CPU's (pow in
               gelu_new, LayerNorm and softmax on 16-bit inputs): the formulas follow the
               partition's kind. The CPU side is checked against real steps; the CUDA
               side is by reading the kernels' autocast lists.
temporaries    short-lived tensors at the peak: the loss's gradients (2 x 4·b·s·V at the
               start of the backward), one layer's backward, the optimizer's step copies
               (torch's foreach AdamW on a GPU copies exp_avg_sq whole; on a CPU one
               tensor at a time), autocast's 16-bit weight copies, ZeRO/DDP buckets; on a GPU
               the GEMM workspaces (``stream.gemm_workspaces``: the forward thread's and the
               backward thread's cuBLAS workspace, made by step 1 and kept), in every phase.

Phases, the peak being the largest (model states are not all live at once):
  forward end     params + optimizer + (grads, when accumulating) + activations + logits
  backward start  the above + the loss's gradients (grads not yet allocated with accum 1)
  backward        activations freed layer by layer as gradients are allocated (the two ends
                  of that straight line, plus one layer's transient and its recompute)
  backward end    params + optimizer + all grads + the embedding's dense gradient
  optimizer step  params + grads + optimizer + the step's transient copies

``components`` are what is live at the peak phase, so they add up to the peak.
Device memory as nvidia-smi shows it: CUDA context + peak allocated x (1 + allocator
overhead). Fits: that is at most capacity minus a safety margin, and the host memory
(offload, and the model each rank builds on the host first) within the job's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..modelshape import ModelShape
from ..plan import Plan
from ..sites import Partition
from ..strategies import Dtypes, ModelStates
from ..strategies.base import recipe_sizes
from ..strategies.deepspeed import OFFLOAD_BUFFER_FACTOR
from . import COMPONENTS, Estimate
from .activations import Activations, activations, rotary_table_bytes, runtime_refusal
from .device import plan_device_memory
from .stream import foreach_step_copies, gemm_workspaces, zero3_reductions
from .gpu import CUDA_CONTEXT_EAGER_MIB, DEFAULT_RUNTIME, Runtime, lazy_loading, paged_states

MIB = 1024 * 1024

SAFETY_MARGIN_FRAC = 0.03
"""Kept free when deciding "fits": a card's usable memory is ~1.5 % under its nominal size
(ECC, driver), and NCCL/cuDNN allocate outside the caching allocator."""
SAFETY_MARGIN_MIN_MIB = 256.0


# -- model states ----------------------------------------------------------------------------


def dtypes_for(plan: Plan, gpu: bool) -> Dtypes:
    """How the plan's engine stores things on a GPU (or CPU) rank (toolkit/strategies/)."""
    return plan.strategy.dtypes(plan, gpu)


def model_states(shape: ModelShape, plan: Plan, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> ModelStates:
    """Params, grads and optimizer per rank, as the plan's engine holds them (toolkit/strategies/), with the
    engine settings the job states (``Runtime.engine_config``)."""
    return plan.strategy.model_states(shape, plan, dt, runtime.engine_config, runtime)


# -- activations: the inventory lives in activations.py (shared with stream.py) --------------------

# -- phases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """What is live at one moment of the step (bytes per rank, by component)."""

    name: str
    params: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries


def phases(shape: ModelShape, plan: Plan, dt: Dtypes, states: ModelStates, acts: Activations,
           runtime: Runtime = DEFAULT_RUNTIME, workspaces: float = 0.0) -> tuple[Phase, ...]:
    """The moments of a steady-state step (optimizer states exist) where the peak can be.

    ``workspaces``: the GEMM libraries' workspaces the allocator holds (bytes; ``stream.gemm_workspaces``, the
    forward thread's and the backward thread's): made by step 1's first GEMMs and kept for the process, so a
    temporary of every phase of the steady state."""
    L, ckpt, causal = shape.layers, plan.checkpointing, shape.task == "causal-lm"
    params, opt, buf, grads = states.params_bytes, states.optimizer_bytes, states.buffer_bytes, states.grads_bytes
    fwd_params = params + states.gathered_bytes
    at = states.gathered_moments  # the engine's own schedule of gathered weights, where it has one
    moment = (lambda name: fwd_params) if at is None else (lambda name: params + getattr(at, name))
    # Grads present from the start of the backward (DeepSpeed's buffers, a previous
    # micro-batch's); the rest is allocated during it: the head's first, then layer by layer.
    live = grads if states.persistent_grads or (plan.grad_accum > 1 and not states.grads_end_with_backward) else 0.0
    # zero_grad(set_to_none) called between the loss and the backward: the previous step's grads
    # are alive through the forward (and freed before the backward starts)
    fwd_live = grads if runtime.grads_through_forward and not (states.persistent_grads
                                                               or states.grads_end_with_backward) else live
    head_share = (grads - live) * shape.head_linear_params / shape.n_params
    # (FSDP: the head's unsharded gradient, held until its unit is reduced at the backward's end)
    head_g = max(head_share, states.held_head_bytes)
    held_extra = head_g - head_share
    layer_g = (grads - live) * shape.layer_params / shape.n_params
    # FSDP's no_sync accumulation: the whole unsharded gradient is alive from the first micro-batch's backward
    # through the next forwards and backwards, each unit's turned into its shard only by the last micro-batch's
    # reduce-scatter; its peak is the earlier micro-batches' (one unit's new gradient, AccumulateGrad's transient,
    # is the strategy's one-block buffer)
    # (beside the shards, when zero_grad keeps those allocated between steps)
    accumulated = states.accumulated_grads_bytes
    if accumulated > 0:
        live = fwd_live = accumulated + (grads if states.persistent_grads else 0.0)
        head_g = layer_g = held_extra = 0.0
    kept = L * acts.kept_layer_bytes
    pixels = acts.input_bytes  # an image model's input, saved by its first op: kept to the end of the backward
    layer_casts = 0.0 if ckpt else L * acts.layer_cast_bytes  # recomputed layers re-cast their weights
    # Adding a new gradient to an existing one (the tied LM head's, or a previous
    # micro-batch's) holds the new one and the sum at once: two vocab x hidden transients.
    vocab_grad = 2.0 * dt.grad * shape.vocab * shape.hidden
    emb_temp = vocab_grad if live or (causal and shape.tied) else 0.0
    head_temp = acts.head_backward_temp_bytes + (vocab_grad if live and causal else 0.0)
    # the largest parameter's gradient handed to the host (ZeRO-3 offload): an untied LM head's in the head's
    # backward, the embedding's at the backward's end
    reduce_temp = states.reduce_temp_bytes
    head_reduce = reduce_temp if causal and not shape.tied else 0.0
    bwd_buf = buf + states.grad_bucket_bytes  # ZeRO-1/2's buckets: from the first gradient to the backward's end
    # ZeRO-3's bucket copies: the largest while the layers' gradients come, the epilogue's at the backward's end
    # (after the embedding's transients are freed; a partition handed to the host is handed inside a reduction)
    flush_mid = flush_end = 0.0
    if states.flush_bucket_elements > 0:
        mid, end = zero3_reductions(shape, int(states.flush_bucket_elements))
        flush_mid, flush_end = dt.grad * mid, dt.grad * end
    phases_ = (
        # autocast's cache holds every 16-bit weight copy until the forward returns
        Phase("forward end", moment("forward_end"), fwd_live, opt, kept + acts.outside_bytes,
              buf + L * acts.layer_cast_bytes + acts.head_cast_bytes + acts.loss_forward_temp_bytes),
        Phase("backward start", moment("head_backward"), live, opt, kept + acts.outside_bytes,
              buf + layer_casts + acts.head_cast_bytes + acts.loss_backward_temp_bytes),
        Phase("head backward", moment("head_backward"), live + head_g, opt, kept + pixels,
              bwd_buf + layer_casts + max(head_temp, states.head_reduce_bytes) + head_reduce),
        Phase("backward, last layer", moment("last_layer"), live + head_g, opt, kept + pixels,
              bwd_buf + layer_casts + max(acts.layer_backward_temp_bytes, states.reduce_extra_bytes)),
        Phase("backward, first layer", moment("first_layer"), live + head_g + (L - 1) * layer_g, opt,
              acts.kept_layer_bytes + pixels,
              bwd_buf + (0.0 if ckpt else acts.layer_cast_bytes)
              + max(acts.layer_backward_temp_bytes, states.reduce_extra_bytes) + flush_mid),
        Phase("backward end", moment("backward_end"), max(grads, accumulated) + held_extra, opt, 0.0,
              bwd_buf + max(emb_temp, flush_end) + reduce_temp),
        # FSDP's last unit (the root) reduced in the backward's final callback: resharded first, so no gathered
        # weights; the layers' gradient shards, its unsharded gradients and the reduce-scatter's buffers
        *((Phase("root reduction", params, grads - (0.0 if states.persistent_grads else states.end_reduce_share),
                 opt, 0.0,
                 buf + states.end_reduce_bytes),) if states.end_reduce_bytes > 0 else ()),
        # the overflow check's masks (ZeRO-3 fp16) and the norm's fp64 copies come and go before the step's own
        # transients
        Phase("optimizer step", params, 0.0 if states.grads_end_with_backward else grads, opt, 0.0,
              buf + max(states.step_check_bytes, recipe_sizes(states.step_order)[1],
                        states.step_temp_bytes * foreach_step_copies(plan, dt, runtime) + states.step_flatten_bytes)),
    )
    if acts.kept_output_bytes > 0:  # the output the loop keeps, from the loss (counted there) into the next forward
        phases_ = (phases_[0],) + tuple(replace(ph, activations=ph.activations + acts.kept_output_bytes)
                                        for ph in phases_[1:])
    tables = sum(rotary_table_bytes(shape, dt, runtime))  # model buffers, resident with the parameters
    if tables:
        phases_ = tuple(replace(ph, params=ph.params + tables) for ph in phases_)
    return tuple(replace(ph, temporaries=ph.temporaries + workspaces) for ph in phases_) if workspaces else phases_


# -- the estimate ------------------------------------------------------------------------------------


def estimate_analytic(shape: ModelShape, plan: Plan, partition: Partition, *,
                      allocator_overhead_frac: float | None = None,
                      cuda_context_mib: float | None = None, runtime: Runtime | None = None,
                      allocator_model: bool = True) -> Estimate:
    """A training step's memory per rank for ``plan`` on ``partition``, from ``shape`` alone (MiB).

    ``components`` are what is live at the peak phase (they add up to ``peak_allocated_mib``;
    with the CUDA context and ``allocator_overhead`` = peak reserved - peak allocated, to
    ``device_used_mib`` less ``gpu_extras_mib``). On a GPU the step's alloc/free stream
    (``stream.step_events``, steps 1 and 2) is replayed through the caching-allocator model
    (``allocator.py``) under the plan's ``alloc_conf`` and the memory the allocator may take
    (capacity - safety margin - context - memory outside the allocator): that gives the
    reserved peak, the fragmentation, the fit, and when only fragmentation fails the setting
    that fixes it. ``allocator_overhead_frac`` (a partition's measured reserved/allocated - 1,
    from calibration) raises the reserved peak where it says more than the replay.
    ``cuda_context_mib`` (default: the partition's) replaces the profile's value. ``runtime``
    describes software other than hpcmem's own (``gpu.Runtime``). ``allocator_model=False``
    skips the replay (reserved = allocated: a lower bound, for quick screening of many plans).
    On a CPU partition the "device" is the host: capacity is the job's memory per rank and
    there is no CUDA context and no caching allocator.
    """
    runtime = runtime or DEFAULT_RUNTIME
    refusal = runtime_refusal(shape, runtime)
    if refusal:
        raise ConfigError(refusal)
    gpu = partition.has_gpu
    dt = dtypes_for(plan, gpu)
    if gpu and not partition.flash_attention:
        dt = replace(dt, flash_sdpa=False)
    states = model_states(shape, plan, dt, runtime)
    if gpu and not runtime.frees_grads and not states.persistent_grads and not states.grads_end_with_backward:
        # torch 1.x (or zero_grad(set_to_none=False)): zero_grad keeps them allocated. Not where the device grads
        # end with the backward (FSDP1's CPU offload hands the optimizer a host .grad, which zero_grad keeps)
        states = replace(states, persistent_grads=True)
    acts = activations(shape, plan, dt, runtime)
    workspaces = float(sum(map(sum, gemm_workspaces(partition.gpu_model, runtime)))) if gpu else 0.0
    peak = max(phases(shape, plan, dt, states, acts, runtime, workspaces), key=lambda ph: ph.total)
    context = (partition.cuda_context_mib if cuda_context_mib is None else cuda_context_mib) if gpu else 0.0
    if gpu and cuda_context_mib is None and not getattr(partition, "calibrated", False) \
            and not lazy_loading(runtime.torch_version):
        context = max(context, CUDA_CONTEXT_EAGER_MIB)  # every kernel loaded at start-up (no lazy loading)
    peak_mib = peak.total / MIB
    capacity = capacity_mib(partition, plan)
    margin = safety_margin_mib(capacity)
    dm = None
    if gpu and allocator_model:
        dm = plan_device_memory(shape, plan, dt, states, acts, gpu_model=partition.gpu_model,
                                capacity_mib=capacity - margin - context, runtime=runtime)
        reserved = max(dm.peak_reserved_mib, peak_mib)
        extras = dict(dm.extras_mib)
    else:
        reserved, extras = peak_mib, {}
    if gpu and allocator_overhead_frac is not None:
        reserved = max(reserved, peak_mib * (1 + allocator_overhead_frac))
    components = {"params": peak.params / MIB, "grads": peak.grads / MIB, "optimizer": peak.optimizer / MIB,
                  "activations": peak.activations / MIB, "temporaries": peak.temporaries / MIB,
                  "cuda_context": context, "allocator_overhead": reserved - peak_mib}
    assert tuple(components) == COMPONENTS
    device_used = context + reserved + sum(extras.values())
    ranks = plan.gpus_per_node
    host = states.host_bytes_per_rank * ranks / MIB
    fits_device = device_used <= capacity - margin and (dm is None or dm.fits)
    paged_note = None
    if states.paged_optimizer_bytes > 0:  # a paged optimizer's states: resident as room allows, the rest on the host
        paged_host, paged_note = paged_states(states.paged_optimizer_bytes / MIB, capacity - margin - device_used,
                                              ranks)
        host += paged_host
    # On a CPU partition the ranks' own memory comes out of the same host memory; on a GPU
    # partition the ranks first build the model on the host (before the offload buffers exist).
    host_needed = max(host, startup_host_bytes_per_rank(shape, plan) * ranks / MIB) if gpu else host + device_used * ranks
    fits_host = host_needed <= job_host_mib(partition, plan)
    notes = _notes(shape, plan, partition, peak, host_needed, fits_host, cuda_context_mib, allocator_overhead_frac,
                   dm, runtime, allocator_model)
    if paged_note:
        notes += (paged_note,)
    fix = dm.fix if dm is not None and dm.fragmentation_only else None
    return Estimate(method="analytic", components=components, peak_allocated_mib=peak_mib,
                    device_used_mib=device_used, host_mib_per_node=host, capacity_mib=capacity,
                    headroom_mib=capacity - device_used, fits=fits_device and fits_host, notes=notes,
                    peak_reserved_mib=reserved, fragmentation=dm.fragmentation if dm else 0.0,
                    segments=dm.segments if dm else 0, gpu_extras_mib=extras,
                    fits_allocated=(dm.fits_allocated if dm else None),
                    fragmentation_only=bool(dm and dm.fragmentation_only), alloc_conf_fix=fix,
                    fix_device_used_mib=(context + dm.fix_peak_reserved_mib + sum(extras.values())
                                         if fix and dm.fix_peak_reserved_mib is not None else None),
                    oom=oom_figures(dm.oom) if dm is not None and dm.oom is not None else None)


def oom_figures(oom) -> dict:
    """PyTorch's OOM figures in MiB, from the replay's ``OutOfMemory``."""
    return {"request_mib": oom.request / MIB, "allocated_mib": oom.allocated / MIB,
            "reserved_mib": oom.reserved / MIB, "free_mib": oom.free / MIB}


def startup_host_bytes_per_rank(shape: ModelShape, plan: Plan) -> float:
    """Host bytes a GPU rank holds while it builds the model, before moving it to its GPU (the engine's)."""
    return plan.strategy.startup_host_bytes(shape, plan)


def job_host_mib(partition: Partition, plan: Plan) -> float:
    """Host memory a job gets per node: --mem (plan.mem_mib), else the partition's default, else the node's."""
    return float(plan.mem_mib or partition.default_mem_mib or partition.host_mem_gib * 1024)


def capacity_mib(partition: Partition, plan: Plan) -> float:
    """Memory one rank may use: the GPU's; on a CPU partition the job's host memory
    (--mem, else the partition's default, else the node's) shared by the ranks of a node."""
    if partition.has_gpu:
        return partition.gpu_mem_gib * 1024
    return job_host_mib(partition, plan) / plan.gpus_per_node


def safety_margin_mib(capacity: float) -> float:
    """Left free when deciding whether a plan fits (see SAFETY_MARGIN_FRAC)."""
    return max(SAFETY_MARGIN_MIN_MIB, SAFETY_MARGIN_FRAC * capacity)


def _notes(shape: ModelShape, plan: Plan, partition: Partition, peak: Phase, host_needed: float, fits_host: bool,
           context_arg: float | None, overhead_arg: float | None, dm=None, runtime: Runtime | None = None,
           allocator_model: bool = True) -> tuple[str, ...]:
    """The assumptions that matter for this estimate, for a person to read."""
    notes = [f"peak at the {peak.name} (steady state: optimizer states exist)"]
    if partition.has_gpu and context_arg is None:
        if getattr(partition, "calibrated", False):
            notes.append(f"CUDA context {partition.cuda_context_mib:g} MiB as measured on the partition")
        else:
            notes.append(f"partition not calibrated: using the profile's cuda_context_mib ({partition.cuda_context_mib:g} MiB)")
    if dm is not None:
        notes.append(f"caching allocator replayed (steps 1-2{', ' + dm.alloc_conf if dm.alloc_conf else ''}): "
                     f"{dm.peak_reserved_mib:.0f} MiB reserved, {dm.fragmentation:.0%} of it unallocated at its peak, "
                     f"{dm.segments} segments")
        if dm.peak_active_mib > dm.peak_allocated_mib + 1:
            notes.append(f"frees that wait for another stream (record_stream) keep up to "
                         f"{dm.peak_active_mib - dm.peak_allocated_mib:.0f} MiB out of reuse at the active peak "
                         f"({dm.peak_active_mib:.0f} MiB); they return before an out-of-memory error")
        if dm.fragmentation_only:
            notes.append("the tensors fit but the allocator's reserved memory does not (fragmentation)"
                         + (f": PYTORCH_CUDA_ALLOC_CONF={dm.fix} makes it fit ({dm.fix_peak_reserved_mib:.0f} MiB reserved)"
                            if dm.fix else "; no allocator setting tried makes it fit"))
        for name, mib in dm.extras_mib.items():
            notes.append(f"{name.replace('_', ' ')}: {mib:.0f} MiB outside the caching allocator")
    elif partition.has_gpu and not allocator_model:
        notes.append("allocator not replayed: reserved taken as the allocated peak (a lower bound)")
    if overhead_arg is not None and partition.has_gpu:
        notes.append(f"reserved at least {overhead_arg:.0%} over allocated, as measured on the partition")
    if runtime is not None and runtime != DEFAULT_RUNTIME:
        notes.append(f"runtime: {runtime}")
        if partition.has_gpu and not lazy_loading(runtime.torch_version) and context_arg is None \
                and not getattr(partition, "calibrated", False):
            notes.append(f"torch {runtime.torch_version} loads every CUDA kernel at start-up: CUDA context at least "
                         f"{CUDA_CONTEXT_EAGER_MIB:g} MiB")
    if not partition.has_gpu:
        notes.append(f"CPU partition: capacity is the job's host memory shared by {plan.gpus_per_node} rank(s); "
                     "the Python/torch process itself is not counted")
    layout_note = plan.strategy.layout(plan).note
    if layout_note:
        notes.append(layout_note)
    if shape.seq_len is not None:
        notes.append(f"{shape.task}: {shape.seq_len} tokens per sample (patches + CLS) from the model's config; "
                     f"the plan's seq_len ({plan.seq_len}) does not apply")
    elif shape.max_positions is not None and plan.seq_len > shape.max_positions:
        notes.append(f"seq_len {plan.seq_len} is longer than the model's {shape.max_positions} positions")
    if shape.kv_cache and not plan.checkpointing and shape.family == "gpt2":
        notes.append("the classifier's forward builds a KV cache (config use_cache), copying K and V in every layer")
    if "nvme" in (plan.offload_optimizer, plan.offload_params) or plan.offload_optimizer == "cpu" or plan.offload_params == "cpu":
        notes.append(f"offload: {plan.strategy.describe(plan)}; host memory x{OFFLOAD_BUFFER_FACTOR:g} for DeepSpeed's "
                     "buffers (CPU), pinned NVMe buffers" if plan.launcher == "deepspeed" else
                     f"offload: {plan.strategy.describe(plan)}: sharded weights, grads and optimizer states in host memory")
    if not fits_host:
        notes.append(f"host memory: {host_needed:.0f} MiB needed per node, {job_host_mib(partition, plan):.0f} MiB available")
    return tuple(notes)
