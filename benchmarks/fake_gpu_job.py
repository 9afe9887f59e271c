"""A FAKE GPU training job for the retry benchmark (benchmarks/retry.py). No GPU is used or needed.

    fake_gpu_job.py MODEL_JSON [--task causal-lm|seq-cls] [--oom-after S] [--train-s S] [--reserve F]
                    [--message pytorch|cublas] [--other-process-mib M]
    fake_gpu_job.py --real-host-mib FIXED [--real-host-mib-per-sample K] [--hold-s S]     (REAL host memory)

It is the command of an hpcmem job spec (``command: {script: .../fake_gpu_job.py}``), so it is rendered,
submitted, polled and classified through the real ``hpcmem submit`` path on the real Slurm test cluster;
only the GPU is emulated. Inside the job (one process per rank under torchrun) it reads:

  HPCMEM_PLAN          plan.json (micro_batch, seq_len, precision, attention, checkpointing, optimizer,
                       zero_stage, offload_*, alloc_conf, world_size ...)
  HPCMEM_GPU_MEM_GIB   the emulated card (16 = V100-SXM2-16GB, 40 = A100-SXM4-40GB; set by the rendered script
                       on the GPU partitions). The card reports PyTorch's "total capacity" of the real card
                       (15.77 GiB for a 16 GB V100, 39.39 GiB for a 40 GB A100), not the nominal size.
  HPCMEM_DS_CONFIG     the DeepSpeed config (bucket sizes), when the launcher is deepspeed
  MODEL_JSON           a Hugging Face style config (jobs/models/bert-large.json, gpt2.json, llama-7b.json ...)

and computes the training step's true peak memory per GPU with the ground-truth model below. If it does not
fit, the job sleeps ``--oom-after`` seconds (the emulated start-up before the first step dies: loading, model
build, data; what makes wasted job-seconds mean something) and then prints, to stderr, PyTorch >= 2.1's exact
``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...`` message inside a realistic traceback
(``[rankN]:`` prefixed when there are several ranks, as torch >= 2.2 prints them) and exits 1. ``--message
cublas`` prints a ``CUBLAS_STATUS_ALLOC_FAILED`` error instead (an OOM whose message states no numbers).
If it fits, it "trains" for ``--train-s`` x the plan's slowdown and exits 0 writing metrics.json with
``"fake_gpu": true``. Either way rank 0 writes ``fake_gpu_truth.json`` (the model's breakdown) into the
attempt directory, never into the log, so nothing but the OOM message reaches the classifier.

Ground-truth memory model (per GPU, bytes; from ../shared/REFERENCE.md "Memory arithmetic"; written here on
purpose without importing toolkit.ladder, whose model is what the benchmark checks)

  parameters Ψ       counted from the config: BERT (embeddings, 24 x [4h²+2hI ...], pooler, classifier),
                     GPT-2 (tied LM head), LLaMA (q/k/v/o, SwiGLU 3hI, RMSNorm, untied head)
  model states       plain PyTorch (launcher torchrun, DDP): fp32 weights 4Ψ + fp32 grads 4Ψ + AdamW 8Ψ = 16Ψ,
                     also under autocast mixed precision (AMP keeps fp32 weights and grads);
                     DeepSpeed: 16-bit weights 2Ψ + 16-bit grads 2Ψ + fp32 master 4Ψ + AdamW 8Ψ = 16Ψ
                     (fp32: 4Ψ + 4Ψ + 8Ψ); bf16-true: 2Ψ + 2Ψ + bf16 AdamW 4Ψ.
                     8-bit AdamW: optimizer state 2Ψ. Adafactor: factored state, ~0.05 bytes/param. SGD: 4Ψ.
  ZeRO (deepspeed)   stage 1: master + optimizer / N; stage 2: + grads / N; stage 3: + weights / N, plus the
                     gathered working set (two layers' 16-bit weights and the prefetch bucket), plus
                     DeepSpeed's communication buckets: (reduce + allgather bucket elements) x 2 bytes x 4.5
                     with overlap_comm (DeepSpeed's own documented rule; ~0.9 GB with hpcmem's 5e7 buckets).
  offload            optimizer offload removes master + optimizer state from the GPU; parameter offload removes
                     the weight shard (the gathered working set stays). Host/NVMe capacity is NOT checked.
  activations        per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit (x2 in fp32); sdpa/flash drop the 5·a·s/h
                     term; checkpointing keeps 2·s·b·h per layer (x2 in fp32) plus one full layer (recompute).
  logits (causal-lm) 16-bit logits 2·b·s·V plus the fp32 upcast for the loss 4·b·s·V (fp32: 4·b·s·V + 4·b·s·V
                     for the log-softmax); a classification head's logits are negligible.
  non-PyTorch        CUDA context + cuBLAS workspace: 498 MiB (V100) / 532 MiB (A100) / 515 MiB (other),
                     + 180 MiB NCCL buffers with more than one rank. Not counted as PyTorch memory.
  allocator          reserved but unallocated = ``--reserve`` (default 6 %) of the allocated memory; with
                     PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True at most 1 %.

  The step is emulated as a sequence of allocations in steady state (the second step; gradients kept,
  i.e. zero_grad(set_to_none=False)): weights, DeepSpeed buckets, master weights, gradients, optimizer state,
  then the forward pass one layer at a time, then the logits. An allocation of ``c`` bytes fails when
  context + allocated x (1 + reserve) + c > capacity; the OOM message then reports exactly that state:
  tried = c (one layer's activations, a logits tensor, the largest weight or optimizer-state tensor, or a
  flat DeepSpeed partition), in use = context + allocated + reserved-unallocated, free = capacity - in use
  (- other processes). Like real PyTorch, it fails at the first allocation that does not fit: the memory in
  use at that point is a lower bound of what the step needs, not the step's peak.

How it differs from hpcmem's ladder model (toolkit/ladder.py), on purpose
  - absolute bytes from the architecture, where the ladder only scales the failed attempt's numbers with an
    assumed 30-70 % activation share; the ladder does not know the model
  - the logits (b·s·V, large for GPT-2's 50257-token vocabulary) scale with the micro-batch and precision but
    are untouched by attention or checkpointing moves; the ladder lumps them with activations (x 0.25 under
    checkpointing)
  - checkpointing keeps 2·s·b·h per layer + one layer (not a fixed 25 %)
  - DeepSpeed's communication buckets (~0.9 GB) and ZeRO-3's gathered working set; the ladder divides
    model states exactly by the world size
  - plain PyTorch AMP keeps fp32 weights and grads (the ladder counts 16-bit weights + fp32 master)
  - fp32 -> mixed precision halves activations (both models) but leaves AMP's model states at 16Ψ
  - the failing allocation happens at the first allocation that does not fit (not at the peak)
  - the head size is the model's h/a, not a fixed 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

MIB = 2**20
GIB = 2**30

# What PyTorch reports as total capacity for a card of this nominal size (torch.cuda.mem_get_info()[1]).
REPORTED_CAPACITY_GIB = {16: 15.77, 32: 31.74, 40: 39.39, 80: 79.15, 24: 23.65, 48: 47.54}
CARD_NAMES = {16: "Tesla V100-SXM2-16GB", 32: "Tesla V100-SXM2-32GB", 40: "NVIDIA A100-SXM4-40GB",
              80: "NVIDIA A100-SXM4-80GB"}
CONTEXT_MIB = {16: 498.0, 32: 498.0, 40: 532.0, 80: 532.0}
CONTEXT_DEFAULT_MIB = 515.0
NCCL_MIB = 180.0
DEFAULT_RESERVE = 0.06
EXPANDABLE_RESERVE = 0.01
DS_BUCKET_DEFAULT = 500_000_000  # DeepSpeed's default reduce/allgather bucket (elements)
DS_OVERLAP_FACTOR = 4.5

# Emulated step time factors (the job's own; independent of the ladder's slowdown table).
PRECISION_TIME = {"fp32": 2.0, "fp16-mixed": 1.0, "bf16-mixed": 1.0, "bf16-true": 0.95}


# --------------------------------------------------------------------------- the model


def model_shape(cfg: dict, task: str) -> dict:
    """Parameter count, largest tensor, one layer's parameters, and the shape numbers the arithmetic needs."""
    kind = cfg.get("model_type", "")
    if kind == "gpt2":
        V, h, L, a = cfg["vocab_size"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"]
        inner = cfg.get("n_inner") or 4 * h
        emb = V * h + cfg.get("n_positions", 1024) * h
        layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
        head = 2 * h + (h * cfg.get("num_labels", 2) if task == "seq-cls" else 0)  # ln_f; the LM head is tied
        largest = max(V * h, 3 * h * h, h * inner)
    elif kind == "llama":
        V, h, L, a = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        inner = cfg["intermediate_size"]
        kv = cfg.get("num_key_value_heads", a) * (h // a)
        emb = V * h
        layer = 2 * h * h + 2 * h * kv + 3 * h * inner + 2 * h
        head = h + (0 if cfg.get("tie_word_embeddings") else V * h)
        largest = max(V * h, h * inner)
    elif kind == "bert":
        V, h, L, a = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        inner = cfg["intermediate_size"]
        emb = V * h + cfg.get("max_position_embeddings", 512) * h + cfg.get("type_vocab_size", 2) * h + 2 * h
        layer = 4 * (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h) + 2 * h
        head = (h * h + h) + (h * cfg.get("num_labels", 2) + cfg.get("num_labels", 2))
        largest = max(V * h, h * inner)
    else:
        raise SystemExit(f"fake_gpu_job: unknown model_type {kind!r} (gpt2, llama, bert)")
    return {"kind": kind, "V": V, "h": h, "L": L, "a": a, "inner": inner, "params": emb + L * layer + head,
            "layer_params": layer, "largest": largest}


def ds_buckets(ds_config: dict | None) -> tuple[int, int, bool]:
    zero = (ds_config or {}).get("zero_optimization", {})
    return (int(zero.get("reduce_bucket_size", DS_BUCKET_DEFAULT)), int(zero.get("allgather_bucket_size", DS_BUCKET_DEFAULT)),
            bool(zero.get("overlap_comm", True)))


def allocations(plan: dict, shape: dict, task: str, ds_config: dict | None) -> list[tuple[str, float, float]]:
    """The steady-state step as (what, total bytes, allocation size) in allocation order (see the docstring)."""
    P, N = shape["params"], plan["world_size"]
    prec, opt = plan["precision"], plan["optimizer"]
    deepspeed = plan["launcher"] == "deepspeed"
    zero = plan["zero_stage"] if deepspeed else 0
    fp32 = prec == "fp32"
    if not deepspeed and prec != "bf16-true":      # plain PyTorch (AMP keeps fp32 weights and grads)
        w_b, g_b, master_b = 4.0, 4.0, 0.0
    elif prec == "fp32":
        w_b, g_b, master_b = 4.0, 4.0, 0.0
    elif prec == "bf16-true":
        w_b, g_b, master_b = 2.0, 2.0, 0.0
    else:                                          # DeepSpeed mixed precision: 16-bit weights/grads, fp32 master
        w_b, g_b, master_b = 2.0, 2.0, 4.0
    opt_b = {"adamw": 8.0, "adamw-8bit": 2.0, "adafactor": 0.05, "sgd": 4.0}[opt]
    if prec == "bf16-true":
        opt_b = {"adamw": 4.0, "adamw-8bit": 2.0, "adafactor": 0.05, "sgd": 2.0}[opt]
    weights, grads, master, optim = w_b * P, g_b * P, master_b * P, opt_b * P
    if zero >= 1:
        master, optim = master / N, optim / N
    if zero >= 2:
        grads /= N
    if zero >= 3:
        weights /= N
    if plan["offload_optimizer"] != "none":
        master = optim = 0.0
    if plan["offload_params"] != "none":
        weights = 0.0
    flat = zero >= 1
    largest = shape["largest"]
    out = [("weights", weights, weights if flat else largest * w_b)]
    if zero >= 1:
        reduce, gather, overlap = ds_buckets(ds_config)
        buckets = (reduce + gather) * 2.0 * (DS_OVERLAP_FACTOR if overlap else 1.0)
        out.append(("deepspeed buckets", buckets, reduce * 2.0))
    if zero >= 3:
        live = 2 * shape["layer_params"] * 2.0 + ds_prefetch(ds_config) * 2.0
        out.append(("zero3 gathered params", live, shape["layer_params"] * 2.0))
    if master:
        out.append(("master weights", master, master if flat else largest * 4.0))
    out.append(("gradients", grads, grads if flat else largest * g_b))
    if optim:
        out.append(("optimizer state", optim, optim / 2 if flat else largest * opt_b / 2))
    s, b, h, a, L = plan["seq_len"], plan["micro_batch"], shape["h"], shape["a"], shape["L"]
    act_bytes = 2.0 if fp32 else 1.0  # the formula is in bytes for 16-bit activations
    attn = 5.0 * a * s / h if plan["attention"] == "eager" else 0.0
    layer = s * b * h * (34.0 + attn) * act_bytes
    if plan["checkpointing"]:
        keep = 2.0 * s * b * h * act_bytes
        out.append(("activations (checkpoints)", keep * L, keep))
        out.append(("activations (recomputed layer)", layer, layer))
    else:
        out.append(("activations", layer * L, layer))
    if task == "causal-lm":
        logits16 = 2.0 * b * s * shape["V"]
        first = 2 * logits16 if fp32 else logits16
        out.append(("logits", first, first))
        out.append(("logits (fp32 for the loss)", 2 * logits16, 2 * logits16))
    return out


def ds_prefetch(ds_config: dict | None) -> int:
    return int((ds_config or {}).get("zero_optimization", {}).get("stage3_prefetch_bucket_size", 50_000_000))


def simulate(plan: dict, shape: dict, task: str, capacity: float, context: float, reserve: float,
             other: float = 0.0, ds_config: dict | None = None) -> dict:
    """Run the allocation sequence against the card; the first allocation that does not fit is the OOM."""
    allocated = 0.0
    usable = capacity - other
    breakdown = {}
    failure = None
    for what, total, chunk in allocations(plan, shape, task, ds_config):
        breakdown[what] = breakdown.get(what, 0.0) + total
        left = total
        while left > 0 and failure is None:
            c = min(chunk, left) if chunk > 0 else left
            if context + allocated * (1 + reserve) + c > usable:
                failure = {"what": what, "tried": c, "allocated": allocated, "reserved_unallocated": allocated * reserve}
                break
            allocated += c
            left -= c
    peak_alloc = sum(breakdown.values())
    return {"fits": failure is None, "failure": failure, "breakdown_bytes": breakdown,
            "peak_allocated": peak_alloc, "peak_reserved": peak_alloc * (1 + reserve),
            "peak_device": context + peak_alloc * (1 + reserve) + other, "capacity": capacity, "context": context,
            "other_process": other, "reserve": reserve}


def slowdown(plan: dict) -> float:
    """The emulated step time relative to mixed precision, sdpa, no checkpointing/ZeRO/offload, one micro-batch."""
    f = PRECISION_TIME[plan["precision"]]
    f *= 1.12 if plan["attention"] == "eager" else 1.0
    f *= 1.33 if plan["checkpointing"] else 1.0
    f *= 1.0 + 0.04 * math.log2(max(plan["grad_accum"], 1))
    f *= {0: 1.0, 1: 1.02, 2: 1.05, 3: 1.15}[plan["zero_stage"]] if plan["launcher"] == "deepspeed" else 1.0
    f *= {"none": 1.0, "cpu": 1.6, "nvme": 2.4}[plan["offload_optimizer"]]
    f *= {"none": 1.0, "cpu": 1.4, "nvme": 2.0}[plan["offload_params"]]
    f *= {"adamw": 1.0, "sgd": 1.0, "adamw-8bit": 1.04, "adafactor": 1.1}[plan["optimizer"]]
    return f


# --------------------------------------------------------------------------- PyTorch's words


def format_size(n: float) -> str:
    """PyTorch's format_size (c10/cuda/CUDACachingAllocator.cpp)."""
    if n <= 1024:
        return f"{int(n)} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


def oom_message(gpu: int, sim: dict, other_pid: int | None = None) -> str:
    f = sim["failure"]
    reserved = f["allocated"] + f["reserved_unallocated"]
    in_use = sim["context"] + reserved
    free = max(sim["capacity"] - in_use - sim["other_process"], 0.0)
    other = (f"Process {other_pid} has {format_size(sim['other_process'])} memory in use. "
             if sim["other_process"] and other_pid else "")
    return (f"CUDA out of memory. Tried to allocate {format_size(f['tried'])}. GPU {gpu} has a total capacity of "
            f"{format_size(sim['capacity'])} of which {format_size(free)} is free. {other}Including non-PyTorch "
            f"memory, this process has {format_size(in_use)} memory in use. Of the allocated memory "
            f"{format_size(f['allocated'])} is allocated by PyTorch, and {format_size(f['reserved_unallocated'])} "
            f"is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            f"Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


SITE = "/usr/local/lib/python3.11/site-packages"


def traceback_lines(what: str, model_kind: str, deepspeed: bool, script: str) -> list[str]:
    """Frames a real training script shows when an allocation of this kind fails."""
    mod = {"gpt2": "gpt2", "llama": "llama", "bert": "bert"}[model_kind]
    cls = {"gpt2": "GPT2", "llama": "Llama", "bert": "Bert"}[model_kind]
    lines = ["Traceback (most recent call last):"]
    if what in ("weights", "master weights", "deepspeed buckets", "zero3 gathered params") or (
            deepspeed and what in ("gradients", "optimizer state")):
        if deepspeed:
            lines += [f'  File "{script}", line 88, in <module>',
                      "    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=args.deepspeed)",
                      f'  File "{SITE}/deepspeed/__init__.py", line 193, in initialize',
                      "    engine = DeepSpeedEngine(args=args,",
                      f'  File "{SITE}/deepspeed/runtime/engine.py", line 1312, in _configure_optimizer',
                      "    self.optimizer = self._configure_zero_optimizer(basic_optimizer)",
                      ]
            if what == "optimizer state":
                lines += [f'  File "{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", line 568, in __init__',
                          "    self.initialize_optimizer_states()",
                          f'  File "{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", line 703, in initialize_optimizer_states',
                          "    self.optimizer.step()",
                          f'  File "{SITE}/torch/optim/adamw.py", line 152, in _init_group',
                          "    state[\"exp_avg_sq\"] = torch.zeros_like(",
                          "                         ^^^^^^^^^^^^^^^^^"]
            else:
                lines += [f'  File "{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", line 375, in __init__',
                          "    self.single_partition_of_fp32_groups.append(self.parallel_partitioned_bit16_groups[i]"
                          "[partition_id].to(",
                          "                                                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^"]
        else:
            lines += [f'  File "{script}", line 71, in <module>',
                      "    model = model.to(device)",
                      f'  File "{SITE}/torch/nn/modules/module.py", line 1355, in to',
                      "    return self._apply(convert)",
                      f'  File "{SITE}/torch/nn/modules/module.py", line 942, in _apply',
                      "    param_applied = fn(param)",
                      f'  File "{SITE}/torch/nn/modules/module.py", line 1341, in convert',
                      "    return t.to(",
                      "           ^^^^^"]
    elif what in ("gradients", "optimizer state"):
        lines += [f'  File "{script}", line 131, in <module>',
                  "    optimizer.step()",
                  f'  File "{SITE}/torch/optim/optimizer.py", line 485, in wrapper',
                  "    out = func(*args, **kwargs)",
                  f'  File "{SITE}/torch/optim/adamw.py", line 209, in step',
                  "    has_complex = self._init_group(",
                  f'  File "{SITE}/torch/optim/adamw.py", line 152, in _init_group',
                  "    state[\"exp_avg_sq\"] = torch.zeros_like(",
                  "                         ^^^^^^^^^^^^^^^^^"]
    else:
        lines += [f'  File "{script}", line 124, in <module>',
                  "    outputs = model(**batch)" if not deepspeed else "    outputs = engine(**batch)",
                  "              ^^^^^^^^^^^^^^",
                  f'  File "{SITE}/torch/nn/modules/module.py", line 1736, in _wrapped_call_impl',
                  "    return self._call_impl(*args, **kwargs)",
                  f'  File "{SITE}/torch/nn/modules/module.py", line 1747, in _call_impl',
                  "    return forward_call(*args, **kwargs)"]
        if what.startswith("logits"):
            lines += [f'  File "{SITE}/transformers/models/{mod}/modeling_{mod}.py", line 1191, in forward',
                      "    loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)",
                      f'  File "{SITE}/transformers/loss/loss_utils.py", line 36, in ForCausalLMLoss',
                      "    logits = logits.float()",
                      "             ^^^^^^^^^^^^^^"]
        else:
            lines += [f'  File "{SITE}/transformers/models/{mod}/modeling_{mod}.py", line 922, in forward',
                      "    outputs = block(",
                      "              ^^^^^^",
                      f'  File "{SITE}/transformers/models/{mod}/modeling_{mod}.py", line 404, in forward',
                      f"    attn_outputs = self.attn(  # {cls} attention",
                      f'  File "{SITE}/torch/nn/functional.py", line 1425, in dropout',
                      "    _VF.dropout_(input, p, training) if inplace else _VF.dropout(input, p, training)",
                      "                                                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^"]
    return lines


def cublas_lines(script: str) -> list[str]:
    return ["Traceback (most recent call last):",
            f'  File "{script}", line 124, in <module>',
            "    outputs = model(**batch)",
            f'  File "{SITE}/torch/nn/modules/linear.py", line 125, in forward',
            "    return F.linear(input, self.weight, self.bias)",
            "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"]


# --------------------------------------------------------------------------- the job


def card(gib: float) -> tuple[float, str, float]:
    key = int(round(gib))
    capacity = REPORTED_CAPACITY_GIB.get(key, gib * 0.985) * GIB
    return capacity, CARD_NAMES.get(key, f"GPU-{gib:g}GB"), CONTEXT_MIB.get(key, CONTEXT_DEFAULT_MIB) * MIB


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def real_host_job(args) -> int:
    """REAL host memory (no GPU emulated): allocate and touch FIXED + K x micro_batch MiB, hold, exit 0."""
    plan = json.loads(Path(os.environ["HPCMEM_PLAN"]).read_text()) if os.environ.get("HPCMEM_PLAN") else {}
    micro = int(plan.get("micro_batch", 1))
    mib = int(args.real_host_mib + args.real_host_mib_per_sample * micro)
    print(f"real host-memory job (no GPU, not emulated): allocating {mib} MiB "
          f"({args.real_host_mib:g} + {args.real_host_mib_per_sample:g} x micro_batch {micro})", flush=True)
    time.sleep(args.startup_s)
    block = bytearray(mib * MIB)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(args.hold_s)
    print(f"done: held {mib} MiB for {args.hold_s:g} s", flush=True)
    if os.environ.get("HPCMEM_ATTEMPT_DIR") and int(os.environ.get("RANK", "0")) == 0:
        write_json(Path(os.environ["HPCMEM_ATTEMPT_DIR"]) / "metrics.json",
                   {"fake_gpu": False, "real_host_memory_mib": mib, "device": "cpu", "plan": plan,
                    "world_size": plan.get("world_size", 1)})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A FAKE GPU training job (emulated CUDA memory) for benchmarks/retry.py")
    p.add_argument("model", nargs="?", help="model config JSON (jobs/models/*.json)")
    p.add_argument("--task", choices=("causal-lm", "seq-cls"), default=None)
    p.add_argument("--oom-after", type=float, default=float(os.environ.get("FAKE_GPU_OOM_AFTER_S", 6)),
                   help="emulated start-up seconds before the OOM is raised")
    p.add_argument("--train-s", type=float, default=float(os.environ.get("FAKE_GPU_TRAIN_S", 3)),
                   help="emulated training seconds for a fitting plan (x the plan's slowdown)")
    p.add_argument("--reserve", type=float, default=DEFAULT_RESERVE,
                   help="allocator reserved-but-unallocated share of allocated memory (fragmentation)")
    p.add_argument("--message", choices=("pytorch", "cublas"), default="pytorch")
    p.add_argument("--other-process-mib", type=float, default=0.0, help="another process on the card (MiB)")
    p.add_argument("--real-host-mib", type=float, default=None, help="REAL host-memory mode: fixed MiB")
    p.add_argument("--real-host-mib-per-sample", type=float, default=0.0)
    p.add_argument("--startup-s", type=float, default=1.0)
    p.add_argument("--hold-s", type=float, default=2.0)
    p.add_argument("--explain", action="store_true", help="print the truth model for the plan and exit (no sleep)")
    args = p.parse_args(argv)
    if args.real_host_mib is not None:
        return real_host_job(args)
    if not args.model:
        p.error("MODEL_JSON is needed (or --real-host-mib)")
    if "HPCMEM_GPU_MEM_GIB" not in os.environ:
        print("fake_gpu_job: HPCMEM_GPU_MEM_GIB is not set: this FAKE GPU job needs a GPU partition", file=sys.stderr)
        return 2
    cfg = json.loads(Path(args.model).read_text())
    task = args.task or ("seq-cls" if cfg.get("model_type") == "bert" else "causal-lm")
    plan = json.loads(Path(os.environ["HPCMEM_PLAN"]).read_text())
    ds_path = os.environ.get("HPCMEM_DS_CONFIG")
    ds_config = json.loads(Path(ds_path).read_text()) if ds_path and Path(ds_path).is_file() else None
    capacity, name, context = card(float(os.environ["HPCMEM_GPU_MEM_GIB"]))
    if plan["world_size"] > 1:
        context += NCCL_MIB * MIB
    reserve = args.reserve
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        reserve = min(reserve, EXPANDABLE_RESERVE)
    shape = model_shape(cfg, task)
    sim = simulate(plan, shape, task, capacity, context, reserve, args.other_process_mib * MIB, ds_config)
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    truth = {"fake_gpu": True, "card": name, "model": args.model, "task": task, "params": shape["params"],
             "fits": sim["fits"], "capacity_mib": capacity / MIB, "context_mib": context / MIB, "reserve": reserve,
             "peak_allocated_mib": sim["peak_allocated"] / MIB, "peak_device_mib": sim["peak_device"] / MIB,
             "breakdown_mib": {k: round(v / MIB, 1) for k, v in sim["breakdown_bytes"].items()},
             "failure": None if sim["failure"] is None else {
                 "what": sim["failure"]["what"], "tried_mib": sim["failure"]["tried"] / MIB,
                 "allocated_mib": sim["failure"]["allocated"] / MIB},
             "slowdown": slowdown(plan), "plan": plan}
    if args.explain:
        print(json.dumps(truth, indent=1))
        return 0
    attempt_dir = Path(os.environ.get("HPCMEM_ATTEMPT_DIR", "."))
    if rank == 0:
        write_json(attempt_dir / "fake_gpu_truth.json", truth)
        print(f"FAKE GPU (emulated by benchmarks/fake_gpu_job.py, no real GPU): {name}, "
              f"{plan['world_size']} rank(s), {shape['params'] / 1e6:.0f}M parameters", flush=True)
    if not sim["fits"]:
        time.sleep(args.oom_after)
        script = str(Path(sys.argv[0]).resolve())
        if args.message == "cublas":
            lines = cublas_lines(script)
        else:
            lines = traceback_lines(sim["failure"]["what"], shape["kind"], plan["launcher"] == "deepspeed", script)
            lines.append("torch.OutOfMemoryError: " + oom_message(local, sim, other_pid=4242 + local))
        prefix = f"[rank{rank}]: " if plan["world_size"] > 1 else ""
        sys.stderr.write("".join(prefix + line + "\n" for line in lines))
        sys.stderr.flush()
        return 1
    seconds = args.train_s * slowdown(plan)
    steps = 10
    for step in range(steps):
        time.sleep(seconds / steps)
        if rank == 0 and step in (0, steps - 1):
            print(f"step {step} loss {6.9 - 0.01 * step:.4f} (fake)", flush=True)
    if rank == 0:
        write_json(attempt_dir / "metrics.json", {
            "fake_gpu": True, "device": f"fake-gpu ({name}, emulated)", "world_size": plan["world_size"],
            "steps": steps, "warmup_steps": 0, "step_time_s": seconds / steps,
            "samples_per_s": plan["global_batch"] / (seconds / steps),
            "peak_allocated_mib": round(sim["peak_allocated"] / MIB, 1),
            "peak_reserved_mib": round(sim["peak_reserved"] / MIB, 1),
            "device_used_mib": round(sim["peak_device"] / MIB, 1), "capacity_mib": round(capacity / MIB, 1),
            "plan": plan, "applied": {}, "versions": {"fake_gpu_job": "1"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
