"""The one memory predictor: the peak device memory of a plan for this run, the same rules for every caller.

The ladder (``ladder.next_plan``), triage's remedies (``triage.remedies``) and the controller (through the ladder)
ask one question: "how much GPU memory does plan P need per GPU, given (maybe) the model, the plan that failed and
the numbers its OOM message stated?". ``Predictor`` answers it; the planner asks the same without a failure
(``Predictor(partition, model=...)``: the estimate as it is). One margin for every decision: ``MARGIN``.

Rules (MiB per GPU, as nvidia-smi shows it)
    model known     the estimate of P (``estimate.estimate``: analytic, with the caching-allocator replay, so
                    its ``device_used_mib`` is context + the allocator's reserved peak), scaled by
                    ``max(1, stated demand / estimate of the failed plan)``: an estimate that was too low is
                    corrected by what the message proved, one that is higher (the step had not reached its peak
                    when it failed) is kept. Without a failed plan or without numbers: the estimate as it is,
                    except that a failed plan with no numbers (driver, NCCL OOM) needed at least the usable memory.
    numbers only    the failed plan's ``footprint`` (below) scaled to P by the knobs (``predicted_peak_mib``), the
                    larger prediction over ``ACTIVATION_SHARES`` (the message does not say how the tensors split).
                    Knows nothing of other models or sequence lengths (None then).
    neither         None; ``saves`` still says whether a move saves anything at all, on a nominal footprint.
    idle give-back  memory reserved but unallocated when the failed plan died (``footprint``'s ``idle``) is given
                    back by a plan that newly sets ``expandable_segments:True``: left out of the demand it is
                    scaled from (model known) or of the footprint (numbers only).
    fits            peak <= ``target_mib`` = usable x (1 - ``MARGIN``), usable = the message's capacity (else the
                    partition's) less other processes; after a failure also below the failed plan's stated demand
                    (a plan predicted to need what failed is not predicted to fit).

Fragmentation (the allocator model, docs/estimator.md "Fragmentation-aware fit")
    ``Prediction`` carries the estimate's reserved peak, its fragmentation share and, when the tensors fit but
    the reserved peak does not (``fragmentation_only``), the ``PYTORCH_CUDA_ALLOC_CONF`` value that makes it fit
    (``alloc_conf_fix``, added to the plan's own setting: ``alloc_conf_value``). ``Predictor.fragmented()`` says
    whether the failure is the allocator's: the message's idle reserved memory could have served the request
    together with the free memory (classify.py's fragmentation rule), or, when the message states no idle
    reserved memory, the estimate of the failed plan is ``fragmentation_only``. The ladder then offers the allocator move first, and triage gives it first.

The numbers-only memory model (``footprint``, ``predicted_peak_mib``; sizes per GPU in MiB)
    demand  = memory in use + the failed request (a lower bound: the step may have needed more after it).
    fixed   = non-PyTorch memory (CUDA context, cuBLAS, NCCL): ``in use - allocated - reserved-unallocated``
              when stated, else ``total - free - reserved in total``, else the partition's ``cuda_context_mib``.
              Unchanged by every move.
    idle    = reserved but unallocated (``reserved in total - already allocated`` in the old wording);
              unchanged, except that ``expandable_segments:True`` gives it back.
    tensors = demand - fixed - idle, split into activations and model states. Nothing in an OOM message
              says how the tensors split, so the split is a range: for the run's first plan (the ``anchor``,
              else the failed plan) taken without checkpointing, ZeRO and offload, with AdamW, activations are
              ``ACTIVATION_SHARES`` (30 % to 70 %) of the tensors; the split of the failed plan follows from the
              scalings below. A plan is predicted to fit only if it fits at both ends of the range (the peak is
              linear in the share). Simulated against jobs that follow these scalings and fail at their peak,
              the first retry fits for a true share from 25 % to 95 %; with 5-20 % activations the second
              (rarely the third) does.
    activations scale with ``micro_batch`` x precision (fp32 1, 16-bit 0.5) x attention (eager keeps the
              ``5·a·s/h`` term of Korthikanti et al. next to the 34 it shares with sdpa/flash, with the head
              size ``h/a = HEAD_DIM``) x checkpointing (keeps ``CHECKPOINT_KEEPS`` of them).
    model states scale with bytes per parameter on the GPU: weights (4 fp32 / 2 mixed) + gradients (4 / 2)
              + fp32 master weights (4 in mixed precision) + optimizer state (the optimizer table's), each times
              the share the engine keeps on the GPU (``Strategy.placement``: ZeRO stages, FSDP shards, offload).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from . import optimizers, strategies
from .plan import Plan, with_changes

MARGIN = 0.10
"""A plan fits when its predicted peak is at most (1 - MARGIN) of the usable GPU memory: the one margin of the ladder,
the planner and triage. (The estimator's own ``Estimate.fits`` keeps its small safety margin, estimate/analytic.py.)"""
ACTIVATION_SHARES = (0.3, 0.7)
"""The range assumed for the share of PyTorch's memory that is activations (for the run's first plan without
checkpointing, ZeRO, offload): a plan is predicted to fit only if it fits for every share in it."""
HEAD_DIM = 64
"""Attention head size h/a assumed when weighing the eager attention matrix (5·a·s/h = 5·s/HEAD_DIM)."""
CHECKPOINT_KEEPS = 0.25
"""Share of the activations activation checkpointing keeps (layer inputs, one recomputed layer, logits)."""
EXPANDABLE = "expandable_segments:True"
"""The allocator setting that gives idle reserved memory back (PYTORCH_CUDA_ALLOC_CONF)."""


# --------------------------------------------------------------------------- the numbers-only model


@dataclass(frozen=True)
class Footprint:
    """A failed plan's GPU memory at the failure, in MiB per GPU, split the way moves change it."""

    plan: Plan
    fixed_mib: float
    """Non-PyTorch memory (CUDA context, cuBLAS, NCCL); no move changes it."""
    idle_mib: float
    """Reserved but unallocated by PyTorch's caching allocator."""
    states_mib: float
    """Model states: weights, gradients, master weights, optimizer state."""
    activations_mib: float
    """Activations (and the temporaries that scale with them)."""
    usable_mib: float | None
    """GPU memory this process could have had (capacity minus other processes), when stated."""

    @property
    def demand_mib(self) -> float:
        return self.fixed_mib + self.idle_mib + self.states_mib + self.activations_mib


def activation_units(plan: Plan) -> float:
    """Activation memory per GPU in arbitrary units (only ratios between plans mean anything)."""
    precision = 1.0 if plan.precision == "fp32" else 0.5
    attention = 34.0 + (5.0 * plan.seq_len / HEAD_DIM if plan.attention == "eager" else 0.0)
    keep = CHECKPOINT_KEEPS if plan.checkpointing else 1.0
    return plan.micro_batch * precision * attention * keep


def state_bytes_per_param(plan: Plan) -> float:
    """Model-state bytes per parameter held on one GPU (REFERENCE "Memory arithmetic"): 16-bit weights and
    grads plus an fp32 master under mixed precision, the optimizer table's state bytes, each times the share
    the plan's engine keeps on the device (``Strategy.placement``: ZeRO stages, FSDP shards, offload)."""
    fp32 = plan.precision == "fp32"
    weights, grads = (4.0, 4.0) if fp32 else (2.0, 2.0)
    master = 4.0 if plan.precision in ("fp16-mixed", "bf16-mixed") else 0.0
    optimizer = optimizers.get(plan.optimizer).state_bytes_per_param(plan.precision)
    place = plan.strategy.placement(plan)
    return (weights * (place.params + place.gathered_params) + grads * place.grads
            + (master + optimizer) * place.optimizer)


def _activation_share(plan: Plan, anchor: Plan | None = None, share: float = 0.5) -> float:
    """The share of tensor memory that is activations for ``plan`` when it is ``share`` for ``anchor``
    (default: ``plan``) without checkpointing, ZeRO, offload, with AdamW (scaled to ``plan`` by the model)."""
    ref = with_changes(anchor or plan, {**strategies.switch_to("torchrun"), "offload_optimizer": "none",
                                        "offload_params": "none", "checkpointing": False, "optimizer": "adamw"})
    act = share * activation_units(plan) / activation_units(ref)
    states = (1.0 - share) * state_bytes_per_param(plan) / state_bytes_per_param(ref)
    return act / (act + states)


def idle_reserved_mib(numbers: Mapping[str, float]) -> float | None:
    """Reserved but unallocated MiB a message states (>= 2.1), or reserved in total - already allocated
    (1.4-2.0); None when it states neither."""
    if numbers.get("reserved_unallocated_mib") is not None:
        return float(numbers["reserved_unallocated_mib"])
    if numbers.get("reserved_total_mib") is not None and numbers.get("already_allocated_mib") is not None:
        return float(numbers["reserved_total_mib"]) - float(numbers["already_allocated_mib"])
    return None


def idle_could_serve(numbers: Mapping[str, float]) -> bool:
    """The message's idle reserved memory, with the free memory, covered the failed request: the allocator's
    fragmentation failed it, not the tensors (classify.py's fragmentation rule, read on the numbers alone)."""
    tried, idle = numbers.get("tried_to_allocate_mib"), idle_reserved_mib(numbers)
    return tried is not None and idle is not None and idle > 0 and idle + float(numbers.get("free_mib") or 0) >= tried


def footprint(plan: Plan, numbers: Mapping[str, float], context_mib: float = 0.0,
              anchor: Plan | None = None, share: float = 0.5) -> Footprint | None:
    """Split the failed plan's memory from a verdict's numbers (MiB); None when they do not say enough.

    Needs ``tried_to_allocate_mib`` and the memory in use: ``process_in_use_mib``, or
    ``total_capacity_mib`` and ``free_mib``, or ``allocated_by_pytorch_mib``, or ``reserved_total_mib``.
    ``context_mib`` stands in for the non-PyTorch memory when the numbers do not show it. ``anchor``:
    the plan whose activation share is ``share`` (the run's first plan; default ``plan``).
    """
    n = {k: float(v) for k, v in numbers.items() if v is not None}
    tried = n.get("tried_to_allocate_mib")
    total = n.get("total_capacity_mib")
    other = n.get("other_process_mib", 0.0)
    idle = max(idle_reserved_mib(n) or 0.0, 0.0)
    if tried is None:
        return None
    if "process_in_use_mib" in n:
        in_use = n["process_in_use_mib"]
    elif total is not None and "free_mib" in n:
        in_use = total - n["free_mib"] - other
    elif "allocated_by_pytorch_mib" in n:
        in_use = n["allocated_by_pytorch_mib"] + idle + context_mib
    elif "reserved_total_mib" in n:
        in_use = n["reserved_total_mib"] + context_mib
    else:
        return None
    if "process_in_use_mib" in n and "allocated_by_pytorch_mib" in n:
        fixed = n["process_in_use_mib"] - n["allocated_by_pytorch_mib"] - idle
    elif total is not None and "free_mib" in n and "reserved_total_mib" in n:
        fixed = total - n["free_mib"] - other - n["reserved_total_mib"]
    else:
        fixed = context_mib
    fixed = min(max(fixed, 0.0), in_use)
    idle = min(idle, in_use - fixed)
    tensors = max(in_use + tried - fixed - idle, 1.0)
    share = _activation_share(plan, anchor, share)
    return Footprint(plan, fixed, idle, tensors * (1.0 - share), tensors * share, usable_device_mib(n, fixed))


def usable_device_mib(numbers: Mapping[str, float], fixed_mib: float = 0.0,
                      card_mib: float | None = None) -> float | None:
    """The device memory this process could have had (MiB, as a plan's predicted peak counts it: non-PyTorch
    memory included): the card's capacity less other processes, and under a memory-fraction cap the message states
    (``classify.binding_cap_mib``) at most the cap plus ``fixed_mib`` (the cap bounds what the allocator reserves;
    the CUDA context and libraries are outside it). ``card_mib``: the card's capacity where the message states
    none (the partition's); None when nothing says."""
    from .classify import binding_cap_mib

    total, cap = numbers.get("total_capacity_mib", card_mib), binding_cap_mib(numbers)
    card = None if total is None else float(total) - float(numbers.get("other_process_mib") or 0.0)
    if cap is None:
        return card
    return float(cap) + fixed_mib if card is None else min(float(cap) + fixed_mib, card)


def newly_expandable(before: Plan, after: Plan) -> bool:
    """``after`` sets expandable segments where ``before`` did not (its idle reserved memory is given back)."""
    return EXPANDABLE in after.alloc_conf and EXPANDABLE not in before.alloc_conf


def predicted_peak_mib(fp: Footprint, new_plan: Plan) -> float:
    """The peak ``new_plan`` is predicted to need on one GPU (MiB), scaled from the failed plan's footprint."""
    old = fp.plan
    idle = 0.0 if newly_expandable(old, new_plan) else fp.idle_mib
    states = fp.states_mib * _ratio(state_bytes_per_param(new_plan), state_bytes_per_param(old))
    acts = fp.activations_mib * _ratio(activation_units(new_plan), activation_units(old))
    return fp.fixed_mib + idle + states + acts


def _ratio(new: float, old: float) -> float:
    return new / old if old > 0 else (0.0 if new <= 0 else 1.0)


def _nominal(plan: Plan) -> Footprint:
    """A stand-in footprint for "does this move save anything at all?" when nothing is stated or known."""
    share = _activation_share(plan)
    return Footprint(plan, 0.0, 100.0, 900.0 * (1 - share), 900.0 * share, None)


def alloc_conf_value(current: str, option: str) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` with ``option`` added to the plan's ``current`` setting."""
    return f"{current},{option}" if current and option not in current else (current or option)


# --------------------------------------------------------------------------- the predictor


@dataclass(frozen=True)
class Prediction:
    """One plan's predicted memory per GPU (MiB)."""

    peak_mib: float
    """Device memory at the peak, as nvidia-smi shows it (corrected by the message's numbers after a failure)."""
    fits: bool
    """``peak_mib <= target_mib`` (the one margin)."""
    target_mib: float
    peak_reserved_mib: float | None = None
    """The caching allocator's reserved peak (model known; the estimate's)."""
    fragmentation: float | None = None
    """Reserved-but-unallocated / reserved at the reserved peak (model known)."""
    fragmentation_only: bool = False
    """The tensors fit but the reserved peak does not: it fails by fragmentation (model known)."""
    alloc_conf_fix: str | None = None
    """With ``fragmentation_only``: the PYTORCH_CUDA_ALLOC_CONF value (the plan's own setting plus the fix) under
    which the replay fits."""

    def to_dict(self) -> dict[str, Any]:
        r = lambda x: None if x is None else round(x, 1)  # noqa: E731
        return {"peak_mib": r(self.peak_mib), "fits": self.fits, "target_mib": r(self.target_mib),
                "peak_reserved_mib": r(self.peak_reserved_mib),
                "fragmentation": None if self.fragmentation is None else round(self.fragmentation, 4),
                "fragmentation_only": self.fragmentation_only, "alloc_conf_fix": self.alloc_conf_fix}


@dataclass(frozen=True)
class Predictor:
    """Peaks of plans for one run (MiB per GPU): see the module docstring for the rules.

    ``partition``: where the plans run (the failed plan's partition). ``failed``: the plan that ran out of
    memory (None: planning before any run). ``numbers``: what its OOM message stated (the Verdict's numbers).
    ``model``: what is trained (None: the numbers-only model). ``anchor``: the run's first plan, where the
    activation share is assumed (default ``failed``). ``method``: the estimate's method (model known).
    ``runtime``: the job's software as known (``estimate.gpu.Runtime``; None: the default Runtime, whose
    DeepSpeed is the one installed beside hpcmem). ``changed_runtime``: the software any other plan runs under,
    where hpcmem's own flags for it change what the job did (None: ``runtime``): a job accumulating under
    FSDP's ``no_sync`` is the failed plan, and every plan hpcmem writes syncs each micro-batch.
    """

    partition: Any
    failed: Plan | None = None
    numbers: Mapping[str, float] = field(default_factory=dict)
    model: Any = None
    anchor: Plan | None = None
    method: str = "analytic"
    runtime: Any = None
    changed_runtime: Any = None
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        n = {k: float(v) for k, v in self.numbers.items() if v is not None}
        object.__setattr__(self, "numbers", n)

    # ------------------------------------------------------------------ what the failure said

    @property
    def context_mib(self) -> float:
        return self.partition.cuda_context_mib if self.partition.has_gpu else 0.0

    @property
    def fp(self) -> Footprint | None:
        """The failed plan's footprint (activation share 0.5 at the anchor); None without enough numbers."""
        if "fp" not in self._memo:
            self._memo["fp"] = (None if self.failed is None else
                                footprint(self.failed, self.numbers, self.context_mib, self.anchor))
        return self._memo["fp"]

    @property
    def usable_mib(self) -> float | None:
        """GPU memory this process could have: the message's capacity less other processes, or the memory-fraction
        cap it states plus the CUDA context (``usable_device_mib``); else the partition's."""
        card = self.partition.gpu_mem_gib * 1024.0 if self.partition.has_gpu else None
        return usable_device_mib(self.numbers, self.context_mib, card)

    @property
    def demand_mib(self) -> float | None:
        """What the failed plan needed at least: stated (in use + the request), else, with a model and a failed
        plan, the usable memory (it did not fit); None otherwise."""
        if self.fp is not None:
            return self.fp.demand_mib
        if self.failed is not None and self.model is not None:
            return self.usable_mib
        return None

    @property
    def idle_mib(self) -> float:
        """Reserved but unallocated when it failed (given back by expandable segments)."""
        return self.fp.idle_mib if self.fp is not None else 0.0

    @property
    def target_mib(self) -> float | None:
        """The most a plan may be predicted to need and fit: usable x (1 - MARGIN), and after a failure below its
        stated demand (always ask for some saving); None when the usable memory is unknown."""
        usable = self.fp.usable_mib if self.fp is not None and self.fp.usable_mib is not None else self.usable_mib
        if usable is None:
            return None
        target = usable * (1 - MARGIN)
        if self.fp is not None:
            target = min(target, self.fp.demand_mib - 1.0)
        return target

    @property
    def predicts(self) -> bool:
        """Whether peaks can be predicted at all (a model, or a failed plan with enough numbers)."""
        return self.model is not None or self.fp is not None

    # ------------------------------------------------------------------ the estimate

    def estimate(self, plan: Plan, model: Any = None):
        """The estimate of ``plan`` (of ``model``, default the run's) on the partition, remembered."""
        from .estimate import estimate

        if model is not None and model is not self.model:  # another model is another job, run as hpcmem writes it
            runtime = self.runtime if self.changed_runtime is None else self.changed_runtime
            return estimate(model, plan, self.partition, self.method, runtime=runtime)  # not remembered
        runtime = self.runtime_of(plan)
        key = ("est", plan)
        if key not in self._memo:
            self._memo[key] = estimate(self.model, plan, self.partition, self.method, runtime=runtime)
        return self._memo[key]

    def runtime_of(self, plan: Plan):
        """The software ``plan`` of the run's model runs under: the job's for the failed plan (its time limit
        aside), else ``changed_runtime`` where set."""
        if self.changed_runtime is None or self.failed is None \
                or plan.replace(time_min=self.failed.time_min) == self.failed:
            return self.runtime
        return self.changed_runtime

    def _scale(self, plan: Plan) -> float:
        """max(1, stated demand / the failed plan's estimate); the idle reserved memory left out for a plan that
        newly sets expandable segments."""
        demand = self.demand_mib
        if self.failed is None or demand is None:
            return 1.0
        if newly_expandable(self.failed, plan):
            demand -= self.idle_mib
        before = self.estimate(self.failed).device_used_mib
        return max(1.0, demand / before) if before > 0 else 1.0

    # ------------------------------------------------------------------ answers

    def peak(self, plan: Plan, model: Any = None) -> float | None:
        """Predicted peak device memory of ``plan`` (MiB per GPU); None when it cannot be said."""
        if self.model is not None:
            return self.estimate(plan, model).device_used_mib * self._scale(plan)
        if model is not None or self.fp is None or plan.seq_len != self.failed.seq_len:
            return None  # the numbers-only model knows nothing of other models or sequence lengths
        prints = [footprint(self.failed, self.numbers, self.context_mib, self.anchor, s) for s in ACTIVATION_SHARES]
        return max(predicted_peak_mib(fp, plan) for fp in prints)

    def target_for(self, plan: Plan) -> float | None:
        """``target_mib``; on a CPU partition with the model known and no stated capacity, ``plan``'s share of
        the job's host memory (the estimate's capacity: --mem, else the partition's default, over the ranks of a
        node) x (1 - MARGIN): what the planner plans against there."""
        target = self.target_mib
        if target is None and self.model is not None and not self.partition.has_gpu:
            from .estimate.analytic import capacity_mib
            target = capacity_mib(self.partition, plan) * (1 - MARGIN)
            if self.fp is not None:
                target = min(target, self.fp.demand_mib - 1.0)
        return target

    def fits(self, plan_or_peak: "Plan | float | None", plan: Plan | None = None) -> bool | None:
        """Whether a plan (or a peak already predicted, of ``plan`` when given) fits with the margin; None when it
        cannot be said. A plan with the model known must also pass the estimate's own checks (``Estimate.fits``:
        host memory for offload and CPU ranks, the allocator replay); a bare peak is judged on the margin alone
        (the planner's screen: a lower bound that does not fit rules its plan out)."""
        if isinstance(plan_or_peak, Plan):
            pred = self.predict(plan_or_peak)
            return None if pred is None else pred.fits
        target = self.target_mib if plan is None else self.target_for(plan)
        return None if plan_or_peak is None or target is None else plan_or_peak <= target

    def predict(self, plan: Plan) -> Prediction | None:
        """``plan``'s peak, fit and (model known) the allocator's view of it; None when nothing can be said.
        Fit: peak <= the target (the one margin) and, model known, the estimate's own ``fits``."""
        peak, target = self.peak(plan), self.target_for(plan)
        if peak is None or target is None:
            return None
        if self.model is None:
            return Prediction(peak, peak <= target, target)
        est = self.estimate(plan)
        fix = alloc_conf_value(plan.alloc_conf, est.alloc_conf_fix) if est.alloc_conf_fix else None
        return Prediction(peak, peak <= target and bool(est.fits), target, est.peak_reserved_mib, est.fragmentation,
                          est.fragmentation_only, fix)

    def saves(self, before: Plan, after: Plan) -> bool:
        """Whether ``after`` is predicted to need less than ``before`` (on a nominal footprint when nothing is
        stated or known: does the move save anything at all in the model?)."""
        if not self.predicts:
            fp = _nominal(before)
            return predicted_peak_mib(fp, after) < predicted_peak_mib(fp, before) - 1e-6
        return self.peak(after) < self.peak(before) - 1e-6

    def fragmented(self) -> bool:
        """The failure is the allocator's: the stated idle reserved memory could have served the request
        (``idle_could_serve``); or, when the message states no idle reserved memory (a driver or NCCL OOM, a
        message cut short) and the model is known, the estimate of the failed plan says its tensors fit and its
        reserved peak does not (``fragmentation_only``). A message that states the idle cache is not overruled."""
        if self.failed is None:
            return False
        if idle_reserved_mib(self.numbers) is not None:
            return idle_could_serve(self.numbers)  # the message states the idle cache: the estimate does not overrule it
        return self.model is not None and self.partition.has_gpu and bool(self.estimate(self.failed).fragmentation_only)


def fit_text(est, plan: Plan) -> str:
    """One line on how ``est`` (an Estimate of ``plan``) fits, for ``hpcmem estimate`` and ``hpcmem plan``."""
    if est.fragmentation_only:
        fix = f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf_value(plan.alloc_conf, est.alloc_conf_fix)}" \
            if est.alloc_conf_fix else None
        return ("FITS ONLY WITH THE ALLOCATOR SETTING: the tensors fit (peak allocated "
                f"{est.peak_allocated_mib:,.0f} MiB) but the reserved peak does not ({_mib_or(est.peak_reserved_mib)} "
                f"reserved, {est.fragmentation:.0%} fragmentation); "
                + (f"{fix} makes it fit ({_mib_or(est.fix_device_used_mib)} device used)" if fix
                   else "no allocator setting tried makes it fit"))
    return ("fits" if est.fits else "DOES NOT FIT") + f" in {est.capacity_mib:,.0f} MiB, headroom {est.headroom_mib:,.0f} MiB"


def fit_fields(est, plan: Plan) -> dict[str, Any]:
    """The fragmentation-aware fit as JSON fields: ``fit`` (``fits`` | ``fragmentation_only`` | ``does_not_fit``);
    for a fragmentation-only plan the allocator setting that makes it fit, as the job's environment line
    (``alloc_conf_env``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) and as the plan knob for
    ``hpcmem submit --set`` (``alloc_conf_set``); both None otherwise."""
    fit = "fragmentation_only" if est.fragmentation_only else ("fits" if est.fits else "does_not_fit")
    value = alloc_conf_value(plan.alloc_conf, est.alloc_conf_fix) if est.alloc_conf_fix else None
    return {"fit": fit, "alloc_conf_env": None if value is None else f"PYTORCH_CUDA_ALLOC_CONF={value}",
            "alloc_conf_set": None if value is None else f"alloc_conf={value}"}


def _mib_or(x: float | None) -> str:
    return "?" if x is None else f"{x:,.0f} MiB"
