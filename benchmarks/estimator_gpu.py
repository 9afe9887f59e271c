"""The memory estimator against published GPU measurements (issue 11, item 5).

    python benchmarks/estimator_gpu.py [--traced] [--json] [--data DIR] [--only TEXT]

Every ``*.json`` file in ``benchmarks/data/`` (see its README.md) is one public source: a
model (a transformers config), a GPU, what was measured (``nvidia_smi_used``,
``max_reserved`` or ``max_allocated``) and rows of plans with the measured MiB. For each
row this builds the hpcmem ``Plan``, the model and a ``Partition`` for the row's card (its
CUDA context when the source measured one), runs the estimator and compares like with like:

- ``nvidia_smi_used``  with ``Estimate.device_used_mib`` (context + reserved);
- ``max_reserved``     with ``Estimate.peak_reserved_mib`` when the estimator has that field,
                       otherwise with the allocated peak plus the estimator's own
                       ``allocator_overhead`` component (said so in the output);
- ``max_allocated``    with ``Estimate.peak_allocated_mib``.

Prints one line per row and a summary per method: over all rows, over the rows without a
gap (see below), over the in-sample and the held-out sources (a source with ``"held_out": true``:
rows the estimator was not developed against) and per source (median |error|, max |error|, worst
under-prediction, rows under by more than 5 %). ``--traced`` adds the
traced method (a fake-tensor step per row: slower). Rows that use something the Plan
vocabulary cannot say are still scored with the nearest plan, and the gap is listed under the
row: the script uses the richest vocabulary the current ``toolkit/plan.py`` has (an ``fsdp``
launcher, ``adamw-fused``, ``adamw-perparam``, ``sgd-plain`` ... when they exist there; FSDP as
DeepSpeed ZeRO and the coarse optimizer names when not).

A source may be a ``stand_in``: a config of a known family with the same parameter tensors as the real model,
whose family the estimator does not know; every row then carries it as a gap.

A row may state the job's ``PYTORCH_CUDA_ALLOC_CONF`` as ``alloc_conf`` (e.g. ``"expandable_segments:True"``):
it becomes the Plan's ``alloc_conf``, under which the estimator's caching-allocator model replays the step, and is
shown in the row's setup label.

Exit status 0 (this is a report), or 2 with one line naming the file and the field when a
data file is malformed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from toolkit.errors import HpcmemError  # noqa: E402
from toolkit.modelshape import TASKS, ModelShape  # noqa: E402
from toolkit.plan import ATTENTIONS, OFFLOADS, PRECISIONS, Plan  # noqa: E402
from toolkit.plan import LAUNCHERS as PLAN_LAUNCHERS  # noqa: E402
from toolkit.plan import OPTIMIZERS as PLAN_OPTIMIZERS  # noqa: E402
from toolkit.sites import Partition  # noqa: E402
from toolkit.strategies.fsdp import REDUCE_DTYPES  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent / "data"
MEASURES = ("max_allocated", "max_reserved", "nvidia_smi_used")
LAUNCHERS = ("torchrun", "deepspeed", "fsdp")
UNDER_FLAG_PCT = 5.0
EXACT = "EXACT (rows without a gap)"
"""Summary group of the rows whose setup the Plan vocabulary states exactly."""
IN_SAMPLE = "IN-SAMPLE (sources the estimator was developed against)"
HELD_OUT = "HELD OUT (sources marked held_out)"
"""Summary groups: a source with ``"held_out": true`` was added after the estimator's last change and was
not used to develop it; its rows are summarized apart so that the in-sample figures do not hide them."""
DEFAULT_CONTEXT_MIB = 500.0
"""CUDA context given to a partition when the source did not measure one (it only enters device_used)."""

# The Plan optimizer that names each implementation, when the Plan vocabulary has it (toolkit/optimizers.py);
# otherwise the row's coarse ``optimizer`` is used and the difference is listed as a gap. Under the older
# vocabulary (adamw, adamw-8bit, adafactor, sgd) the estimator modelled torch's foreach AdamW, SGD with a
# momentum buffer, factored Adafactor and bitsandbytes 8-bit.
IMPL_PLAN_NAME = {"torch-foreach": "adamw", "torch-fused": "adamw-fused", "per-parameter": "adamw-perparam",
                  "bnb-8bit": "adamw-8bit", "bnb-8bit-paged": "adamw-8bit-paged", "adafactor-factored": "adafactor",
                  "adafactor-momentum": "adafactor-momentum", "sgd-momentum": "sgd",
                  "sgd-plain-foreach": "sgd-plain", "sgd-plain-per-parameter": "sgd-plain"}
OLD_VOCAB_IMPL = {"adamw": "torch-foreach", "sgd": "sgd-momentum", "adafactor": "adafactor-factored",
                  "adamw-8bit": "bnb-8bit"}

TOP_FIELDS = {"source": str, "title": str, "retrieved": str, "quote": str, "setup": str, "measured": str,
              "task": str, "gpu": str, "rows": list}
ROW_FIELDS = {"micro_batch": int, "grad_accum": int, "seq_len": int, "precision": str, "optimizer": str,
              "optimizer_impl": str, "checkpointing": bool, "attention": str, "launcher": str, "gpus": int,
              "zero_stage": int, "offload_optimizer": str, "offload_params": str, "measured_mib": (int, float),
              "quote": str, "inferred": str}
COARSE_OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor", "sgd")
"""The data's ``optimizer`` field: the family; ``optimizer_impl`` says which implementation ran."""
ROW_CHOICES = {"precision": PRECISIONS, "optimizer": COARSE_OPTIMIZERS, "attention": ATTENTIONS, "launcher": LAUNCHERS,
               "offload_optimizer": OFFLOADS, "offload_params": OFFLOADS}


class DataError(Exception):
    """A malformed data file: the message names the file and the field."""


@dataclass
class Source:
    path: Path
    doc: dict

    @property
    def name(self) -> str:
        return self.path.stem


@dataclass
class Case:
    """One measured row, ready to estimate."""

    source: Source
    index: int
    row: dict
    plan: Plan
    shape: ModelShape
    partition: Partition
    gaps: list[str] = field(default_factory=list)
    runtime: Any = None
    """``estimate.gpu.Runtime`` from the source's ``runtime`` facts (None: hpcmem's own runtime)."""

    @property
    def label(self) -> str:
        r = self.row
        bits = [f"mb{r['micro_batch']}"]
        if r["grad_accum"] > 1:
            bits.append(f"ga{r['grad_accum']}")
        if self.shape.seq_len is None:
            bits.append(f"s{r['seq_len']}")
        bits += [r["precision"], r["optimizer_impl"] if r["optimizer_impl"] else r["optimizer"]]
        if r["checkpointing"]:
            bits.append("ckpt")
        bits.append(r["attention"])
        if r["gpus"] > 1 or r["launcher"] != "torchrun":
            shard = f"{r['launcher']}x{r['gpus']}"
            if r["zero_stage"]:
                shard += f"-z{r['zero_stage']}"
            if r["offload_optimizer"] != "none" or r["offload_params"] != "none":
                shard += "-offload"
            bits.append(shard)
        if r.get("alloc_conf"):
            bits.append(f"alloc_conf={r['alloc_conf']}")
        return " ".join(bits)


# -- loading and checking ---------------------------------------------------------------------------


def _need(where: str, obj: dict, name: str, kind) -> Any:
    if name not in obj:
        raise DataError(f"{where}.{name}: missing")
    value = obj[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise DataError(f"{where}.{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise DataError(f"{where}.{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def load_sources(data_dir: Path = DATA_DIR) -> list[Source]:
    """Every data file, checked field by field (DataError names the file and the field)."""
    files = sorted(Path(data_dir).glob("*.json"))
    if not files:
        raise DataError(f"{data_dir}: no *.json data files")
    sources = []
    for path in files:
        try:
            doc = json.loads(path.read_text())
        except ValueError as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise DataError(f"{path}: expected a JSON object at the top")
        check_source(path, doc)
        sources.append(Source(path, doc))
    return sources


def check_source(path: Path, doc: dict) -> None:
    where = str(path)
    for name, kind in TOP_FIELDS.items():
        _need(where, doc, name, kind)
    if doc["measured"] not in MEASURES:
        raise DataError(f"{where}.measured: must be one of {', '.join(MEASURES)}; got {doc['measured']!r}")
    if doc["task"] not in TASKS:
        raise DataError(f"{where}.task: must be one of {', '.join(TASKS)}; got {doc['task']!r}")
    if not isinstance(doc.get("model_config"), dict):
        raise DataError(f"{where}.model_config: a transformers config dict is needed (no weights are fetched here)")
    for name in ("context_mib", "gpu_mem_gib"):
        if name not in doc:
            raise DataError(f"{where}.{name}: missing (null when unknown)")
    if "stand_in" in doc and (not isinstance(doc["stand_in"], str) or not doc["stand_in"].strip()):
        raise DataError(f"{where}.stand_in: expected prose saying which model the config stands in for, "
                        f"got {doc['stand_in']!r}")
    if "held_out" in doc and not isinstance(doc["held_out"], bool):
        raise DataError(f"{where}.held_out: expected true or false, got {doc['held_out']!r}")
    if doc["context_mib"] is not None and not isinstance(doc["context_mib"], (int, float)):
        raise DataError(f"{where}.context_mib: expected a number or null, got {doc['context_mib']!r}")
    runtime_of(path, doc)
    if doc["measured"] == "nvidia_smi_used" and doc["context_mib"] is None:
        raise DataError(f"{where}.context_mib: an nvidia-smi measurement needs the CUDA context it includes")
    if not isinstance(doc["gpu_mem_gib"], (int, float)) or isinstance(doc["gpu_mem_gib"], bool) or doc["gpu_mem_gib"] <= 0:
        raise DataError(f"{where}.gpu_mem_gib: expected a positive number, got {doc['gpu_mem_gib']!r}")
    if not doc["rows"]:
        raise DataError(f"{where}.rows: empty")
    for i, row in enumerate(doc["rows"]):
        rw = f"{where}.rows[{i}]"
        if not isinstance(row, dict):
            raise DataError(f"{rw}: expected an object")
        for name, kind in ROW_FIELDS.items():
            _need(rw, row, name, kind)
        for name, choices in ROW_CHOICES.items():
            if row[name] not in choices:
                raise DataError(f"{rw}.{name}: must be one of {', '.join(choices)}; got {row[name]!r}")
        for name in ("micro_batch", "grad_accum", "seq_len", "gpus"):
            if row[name] < 1:
                raise DataError(f"{rw}.{name}: must be at least 1, got {row[name]}")
        if row["measured_mib"] <= 0:
            raise DataError(f"{rw}.measured_mib: must be positive, got {row['measured_mib']}")
        if not row["quote"].strip():
            raise DataError(f"{rw}.quote: empty")
        if "alloc_conf" in row and not isinstance(row["alloc_conf"], str):
            raise DataError(f"{rw}.alloc_conf: expected a string (PYTORCH_CUDA_ALLOC_CONF as the job set it), "
                            f"got {row['alloc_conf']!r}")
        if "reduce_dtype" in row and row["reduce_dtype"] not in REDUCE_DTYPES:
            raise DataError(f"{rw}.reduce_dtype: must be one of {', '.join(REDUCE_DTYPES)}; "
                            f"got {row['reduce_dtype']!r}")
        runtime_of(path, doc, row, rw)


RUNTIME_FIELDS = {"torch_version": str, "logits_fp32": bool, "grads_set_to_none": bool, "cublas_workspace_config": str,
                  "zero_grad": str, "model_code": str, "sdpa_repeats_kv": bool, "shifted_logits_copy": str,
                  "output_kept": str, "loss_chunk_rows": int, "rotary_tables": bool,
                  "zero3_linear_wrapped": bool, "logits_upcast_in_model": bool, "deepspeed_version": str,
                  "fsdp_limit_all_gathers": bool, "fsdp_use_orig_params": bool, "fsdp_no_sync": bool, "fsdp_api": str,
                  "fsdp_embedding_unit": bool, "fsdp_keep_last_block": bool,
                  "eager_clamps_scores": bool,
                  "ddp_side_stream": bool, "ddp_single_process": bool, "engine_config": dict}


def runtime_of(path: Path, doc: dict, row: dict | None = None, where: str | None = None):
    """The source's ``runtime`` facts (what its software did that changes memory: torch version, a loss on
    16-bit logits, where the loop calls zero_grad ...), updated by the row's own ``runtime`` when it has
    one (scripts of one source can differ), as an ``estimate.gpu.Runtime``; None when neither states any.
    ``note`` is prose."""
    from toolkit.estimate.gpu import Runtime

    kwargs = {}
    for at, facts in ((str(path), doc.get("runtime")), (where or str(path), (row or {}).get("runtime"))):
        if facts is None:
            continue
        if not isinstance(facts, dict):
            raise DataError(f"{at}.runtime: expected an object, got {facts!r}")
        for name, value in facts.items():
            if name == "note":
                continue
            if name not in RUNTIME_FIELDS:
                raise DataError(f"{at}.runtime.{name}: unknown; known: {', '.join(RUNTIME_FIELDS)}, note")
            if not isinstance(value, RUNTIME_FIELDS[name]) or isinstance(value, bool) != (RUNTIME_FIELDS[name] is bool):
                raise DataError(f"{at}.runtime.{name}: expected {RUNTIME_FIELDS[name].__name__}, got {value!r}")
            kwargs[name] = value
    if not kwargs:
        return None
    try:
        return Runtime(**kwargs)
    except ValueError as exc:
        raise DataError(f"{where or path}.runtime: {exc}") from None


def build_case(source: Source, index: int) -> Case:
    """The Plan, model shape and partition of one row (DataError names what does not build)."""
    doc, row = source.doc, source.doc["rows"][index]
    where = f"{source.path}.rows[{index}]"
    gaps: list[str] = [f"stand-in model: {doc['stand_in']}"] if doc.get("stand_in") else []
    if row["launcher"] == "torchrun" and row["zero_stage"]:
        raise DataError(f"{where}.zero_stage: {row['zero_stage']} needs launcher deepspeed or fsdp")
    optimizer, gap = plan_optimizer(row)
    if gap:
        gaps.append(gap)
    alloc_conf = row_alloc_conf(row, where)
    knobs = dict(nodes=1, gpus_per_node=row["gpus"], global_batch=row["micro_batch"] * row["grad_accum"] * row["gpus"],
                 micro_batch=row["micro_batch"], grad_accum=row["grad_accum"], seq_len=row["seq_len"],
                 precision=row["precision"], optimizer=optimizer, checkpointing=row["checkpointing"],
                 attention=row["attention"])
    if alloc_conf:
        knobs["alloc_conf"] = alloc_conf
    plan = None
    runtime = runtime_of(source.path, doc, row, where)
    if row["launcher"] == "fsdp" and "fsdp" in PLAN_LAUNCHERS:
        plan, gap = fsdp_plan(row, knobs, where, flat=runtime is not None and runtime.fsdp_flat_params)
        gaps.extend(gap)
    if plan is None:
        launcher = "deepspeed" if row["launcher"] == "fsdp" else row["launcher"]
        if row["launcher"] == "fsdp":
            gaps.append(f"FSDP scored as DeepSpeed ZeRO-{row['zero_stage']} (the Plan has no fsdp launcher)")
            if row["precision"] == "bf16-true":
                gaps.append("FSDP bf16-true keeps no fp32 master copy; the DeepSpeed model adds one")
        try:
            plan = Plan(launcher=launcher, zero_stage=row["zero_stage"], offload_optimizer=row["offload_optimizer"],
                        offload_params=row["offload_params"], **knobs)
        except HpcmemError as exc:
            raise DataError(f"{where}: the row does not make a Plan: {exc}") from None
    try:
        shape = ModelShape.from_config(doc["model_config"], task=doc["task"], num_labels=doc.get("num_labels"))
    except HpcmemError as exc:
        raise DataError(f"{source.path}.model_config: {exc}") from None
    partition = gpu_partition(source, row["gpus"])
    try:
        partition.check_plan(plan)
    except HpcmemError as exc:
        raise DataError(f"{where}: the row's plan cannot run on {doc['gpu']}: {exc}") from None
    return Case(source, index, row, plan, shape, partition, gaps, runtime)


def row_alloc_conf(row: dict, where: str) -> str:
    """The row's ``alloc_conf`` (PYTORCH_CUDA_ALLOC_CONF as the job set it; "" when the row has none), checked
    the way the Plan checks it (``toolkit.plan.check_alloc_conf``, which ``Plan.__post_init__`` calls) and the
    way the estimator's allocator model reads it (``parse_alloc_conf``), so that a bad value is a DataError
    naming the row's field rather than a Plan refusal or a failed estimate."""
    value = row.get("alloc_conf", "")
    if not isinstance(value, str):
        raise DataError(f"{where}.alloc_conf: expected a string, got {value!r}")
    if not value:
        return ""
    from toolkit.estimate.allocator import parse_alloc_conf
    from toolkit.plan import check_alloc_conf

    try:
        check_alloc_conf(value)
        parse_alloc_conf(value)
    except HpcmemError as exc:
        raise DataError(f"{where}.alloc_conf: {exc}") from None
    return value


def plan_optimizer(row: dict) -> tuple[str, str | None]:
    """The Plan optimizer for the row's implementation, and the gap when the vocabulary cannot name it."""
    impl = row["optimizer_impl"]
    named = IMPL_PLAN_NAME.get(impl)
    if named in PLAN_OPTIMIZERS:
        return named, None
    modelled = OLD_VOCAB_IMPL.get(row["optimizer"], row["optimizer"])
    if impl == modelled:
        return row["optimizer"], None
    return row["optimizer"], f"optimizer {row['optimizer']} runs as {impl}; the Plan's {row['optimizer']} is {modelled}"


def fsdp_plan(row: dict, knobs: dict, where: str, flat: bool = True) -> tuple[Plan | None, list[str]]:
    """A launcher=fsdp Plan (FULL_SHARD: reshard after forward; SHARD_GRAD_OP: keep), or None when the
    Plan refuses the row (then it is scored as DeepSpeed ZeRO and the refusal is a gap). ``flat``: the row ran
    FSDP1 (its runtime's ``fsdp_flat_params``: ``fsdp_api`` fsdp1, or a torch before 2.4), which hpcmem's own launcher is not (a gap)."""
    names = {f.name for f in dataclasses.fields(Plan)}
    extra = {}
    if "reshard_after_forward" in names:
        extra["reshard_after_forward"] = row["zero_stage"] == 3
    elif row["zero_stage"] == 2:
        return None, ["the Plan's fsdp launcher has no SHARD_GRAD_OP (reshard_after_forward) knob"]
    offload = "cpu" if "cpu" in (row["offload_params"], row["offload_optimizer"]) else "none"
    if "reduce_dtype" in row:
        extra["reduce_dtype"] = row["reduce_dtype"]
    try:
        plan = Plan(launcher="fsdp", offload_params=offload, **knobs, **extra)
    except HpcmemError as exc:
        return None, [f"the Plan refused launcher=fsdp for this row ({exc})"]
    if not flat:
        return plan, []
    return plan, ["measured with FSDP1 (flat parameters; estimated as FSDP1: the row's fsdp_api, or its torch before 2.4); "
                  "hpcmem's fsdp launcher is FSDP2"]


def gpu_partition(source: Source, gpus: int) -> Partition:
    """A one-node partition with the source's card and, when measured, its CUDA context.

    It starts from the shipped example site's partition of the same GPU family (so it has
    whatever fields and capabilities ``Partition`` has today) and replaces the card, its
    memory, the GPU count and the context; calibration is cleared.
    """
    doc = source.doc
    template = _family_template(doc["gpu"], f"{source.path}.gpu")
    context = doc["context_mib"] if doc["context_mib"] is not None else DEFAULT_CONTEXT_MIB
    changes = {"site": "published", "name": source.name, "gpu_model": doc["gpu"],
               "gpu_mem_gib": float(doc["gpu_mem_gib"]), "gpus_per_node": max(8, gpus),
               "cuda_context_mib": float(context), "allocator_overhead_frac": None, "calibrated": False,
               "host_mem_gib": max(template.host_mem_gib, 1024.0), "max_time_min": 10**6}
    names = {f.name for f in dataclasses.fields(Partition)}
    return dataclasses.replace(template, **{k: v for k, v in changes.items() if k in names})


_FAMILIES = (("V100", "v100-16gb"), ("A100", "a100-80gb"), ("H100", "a100-80gb"), ("H200", "a100-80gb"),
             ("RTX 40", "a100-80gb"))
"""GPU family -> the example site's partition used as the template (the card, its memory and the context are
replaced; an Ada GeForce card takes the A100 template: bf16-capable, not Hopper, so the same cuBLAS workspace)."""


def _family_template(gpu: str, where: str) -> Partition:
    from toolkit.sites import load_site_file

    for family, name in _FAMILIES:
        if family in gpu.upper():
            site = load_site_file(REPO / "site_configs" / "example-hpc.yaml")
            return site.partitions[name]
    raise DataError(f"{where}: {gpu!r} is not a card this benchmark has a template for "
                    f"({', '.join(f for f, _ in _FAMILIES)})")


def load_cases(data_dir: Path = DATA_DIR) -> list[Case]:
    return [build_case(s, i) for s in load_sources(data_dir) for i in range(len(s.doc["rows"]))]


# -- scoring ------------------------------------------------------------------------------------------


def predicted_mib(est, measured: str) -> tuple[float, str]:
    """The estimate's figure that is like the measurement, and how it was obtained."""
    if measured == "nvidia_smi_used":
        return est.device_used_mib, "device_used_mib"
    if measured == "max_allocated":
        return est.peak_allocated_mib, "peak_allocated_mib"
    reserved = getattr(est, "peak_reserved_mib", None)
    if reserved is not None:
        return reserved, "peak_reserved_mib"
    return (est.peak_allocated_mib + est.components.get("allocator_overhead", 0.0),
            "peak_allocated_mib + allocator_overhead (the Estimate has no peak_reserved_mib)")


def score(cases: list[Case], methods: tuple[str, ...]) -> list[dict]:
    from toolkit.estimate import ModelRef, estimate

    out = []
    for case in cases:
        doc = case.source.doc
        ref = ModelRef(doc["model_config"], doc["task"], doc.get("num_labels"), doc.get("model") or case.source.name)
        for method in methods:
            t0 = time.perf_counter()
            try:
                est = estimate(ref, case.plan, case.partition, method, runtime=case.runtime)
            except Exception as exc:  # a report: one failed row must not hide the others
                out.append(_result(case, method, None, f"estimate failed: {type(exc).__name__}: {exc}",
                                   time.perf_counter() - t0))
                continue
            pred, how = predicted_mib(est, doc["measured"])
            out.append(_result(case, method, pred, how, time.perf_counter() - t0, est))
    return out


def _result(case: Case, method: str, pred: float | None, how: str, secs: float, est=None) -> dict:
    measured = float(case.row["measured_mib"])
    err = None if pred is None else 100.0 * (pred - measured) / measured
    return {"source": case.source.name, "held_out": bool(case.source.doc.get("held_out", False)), "row": case.index,
            "setup": case.label, "gpu": case.source.doc["gpu"],
            "method": method, "measured": case.source.doc["measured"], "measured_mib": measured,
            "predicted_mib": pred, "compared": how, "error_pct": err, "seconds": round(secs, 3),
            "gaps": case.gaps, "peak_allocated_mib": None if est is None else est.peak_allocated_mib,
            "device_used_mib": None if est is None else est.device_used_mib}


def summarize(results: list[dict]) -> list[dict]:
    """Per method, over all rows, over the rows without a gap, over the in-sample and the held-out sources
    and per source: median/max |error|, worst under-prediction, rows under by more than 5 %."""
    groups: dict[tuple[str, str], list[float]] = {}
    failed: dict[tuple[str, str], int] = {}
    for r in results:
        keys = [(r["method"], "ALL"), (r["method"], HELD_OUT if r.get("held_out") else IN_SAMPLE),
                (r["method"], r["source"])]
        if not r["gaps"]:
            keys.append((r["method"], EXACT))
        for key in keys:
            if r["error_pct"] is None:
                failed[key] = failed.get(key, 0) + 1
            else:
                groups.setdefault(key, []).append(r["error_pct"])
    out = []
    order = {"ALL": 0, EXACT: 1, IN_SAMPLE: 2, HELD_OUT: 3}
    held = {r["source"] for r in results if r.get("held_out")}
    for (method, source), errs in sorted(groups.items(),
                                         key=lambda kv: (kv[0][0], order.get(kv[0][1], 4 + (kv[0][1] in held)), kv[0][1])):
        absolute = [abs(e) for e in errs]
        out.append({"method": method, "source": source, "held_out": source in held or source == HELD_OUT,
                    "rows": len(errs), "failed": failed.get((method, source), 0),
                    "median_abs_pct": statistics.median(absolute), "max_abs_pct": max(absolute),
                    "worst_under_pct": min(min(errs), 0.0),
                    "under_gt_5pct": sum(1 for e in errs if e < -UNDER_FLAG_PCT)})
    return out


# -- output ---------------------------------------------------------------------------------------------


def print_report(results: list[dict], summary: list[dict]) -> None:
    print(f"{'source':<42} {'setup':<58} {'method':<8} {'measured':<15} {'meas MiB':>9} {'pred MiB':>9} {'err %':>7}")
    notes_seen = set()
    for r in results:
        pred = "-" if r["predicted_mib"] is None else f"{r['predicted_mib']:,.0f}"
        err = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}"
        print(f"{r['source']:<42} {r['setup']:<58} {r['method']:<8} {r['measured']:<15} "
              f"{r['measured_mib']:>9,.0f} {pred:>9} {err:>7}")
        if r["error_pct"] is None:
            print(f"    {r['compared']}")
        for gap in r["gaps"]:
            if r["method"] == results[0]["method"]:
                print(f"    gap: {gap}")
        if r["compared"].startswith("peak_allocated_mib +") and r["compared"] not in notes_seen:
            notes_seen.add(r["compared"])
    for how in sorted(notes_seen):
        print(f"\nnote: max_reserved rows compared with {how}")
    print(f"\n{'method':<8} {'source (* held out)':<56} {'rows':>4} {'median|e|%':>10} {'max|e|%':>8} {'worst under%':>12} "
          f"{'under>5%':>8}")
    for s in summary:
        fail = f"  ({s['failed']} failed)" if s["failed"] else ""
        name = s["source"] + (" *" if s["held_out"] and s["source"] != HELD_OUT else "")
        print(f"{s['method']:<8} {name:<56} {s['rows']:>4} {s['median_abs_pct']:>10.1f} {s['max_abs_pct']:>8.1f} "
              f"{s['worst_under_pct']:>12.1f} {s['under_gt_5pct']:>8}{fail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traced", action="store_true", help="also run the traced method (fake-tensor steps: slower)")
    parser.add_argument("--json", action="store_true", help="machine output: rows and summary as one JSON object")
    parser.add_argument("--data", type=Path, default=DATA_DIR, help="directory of data files (default benchmarks/data)")
    parser.add_argument("--only", metavar="TEXT", help="score only the rows whose source name or setup contains TEXT "
                        "(e.g. a source, 'fp32', 'mb4'): for the slow --traced method")
    args = parser.parse_args(argv)
    try:
        cases = load_cases(args.data)
    except DataError as exc:
        print(f"estimator_gpu: {exc}", file=sys.stderr)
        return 2
    if args.only:
        cases = [c for c in cases if args.only in c.source.name or args.only in c.label]
        if not cases:
            print(f"estimator_gpu: --only {args.only!r}: no row's source or setup contains it", file=sys.stderr)
            return 2
    methods = ("analytic", "traced") if args.traced else ("analytic",)
    results = score(cases, methods)
    summary = summarize(results)
    if args.json:
        json.dump({"rows": results, "summary": summary}, sys.stdout, indent=1)
        print()
    else:
        print_report(results, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
