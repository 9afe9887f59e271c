"""Calibration: measure a partition for real and keep the numbers beside its site profile.

``hpcmem calibrate --site S --partition P`` runs ``probe`` on the partition (a
Python function submitted through submitit on Slurm; in-process for the local
site) and writes what it measured to ``<site>.calibration.yaml`` beside the site
profile (or under ``$HPCMEM_HOME/calibration/`` when that directory is not
writable). ``sites.load_site_file`` applies it: the estimator then uses the
measured CUDA context and allocator overhead instead of the profile's guesses.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from .errors import HpcmemError, SchedulerError
from .files import write_atomic
from .devices import gpu_has_bf16, nvml_process_used_bytes, nvml_used_bytes, visible_nvml_handle
from .resources import data_dir
from .sites import Partition, Site, check_calibration, read_calibration

CALIBRATION_KEYS = ("gpu_model", "gpu_mem_gib", "gpus", "cuda_context_mib", "fp16", "bf16", "flash_attention", "host_mem_gib",
                    "nvme_free_gib", "allocator_overhead_frac")
"""What a calibration file may set per partition (anything else in the file is kept but not applied)."""


def probe(nvme_path: str | None = None) -> dict[str, Any]:
    """Measure the node this runs on: GPU, CUDA context, fp16/bf16/flash support, host memory, NVMe free space."""
    out: dict[str, Any] = {"host": os.uname().nodename, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "host_mem_gib": _host_mem_gib()}
    if nvme_path:
        try:
            out["nvme_free_gib"] = round(shutil.disk_usage(nvme_path).free / 2**30, 1)
        except OSError as exc:
            out["nvme_error"] = f"{nvme_path}: {exc.strerror or exc}"
    out.update(_gpu_probe())
    return out


def _gpu_probe() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"gpus": 0, "note": "torch is not installed on the node: GPU not probed"}
    out: dict[str, Any] = {"torch": str(torch.__version__)}
    if not torch.cuda.is_available():
        return {**out, "gpus": 0, **cpu_precisions(torch)}
    before = _nvml_used_mib()
    torch.zeros(1, device="cuda")  # creates the context
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # loads cuBLAS and its workspace
    torch.cuda.synchronize()
    bare = _nvml_used_mib()
    bare_reserved = torch.cuda.memory_reserved() / 2**20
    props = torch.cuda.get_device_properties(0)
    trained = _train_kernels(torch, ["fp32", "fp16-mixed"] + (["bf16-mixed"] if gpu_has_bf16(torch) else []))
    after = _nvml_used_mib()
    out.update({
        "gpus": torch.cuda.device_count(), "gpu_model": props.name,
        "gpu_mem_gib": round(props.total_memory / 2**30, 1),
        "bf16": gpu_has_bf16(torch),  # not V100's emulation
        "flash_attention": props.major >= 8,
        "cuda": str(torch.version.cuda),
    })
    reserved = torch.cuda.memory_reserved() / 2**20
    own = _nvml_used_mib(own=True)  # this process's alone: other jobs on a shared GPU do not count
    context = None
    if own is not None:
        context = round(own - reserved, 1)
    elif before is not None and after is not None:
        context = round(after - before - reserved, 1)
    if context is not None and context >= 0:  # below 0: another process freed memory meanwhile, not a measurement
        out["cuda_context_mib"] = context
    if before is not None and bare is not None:
        out["cuda_context_bare_mib"] = round(bare - before - bare_reserved, 1)
    if trained:
        out["context_note"] = trained
    return out


def _train_kernels(torch, precisions: list[str]) -> str:
    """Load the kernels a training step loads: two steps of the tiny GPT-2 in each precision.

    With lazy loading (CUDA >= 11.7) a kernel's module is loaded, into device memory outside PyTorch's allocator,
    the first time it runs, so the context a training job sees is larger than after a bare matrix product: on
    an H100 with torch 2.11 / CUDA 13, 685 MiB after the product and 751-773 MiB after steps of the tiny GPT-2,
    GPT-2, BERT-large or ViT-B (benchmarks/results/gpu-session-20261127.txt: the model's size barely matters, so
    the tiny one stands for them). '' when done; else why not (the figure after the product stands): a probe
    never fails for want of a training step (transformers missing on the node, a kernel the card lacks)."""
    import gc

    try:
        from .estimate.measure import train_setup
        from .models import load_model_config
        from .plan import Plan

        config = load_model_config("tiny-gpt2")
        for precision in precisions:
            plan = Plan(global_batch=2, micro_batch=2, seq_len=128, precision=precision)
            *_, step = train_setup(config, "causal-lm", plan, device="cuda")
            for _ in range(2):
                step()
            del step
    except Exception as exc:  # noqa: BLE001 - the probe's other figures still count
        return f"context after a bare matrix product only (no training step: {type(exc).__name__}: {exc})"[:300]
    finally:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return ""


def cpu_precisions(torch) -> dict[str, bool]:
    """What this CPU runs: fp16 needs oneDNN's fp16 kernels (AVX512-FP16 / AMX-FP16), which DeepSpeed's CPU
    accelerator checks; bf16 always runs (reference kernels where oneDNN has none)."""
    try:
        fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: fp16 cannot be counted on
        fp16 = False
    return {"fp16": fp16, "bf16": True}


def _nvml_used_mib(own: bool = False) -> float | None:
    """The job's GPU's memory in use as nvidia-smi shows it (MiB); with ``own``, this process's alone (None where
    NVML does not list it)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            handle = visible_nvml_handle(pynvml, 0)
            if own:
                used = nvml_process_used_bytes(pynvml, handle, os.getpid())
                return None if used is None else used / 2**20
            return nvml_used_bytes(pynvml, handle) / 2**20
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: the context is then not measured
        return None


def _host_mem_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return 0.0


def run_probe(site: Site, partition: Partition, folder: Path, timeout_min: int = 10) -> dict[str, Any]:
    """Run ``probe`` on the partition and return what it measured."""
    if site.scheduler == "local":
        return probe(partition.nvme_path)
    import submitit

    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    params: dict[str, Any] = {"slurm_partition": partition.slurm_partition, "timeout_min": timeout_min,
                              "cpus_per_task": 1, "slurm_mem": "8G", "name": f"hpcmem-calibrate.{partition.name}"}
    if partition.has_gpu:
        params["slurm_gres"] = f"gpu:{partition.gres_type}:1" if partition.gres_type else "gpu:1"
    for key, value in (("slurm_account", partition.account), ("slurm_qos", partition.qos),
                       ("slurm_constraint", partition.constraint)):
        if value:
            params[key] = value
    executor.update_parameters(**params)
    try:
        job = executor.submit(probe, partition.nvme_path)
        return job.result()
    except Exception as exc:  # submitit wraps sbatch failures and the job's own exception
        lines = str(exc).strip().splitlines()
        raise SchedulerError(f"calibration probe on {site.name}:{partition.name} failed: {lines[-1] if lines else exc}") from exc


def calibration_path(site: Site, home: Path) -> Path:
    """Beside the site profile when it is a site's own (writable) directory; for the profiles shipped with
    hpcmem, or a read-only directory, under $HPCMEM_HOME/calibration/ (never inside the installation)."""
    beside = site.path.with_name(f"{site.name}.calibration.yaml")
    shipped = site.path.parent.resolve() == data_dir("site_configs").resolve()
    if not shipped and os.access(site.path.parent, os.W_OK):
        return beside
    return home / "calibration" / beside.name


def load_measured(path: Path, partition: str) -> dict[str, Any]:
    """What the calibration file already holds for one partition ({} when nothing)."""
    return dict(read_calibration(path).get(partition) or {}) if path.is_file() else {}


def write_calibration(path: Path, partition: str, measured: dict[str, Any]) -> Path:
    """Merge one partition's measurements into the calibration file (other partitions are kept)."""
    # a damaged file is refused (ConfigError naming it), never overwritten: its other partitions would be lost
    data = {"partitions": read_calibration(path) if path.is_file() else {}}
    data["partitions"][partition] = measured
    # what would not load is not written (a probe's or fit's absurd figure would refuse the whole site later)
    check_calibration(data, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "# Written by `hpcmem calibrate`: measured values, applied over the site profile.\n"
                 + yaml.safe_dump(data, sort_keys=True))
    return path


MIN_FIT_POINTS = 3
"""Measured attempts needed before overheads are fitted from them."""


def fit_overheads(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Allocator overhead and CUDA context fitted from jobs' metrics.json (GPU runs only).

    allocator_overhead_frac = median(peak_reserved / peak_allocated - 1) and cuda_context_mib =
    median(device_used - peak_reserved), per rank, over the runs that report all three (MiB).
    Returns {} when fewer than MIN_FIT_POINTS ranks measured them (CPU runs report none).
    """
    reserve, context = [], []
    for m in metrics:
        for rank in (m.get("ranks") or {}).values():
            alloc, reserved, used = (rank.get(k) for k in ("peak_allocated_mib", "peak_reserved_mib", "device_used_mib"))
            if alloc and reserved and used and reserved >= alloc and used >= reserved:
                reserve.append(reserved / alloc - 1.0)
                context.append(used - reserved)
    if len(reserve) < MIN_FIT_POINTS:
        return {}
    return {"allocator_overhead_frac": round(_median(reserve), 4), "cuda_context_mib": round(_median(context), 1),
            "fitted_from_ranks": len(reserve)}


def fit_recorded(site: str, partition: str, *, ledger=None, bench=None) -> dict[str, Any]:
    """``fit_overheads`` over what the site recorded: the metrics of the partition's past attempts (``ledger``)
    and/or the nightly benchmark rows (``bench``, a results-store DataFrame). Raises HpcmemError when fewer
    than MIN_FIT_POINTS GPU ranks measured all three figures (CPU runs measure none)."""
    metrics: list[dict[str, Any]] = []
    if ledger is not None:
        metrics += [a.metrics for r in ledger.runs() if r.site == site
                    for a in ledger.attempts(r.run_id) if a.partition == partition and a.metrics]
    if bench is not None:
        from .bench.store import calibration_metrics

        metrics += calibration_metrics(bench, site, partition)
    fitted = fit_overheads(metrics)
    if not fitted:
        where = " and ".join(w for w, given in (("recorded attempts", ledger), ("benchmark cells", bench))
                             if given is not None)
        raise HpcmemError(f"{site}:{partition}: fewer than {MIN_FIT_POINTS} GPU ranks with measured memory among "
                          f"{len(metrics)} {where}; nothing to fit yet")
    return fitted


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
