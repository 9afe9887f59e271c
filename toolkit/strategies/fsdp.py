"""FSDP: PyTorch's Fully Sharded Data Parallel, version 2 (``torch.distributed.fsdp.fully_shard``).

torchrun starts the ranks, as for DDP. Each transformer block is one FSDP unit, then the root (embeddings,
final norm, head); every parameter is sharded over the ranks as a DTensor. Per rank, with Ψ parameters and N
ranks (the sharded parameters are the master copy, so there is no separate one):

- sharded parameters, gradients and optimizer states: (s + s + states) · Ψ/N, s = 4 B (fp32, fp16/bf16-mixed)
  or 2 B (bf16-true);
- gathered weights in the compute dtype (2 B under mixed precision): the root's for the whole step (FSDP2
  does not reshard the root after the forward) and, with ``reshard_after_forward=true`` (ZeRO-3-like), the
  block being computed plus the one prefetched; with ``false`` (ZeRO-2-like) every block from its forward to
  its backward;
- in the backward, one block's unsharded gradients (compute dtype) and the reduce-scatter input in the
  reduce dtype (``reduce_dtype``: fp32, or the compute dtype with ``param``), a new flat buffer that
  ``foreach_reduce`` copies the gradients into whatever the dtypes (FSDP1, which published runs of torch < 2.4
  used, makes its flat gradient as a cat of its views' gradients and reduce-scatters it in place unless it casts
  it); the head's unsharded gradient from its backward to the backward's end, where the root is reduced last
  (its inputs need no gradient: the final callback), its unsharded gradients and reduce-scatter buffers at once.

Knobs: ``reshard_after_forward`` (true/false), ``reduce_dtype`` (fp32/param), ``offload_params=cpu``
(``CPUOffloadPolicy``: sharded parameters, gradients and optimizer states live in pinned host memory and the
optimizer steps there), ``checkpointing`` (per block, non-reentrant), ``precision`` (the mixed-precision
policy's param dtype). The wrapping unit is the model's transformer block (HF ``_no_split_modules``).
"""

from __future__ import annotations

import json
from math import prod
from typing import Any, Mapping

from .. import optimizers
from ..errors import PlanError
from .base import MIXED, SIXTEEN_BIT, Dtypes, Gathered, Layout, ModelStates, Placement, Strategy, register

REDUCE_DTYPES = ("fp32", "param")


def optimizer_tensors(shape, world: int, flat: bool = False, orig_params: bool = False) -> list[tuple[int, ...]]:
    """The shapes of the tensors FSDP's optimizer steps over on rank 0, in ``model.parameters()`` order: its states
    are made per tensor at the first step, and a foreach step's temporaries too.

    - FSDP2: each parameter's shard, its first dimension chunked (``torch.chunk``: ``ceil(dim0 / world)`` rows);
    - FSDP1 (``flat``, ``Runtime.fsdp_flat_params``): each wrapped unit is one flat parameter (the root's, the
      parameters outside the layers, first), padded to a multiple of ``world`` and sharded in contiguous
      chunks. Without ``orig_params`` the optimizer sees the flat shard, one 1-D tensor per unit; with it
      (``use_orig_params=True``), each original parameter's piece of that chunk, a 1-D view (the rank's chunk
      of a unit holds whole parameters, part of one at each end, and none of the others).
    """
    world = max(1, world)
    first = [t for t in shape.other_tensors if t[2] == "embedding" or t[0].startswith("embeddings")]
    root = first + [t for t in shape.other_tensors if t not in first]
    units = ([root] if root else []) + [list(shape.layer_tensors)] * shape.layers
    out: list[tuple[int, ...]] = []
    for unit in units:
        if not flat:
            out += [(-(-dims[0] // world),) + tuple(dims[1:]) for _name, dims, _kind in unit if dims]
            continue
        chunk = -(-sum(prod(dims) for _name, dims, _kind in unit) // world)
        if not orig_params:
            out.append((chunk,))
            continue
        left = chunk
        for _name, dims, _kind in unit:
            if left <= 0:
                break
            piece = min(prod(dims), left)
            out.append((piece,))
            left -= piece
    return [dims for dims in out if prod(dims) > 0]


SYNC_EACH_BATCH = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
"""How hpcmem asks HF Accelerate (``GradientAccumulationPlugin``) and HF Trainer (``accelerator_config``) to
reduce-scatter every micro-batch of an accumulation, as its own runtime does: by default both run all but the
last under ``no_sync``, where FSDP keeps every unit's unsharded gradient until the last (``Runtime.fsdp_no_sync``),
so that accumulating, a rung the ladder takes to save memory, would cost the whole unsharded gradient under FSDP.
The field came with transformers PR #29589 (2024); PR #43919 ("Fix sync gradient", merged 2026-02-11) made the
Trainer's accumulation loop check it before it enters ``no_sync`` (read in the installed 5.24)."""


def with_sync_each_batch(accelerator_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``accelerator_config`` (the HF Trainer's, as a dict) with ``SYNC_EACH_BATCH`` merged in, its other settings
    kept: the Trainer takes only the last ``--accelerator_config`` given, so the sync is asked for inside the
    job's own one. None: ``SYNC_EACH_BATCH`` alone."""
    config = dict(accelerator_config or {})  # shallow: a job's JSON may nest deeper than deepcopy's recursion
    kwargs = config.get("gradient_accumulation_kwargs")
    return {**config, "gradient_accumulation_kwargs": {**(kwargs if isinstance(kwargs, dict) else {}),
                                                       **SYNC_EACH_BATCH["gradient_accumulation_kwargs"]}}


PREFETCHED_UNITS = 2
"""Blocks whose weights are gathered at once when resharding after the forward: the one being computed and
the next, which FSDP2's implicit prefetching all-gathers in advance."""
RESHARD_COST = 1.12
"""A second all-gather of every block in the backward (ZeRO-3-like) against keeping them (ZeRO-2-like)."""
SHARD_COST = 1.04
OFFLOAD_COST = 2.0
"""CPU offload: host-device copies of every unit each step and a CPU optimizer step."""


@register
class FSDP(Strategy):
    name = "fsdp"
    title = "FSDP2"
    template = "fsdp.sbatch.j2"
    family = "sharded"
    own_knobs = ("reshard_after_forward", "reduce_dtype")
    config_file = "fsdp_config.json"
    env_var = "HPCMEM_FSDP_CONFIG"
    sharded = True
    checkpointing_by_config = True

    def validate(self, plan) -> None:
        if plan.offload_params not in ("none", "cpu"):
            raise PlanError(f"offload_params={plan.offload_params}: FSDP offloads to the CPU only; "
                            "NVMe offload needs launcher=deepspeed (ZeRO-Infinity)")
        if plan.reduce_dtype not in REDUCE_DTYPES:
            raise PlanError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}; got {plan.reduce_dtype!r}")

    def describe(self, plan) -> str:
        parts = [f"FSDP2 ({'ZeRO-3-like: resharded after forward' if plan.reshard_after_forward else 'ZeRO-2-like: kept after forward'})"]
        if plan.offload_params == "cpu":
            parts.append("CPU offload")
        return ", ".join(parts)

    def summary(self, plan) -> list[str]:
        out = ["reshard" if plan.reshard_after_forward else "noreshard"]
        if plan.reduce_dtype != "fp32":
            out.append(f"reduce={plan.reduce_dtype}")
        if plan.offload_params == "cpu":
            out.append("params->cpu")
        return out

    # -- rendering and training code ---------------------------------------------------------

    def config(self, plan, *, nvme_path: str | None = None, gpu: bool = True,
               largest_param: int | None = None) -> dict[str, Any]:
        """fsdp_config.json, in the keys of HF TrainingArguments' ``fsdp_config`` (version 2) and accelerate's
        FullyShardedDataParallelPlugin, which hpcmem's runtime reads too. Its ``mixed_precision_policy`` reaches
        hpcmem's reference trainer and Accelerate (``accelerate_kwargs``); the HF Trainer does not pass it on to
        its plugin (transformers 5.24's ``TrainingArguments``), so a Trainer job reduces in the 16-bit dtype
        whatever the plan's ``reduce_dtype``: less than an fp32-reduce plan is estimated to hold."""
        cfg: dict[str, Any] = {"version": 2, "reshard_after_forward": plan.reshard_after_forward,
                               "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                               "cpu_offload": plan.offload_params == "cpu",
                               "activation_checkpointing": plan.checkpointing,
                               "state_dict_type": "SHARDED_STATE_DICT"}
        policy = self.mixed_precision(plan)
        if policy:
            cfg["mixed_precision_policy"] = policy
        return cfg

    def mixed_precision(self, plan) -> dict[str, str] | None:
        """The MixedPrecisionPolicy's dtypes (torch names), None when the model runs in its own dtype."""
        if plan.precision not in MIXED:
            return None
        half = SIXTEEN_BIT[plan.precision]
        return {"param_dtype": half, "reduce_dtype": "float32" if plan.reduce_dtype == "fp32" else half}

    def mixed_precision_policy(self, plan):
        """``torch.distributed.fsdp.MixedPrecisionPolicy`` for the plan (None when the model runs in its own dtype);
        the one object both the reference trainer's ``fully_shard`` and accelerate's plugin take."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        names = self.mixed_precision(plan)
        if names is None:
            return None
        return MixedPrecisionPolicy(param_dtype=getattr(torch, names["param_dtype"]),
                                    reduce_dtype=getattr(torch, names["reduce_dtype"]))

    def trainer_flags(self, plan, config_path: str | None) -> list[str]:
        words = ["full_shard" if plan.reshard_after_forward else "shard_grad_op", "auto_wrap"]
        if plan.offload_params == "cpu":
            words.append("offload")
        flags = ["--fsdp", " ".join(words)]
        if config_path:
            flags += ["--fsdp_config", config_path]
        if plan.grad_accum > 1:
            flags += ["--accelerator_config", json.dumps(with_sync_each_batch())]
        return flags

    def training_args(self, plan, config_path: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"fsdp": self.trainer_flags(plan, config_path)[1]}
        if config_path:
            out["fsdp_config"] = str(config_path)
        if plan.grad_accum > 1:
            out["accelerator_config"] = with_sync_each_batch()
        return out

    def accelerate_kwargs(self, plan, config_path: str | None) -> dict[str, Any]:
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=plan.reshard_after_forward, auto_wrap_policy="transformer_based_wrap",
            cpu_offload=plan.offload_params == "cpu", activation_checkpointing=plan.checkpointing,
            state_dict_type="SHARDED_STATE_DICT", mixed_precision_policy=self.mixed_precision_policy(plan))
        from accelerate.utils import GradientAccumulationPlugin

        accumulation = GradientAccumulationPlugin(num_steps=plan.grad_accum,
                                                  **SYNC_EACH_BATCH["gradient_accumulation_kwargs"])
        return {"fsdp_plugin": plugin, "gradient_accumulation_plugin": accumulation}

    def fabric_kwargs(self, plan) -> dict[str, Any]:
        # Lightning's FSDPStrategy speaks FSDP1's sharding strategies; the wrapping and checkpointing policies
        # are the model's block classes, which the caller adds (runtime.fabric_kwargs(plan, block_classes)).
        return {"strategy": "fsdp", "strategy_kwargs": {
            "sharding_strategy": "FULL_SHARD" if plan.reshard_after_forward else "SHARD_GRAD_OP",
            "cpu_offload": plan.offload_params == "cpu"}}

    # -- memory ------------------------------------------------------------------------------

    def dtypes(self, plan, gpu: bool) -> Dtypes:
        storage = 2 if plan.precision == "bf16-true" else 4
        compute = 2 if plan.precision in (*MIXED, "bf16-true") else 4
        # Gathered weights and the activations are in the compute dtype (the policy casts the inputs too);
        # the sharded fp32 parameters are the master copy (no separate one); states follow the storage dtype.
        return Dtypes(param=compute, compute=compute, grad=compute, master=0, state=storage, autocast=False,
                      gpu=gpu, mask=1 if gpu else compute)

    def layout(self, plan) -> Layout:
        if plan.precision == "bf16-true":
            return Layout("bfloat16")
        half = SIXTEEN_BIT.get(plan.precision)
        if half is None:
            return Layout("float32")
        return Layout(half, master_weights=True, loss_scaling=plan.precision == "fp16-mixed",
                      note="FSDP mixed precision: weights gathered in 16-bit, the sharded fp32 weights are the master")

    def model_states(self, shape, plan, dt: Dtypes, engine_config=None, runtime=None) -> ModelStates:
        psi = float(shape.n_params)
        n = plan.world_size
        storage = dt.state
        reduce = 4 if plan.reduce_dtype == "fp32" else dt.compute
        opt = optimizers.get(plan.optimizer)
        block = float(shape.layer_params)
        root = max(psi - shape.layers * block, 0.0)
        in_flight = PREFETCHED_UNITS * block if plan.reshard_after_forward else shape.layers * block
        gathered = dt.param * (root + min(in_flight, shape.layers * block))
        shard = psi / n
        params, grads = storage * shard, storage * shard
        flat = getattr(runtime, "fsdp_flat_params", False)
        tensors = optimizer_tensors(shape, n, flat, getattr(runtime, "fsdp_use_orig_params", False))
        on_device = dt.gpu and plan.offload_params == "none"  # CPU offload steps the host's shards: nothing paged
        optimizer = float(sum(sum(opt.state_tensor_bytes(dims, storage, on_device)) for dims in tensors))
        paged = float(sum(opt.paged_state_bytes(dims, on_device) for dims in tensors))
        numels = [prod(dims) for dims in tensors]
        step = opt.step_temp_bytes(sum(numels), max(numels, default=0), storage, storage, dt.gpu)
        # a unit's gradients as it is reduced, read in torch 2.13: FSDP2's foreach_reduce copies the unit's unsharded
        # gradients (compute dtype) into a new flat reduce-scatter input (reduce dtype), frees them, then makes the
        # output shard (_fsdp_collectives.py). FSDP1's flat gradient is made by the backward of the views' split
        # (_flat_param.py: torch.split of the flat parameter), a cat of the views' gradients while they are still
        # alive; the post-backward hook casts it to the reduce dtype where that differs and reduce-scatters it in
        # place into a new shard. Per unit of u elements, the most alive at once:
        def reducing(u: float) -> float:
            second = max(dt.grad, reduce) if flat else reduce
            return max(u * (dt.grad + second), u * reduce * (1.0 + 1.0 / n))

        buffers = reducing(block)
        # accumulation without the gradient sync (Runtime.fsdp_no_sync): every unit keeps its unsharded gradient
        # between micro-batches, FSDP1 as its flat parameter's .grad in the unsharded (compute) dtype (the
        # post-backward hook returns before _reduce_grad; prepare_gradient_for_backward keeps an unsharded .grad);
        # FSDP2 casts it to its mixed-precision policy's reduce dtype (FSDPParam.to_accumulated_grad_if_needed). Read in
        # torch 2.13; with CPU offload too ("the gradients will not be offloaded to CPU when inside the context")
        accumulated = 0.0
        if getattr(runtime, "fsdp_no_sync", False) and plan.grad_accum > 1 and plan.world_size > 1:
            accumulated = psi * (reduce if not flat and plan.precision in MIXED else dt.grad)
        host = 0.0
        if plan.offload_params == "cpu":
            host = params + grads + optimizer
            params = optimizer = step = 0.0
            # FSDP1 keeps each unit's reduce-scattered gradient shard on the device, in the flat parameter's dtype,
            # as _saved_grad_shard until the backward's final callback hands the optimizer the host copy
            # (_accumulate_sharded_grad, prepare_gradient_for_optim; read in torch 2.13, the same since 2.0)
            grads = grads if flat else 0.0
        # the root unit (what no block holds: embeddings, final norm, head) has no input that needs a gradient, so
        # its post-backward runs in the backward's final callback (FSDP2's _root_post_backward_final_callback; FSDP1's
        # flat gradient waits for the embedding's too): the head's unsharded gradient is held from its backward to
        # there, where the whole root is reduced at once. Where the job wraps each embedding as a unit of its own
        # (Runtime.fsdp_embedding_unit, an untied head), those are reduced at the end one by one and the root, now
        # the final norm and the head, as soon as their gradients exist, in the head's backward.
        embeddings = [prod(dims) for _name, dims, kind in shape.other_tensors if kind == "embedding"]
        own_embeddings = getattr(runtime, "fsdp_embedding_unit", False) and not shape.tied and bool(embeddings)
        if own_embeddings:
            held_head, head_reduce, last = 0.0, reducing(root - sum(embeddings)), max(embeddings)
        else:
            held_head, head_reduce, last = dt.grad * shape.head_linear_params, 0.0, root
        # FSDP2's gathered weights moment by moment: the root throughout (an embedding unit of its own only for its
        # forward and its backward); with resharding, in the forward the unit computing and the one prefetched,
        # none by the loss, and in the backward the unit computing and the one prefetched (the root's pre-backward
        # prefetches the last; the first has none after it); without, every unit from its forward to the end of
        # its backward. A unit is resharded after its backward, before its gradients are reduced. Measured on one
        # CPU rank (benchmarks/fsdp_cpu_check.py). FSDP1 is counted as before, the root and two units (or all of
        # them) at every moment: its published runs are under by up to 9 points with the moments (the 405B row;
        # docs/estimator.md, session 20), and no trace of an FSDP1 step says which moment holds more
        u, r = dt.param * block, dt.param * (root - (sum(embeddings) if own_embeddings else 0.0))
        whole, layers = dt.param * root, shape.layers
        if flat:
            moments = None
        elif plan.reshard_after_forward:
            # a last block kept gathered after its forward (Runtime.fsdp_keep_last_block) is there by the loss
            kept = u * min(1, layers) if getattr(runtime, "fsdp_keep_last_block", False) else 0.0
            moments = Gathered(forward_end=r + kept, head_backward=r + u * min(1, layers),
                               last_layer=r + u * min(PREFETCHED_UNITS, layers), first_layer=r + u * min(1, layers),
                               backward_end=whole)
        else:
            moments = Gathered(forward_end=r + u * layers, head_backward=r + u * layers, last_layer=r + u * layers,
                               first_layer=r + u * min(1, layers), backward_end=whole)
        return ModelStates(params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer, persistent_grads=False,
                           grads_end_with_backward=plan.offload_params == "cpu" and grads > 0,
                           buffer_bytes=0.0, grad_bucket_bytes=block * dt.grad,
                           reduce_extra_bytes=buffers - block * dt.grad, gathered_bytes=gathered, step_temp_bytes=step,
                           host_bytes_per_rank=host, accumulated_grads_bytes=accumulated, paged_optimizer_bytes=paged,
                           held_head_bytes=held_head, head_reduce_bytes=head_reduce, end_reduce_bytes=reducing(last),
                           end_reduce_share=grads * last / psi if psi else 0.0, gathered_moments=moments,
                           embedding_unit_bytes=dt.param * sum(embeddings) if own_embeddings else 0.0)

    def placement(self, plan) -> Placement:
        share = 1.0 / plan.world_size
        # Without resharding every block stays gathered from its forward to its backward, on top of its shard.
        gathered = float(PREFETCHED_UNITS) if plan.reshard_after_forward else 0.0
        whole = 0.0 if plan.reshard_after_forward else 1.0
        if plan.offload_params == "cpu":
            return Placement(0.0, 0.0, 0.0, host_params=share, host_optimizer=share, gathered_layers=gathered,
                             gathered_params=whole)
        return Placement(share, share, share, gathered_layers=gathered, gathered_params=whole)

    def startup_host_bytes(self, shape, plan) -> float:
        # the runtime builds the whole model on each rank, then shards it (meta-device init is the user's choice)
        return (2.0 if plan.precision == "bf16-true" else 4.0) * shape.n_params

    def cost(self, plan) -> float:
        factor = SHARD_COST * (RESHARD_COST if plan.reshard_after_forward else 1.0)
        return factor * (OFFLOAD_COST if plan.offload_params == "cpu" else 1.0)

    # -- the runtime side (inside the job) ---------------------------------------------------

    def shard(self, model, plan, device):
        """Apply ``fully_shard`` to each transformer block, then to the root; returns what was applied and why
        anything differs from the plan (``{knob: (value, reason)}``)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        applied: dict[str, tuple[Any, str]] = {}
        kwargs: dict[str, Any] = {"reshard_after_forward": plan.reshard_after_forward}
        policy = self.mixed_precision_policy(plan)
        if policy is not None:
            kwargs["mp_policy"] = policy
        if plan.offload_params == "cpu":
            if device.type == "cuda":
                kwargs["offload_policy"] = CPUOffloadPolicy()
            else:
                applied["offload_params"] = ("none", "FSDP's CPU offload moves parameters off a GPU; on a CPU "
                                                     "device they are already in host memory")
        blocks = transformer_blocks(model)
        if not blocks:
            raise PlanError(f"launcher=fsdp: {type(model).__name__} names no transformer block to shard "
                            "(HF _no_split_modules); use launcher=torchrun or deepspeed")
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return applied


    def save_state(self, directory, ranks, model, optimizer) -> str:
        """Every rank writes its shards with torch.distributed.checkpoint into ``dcp/`` (model and optimizer by
        FQN); returns the save's format. FSDP of another world size and DDP read it back (resharded on load)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from ..runtime.checkpoint import DCP_DIR, FORMAT_DCP

        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=f"{directory}/{DCP_DIR}")
        return FORMAT_DCP

    def load_state(self, directory, saved, model, optimizer) -> None:
        """Load a torch.distributed.checkpoint or a full (DDP) save into the sharded model and optimizer."""
        from ..runtime.checkpoint import load_torch_state

        load_torch_state(directory, saved.format, model, optimizer)

    def state_digest(self, model, optimizer):
        """sha256 of the gathered model and optimizer state (a collective; rank 0 gets it, None on the others)."""
        from ..runtime.checkpoint import torch_digest

        return torch_digest(model, optimizer)


def transformer_blocks(model) -> list:
    """The modules FSDP wraps one by one: those whose class the model names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]
