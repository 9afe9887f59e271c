"""The analytic estimate's tensors as an ordered alloc/free stream, for the caching-allocator model.

``step_events`` turns the per-tensor model of ``analytic`` (model states per parameter, activations
per layer and per saved tensor where it sets block sizes, the loss's fp32 logits, the optimizer's
temporaries per implementation) into the allocations and frees of training steps 1 and 2, in the
order the runtime makes them:

load       the weights, tensor by tensor in ``model.parameters()`` order (embeddings first, the layers,
           the head); DDP's gradient buckets (a second copy of the grads unless
           ``gradient_as_bucket_view``) or DeepSpeed's flat buffers; under DeepSpeed the fp32 master copy
           and the optimizer states too (the engine makes them at start-up).
step       for each micro-batch: the forward (per layer: autocast's 16-bit weight copies, kept in its
           cache until the forward returns; the layer's saved tensors; under checkpointing the layer's
           internals made and freed, its input kept), the loss (the logits, their fp32 upcast, the
           log-probs), the backward (the loss's gradients, the head's, then per layer from the last: the
           recompute, the layer's transient gradients, its parameters' gradients the first time, the
           saved tensors freed); then the optimizer step: at step 1 its states, parameter by parameter
           into whatever blocks the activations just freed, and the step's temporaries (foreach: a
           state-sized copy of every parameter at once; a per-parameter loop: one parameter's); then
           ``zero_grad`` (set_to_none: the grads are freed).
Step 2 is the steady state: the forward's activations now meet blocks holding optimizer states.
Two micro-batches stand for any accumulation (the pattern repeats).

Sizes are what the allocator sees: tensor by tensor where the tensor is large enough to set a
segment's size (weights, grads, states, hidden- and FFN-wide activations, score matrices, logits),
the remainder of a per-layer total as one tensor. Pure Python; a 7B model's two steps are a few
thousand events.
"""

from __future__ import annotations

from functools import lru_cache
from math import floor, prod
from typing import Iterator

from .. import optimizers
from ..modelshape import ModelShape
from ..strategies.base import AUTOGRAD_GRADIENT
from ..strategies.ddp import builds_ddp
from ..strategies.fsdp import optimizer_tensors as fsdp_optimizer_tensors
from .activations import PREVIOUS_OUTPUT, rotary_table_bytes
from .gpu import (DDP_BROADCASTS_IN_FLIGHT, DEFAULT_RUNTIME, Runtime, cublas_workspace_bytes, CUBLASLT_WORKSPACE_OLD,
                  ddp_broadcast_sizes, ddp_bucket_sizes)

Event = tuple


class _Ids:
    def __init__(self):
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


MAX_PIECES = 32
"""The most tensors ``_split`` makes of an activation total. Real models need at most 16 (all 104 published rows);
the bound keeps a hostile config (heads a thousand times wider than the hidden size) from making a stream of
millions of events."""
MAX_FLAT_CHUNKS = 4096
"""The most ``_FLAT_CHUNK`` pieces of one flat buffer: 8 TiB, more than any rank holds (a bound for hostile sizes,
never reached by a plan that could fit a card)."""


def _split(total: float, unit: float, cap: int = MAX_PIECES) -> list[int]:
    """``total`` bytes as tensors of ``unit`` bytes and one remainder (nothing under 1 byte); beyond ``cap``
    tensors, ``cap`` equal ones."""
    total = int(total)
    if total <= 0:
        return []
    unit = int(unit)
    if unit <= 0 or unit >= total:
        return [total]
    n, rest = divmod(total, unit)
    if n + (1 if rest else 0) > cap:
        n, rest = divmod(total, cap)
        return [n + 1] * rest + [n] * (cap - rest)
    return [unit] * n + ([rest] if rest else [])


def _flat_chunks(total: float) -> list[int]:
    """A flat buffer of ``total`` bytes as the stream allocates it: ``_FLAT_CHUNK`` pieces, at most
    ``MAX_FLAT_CHUNKS`` of them."""
    return _split(total, _FLAT_CHUNK, MAX_FLAT_CHUNKS)


SMALL_NUMEL = 65536
"""Parameters this small (<= 256 KiB in fp32: biases, norms) are bundled per layer (up to BUNDLE_NUMEL):
they and their grads and states live in the allocator's small pool (requests <= 1 MiB), which never
shares segments with the large pool where fragmentation happens, so one event stands for several."""
BUNDLE_NUMEL = 262144


def packed_qkv(layer: tuple) -> tuple:
    """A layer's tensors with the query/key/value projections packed into one weight and one bias, as
    ``nn.MultiheadAttention`` holds them (``in_proj_weight`` [3h, h] then ``in_proj_bias``, where the
    query's were): what torchvision's ViT allocates, so what the allocator sees."""
    qkv = [t for t in layer if any(m in t[0] for m in ("q_proj.", "k_proj.", "v_proj."))]
    if len(qkv) != 6:
        return layer
    w = [t for t in qkv if t[2] == "linear"]
    b = [t for t in qkv if t[2] != "linear"]
    weight = ("attention.in_proj_weight", (sum(t[1][0] for t in w), w[0][1][1]), "linear")
    bias = ("attention.in_proj_bias", (sum(t[1][0] for t in b),), b[0][2])
    out: list[tuple] = []
    for t in layer:
        if t is qkv[0]:
            out += [weight, bias]
        elif t not in qkv:
            out.append(t)
    return tuple(out)


def param_order(shape: ModelShape, packed: bool = False) -> list[tuple]:
    """Parameters in ``model.parameters()`` order: (name, dims, kind, layer index or None, member dims);
    small neighbours of one layer bundled (``SMALL_NUMEL``), a bundle's dims being (total elements,).
    ``packed``: the layer's query/key/value projections as one tensor (``packed_qkv``)."""
    first = [t for t in shape.other_tensors if t[2] == "embedding" or t[0].startswith("embeddings")]
    last = [t for t in shape.other_tensors if t not in first]
    layer = packed_qkv(shape.layer_tensors) if packed else shape.layer_tensors
    groups = [(first, None)] + [(layer, li) for li in range(shape.layers)] + [(last, None)]
    out: list[tuple] = []
    for tensors, li in groups:
        bundle: list[tuple[int, ...]] = []

        def flush():
            if bundle:
                out.append(("bundle", (sum(prod(m) for m in bundle),), "bundle", li, tuple(bundle)))
                bundle.clear()

        for name, dims, kind in tensors:
            n = prod(dims)
            if n <= SMALL_NUMEL:
                if sum(prod(m) for m in bundle) + n > BUNDLE_NUMEL:
                    flush()
                bundle.append(tuple(dims))
            else:
                out.append((name, tuple(dims), kind, li, (tuple(dims),)))
        flush()
    return out


def _state_sizes(opt, entry, state_bytes: int) -> list[int]:
    """The optimizer states of one parameter (or one bundle: their sum, as one small-pool tensor), on a GPU (the
    allocator stream's)."""
    members = entry[4]
    if len(members) == 1:
        return opt.state_tensor_bytes(members[0], state_bytes)
    total = sum(sum(opt.state_tensor_bytes(m, state_bytes)) for m in members)
    return [total] if total else []


class _Layer:
    """One layer's activation tensors (bytes), by role."""

    def __init__(self, saved: list[int], kept: list[int], casts: list[int], backward: list[int]):
        self.saved, self.kept, self.casts, self.backward = saved, kept, casts, backward


def layer_tensors(shape: ModelShape, plan, dt, acts, runtime: Runtime = DEFAULT_RUNTIME) -> _Layer:
    """Split a layer's totals from ``analytic.activations`` into tensors of the sizes the runtime makes."""
    from .activations import _attention_bytes, _ffn_bytes, sequence_length, stores_scores, window_masked

    seq = sequence_length(shape, plan)
    b = plan.micro_batch
    tokens = b * seq
    c, h = dt.compute, shape.hidden
    saved: list[int] = []
    total = acts.layer_bytes
    if stores_scores(shape, plan, dt):
        # the softmax output and its dropout (mask and output) or 16-bit copy: a x s x s elements each
        square = b * shape.heads * seq * seq
        q_dim = shape.heads * shape.head_dim
        score_total = (_attention_bytes(shape, plan, dt, runtime) - 4 * q_dim * c) * tokens
        scores = _split(score_total, square * c)
        saved += scores
        total -= sum(scores)
    elif window_masked(shape, plan):  # the additive window mask SDPA made for this layer: b x s x s, one tensor
        mask = min(b * seq * seq * c, total)
        saved.append(int(mask))
        total -= mask
    ffn_total = min(_ffn_bytes(shape, dt) * tokens, total)
    ffn = _split(ffn_total, tokens * shape.ffn * c)
    saved += ffn
    total -= sum(ffn)
    if _torchvision_vit(shape, runtime) and not stores_scores(shape, plan, dt) and total >= 3 * tokens * h * c:
        saved.append(3 * tokens * h * c)  # the packed projection's contiguous (3, s, b, h) copy: one block
        total -= 3 * tokens * h * c
    saved += _split(total, tokens * h * c)
    kept = [int(acts.kept_layer_bytes)] if plan.checkpointing else saved
    casts = []
    if dt.autocast:
        casts = [2 * prod(s) for _, s, k in shape.layer_tensors if k == "linear"]
    # the backward's transient: under checkpointing the recompute (the layer's saved tensors and its
    # weights re-cast) first; then gradients of hidden and FFN width
    back_total = acts.layer_backward_temp_bytes
    backward: list[int] = []
    if plan.checkpointing:
        recompute = saved + casts
        backward += recompute
        back_total -= sum(recompute)
    if dt.autocast:
        wgrad = c * shape.ffn * h
        if back_total >= wgrad:
            backward.append(int(wgrad))
            back_total -= wgrad
    if back_total > 0:
        ffn_part = min(back_total / 2, tokens * shape.ffn * c)
        backward += _split(ffn_part, tokens * shape.ffn * c)
        backward += _split(back_total - ffn_part, tokens * h * max(dt.param, c))
    return _Layer(saved, kept, casts, backward)


def foreach_step_copies(plan, dt, runtime: Runtime = DEFAULT_RUNTIME) -> int:
    """How many times the optimizer's foreach temporaries are alive at once: torch's foreach AdamW on
    CUDA tensors holds ``runtime.foreach_adam_intermediates`` parameter-sized lists (2 before torch 2.1);
    1 for everything else (DeepSpeed runs its own Adam)."""
    opt = optimizers.get(plan.optimizer)
    if opt.temporaries == "foreach" and dt.gpu and plan.launcher != "deepspeed":
        return runtime.foreach_adam_intermediates
    return 1


def _torchvision_vit(shape: ModelShape, runtime: Runtime) -> bool:
    return shape.family == "vit" and runtime.model_code == "torchvision"


def _outside(shape: ModelShape, plan, dt, acts,
             runtime: Runtime = DEFAULT_RUNTIME) -> tuple[list[int], list[int], int]:
    """(the tensors the embeddings saved, kept to the end of the backward: ``Activations.input_bytes``, one block;
    the other tensors saved outside the layers except the log-probs, freed as the head's backward ends; the
    log-probs' bytes: fp32 when the loss upcasts the logits, else the compute dtype)."""
    from .activations import sequence_length

    tokens = plan.micro_batch * sequence_length(shape, plan)
    elem = 4 if runtime.logits_fp32 else dt.compute
    causal = shape.task == "causal-lm"
    logprobs = elem * tokens * shape.vocab if causal else 0
    kept = [int(acts.input_bytes)] if acts.input_bytes >= 1 else []
    rest = acts.outside_bytes - logprobs - sum(kept)
    softcap = [int(tokens * shape.vocab * dt.compute)] if causal and shape.final_softcap else []  # one tensor
    return kept, softcap + _split(rest - sum(softcap), tokens * shape.hidden * dt.param), int(logprobs)


def gemm_workspaces(gpu_model: str | None, runtime: Runtime = DEFAULT_RUNTIME) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The GEMM libraries' workspaces a training step takes from the caching allocator and keeps for the
    process: (the forward's, the backward's), in bytes, in the order they are made.

    cuBLAS keeps one workspace per (handle, stream) (torch >= 1.11, ``CublasHandlePool.cpp``
    ``cublas_handle_stream_to_workspace``), and its handles are per thread (a ``thread_local`` PoolWindow of
    the handle pool). The autograd engine runs a CUDA backward on its own device thread, not the thread that
    called ``backward()``, so the step's first backward GEMM makes a second workspace beside the forward's.
    torch 2.0-2.4's separate cuBLASLt workspace is counted once, with the forward's."""
    if not runtime.cublas_in_allocator:  # torch < 1.11: cuBLAS's own memory, outside the allocator (gpu_extras)
        return (), ()
    cublas = cublas_workspace_bytes(gpu_model, runtime.cublas_workspace_config)
    forward = (cublas, CUBLASLT_WORKSPACE_OLD) if runtime.cublaslt_separate else (cublas,)
    return forward, (cublas,)


def step_events(shape: ModelShape, plan, dt, states, acts, *, gpu_model: str | None = None,
                runtime: Runtime = DEFAULT_RUNTIME, steps: int = 2, sharded: bool = False) -> list[Event]:
    """The alloc/free stream of loading the model and running ``steps`` training steps on one rank.

    ``states``: the strategy's ModelStates (per-rank bytes); ``acts``: ``analytic.activations``.
    ``sharded``: the engine shards the states (DeepSpeed: flat buffers made at start-up; FSDP: shards, whose
    optimizer states its first step makes per tensor) rather than DDP's replicated per-tensor copies.
    """
    ids = _Ids()
    ev: list[Event] = []
    A = ev.append
    opt = optimizers.get(plan.optimizer)
    params = param_order(shape, packed=_torchvision_vit(shape, runtime))
    n_params = shape.n_params or 1
    scale_p = states.params_bytes / (dt.param * n_params) if dt.param else 0.0
    per_tensor = not sharded and abs(scale_p - 1.0) < 1e-6

    def alloc(size, stream=DEFAULT_STREAM) -> int:
        i = ids()
        A(("alloc", i, max(1, int(size))) if stream == DEFAULT_STREAM else ("alloc", i, max(1, int(size)), stream))
        return i

    def free(i: int) -> None:
        A(("free", i))

    # FSDP's optimizer (torch's) steps over the shards as tensors, not one flat buffer: its states are made by its
    # first step and its temporaries tensor by tensor, as under DDP (strategies.fsdp.optimizer_tensors)
    fsdp_shards = ([("shard", dims, "shard", None, (dims,))
                    for dims in fsdp_optimizer_tensors(shape, plan.world_size, runtime.fsdp_flat_params,
                                                       runtime.fsdp_use_orig_params)]
                   if sharded and plan.launcher == "fsdp" and states.optimizer_bytes > 0 else [])

    # -- load -------------------------------------------------------------------------------------
    flat_states: list[int] = []
    persistent_grads: list[int] = []
    if states.startup:  # the engine's own start-up, tensor by tensor (its buffers included)
        flat_states = list(_follow(states.startup, alloc, free).values())
        persistent_grads = flat_states if states.persistent_grads and states.grads_bytes > 0 else []
    else:
        if per_tensor:
            for entry in params:
                alloc(dt.param * prod(entry[1]))
        else:
            for piece in _flat_chunks(states.params_bytes):
                alloc(piece)
        if sharded and states.optimizer_bytes > 0 and not fsdp_shards:  # DeepSpeed: master copy and states
            flat_states = [alloc(x) for x in _flat_chunks(states.optimizer_bytes)]
        if sharded and states.persistent_grads and states.grads_bytes > 0:  # the engine's flat gradient buffers
            persistent_grads = [alloc(x) for x in _flat_chunks(states.grads_bytes)]
    # FSDP1 without its rate limiter (Runtime.fsdp_unlimited_all_gathers; FULL_SHARD): the blocks FSDP
    # frees after record_stream (each unit's gathered flat parameter, forward and backward, and its
    # unsharded gradient) are not reused before the step's end, so each is a block of its own until then;
    # the one-block gradient buffer below is then one of them.
    unlimited = (sharded and plan.launcher == "fsdp" and runtime.fsdp_unlimited_all_gathers
                 and states.gathered_bytes > 0 and getattr(plan, "reshard_after_forward", True))
    unit = dt.param * shape.layer_params
    root = dt.param * max(shape.n_params - shape.layers * shape.layer_params, 0)
    # FSDP1 with CPU offload (CPUOffload(offload_params=True)), read in torch's _flat_param.py (the same since
    # torch 2.0's HandleConfig): each unshard first copies the unit's shard to the device, in the gathered dtype
    # (FlatParamHandle.pre_unshard: flat_param_to(device), "a new tensor distinct from any attributes", or the
    # low-precision _mp_shard), the all-gather's input, dropped once the unsharded view replaces it. NCCL records
    # a collective's input on its stream (ProcessGroupNCCL recordStream), so without the rate limiter each copy
    # is a block of its own until the backward's end, as the gathered units are; with it, a transient. (The
    # gradient shards FSDP1 keeps on the device under offload are the strategy's grads_bytes.)
    world = max(1, plan.world_size)
    fsdp1_offload = (sharded and plan.launcher == "fsdp" and plan.offload_params == "cpu"
                     and runtime.fsdp_flat_params and states.gathered_bytes > 0)
    shard_copy = -(-int(unit) // world) if fsdp1_offload else 0
    # gathered weights: where the engine schedules them module by module (ZeRO-3's coordinator:
    # ModelStates.gathered_moments) a rolling window of layer-sized blocks as large as its peak. FSDP (with its rate
    # limiter, or FSDP2) gathers unit by unit: the root unit (what no block holds: embeddings, final norm, head) from
    # the forward's start to the end of its backward (a root is not resharded after its forward); each block's unit
    # for its forward, one more in flight (FSDP1's limiter allows two all-gathers, FSDP2's prefetch one unit ahead),
    # freed after it when resharding after the forward, else kept to its backward; in the backward each unit from the
    # previous unit's backward (BACKWARD_PRE / FSDP2's backward prefetch) to the end of its own. The phases count
    # the root and two units at every moment (ModelStates.gathered_bytes), the most this holds at once.
    # Streams, read in torch 2.13: FSDP1 allocates each unsharded flat parameter under its unshard stream
    # (FlatParamHandle.unshard inside _unshard's `stream(unshard_stream)`), so those blocks are that stream's and
    # only other all-gathers reuse them; FSDP2 all-gathers into one flat output made under its copy-in stream
    # (foreach_all_gather) and copies it out into the unsharded parameters, made on the compute stream
    # (foreach_all_gather_copy_out), so its side stream holds a unit-sized block and the units are the compute's.
    g_block, g_depth = states.gathered_bytes, 1
    g_stream = GATHER_STREAM if states.side_streams else DEFAULT_STREAM
    fsdp_units = (sharded and plan.launcher == "fsdp" and states.gathered_bytes > 0 and not unlimited
                  and unit > 0)
    ag_buffer = fsdp_units and not runtime.fsdp_flat_params  # FSDP2's flat all-gather output
    # FSDP with the embeddings a unit of their own (ModelStates.embedding_unit_bytes): out of the root, gathered for
    # their forward and again for their backward (from the first block's backward, which prefetches them)
    emb_unit = int(states.embedding_unit_bytes) if fsdp_units else 0
    root -= emb_unit
    root_copy = -(-int(root) // world) if fsdp1_offload else 0
    emb_copy = -(-emb_unit // world) if fsdp1_offload else 0
    if fsdp_units and runtime.fsdp_flat_params:
        g_stream = GATHER_STREAM
    reshard = getattr(plan, "reshard_after_forward", True)
    # the last unit resharded after its forward (then prefetched again by the root's pre-backward), unless the job
    # keeps it gathered (Runtime.fsdp_keep_last_block)
    reshard_last = fsdp_units and reshard and not runtime.fsdp_keep_last_block
    if fsdp_units:
        g_block, g_depth = unit, 1 if reshard else shape.layers
    elif states.gathered_moments is not None and unit > 0:
        g_block, g_depth = unit, max(1, floor(states.gathered_bytes / unit))  # depth + 1 blocks in a layer
    # ZeRO-3's schedule (gathered_moments): what the layer-sized window cannot hold at the forward's end (the head's
    # weights, the prefetch past the last layer) and the embeddings' weights in their backward, as blocks of their own
    zero3_at = (states.gathered_moments if states.gathered_moments is not None and sharded and not fsdp_units
                and not unlimited and states.gathered_bytes > 0 and unit > 0 else None)
    ddp_first_bucket = None  # DDP's all-gradient bucket until its rebuild
    if states.buffer_bytes > 0 and not unlimited and not states.startup:
        if per_tensor and builds_ddp(plan, runtime.ddp_single_process):
            ddp_first_bucket = ddp_construction([dt.param * prod(e[1]) for e in params],
                                                [dt.grad * prod(e[1]) for e in params], alloc, free,
                                                runtime.ddp_side_stream)
        else:
            alloc(states.buffer_bytes)
    for size in rotary_table_bytes(shape, dt, runtime):  # an older transformers' per-layer rotary tables
        alloc(size)
    forward_ws, backward_ws = gemm_workspaces(gpu_model, runtime) if dt.gpu else ((), ())
    for size in forward_ws:  # the forward's first GEMM; kept for the process
        alloc(size)

    layer = layer_tensors(shape, plan, dt, acts, runtime)
    embedded, outside, logprobs = _outside(shape, plan, dt, acts, runtime)
    head_casts = [int(acts.head_cast_bytes)] if acts.head_cast_bytes > 0 else []
    grads: dict[int, int] = {}  # param index -> id
    head_idx, layer_idx, emb_idx = _backward_groups(params)
    states_made = bool(flat_states) or (sharded and not fsdp_shards)
    # DeepSpeed with optimizer offload: the device copies of the largest gradient on its way to the host, in the
    # engine's order (ModelStates.reduce_order; one block of reduce_temp_bytes where no order is given)
    reduce_temp = states.reduce_order or ((("hand-over", int(states.reduce_temp_bytes)), ("hand-over", None))
                                          if states.reduce_temp_bytes > 0 else ())
    head_reduce = reduce_temp if shape.task == "causal-lm" and not shape.tied else ()
    micro = 1 if plan.grad_accum == 1 else 2
    keep_grads = states.persistent_grads or (not runtime.frees_grads and not states.grads_end_with_backward)
    # zero_grad between the loss and the backward: the step's grads are freed before the next backward
    late_zero = runtime.grads_through_forward and not keep_grads

    # FSDP reduces each unit's gradient on a stream of its own and makes the gradient shards there, read in torch
    # 2.13 (FSDP1 since 2.0): FSDP1's post-backward hook runs under its post-backward stream, where it casts the
    # flat gradient to the reduce dtype and makes the new shard (_runtime_utils._post_backward_hook, _reduce_grad:
    # empty_like(chunks[0]), kept as _saved_grad_shard, then .grad); FSDP2's foreach_reduce makes the reduce-scatter
    # output under its reduce-scatter stream and the shards' .grad are views of it (or their cast, on the same
    # stream). Those blocks belong to that stream's pool: freed by zero_grad, they stay cached for the next
    # backward's reductions, and the forward's activations cannot reuse them.
    fsdp_reduces = sharded and plan.launcher == "fsdp" and dt.gpu
    grad_stream = REDUCE_STREAM if fsdp_reduces else DEFAULT_STREAM
    # FSDP1's casts and new shards come from that stream too; FSDP2 makes its reduce-scatter input on the compute
    # stream (reduce_scatter_comm.allocate before entering the reduce-scatter stream)
    reduce_stream = REDUCE_STREAM if fsdp_reduces and runtime.fsdp_flat_params else DEFAULT_STREAM

    def grad_alloc(size) -> int:
        return alloc(size, grad_stream)

    def grad_bytes(numel: int) -> int:
        return int(dt.grad * numel * (states.grads_bytes / (dt.grad * n_params) if dt.grad else 0))

    # FSDP's no_sync accumulation (ModelStates.accumulated_grads_bytes): the first micro-batch makes each
    # parameter's unsharded gradient, kept; the last adds its own (a transient) and reduce-scatters the sum into
    # the shard, the unsharded one freed after it
    unsharded: dict[int, int] = {}
    acc_per_elem = states.accumulated_grads_bytes / n_params

    def grads_of(idx, last: bool) -> None:
        if acc_per_elem <= 0 or micro == 1:
            _grads_for(idx, params, grads, grad_alloc, free, grad_bytes, keep_grads, persistent_grads, flush, late)
            return
        for k in idx:
            size = int(acc_per_elem * prod(params[k][1]))
            if k in unsharded or (last and k in grads):  # AccumulateGrad's new gradient, added in place
                free(alloc(size))
            else:
                unsharded[k] = alloc(size)
            if last and k in unsharded:
                if k not in grads:
                    grads[k] = grad_alloc(grad_bytes(prod(params[k][1])))
                free(unsharded.pop(k))

    flush = _Flush(states.flush_bucket_elements, dt.grad, alloc, free,
                   REDUCE_STREAM if states.side_streams else DEFAULT_STREAM)
    # ZeRO-3's backward frees after record_stream, back in their pools a few bucket flushes later
    late = _Deferred(states.deferred_flushes, states.deferred_bucket_elements, A, free)

    kept_output = None  # the previous micro-batch's output, where the loop keeps it (Activations.kept_output)
    for step in range(1, steps + 1):
        A(("mark", f"step {step}"))
        # the Reducer's rebuild, at the forward after the first backward that recorded the gradients' order: step 2
        # without accumulation or under DDP's no_sync (whose micro-batches record nothing but the last)
        if step == 2 and ddp_first_bucket is not None:
            ddp_rebuild(ddp_first_bucket, [dt.grad * prod(e[1]) for e in params], alloc, free)
        for mb in range(micro):
            # forward
            emb_ids = [alloc(x) for x in embedded]
            out_ids = [alloc(x) for x in outside]
            cast_ids: list[int] = []
            kept_ids: list[list[int]] = []
            gathered = []
            pending = [alloc(root_copy)] if root_copy and unlimited else []
            root_id = None
            if unlimited and root > 0:  # FSDP1 keeps the root gathered
                pending.append(alloc(root))
            elif fsdp_units and root > 0:
                root_id = _gather(alloc, free, root, root_copy, g_stream, ag_buffer)
            elif root_copy:
                free(alloc(root_copy))
            if emb_unit:  # gathered, used and resharded: a non-root unit is resharded after its forward
                free(_gather(alloc, free, emb_unit, emb_copy, g_stream, ag_buffer))
            for li in range(shape.layers):
                if unlimited:
                    if shard_copy:
                        pending.append(alloc(shard_copy))
                    pending.append(alloc(unit))
                elif fsdp_units:
                    gathered.append(_gather(alloc, free, unit, shard_copy, g_stream, ag_buffer))
                elif states.gathered_bytes > 0 and sharded:
                    copy = alloc(shard_copy) if shard_copy else None
                    gathered.append(alloc(g_block, g_stream))
                    if copy is not None:
                        free(copy)
                cast_ids += [alloc(x) for x in layer.casts]
                if plan.checkpointing:
                    # the layer's internals, dropped as its forward goes on (the checkpoint keeps none); its output,
                    # the next layer's input and what the checkpoint keeps, is made once they are gone
                    tmp = [alloc(x) for x in layer.saved]
                    for i in tmp:
                        free(i)
                    kept_ids.append([alloc(x) for x in layer.kept])
                else:
                    kept_ids.append([alloc(x) for x in layer.saved])
                if gathered and len(gathered) > g_depth:
                    free(gathered.pop(0))
            if reshard_last:
                for i in gathered:
                    free(i)
                gathered = []
            head_gather = None
            if zero3_at is not None and zero3_at.forward_end - len(gathered) * g_block >= 1:
                head_gather = alloc(int(zero3_at.forward_end - len(gathered) * g_block), g_stream)
            cast_ids += [alloc(x) for x in head_casts]
            # the loss: a causal LM's logits tensors in their order, then the log-probs it saves; another model's
            # transients after its log-probs
            alive = _follow(acts.loss_forward_order, alloc, free,
                            given={PREVIOUS_OUTPUT: kept_output} if kept_output is not None else None)
            kept_output = alive.pop(acts.kept_output) if acts.kept_output else None  # Runtime.output_kept
            made = list(alive.values())
            lp = alloc(logprobs) if logprobs else None
            if not acts.loss_forward_order:
                made = [alloc(x) for x in _loss_forward(acts, logprobs)]
            for i in made:
                free(i)
            for i in cast_ids:  # autocast's cache is cleared when the forward's context exits
                free(i)
            # FSDP2 from torch 2.8 reshards the root after its forward (the loss is inside it) and gathers it again
            # as its backward starts (Runtime.fsdp_root_reshards_after_forward)
            root_again = root_id is not None and reshard and runtime.fsdp_root_reshards_after_forward
            if root_again:
                free(root_id)
            # backward
            if step == 1 and mb == 0:
                for size in backward_ws:  # the autograd device thread's first GEMM; kept for the process
                    alloc(size)
            if late_zero and mb == 0:
                for i in grads.values():
                    free(i)
                grads.clear()
            if root_again:
                root_id = _gather(alloc, free, root, root_copy, g_stream, ag_buffer)
            if acts.loss_chunk_bytes and lp is not None:
                # a chunked loss (Runtime.loss_chunk_rows): the first chunk's two gradients beside the log-probs;
                # each chunk's log-probs then go as its gradient comes (one block here), and split's backward
                # concatenates the chunks' gradients
                chunk = int(acts.loss_chunk_bytes)
                nll, first = alloc(chunk), alloc(chunk)
                free(nll)
                free(lp)
                chunk_grads = [first] + [alloc(x) for x in _split(logprobs - chunk, chunk)]
                loss_bwd = [alloc(logprobs)]
                for i in chunk_grads:
                    free(i)
            else:
                loss_bwd = [alloc(x) for x in _split(acts.loss_backward_temp_bytes, max(logprobs, 1))]
                if lp is not None:
                    free(lp)
            if reshard_last:  # the root's pre-backward prefetches the last unit
                gathered.append(_gather(alloc, free, unit, shard_copy, g_stream, ag_buffer))
            head_tmp = [alloc(x) for x in _split(acts.head_backward_temp_bytes, max(logprobs // 4 * dt.compute, 1))]
            for i in loss_bwd:
                free(i)
            # ZeRO-1/2's gradient buckets, made at the first gradient hook, released in the backward's epilogue
            grad_buckets = [] if unlimited else [alloc(x) for x in _flat_chunks(states.grad_bucket_bytes)]
            head_params = head_idx
            grads_of(head_params, mb == micro - 1)
            # FSDP: the head's unsharded gradient, held until its unit is reduced (at the end: the root's), or that
            # unit's reduction now
            held = alloc(int(states.held_head_bytes)) if states.held_head_bytes > 0 else None
            if states.head_reduce_bytes > 0:
                free(alloc(int(states.head_reduce_bytes), reduce_stream))
            if head_reduce:  # an untied LM head's gradient handed to the host (offload), inside its reduction
                flush.within(head_reduce)
            for i in head_tmp:
                free(i)
            for i in out_ids:  # the final norm's and the head's saved tensors: their backward is done
                free(i)
            if head_gather is not None:  # released after the head's backward (record_stream)
                late.free(head_gather)
            emb_id = None
            for li in reversed(range(shape.layers)):
                if unlimited:
                    if shard_copy:
                        pending.append(alloc(shard_copy))
                    pending.append(alloc(unit))
                elif fsdp_units:
                    if reshard and li > 0:  # this unit's pre-backward prefetches the next one
                        gathered.insert(0, _gather(alloc, free, unit, shard_copy, g_stream, ag_buffer))
                    elif li == 0 and emb_unit:  # the first block's prefetches the embeddings' unit
                        emb_id = _gather(alloc, free, emb_unit, emb_copy, g_stream, ag_buffer)
                elif gathered:
                    late.free(gathered.pop())
                if sharded and states.gathered_bytes > 0 and not unlimited and not fsdp_units:
                    copy = alloc(shard_copy) if shard_copy else None
                    gathered.append(alloc(g_block, g_stream))
                    if copy is not None:
                        free(copy)
                recast = [alloc(x) for x in layer.casts] if plan.checkpointing else []
                tmp = [alloc(x) for x in layer.backward]
                idx = layer_idx.get(li, [])
                if unlimited:  # the unit's unsharded gradient, reduce-scattered into its shard
                    pending.append(alloc(unit))
                grads_of(idx, mb == micro - 1)
                for i in tmp:
                    free(i)
                if states.reduce_extra_bytes > 0 and not unlimited:
                    # the unit's reduction, its computation done
                    free(alloc(int(states.reduce_extra_bytes), reduce_stream))
                for i in recast:
                    free(i)
                for i in kept_ids[li]:
                    free(i)
                if fsdp_units and gathered:  # resharded after its backward
                    free(gathered.pop())
            for i in gathered:
                late.free(i)
            for i in pending:
                free(i)
            emb_gather = None
            if zero3_at is not None and zero3_at.backward_end >= 1:  # the embeddings' weights, for their backward
                emb_gather = alloc(int(zero3_at.backward_end), g_stream)
            # embeddings' gradients (the tied head's adds a second vocab x hidden transient)
            emb = emb_idx
            vocab_grad = dt.grad * shape.vocab * shape.hidden
            add = (grads or (shape.task == "causal-lm" and shape.tied)) and vocab_grad > 0
            t = [alloc(vocab_grad), alloc(vocab_grad)] if add else []
            grads_of(emb, mb == micro - 1)
            for i in t:
                free(i)
            if emb_gather is not None:
                late.free(emb_gather)
            if emb_id is not None:  # the embeddings' unit resharded after its backward, then reduced
                free(emb_id)
            # the root's post-backward: its resharding, then its unsharded gradients (the held head's among them)
            # with the reduce-scatter's buffers
            if root_id is not None:
                free(root_id)
            if states.end_reduce_bytes > 0:
                free(alloc(int(max(states.end_reduce_bytes - states.held_head_bytes, 0)), reduce_stream))
            if held is not None:
                free(held)
            # the engine's backward epilogue reduces what the bucket still holds, handing the embedding's gradient
            # to the host inside that reduction (offload), and then releases ZeRO-1/2's buckets
            # (independent_gradient_partition_epilogue: reduce_ipg_grads, then _release_ipg_buffers)
            flush.epilogue(reduce_temp)
            late.drain()  # the epilogue synchronizes the reduce stream, which waited for the compute stream
            for i in grad_buckets:
                free(i)
            for i in emb_ids:
                free(i)
            if states.grads_end_with_backward:  # the backward's final callback drops the device grads
                for i in grads.values():
                    free(i)
                grads.clear()
        # optimizer step
        A(("mark", f"step {step} optimizer"))
        copies = foreach_step_copies(plan, dt, runtime)
        for _ in range(2 if states.step_check_bytes > 0 else 0):  # the overflow check's isinf, then isnan, mask
            free(alloc(int(states.step_check_bytes), flush.stream))
        _follow(states.step_order, alloc, free)  # ZeRO's overflow scan and fp64 norm of the largest gradient slice
        if sharded and not fsdp_shards:
            flat = [alloc(x) for x in _flat_chunks(states.step_flatten_bytes)]
            tmp = [alloc(x) for x in _flat_chunks(states.step_temp_bytes * copies)]
            for i in flat:  # the flattened 16-bit gradients, once cast
                free(i)
            if step == 1:  # states made lazily by the optimizer's first step, beside the gradient's fp32 copy
                for x in states.lazy_states:
                    alloc(x)
            for i in tmp:
                free(i)
        else:
            tensors = fsdp_shards or params
            numels = [prod(e[1]) for e in tensors]
            if not states_made:
                if opt.temporaries == "foreach" and dt.gpu:  # _init_group makes every state first
                    for e in tensors:
                        for x in _state_sizes(opt, e, dt.state):
                            alloc(x)
                    waves = opt.step_temp_tensors(numels, dt.state, dt.grad, dt.gpu)
                else:  # a per-parameter loop makes each parameter's states as it reaches it
                    waves = []
                    for e, wave in zip(tensors, opt.step_temp_tensors(numels, dt.state, dt.grad, dt.gpu)
                                       or [[] for _ in tensors]):
                        for x in _state_sizes(opt, e, dt.state):
                            alloc(x)
                        w = [alloc(x) for x in wave]
                        for i in w:
                            free(i)
                states_made = True
            else:
                waves = opt.step_temp_tensors(numels, dt.state, dt.grad, dt.gpu)
            for wave in waves:
                w = [alloc(x) for x in wave * copies]
                for i in w:
                    free(i)
        if not keep_grads and not late_zero:
            for i in grads.values():
                free(i)
            grads.clear()
    return ev


_FLAT_CHUNK = 2 * 1024 ** 3
"""Flat buffers (DeepSpeed's partitions, FSDP's shards) as tensors of at most 2 GiB (DeepSpeed's
default sub_group_size is 1e9 elements; torch pads each FSDP shard): chunks only matter for the
segments they make."""


def ddp_construction(param_bytes: list[int], grad_bytes: list[int], alloc, free, side_stream: bool) -> int:
    """DistributedDataParallel's construction (estimate.gpu, the DDP notes), the parameters' and their gradients'
    bytes in registration order: the broadcast of the parameters through flat copies, two in flight, then the
    Reducer's one bucket of every gradient, whose id is returned (it lives until ``ddp_rebuild``). On Lightning's
    own stream with ``side_stream`` (``Runtime.ddp_side_stream``). Used by both methods' streams."""
    stream = DDP_BUILD_STREAM if side_stream else DEFAULT_STREAM
    in_flight: list[int] = []
    for size in ddp_broadcast_sizes(param_bytes):
        if len(in_flight) >= DDP_BROADCASTS_IN_FLIGHT:
            free(in_flight.pop(0))
        in_flight.append(alloc(size, stream))
    for i in in_flight:
        free(i)
    return alloc(sum(grad_bytes), stream)


def ddp_rebuild(first_bucket: int, grad_bytes: list[int], alloc, free) -> None:
    """The Reducer's rebuild at the second forward: the first bucket freed, then the capped buckets in the order
    the backward made the gradients (``ddp_bucket_sizes``), on the training's stream."""
    free(first_bucket)
    for bucket in ddp_bucket_sizes(grad_bytes):
        alloc(bucket)


def _follow(order, alloc, free, stream_of=None, given=None) -> dict[str, int]:
    """Replay a recipe of ``(name, bytes)`` (make a tensor) and ``(name, None)`` (free the one made under that
    name) steps; the ids still alive, by name. ``stream_of(name)``: the stream each tensor is made on (None: the
    allocator's default). ``given``: ids alive before it starts, by name, which it may free; the previous
    micro-batch's kept output (``PREVIOUS_OUTPUT``) is freed only where there is one."""
    made: dict[str, int] = dict(given or {})
    for name, size in order:
        if size is None:
            if name == PREVIOUS_OUTPUT and name not in made:  # the first micro-batch: nothing kept yet
                continue
            free(made.pop(name))
        else:
            made[name] = alloc(size) if stream_of is None else alloc(size, stream_of(name))
    return made


def _loss_forward(acts, logprobs: int) -> list[int]:
    """The loss's forward transients where no order is given (``Activations.loss_forward_order``: a model other
    than a causal LM), as blocks the size of the log-probs when there are any."""
    total = acts.loss_forward_temp_bytes
    if total <= 0:
        return []
    return _split(total, logprobs) if logprobs else [int(total)]


def _backward_groups(params) -> tuple[list[int], dict[int, list[int]], list[int]]:
    """Indices into ``params`` as the backward meets them: the head's (parameters after the first layer's that
    belong to no layer), each layer's, the embeddings' (before the first layer)."""
    first = _first_layer_index(params)
    by_layer: dict[int, list[int]] = {}
    for k, e in enumerate(params):
        if e[3] is not None:
            by_layer.setdefault(e[3], []).append(k)
    head = [k for k, e in enumerate(params) if e[3] is None and k >= first]
    emb = [k for k, e in enumerate(params) if e[3] is None and k < first]
    return head, by_layer, emb


def _first_layer_index(params) -> int:
    for k, p in enumerate(params):
        if p[3] is not None:
            return k
    return len(params)


DEFAULT_STREAM = 0
GATHER_STREAM = "all-gather"
"""the stream DeepSpeed's parameter coordinator gathers on with ``overlap_comm``"""
DDP_BUILD_STREAM = "ddp-build"
"""the stream Lightning builds DistributedDataParallel on (``Runtime.ddp_side_stream``)"""
REDUCE_STREAM = "reduce"
"""the stream gradients are reduced on: DeepSpeed's with ``overlap_comm`` (ZeRO-3's ``reduce_and_partition_stream``,
ZeRO-1/2's ``reduction_stream``), FSDP1's post-backward stream, FSDP2's reduce-scatter stream"""


class _Bucket:
    """DeepSpeed's gradient bucket by elements (``reduce_bucket_size``): a gradient that would overflow it
    reduces what it holds first (``reduce_independent_p_g_buckets_and_remove_grads``)."""

    __slots__ = ("cap", "fill")

    def __init__(self, cap: float):
        self.cap, self.fill = cap, 0

    def take(self, numel: int) -> bool:
        """A gradient enters; True when the bucket was reduced (emptied) before it."""
        flushed = bool(self.fill) and self.fill + numel > self.cap
        if flushed:
            self.fill = 0
        self.fill += numel
        return flushed


class _Flush:
    """DeepSpeed ZeRO-3's bucket reductions: each (a gradient overflowing the ``_Bucket``, and the backward's
    epilogue) copies the bucket's gradients into one new tensor (``ModelStates.flush_bucket_elements``), on the
    reduce stream with ``overlap_comm``."""

    def __init__(self, cap: float, elem: int, alloc, free, stream=DEFAULT_STREAM):
        self.bucket, self.elem, self.stream = _Bucket(cap), elem, stream
        self.alloc, self.free = alloc, free

    def add(self, numel: int) -> None:
        held = self.bucket.fill
        if self.bucket.cap > 0 and self.bucket.take(numel):  # cap 0: no copies
            self._reduce(held)

    def within(self, order=()) -> None:
        """Transients of a reduction on its stream: a recipe (``ModelStates.reduce_order``'s form), replayed; the
        gradient autograd made (``AUTOGRAD_GRADIENT``) on the compute stream."""
        on = lambda name: DEFAULT_STREAM if name == AUTOGRAD_GRADIENT else self.stream  # noqa: E731
        for i in _follow(order, self.alloc, self.free, on).values():
            self.free(i)

    def epilogue(self, inside=()) -> None:
        """Reduce what the bucket holds; ``inside``: a recipe of transients made and freed during the reduction."""
        self._reduce(self.bucket.fill, inside)
        self.bucket.fill = 0

    def _reduce(self, held: int, inside=()) -> None:
        copy = self.alloc(self.elem * held, self.stream) if held else None
        self.within(inside)
        if copy is not None:
            self.free(copy)


def _gather(alloc, free, unit: int, shard_copy: int, stream, flat_output: bool) -> int:
    """One FSDP unit's all-gather: its unsharded block, made while the device copy of its shard (FSDP1's CPU
    offload) lives; FSDP2 (``flat_output``) gathers into a flat block on its all-gather stream first and copies
    out of it."""
    copy = alloc(shard_copy) if shard_copy else None
    flat = alloc(unit, GATHER_STREAM) if flat_output else None
    block = alloc(unit, stream)
    for i in (copy, flat):
        if i is not None:
            free(i)
    return block


class _Deferred:
    """ZeRO-3's frees after ``record_stream`` in the backward (``ModelStates.deferred_flushes``): each gathered
    weight and each gradient copied into the bucket leaves the allocated bytes at its free (``("defer", id)``)
    and returns to its pool (``("return", id)``) when the host has made ``lag`` + 1 more bucket flushes, which
    is when DeepSpeed has waited for the reduction whose stream waited for that free's compute (the host may be
    no further ahead; a faster host-to-GPU catch-up returns it sooner: this is the bound); all at the
    backward's epilogue, which synchronizes the reduce stream. ``lag`` 0: a plain free."""

    def __init__(self, lag: int, cap: float, emit, free):
        self.lag, self.bucket, self.count = lag, _Bucket(cap), 0
        self.emit, self._free = emit, free
        self.waiting: list[tuple[int, int]] = []  # (the flush by which it is back, id)

    def add(self, numel: int) -> None:
        """A gradient enters the bucket: a bucket that would overflow is reduced first (one more flush)."""
        if not self.lag or not self.bucket.take(numel):
            return
        self.count += 1
        due = [w for w in self.waiting if w[0] <= self.count]
        self.waiting = [w for w in self.waiting if w[0] > self.count]
        for _, i in due:
            self.emit(("return", i))

    def free(self, i: int) -> None:
        if not self.lag:
            self._free(i)
            return
        self.emit(("defer", i))
        self.waiting.append((self.count + 1 + self.lag, i))

    def drain(self) -> None:
        for _, i in self.waiting:
            self.emit(("return", i))
        self.waiting, self.bucket.fill = [], 0


@lru_cache(maxsize=256)
def zero3_reductions(shape: ModelShape, bucket_elements: int) -> tuple[int, int]:
    """(the largest reduction during the layers' backward, the epilogue's), in elements: the bucket copies
    ``_Flush`` makes over one backward, gradients in the order ``step_events`` produces them (the head's,
    the layers' from the last, the embeddings')."""
    sizes: list[int] = []
    ids = iter(range(1 << 62))
    flush = _Flush(bucket_elements, 1, lambda size, stream=DEFAULT_STREAM: sizes.append(int(size)) or next(ids),
                   lambda i: None)
    params = param_order(shape)
    head, by_layer, emb = _backward_groups(params)
    order = head + [k for li in reversed(range(shape.layers)) for k in by_layer.get(li, [])] + emb
    for k in order:
        flush.add(prod(params[k][1]))
    during = len(sizes)
    flush.epilogue()
    return max(sizes[:during], default=0), (sizes[during] if len(sizes) > during else 0)


def _grads_for(idx, params, grads, alloc, free, grad_bytes, keep, persistent, flush: _Flush | None = None,
               late: "_Deferred | None" = None) -> None:
    """The gradients of ``idx``: made the first time (unless the engine keeps flat grads); later
    micro-batches make a transient gradient that AccumulateGrad adds in place."""
    for k in idx:
        if flush is not None:  # the bucket takes every gradient, kept on the device or not
            flush.add(prod(params[k][1]))
        if late is not None:
            late.add(prod(params[k][1]))
        size = grad_bytes(prod(params[k][1]))
        if size <= 0:
            continue
        if persistent:
            i = alloc(size)  # DeepSpeed: the param's full grad, reduced into the flat buffer, then freed
            (late.free if late is not None else free)(i)
        elif k in grads:
            i = alloc(size)
            free(i)
        else:
            grads[k] = alloc(size)


def iter_sizes(events) -> Iterator[int]:
    for e in events:
        if e[0] == "alloc":
            yield e[2]
