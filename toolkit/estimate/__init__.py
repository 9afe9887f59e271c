"""Memory estimates of one training step, per GPU and per node, before submission.

Two methods behind one interface (``estimate``):

- ``analytic`` (estimate/analytic.py): arithmetic from the model's shape, instant;
- ``traced`` (estimate/traced.py): one real training step of the actual model under
  PyTorch's fake tensors on the CPU, counting live tensor bytes without allocating them.

Both return an ``Estimate``: numbers in MiB, per GPU unless the name says per node.
The CLI formats them; nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

COMPONENTS = ("params", "grads", "optimizer", "activations", "temporaries", "cuda_context", "allocator_overhead")
"""Component names, in this order, in every Estimate (MiB per GPU)."""
METHODS = ("analytic", "traced")


@dataclass(frozen=True)
class Estimate:
    """A training step's memory (MiB) for one plan on one partition.

    The first fields keep their meaning for every caller (ladder, planner, triage, bench, cli).
    The allocator model (estimate/allocator.py) adds what the GPU sees on top of the tensors:
    the caching allocator's reserved peak, its fragmentation, and whether the plan fails only
    because of it (then ``alloc_conf_fix`` names the ``PYTORCH_CUDA_ALLOC_CONF`` setting that
    makes it fit). On a CPU partition there is no allocator: reserved = allocated.
    """

    method: str
    components: Mapping[str, float]
    """MiB per GPU by COMPONENTS name; ``allocator_overhead`` is peak reserved - peak allocated."""
    peak_allocated_mib: float
    """Peak of live tensors, as ``torch.cuda.max_memory_allocated`` reports it."""
    device_used_mib: float
    """What nvidia-smi shows at peak: CUDA context + memory reserved by the caching allocator
    (+ ``gpu_extras_mib``: device memory outside the allocator, e.g. NCCL's buffers). A paged optimizer's
    states are not in it: the driver pages them out when the device needs the room, so a fit never needs them;
    nvidia-smi shows their resident part on top (the estimate's notes say how much)."""
    host_mib_per_node: float
    """Host memory per node the step needs beyond the processes themselves: offloaded states, pinned buffers, a
    paged optimizer's states that the device has no room for."""
    capacity_mib: float
    """The partition's GPU memory (host memory on a CPU partition)."""
    headroom_mib: float
    """capacity - device_used (negative: does not fit)."""
    fits: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Assumptions and warnings worth telling a person (e.g. 'partition not calibrated')."""
    peak_reserved_mib: float | None = None
    """``torch.cuda.max_memory_reserved``: the caching allocator's segments at their peak, from
    replaying the step's alloc/free stream (steps 1 and 2) through the allocator model under the
    plan's ``alloc_conf`` (when it does not fit: what it would reserve with room). None: not modelled."""
    fragmentation: float = 0.0
    """Reserved-but-unallocated / reserved at the reserved peak (0..1)."""
    segments: int = 0
    """The allocator's segments (cudaMalloc calls) alive at the reserved peak."""
    gpu_extras_mib: Mapping[str, float] = field(default_factory=dict)
    """Device memory outside the caching allocator, by name (counted in device_used)."""
    fits_allocated: bool | None = None
    """The tensors alone fit (peak allocated within what the allocator may take); None: not modelled."""
    fragmentation_only: bool = False
    """The tensors fit but the allocator's reserved peak does not: the plan fails by fragmentation."""
    alloc_conf_fix: str | None = None
    """With ``fragmentation_only``: a PYTORCH_CUDA_ALLOC_CONF setting (added to the plan's ``alloc_conf``)
    under which the replay fits, e.g. ``expandable_segments:True``."""
    fix_device_used_mib: float | None = None
    """device_used with ``alloc_conf_fix`` applied."""
    oom: Mapping[str, Any] | None = None
    """When the replay runs out of memory: PyTorch's figures (MiB): request, allocated, reserved, free."""

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "components": dict(self.components),
                "peak_allocated_mib": self.peak_allocated_mib, "device_used_mib": self.device_used_mib,
                "host_mib_per_node": self.host_mib_per_node, "capacity_mib": self.capacity_mib,
                "fits": self.fits, "headroom_mib": self.headroom_mib, "notes": list(self.notes),
                "peak_reserved_mib": self.peak_reserved_mib, "fragmentation": self.fragmentation,
                "segments": self.segments, "gpu_extras_mib": dict(self.gpu_extras_mib),
                "fits_allocated": self.fits_allocated, "fragmentation_only": self.fragmentation_only,
                "alloc_conf_fix": self.alloc_conf_fix, "fix_device_used_mib": self.fix_device_used_mib,
                "oom": dict(self.oom) if self.oom else None}


@dataclass(frozen=True)
class ModelRef:
    """What is trained, for estimation: a transformers config dict, the task and its labels."""

    config: Mapping[str, Any]
    task: str = "causal-lm"
    num_labels: int | None = None
    name: str = ""


def model_ref(name_or_path: str, task: str = "causal-lm", num_labels: int | None = None) -> ModelRef:
    """Resolve a model (a name in jobs/models, a config.json or its directory, or a HF id in the local cache)."""
    from ..models import load_model_config

    return ModelRef(load_model_config(name_or_path), task, num_labels, name_or_path)


def spec_model(spec) -> ModelRef:
    """The model a job spec trains (its ``model:`` section), for estimation."""
    from ..errors import ConfigError
    from ..jobspec import fill_placeholders

    model = dict(spec.model)
    if not model.get("config"):
        raise ConfigError(f"{spec.path}: model.config: the spec names no model to estimate (add model: {{config: ...}} "
                          "or give --model)")
    name = fill_placeholders(model["config"], {"spec_dir": str(spec.spec_dir)}, spec.path)
    return model_ref(name, model.get("task", "causal-lm"), model.get("num_labels"))


def attention_refusal(model: ModelRef | None, plan) -> str | None:
    """Why the model's transformers class cannot run ``plan.attention`` (its job would fail as it builds the
    model); None when it can, or when the analytic shapes do not know the model (the job's build says then)."""
    from ..errors import ConfigError
    from ..modelshape import ModelShape

    if model is None or plan.attention != "sdpa":
        return None
    try:
        shape = ModelShape.from_config(model.config, task=model.task, num_labels=model.num_labels)
    except ConfigError:
        return None
    if shape.sdpa:
        return None
    return (f"model_type {shape.model_type!r} has no SDPA path in transformers (its attention soft-caps the scores, "
            "which SDPA cannot): set attention to eager or flash")


def estimate(model: ModelRef, plan, partition, method: str = "analytic", *, runtime=None,
             allocator_model: bool = True) -> Estimate:
    """The memory of one training step of ``model`` under ``plan`` on ``partition`` (MiB).

    ``runtime`` (``estimate.gpu.Runtime``) describes software that differs from hpcmem's own
    runtime where it changes memory (an older torch that keeps gradients between steps, a loss
    on 16-bit logits, ...): for estimating published runs. None: hpcmem's runtime.
    ``allocator_model=False`` (analytic) skips the caching-allocator replay: reserved is taken as
    the allocated peak, a lower bound of device_used (a plan that does not fit so does not fit at
    all), about 1 ms instead of 10-30 ms: for screening many plans before replaying the best.
    """
    from ..errors import ConfigError

    refusal = attention_refusal(model, plan)
    if refusal:
        raise ConfigError(refusal)
    overhead = partition.allocator_overhead_frac
    if method == "analytic":
        from ..modelshape import ModelShape
        from .analytic import estimate_analytic

        shape = ModelShape.from_config(model.config, task=model.task, num_labels=model.num_labels)
        return estimate_analytic(shape, plan, partition, allocator_overhead_frac=overhead, runtime=runtime,
                                 allocator_model=allocator_model)
    if method == "traced":
        try:
            from .traced import estimate_traced  # imports torch: only when asked for
        except ModuleNotFoundError as exc:  # a login node's core install (no hpcmem[job])
            if (exc.name or "").partition(".")[0] == "toolkit":
                raise  # hpcmem's own module: a bug, not an install
            raise ConfigError(f"the traced method needs {exc.name or 'torch'}, which is not installed here: use "
                              f"--method analytic, or pip install 'hpcmem[job]'") from exc

        kwargs = {} if overhead is None else {"allocator_overhead_frac": overhead}
        if runtime is not None:
            kwargs["runtime"] = runtime
        return estimate_traced(dict(model.config), model.task, plan, partition, **kwargs)
    raise ConfigError(f"unknown estimation method {method!r}; valid: {', '.join(METHODS)}")
