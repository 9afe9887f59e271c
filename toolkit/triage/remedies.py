"""Ranked remedies for a job that ran out of memory, each as a concrete change.

``remedies(verdict, plan, partition, model, allow=, spec=, site=, max_items=, base=)`` is pure. It reads the
classifier's Verdict, what is known of the failed plan (a ``Plan``, a mapping of the knobs found, or None), the
partition it ran on and (maybe) the model, and returns up to ``max_items`` ``Remedy`` objects, best first.
Each carries the new plan, its predicted per-GPU peak, whether that fits, its slowdown, the ``hpcmem submit
--set`` knobs and the lines of the job script, DeepSpeed config and HF Trainer arguments that change.

Which failures get which remedies (the family is ``failures.family_of(kind, cause)``)
    not an OOM (``not_oom``, ``unknown``)  none: ``where_to_look(verdict)`` says where to look instead.
    by phase and step, first (``phase_advice``): advice that is not a plan knob, in front of the plan moves --
        eval / generate   the evaluation's own batch size, ``torch.no_grad()``/``inference_mode()`` and
                          ``model.eval()``, ``--eval_accumulation_steps`` (OSC's guide), fewer beams/new tokens;
        load              low-precision and sharded loading straight to the devices, meta-device init
                          (``init_empty_weights``, Fabric ``init_module``, ZeRO-3 ``zero.Init``), offload;
        checkpoint        gather the state dict to the CPU / save it sharded;
        a late step       (``step >= LATE_STEP``) the long-batch and leak questions: the first-step ladder assumes
                          every step needs what the first did, and this job ran for many steps first.
    gpu_oom_other_process                  one: the GPU to yourself (another process holds it); no plan move.
    host_oom, cpu_alloc_oom, nccl_oom about /dev/shm
                                           the ladder's host rungs, walked (``ladder.next_plan``): NVMe instead
                                           of CPU offload, more --mem (up to the node), fewer data-loader
                                           workers, ...; each on top of the one before.
    GPU OOMs (gpu_oom, gpu_oom_fragmentation, gpu_driver_oom, nccl_oom)
                                           the planner's candidates (``planner.candidate_plans``: moves that keep
                                           what is learned, only what the partition supports: no bf16 or flash
                                           attention on a V100) from the failed plan, predicted, ranked below;
                                           none undoes a saving the failed plan had (a larger micro-batch, a
                                           lower ZeRO stage, less offload, fp32 again). Fragmentation:
                                           ``expandable_segments:True`` first (free: no code change, no
                                           slowdown), and on every other candidate too.
    the job's own DeepSpeed (``Verdict.deepspeed_version``, from its log): every prediction is made as that version
                                           allocates; where it holds memory that a newer one does not
                                           (``upgrade_advice``: ZeRO-1/2 with CPU offload before 0.19.8), the
                                           same plan on a newer DeepSpeed -- first when it fits, after the plan
                                           moves when it does not.
    the job's own accumulation (``KnownPlan.runtime``: the HF Trainer's ``--fsdp`` flags without
    ``sync_each_batch``, read by ``scriptread``): every prediction keeps FSDP's unsharded gradients between
                                           micro-batches (``Runtime.fsdp_no_sync``), and the same plan with a
                                           gradient sync on every micro-batch (``sync_advice``) is ranked the
                                           same way.

Predicted peak (MiB per GPU, as nvidia-smi shows it)
    The one predictor, ``predict.Predictor`` (its docstring has the rules, the same as the ladder's): model known,
    the estimate of each candidate scaled by max(1, stated demand / estimate of the failed plan), the idle
    reserved memory left out for a candidate that newly sets expandable segments, and without numbers in the
    message the failed plan's demand taken as at least the usable memory (it did not fit); numbers only, the
    failed plan's footprint scaled by the knobs, the larger prediction over the assumed activation shares;
    neither, or the plan is unknown: the ladder's moves in order (``next_plan`` without numbers, each on top of
    the one before), predicted peak and fits None. Fits: peak <= usable x (1 - ``predict.MARGIN``), below the
    failed plan's stated demand; usable: the message's capacity (else the partition's) minus other processes.
    Fragmentation (``Predictor.fragmented``: the verdict's kind, or the message's idle reserved memory with the
    free memory covered the request, or the estimate of the failed plan fits its tensors but not its reserved
    peak): ``expandable_segments:True`` is the first remedy.

Ranking
    Among the candidates predicted to fit: relative throughput (``planner.speed`` against the failed plan)
    first, and only those on the speed/memory frontier (a slower candidate is shown only when it needs less
    memory than every faster one). When none fits: where ``gpus`` is allowed, more GPUs per node (global batch
    kept) are tried too; then the closest ones (least memory first, fits False; a larger one only when faster),
    followed by the last resorts that fit, labelled ``LAST_RESORT``: half the sequence length, plain SGD, a
    smaller model (fewer layers of the same shape; model known only). At most ``max_items`` in all, except that
    at least one closest remedy is kept in front of the last resorts.

The ``set_args`` are the knobs that differ from ``base`` (default: the failed plan), so
``with_changes(base, parse_sets(set_args)) == remedy.plan``; ``grad_accum`` is left to follow from the
micro-batch. The time limit is scaled by the ladder's slowdown (``ladder.scale_time``, as the controller does) only
when the failed plan's ``time_min`` was known. That slowdown is deliberately conservative -- it counts the costs
of a move and credits no predicted speed-up (mixed precision, flash attention) -- so a remedy predicted to be
faster may still ask for a little more time: a job killed at its time limit costs more than a longer request.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from .. import ladder, planner
from ..predict import EXPANDABLE, MARGIN, Predictor, alloc_conf_value
from ..classify import Verdict
from ..errors import HpcmemError, UnknownNameError
from ..estimate import ModelRef, attention_refusal
from ..estimate.gpu import CURRENT_DEEPSPEED, Runtime
from ..failures import family_of, is_host
from ..modelshape import ModelShape, largest_param_numel
from ..plan import KNOBS, Plan, parse_sets, with_changes
from ..sites import Partition
from .changes import ds_config_changes, script_changes, title, trainer_arg_changes
from .picture import KnownPlan, fill_plan, job_runtime

ALL_MOVES = tuple(name for name in ladder.ALLOW_NAMES if name != "partition")
"""Every move a remedy may make (a bigger partition is the lead's to suggest: it needs the site)."""
LAST_RESORT = "LAST RESORT (changes what is learned): "
"""How the DeepSpeed config is named in Trainer arguments."""
_LAYER_KEYS = ("n_layer", "num_hidden_layers")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Remedy:
    """One way to make the job fit, as a concrete change (MiB per GPU)."""

    title: str
    """What changes, in words: "Micro-batch 8 -> 2 with grad_accum 1 -> 4 (same global batch) + ..."."""
    moves: tuple[str, ...]
    """``ladder.move_names`` from the failed plan."""
    plan: Plan | None
    """The new plan (None: the remedy is not a plan change, or the failed plan was unknown and ``set_args`` are
    relative to assumed defaults)."""
    predicted_peak_mib: float | None
    """Predicted per-GPU peak (device used) of the new plan, corrected by the message's numbers."""
    fits: bool | None
    """Predicted to fit with the margin (None: cannot say)."""
    slowdown: float | None
    """Relative time per sample against the failed plan (1.0 same, 1.33 is 33 % slower, 0.5 twice as fast)."""
    set_args: tuple[str, ...]
    """``knob=value`` for ``hpcmem submit --set``."""
    submit_command: str
    """The ``hpcmem submit`` command line (shell-quoted)."""
    script_changes: tuple[str, ...]
    """``#SBATCH`` and launcher lines that change: "#SBATCH --gpus-per-node=a100:2 -> a100:4"."""
    ds_config_changes: tuple[str, ...]
    """DeepSpeed config keys that change: "zero_optimization.stage: 2 -> 3"."""
    trainer_args: tuple[str, ...]
    """HF Trainer flags that change: "--per_device_train_batch_size 2", "drop --bf16"."""
    changes_result: bool = False
    """True for last resorts that change what is learned."""
    note: str = ""
    """Assumptions and caveats."""

    def to_dict(self) -> dict:
        """JSON-ready (MiB rounded to 0.1, slowdown to 0.001)."""
        return {
            "title": self.title, "moves": list(self.moves),
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "predicted_peak_mib": None if self.predicted_peak_mib is None else round(self.predicted_peak_mib, 1),
            "fits": self.fits, "slowdown": None if self.slowdown is None else round(self.slowdown, 3),
            "set_args": list(self.set_args), "submit_command": self.submit_command,
            "script_changes": list(self.script_changes), "ds_config_changes": list(self.ds_config_changes),
            "trainer_args": list(self.trainer_args), "changes_result": self.changes_result, "note": self.note,
        }


# --------------------------------------------------------------------------- entry point


def remedies(verdict: Verdict, plan: Plan | KnownPlan | Mapping[str, Any] | None, partition: Partition,
             model: ModelRef | None, *, allow: Iterable[str] = ALL_MOVES, spec: str | None = None,
             site: str | None = None, max_items: int = 5, base: Plan | None = None) -> list[Remedy]:
    """Remedies for ``verdict``, best first (the rules are in the module docstring).

    ``plan``: the failed plan, the knobs found (a mapping or ``fill_plan``'s KnownPlan: the rest assumed and said
    so, the time limit scaled only when known) or None. ``allow``:
    the move names a remedy may use (``ALL_MOVES``). ``spec``, ``site``: for the submit command (default
    ``SPEC`` and the partition's site). ``base``: the plan ``hpcmem submit SPEC`` starts from, against which
    ``set_args`` are given (default: the failed plan). Raises ``UnknownNameError`` for an unknown move name.
    """
    allow = tuple(allow)
    unknown = sorted(set(allow) - set(ALL_MOVES))
    if unknown:
        raise UnknownNameError("remedy move", unknown[0], ALL_MOVES)
    if not verdict.is_oom or max_items < 1:
        return []
    known = fill_plan(plan, partition, model)
    maker = _Maker(partition, known, model, spec, site, base or known.plan)
    family = "host" if is_host(verdict) else family_of(verdict.kind, getattr(verdict, "cause", None))
    if family == "exclusive":
        return [_other_process(verdict, maker)]
    advice = phase_advice(verdict, maker)[:max_items]
    room = max_items - len(advice)
    if room < 1:
        return advice
    if family == "host":
        return advice + _walk(verdict, known, maker, allow, room, host=True)
    pred = _predictor(verdict, known, partition, model) if known.known else None
    if pred is None:
        return advice + _walk(verdict, known, maker, allow, room, host=False)
    software = software_advice(known.plan, maker, pred)[:room]
    first = [r for r in software if r.fits]  # the same plan fits with other software or settings: first
    later = [r for r in software if not r.fits]
    moves = _gpu(verdict, known, maker, allow, pred, room - len(first)) if room > len(first) else []
    return advice + first + moves + later[:room - len(first) - len(moves)]


LATE_STEP = 50
"""A failure at this step or later is a late one. A training step's memory is the same from one step to the next once
the first steps have allocated the optimizer states and warmed the allocator's cache; a job that ran this many steps
and then ran out met a longer batch or grew memory (a leak), and the first-step ladder answers neither."""


def phase_advice(verdict: Verdict, maker: "_Maker") -> list[Remedy]:
    """Advice chosen by where (phase) and when (step) the job died; [] when neither changes the answer."""
    phase, step = getattr(verdict, "phase", None), getattr(verdict, "step", None)
    host = is_host(verdict)
    out = []
    if phase in ("eval", "generate") and not host:
        gen = (" For generation: fewer beams (num_beams) and return sequences, a smaller max_new_tokens, and a "
               "smaller generation batch; the KV cache grows with each of them.") if phase == "generate" else ""
        out.append(_advice(
            f"The {'evaluation' if phase == 'eval' else 'generation'} ran out, not the training step: a smaller "
            "evaluation batch, under no_grad with model.eval()",
            ("--per_device_eval_batch_size (half of today's, or 1)", "--eval_accumulation_steps 1"),
            "Peak not predicted: evaluation memory is its own batch size, not the training micro-batch. Run it "
            "under torch.no_grad() (or torch.inference_mode()) with model.eval() so no activations are kept for a "
            "backward pass; HF Trainer does both, but a custom loop must. --eval_accumulation_steps moves "
            "predictions to the CPU instead of gathering all of them on the GPU; compute metrics on the CPU." + gen,
            maker))
    elif phase == "load":
        out.append(_advice(
            "The model did not fit while loading: load it in 16-bit and sharded, straight to its devices, or "
            "initialise it on the meta device",
            ("from_pretrained(..., torch_dtype=torch.bfloat16, low_cpu_mem_usage=True, device_map=...)",),
            "Peak not predicted: loading can need more than training (a full fp32 copy per rank, or on one GPU). Load "
            "in bf16/fp16 (torch_dtype), shard by shard (low_cpu_mem_usage=True, device_map) instead of materialising "
            "the whole model on every rank; initialise on the meta device (accelerate.init_empty_weights(), "
            "Fabric.init_module(empty_init=True), DeepSpeed ZeRO-3 zero.Init / HF with a ZeRO-3 config) so each rank "
            "holds only its shard; or offload what does not fit (device_map='auto' with an offload_folder, ZeRO-3 "
            "offload_param)." + (" Host memory: load fewer ranks at once or with mmap (torch.load(mmap=True))."
                                 if host else ""),
            maker))
    elif phase == "checkpoint" and not host:
        out.append(_advice(
            "Saving the checkpoint ran out: gather the state dict to the CPU, or save it sharded",
            (),
            "Peak not predicted: a full state dict gathered on one GPU needs the whole model there. FSDP: "
            "FullStateDictConfig(offload_to_cpu=True, rank0_only=True) or StateDictType.SHARDED_STATE_DICT; "
            "DeepSpeed ZeRO-3: save the sharded checkpoint and consolidate offline (zero_to_fp32.py); call "
            "torch.cuda.empty_cache() before saving.",
            maker))
    if step is not None and step >= LATE_STEP and not host:
        of = f" of {verdict.total_steps}" if getattr(verdict, "total_steps", None) else ""
        out.append(_advice(
            f"It ran {step}{of} steps before failing: ask first whether a long batch or a leak did it",
            ("--group_by_length (or a fixed --max_seq_length / padding to it)",),
            "Peak not predicted: a step needs the same memory as the one before once training is under way, so a "
            f"failure at step {step} means the input or the kept memory changed. A long batch: the longest sequence "
            "or largest image came late -- cap the length, bucket by length, or pad to the maximum so the first "
            "step is the worst one. A leak: memory growing step by step -- tensors kept across steps (a loss summed "
            "without .item(), outputs appended to a list, retain_graph=True), a growing cache; log "
            "torch.cuda.max_memory_allocated() per step to tell the two apart. Resume from the last checkpoint "
            "rather than from step 0. The memory moves below help either way, at their cost.",
            maker))
    return out


def software_advice(failed: Plan, maker: "_Maker", pred: Predictor) -> list[Remedy]:
    """The failed plan unchanged under other software or settings that hold less memory for it: a gradient sync on
    every micro-batch (``sync_advice``), a newer DeepSpeed (``upgrade_advice``). Each is predicted without that
    memory and fits only where the estimate without it fits too (ranked first then, after the plan moves
    otherwise); [] when nothing applies or the model is unknown."""
    return sync_advice(failed, maker, pred) + upgrade_advice(failed, maker, pred)


def _without(failed: Plan, pred: Predictor, runtime: Runtime) -> tuple[float, bool | None]:
    """(MiB per GPU the failed plan holds under ``pred``'s runtime but not under ``runtime``, whether it then fits)."""
    other = Predictor(pred.partition, model=pred.model, method=pred.method, runtime=runtime)
    saved = pred.estimate(failed).device_used_mib - other.estimate(failed).device_used_mib
    before = pred.peak(failed)
    if before is None or saved < 1.0:
        return 0.0, None
    fits = pred.fits(before - saved, failed)
    return saved, (fits and bool(other.estimate(failed).fits) if fits is not None else None)


def sync_advice(failed: Plan, maker: "_Maker", pred: Predictor) -> list[Remedy]:
    """A gradient sync on every micro-batch, where the job accumulates under FSDP with the HF Trainer's default
    ``no_sync`` (``Runtime.fsdp_no_sync``, read from its flags by ``scriptread``): every unit then keeps its whole
    unsharded gradient until the last micro-batch."""
    runtime = pred.runtime
    if runtime is None or not runtime.fsdp_no_sync or pred.model is None or failed.launcher != "fsdp" \
            or failed.grad_accum < 2:
        return []
    saved, fits = _without(failed, pred, replace(runtime, fsdp_no_sync=False))
    if saved <= 0:
        return []
    advice = _advice(
        f"Reduce the gradients on every micro-batch (sync_each_batch): under FSDP the accumulation holds "
        f"{saved / 1024:.1f} GiB per GPU of unsharded gradients",
        maker.trainer_args(failed, failed),
        f"Same plan, same results. The HF Trainer accumulates the first {failed.grad_accum - 1} of every "
        f"{failed.grad_accum} micro-batches under no_sync, and FSDP then keeps every unit's whole unsharded gradient "
        "until the last; a reduce-scatter per micro-batch costs communication, not memory. The Trainer honors the "
        "setting since transformers PR #43919 (2026-02); a custom loop passes "
        "GradientAccumulationPlugin(sync_each_batch=True) to Accelerator instead. Predicted peak without that memory.",
        maker)
    return [replace(advice, predicted_peak_mib=pred.peak(failed) - saved, fits=fits)]


def upgrade_advice(failed: Plan, maker: "_Maker", pred: Predictor) -> list[Remedy]:
    """A newer DeepSpeed, where the job's own (its log's ``DeepSpeed info: version=``) holds memory that hpcmem's
    does not for this plan: ZeRO-1/2 with CPU optimizer offload (``estimate.gpu.Runtime``: the overflow check's
    copies before DeepSpeed PR #8325, the step's fp32 partition on the device from v0.14.1 to v0.17.0)."""
    runtime = pred.runtime
    if runtime is None or pred.model is None or failed.launcher != "deepspeed" or failed.zero_stage not in (1, 2) \
            or failed.offload_optimizer == "none":
        return []
    causes = []
    if runtime.zero_overflow_check == "elementwise":
        causes.append("its overflow check copies each gradient it hands to the host to fp32 with three masks, 11 "
                      "bytes per element of the largest gradient at once (DeepSpeed PR #8325, in 0.19.8)")
    elif runtime.zero_overflow_check == "sum":
        causes.append("its overflow check copies each gradient it hands to the host to fp32, 4 bytes per element "
                      "of the largest gradient (DeepSpeed PR #8325, in 0.19.8, allocates nothing)")
    if runtime.zero_offload_step_fp32_copy:
        causes.append("its step copies the whole fp32 partition to the GPU before casting it (DeepSpeed PR #7309, "
                      "in 0.17.0)")
    if not causes:
        return []
    saved, fits = _without(failed, pred, replace(runtime, deepspeed_version=CURRENT_DEEPSPEED))
    if saved <= 0:
        return []
    peak = pred.peak(failed) - saved
    advice = _advice(
        f"Upgrade DeepSpeed {runtime.deepspeed_version} -> {CURRENT_DEEPSPEED} or later: with this plan it holds "
        f"{saved / 1024:.1f} GiB per GPU that newer DeepSpeed does not",
        (), "Same plan, same results. With ZeRO-Offload " + "; ".join(causes) + ". Predicted peak without "
        "that memory; pip install -U deepspeed in the job's environment.", maker)
    return [replace(advice, predicted_peak_mib=peak, fits=fits)]


def _advice(title: str, trainer_args: tuple, note: str, maker: "_Maker") -> Remedy:
    """A remedy that is advice, not a plan change (no plan, no predicted peak)."""
    return Remedy(title=title, moves=(), plan=None, predicted_peak_mib=None, fits=None, slowdown=None, set_args=(),
                  submit_command="", script_changes=(), ds_config_changes=(), trainer_args=tuple(trainer_args),
                  note=note)


# --------------------------------------------------------------------------- prediction


def _predictor(verdict: Verdict, known: KnownPlan, partition: Partition, model: ModelRef | None) -> Predictor | None:
    """The one predictor (toolkit/predict.py) for this failure, with the job's software as its log and files state
    it; None when it can say nothing (neither a model nor enough numbers, or no known GPU capacity)."""
    runtime = job_runtime(verdict, known)
    # every plan hpcmem writes for an FSDP accumulation syncs each micro-batch (SYNC_EACH_BATCH in its flags)
    changed = replace(runtime, fsdp_no_sync=False) if runtime is not None and runtime.fsdp_no_sync else None
    pred = Predictor(partition, known.plan, verdict.numbers, model, runtime=runtime, changed_runtime=changed)
    if not pred.predicts or pred.target_mib is None:
        return None
    return pred


@dataclass(frozen=True)
class _Scored:
    plan: Plan
    peak: float | None
    fits: bool | None
    throughput: float
    """Relative samples per second against the failed plan (``planner.speed``)."""


def _score(plans: Iterable[Plan], pred: Predictor, model: ModelRef | None = None) -> list[_Scored]:
    base = planner.speed(pred.failed, pred.partition)
    out = []
    for plan in plans:
        peak = pred.peak(plan, model)
        fits = pred.fits(plan) if model is None else pred.fits(peak)  # the run's model: the planner's whole rule
        out.append(_Scored(plan, peak, fits, planner.speed(plan, pred.partition) / base))
    return out


def _candidates(start: Plan, failed: Plan, partition: Partition, allow: Iterable[str], model=None) -> list[Plan]:
    """The planner's candidates from ``start`` that only add memory savings to the failed plan (never a larger
    micro-batch, a lower ZeRO stage, less offload or fp32 again: the failed plan ran out of memory), without
    the failed plan itself, without flash attention in fp32 (its kernels are 16-bit only) and without an
    attention the model cannot run (``planner.candidate_plans``)."""
    plans = planner.candidate_plans(start, partition, allow, model)
    return [p for p in plans if _knobs(p) != _knobs(failed) and not _steps_back(failed, p)
            and not (p.attention == "flash" and p.precision == "fp32")]


def _steps_back(failed: Plan, plan: Plan) -> bool:
    """Whether ``plan`` undoes a memory saving ``failed`` already had."""
    return (plan.micro_batch > failed.micro_batch or plan.zero_stage < failed.zero_stage
            or (plan.precision == "fp32" and failed.precision != "fp32")
            or (plan.checkpointing < failed.checkpointing)
            or any(getattr(plan, k) == "none" != getattr(failed, k) for k in ("offload_optimizer", "offload_params")))


# --------------------------------------------------------------------------- GPU OOM


def _gpu(verdict: Verdict, known: KnownPlan, maker: "_Maker", allow: tuple, pred: Predictor,
         max_items: int) -> list[Remedy]:
    failed = known.plan.replace(time_min=min(known.plan.time_min, maker.partition.max_time_min))
    start, first = failed, []
    fragmented = verdict.kind == "gpu_oom_fragmentation" or pred.fragmented()
    if fragmented and "alloc_conf" in allow and EXPANDABLE not in failed.alloc_conf:
        start = failed.replace(alloc_conf=alloc_conf_value(failed.alloc_conf, EXPANDABLE))
        first = _score([start], pred)
    scored = [s for s in _score(_candidates(start, failed, maker.partition, allow, maker.model), pred)
              if s.plan != start]
    if not any(s.fits for s in scored + first) and "gpus" in allow:
        for wider in ladder.more_gpus(start, maker.partition):
            scored += _score([wider, *_candidates(wider, failed, maker.partition, allow, maker.model)], pred)
    fitting = [s for s in scored if s.fits]
    room = max_items - len(first)
    if fitting:
        chosen, last = _frontier(fitting)[:room], []
    else:
        last = [] if any(s.fits for s in first) else _last_resorts(start, failed, maker, allow, pred)
        chosen = _closest(scored)[:max(1, room - len(last))]
    out = [maker.remedy(failed, s.plan, s.peak, s.fits, note=_first_note(s, pred)) for s in first]
    out += [maker.remedy(failed, s.plan, s.peak, s.fits, note=_note(s, pred, failed)) for s in chosen]
    return out + last


def _frontier(scored: list[_Scored]) -> list[_Scored]:
    """Fastest first, keeping a slower one only when it needs less memory than every faster one."""
    out, least = [], float("inf")
    for s in sorted(scored, key=lambda s: (-round(s.throughput, 9), s.peak)):
        if s.peak < least - 1e-6:
            out.append(s)
            least = s.peak
    return out


def _closest(scored: list[_Scored]) -> list[_Scored]:
    """Least memory first, keeping a larger one only when it is faster than every smaller one."""
    out, fastest = [], 0.0
    for s in sorted(scored, key=lambda s: (s.peak, -s.throughput)):
        if s.throughput > fastest + 1e-9:
            out.append(s)
            fastest = s.throughput
    return out


def _first_note(s: _Scored, pred: Predictor) -> str:
    return ("The allocator gives idle reserved memory back instead of failing on fragmentation; no code change "
            "and no slowdown. " + _fit_text(s, pred)).strip()


def _note(s: _Scored, pred: Predictor, failed: Plan) -> str:
    parts = [_fit_text(s, pred)]
    if s.plan.world_size != failed.world_size:
        parts.append(f"Asks for {s.plan.world_size} GPUs instead of {failed.world_size} (global batch kept).")
    return " ".join(p for p in parts if p)


def _fit_text(s: _Scored, pred: Predictor) -> str:
    how = "the estimate corrected by the message's numbers" if pred.model is not None else "the message's numbers"
    if s.peak is None:
        return ""
    verdict = "fits" if s.fits else "does not fit"
    return (f"Predicted peak {s.peak / 1024:.1f} GiB per GPU ({how}) {verdict} under "
            f"{pred.target_mib / 1024:.1f} GiB ({MARGIN:.0%} margin).")


# --------------------------------------------------------------------------- last resorts


def _last_resorts(start: Plan, failed: Plan, maker: "_Maker", allow: tuple, pred: Predictor) -> list[Remedy]:
    """The last resorts that are predicted to fit: half the context, plain SGD, a smaller model."""
    out = []
    if start.seq_len >= 2:
        shorter = start.replace(seq_len=start.seq_len // 2)
        best = _fastest_fitting(_score([shorter, *_candidates(shorter, failed, maker.partition, allow, maker.model)],
                                       pred))
        if best is not None:
            out.append(maker.remedy(failed, best.plan, best.peak, True, changes_result=True,
                                    prefix=f"{LAST_RESORT}half the sequence length: ",
                                    note="Shorter samples change what the model learns. " + _fit_text(best, pred)))
    if start.optimizer != "sgd":
        sgd = start.replace(optimizer="sgd")
        keep = [a for a in allow if a != "optimizer"]
        best = _fastest_fitting(_score([sgd, *_candidates(sgd, failed, maker.partition, keep, maker.model)], pred))
        if best is not None:
            out.append(maker.remedy(failed, best.plan, best.peak, True, changes_result=True,
                                    prefix=f"{LAST_RESORT}plain SGD: ",
                                    note="SGD (momentum) instead of AdamW needs other learning rates and "
                                         "converges differently. " + _fit_text(best, pred)))
    smaller = _smaller_model(start, failed, maker, allow, pred)
    if smaller is not None:
        out.append(smaller)
    return out


def _fastest_fitting(scored: list[_Scored]) -> _Scored | None:
    fitting = _frontier([s for s in scored if s.fits])
    return fitting[0] if fitting else None


def _smaller_model(start: Plan, failed: Plan, maker: "_Maker", allow: tuple, pred: Predictor) -> Remedy | None:
    """The same model with the most layers that fit (with the plan that needs least memory), model known only."""
    model = pred.model
    key = next((k for k in _LAYER_KEYS if model is not None and model.config.get(k)), None)
    if key is None:
        return None
    layers = int(model.config[key])
    scored = _score([start, *_candidates(start, failed, maker.partition, allow, maker.model)], pred)
    leanest = min(scored, key=lambda s: s.peak).plan

    def with_layers(n: int) -> ModelRef:
        return replace(model, config={**model.config, key: n})

    low, high = 0, layers - 1  # the largest n in [1, layers - 1] whose leanest plan fits; 0: none
    while low < high:
        mid = (low + high + 1) // 2
        if pred.fits(pred.peak(leanest, with_layers(mid))):
            low = mid
        else:
            high = mid - 1
    if low < 1:
        return None
    small = with_layers(low)
    best = _fastest_fitting(_score([start, *_candidates(start, failed, maker.partition, allow, maker.model)], pred,
                                   small))
    if best is None:
        return None
    params = _params(model), _params(small)
    size = f" (about {params[1] / 1e6:.0f}M parameters instead of {params[0] / 1e6:.0f}M)" if all(params) else ""
    return maker.remedy(failed, best.plan, best.peak, True, changes_result=True,
                        prefix=f"{LAST_RESORT}a smaller model, {low} of its {layers} layers{size}: ",
                        note=f"Set {key}: {low} in the model config. " + _fit_text(best, pred))


def _params(model: ModelRef) -> int | None:
    try:
        return ModelShape.from_config(model.config, task=model.task, num_labels=model.num_labels).n_params
    except (HpcmemError, KeyError, TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- the ladder, walked


def _walk(verdict: Verdict, known: KnownPlan, maker: "_Maker", allow: tuple, max_items: int,
          host: bool) -> list[Remedy]:
    """The ladder's moves in order, each on top of the one before, unpredicted (host memory, or a GPU OOM with
    neither a model nor numbers, or an unknown plan). Consecutive micro-batch halvings count as one step."""
    failed = known.plan.replace(time_min=min(known.plan.time_min, maker.partition.max_time_min))
    said = verdict if host else Verdict(verdict.kind, reason=verdict.reason)  # without numbers: one rung a step
    moves = [a for a in allow if a in ladder.ALLOW_NAMES]
    out, plan, tried, previous = [], failed, [], ()
    why = _walk_note(known, host)
    while len(out) < max_items:
        d = ladder.next_plan(plan, said, maker.partition, allow=moves, tried=tried, attempts_made=1, max_attempts=2)
        if d.action != "retry":
            break
        if attention_refusal(maker.model, d.plan):  # a rung the model cannot run (Gemma 2 on sdpa): the next one
            tried.append(d.plan)
            continue
        tried.append(plan)
        step = ladder.move_names(plan, d.plan)
        plan = d.plan
        if out and _same_knob(step, previous):
            continue
        previous = step
        new = plan if "time_min" in known.given else plan.replace(time_min=failed.time_min)
        more = " On top of the remedy before: for when that one is not enough." if out else ""
        remedy = maker.remedy(failed, new, None, None, note=(why + more).strip(), scale_time=False)
        out.append(remedy if known.known else replace(remedy, plan=None))  # no plan of the job's to show
    return out


def _same_knob(step: tuple, previous: tuple) -> bool:
    """Both steps change the same one knob (micro-batch halved again, --mem raised again)."""
    knobs = {m.split(":")[0] for m in step}
    return len(knobs) == 1 and knobs == {m.split(":")[0] for m in previous}


def _walk_note(known: KnownPlan, host: bool) -> str:
    if host:
        return "Host memory: the need is not predicted; --mem is capped at the node's memory less a reserve."
    if not known.known:
        return "Peak not predicted: the knob values are relative to assumed defaults."
    return ("Neither the model nor the message's numbers are known: the peak is not predicted; "
            "the ladder's moves in order, cheapest first. " + known.note).strip()


# --------------------------------------------------------------------------- another process


def _other_process(verdict: Verdict, maker: "_Maker") -> Remedy:
    n = verdict.numbers
    other = n.get("other_process_mib", 0.0)
    demand = Predictor(maker.partition, maker.known.plan, n).demand_mib
    total = n.get("total_capacity_mib", maker.partition.gpu_mem_gib * 1024)
    fits = None if demand is None else demand <= total * (1 - MARGIN)  # alone on the GPU: the whole card
    held = f" {other / 1024:.1f} GiB" if other else ""
    argv = maker.submit_argv(())
    return Remedy(
        title=f"Another process holds{held} of the GPU: run with the GPU to yourself",
        moves=(), plan=maker.known.plan if maker.known.known else None, predicted_peak_mib=demand, fits=fits,
        slowdown=1.0, set_args=(), submit_command=shlex.join(argv),
        script_changes=("#SBATCH --exclusive (the whole node), or ask the admins for the GPUs' EXCLUSIVE_PROCESS "
                        "compute mode",),
        ds_config_changes=(), trainer_args=(),
        note=("No memory move: alone on the GPU the job would have had the memory it asked for. On the node "
              "(srun --jobid=JOBID --overlap nvidia-smi) see which process holds it: a stray process of an "
              "earlier job, a second copy of the training started by mistake (a launcher inside a launcher), "
              "or another job sharing the GPU."),
    )


# --------------------------------------------------------------------------- a remedy from a plan change


@dataclass(frozen=True)
class _Maker:
    """Turns a new plan into a Remedy: title, --set knobs, command, and the lines that change."""

    partition: Partition
    known: KnownPlan
    model: ModelRef | None
    spec: str | None
    site: str | None
    base: Plan

    def remedy(self, failed: Plan, plan: Plan, peak: float | None, fits: bool | None, *, note: str = "",
               changes_result: bool = False, prefix: str = "", scale_time: bool = True) -> Remedy:
        if scale_time and "time_min" in self.known.given:
            plan = ladder.scale_time(failed, plan, self.partition)
        sets = set_args(self.base, plan)
        if self.known.note and self.known.note not in note:
            note = f"{note} {self.known.note}".strip()
        return Remedy(
            title=prefix + title(failed, plan),
            moves=ladder.move_names(failed, plan), plan=plan, predicted_peak_mib=peak, fits=fits,
            slowdown=_slowdown(failed, plan, self.partition),
            set_args=sets, submit_command=shlex.join(self.submit_argv(sets)),
            script_changes=script_changes(failed, plan, self.partition),
            ds_config_changes=ds_config_changes(failed, plan, self.partition, self._largest_param()),
            trainer_args=self.trainer_args(failed, plan), changes_result=changes_result, note=note)

    def trainer_args(self, failed: Plan, plan: Plan) -> tuple[str, ...]:
        """The HF Trainer flags to change, against the job's own ``--accelerator_config`` where its flags were read."""
        known = self.known
        if known.accelerator_config is None and "fsdp_no_sync" not in known.runtime:
            return trainer_arg_changes(failed, plan)
        return trainer_arg_changes(failed, plan, accelerator_config=known.accelerator_config)

    def submit_argv(self, sets: Iterable[str]) -> list[str]:
        argv = ["hpcmem", "submit", self.spec or "SPEC", "--site", self.site or self.partition.site,
                "--partition", self.partition.name]
        for item in sets:
            argv += ["--set", item]
        return argv

    def _largest_param(self) -> int | None:
        if self.model is None:
            return None
        try:
            return largest_param_numel(self.model.config)
        except (HpcmemError, KeyError, TypeError, ValueError):
            return None


def _slowdown(before: Plan, after: Plan, partition: Partition) -> float:
    """Relative time per sample: ``planner.speed`` of both, and the cost of fewer data-loader workers."""
    x = planner.speed(before, partition) / planner.speed(after, partition)
    if after.workers < before.workers:
        x *= ladder.WORKERS_PER_HALVING ** math.log2(before.workers / (after.workers or 0.5))
    return x


def set_args(base: Plan, plan: Plan) -> tuple[str, ...]:
    """``knob=value`` for every knob of ``plan`` that differs from ``base`` (``grad_accum`` and
    ``global_batch`` follow from the others), in knob order."""
    out = []
    for name in KNOBS:
        if name in ("grad_accum", "global_batch"):
            continue
        value = getattr(plan, name)
        if value != getattr(base, name):
            out.append(f"{name}={_text(value)}")
    out_plan = with_changes(base, parse_sets(out))
    if out_plan.grad_accum != plan.grad_accum or out_plan.global_batch != plan.global_batch:
        out.append(f"grad_accum={plan.grad_accum}")  # only when it does not follow (a base of another shape)
    return tuple(out)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else str(value)


def _knobs(plan: Plan) -> tuple:
    return tuple((k, v) for k, v in plan.to_dict().items() if k != "time_min")
