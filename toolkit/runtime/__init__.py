"""The hpcmem job runtime: used inside a job to read its plan and record its memory.

    from toolkit import runtime
    plan = runtime.load_plan()                       # HPCMEM_PLAN
    args = TrainingArguments(output_dir=..., **runtime.hf_training_args(plan))
    with runtime.MemoryMonitor(runtime.attempt_dir(), plan=plan.to_dict()) as mon:
        ...                                          # mon.step(samples, loss.item()) per optimizer step

Modules: ``jobenv`` (environment: plan, attempt dir, DeepSpeed config, ranks,
GPU memory cap), ``adapters`` (the plan for HF Trainer / Accelerate), ``metrics``
(rank records -> metrics.json), ``monitor`` (the MemoryMonitor), ``checkpoint`` (saves shared by a run's
attempts, resume; ``hf_resume_checkpoint`` for the HF Trainer), ``userloops`` (saves and resume for an
Accelerate loop, the HF Trainer's time-limit save), ``oom`` (the OOM rehearsal).
"""

from .checkpoint import hf_resume_checkpoint
from .adapters import accelerate_kwargs, fabric_kwargs, hf_model_kwargs, hf_training_args
from .jobenv import (
    Ranks,
    apply_gpu_memory_cap,
    attempt_dir,
    ds_config,
    ds_config_path,
    in_hpcmem_job,
    load_plan,
    memory_fraction,
    ranks,
)
from .metrics import collect, merge_ranks, write_json_atomic
from .monitor import MemoryMonitor
from .hf_inflight import inflight_trainer
from .userloops import AccelerateCheckpoints, hf_time_limit_callback

__all__ = [
    "AccelerateCheckpoints",
    "MemoryMonitor",
    "Ranks",
    "accelerate_kwargs",
    "fabric_kwargs",
    "apply_gpu_memory_cap",
    "attempt_dir",
    "collect",
    "ds_config",
    "ds_config_path",
    "hf_model_kwargs",
    "hf_resume_checkpoint",
    "hf_time_limit_callback",
    "hf_training_args",
    "in_hpcmem_job",
    "inflight_trainer",
    "load_plan",
    "memory_fraction",
    "merge_ranks",
    "ranks",
    "write_json_atomic",
]
