"""The reference trainer: ``python -m toolkit.train --model NAME --task causal-lm|seq-cls|image-cls``.

It trains an untrained transformers model built from a config (toolkit/models.py,
no downloads) on synthetic data like the classic benchmark: random token ids of the
plan's ``seq_len`` and random labels; for image-cls (a ViT) random ``pixel_values`` of
the config's image size and random labels. Inside an hpcmem job it takes the plan from
``HPCMEM_PLAN``; outside it uses a single-node plan for the ranks it was started
with. Hugging Face style flags (``--per_device_train_batch_size``,
``--gradient_accumulation_steps``, ``--gradient_checkpointing``, ``--bf16``, ``--fp16``,
``--deepspeed CONFIG``, ``--optim``) and ``--set knob=value`` override the plan, so the
same command runs inside and outside hpcmem.

Launch: plain ``python -m toolkit.train`` (one process), ``torchrun`` (DDP over nccl on
CUDA, gloo on CPU; ``launcher=fsdp``: FSDP2, each transformer block then the root
``fully_shard``-ed), or for ``launcher=deepspeed`` either torchrun or the deepspeed
launcher (``deepspeed --num_gpus N --module toolkit.train ...``; it passes
``--local_rank``): ``deepspeed.initialize`` with the plan's ds_config, gloo on CPU
with DS_ACCELERATOR=cpu.

How each knob is applied:
  micro_batch, grad_accum  samples per forward, micro-batches per optimizer step (DDP skips
                           the all-reduce on all but the last: ``no_sync``)
  precision                fp32; fp16-mixed = fp16 autocast + torch.amp.GradScaler (CUDA and
                           CPU alike); bf16-mixed = bf16 autocast; bf16-true = weights built in
                           bf16. Under DeepSpeed the engine does it: the plan's precision is
                           written into the ds_config's fp16/bf16 sections (no autocast here).
  optimizer                adamw = torch AdamW; adamw-8bit = bitsandbytes AdamW8bit (no
                           substitute when it is missing: that would change what is learned,
                           so the job fails saying so); adafactor = transformers Adafactor;
                           sgd = SGD with momentum 0.9. A ds_config "optimizer" section (CPU
                           offload of AdamW) makes DeepSpeed build its own (CPU) Adam.
  checkpointing            ``model.gradient_checkpointing_enable`` (non-reentrant)
  attention                attn_implementation eager / sdpa / flash_attention_2
  zero_stage, offload_*    the ds_config; ZeRO-3 builds the model partitioned (zero.Init)
  launcher=fsdp            ``fully_shard`` per transformer block (HF _no_split_modules), then the
                           root; reshard_after_forward as planned; mixed precision by FSDP's
                           MixedPrecisionPolicy (param dtype from the precision, reduce_dtype), no
                           autocast; offload_params=cpu is CPUOffloadPolicy on a GPU (on a CPU the
                           parameters are already in host memory: recorded in "applied")
  seq_len                  tokens per sample (refused when longer than the model's positions);
                           not used by image-cls, whose sequence (a ViT's patches + CLS) comes
                           from the model's config: metrics.json "applied" records it
  alloc_conf               PYTORCH_CUDA_ALLOC_CONF (set by the job script; set here if missing)
  workers                  unused: batches are made in the training process, no data loader

Where this machine cannot do what the plan says (decided per case):
  attention=flash on CPU   runs sdpa and records it in metrics.json "applied": flash-attn
                           kernels exist only for CUDA, and PyTorch's CPU sdpa already uses a
                           fused flash-style kernel, so the memory behaviour is the nearest
                           there is. On a GPU without the flash-attn package the job fails.
  bf16-true on DeepSpeed   DeepSpeed's bf16 mode keeps fp32 master weights unless the
                           config sets bf16_master_weights_and_grads; recorded in "applied".
  bf16 on a GPU without it fails clearly (the plan should never ask for it).
  fp16-mixed on CPU        really runs under torch (CPU fp16 autocast and GradScaler exist in
                           torch 2.13). DeepSpeed's CPU accelerator runs fp16 only where oneDNN
                           has fp16 kernels (AVX512-FP16, AMX-FP16); elsewhere the nearest
                           precision it runs (bf16-mixed, else fp32), recorded in "applied".
Failures exit non-zero with the real exception (an OOM keeps PyTorch's own message);
configuration problems print one ``hpcmem: error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .. import models, optimizers
from ..models import HF_ATTENTION
from ..devices import gpu_has_bf16
from ..errors import ConfigError, HpcmemError, PlanError
from ..plan import Plan, apply_overrides, parse_sets, with_changes
from ..strategies.deepspeed import plan_from_ds_config
from . import checkpoint as ckpt
from . import inflight, jobenv
from .monitor import MemoryMonitor
from .oom import OomRehearsal

_STARTED = time.time()  # this process's start: the job's, near enough, when Slurm does not say

# --optim values of HF TrainingArguments (and the plan's own names and aliases) -> plan optimizer.
OPTIM_NAMES = optimizers.script_names()


DEFAULT_LR = 1e-4
DEFAULT_EVERY_MIN = 30.0


# -- command line -----------------------------------------------------------------

def _bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m toolkit.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="config.json path, directory holding one, or jobs/models/<name>")
    p.add_argument("--task", required=True, choices=models.TASKS)
    p.add_argument("--steps", "--max_steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--warmup-steps", "--warmup_steps", type=int, default=1,
                   help="first steps left out of the timing (default 1)")
    p.add_argument("--min-step-s", type=float, default=0.0, metavar="S",
                   help="pad every step to at least S seconds (rehearsals and tests: a job's length that does not "
                        "depend on how fast the machine is)")
    p.add_argument("--lr", "--learning_rate", type=float, default=None,
                   help=f"learning rate (default {DEFAULT_LR}; a DeepSpeed optimizer section keeps its own unless given)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-dir", default=None,
                   help="where metrics go outside an hpcmem job (default: HPCMEM_ATTEMPT_DIR, else none)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE",
                   help="override a plan knob (repeatable)")
    ck = p.add_argument_group("checkpoints and resume (docs/resume.md)")
    ck.add_argument("--checkpoint-dir", default=None,
                    help="where saves go and are resumed from (default: HPCMEM_CHECKPOINT_DIR; none: no checkpoints)")
    ck.add_argument("--checkpoint-every-steps", type=int, default=0, metavar="N",
                    help="save every N optimizer steps (0: off)")
    ck.add_argument("--checkpoint-every-min", type=float, default=None, metavar="M",
                    help=f"save every M minutes (default {DEFAULT_EVERY_MIN:g} when there is a checkpoint directory "
                         "and no step interval; 0: off)")
    ck.add_argument("--checkpoint-margin-s", type=float, default=None, metavar="S",
                    help="save this long before the job's time limit (default 10%% of the limit, 20-300 s)")
    ck.add_argument("--checkpoint-keep", type=int, default=0, metavar="K",
                    help="keep the K newest complete saves, remove older ones (default 0: keep all; partial and "
                         "damaged saves are never removed)")
    ck.add_argument("--checkpoint-digest", action="store_true",
                    help="record a sha256 of the model and optimizer state with each save and resume (gathers it)")
    ck.add_argument("--no-resume", dest="resume", action="store_false",
                    help="start from step 0 even when the checkpoint directory holds saves")
    ck.add_argument("--inflight-recovery", type=_bool, nargs="?", const=True, default=None, metavar="BOOL",
                    help="answer an out-of-memory error inside the job with a smaller micro-batch and more "
                         "accumulation (the same global batch), then activation checkpointing, re-running the step "
                         "(default: HPCMEM_INFLIGHT, else true; DDP and single process: FSDP and DeepSpeed go back "
                         "through the controller)")
    oom = p.add_argument_group("rehearse a real out-of-memory failure")
    oom.add_argument("--oom-at-step", type=int, default=None, metavar="N",
                     help="from optimizer step N on, really allocate past the job's memory limit")
    oom.add_argument("--oom-rank", type=int, default=None, metavar="R", help="only rank R allocates (default: all)")
    oom.add_argument("--oom-kind", choices=("activations", "fixed"), default="activations",
                     help="activations: the extra memory scales with the micro-batch (held during each forward and "
                          "backward); fixed: one block that no micro-batch avoids (default activations)")
    oom.add_argument("--oom-mib", type=float, default=None, metavar="MIB",
                     help="the extra memory: MiB per sample (activations) or in all (fixed); default: 110%% of the "
                          "limit this process runs under (per sample: divided by the micro-batch of the first step "
                          "that allocates)")
    peaks = p.add_argument_group("rehearse a data-driven peak (docs/resume.md, Data-driven peaks)")
    peaks.add_argument("--long-batch-at-step", type=int, default=None, metavar="N",
                       help="variable sequence lengths: every step's batch is padded to a length drawn from "
                            "[seq_len/2, seq_len] (the same on every rank), except step N's, padded to --seq-len-max")
    peaks.add_argument("--seq-len-max", type=int, default=None, metavar="L",
                       help="the long batch's length (tokens; with --long-batch-at-step)")
    peaks.add_argument("--leak-mib-per-step", type=float, default=None, metavar="M",
                       help="leak: every step keeps a reference to M MiB of real (written) tensors, like an "
                            "accumulated loss tensor that keeps its graph")
    hf = p.add_argument_group("Hugging Face style overrides (win over the plan when given)")
    hf.add_argument("--per_device_train_batch_size", type=int)
    hf.add_argument("--gradient_accumulation_steps", type=int)
    hf.add_argument("--gradient_checkpointing", type=_bool, nargs="?", const=True)
    hf.add_argument("--bf16", type=_bool, nargs="?", const=True)
    hf.add_argument("--fp16", type=_bool, nargs="?", const=True)
    hf.add_argument("--deepspeed", metavar="CONFIG", help="ds_config.json (sets launcher=deepspeed)")
    hf.add_argument("--optim", choices=sorted(OPTIM_NAMES))
    # The deepspeed launcher appends --local_rank=N; the environment has it too.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.checkpoint_every_steps < 0 or (args.checkpoint_every_min is not None and args.checkpoint_every_min < 0):
        p.error("checkpoint intervals must be >= 0")
    if args.oom_at_step is not None and args.oom_at_step < 1:
        p.error("--oom-at-step must be at least 1")
    if args.oom_mib is not None and args.oom_mib <= 0:
        p.error("--oom-mib must be positive")
    if (args.long_batch_at_step is None) != (args.seq_len_max is None):
        p.error("--long-batch-at-step and --seq-len-max go together")
    if args.long_batch_at_step is not None and (args.long_batch_at_step < 1 or args.seq_len_max < 1):
        p.error("--long-batch-at-step and --seq-len-max must be at least 1")
    if args.leak_mib_per_step is not None and not (0 < args.leak_mib_per_step < 2**20):
        p.error("--leak-mib-per-step must be positive (MiB)")
    return args


# -- the plan ------------------------------------------------------------------------

def default_plan(ranks: jobenv.Ranks) -> Plan:
    """The plan outside hpcmem: the ranks we were started with, micro-batch 8, no accumulation."""
    return Plan(nodes=ranks.nodes, gpus_per_node=ranks.world_size // ranks.nodes,
                global_batch=8 * ranks.world_size, micro_batch=8, grad_accum=1)


def plan_for_args(plan: Plan, args: argparse.Namespace, ds_cfg: dict[str, Any] | None = None) -> Plan:
    """``plan`` changed by the command line: HF flags and ``--deepspeed`` first, then ``--set``.

    HF flags are taken literally (the global batch follows from them); ``--set``
    behaves as everywhere in hpcmem (a new micro-batch keeps the global batch).
    """
    changes = plan_overrides(args, ds_cfg)
    if plan.precision == "bf16-true" and changes.get("precision") == "bf16-mixed":
        changes.pop("precision")  # --bf16 and a ds_config's bf16 section cannot say bf16-true; keep the plan's
    plan = apply_overrides(plan, changes)
    sets = parse_sets(args.sets)
    return with_changes(plan, sets) if sets else plan


def plan_overrides(args: argparse.Namespace, ds_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Knob changes asked for by HF-style flags and a ``--deepspeed`` config."""
    changes: dict[str, Any] = {}
    if ds_cfg is not None:
        changes.update(plan_from_ds_config(ds_cfg))
    if args.per_device_train_batch_size is not None:
        changes["micro_batch"] = args.per_device_train_batch_size
    if args.gradient_accumulation_steps is not None:
        changes["grad_accum"] = args.gradient_accumulation_steps
    if args.gradient_checkpointing is not None:
        changes["checkpointing"] = args.gradient_checkpointing
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 cannot both be set")
    if args.bf16:
        changes["precision"] = "bf16-mixed"
    elif args.fp16:
        changes["precision"] = "fp16-mixed"
    elif args.bf16 is False or args.fp16 is False:
        changes.setdefault("precision", "fp32")
    if args.optim is not None:
        changes["optimizer"] = OPTIM_NAMES[args.optim]
    return changes


def resolve_plan(args: argparse.Namespace, ranks: jobenv.Ranks) -> tuple[Plan, dict[str, Any] | None]:
    """The plan of this run and, for the deepspeed launcher, its ds_config dict."""
    user_ds = jobenv.ds_config(path=args.deepspeed) if args.deepspeed else None
    plan = jobenv.load_plan() if jobenv.in_hpcmem_job() else default_plan(ranks)
    plan = plan_for_args(plan, args, user_ds)
    if plan.world_size != ranks.world_size:
        raise PlanError(f"the plan has world_size {plan.world_size} (nodes {plan.nodes} x gpus_per_node "
                        f"{plan.gpus_per_node}) but this job was started with {ranks.world_size} rank(s)")
    if plan.strategy.config_file != "ds_config.json":  # only DeepSpeed's engine reads a config here
        return plan, None
    if user_ds is not None:
        cfg = user_ds
    elif jobenv.in_hpcmem_job() or os.environ.get(jobenv.ENV_DS_CONFIG):
        cfg = jobenv.ds_config()
    else:
        from ..strategies.deepspeed import deepspeed_config

        import torch

        # Outside hpcmem there is no partition: NVMe offload then needs --deepspeed CONFIG.
        cfg = deepspeed_config(plan, nvme_path=None, gpu=torch.cuda.is_available())
    return plan, fill_ds_config(cfg, plan, args.lr)


def fill_ds_config(cfg: dict[str, Any], plan: Plan, lr: float | None = None) -> dict[str, Any]:
    """A copy of ``cfg`` that says what the plan says, with every "auto" resolved.

    The plan is the truth for batch sizes and precision (the fp16/bf16 sections are
    switched to match it, their other settings kept); ``lr`` (when given) sets the
    optimizer section's learning rate.
    """
    import copy

    cfg = copy.deepcopy(cfg)
    cfg["train_batch_size"] = plan.global_batch
    cfg["train_micro_batch_size_per_gpu"] = plan.micro_batch
    cfg["gradient_accumulation_steps"] = plan.grad_accum
    if cfg.get("gradient_clipping") == "auto":
        cfg["gradient_clipping"] = 1.0
    if "bfloat16" in cfg:  # DeepSpeed's older spelling
        cfg["bf16"] = {**cfg.pop("bfloat16"), **(cfg.get("bf16") or {})}
    want = PLAN_DS_PRECISION[plan.precision]
    for section in ("fp16", "bf16"):
        if section == want:
            cfg[section] = {**(cfg.get(section) or {}), "enabled": True}
        elif isinstance(cfg.get(section), dict):
            cfg[section]["enabled"] = False
    opt = cfg.get("optimizer")
    if isinstance(opt, dict):
        params = opt.setdefault("params", {})
        defaults = {"lr": lr or DEFAULT_LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
        for key, value in list(params.items()):
            if value == "auto":
                params[key] = defaults.get(key)
        if lr is not None:
            params["lr"] = lr
    return cfg


PLAN_DS_PRECISION = {"fp32": "fp32", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


# -- machine decisions (pure) --------------------------------------------------------

def choose_attention(attention: str, device_type: str, flash_installed: bool) -> tuple[str, str | None]:
    """(attn_implementation to use, reason when it differs from the plan's)."""
    if attention != "flash":
        return HF_ATTENTION[attention], None
    if device_type != "cuda":
        return "sdpa", ("flash_attention_2 exists only for CUDA GPUs; on CPU PyTorch's sdpa (a fused "
                        "flash-style kernel that never stores the attention matrix) is the nearest")
    if not flash_installed:
        raise HpcmemError("attention=flash needs the flash-attn package on this GPU node "
                          "(pip install flash-attn), or set attention=sdpa")
    return "flash_attention_2", None


def choose_precision(precision: str, fp16_ok: bool, bf16_ok: bool, engine: str) -> tuple[str, str | None]:
    """(precision to run, reason when it differs from the plan's) for an engine that refuses what its
    device lacks. fp16-mixed's nearest is bf16-mixed (16-bit activations, fp32 master weights, no loss
    scaling needed), then fp32; bf16's nearest is fp16-mixed, then fp32."""
    wanted = {"fp16-mixed": fp16_ok, "bf16-mixed": bf16_ok, "bf16-true": bf16_ok}.get(precision, True)
    if wanted:
        return precision, None
    nearest = [p for p, ok in (("bf16-mixed", bf16_ok), ("fp16-mixed", fp16_ok), ("fp32", True))
               if ok and p != precision][0]
    dtype = "fp16" if precision.startswith("fp16") else "bf16"
    return nearest, f"{engine} has no {dtype} on this device; ran {nearest} instead of {precision}"


# -- the run -------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ranks = jobenv.ranks()
    out_dir = jobenv.attempt_dir(required=False) or args.metrics_dir
    monitor = MemoryMonitor(out_dir, warmup_steps=args.warmup_steps, rank_info=ranks)
    signal.signal(signal.SIGTERM, _raise_terminated)  # so metrics.json says how the job ended
    try:
        with monitor:
            plan, ds_cfg = resolve_plan(args, ranks)
            monitor.plan = plan.to_dict()
            if plan.alloc_conf and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
                # Normally the job script sets it; CUDA's allocator reads it at its first use.
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = plan.alloc_conf
            Trainer(args, plan, ds_cfg, ranks, monitor).run()
    except HpcmemError as exc:
        print(f"hpcmem: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Terminated as exc:
        print(f"hpcmem: {exc}; stopped", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    finally:
        _destroy_process_group()
    return 0


class Trainer:
    """One rank's training run for a plan (built step by step, then ``run``)."""

    def __init__(self, args, plan: Plan, ds_cfg: dict[str, Any] | None, ranks: jobenv.Ranks, monitor: MemoryMonitor):
        self.args, self.plan, self.ds_cfg, self.ranks, self.monitor = args, plan, ds_cfg, ranks, monitor
        self.inflight_moves: list[dict[str, Any]] = []

    def log(self, text: str) -> None:
        if self.ranks.is_main:
            print(text, flush=True)

    def run(self) -> None:
        import torch


        plan, args = self.plan, self.args
        device = self.setup_distributed()
        # stacks only without checkpointing: a checkpointed backward died under stack recording (monitor.py)
        self.monitor.attach_device(device, stacks=not plan.checkpointing)
        cap = jobenv.apply_gpu_memory_cap(device)
        if cap:
            self.monitor.note("gpu_memory_fraction", cap["memory_fraction"],
                              f"HPCMEM_GPU_MEM_GIB={cap['gpu_mem_gib']} on a {cap['card_gib']} GiB card")
        self.check_precision(device)
        if plan.optimizer == "adamw-8bit":
            models.import_bitsandbytes()  # fail before building a large model, not after
        torch.manual_seed(args.seed)  # the same initial weights on every rank

        model_cfg = models.load_model_config(args.model)
        config = models.transformers_config(model_cfg, args.task)
        image = args.task in models.IMAGE_TASKS
        limit = models.max_positions(config)
        if not image and limit is not None and plan.seq_len > limit:
            raise PlanError(f"seq_len {plan.seq_len} is longer than the model's {limit} positions")
        if not image and limit is not None and (args.seq_len_max or 0) > limit:
            raise PlanError(f"--seq-len-max {args.seq_len_max} is longer than the model's {limit} positions")
        if image:
            inputs = "image " + "x".join(str(n) for n in models.image_input_shape(config))
            if model_cfg.get("image_size") and model_cfg.get("patch_size"):
                from ..modelshape import image_sequence

                seq = image_sequence(model_cfg)
                inputs += f" ({seq} tokens: patches + CLS)"
                self.monitor.note("seq_len", seq, f"{args.task}: the sequence is the image's patches plus the CLS "
                                                  "token, from the model's config; the plan's seq_len does not apply")
        else:
            inputs = f"seq_len {plan.seq_len}"
        attn, why = choose_attention(plan.attention, device.type, importlib.util.find_spec("flash_attn") is not None)
        if why:
            self.monitor.note("attention", "sdpa", why)
        model = self.build_model(config, attn)
        if plan.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.log(f"hpcmem train: {config.model_type} {models.count_parameters(model) / 1e6:.1f}M params, "
                 f"task {args.task}, {plan.launcher} x{self.ranks.world_size} on {device.type}, "
                 f"micro_batch {plan.micro_batch} x grad_accum {plan.grad_accum} (global {plan.global_batch}), "
                 f"{inputs}, {plan.precision}, {plan.optimizer}, attention {attn}"
                 + (f", {plan.strategy.describe(plan)}" if plan.strategy.sharded else "")
                 + (", checkpointing" if plan.checkpointing else ""))
        batches = SyntheticBatches(config, args.task, plan.micro_batch, plan.seq_len, device,
                                   seed=args.seed + 1000 * self.ranks.rank)
        if self.ds_cfg is not None:
            self.train_deepspeed(model, batches)
        else:
            self.train_torch(model, batches, device)

    # -- set-up --

    def setup_distributed(self):
        import torch
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(self.ranks.local_rank)
        device = torch.device("cuda", self.ranks.local_rank) if cuda else torch.device("cpu")
        if self.ds_cfg is not None:
            _single_process_rendezvous()
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        elif self.ranks.world_size > 1:
            dist.init_process_group(backend="nccl" if cuda else "gloo")
        return device

    def check_precision(self, device) -> None:
        import torch

        wants_bf16 = self.plan.precision in ("bf16-mixed", "bf16-true")
        if wants_bf16 and device.type == "cuda" and not gpu_has_bf16(torch):
            raise PlanError(f"precision={self.plan.precision}: this GPU ({torch.cuda.get_device_name(device)}) "
                            "has no bf16; use fp16-mixed")
        if self.ds_cfg is not None:
            from deepspeed.accelerator import get_accelerator

            accel = get_accelerator()
            precision, why = choose_precision(self.plan.precision, bool(accel.is_fp16_supported()),
                                              bool(accel.is_bf16_supported()), f"DeepSpeed's {accel.device_name()} accelerator")
            if why:
                self.monitor.note("precision", precision, why)
                self.log(f"hpcmem train: {why}")
                self.plan = self.plan.replace(precision=precision)
                self.ds_cfg = fill_ds_config(self.ds_cfg, self.plan)
            if self.plan.precision == "bf16-true" and not self.ds_cfg["bf16"].get("bf16_master_weights_and_grads"):
                self.monitor.note("precision", "bf16-mixed",
                                  "DeepSpeed's bf16 mode keeps fp32 master weights unless the config sets "
                                  "bf16_master_weights_and_grads")

    def build_model(self, config, attn: str):
        import torch


        dtype = torch.bfloat16 if self.plan.precision == "bf16-true" and self.ds_cfg is None else None
        if self.ds_cfg is not None and self.plan.zero_stage == 3:
            # Build partitioned (and offloaded) from the start: transformers wraps
            # from_config in deepspeed.zero.Init while an HfDeepSpeedConfig is alive.
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(self.ds_cfg)  # must outlive the model's construction
            return models.build_model(config, self.args.task, attn)
        model = models.build_model(config, self.args.task, attn, dtype=dtype)
        return model

    def make_optimizer(self, params):
        return models.build_optimizer(self.plan.optimizer, params, self.args.lr or DEFAULT_LR)

    # -- loops --

    def train_torch(self, model, batches: "SyntheticBatches", device) -> None:
        import torch

        plan = self.plan
        fsdp = plan.strategy.name == "fsdp"
        if not fsdp:  # fully_shard moves each block's states to the device as it shards them: never the whole
            model.to(device)  # model on one GPU (the estimate builds it on the host: strategies.fsdp startup)
        if fsdp:  # shard before the optimizer is built: it steps the sharded parameters
            for knob, (value, why) in plan.strategy.shard(model, plan, device).items():
                self.monitor.note(knob, value, why)
        optimizer = self.make_optimizer([p for p in model.parameters() if p.requires_grad])
        ddp = self.ranks.world_size > 1 and not fsdp
        if ddp:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        # FSDP's mixed-precision policy casts weights and inputs itself: no autocast around it.
        autocast = None if fsdp else {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(plan.precision)
        scaler = torch.amp.GradScaler(device.type) if plan.precision == "fp16-mixed" else None
        engine = BoundEngine(plan.strategy, model, optimizer)
        start, saver = self.start_checkpoints(device, engine, batches, scaler)
        rehearsal = self.oom_rehearsal(device)
        model.train()
        recovery, discard = self.recovery(device, model, optimizer, rehearsal, batches, fsdp)
        self.monitor.begin_steps()

        def micro_batches(step: int, plan: Plan):
            total = torch.zeros((), device=device)
            for micro in range(plan.grad_accum):
                last = micro == plan.grad_accum - 1
                sync = model.no_sync() if ddp and not last else contextlib.nullcontext()
                with sync:
                    self.leak(step, device)
                    if rehearsal:
                        rehearsal.before_micro(step, plan.micro_batch)
                    with torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext():
                        loss = model(**batches.next()).loss / plan.grad_accum
                    recovery.forward_done()  # over several ranks: the agreement on a forward's OOM
                    (scaler.scale(loss) if scaler else loss).backward()
                    recovery.backward_done()
                    if rehearsal:
                        rehearsal.after_micro()
                total += loss.detach().float()
            return total

        for step in range(start + 1, self.args.steps + 1):
            self.begin_step(step, batches, device)
            rng = recovery.capture(batches.generator)
            total = recovery.run_step(step, functools.partial(micro_batches, step), discard=discard,
                                      rewind=functools.partial(recovery.restore, rng, batches.generator))
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.end_step(step, total.item())
            if saver:
                saver(step)

    def train_deepspeed(self, model, batches: "SyntheticBatches") -> None:
        import deepspeed
        import torch

        cfg = self.ds_cfg
        if "optimizer" in cfg:  # DeepSpeed builds its own (CPU) Adam for offload
            engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                              config=cfg)
        else:
            optimizer = self.make_optimizer([p for p in model.parameters() if p.requires_grad])
            # ZeRO refuses client optimizers it has not tested (SGD, Adafactor, 8-bit AdamW)
            # without this flag; HF Trainer and Accelerate set it the same way.
            cfg = {**cfg, "zero_allow_untested_optimizer": True}
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        batches.device = engine.device
        bound = BoundEngine(self.plan.strategy, engine, None)
        start, saver = self.start_checkpoints(engine.device, bound, batches, None)
        rehearsal = self.oom_rehearsal(engine.device)
        engine.train()
        self.monitor.begin_steps()
        for step in range(start + 1, self.args.steps + 1):
            self.begin_step(step, batches, engine.device)
            total = torch.zeros((), device=engine.device)
            for _ in range(self.plan.grad_accum):
                self.leak(step, engine.device)
                if rehearsal:
                    rehearsal.before_micro(step, self.plan.micro_batch)
                loss = engine(**batches.next()).loss
                engine.backward(loss)
                if rehearsal:
                    rehearsal.after_micro()
                engine.step()
                total += loss.detach().float()
            self.end_step(step, total.item() / self.plan.grad_accum)
            if saver:
                saver(step)

    # -- checkpoints and the OOM rehearsal --

    def checkpointer(self, device) -> "ckpt.Checkpointer | None":
        """The rank's Checkpointer when there is a checkpoint directory (--checkpoint-dir, HPCMEM_CHECKPOINT_DIR)."""
        args = self.args
        root = args.checkpoint_dir or ckpt.checkpoint_dir()
        if not root:
            return None
        every_min = args.checkpoint_every_min
        if every_min is None:
            every_min = 0.0 if args.checkpoint_every_steps else DEFAULT_EVERY_MIN
        plan = self.plan.to_dict()
        # Outside a job there is no time limit to save before (the plan's time_min is only a default then).
        deadline = ckpt.job_deadline(plan if jobenv.in_hpcmem_job() else {}, started=_STARTED)
        limit_s = 60.0 * float(plan.get("time_min") or 0)
        policy = ckpt.Policy(every_steps=args.checkpoint_every_steps or None, every_s=60.0 * every_min or None,
                             deadline=deadline, margin_s=ckpt.margin_s(limit_s, args.checkpoint_margin_s))
        attempt_dir = jobenv.attempt_dir(required=False)
        saver = ckpt.Checkpointer(Path(root), policy, self.ranks, plan, monitor=self.monitor, device=device,
                                  digest=args.checkpoint_digest, attempt=attempt_dir.name if attempt_dir else None,
                                  keep=max(0, args.checkpoint_keep))
        saver.install_signal()
        return saver

    def start_checkpoints(self, device, engine: "BoundEngine", batches: "SyntheticBatches", scaler):
        """Resume from the newest save this layout reads; returns (the step to continue after, a per-step saver)."""
        saver = self.checkpointer(device)
        if saver is None:
            return 0, None
        rank, seed = self.ranks.rank, self.args.seed

        def extras_save() -> dict:
            return ckpt.rng_state(batches.generator, scaler)

        def extras_load(state, step: int) -> str | None:
            if state is not None:
                ckpt.restore_rng(state, batches.generator, scaler)
                return None
            import torch

            # No state for this rank (the world size changed): a data position derived from (seed, rank, step).
            torch.manual_seed(seed + 7919 * rank + step)
            batches.generator.manual_seed(seed + 1000 * rank + 1_000_003 * step)
            return (f"the save has no RNG and data state for rank {rank} (it was written by another world size): "
                    "reseeded from (seed, rank, step)")

        fmt = ENGINE_FORMATS[self.plan.strategy.name]
        if self.args.resume:
            start = saver.resume(engine, extras_load, fmt)
        else:
            start = 0
            saver._record(resume={"dir": str(saver.root), "resumed_from_step": None, "restart_reason": "--no-resume"})
        if start >= self.args.steps:
            self.log(f"hpcmem train: the checkpoint is at step {start}, --steps is {self.args.steps}: nothing to train")
        return start, lambda step: saver.maybe_save(step, engine, extras_save)

    # -- in-job recovery (docs/resume.md) --

    def recovery(self, device, model, optimizer, rehearsal, batches: "SyntheticBatches", fsdp: bool):
        """In-job recovery for this run (toolkit/runtime/inflight.py) and how a failed try is discarded: on unless
        --inflight-recovery false or HPCMEM_INFLIGHT=0; never under FSDP (its collectives in forward: back to the
        controller)."""
        on = self.args.inflight_recovery
        on = inflight.enabled() if on is None else on
        if on and fsdp:
            self.monitor.note("inflight_recovery", False, "FSDP: an OOM inside a block's all-gather cannot be agreed "
                                                          "on by all ranks; the controller answers it")
            on = False
        hf_model = getattr(model, "module", model)

        def enable_checkpointing() -> None:
            self.monitor.drop_stacks()
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # what the model says, not what was asked: metrics.json applied.checkpointing
            self.monitor.note("checkpointing", bool(getattr(hf_model, "is_gradient_checkpointing", False)),
                              "in-job move after an out-of-memory error at micro-batch 1")

        def discard() -> None:
            optimizer.zero_grad(set_to_none=True)
            if rehearsal and rehearsal.kind != "fixed":  # a fixed block stays: no micro-batch avoids it
                rehearsal.held.clear()

        def on_move(move: dict[str, Any], new: Plan) -> None:
            self.inflight_moves.append(move)
            why = f"in-job move after an out-of-memory error in step {move['step']}: the same global batch"
            for knob in ("micro_batch", "grad_accum"):
                if move["from"][knob] != move["to"][knob]:
                    self.monitor.note(knob, move["to"][knob], why)
            self.monitor.set_fields(inflight_moves=list(self.inflight_moves))
            self.monitor.restart_peaks()  # metrics.json's peaks are the new plan's, not the failed try's
            self.plan = new
            batches.micro_batch = new.micro_batch

        can_checkpoint = hasattr(hf_model, "gradient_checkpointing_enable") and getattr(
            hf_model, "supports_gradient_checkpointing", True)
        recovery = inflight.Recovery(self.plan, device=device, enabled=on,
                                     enable_checkpointing=enable_checkpointing if can_checkpoint else None,
                                     on_move=on_move, log=self.log, data_peak=self.monitor.data_peak)
        return recovery, discard

    def oom_rehearsal(self, device) -> OomRehearsal | None:
        args = self.args
        if args.oom_at_step is None:
            return None
        return OomRehearsal(args.oom_at_step, kind=args.oom_kind, rank=args.oom_rank, mib=args.oom_mib,
                            my_rank=self.ranks.rank, device=device)

    # -- data-driven peaks (docs/resume.md): each step's length, the rehearsed long batch and leak --

    def begin_step(self, step: int, batches: "SyntheticBatches", device) -> None:
        """Before step ``step``: its batch length (rehearsal: variable, one long batch), recorded with the
        monitor (which resets the step's peak)."""
        args = self.args
        if args.long_batch_at_step is not None and batches.task not in models.IMAGE_TASKS:
            batches.seq_len = step_seq_len(step, self.plan.seq_len, args.long_batch_at_step, args.seq_len_max,
                                           args.seed)
        self.monitor.begin_step(step, None if batches.task in models.IMAGE_TASKS else batches.seq_len)

    def leak(self, step: int, device) -> None:
        """The rehearsed leak: step ``step`` keeps ``--leak-mib-per-step`` MiB of real tensors for good. Called in
        the step's first forward, where a real leak (a loss kept with its graph) allocates; once per step, so a
        step re-run by in-job recovery does not leak twice."""
        mib = self.args.leak_mib_per_step
        if not mib or step in getattr(self, "_leaked", {}):
            return
        import torch

        kept = self.__dict__.setdefault("_leaked", {})
        kept[step] = torch.ones(int(mib * 2**20) // 4, dtype=torch.float32, device=device)  # written: resident

    def end_step(self, step: int, loss: float) -> None:
        plan = self.plan
        if self.args.min_step_s > 0:  # the padding is part of the step, as a slower machine's would be
            import time

            last = getattr(self, "_step_clock", None)
            if last is not None:
                time.sleep(max(0.0, self.args.min_step_s - (time.perf_counter() - last)))
            self._step_clock = time.perf_counter()
        took = self.monitor.step(samples=plan.micro_batch * plan.grad_accum, loss=loss)
        if not self.ranks.is_main:
            return
        line = (f"step {step}/{self.args.steps} loss {loss:.4g} "
                f"samples/s {plan.global_batch / took if took > 0 else math.inf:.1f} "
                f"peak_rss {self.monitor.peak_rss_mib():.0f} MiB")
        allocated = self.monitor.peak_allocated_mib()
        if allocated is not None:
            line += f" peak_alloc {allocated:.0f} MiB"
        print(line, flush=True)


# The save format each engine writes (runtime/checkpoint.py says which engines read which).
ENGINE_FORMATS = {"torchrun": ckpt.FORMAT_FULL, "fsdp": ckpt.FORMAT_DCP, "deepspeed": ckpt.FORMAT_DEEPSPEED}


class BoundEngine:
    """A strategy's checkpoint methods bound to this run's model (or DeepSpeed engine) and optimizer."""

    def __init__(self, strategy, model, optimizer):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer

    def save_state(self, directory, ranks) -> str:
        return self.strategy.save_state(directory, ranks, self.model, self.optimizer)

    def load_state(self, directory, saved) -> None:
        self.strategy.load_state(directory, saved, self.model, self.optimizer)

    def digest(self):
        return self.strategy.state_digest(self.model, self.optimizer)


class SyntheticBatches:
    """Random token ids of a fixed length and random labels, like the classic benchmark;
    for image-cls random fp32 pixel_values of the config's image size (N(0, 1), as after
    normalisation) and random labels (``seq_len`` is not used)."""

    def __init__(self, config, task: str, micro_batch: int, seq_len: int, device, seed: int):
        import torch

        self.config = config
        self.vocab = int(getattr(config, "vocab_size", 0) or 0)
        self.num_labels = int(getattr(config, "num_labels", 2) or 2)
        self.task, self.micro_batch, self.seq_len, self.device = task, micro_batch, seq_len, device
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> dict[str, Any]:
        import torch

        if self.task in models.IMAGE_TASKS:
            batch = models.random_image_batch(self.config, self.micro_batch, self.generator)
            return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        ids = torch.randint(0, self.vocab, (self.micro_batch, self.seq_len), generator=self.generator)
        if self.task == "causal-lm":
            labels = ids
        else:
            labels = torch.randint(0, self.num_labels, (self.micro_batch,), generator=self.generator)
        return {"input_ids": ids.to(self.device, non_blocking=True), "labels": labels.to(self.device, non_blocking=True)}


def step_seq_len(step: int, seq_len: int, long_at: int, long_len: int, seed: int) -> int:
    """The rehearsal's batch length at ``step``: ``long_len`` at ``long_at``, else drawn from
    [max(1, seq_len // 2), seq_len] by (seed, step) alone, so every rank and a resumed attempt agree."""
    if step == long_at:
        return long_len
    import random

    return random.Random(seed * 1_000_003 + step).randint(max(1, seq_len // 2), seq_len)


class Terminated(BaseException):
    """SIGTERM (Slurm's time limit, scancel, torchrun tearing down): ends training like an error."""


def _raise_terminated(signum, frame):
    raise Terminated(f"received signal {signal.Signals(signum).name}")


def _single_process_rendezvous() -> None:
    """Launcher variables for a DeepSpeed run started without a launcher (one process)."""
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - tearing down after a failure must not hide it
        pass


if __name__ == "__main__":
    sys.exit(main())
