"""DDP: torchrun starts one process per GPU, torch's DistributedDataParallel replicates the model.

Every rank holds the whole model, its gradients and its optimizer state; gradients are all-reduced
through DDP's flat buckets (a second copy of the gradients). No sharding, no offload.
"""

from __future__ import annotations

from .. import optimizers
from .base import ModelStates, Strategy, register


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

    def model_states(self, shape, plan, dt) -> ModelStates:
        psi = float(shape.n_params)
        opt = optimizers.get(plan.optimizer)
        ddp_buckets = dt.grad * psi if plan.world_size > 1 else 0.0  # DDP's flat buckets: a second copy of the grads
        return ModelStates(
            params_bytes=dt.param * psi, grads_bytes=dt.grad * psi,
            optimizer_bytes=opt.state_bytes(shape.shape_counts, dt.state),
            persistent_grads=False, buffer_bytes=ddp_buckets, gathered_bytes=0.0,
            step_temp_bytes=opt.step_temp_bytes(psi, shape.largest_param_numel, dt.state, dt.grad, dt.gpu),
            host_bytes_per_rank=0.0)

    def fabric_kwargs(self, plan) -> dict:
        return {"strategy": "ddp" if plan.world_size > 1 else "auto"}
