"""The memory picture of a failed job: what the message says set against what the estimator predicts.

``memory_picture(verdict, plan, partition, model, max_rss_mib=, mem_request_mib=)`` is pure. It reads the
classifier's Verdict (``verdict.numbers``, MiB), what is known of the plan (a ``Plan``, a mapping of the knobs
found in the job's files, or None), the partition and (maybe) the model, and returns a ``MemoryPicture``:
the analytic estimate of the job as it ran, the message's numbers, the GPU capacity, flags, sentences for a
person and the assumptions made. Nothing here prints; the triage report lays it out.

``fill_plan(known, partition)`` turns the knobs found in a job's files into a whole Plan, saying which knobs
were assumed; ``remedies`` uses it too.

Flags
    fragmentation          the classifier called the OOM fragmentation (idle reserved memory could have held
                           the request)
    other_process          other processes held GPU memory (``other_process_mib`` > 0)
    host_pressure_offload  the plan offloads to the CPU and host memory was short: a host OOM, or the peak RSS
                           within ``HOST_PRESSURE_SHARE`` of ``--mem``, or the estimate's offloaded states
                           alone that close to it
    estimate_low           the message shows more demand (in use + the failed request) than the estimate by
                           more than ``ESTIMATE_LOW_SHARE``: the job holds memory the model does not know of
    estimate_high          the estimate is above the capacity and more than ``ESTIMATE_LOW_SHARE`` above the
                           stated demand (the step failed before its peak; nothing wrong)
    capacity_mismatch      the message's GPU capacity differs from the partition's by more than 10 %
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..classify import Verdict, usable_capacity_mib
from ..errors import UnknownNameError
from ..estimate import Estimate, ModelRef, attention_refusal, estimate
from ..estimate.gpu import Runtime
from ..failures import is_host
from ..ladder import describe
from ..predict import footprint, usable_device_mib
from ..plan import KNOBS, Plan
from ..sites import Partition
from ..strategies import infer_launcher

ESTIMATE_LOW_SHARE = 0.10
"""The stated demand must exceed the estimate by this share to flag the estimate low (and conversely)."""
HOST_PRESSURE_SHARE = 0.90
"""Peak RSS (or offloaded states) at this share of --mem counts as host-memory pressure."""
MEMORY_KNOBS = ("nodes", "gpus_per_node", "micro_batch", "grad_accum", "seq_len", "precision", "optimizer",
                "checkpointing", "attention", "zero_stage", "offload_optimizer", "offload_params")
"""Knobs that change the GPU memory of a step: the ones worth saying were assumed."""


# --------------------------------------------------------------------------- the plan as far as it is known


@dataclass(frozen=True)
class KnownPlan:
    """What is known of the failed job's plan, filled up to a whole Plan."""

    plan: Plan
    """Every knob: the known ones, the ones that follow from them, defaults for the rest."""
    assumed: tuple[str, ...] = ()
    """``knob=value`` for each memory knob taken from the defaults (nothing said about it)."""
    known: bool = True
    """False when nothing at all was known (the plan is the defaults)."""
    given: frozenset = frozenset()
    """Names of the knobs that were given (``time_min`` in it: the time limit is known)."""
    runtime: Mapping[str, Any] = field(default_factory=dict)
    """``estimate.gpu.Runtime`` fields the job's files state about its software (``JobFacts.runtime``)."""
    accelerator_config: str | None = None
    """The HF Trainer's ``--accelerator_config`` as the job wrote it (``JobFacts.accelerator_config``), or None."""

    @property
    def note(self) -> str:
        """One sentence about the assumptions ("" when there are none)."""
        if not self.known:
            return f"The job's plan is unknown: hpcmem's defaults are assumed {describe(self.plan)}."
        if self.assumed:
            return f"Not found in the job's files, so assumed: {', '.join(self.assumed)}."
        return ""


def fill_plan(known: Plan | Mapping[str, Any] | None, partition: Partition | None = None,
              model: Any = None) -> KnownPlan:
    """A whole Plan from what is known of it.

    ``known``: a KnownPlan (returned as it is), a Plan (taken as wholly known, its time limit too), a mapping
    of knob names to values (None values count as unknown;
    ``world_size`` may stand in for ``gpus_per_node``), or None (nothing known: the defaults). The batch
    knobs follow from each other (``micro_batch x grad_accum x world_size == global_batch``; where they
    disagree micro-batch and accumulation win); the launcher is the engine the knobs imply
    (``strategies.infer_launcher``: deepspeed with ZeRO or offload, fsdp with its resharding knobs); ``time_min`` is capped at the partition's limit. Raises
    ``UnknownNameError`` for a name that is not a knob, ``PlanError`` for knobs that cannot go together.
    ``model`` (an ``estimate.ModelRef``, when known): an attention nobody stated is eager, not sdpa, for a model
    transformers gives no SDPA path (Gemma 2: its default there).
    """
    if isinstance(known, KnownPlan):
        return known
    if isinstance(known, Plan):
        return KnownPlan(known, (), True, frozenset(KNOBS))
    given = {k: v for k, v in dict(known or {}).items() if v is not None}
    world = given.pop("world_size", None)
    unknown = sorted(set(given) - set(KNOBS))
    if unknown:
        raise UnknownNameError("knob", unknown[0], KNOBS)
    values = dict(given)
    values.setdefault("nodes", 1)
    derived = set()
    if "gpus_per_node" not in values and world:
        values["gpus_per_node"] = max(1, int(world) // values["nodes"])
        derived.add("gpus_per_node")
    values.setdefault("gpus_per_node", 1)
    batch, followed = _batch(values, values["nodes"] * values["gpus_per_node"])
    values.update(batch)
    derived |= followed
    values["launcher"] = infer_launcher(values)  # the engine, whatever started it (often torchrun)
    if partition is not None and values.get("time_min", 0) > partition.max_time_min:
        values["time_min"] = partition.max_time_min
    plan = Plan(**values)
    if "attention" not in given and attention_refusal(model, plan):
        plan = plan.replace(attention="eager")
    assumed = tuple(f"{k}={_text(getattr(plan, k))}" for k in MEMORY_KNOBS if k not in given and k not in derived)
    return KnownPlan(plan, assumed, bool(given) or bool(derived), frozenset(given))


def _batch(values: Mapping[str, Any], world: int) -> tuple[dict, set]:
    """(micro_batch, grad_accum, global_batch consistent with each other, the names that followed from the
    others). Known micro-batch and accumulation win over a global batch that disagrees with them."""
    micro, accum, total = values.get("micro_batch"), values.get("grad_accum"), values.get("global_batch")
    derived = set()
    if micro is None and total is not None and total % ((accum or 1) * world) == 0:
        micro = total // ((accum or 1) * world)
        derived.add("micro_batch")
    if micro is None:
        micro = Plan.micro_batch
    if accum is None and total is not None and total % (micro * world) == 0:
        accum = total // (micro * world)
        derived.add("grad_accum")
    if accum is None:
        accum = 1
    return {"micro_batch": micro, "grad_accum": accum, "global_batch": micro * accum * world}, derived


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else str(value)


# --------------------------------------------------------------------------- the picture


@dataclass(frozen=True)
class MemoryPicture:
    """A failed job's memory: the message's numbers, the estimate, what stands out (MiB throughout)."""

    estimate: Estimate | None
    """The analytic estimate of the job as it ran (None: model or plan unknown; ``notes`` says why)."""
    stated: dict
    """The message's numbers (``verdict.numbers``, MiB)."""
    capacity_mib: float | None
    """GPU capacity: the message's, else the partition's (None on a CPU partition with nothing stated)."""
    flags: tuple[str, ...]
    """What stands out (see the module docstring)."""
    lines: tuple[str, ...]
    """Sentences for a person, in reading order."""
    notes: tuple[str, ...]
    """Assumptions: knobs assumed, model unknown, partition not calibrated, ..."""
    demand_mib: float | None = None
    """What the step needed at least on one GPU: in use + the failed request (None: not stated)."""
    usable_mib: float | None = None
    """GPU memory this process could have had: capacity minus other processes."""
    max_rss_mib: float | None = None
    """Peak resident memory of the job (sacct MaxRSS), when known."""
    mem_request_mib: float | None = None
    """Host memory asked per node (--mem), when known."""
    plan: Plan | None = None
    """The plan the estimate is for (known knobs + assumptions); None when nothing was known."""

    def to_dict(self) -> dict:
        """JSON-ready (MiB rounded to 0.1): estimate, stated, capacity_mib, demand_mib, usable_mib, max_rss_mib,
        mem_request_mib, plan, flags, lines, notes."""
        return {
            "estimate": estimate_dict(self.estimate),
            "stated": {k: _r(v) for k, v in self.stated.items()},
            "capacity_mib": _r(self.capacity_mib),
            "demand_mib": _r(self.demand_mib),
            "usable_mib": _r(self.usable_mib),
            "max_rss_mib": _r(self.max_rss_mib),
            "mem_request_mib": _r(self.mem_request_mib),
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "flags": list(self.flags),
            "lines": list(self.lines),
            "notes": list(self.notes),
        }


def estimate_dict(est: Estimate | None) -> dict | None:
    """``Estimate.to_dict()`` with MiB rounded to 0.1 (None stays None)."""
    if est is None:
        return None
    out = est.to_dict()
    out["components"] = {k: _r(v) for k, v in out["components"].items()}
    for key in ("peak_allocated_mib", "device_used_mib", "host_mib_per_node", "capacity_mib", "headroom_mib"):
        out[key] = _r(out[key])
    return out


def memory_picture(verdict: Verdict, plan: Plan | KnownPlan | Mapping[str, Any] | None, partition: Partition | None,
                   model: ModelRef | None, *, max_rss_mib: float | None = None,
                   mem_request_mib: float | None = None) -> MemoryPicture:
    """The memory picture of a failed job.

    ``verdict``: the classifier's (numbers in MiB). ``plan``: a Plan, the knobs found (a mapping, or
    ``fill_plan``'s KnownPlan of them: the assumptions are then named in ``notes``), or None.
    ``partition``: where it ran (None: unknown; the capacity then comes from the message alone). ``model``:
    what it trained (None: no estimate). ``max_rss_mib``: sacct's MaxRSS; ``mem_request_mib``: --mem (MiB;
    default: the plan's ``mem_mib``, else the partition's default).
    """
    n = {k: float(v) for k, v in verdict.numbers.items() if v is not None}
    notes: list[str] = []
    known = fill_plan(plan, partition, model) if plan is not None else None
    known = known if known is not None and known.known else None
    if known is not None and known.note:
        notes.append(known.note)
    if mem_request_mib is None and known is not None:
        mem_request_mib = known.plan.mem_mib or (partition.default_mem_mib if partition else None)
    capacity = _capacity(n, partition)
    context = partition.cuda_context_mib if partition is not None else 0.0
    fp = footprint(known.plan if known else Plan(), n, context) if n else None
    card = partition.gpu_mem_gib * 1024.0 if partition is not None and partition.has_gpu else None
    usable = usable_device_mib(n, fp.fixed_mib if fp is not None else context, card)  # predict.py's rule
    demand = fp.demand_mib if fp is not None else None
    est = _estimate(verdict, known, partition, model, notes)
    if est is not None:
        notes.extend(note for note in est.notes if note not in notes)
    flags = _flags(verdict, n, known, est, demand, capacity, partition, max_rss_mib, mem_request_mib)
    lines = _gpu_lines(n, demand, capacity) + _estimate_lines(est, known, demand, flags)
    lines += _host_lines(verdict, known, est, max_rss_mib, mem_request_mib, flags)
    if "capacity_mismatch" in flags:
        notes.append(f"The message's GPU has {_gib(capacity)}, the partition's {_gib(partition.gpu_mem_gib * 1024)}: "
                     "the job ran on other hardware or under a memory cap; the message's capacity is used.")
    return MemoryPicture(est, dict(verdict.numbers), capacity, tuple(flags), tuple(lines), tuple(notes), demand,
                         usable, max_rss_mib, mem_request_mib, known.plan if known else None)


def _capacity(n: Mapping[str, float], partition: Partition | None) -> float | None:
    stated = usable_capacity_mib(n)  # a memory-fraction cap, else the card
    if stated is not None:
        return stated
    if partition is not None and partition.has_gpu:
        return partition.gpu_mem_gib * 1024
    return None


def _estimate(verdict: Verdict, known: KnownPlan | None, partition: Partition | None, model: ModelRef | None,
              notes: list[str]) -> Estimate | None:
    """The analytic estimate of the plan as it ran, or None with a note saying why."""
    missing = [what for what, value in (("model", model), ("plan", known), ("partition", partition)) if value is None]
    if missing:
        notes.append(f"No estimate: the job's {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} unknown.")
        return None
    if not partition.has_gpu and not is_host(verdict):
        notes.append("No GPU estimate: the partition has no GPU.")
    return estimate(model, known.plan, partition, runtime=job_runtime(verdict, known))


def job_runtime(verdict: Verdict, known: KnownPlan | None = None):
    """The job's software as its log states it (``Verdict.deepspeed_version``) and its files do
    (``KnownPlan.runtime``), for the estimator; None when neither says anything (the default Runtime: the
    DeepSpeed installed beside hpcmem, a gradient sync on every micro-batch)."""
    fields = dict(known.runtime) if known is not None else {}
    version = getattr(verdict, "deepspeed_version", None)
    if version:
        fields["deepspeed_version"] = version
    return Runtime(**fields) if fields else None


def _flags(verdict, n, known, est, demand, capacity, partition, max_rss, mem_request) -> list[str]:
    flags = []
    if verdict.kind == "gpu_oom_fragmentation":
        flags.append("fragmentation")
    if n.get("other_process_mib", 0.0) > 0:
        flags.append("other_process")
    offload = known is not None and "cpu" in (known.plan.offload_optimizer, known.plan.offload_params)
    if offload and _host_short(verdict, est, max_rss, mem_request):
        flags.append("host_pressure_offload")
    if est is not None and demand is not None:
        if demand > est.device_used_mib * (1 + ESTIMATE_LOW_SHARE):
            flags.append("estimate_low")
        elif capacity is not None and est.device_used_mib > max(capacity, demand * (1 + ESTIMATE_LOW_SHARE)):
            flags.append("estimate_high")
    stated = usable_capacity_mib(n)
    if partition is not None and partition.has_gpu and stated is not None:
        if abs(stated - partition.gpu_mem_gib * 1024) > 0.10 * partition.gpu_mem_gib * 1024:
            flags.append("capacity_mismatch")
    return flags


def _host_short(verdict: Verdict, est: Estimate | None, max_rss: float | None, mem_request: float | None) -> bool:
    if is_host(verdict):  # host kinds, and an nccl_oom about /dev/shm (toolkit/failures.py)
        return True
    if not mem_request:
        return False
    used = max(max_rss or 0.0, est.host_mib_per_node if est is not None else 0.0)
    return used >= HOST_PRESSURE_SHARE * mem_request


# --------------------------------------------------------------------------- sentences


def _gpu_lines(n: Mapping[str, float], demand: float | None, capacity: float | None) -> list[str]:
    if not n:
        return ["The message states no memory sizes."]
    lines = []
    tried, free = n.get("tried_to_allocate_mib"), n.get("free_mib")
    of = f" of {_gib(capacity)}" if capacity is not None else ""
    need = f"; the step needed {_gib(tried)} more" if tried is not None else ""
    free_text = f" ({_gib(free)} free)" if free is not None else ""
    if "allocated_by_pytorch_mib" in n:
        idle = n.get("reserved_unallocated_mib", 0.0)
        lines.append(f"PyTorch had {_gib(n['allocated_by_pytorch_mib'])} allocated + {_gib(idle)} reserved-unused"
                     f"{of}{need}{free_text}.")
    elif "already_allocated_mib" in n:
        reserved = n.get("reserved_total_mib")
        held = f" ({_gib(reserved)} reserved in total)" if reserved is not None else ""
        if reserved is None and "reserved_unallocated_mib" in n:  # <= 1.3 "cached": the idle part
            held = f" + {_gib(n['reserved_unallocated_mib'])} reserved-unused"
        lines.append(f"PyTorch had {_gib(n['already_allocated_mib'])} allocated{held}{of}{need}{free_text}.")
    elif tried is not None:
        lines.append(f"The step tried to allocate {_gib(tried)}{of}{free_text}.")
    if "process_in_use_mib" in n and "allocated_by_pytorch_mib" in n:
        outside = n["process_in_use_mib"] - n["allocated_by_pytorch_mib"] - n.get("reserved_unallocated_mib", 0.0)
        lines.append(f"This process held {_gib(n['process_in_use_mib'])} in all, {_gib(max(outside, 0.0))} of it "
                     "outside PyTorch (CUDA context, cuBLAS, NCCL).")
    if n.get("other_process_mib"):
        lines.append(f"Other processes held {_gib(n['other_process_mib'])} of the GPU.")
    if demand is not None:
        lines.append(f"So the step needed at least {_gib(demand)} on this GPU (in use + the failed request){of}.")
    return lines


def _estimate_lines(est: Estimate | None, known: KnownPlan | None, demand: float | None, flags: list) -> list[str]:
    if est is None:
        return []
    parts = ", ".join(f"{name.replace('_', ' ')} {value / 1024:.1f}" for name, value in est.components.items() if value)
    line = (f"The estimate for this plan {describe(known.plan)} is {_gib(est.device_used_mib)} per GPU as nvidia-smi "
            f"would show it ({parts} GiB)")
    if demand is not None:
        if "estimate_low" in flags:
            line += f"; the message shows at least {_gib(demand)}, so the job holds more than the model knows of"
        elif "estimate_high" in flags:
            line += f"; the message shows {_gib(demand)} when it failed, before the step's peak"
        else:
            line += f", in line with the {_gib(demand)} the message shows"
    return [line + "."]


def _host_lines(verdict, known, est, max_rss, mem_request, flags) -> list[str]:
    lines = []
    if max_rss is not None:
        limit = f" of its --mem {_gib(mem_request)}" if mem_request else ""
        sampled = (" (as sampled by Slurm's accounting: a process killed for memory is often last sampled "
                   "well below the limit it hit)" if verdict.kind == "host_oom" and mem_request
                   and max_rss < 0.9 * mem_request else "")
        lines.append(f"The job's peak resident memory was {_gib(max_rss)}{limit} per node{sampled}.")
    if est is not None and est.host_mib_per_node > 0:
        lines.append(f"Offloading keeps about {_gib(est.host_mib_per_node)} in host memory per node (estimate).")
    if "host_pressure_offload" in flags:
        lines.append("Host memory is under pressure from CPU offload: NVMe offload or more --mem relieves it.")
    return lines


def _gib(mib: float | None) -> str:
    if mib is None:
        return "?"
    return f"{mib / 1024:.1f} GiB" if abs(mib) >= 1024 else f"{mib:.0f} MiB"


def _r(value: Any) -> Any:
    return round(float(value), 1) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
