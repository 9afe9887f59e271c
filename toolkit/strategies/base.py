"""What every training engine answers, and the registry that finds one by name.

A strategy is one engine (DDP, DeepSpeed, FSDP) and everything about it. The rest of hpcmem asks the
plan's strategy (``strategies.of(plan)``) instead of branching on the engine:

- the plan: ``validate`` (engine-specific knob rules), ``own_knobs`` (knobs only it reads), ``describe``;
- rendering: ``template``, ``config_file`` + ``config`` (ds_config.json, fsdp_config.json), ``env_var``
  (where the job finds that file), ``summary`` (plan-summary words);
- training code: ``trainer_flags`` (HF Trainer command line), ``training_args`` (TrainingArguments),
  ``accelerate_kwargs`` (accelerate.Accelerator), ``fabric_kwargs`` (Lightning Fabric);
- memory: ``dtypes`` and ``model_states`` (the estimator), ``placement`` (shares of the model states on the
  device and on the host, for arithmetic on traced categories and the ladder), ``startup_host_bytes``;
- cost: ``cost`` (a step-time factor against plain DDP, for the ladder and the planner).

This package imports nothing of hpcmem but ``errors``, ``optimizers`` and ``modelshape``: a plan, a
partition or a model shape is passed in (duck-typed), so render, runtime, ladder, planner, estimate and
triage all sit above it. Adding an engine is one module here (registered with ``@register``), one template
and their tests (docs/add-an-engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ..errors import PlanError, UnknownNameError

MIXED = ("fp16-mixed", "bf16-mixed")
SIXTEEN_BIT = {"fp16-mixed": "float16", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16"}
"""The 16-bit dtype of each precision that has one (torch dtype names)."""


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a rank holds under a plan's precision and engine."""

    param: int
    """weights as the layers use them, and the residual stream between layers"""
    compute: int
    """matmul inputs and outputs, activation-function tensors"""
    grad: int
    master: int
    """extra fp32 master copy per parameter (0 when the weights are the master)"""
    state: int
    """optimizer state element (torch: the param's dtype; DeepSpeed: fp32)"""
    autocast: bool
    gpu: bool
    mask: int
    """a dropout mask element: a bool on CUDA, a noise tensor of the input's dtype on the CPU"""
    flash_sdpa: bool = True
    """the GPU runs 16-bit SDPA on the flash kernel (Ampere and later: the partition's ``flash_attention``); else
    on the memory-efficient one (V100, T4), whose output layout differs (``activations.output_follows_query``)"""


@dataclass(frozen=True)
class Gathered:
    """Unsharded weights an engine holds gathered at the step's moments (bytes per rank), where it tracks them
    per module (DeepSpeed ZeRO-3's parameter coordinator: ``deepspeed.zero3_gathered``)."""

    forward_end: float
    """the LM head's forward (the forward's last module), where the activations peak"""
    head_backward: float
    last_layer: float
    """the last layer's backward (with its recomputed forward under checkpointing)"""
    first_layer: float
    backward_end: float
    """the embeddings' backward"""


@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of weights, gradients and optimizer, and what offload puts on the host."""

    params_bytes: float
    """resident on the device between steps"""
    grads_bytes: float
    """on the device once all are allocated"""
    optimizer_bytes: float
    """on the device: states and any fp32 master copy"""
    persistent_grads: bool
    """grads stay allocated across steps (DeepSpeed buffers) instead of being set to None"""
    buffer_bytes: float
    """communication buffers that live through the step (DDP buckets, ZeRO reduce buckets, FSDP reduce-scatter)"""
    gathered_bytes: float
    """sharded engines: full weights gathered during forward/backward (ZeRO-3: a layer's; FSDP: the units in
    flight, or all of them when they are not resharded after the forward)"""
    step_temp_bytes: float
    host_bytes_per_rank: float
    """offloaded states (with their buffers) and pinned NVMe buffers"""
    paged_optimizer_bytes: float = 0.0
    """optimizer states in CUDA unified memory (bitsandbytes' paged optimizers: ``Optimizer.paged_state_bytes``),
    not in ``optimizer_bytes``: outside the caching allocator, resident on the device as far as it has room, paged
    out to the host under pressure"""
    reduce_temp_bytes: float = 0.0
    """device bytes alive at once while the largest parameter's gradient is reduced and handed to the host
    (DeepSpeed with optimizer offload, ZeRO-1/2 and ZeRO-3 each by its own path: see ``DeepSpeed.model_states``):
    the most alive at once in ``reduce_order``"""
    reduce_order: tuple[tuple[str, float | None], ...] = ()
    """that hand-over tensor by tensor, in the engine's order, as a recipe (``startup``'s form); everything it
    makes it frees"""
    gathered_moments: Gathered | None = None
    """``gathered_bytes`` moment by moment, where the engine's own schedule says it (None: the same at every moment
    of the forward and backward)"""
    grad_bucket_bytes: float = 0.0
    """communication buffers alive from the first gradient to the backward's end only (DeepSpeed ZeRO-1/2's
    contiguous-gradient buckets, made at the first gradient hook and released in the backward's epilogue)"""
    flush_bucket_elements: float = 0.0
    """DeepSpeed ZeRO-3's reduce-scatter (``reduce_scatter_coalesced``) copies the bucket's gradients into one
    new flat tensor (the 16-bit dtype) each time the bucket is reduced: when the next gradient would overflow
    it, and in the backward's epilogue. The bucket's capacity in elements; 0: no copy"""
    step_flatten_bytes: float = 0.0
    """made at the step's start beside ``step_temp_bytes`` and freed before the optimizer runs (DeepSpeed: the
    group's 16-bit gradients flattened into one tensor, then cast to the fp32 copy that ``step_temp_bytes``
    holds); counted with the optimizer's own transients, which come after it, as a bound"""
    step_check_bytes: float = 0.0
    """a bool mask of the gradient partition, made and freed twice at the step's start on the reduction stream
    (DeepSpeed ZeRO-3 fp16's overflow check: ``isinf`` then ``isnan`` of the flat gradient buffer), before the
    step's own transients (the step phase counts the larger of the two)"""
    grads_end_with_backward: bool = False
    """the device grads are freed at the backward's end, before the step (FSDP1 under CPU offload keeps each unit's
    gradient shard until its final callback hands the optimizer the host copy)"""
    accumulated_grads_bytes: float = 0.0
    """gradients held unsharded across the micro-batches of an accumulation that skip the gradient sync (FSDP's
    ``no_sync``: ``Runtime.fsdp_no_sync``): the whole model's, from the first micro-batch's backward until each
    unit's reduce-scatter in the last micro-batch's backward turns it into its shard (``grads_bytes``)"""
    step_order: tuple[tuple[str, float | None], ...] = ()
    """the step's first transients on the compute stream, as a recipe (``recipe_sizes``), before its own
    (``step_flatten_bytes``, ``step_temp_bytes``): DeepSpeed ZeRO without offload checks (ZeRO-1/2 fp16) and
    norms each gradient slice of the partition in turn, so the largest slice's; all freed by its end"""
    side_streams: bool = False
    """the engine gathers weights and reduces gradients on streams of its own (DeepSpeed ``overlap_comm``):
    the caching allocator serves each stream from its own blocks"""
    deferred_flushes: int = 0
    """DeepSpeed ZeRO-3 with ``overlap_comm``: in the backward each gathered weight (``free_param``) and each
    gradient copied into the bucket (``__add_grad_to_ipg_bucket``) is freed after ``record_stream``, so its block
    returns to its pool only when the GPU has passed the free; the host waits at each bucket flush for the
    reduction this many flushes back (``max_param_reduce_events`` + 1), whose stream waited for the compute
    stream, so a block freed after flush c is back by flush c + 1 + this. 0: frees return at once"""
    deferred_bucket_elements: float = 0.0
    """the bucket those flushes count, in elements (``reduce_bucket_size``)"""
    startup: tuple[tuple[str, float | None], ...] = ()
    """the engine's device allocations at start-up, one by one in its order, where its code says them (DeepSpeed
    ZeRO-3): ``(name, bytes)`` makes a tensor, ``(name, None)`` frees the one made under that name. What is still
    alive at the end stands for ``params_bytes``, ``grads_bytes``, ``buffer_bytes`` and ``optimizer_bytes`` less
    ``lazy_states``. Empty: the allocator stream makes those as flat chunks."""
    lazy_states: tuple[float, ...] = ()
    """optimizer states (bytes, one tensor each, in creation order) that the optimizer makes at its first step
    (``zeros_like`` on the first ``step``) rather than at start-up: part of ``optimizer_bytes``, made in step 1
    while the step's gradient copy is alive, and kept"""
    held_head_bytes: float = 0.0
    """gradient bytes the head holds from its backward to the backward's end in place of its share of
    ``grads_bytes`` (FSDP: the head is in the root unit, which reduce-scatters only in the backward's final
    callback, so the head's unsharded gradient waits there in the compute dtype)"""
    reduce_extra_bytes: float = 0.0
    """made as each unit's backward computation ends, beside ``grad_bucket_bytes`` but after the layer's own
    backward temporaries are gone, and freed before the next unit's (FSDP: the reduce-scatter's input and output
    beyond the unit's unsharded gradients, or FSDP1's flat gradient, the cat of its views' gradients)"""
    head_reduce_bytes: float = 0.0
    """alive at once in the head's backward while the unit that holds the head is reduced, where that unit is
    reduced there (FSDP whose embeddings are units of their own: the root, final norm and head)"""
    end_reduce_bytes: float = 0.0
    """alive at once at the backward's end while the last unit is reduced (FSDP: the root unit's unsharded
    gradients with its reduce-scatter buffers), its gathered weights already freed (FSDP reshards a unit before
    it reduces its gradients); 0: nothing of the kind"""
    end_reduce_share: float = 0.0
    """the part of ``grads_bytes`` that reduction makes (the unit's gradient shard, its output), not there yet"""
    embedding_unit_bytes: float = 0.0
    """gathered bytes of the embeddings where FSDP wraps them as a unit of their own (``Runtime.fsdp_embedding_unit``),
    out of the root's: resharded after their forward, gathered again for their backward; 0: in the root"""


AUTOGRAD_GRADIENT = "gradient"
"""The name a hand-over recipe (``ModelStates.reduce_order``) gives the gradient autograd made: on the compute
stream, where the rest of the hand-over may run on the engine's reduction stream."""


def recipe_sizes(order, given=None) -> tuple[dict[str, float], float]:
    """A recipe of ``(name, bytes)`` (make a tensor) and ``(name, None)`` (free the one made under that name)
    steps, as ``ModelStates.startup`` and ``Activations.loss_forward_order`` write them: (the sizes still alive at
    its end, by name; the most alive at once). ``given``: tensors alive before it starts (name: bytes), which it
    may free."""
    alive: dict[str, float] = dict(given or {})
    peak = sum(alive.values())
    for name, size in order:
        if size is None:
            alive.pop(name)
        else:
            alive[name] = size
            peak = max(peak, sum(alive.values()))
    return alive, peak


@dataclass(frozen=True)
class Placement:
    """Shares of the unsharded model states one rank keeps on its device, and on the host (0..1)."""

    params: float
    grads: float
    optimizer: float
    """optimizer states and any master copy"""
    host_params: float = 0.0
    host_optimizer: float = 0.0
    nvme: bool = False
    """what is offloaded goes to NVMe, not host memory"""
    gathered_layers: float = 0.0
    """layers whose full weights are gathered at once on top of the shards (ZeRO-3: the largest one)"""
    gathered_params: float = 0.0
    """share of the whole model's weights, in the compute dtype, that stays gathered on top of the shards
    from each layer's forward to its backward (FSDP without resharding after the forward: all of it at
    the backward's start); none of it is alive at the optimizer step"""


@dataclass(frozen=True)
class Layout:
    """How the plan's precision stores the model, in torch dtype names (for the traced estimator)."""

    weights: str
    """the model's parameters as built ("float32", "bfloat16", "float16")"""
    autocast: str | None = None
    master_weights: bool = False
    """an fp32 copy of the weights lives in the optimizer"""
    loss_scaling: bool = False
    note: str = ""


class Strategy:
    """One training engine. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    """the plan's ``launcher`` value"""
    title: ClassVar[str]
    template: ClassVar[str]
    """the sbatch template under templates/"""
    family: ClassVar[str] = "data-parallel"
    """replicated (DDP) or sharded (ZeRO, FSDP): the ladder's families"""
    own_knobs: ClassVar[tuple[str, ...]] = ()
    """plan knobs only this engine reads (others must leave them at their defaults)"""
    config_file: ClassVar[str | None] = None
    """the engine's config file in the attempt directory"""
    env_var: ClassVar[str | None] = None
    """the environment variable a job reads that file's path from"""
    sharded: ClassVar[bool] = False
    checkpointing_by_config: ClassVar[bool] = False
    """activation checkpointing is set in the engine's config file rather than by the Trainer's flag"""

    # -- the plan ------------------------------------------------------------------------------

    def validate(self, plan) -> None:
        """Refuse knob combinations this engine cannot run (PlanError naming the knob)."""

    def describe(self, plan) -> str:
        return self.title

    def summary(self, plan) -> list[str]:
        """Words this engine adds to the one-line plan summary."""
        return []

    # -- rendering ---------------------------------------------------------------------------

    def config(self, plan, *, nvme_path: str | None = None, gpu: bool = True,
               largest_param: int | None = None) -> dict[str, Any] | None:
        """The engine's config file content (None when it has none)."""
        return None

    def context(self, plan, partition) -> dict[str, Any]:
        """Extra template values (already computed; the template only lays them out)."""
        return {}

    # -- training code -----------------------------------------------------------------------

    def trainer_flags(self, plan, config_path: str | None) -> list[str]:
        """HF Trainer command-line flags for the engine (beyond batch, precision and optimizer)."""
        return []

    def training_args(self, plan, config_path: str | None) -> dict[str, Any]:
        """``transformers.TrainingArguments`` keyword arguments for the engine."""
        return {}

    def accelerate_kwargs(self, plan, config_path: str | None) -> dict[str, Any]:
        """``accelerate.Accelerator`` keyword arguments for the engine (accumulation included)."""
        return {"gradient_accumulation_steps": plan.grad_accum}

    def fabric_kwargs(self, plan) -> dict[str, Any]:
        """``lightning.Fabric`` keyword arguments (``strategy`` as a name or its arguments)."""
        return {"strategy": "ddp" if plan.world_size > 1 else "auto"}

    # -- memory ------------------------------------------------------------------------------

    def dtypes(self, plan, gpu: bool) -> Dtypes:
        """How a rank stores things: torch autocast keeps fp32 weights (the master) under mixed precision;
        bf16-true keeps everything in bf16."""
        mixed = plan.precision in MIXED
        if plan.precision == "bf16-true":
            return Dtypes(param=2, compute=2, grad=2, master=0, state=2, autocast=False, gpu=gpu, mask=1 if gpu else 2)
        compute = 2 if mixed else 4
        return Dtypes(param=4, compute=compute, grad=4, master=0, state=4, autocast=mixed, gpu=gpu,
                      mask=1 if gpu else compute)

    def layout(self, plan) -> Layout:
        half = SIXTEEN_BIT.get(plan.precision)
        if half is None:
            return Layout("float32")
        if plan.precision == "bf16-true":
            return Layout("bfloat16")
        return Layout("float32", autocast=half, loss_scaling=plan.precision == "fp16-mixed")

    def model_states(self, shape, plan, dt: Dtypes, engine_config: Mapping[str, Any] | None = None,
                     runtime=None) -> ModelStates:
        """What the engine keeps per rank. ``engine_config``: the engine's own settings as the job states them
        (DeepSpeed: its ds_config's ``zero_optimization`` section); None: what hpcmem writes for the plan.
        ``runtime``: the job's other software facts (``estimate.gpu.Runtime``; None: hpcmem's runtime)."""
        raise NotImplementedError

    def placement(self, plan) -> Placement:
        return Placement(1.0, 1.0, 1.0)

    def startup_host_bytes(self, shape, plan) -> float:
        """Host bytes a GPU rank holds while it builds the model, before moving it to its device."""
        return (2.0 if plan.precision == "bf16-true" else 4.0) * shape.n_params

    def cost(self, plan) -> float:
        """Step time against plain DDP of the same plan (>= 1)."""
        return 1.0


_REGISTRY: dict[str, Strategy] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: one instance of ``cls`` is the strategy called ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> Strategy:
    """The strategy called ``name`` (a plan's ``launcher``); an unknown name lists the valid ones."""
    if name not in _REGISTRY:
        raise UnknownNameError("launcher", name, list(_REGISTRY))
    return _REGISTRY[name]


def of(plan) -> Strategy:
    """The plan's strategy."""
    return get(plan.launcher)


def names() -> tuple[str, ...]:
    """Every registered launcher name, in registration order (CLI choices)."""
    return tuple(_REGISTRY)


def all_strategies() -> tuple[Strategy, ...]:
    return tuple(_REGISTRY.values())


def infer_launcher(knobs, default: str = "torchrun") -> str:
    """The engine a set of knob values implies (a job's facts, CLI options): the one whose own knobs are set
    away from their defaults (ZeRO stage, optimizer offload -> deepspeed; FSDP's resharding -> fsdp), else
    the ``launcher`` given, else parameter offload -> deepspeed (the engine that offloads to NVMe too), else
    ``default``. A job script may start any engine with torchrun: the knobs decide, not the launch line."""
    for strategy in _REGISTRY.values():
        for knob in strategy.own_knobs:
            if knob in knobs and knobs[knob] is not None and knobs[knob] != _OWN_DEFAULTS.get(knob):
                return strategy.name
    if knobs.get("launcher"):
        return knobs["launcher"]
    if knobs.get("offload_params") not in (None, "none"):
        return "deepspeed"
    return default


_OWN_DEFAULTS = {"zero_stage": 0, "offload_optimizer": "none", "reshard_after_forward": True, "reduce_dtype": "fp32"}
"""The defaults of the engines' own knobs (toolkit/plan.py's; a test keeps the two equal)."""


def switch_to(launcher: str) -> dict[str, Any]:
    """Knob changes that move a plan to ``launcher``: the launcher, and every other engine's own knobs back
    at their defaults (a ZeRO stage means nothing to FSDP, resharding nothing to DeepSpeed)."""
    get(launcher)
    out: dict[str, Any] = {"launcher": launcher}
    for strategy in _REGISTRY.values():
        if strategy.name != launcher:
            out.update({knob: _OWN_DEFAULTS[knob] for knob in strategy.own_knobs})
    return out


def refuse(knob: str, value: Any, why: str) -> None:
    raise PlanError(f"{knob}={value}: {why}")
