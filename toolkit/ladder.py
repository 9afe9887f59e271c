"""The ladder: the next plan after an attempt ran out of memory, or why there is none.

``next_plan(plan, verdict, partition, allow=..., tried=..., attempts_made=..., max_attempts=..., bigger=...)``
is pure: it reads the failed attempt's plan, its Verdict (``toolkit.classify``) and the partition it ran on, and
returns a ``Decision``: ``retry`` with a new plan (and the partition to run it on), ``give_up`` (an OOM with no
move left, or no attempts left) or ``stop`` (not a memory failure: no memory move is the answer).
Every move keeps what is learned: ``global_batch``, ``seq_len`` and the model never change; precision only
goes to mixed precision (fp32 master weights kept, never bf16-true); the optimizer changes only where the spec
allows ``optimizer`` and then only to 8-bit AdamW or Adafactor.

Rules, in the order they are applied
    1. ``not_oom`` / ``unknown``: stop, no plan (a transient retry is the controller's business).
    2. ``gpu_oom_other_process``: stop: another process holds the GPU; not a memory move.
    3. ``attempts_made >= max_attempts``: give up, listing what was tried.
    4. ``gpu_oom_fragmentation``, or any GPU OOM the predictor calls the allocator's (``Predictor.fragmented``:
       the stated idle reserved memory and the free memory covered the request, or the estimate of the failed
       plan fits its tensors but not its reserved peak): ``alloc_conf`` gains ``expandable_segments:True``
       first (if allowed and not there yet), then, when the prediction says that is not enough, the GPU
       ladder goes on from there. With the setting already there (or not allowed) it is a plain ``gpu_oom``.
    5. ``gpu_oom``, ``gpu_driver_oom``, ``nccl_oom`` (device side): the GPU ladder below. An ``nccl_oom``
       about ``/dev/shm`` is host shared memory: the host ladder.
    6. ``host_oom``, ``cpu_alloc_oom``: the host ladder below.
    A plan in ``tried`` (in attempt order; same knobs apart from ``time_min``, on the same partition) is
    never returned: the ladder skips to the next option or rung. Every plan returned passes
    ``Partition.check_plan``; a rung whose plan does not (a ``PlanError``) is skipped. When nothing is
    left: give up, saying what was tried and why.

GPU ladder (cheapest in lost throughput first; each rung only when its ``allow`` name is given and the
partition can do it; options within a rung go from mild to strong). The rungs are the steps of the move table
``MOVES``, one entry per move that also holds the planner's axis for it (``move_grid``): the ladder and the
planner share the moves.
    precision      fp32 -> bf16-mixed where ``partition.bf16``, else fp16-mixed (loss scaling)
    attention      eager -> flash where ``partition.flash_attention`` and not fp32, else sdpa
    micro_batch    down to a divisor of ``global_batch / world_size``, ``grad_accum`` up (``with_changes``)
    checkpointing  activation checkpointing on
    optimizer      adamw -> adamw-8bit -> adafactor (not while the optimizer is offloaded)
    zero, fsdp     sharding, in two families (toolkit/strategies/): DeepSpeed ZeRO stage up, 0 -> 1 -> 2 -> 3
                   (``zero``), and FSDP2, first keeping each block's weights from forward to backward, then
                   resharding after the forward (``fsdp``); from plain DDP both, cheapest first; once sharded
                   a plan stays in its family (its checkpoints' layout follows the engine)
    offload        optimizer state to CPU (ZeRO >= 1; from ZeRO 0 to 2 when ``zero`` is allowed),
                   then parameters to CPU (ZeRO 3, raised to it when ``zero`` is allowed); under FSDP its CPU
                   offload (parameters, gradients and optimizer state together)
    nvme           what is still on the GPU to ``partition.nvme_path`` (ZeRO-Infinity, ZeRO 3)
    gpus           more GPUs per node, up to the partition's, global batch kept (``grad_accum`` follows)
    partition      the first of ``bigger`` with more GPU memory (plan adapted: fp16 where no bf16, sdpa
                   where no flash, GPUs per node within the partition's)
    A rung the memory model says saves nothing is never taken (e.g. ZeRO or more GPUs on one GPU with
    plain data parallelism, NVMe offload of what is already on the CPU).

Using the numbers (GPU ladder)
    When the verdict states ``tried_to_allocate_mib`` and how much was in use (``process_in_use_mib``,
    or ``total_capacity_mib - free_mib``, or what PyTorch had allocated and reserved), the ladder predicts
    each plan's peak with the one predictor (below) and climbs, in one decision, as many rungs as the prediction
    needs to come under ``(capacity - other processes) * (1 - MARGIN)``: at each rung the mildest option that
    fits is taken; otherwise its strongest option is kept and the next rung is added on top. A later rung may
    make an earlier one unnecessary: of the fitting plan and its variants without the checkpointing or
    optimizer move, each with the largest micro-batch that fits, the one with the least ``slowdown`` wins
    (then the fewest moves). When nothing fits on this partition, the ``bigger`` partitions are tried from
    the original plan; when nothing fits anywhere, the strongest plan allowed is tried (the model is rough)
    and the next failure gives up. A driver or NCCL OOM states no numbers but reached the card's memory, and a
    host OOM on a CPU partition reached ``--mem`` (``limit_numbers``): those limits stand in for the numbers.
    Without numbers otherwise (a message cut short, most host failures), one rung per failure: the mildest
    option of the first rung that applies.

The memory model is the one predictor, ``toolkit/predict.py`` (``Predictor``; its docstring has the rules):
    the failed plan's footprint from the numbers, scaled to each plan by its knobs over the assumed range of
    activation shares, or, when ``next_plan`` is given the ``model``, the estimate of each plan scaled by
    max(1, stated demand / the failed plan's estimate); expandable segments give the idle reserved memory
    back. ``MARGIN`` is the predictor's, the one margin of the ladder, the planner and triage.

Host ladder (reverse pressure; host memory per node, ``mem_mib`` being Slurm's ``--mem``)
    nvme           offload on ``cpu`` -> ``nvme`` where the partition has ``nvme_path`` (ZeRO 3)
    mem            more ``--mem``: double it, or to what the failed request needs (``(limit + tried) x
                   (1 + MARGIN)``), capped at ``host_mem_gib x (1 - HOST_RESERVE_SHARE)``; an unknown
                   default goes to the cap. When the cap is short of what the message asks, the next
                   host rung is added in the same decision.
    workers        fewer data-loader workers (halved)
    micro_batch    on a CPU partition (activations live in host memory): micro-batch halved
    checkpointing  on a CPU partition
    zero           on a CPU partition with several ranks: ZeRO stage up (model states partitioned)
    offload        on a GPU partition: less CPU offload (parameters back first, then optimizer state)
    partition      the first of ``bigger`` with more host memory

Time
    Every retry scales ``time_min`` by the slowdown of its moves (``slowdown``): accumulation
    ``ACCUM_PER_HALVING`` per halving of the micro-batch, checkpointing ``CHECKPOINTING_SLOWDOWN``, the
    optimizer's ``cost`` in the optimizer table and the engine's ``Strategy.cost`` (ZeRO stage, FSDP
    resharding, offload; taken as ratios), ``WORKERS_PER_HALVING``; precision, attention,
    the allocator, ``--mem``, more GPUs and a partition change cost nothing. The time never shrinks and
    is capped at the partition's ``max_time_min``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

from . import optimizers, peaks, strategies
from .classify import Verdict
from .errors import PlanError, UnknownNameError
from .estimate import attention_refusal
from .failures import is_host, text_of
from .plan import Plan, with_changes
from .predict import EXPANDABLE, MARGIN, Footprint, Predictor, footprint
from .sites import Partition

ALLOW_NAMES = ("alloc_conf", "precision", "attention", "micro_batch", "checkpointing", "optimizer", "zero",
               "fsdp", "offload", "nvme", "gpus", "partition", "mem", "workers")
"""The moves a job spec may allow (``retry.allow``)."""

LIMIT_KINDS = ("gpu_driver_oom", "nccl_oom")
"""GPU-side failures that never state numbers (outside the caching allocator): the card's memory is the limit."""

HOST_RESERVE_SHARE = 0.05
"""Share of a node's memory never asked for with --mem (the OS, Slurm, page cache)."""

# --- slowdown factors (see slowdown())
ACCUM_PER_HALVING = 1.05
CHECKPOINTING_SLOWDOWN = 1.33
WORKERS_PER_HALVING = 1.10

TriedItem = Union[Plan, "tuple[Plan, Partition | str]"]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt."""

    action: str
    """``retry`` (run ``plan`` on ``partition``), ``give_up`` (an OOM with no move left) or ``stop`` (not a
    memory failure)."""
    plan: Plan | None
    """The next plan (None unless retrying)."""
    partition: Partition
    """The partition to run it on (the same one unless a ``partition:`` move was made)."""
    moves: tuple[str, ...] = ()
    """Short names of the moves from the failed plan, e.g. ``("precision:fp16-mixed", "micro_batch:32->8")``."""
    reason: str = ""
    """One sentence for a person: why this move, or why not."""
    predicted_peak_mib: float | None = None
    """The memory model's predicted GPU peak of ``plan`` (MiB), when the verdict stated numbers."""

    def to_dict(self) -> dict:
        """JSON-ready: action, plan (knobs or None), site, partition (name), moves, reason, predicted_peak_mib."""
        return {
            "action": self.action,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "site": self.partition.site,
            "partition": self.partition.name,
            "moves": list(self.moves),
            "reason": self.reason,
            "predicted_peak_mib": None if self.predicted_peak_mib is None else round(self.predicted_peak_mib, 1),
        }


# --------------------------------------------------------------------------- time


def slowdown(before: Plan, after: Plan) -> float:
    """Expected wall-time factor of running ``after`` instead of ``before`` (>= 1; see the docstring)."""
    factor = 1.0
    if after.grad_accum > before.grad_accum:
        factor *= ACCUM_PER_HALVING ** math.log2(after.grad_accum / before.grad_accum)
    if after.checkpointing and not before.checkpointing:
        factor *= CHECKPOINTING_SLOWDOWN
    factor *= optimizers.get(after.optimizer).cost / optimizers.get(before.optimizer).cost
    factor *= after.strategy.cost(after) / before.strategy.cost(before)
    if after.workers < before.workers:
        factor *= WORKERS_PER_HALVING ** math.log2(before.workers / (after.workers or 0.5))  # 1 -> 0: one halving
    return max(factor, 1.0)


def scale_time(before: Plan, after: Plan, partition: Partition) -> Plan:
    """``after`` with ``time_min`` = before's x slowdown, rounded up, at most the partition's limit."""
    minutes = math.ceil(before.time_min * slowdown(before, after) - 1e-9)
    return after.replace(time_min=max(1, min(minutes, partition.max_time_min)))


# --------------------------------------------------------------------------- context


@dataclass(frozen=True)
class _Ctx:
    """What every rung and check needs: where, what is allowed, what was tried, how memory is predicted."""

    home: Partition
    """The partition the failed plan ran on."""
    partition: Partition
    """The partition being planned for (``home`` unless trying a bigger one)."""
    allow: frozenset
    tried: frozenset
    numbers: dict
    kind: str
    pred: Predictor
    """The one predictor (toolkit/predict.py) for this failure: numbers-driven once ``_with_numbers`` found a
    footprint, else it only says whether a move saves anything at all."""
    target_mib: float | None = None
    model: Any = None
    """What is trained (``estimate.ModelRef``), when known: the predictor scales its estimate by the numbers."""
    anchor: Plan | None = None
    """The run's first plan, where the activation share is assumed."""

    @property
    def fp(self) -> Footprint | None:
        return self.pred.fp

    def allows(self, name: str) -> bool:
        return name in self.allow

    def on(self, partition: Partition) -> "_Ctx":
        """The same decision, planned for another partition (its whole GPU is the target)."""
        target = None if self.fp is None else partition.gpu_mem_gib * 1024 * (1 - MARGIN)
        return replace(self, partition=partition, target_mib=target)

    def was_tried(self, plan: Plan) -> bool:
        return (_knobs(plan), self.partition.name) in self.tried

    def make(self, plan: Plan, **changes) -> Plan | None:
        """``plan`` with ``changes`` (batch invariant re-derived), or None when it is invalid here or the model
        cannot run it (``estimate.attention_refusal``: Gemma 2 has no SDPA path)."""
        try:
            new = with_changes(plan, changes)
            self.partition.check_plan(new)
        except PlanError:
            return None
        if (new.global_batch, new.seq_len) != (plan.global_batch, plan.seq_len) or attention_refusal(self.model, new):
            return None
        return new

    def peak(self, plan: Plan) -> float | None:
        """Predicted peak GPU memory of ``plan`` (MiB), when the numbers say enough."""
        return self.pred.peak(plan) if self.fp is not None else None

    def saves(self, before: Plan, after: Plan) -> bool:
        return self.pred.saves(before, after)

    def fits(self, plan: Plan) -> bool:
        """The predictor's fit (``Predictor.fits``: the margin, and with the model known the estimate's own checks,
        host memory included) on the failed plan's partition; on another (``on``), its peak against that one's."""
        if self.fp is None:
            return False
        if self.partition == self.pred.partition and self.target_mib == self.pred.target_mib:
            return bool(self.pred.fits(plan))
        return self.peak(plan) <= self.target_mib


def _knobs(plan: Plan) -> tuple:
    """A plan's identity for "already tried": every knob but the time limit."""
    return tuple(sorted((k, v) for k, v in plan.to_dict().items() if k != "time_min"))


def _tried_set(tried: Iterable[TriedItem], partition: Partition) -> frozenset:
    out = set()
    for item in tried:
        plan, where = item if isinstance(item, tuple) else (item, partition)
        out.add((_knobs(plan), where if isinstance(where, str) else where.name))
    return frozenset(out)


# --------------------------------------------------------------------------- GPU rungs
# Each rung: (plan, ctx) -> candidate plans, mildest first; [] when not allowed or not possible here.


def _alloc_conf(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("alloc_conf") or EXPANDABLE in plan.alloc_conf:
        return []
    conf = f"{plan.alloc_conf},{EXPANDABLE}" if plan.alloc_conf else EXPANDABLE
    return _valid([ctx.make(plan, alloc_conf=conf)])


def _precision(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("precision") or plan.precision != "fp32":
        return []
    return _valid([ctx.make(plan, precision="bf16-mixed" if ctx.partition.bf16 else "fp16-mixed")])


def _attention(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("attention") or plan.attention != "eager":
        return []
    flash = ctx.partition.flash_attention and plan.precision != "fp32"  # flash kernels are 16-bit only
    return _valid([ctx.make(plan, attention="flash" if flash else "sdpa")])


def _micro_batch(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("micro_batch"):
        return []
    per_rank = plan.global_batch // plan.world_size
    return _valid([ctx.make(plan, micro_batch=d) for d in _divisors(per_rank, below=plan.micro_batch)])


def _checkpointing(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("checkpointing") or plan.checkpointing:
        return []
    return _valid([ctx.make(plan, checkpointing=True)])


def _optimizer(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("optimizer") or plan.offload_optimizer != "none":
        return []
    family = optimizers.get(plan.optimizer).family
    leaner = {"adamw": ("adamw-8bit", "adafactor"), "adamw-8bit": ("adafactor",)}.get(family, ())
    return _valid([ctx.make(plan, optimizer=o) for o in leaner])


def _shard(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """Sharding, in two families: DeepSpeed ZeRO stages above the current one (``zero``) and FSDP, kept after
    the forward then resharded (``fsdp``); a plan stays in its family once sharded (a checkpoint's layout
    follows the engine), and from plain DDP both are offered, cheapest (``Strategy.cost``) first."""
    out = []
    if ctx.allows("zero") and plan.launcher in ("torchrun", "deepspeed"):
        out += [ctx.make(plan, **strategies.switch_to("deepspeed"), zero_stage=s) for s in range(plan.zero_stage + 1, 4)]
    if ctx.allows("fsdp") and plan.launcher in ("torchrun", "fsdp"):
        options = (False, True) if plan.launcher == "torchrun" else (True,) if not plan.reshard_after_forward else ()
        out += [ctx.make(plan, **strategies.switch_to("fsdp"), reshard_after_forward=r) for r in options]
    return sorted(_valid(out), key=lambda p: p.strategy.cost(p))


def _offload(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """Optimizer state to the CPU (ZeRO-Offload, ZeRO 2 from 0), then parameters (ZeRO 3); under FSDP its
    CPU offload (parameters, gradients and optimizer state together)."""
    if not ctx.allows("offload"):
        return []
    if plan.launcher == "fsdp" or (plan.launcher == "torchrun" and ctx.allows("fsdp") and not ctx.allows("zero")):
        if plan.offload_params != "none":
            return []
        return _valid([ctx.make(plan, **strategies.switch_to("fsdp"), offload_params="cpu")])
    return _offload_to(plan, ctx, "cpu", optimizer_stage=2 if plan.zero_stage == 0 else plan.zero_stage)


def _nvme(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """What is still on the GPU to NVMe (ZeRO-Infinity, ZeRO 3)."""
    if not ctx.allows("nvme") or not ctx.partition.nvme_path:
        return []
    return _offload_to(plan, ctx, "nvme", optimizer_stage=3)


def _offload_to(plan: Plan, ctx: _Ctx, where: str, optimizer_stage: int) -> list[Plan]:
    out, state = [], plan
    if state.offload_optimizer == "none":
        state = _with_zero(state, ctx, optimizer_stage, offload_optimizer=where)
        out.append(state)
    if state is not None and state.offload_params == "none":
        out.append(_with_zero(state, ctx, 3, offload_params=where))
    return _valid(out)


def _more_gpus(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """More ranks per node, global batch kept (helps only where ZeRO partitions the model states)."""
    return more_gpus(plan, ctx.partition) if ctx.allows("gpus") else []


def more_gpus(plan: Plan, partition: Partition) -> list[Plan]:
    """``plan`` on each larger rank count per node ``partition`` has (GPUs, CPUs on a CPU partition), global batch
    kept (``_shape``), fewest first; the ladder's ``gpus`` step and triage's wider starting points."""
    most = partition.gpus_per_node if partition.has_gpu else partition.cpus_per_node
    out = []
    for gpus in range(plan.gpus_per_node + 1, most + 1):
        shape = _shape(plan, gpus)
        if shape is None:
            continue
        try:
            new = with_changes(plan, shape)
            partition.check_plan(new)
        except PlanError:
            continue
        if (new.global_batch, new.seq_len) == (plan.global_batch, plan.seq_len):
            out.append(new)
    return out


# --------------------------------------------------------------------------- the move table
# One definition per memory move, shared by the ladder (``step``: from a failed plan, mildest first) and the
# planner (``values``: the settings of the move's knobs it enumerates from a base plan, their product being its
# candidates). Adding a move is one entry here.


@dataclass(frozen=True)
class Move:
    """One memory move: its name, the ladder's step and the planner's axis."""

    name: str
    """The move (an ``ALLOW_NAMES`` name; ``shard`` stands for ``zero`` and ``fsdp``)."""
    step: Callable[[Plan, "_Ctx"], list]
    """The ladder's step from a plan: the plans it offers, mildest first ([] when not allowed or not possible)."""
    values: Callable[[Plan, Partition, frozenset], list] | None = None
    """The planner's axis: every setting of the move's knobs it enumerates from ``base`` on the partition with
    the allowed moves (``base``'s own included), as knob changes. None: not an axis of its own (offload and
    NVMe are enumerated with sharding, the engine's axis; the allocator setting is added per candidate by the
    planner when the allocator model asks for it; more GPUs change the world size the planner keeps)."""


def _precision_values(base: Plan, partition: Partition, allow: frozenset) -> list[dict]:
    out = {base.precision}
    if "precision" in allow and partition.has_gpu:
        out |= {"bf16-mixed" if partition.bf16 else "fp16-mixed", "fp32"}
    return [{"precision": p} for p in sorted(out)]


def _attention_values(base: Plan, partition: Partition, allow: frozenset) -> list[dict]:
    out = {base.attention}
    if "attention" in allow:
        out |= {"sdpa"} | ({"flash"} if partition.flash_attention else set())
    return [{"attention": a} for a in sorted(out)]


def _micro_batch_values(base: Plan, partition: Partition, allow: frozenset) -> list[dict]:
    per_rank = base.global_batch // base.world_size
    micros = micro_batches(per_rank, base.micro_batch) if "micro_batch" in allow else [base.micro_batch]
    return [{"micro_batch": m} for m in micros]


def _checkpointing_values(base: Plan, partition: Partition, allow: frozenset) -> list[dict]:
    out = {base.checkpointing, True} if "checkpointing" in allow else {base.checkpointing}
    return [{"checkpointing": c} for c in sorted(out)]


def _optimizer_values(base: Plan, partition: Partition, allow: frozenset) -> list[dict]:
    out = {base.optimizer} | ({"adamw-8bit", "adafactor"} if "optimizer" in allow else set())
    return [{"optimizer": o} for o in sorted(out)]


def _engine_values(base: Plan, partition: Partition, allow: frozenset) -> list[dict]:
    return engine_options(base, allow, nvme=bool(partition.nvme_path))


MOVES = (
    Move("alloc_conf", _alloc_conf),
    Move("precision", _precision, _precision_values),
    Move("attention", _attention, _attention_values),
    Move("micro_batch", _micro_batch, _micro_batch_values),
    Move("checkpointing", _checkpointing, _checkpointing_values),
    Move("optimizer", _optimizer, _optimizer_values),
    Move("shard", _shard, _engine_values),
    Move("offload", _offload),
    Move("nvme", _nvme),
    Move("gpus", _more_gpus),
)
"""The memory moves, cheapest in lost throughput first: the GPU ladder's order (the allocator move leads only
when the failure is the allocator's; the partition move comes after them all)."""

GPU_RUNGS = tuple(m.step for m in MOVES if m.name != "alloc_conf")
"""The GPU ladder, cheapest in lost throughput first (the partition rung comes after them)."""


def move_grid(base: Plan, partition: Partition, allow: Iterable[str]) -> Iterator[dict]:
    """The planner's candidates as knob changes from ``base``: the product of every move's ``values`` (in the
    table's order), each a dict of changes (invalid combinations are the caller's to drop)."""
    allow = frozenset(allow)
    axes = [m.values(base, partition, allow) for m in MOVES if m.values is not None]
    for combo in itertools.product(*axes):
        changes: dict = {}
        for part in combo:
            changes.update(part)
        yield changes


MAX_MICRO_BATCHES = 32
"""Most micro-batch sizes tried per plan family: the candidates are a product, so this bounds the planner's time
whatever the global batch (2**30 has 31 divisors, 963761198400 has 6720)."""


def micro_batches(per_rank: int, base_micro: int, most: int = MAX_MICRO_BATCHES) -> list[int]:
    """Micro-batch sizes the planner tries, ascending: every divisor of ``per_rank`` when there are at most
    ``most``; else ``base_micro`` and, for each power of two up to ``per_rank``, the largest divisor not above it
    (log-spaced, so every scale is tried), thinned evenly to ``most``."""
    every = divisors(per_rank) if per_rank >= 1 else [1]
    if len(every) <= most:
        return every
    chosen, k = [], 0
    for d in every:
        while 2 ** (k + 1) <= d:
            k += 1
        if chosen and chosen[-1][0] == k:
            chosen[-1] = (k, d)  # the largest divisor within [2**k, 2**(k+1))
        else:
            chosen.append((k, d))
    picks = sorted({d for _k, d in chosen})
    if len(picks) > most - 1:
        step = (len(picks) - 1) / (most - 2)
        picks = sorted({picks[round(i * step)] for i in range(most - 1)})
    return sorted(set(picks) | ({base_micro} if per_rank % base_micro == 0 else set()))


def _with_zero(plan: Plan | None, ctx: _Ctx, stage: int, **changes) -> Plan | None:
    """``changes`` that need ZeRO ``stage`` at least: raised to it only where ``zero`` is allowed."""
    if plan is None:
        return None
    if plan.zero_stage < stage:
        if not ctx.allows("zero"):
            return None
        changes.update(zero_stage=stage, **strategies.switch_to("deepspeed"))
    return ctx.make(plan, **changes)


def _shape(plan: Plan, gpus: int) -> dict | None:
    """Changes for ``gpus`` per node with the global batch kept: the largest micro-batch up to the current
    one that divides the per-rank batch (grad_accum follows); None when the batch does not divide."""
    world = plan.nodes * gpus
    if plan.global_batch % world:
        return None
    micro = max(_divisors(plan.global_batch // world, below=plan.micro_batch + 1), default=None)
    return None if micro is None else {"gpus_per_node": gpus, "micro_batch": micro}


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` >= 1, ascending, from its prime factorisation (trial division up to sqrt(n), so a
    global batch of 10**11 read from an untrusted plan.json takes microseconds, not minutes)."""
    factors: dict[int, int] = {}
    m, p = int(n), 2
    while p * p <= m:
        while m % p == 0:
            factors[p] = factors.get(p, 0) + 1
            m //= p
        p += 1 if p == 2 else 2
    if m > 1:
        factors[m] = factors.get(m, 0) + 1
    out = [1]
    for prime, power in factors.items():
        out = [d * prime ** k for d in out for k in range(power + 1)]
    return sorted(out)


def _divisors(n: int, below: int) -> list[int]:
    """Divisors of ``n`` smaller than ``below``, largest first."""
    return [d for d in reversed(divisors(n)) if d < below]


def engine_options(plan: Plan, allow: Iterable[str], nvme: bool) -> list[dict]:
    """Every engine set-up the moves ``allow`` can reach from ``plan`` (``plan``'s own first), as knob changes:
    ZeRO stages and their CPU/NVMe offloads (``zero``, ``offload``, ``nvme``; NVMe only where the partition has
    ``nvme``), FSDP with and without resharding and its CPU offload (``fsdp``, ``offload``). The same families,
    in the same words, as the ladder's shard, offload and nvme rungs; the planner enumerates these."""
    allow = set(allow)
    own = {k: getattr(plan, k) for k in ("launcher", "zero_stage", "offload_optimizer", "offload_params",
                                         "reshard_after_forward", "reduce_dtype")}
    out = [own]
    offloads = [("none", "none")] + ([("cpu", "none"), ("cpu", "cpu")] if "offload" in allow else []) + (
        [("nvme", "none"), ("nvme", "nvme"), ("cpu", "nvme")] if "nvme" in allow and nvme else [])
    if "zero" in allow and plan.launcher in ("torchrun", "deepspeed"):
        out += [{**strategies.switch_to("deepspeed"), "zero_stage": z, "offload_optimizer": o, "offload_params": p}
                for z in range(1, 4) for o, p in offloads]
    if "fsdp" in allow and plan.launcher in ("torchrun", "fsdp"):
        cpu = ("none", "cpu") if "offload" in allow else ("none",)
        out += [{**strategies.switch_to("fsdp"), "reshard_after_forward": r, "offload_params": p,
                 "offload_optimizer": "none"} for r in (False, True) for p in cpu]
    return out


def _valid(plans: Iterable[Plan | None]) -> list[Plan]:
    return [p for p in plans if p is not None]


# --------------------------------------------------------------------------- host rungs


def _host_nvme(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """Offload on the CPU moves to NVMe (ZeRO 3)."""
    on_cpu = {k: "nvme" for k in ("offload_optimizer", "offload_params") if getattr(plan, k) == "cpu"}
    if not ctx.allows("nvme") or not ctx.partition.nvme_path or not on_cpu:
        return []
    return _valid([_with_zero(plan, ctx, 3, **on_cpu)])


def _more_mem(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """More --mem: doubled, or what the failed request needs, within the node."""
    if not ctx.allows("mem"):
        return []
    cap, current = _mem_cap(ctx.partition), _mem_now(plan, ctx.partition)
    wanted = cap if current is None else max(2 * current, _mem_needed(current, ctx) or 0)
    new = min(int(math.ceil(wanted)), cap)
    if current is not None and new <= current:
        return []
    return _valid([ctx.make(plan, mem_mib=new)])


def _fewer_workers(plan: Plan, ctx: _Ctx) -> list[Plan]:
    if not ctx.allows("workers") or plan.workers == 0:
        return []
    return _valid([ctx.make(plan, workers=plan.workers // 2)])


def _on_cpu_partition(rung):
    """A GPU rung that, on a CPU partition, also lowers host memory (activations and states live there):
    its mildest option that saves anything."""
    def host_rung(plan: Plan, ctx: _Ctx) -> list[Plan]:
        if ctx.partition.has_gpu:
            return []
        return [p for p in rung(plan, ctx) if ctx.saves(plan, p)][:1]
    host_rung.__name__ = f"_cpu{rung.__name__}"
    return host_rung


def _less_cpu_offload(plan: Plan, ctx: _Ctx) -> list[Plan]:
    """On a GPU partition: parameters back from the CPU first, then the optimizer state."""
    if not ctx.allows("offload") or not ctx.partition.has_gpu:
        return []
    if plan.offload_params == "cpu":
        return _valid([ctx.make(plan, offload_params="none")])
    if plan.offload_optimizer == "cpu":
        return _valid([ctx.make(plan, offload_optimizer="none")])
    return []


HOST_RUNGS = (_host_nvme, _more_mem, _fewer_workers, _on_cpu_partition(_micro_batch),
              _on_cpu_partition(_checkpointing), _on_cpu_partition(_shard), _less_cpu_offload)
"""The host ladder (reverse pressure), in order (the partition rung comes after them)."""


def _mem_cap(partition: Partition) -> int:
    return int(partition.host_mem_gib * 1024 * (1 - HOST_RESERVE_SHARE))


def _mem_now(plan: Plan, partition: Partition) -> int | None:
    return plan.mem_mib or partition.default_mem_mib


def _mem_needed(current: int, ctx: _Ctx) -> float | None:
    """--mem (MiB) the failed request says is needed, when the message states it."""
    tried = ctx.numbers.get("tried_to_allocate_mib")
    return None if tried is None else (current + tried) * (1 + MARGIN)


# --------------------------------------------------------------------------- the decision


def next_plan(
    plan: Plan,
    verdict: Verdict,
    partition: Partition,
    *,
    allow: Sequence[str],
    tried: Iterable[TriedItem] = (),
    attempts_made: int = 1,
    max_attempts: int = 6,
    bigger: Sequence[Partition] = (),
    model: Any = None,
) -> Decision:
    """Decide what follows a failed attempt (the rules are in the module docstring).

    ``plan`` failed on ``partition`` with ``verdict``. ``allow``: the move names the job spec allows
    (``ALLOW_NAMES``). ``tried``: plans already run (a bare Plan means on ``partition``; a ``(plan,
    partition or its name)`` pair says where); ``plan`` itself always counts as tried. ``attempts_made`` of
    ``max_attempts`` are used up. ``bigger``: partitions the job may move to, in order of preference (needs
    ``partition`` allowed). ``model``: what is trained (``estimate.ModelRef``), when the estimator covers it:
    the predictor (toolkit/predict.py) then scales its estimate by the stated numbers instead of scaling the
    numbers alone by the knobs.
    """
    unknown = sorted(set(allow) - set(ALLOW_NAMES))
    if unknown:
        raise UnknownNameError("retry move", unknown[0], ALLOW_NAMES)
    tried = list(tried)
    if not verdict.is_oom:
        what = "the failure was not identified" if verdict.kind == "unknown" else "this is not a memory failure"
        return Decision("stop", None, partition, reason=f"No memory move: {what} ({verdict.kind}){_said(verdict)}.")
    if verdict.kind == "gpu_oom_other_process":
        return Decision("stop", None, partition,
                        reason=f"Another process holds the GPU; not a memory move{_said(verdict)}.")
    if attempts_made >= max_attempts:
        return _give_up(plan, partition, tried, f"{attempts_made} of {max_attempts} allowed attempts are used up")
    first = (tried[0] if isinstance(tried[0], Plan) else tried[0][0]) if tried else plan
    host = is_host(verdict)
    numbers = dict(verdict.numbers)
    if footprint(plan, numbers, partition.cuda_context_mib) is None and (host or verdict.kind in LIMIT_KINDS):
        numbers = {**(limit_numbers(plan, partition, host) or {}), **numbers}
    ctx = _Ctx(partition, partition, frozenset(allow), _tried_set([plan, *tried], partition),
               numbers, verdict.kind, Predictor(partition), model=model, anchor=first)
    if host and not partition.has_gpu and not ctx.allows("mem"):
        jumped = _cpu_host_jump(plan, ctx)
        if jumped is not None:
            return jumped
    if host:
        return _host_decision(plan, ctx, bigger, tried)
    return _gpu_decision(plan, ctx, bigger, tried)


def limit_numbers(plan: Plan, partition: Partition, host: bool) -> dict | None:
    """What an OOM that states no numbers still tells: the job reached its limit. Host memory on a CPU partition
    (where activations and states live): ``--mem`` (the plan's, else the partition's default) shared by the
    node's ranks; the device's memory for a GPU-side failure (driver, NCCL): the card's. As verdict numbers
    (MiB per rank): in use = the limit, nothing free, nothing more asked. None when no limit is known (a host
    failure on a GPU partition is about offload buffers, which these numbers do not describe)."""
    if host and not partition.has_gpu:
        limit = _mem_now(plan, partition)
        per_rank = None if limit is None else limit / plan.gpus_per_node
    elif not host and partition.has_gpu:
        per_rank = partition.gpu_mem_gib * 1024
    else:
        per_rank = None
    if not per_rank:
        return None
    return {"tried_to_allocate_mib": 0.0, "total_capacity_mib": float(per_rank), "free_mib": 0.0}


def _cpu_host_jump(plan: Plan, ctx: _Ctx) -> Decision | None:
    """A host OOM on a CPU partition with ``mem`` not allowed: climb the moves that shrink a rank's memory there
    (micro-batch, checkpointing, sharding) until one is predicted to fit under ``--mem``, in one decision; None
    when nothing is predicted to fit (the host ladder then takes one rung)."""
    ctx = _with_numbers(plan, ctx)
    if ctx.fp is None:
        return None
    reached, fits = _climb(plan, (_micro_batch, _checkpointing, _shard), ctx)
    if not fits:
        return None
    return _retry(plan, reached, ctx, f"{_gap_text(ctx)} (no numbers stated: --mem is the limit it reached)")


def _said(verdict: Verdict) -> str:
    return f": {verdict.reason.rstrip('.')}" if verdict.reason else ""


# --------------------------------------------------------------------------- GPU ladder


def _gpu_decision(plan: Plan, ctx: _Ctx, bigger: Sequence[Partition], tried: list) -> Decision:
    ctx = _with_numbers(plan, ctx)
    rungs = GPU_RUNGS
    if _alloc_conf(plan, ctx) and (ctx.kind == "gpu_oom_fragmentation" or _fragmented(plan, ctx)):
        rungs = (_alloc_conf, *GPU_RUNGS)
    if ctx.fp is None:
        return _one_rung(plan, ctx, rungs, bigger, tried)
    reached, fits = _climb(plan, rungs, ctx)
    if fits:
        return _retry(plan, reached, ctx, _gap_text(ctx))
    for big in _bigger(ctx, bigger, gpu=True):
        big_ctx = ctx.on(big)
        start = _adapt(plan, big_ctx)
        if start is None:
            continue
        if big_ctx.fits(start) and not big_ctx.was_tried(start):
            return _retry(plan, start, big_ctx, _gap_text(ctx))
        got, fits = _climb(start, rungs, big_ctx)
        if fits:
            return _retry(plan, got, big_ctx, _gap_text(ctx))
    if reached != plan and not ctx.was_tried(reached):
        short = _mib(ctx.peak(reached) - ctx.target_mib)
        return _retry(plan, reached, ctx, f"{_gap_text(ctx)}; no allowed plan is predicted to fit (the strongest "
                                          f"is {short} short), so the strongest is tried")
    return _give_up(plan, ctx.partition, tried, f"{_gap_text(ctx)}, and {_left_out(ctx)}")


def _with_numbers(plan: Plan, ctx: _Ctx) -> _Ctx:
    """``ctx`` with the one predictor for this failure and its target peak, when the verdict's numbers say
    enough (a footprint of the failed plan); else unchanged (one rung per failure). The model is used on a GPU
    partition only (the estimate's figure is device memory; on a CPU partition the numbers alone scale)."""
    model = ctx.model if ctx.partition.has_gpu else None
    pred = Predictor(ctx.partition, plan, ctx.numbers, model, ctx.anchor)
    if pred.fp is None:
        return ctx
    return replace(ctx, pred=pred, target_mib=pred.target_mib)


def _fragmented(plan: Plan, ctx: _Ctx) -> bool:
    """The failure is the allocator's (``Predictor.fragmented``): the stated idle reserved memory could have
    served the request, or the estimate of the failed plan fits its tensors but not its reserved peak."""
    model = ctx.model if ctx.partition.has_gpu else None
    pred = ctx.pred if ctx.fp is not None else Predictor(ctx.partition, plan, ctx.numbers, model, ctx.anchor)
    return pred.fragmented()


def _climb(start: Plan, rungs, ctx: _Ctx) -> tuple[Plan, bool]:
    """Add rungs in order until a plan is predicted to fit: (the plan reached, whether it fits).

    At each rung the mildest option that fits and was not tried wins; otherwise the rung's strongest
    option is kept and the next rung goes on top of it.
    """
    state = start
    for rung in rungs:
        options = [o for o in rung(state, ctx) if ctx.saves(state, o)]
        for option in options:
            if ctx.fits(option) and not ctx.was_tried(option):
                return _cheapest_variant(option, start, ctx), True
        if options:
            state = options[-1]
    return state, False


def _cheapest_variant(plan: Plan, start: Plan, ctx: _Ctx) -> Plan:
    """Among ``plan`` and its variants that still fit, the one with the least slowdown.

    A later rung may have made an earlier one unnecessary: variants drop checkpointing and the optimizer
    change again where they were added, each with the largest micro-batch (up to the failed plan's) that fits.
    """
    per_rank = plan.global_batch // plan.world_size
    variants = [plan]
    for checkpointing in dict.fromkeys((plan.checkpointing, start.checkpointing)):
        for optimizer in dict.fromkeys((plan.optimizer, start.optimizer)):
            base = ctx.make(plan, checkpointing=checkpointing, optimizer=optimizer)
            for micro in _divisors(per_rank, below=start.micro_batch + 1) if base is not None else ():
                candidate = ctx.make(base, micro_batch=micro)
                if candidate is not None and ctx.fits(candidate) and not ctx.was_tried(candidate):
                    variants.append(candidate)
                    break
    return min(variants, key=lambda v: (round(slowdown(start, v), 6), len(move_names(start, v)), -v.micro_batch))


def _one_rung(plan: Plan, ctx: _Ctx, rungs, bigger: Sequence[Partition], tried: list) -> Decision:
    """Without numbers: the mildest untried option of the first rung that has one, else a bigger partition."""
    for rung in rungs:
        for option in rung(plan, ctx):
            if ctx.saves(plan, option) and not ctx.was_tried(option):
                return _retry(plan, option, ctx, f"{_kind_text(ctx)}, no numbers stated: the cheapest move left")
    return _to_bigger(plan, ctx, bigger, tried, gpu=True)


def _to_bigger(plan: Plan, ctx: _Ctx, bigger: Sequence[Partition], tried: list, gpu: bool) -> Decision:
    """The plan as it is on the first bigger partition that can run it, else give up."""
    for big in _bigger(ctx, bigger, gpu=gpu):
        big_ctx = ctx.on(big)
        moved = _adapt(plan, big_ctx)
        if moved is not None and not big_ctx.was_tried(moved):
            return _retry(plan, moved, big_ctx, f"{_kind_text(ctx)}: no move is left on {ctx.home.name}")
    return _give_up(plan, ctx.home, tried, f"{_kind_text(ctx)}, and {_left_out(ctx)}")


# --------------------------------------------------------------------------- host ladder


def _host_decision(plan: Plan, ctx: _Ctx, bigger: Sequence[Partition], tried: list) -> Decision:
    """One host rung (two when more --mem cannot reach what the message asks for)."""
    for i, rung in enumerate(HOST_RUNGS):
        for option in rung(plan, ctx):
            if ctx.was_tried(option):
                continue
            why = f"{_kind_text(ctx)}: the cheapest host-memory move left"
            if rung is _more_mem and _mem_short(plan, option, ctx):
                option = _also_next(option, HOST_RUNGS[i + 1:], ctx)
                why = f"{_kind_text(ctx)}: the node's --mem limit is short of the failed request, so one more move"
            return _retry(plan, option, ctx, why)
    return _to_bigger(plan, ctx, bigger, tried, gpu=False)


def _mem_short(plan: Plan, option: Plan, ctx: _Ctx) -> bool:
    current = _mem_now(plan, ctx.partition)
    needed = _mem_needed(current, ctx) if current is not None else None
    return needed is not None and option.mem_mib < needed


def _also_next(plan: Plan, rungs, ctx: _Ctx) -> Plan:
    for rung in rungs:
        for option in rung(plan, ctx):
            if not ctx.was_tried(option):
                return option
    return plan


# --------------------------------------------------------------------------- partitions


def _bigger(ctx: _Ctx, bigger: Sequence[Partition], gpu: bool) -> list[Partition]:
    """The partitions of ``bigger`` with more GPU (or host) memory than home, when ``partition`` is allowed."""
    if not ctx.allows("partition"):
        return []
    if gpu:
        return [p for p in bigger if p.has_gpu and p.gpu_mem_gib > ctx.home.gpu_mem_gib]
    return [p for p in bigger if p.host_mem_gib > ctx.home.host_mem_gib]


def _adapt(plan: Plan, ctx: _Ctx) -> Plan | None:
    """``plan`` made runnable on ``ctx.partition``: fp16 without bf16, sdpa without flash, its GPUs per node,
    --mem and time within its limits; None when the global batch cannot be kept there."""
    part = ctx.partition
    changes = {"time_min": min(plan.time_min, part.max_time_min)}
    if plan.precision.startswith("bf16") and not part.bf16:
        changes["precision"] = "fp16-mixed"
    if plan.attention == "flash" and not part.flash_attention:
        # sdpa, or eager for a model with no SDPA path (Gemma 2)
        changes["attention"] = "eager" if attention_refusal(ctx.model, plan.replace(attention="sdpa")) else "sdpa"
    most = part.gpus_per_node if part.has_gpu else part.cpus_per_node
    if plan.gpus_per_node > most:
        shape = _shape(plan, most)
        if shape is None:
            return None
        changes.update(shape)
    if plan.mem_mib is not None and plan.mem_mib > part.host_mem_gib * 1024:
        changes["mem_mib"] = _mem_cap(part)
    return ctx.make(plan, **changes)


# --------------------------------------------------------------------------- results and words


def _retry(before: Plan, after: Plan, ctx: _Ctx, why: str) -> Decision:
    final = scale_time(before, after, ctx.partition)
    ctx.partition.check_plan(final)  # each rung was checked; the time is capped: this cannot fail
    moves = move_names(before, final)
    if ctx.partition.name != ctx.home.name or ctx.partition.site != ctx.home.site:
        moves += (f"partition:{ctx.partition.name}",)
    peak = ctx.peak(final) if ctx.fp is not None else None
    predicted = f", predicted peak {_mib(peak)}" if peak is not None else ""
    return Decision("retry", final, ctx.partition, moves, f"{why}: {', '.join(moves)}{predicted}.", peak)


def _give_up(plan: Plan, partition: Partition, tried: list, why: str) -> Decision:
    """Give up, saying why and what was tried: the first plan, the moves made since, the partitions used."""
    runs = [(item, partition) if isinstance(item, Plan) else item for item in (*tried, (plan, partition))]
    first, last = runs[0][0], plan
    places = list(dict.fromkeys(p if isinstance(p, str) else p.name for _, p in runs))
    count = len({(_knobs(p), w if isinstance(w, str) else w.name) for p, w in runs})
    since = move_names(first, last)
    what = f"; moves made since: {', '.join(since)}" if since else ""
    return Decision("give_up", None, partition, reason=f"Giving up: {why}; tried {count} plan(s) on "
                                                       f"{', '.join(places)}, starting from {describe(first)}{what}.")


def move_names(before: Plan, after: Plan) -> tuple[str, ...]:
    """Short names of what changed from ``before`` to ``after`` (grad_accum, launcher and time follow)."""
    b, a = before, after
    out = []
    if a.alloc_conf != b.alloc_conf:
        out.append(f"alloc_conf:{a.alloc_conf or 'default'}")
    out += [f"{k}:{getattr(a, k)}" for k in ("precision", "attention") if getattr(a, k) != getattr(b, k)]
    if a.micro_batch != b.micro_batch:
        out.append(f"micro_batch:{b.micro_batch}->{a.micro_batch}")
    if a.checkpointing != b.checkpointing:
        out.append("checkpointing" if a.checkpointing else "no-checkpointing")
    if a.optimizer != b.optimizer:
        out.append(f"optimizer:{a.optimizer}")
    if a.launcher != b.launcher and "fsdp" in (a.launcher, b.launcher):
        out.append(f"launcher:{b.launcher}->{a.launcher}")
    if a.zero_stage != b.zero_stage:
        out.append(f"zero:{b.zero_stage}->{a.zero_stage}")
    if a.reshard_after_forward != b.reshard_after_forward:
        out.append("reshard_after_forward" if a.reshard_after_forward else "no-reshard_after_forward")
    out += [f"{k}:{getattr(a, k)}" for k in ("offload_optimizer", "offload_params") if getattr(a, k) != getattr(b, k)]
    out += [f"{k}:{getattr(b, k)}->{getattr(a, k)}" for k in ("nodes", "gpus_per_node", "workers")
            if getattr(a, k) != getattr(b, k)]
    if a.mem_mib != b.mem_mib:
        out.append(f"mem_mib:{b.mem_mib or 'default'}->{a.mem_mib or 'default'}")
    return tuple(out)


def describe(plan: Plan) -> str:
    """A plan in a few words, for reasons and status lines."""
    parts = [plan.precision, f"micro {plan.micro_batch}x{plan.grad_accum} on {plan.world_size}", plan.attention,
             plan.optimizer]
    if plan.checkpointing:
        parts.append("checkpointing")
    if plan.strategy.sharded:
        parts.append(plan.strategy.describe(plan))
    elif plan.zero_stage:
        parts.append(f"ZeRO {plan.zero_stage}")
    if plan.mem_mib:
        parts.append(f"--mem {plan.mem_mib}M")
    if plan.workers:
        parts.append(f"{plan.workers} workers")
    if EXPANDABLE in plan.alloc_conf:
        parts.append("expandable segments")
    return "(" + ", ".join(parts) + ")"




def _kind_text(ctx: _Ctx) -> str:
    return text_of(ctx.kind)


def _gap_text(ctx: _Ctx) -> str:
    fp = ctx.fp
    return (f"{_kind_text(ctx)} needing about {_mib(fp.demand_mib)} against a target of {_mib(ctx.target_mib)} "
            f"({MARGIN:.0%} margin), {_mib(fp.demand_mib - ctx.target_mib)} to save")


def _left_out(ctx: _Ctx) -> str:
    off = [name for name in ALLOW_NAMES if name not in ctx.allow]
    return "no memory move is left (every allowed one is used up or impossible here" + (
        f"; not allowed: {', '.join(off)})" if off else ")")


def _mib(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB" if abs(mib) >= 1024 else f"{mib:.0f} MiB"


# --------------------------------------------------------------------------- data-driven peaks


def size_for_long_batch(decision: Decision, diag: peaks.PeakDiagnosis | None, seq_len: int,
                        mem_cap_mib: float | None = None) -> Decision:
    """The ladder's decision for a plan sized by ``peaks.plan_for_ladder``: the data's usual ``seq_len`` given back
    to the next plan (what is learned never changes: the data keeps its lengths), a ``sized-for-seq-len:L`` move and the
    long batch named in the reason. When the ladder's move is more ``--mem`` and the series measured host memory,
    ``--mem`` is raised to what the long batch needs (``long_batch_host_mib`` plus the predictor's margin, at most
    ``mem_cap_mib``) instead of a blind doubling. Any other decision is returned as it is."""
    if diag is None or diag.case != peaks.LONG_BATCH:
        return decision
    length = int(diag.numbers["seq_len"])
    plan = decision.plan.replace(seq_len=seq_len) if decision.plan is not None else None
    moves = decision.moves
    sized = ""
    need = peaks.long_batch_host_mib(diag, plan.gpus_per_node) if plan is not None else None
    mem_move = [m for m in moves if m.startswith("mem_mib:")]
    if need is not None and mem_move and plan.mem_mib is not None:
        wanted = math.ceil(round(need * (1 + MARGIN), 3))  # 5920 x 1.1 is 6512, not 6512.000001
        if mem_cap_mib is not None:
            wanted = min(wanted, int(mem_cap_mib))
        if wanted > plan.mem_mib:
            before = mem_move[0].split(":", 1)[1].split("->")[0]
            moves = tuple(f"mem_mib:{before}->{wanted}" if m == mem_move[0] else m for m in moves)
            decision = replace(decision, reason=decision.reason.replace(mem_move[0], moves[0]))
            sized = (f" --mem {wanted} MiB: the usual steps' peak {diag.numbers['usual_peak_mib']:.0f} MiB x "
                     f"{length}/{diag.numbers['longest_done']} tokens (+{MARGIN:.0%})")
            plan = plan.replace(mem_mib=wanted)
    if decision.action == "retry":
        moves = (f"sized-for-seq-len:{length}", *moves)
    return replace(decision, plan=plan, moves=moves,
                               reason=f"A long batch: {diag.reason}: sized for it{sized}. {decision.reason}")
