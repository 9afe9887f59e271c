"""The planner: candidate plans along the ladder, their predicted memory and speed, the fastest that fits.

Candidates keep what is learned (global batch, sequence length, model, world size) and vary what the
job spec allows: precision the GPU has, attention, micro-batch (accumulation follows), checkpointing,
optimizer (only if allowed), ZeRO stage, FSDP and offload. They are the product of the axes of the ladder's
move table (``ladder.MOVES``, ``ladder.move_grid``): one definition per move, whose ladder step goes only
towards less memory, mildest first, while its planner axis also holds the settings that cost memory and buy
speed (larger micro-batches, lower ZeRO stages; fp32 is listed too), so the fastest that fits can be
chosen. Each is estimated (analytic: instant) and given a
relative throughput from a simple cost model:

    throughput = precision speed-up / (accumulation x checkpointing x optimizer x engine costs)

with the cost factors the ladder uses to scale ``--time`` on a retry (the optimizer table's ``cost``,
``Strategy.cost`` for ZeRO, FSDP and offload) and a
precision speed-up of 2.0 for fp16/bf16 over fp32 on GPUs without TF32 (V100), 1.6 over TF32 on GPUs
with it (A100 and later), 1.0 on a CPU. Flash attention counts 1.1 over SDPA, eager 0.9. These are
starting values for the nightly benchmarks to calibrate. The chosen plan is the fastest one that fits.

Fit is the one predictor's (``predict.Predictor(partition, model=model)``, no failure): the same rule and the
same ``predict.MARGIN`` as the ladder and triage (peak device memory at most (1 - MARGIN) of the usable memory,
and the estimate's own checks: host memory, the allocator replay). The predictor also holds the estimates, so
each plan is estimated once.

Fragmentation-aware fit: a candidate whose tensors fit but whose caching allocator's reserved peak does not
(``Estimate.fragmentation_only``) is reported as such (``fit: fragmentation_only`` and ``alloc_conf_env`` in
``to_dict``), and where the spec allows ``alloc_conf`` the same plan with the estimate's ``alloc_conf_fix``
(e.g. ``expandable_segments:True``, added to its ``alloc_conf``) follows it as a candidate of its own, the
ladder's allocator move, at the same speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from . import ladder, optimizers
from .errors import PlanError
from .estimate import Estimate, ModelRef, attention_refusal, estimate
from .plan import Plan, with_changes
from .predict import MARGIN, Predictor, alloc_conf_value, fit_fields  # noqa: F401 (MARGIN: the one margin, re-exported)
from .sites import Partition

MIXED_SPEEDUP = {"no-tf32": 2.0, "tf32": 1.6, "cpu": 1.0}
ATTENTION_SPEED = {"eager": 0.9, "sdpa": 1.0, "flash": 1.1}


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    estimate: Estimate
    throughput: float
    """Relative samples per second (the first plan = 1.0)."""
    moves: tuple[str, ...]
    """What changed from the first plan."""
    screened: bool = False
    """The estimate is the quick lower bound (no allocator replay): enough to rule the plan out, never to choose it."""
    predicted_fit: bool = False
    """The one predictor's answer (``Predictor.fits``: the margin and the estimate's own checks); False when
    screened."""

    def fits_with_margin(self) -> bool:
        return not self.screened and self.predicted_fit

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {"plan": self.plan.to_dict(), "moves": list(self.moves), "peak_allocated_mib": e.peak_allocated_mib,
                "device_used_mib": e.device_used_mib, "host_mib_per_node": e.host_mib_per_node,
                "capacity_mib": e.capacity_mib, "headroom_mib": e.headroom_mib, "fits": e.fits,
                "fits_with_margin": self.fits_with_margin(), "relative_throughput": round(self.throughput, 4),
                "screened": self.screened, "peak_reserved_mib": e.peak_reserved_mib,
                "fragmentation": e.fragmentation, "fragmentation_only": e.fragmentation_only,
                "alloc_conf_fix": e.alloc_conf_fix, **fit_fields(e, self.plan)}


def speed(plan: Plan, partition: Partition) -> float:
    """Relative samples per second of ``plan`` (arbitrary unit; only ratios mean something)."""
    if not partition.has_gpu or plan.precision == "fp32":
        gain = 1.0
    else:
        gain = MIXED_SPEEDUP["tf32" if partition.tf32 else "no-tf32"]
    cost = ladder.ACCUM_PER_HALVING ** max(0.0, _log2(plan.grad_accum))
    cost *= ladder.CHECKPOINTING_SLOWDOWN if plan.checkpointing else 1.0
    cost *= optimizers.get(plan.optimizer).cost * plan.strategy.cost(plan)
    return gain * ATTENTION_SPEED[plan.attention] / cost


def candidate_plans(base: Plan, partition: Partition, allow: Iterable[str], model: ModelRef | None = None
                    ) -> list[Plan]:
    """Every valid plan reachable from ``base`` with the allowed moves on ``partition`` (base first): the
    product of the moves' axes in the ladder's move table (``ladder.MOVES``, ``ladder.move_grid``). With the
    ``model`` known, a move to an attention its class cannot run is no candidate (``estimate.attention_refusal``;
    the base itself is the estimate's to refuse)."""
    out = [base]
    for changes in ladder.move_grid(base, partition, allow):
        try:
            plan = with_changes(base, changes)
            partition.check_plan(plan)
        except PlanError:
            continue
        if plan != base and not attention_refusal(model, plan):
            out.append(plan)
    return out


MAX_MICRO_BATCHES = ladder.MAX_MICRO_BATCHES
micro_batches = ladder.micro_batches
"""The micro-batch axis (the move table's ``micro_batch`` values), bounded so the planner's time is."""


SHOWN_FITTING = 12
"""Candidates that fit, fastest first, whose estimates are replayed through the allocator model."""


def plan_candidates(model: ModelRef, base: Plan, partition: Partition, allow: Iterable[str],
                    method: str = "analytic", fitting: int = SHOWN_FITTING) -> list[Candidate]:
    """Every candidate with its estimate and relative throughput, fastest first.

    Analytic: every candidate is first screened with the quick lower bound (``allocator_model=False``: no
    caching-allocator replay, about 1 ms); then, fastest first, the base plan and the candidates the screen
    lets through get the full estimate until ``fitting`` of them fit with the margin (the fastest that fits is
    among them). The others keep their screen and are marked ``screened``: a plan whose lower bound does not
    fit does not fit, and a screened plan is never chosen. Traced: every candidate is traced.
    """
    base_speed = speed(base, partition)
    plans = candidate_plans(base, partition, allow, model)
    pred = Predictor(partition, model=model, method=method)
    if method != "analytic":
        cands = [_candidate(pred, p, speed(p, partition) / base_speed, base) for p in plans]
        cands += [f for c in cands for f in [_allocator_move(pred, c, base, allow)] if f]
        return sorted(cands, key=lambda c: (-c.throughput, c.estimate.device_used_mib))
    screened = sorted(((p, estimate(model, p, partition, allocator_model=False), speed(p, partition) / base_speed)
                       for p in plans), key=lambda t: (-t[2], t[1].device_used_mib))
    out, fit = [], 0
    for plan, screen, throughput in screened:
        if plan == base or (fit < fitting and pred.fits(screen.device_used_mib, plan)):
            cand = _candidate(pred, plan, throughput, base)
            fit += cand.fits_with_margin()
            fixed = _allocator_move(pred, cand, base, allow)
            if fixed is not None:
                out.append(cand)
                cand = fixed
                fit += fixed.fits_with_margin()
        else:
            cand = Candidate(plan, screen, throughput, ladder.move_names(base, plan), screened=True)
        out.append(cand)
    return out


def _candidate(pred: Predictor, plan: Plan, throughput: float, base: Plan) -> Candidate:
    """``plan`` with its (full) estimate and the predictor's fit."""
    return Candidate(plan, pred.estimate(plan), throughput, ladder.move_names(base, plan),
                     predicted_fit=bool(pred.fits(plan)))


def _allocator_move(pred: Predictor, cand: Candidate, base: Plan, allow: Iterable[str]) -> Candidate | None:
    """The fragmentation-aware fit: a candidate whose tensors fit but whose reserved peak does not
    (``fragmentation_only``) gets the allocator move (``alloc_conf``, when the spec allows it) with the setting
    the estimate found to make it fit; as fast as the candidate (the allocator setting costs nothing)."""
    fix = cand.estimate.alloc_conf_fix
    if not cand.estimate.fragmentation_only or not fix or "alloc_conf" not in set(allow):
        return None
    try:
        plan = with_changes(cand.plan, {"alloc_conf": alloc_conf_value(cand.plan.alloc_conf, fix)})
        pred.partition.check_plan(plan)
    except PlanError:
        return None
    return _candidate(pred, plan, cand.throughput, base)


def choose(candidates: list[Candidate]) -> Candidate | None:
    """The fastest candidate that fits with the margin (None when none does)."""
    return next((c for c in candidates if c.fits_with_margin()), None)


def _log2(x: float) -> float:
    import math
    return math.log2(x) if x > 0 else 0.0
