"""DDP: torchrun starts one process per GPU, torch's DistributedDataParallel replicates the model.

Every rank holds the whole model, its gradients and its optimizer state; gradients are all-reduced
through DDP's flat buckets (a second copy of the gradients). No sharding, no offload.
"""

from __future__ import annotations

from .. import optimizers
from .base import ModelStates, Strategy, register


def builds_ddp(plan, single_process: bool = False) -> bool:
    """Whether the plan's ranks are DistributedDataParallel replicas (torchrun over more than one rank), whose
    construction and buckets the estimates add (``estimate.stream.ddp_construction``). ``single_process``: the job
    wraps one process in DDP too (``Runtime.ddp_single_process``)."""
    return plan.strategy.name == DDP.name and (plan.world_size > 1 or single_process)


@register
class DDP(Strategy):
    name = "torchrun"
    title = "torchrun (DDP)"
    template = "torchrun.sbatch.j2"
    family = "replicated"

    def validate(self, plan) -> None:
        if plan.offload_params != "none":
            from .base import refuse

            refuse("offload_params", plan.offload_params, "DDP replicates the model; offload needs launcher=fsdp "
                   "(cpu) or launcher=deepspeed with zero_stage=3")

    def describe(self, plan) -> str:
        return "DDP" if plan.world_size > 1 else "single process"

    def model_states(self, shape, plan, dt, engine_config=None, runtime=None) -> ModelStates:
        psi = float(shape.n_params)
        opt = optimizers.get(plan.optimizer)
        # DDP's flat buckets: a second copy of the grads
        ddp_buckets = dt.grad * psi if builds_ddp(plan, getattr(runtime, "ddp_single_process", False)) else 0.0
        return ModelStates(
            params_bytes=dt.param * psi, grads_bytes=dt.grad * psi,
            optimizer_bytes=opt.state_bytes(shape.shape_counts, dt.state, dt.gpu),
            paged_optimizer_bytes=opt.paged_bytes(shape.shape_counts, dt.gpu),
            persistent_grads=False, buffer_bytes=ddp_buckets, gathered_bytes=0.0,
            step_temp_bytes=opt.step_temp_bytes(psi, shape.largest_param_numel, dt.state, dt.grad, dt.gpu),
            host_bytes_per_rank=0.0)

    def fabric_kwargs(self, plan) -> dict:
        return {"strategy": "ddp" if plan.world_size > 1 else "auto"}

    # -- the runtime side (inside the job): checkpoints (docs/resume.md) ------------------------------------

    def save_state(self, directory, ranks, model, optimizer) -> str:
        """Rank 0 writes the full model and FQN-keyed optimizer state_dicts to ``state.pt`` (DDP's ranks hold the
        same state); returns the save's format. FSDP and DDP of any world size can read it back."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from ..runtime.checkpoint import FORMAT_FULL, STATE_FILE

        module = getattr(model, "module", model)
        if ranks.is_main:
            torch.save({"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, optimizer)},
                       f"{directory}/{STATE_FILE}")
        return FORMAT_FULL

    def load_state(self, directory, saved, model, optimizer) -> None:
        """Load a full or a torch.distributed.checkpoint save (an FSDP one converts) into the model and optimizer."""
        from ..runtime.checkpoint import load_torch_state

        load_torch_state(directory, saved.format, getattr(model, "module", model), optimizer)

    def state_digest(self, model, optimizer):
        """sha256 of the model and optimizer state (rank 0; None on the others)."""
        from ..runtime.checkpoint import torch_digest

        return torch_digest(getattr(model, "module", model), optimizer)
