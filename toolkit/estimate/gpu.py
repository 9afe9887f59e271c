"""What a GPU process holds besides the tensors the model makes: the constants, each with its source.

Two kinds:

- inside the caching allocator (they are allocations in the replayed stream, so they take blocks
  and segments like any tensor): cuBLAS and cuBLASLt workspaces, DDP gradient buckets, DeepSpeed's
  reduce/all-gather buckets;
- outside it (added to ``device_used`` as named extras): the CUDA context, NCCL's communicator
  buffers, and on torch < 1.11 cuBLAS's own workspace (before PyTorch routed it through the allocator).

Pure arithmetic, no torch import.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

MIB = 1024 * 1024
KIB = 1024

# cuBLAS workspace per (handle, stream), allocated through the caching allocator on the first GEMM and
# kept for the process's life. PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize:
# default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB (8.125 MiB) below compute
# capability 9; ":4096:8" = 32 MiB on Hopper (sm90; torch >= 2.8 also Blackwell sm100/sm120). Also
# PyTorch docs "CUDA semantics: cuBLAS workspaces".
CUBLAS_WORKSPACE_DEFAULT = 2 * 4096 * KIB + 8 * 16 * KIB
CUBLAS_WORKSPACE_HOPPER = 4096 * 8 * KIB
# cuBLASLt workspace (used by addmm/linear with bias on CUDA): CublasHandlePool.cpp getCUDABlasLtWorkspaceSize:
# CUBLASLT_WORKSPACE_SIZE (KiB), default 1024 KiB in torch 2.0-2.4; from 2.5 it defaults to the cuBLAS size
# and shares the cuBLAS workspace when it fits (counted once here, as the cuBLAS one).
CUBLASLT_WORKSPACE_OLD = 1024 * KIB

# NCCL allocates its own device buffers (cudaMalloc, outside PyTorch's allocator) when a communicator
# is set up: per channel and per peer, a buffer per protocol. NCCL docs, "Environment variables":
# NCCL_BUFFSIZE default 4 MiB (the Simple protocol); LL128 ~4.6 MiB and LL 256 KiB per channel per peer
# (NCCL src/include/device.h defaults). A ring touches 2 peers (send, recv) per channel; channel counts
# depend on the topology (NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS); 2 is NCCL's minimum on PCIe, NVLink
# systems use more. We count 2 channels x 2 peers x (4 + 4.6 + 0.25) MiB, a lower bound, and say so.
NCCL_BUFFSIZE = 4 * MIB
NCCL_LL128_BUFFSIZE = int(4.6 * MIB)
NCCL_LL_BUFFSIZE = 256 * KIB
NCCL_MIN_CHANNELS = 2

# DDP: torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25); the first bucket is capped at
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB (torch/nn/parallel/distributed.py). With
# gradient_as_bucket_view=False (the default) the buckets are a second copy of the gradients; with True the
# grads are views into them (no second copy). Built without find_unused_parameters or static_graph, the Reducer
# starts with one bucket of every gradient (bucket_size_limits = [sys.maxsize], DDPBucketConfig
# .compute_bucket_size_limits) and rebuilds it into the capped buckets, in the order the first backward made the
# gradients, at the second iteration's forward (_rebuild_buckets; Reducer::initialize_buckets clears the old
# buckets first). Its construction first broadcasts rank 0's parameters (and buffers, not modelled: the models here
# have none of size) through flat copies of 250 MiB buckets, two in flight (_sync_module_states; c10d comm.cpp
# broadcast_coalesced); a bucket of one tensor is broadcast in place (flatten_dense_tensors returns its view).
DDP_BUCKET_CAP = 25 * MIB
DDP_FIRST_BUCKET = 1 * MIB
DDP_BROADCAST_BUCKET = 250 * MIB
DDP_BROADCASTS_IN_FLIGHT = 2


def cublas_workspace_bytes(gpu_model: str | None, config: str | None = None) -> int:
    """One cuBLAS workspace (bytes) for ``gpu_model`` (its name as nvidia-smi gives it), or for
    ``config`` (a CUBLAS_WORKSPACE_CONFIG value ":SIZE_KIB:COUNT[:SIZE:COUNT...]")."""
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if not pairs:
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {config!r}: expected :SIZE:COUNT pairs (KiB)")
        return sum(int(s) * int(n) for s, n in pairs) * KIB
    return CUBLAS_WORKSPACE_HOPPER if gpu_generation(gpu_model) in ("hopper", "blackwell") else CUBLAS_WORKSPACE_DEFAULT


def gpu_generation(gpu_model: str | None) -> str:
    """volta, turing, ampere, ada, hopper, blackwell or unknown, from a GPU model name."""
    name = (gpu_model or "").upper()
    for marks, gen in ((("B100", "B200", "GB200", "B300", "RTX 50", "RTX PRO 6000 BLACKWELL"), "blackwell"),
                       (("H100", "H200", "H800", "GH200"), "hopper"),
                       (("L4", "L40", "RTX 40", "RTX 6000 ADA"), "ada"),
                       (("A100", "A800", "A10", "A30", "A40", "A6000", "RTX 30", "A5000", "A4000"), "ampere"),
                       (("T4", "RTX 20", "TITAN RTX", "QUADRO RTX"), "turing"),
                       (("V100", "TITAN V"), "volta"), (("P100", "P40"), "pascal")):
        if any(m in name for m in marks):
            return gen
    return "unknown"


# CUDA context (MiB) as nvidia-smi shows it before any tensor memory, by how CUDA loads kernels.
# With lazy loading (CUDA_MODULE_LOADING=LAZY: CUDA >= 11.7, the default PyTorch sets from 1.13/2.0 on)
# only the kernels used are loaded: a few hundred MiB. Without it (torch < 1.13, or CUDA < 11.7) every
# kernel of torch, cuBLAS and cuDNN is loaded at start-up: over a GiB.
# Sources: Hugging Face "Efficient training on a single GPU" (V100, CUDA 11.2, torch 1.10): 1343 MiB
# after a 1-element tensor; NVIDIA CUDA C Programming Guide, "Lazy Loading": module loading on first use.
# The partition's profile (hpcmem calibrate measures it) always wins over this table.
CUDA_CONTEXT_EAGER_MIB = 1343.0


def lazy_loading(torch_version: str | None) -> bool:
    """Whether PyTorch ``torch_version`` loads CUDA modules lazily by default (>= 1.13)."""
    major, minor = version_tuple(torch_version)
    return (major, minor) >= (1, 13)


def version_tuple(text: str | None) -> tuple[int, int]:
    """(major, minor) of a version string; None or unparsable: the current era (2, 99)."""
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (2, 99)


_VERSION = r"(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?"
"""A release number as ``deepspeed_version`` takes it (bounded: a version is never thousands of digits long)."""
ZERO_GRAD_PLACES = ("after_step", "before_backward")
FOREACH_ADAM_ONE_INTERMEDIATE_NIGHTLY = "20230708"
"""The first torch nightly (2.1.0.devYYYYMMDD) with PR #104780's single-intermediate foreach Adam."""
MODEL_CODES = ("transformers", "torchvision", "litgpt")
"""``Runtime.model_code``'s values; litgpt's also as ``litgpt:YYYY-MM-DD``, the date of the code that ran."""
_LITGPT_DATED = re.compile(r"litgpt:(\d{4}-\d{2}-\d{2})\Z")
SHIFTED_COPIES = (None, "after_upcast", "before_upcast")
OUTPUT_KEPT = (None, "model_output", "logits")
"""``Runtime.output_kept``'s values."""
FSDP_LIMIT_ALL_GATHERS_NIGHTLY = "20230712"
"""The first torch nightly (2.1.0.devYYYYMMDD) with PR #104900 (merged 2023-07-11): FSDP1's
``limit_all_gathers`` (the rate limiter) defaults to True; before it, False."""
FSDP2_TORCH = (2, 4)
"""torch whose ``fsdp`` is FSDP2 (``fully_shard``, what hpcmem runs); before it a ``fsdp`` launch is FSDP1."""
FSDP_APIS = (None, "fsdp1", "fsdp2")
"""``Runtime.fsdp_api``'s values (None: by ``FSDP2_TORCH``)."""


@dataclass(frozen=True)
class Runtime:
    """How the job's software behaves where it changes device memory. The defaults are what
    hpcmem's own runtime (torch 2.x, transformers 5.x) does; published measurements made with
    older software are estimated by giving its version."""

    torch_version: str | None = None
    """None: the torch hpcmem runs (2.x)"""
    grads_set_to_none: bool | None = None
    """``zero_grad`` frees the gradients between steps (None: torch >= 2.0's default, True; torch
    1.x's ``Module.zero_grad`` kept them, zeroed)"""
    cublas_workspace_config: str | None = None
    """CUBLAS_WORKSPACE_CONFIG when the job sets it"""
    zero_grad: str = "after_step"
    """where the training loop calls ``zero_grad``: ``after_step`` (or at the top of the loop, before the
    forward: hpcmem's runtime, HF Trainer, torch's examples) or ``before_backward`` (``logits = model(x);
    loss = ...; optimizer.zero_grad(); loss.backward()``, as in many hand-written loops and Lightning's
    automatic optimization, whose closure runs the training step, then zero_grad, then backward). With
    ``set_to_none`` (torch >= 2.0) the grads are freed where it is called, so ``before_backward`` keeps the
    previous step's gradients alive through the whole next forward."""
    logits_fp32: bool = True
    """the causal-LM loss upcasts the logits to fp32 (transformers: ``logits.float()`` before the
    cross-entropy); False: ``F.cross_entropy`` on 16-bit logits (litgpt, hand-written loops)"""

    fsdp_limit_all_gathers: bool | None = None
    """FSDP1's ``limit_all_gathers`` as the job passes it (None: the job passes none and the torch version's
    default applies; see ``fsdp_unlimited_all_gathers``)"""
    fsdp_use_orig_params: bool = False
    """FSDP1's ``use_orig_params`` as the job passes it (False: FSDP1's default; Lightning's ``FSDPStrategy``
    passes True): the optimizer steps over each original parameter's piece of the rank's shard instead of one
    flat parameter per unit (``strategies.fsdp.optimizer_tensors``)"""
    fsdp_embedding_unit: bool = False
    """the job's FSDP wraps the input embedding as a unit of its own (an auto-wrap policy naming ``nn.Embedding``,
    as Lambda's distributed-training guide does), so the root unit keeps the final norm and an untied head only
    and is reduced as soon as their gradients exist, in the head's backward; False: hpcmem's, HF Accelerate's and
    Lightning's wrap (the transformer blocks, the rest in the root), whose root is reduced at the backward's end.
    A tied head shares the embedding's weight and so its unit: no difference there. Under FSDP a unit that is not the
    root is resharded after its forward, so the embedding's weights are gathered for its forward and again for its
    backward only (torchtitan since its PR #1094, 2025-07-28, wraps ``tok_embeddings`` so, and ``[norm, output]`` as
    one unit kept gathered: the root here)"""
    fsdp_keep_last_block: bool = False
    """the job's FSDP does not reshard the last transformer block after its forward (``reshard_after_forward=False``
    on that block only, "since FSDP would prefetch it immediately"), so its weights stay gathered from its forward
    through the loss to its backward: torchtitan from its first FSDP2 wrap (PR #165, 2024-03) to its PR #1094
    (2025-07-28, read in the mirror of pytorch/torchtitan). False: every block is resharded alike"""

    ddp_side_stream: bool = False
    """DistributedDataParallel is built inside a stream of its own: Lightning's ``DDPStrategy`` (Fabric's and the
    Trainer's, since Lightning 2.1, PR #17334; read in the 2.1.0 and 2.6.6 wheels: ``setup_module`` / ``_setup_model``
    under ``torch.cuda.stream(torch.cuda.Stream())``). The blocks its construction makes, the broadcast's flat
    copies and the Reducer's first all-gradient bucket, then belong to that stream's pool, which the training's
    stream never reuses (``get_free_block`` matches the stream): they stay reserved, on top of the rebuilt buckets,
    until ``empty_cache`` or an allocation that would otherwise fail releases them. False: built on the default
    stream (torch's own examples, hpcmem's runtime)"""

    ddp_single_process: bool = False
    """the job wraps its model in DistributedDataParallel when it runs one process too, so a one-GPU run has DDP's
    construction and gradient buckets (torch builds the Reducer for a world of one as for more): scripts that wrap
    whenever torchrun started them (nanoGPT's ``ddp = int(os.environ.get('RANK', -1)) != -1``, a ``--strategy ddp``
    flag). False: one process runs the bare model (hpcmem's runtime wraps only over several ranks)"""

    fsdp_api: str | None = None
    """which FSDP the job wraps with: ``"fsdp1"`` (``FullyShardedDataParallel``, flat parameters), ``"fsdp2"``
    (``fully_shard``, a DTensor per parameter: hpcmem's launcher). None: FSDP1 when ``torch_version`` is before
    2.4 (FSDP2's first release), else FSDP2. FSDP1 stays common on later torch: HF Accelerate's FSDP plugin, the
    HF Trainer's ``fsdp`` and Lightning's ``FSDPStrategy`` wrap with it unless told otherwise (Accelerate 1.0.1's
    plugin has no other path)"""

    fsdp_no_sync: bool = False
    """gradient accumulation under FSDP skips the gradient sync on every micro-batch but the last: FSDP1's
    ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``, which HF Accelerate's ``accumulate``/``no_sync``,
    HF Trainer (every micro-batch but the last) and Lightning (Fabric's ``no_backward_sync``, the Trainer's
    ``accumulate_grad_batches``) use. Each unit then keeps its whole unsharded gradient from the first micro-batch
    until the last one's reduce-scatter ("FSDP will accumulate the full model gradients (instead of gradient
    shards) until the eventual sync", ``FullyShardedDataParallel.no_sync``; ``strategies.fsdp``). False: every
    micro-batch reduce-scatters its gradients, as hpcmem's runtime does"""

    engine_config: Mapping[str, Any] | None = field(default=None, hash=False)
    """the engine's settings as the job states them, where they change device memory: DeepSpeed's ds_config
    ``zero_optimization`` section (its bucket sizes; ``strategies.deepspeed.ZeroSettings``). None: the config
    hpcmem writes for the plan."""

    sdpa_repeats_kv: bool = False
    """a grouped-query model's attention hands SDPA its K and V repeated to every query head (``repeat_kv``), so
    SDPA saves them at the query's width: transformers always until its PR #39412 (merged 2025-07-15; 4.40's
    ``LlamaSdpaAttention`` read), since then whenever a mask reaches SDPA (padded batches) on CUDA or the head
    dimension is over 256 (``use_gqa_in_sdpa``, read in 5.23), and torchtitan's Llama before its PR #2259.
    False: SDPA's own grouped-query path sees the KV heads, as hpcmem's runtime (transformers 5, no padding) runs"""

    shifted_logits_copy: str | None = None
    """the causal-LM loss shifts the logits with a contiguous copy (``shift_logits = logits[..., :-1, :]
    .contiguous()``) before the cross-entropy: ``"after_upcast"``, of the fp32 logits (transformers' causal-LM
    heads until PR #35646, merged 2025-01, "removing unnecessary contiguous() call": 4.40's
    ``Qwen2ForCausalLM``/``LlamaForCausalLM`` and 4.46's ``ForCausalLMLoss`` read); ``"before_upcast"``, of the
    logits in the compute dtype, which autocast's cross-entropy then casts (a hand-written loss such as
    ColossalAI's ``GPTLMLoss``). None: the labels are shifted instead (transformers since, hpcmem's runtime) or
    the data loader shifts the targets"""

    output_kept: str | None = None
    """the training loop keeps the model's output in a variable of its own, so a causal LM's logits outlive the
    loss: through the backward and the optimizer step, until the next micro-batch's forward rebinds the variable.
    ``"model_output"``: the object the model returns, the loss computed inside it (``out = model(input_ids,
    labels=input_ids); out.loss.backward()``: HF's no_trainer examples, PEFT's method comparison, many hand-written
    loops), rebound once the next forward and its loss have returned; ``"logits"``: the logits the loop passes to
    its own loss (``logits = model(x); loss = loss_fn(logits, y); loss.backward()``: litgpt's fine-tuning scripts,
    nanoGPT, torch's examples), rebound as soon as the next forward returns them. The tensor kept is the one the
    model returns (fp32 under ``logits_upcast_in_model``, else the compute dtype's); a loop's own shifted or
    reshaped copy of it, as large, counts the same. None: the output is dropped before the backward (hpcmem's
    runtime, ``loss = model(**batch).loss``; HF Trainer and Lightning, whose step returns the loss only; torchtitan
    and torchtune, which ``del`` the logits before the backward)"""

    rotary_tables: bool = False
    """each attention layer's rotary embedding keeps cos and sin tables for ``max_position_embeddings`` positions as
    model buffers, which the engine moves to the device with the model and casts to its dtype: transformers'
    per-layer ``RotaryEmbedding`` of Llama (to 4.37 ``cos_cached``, 4.39-4.40 ``_cos_cached``; 4.38 kept them as
    plain attributes, not moved), Mistral (to 4.41) and Qwen2 (4.37-4.44), read in those releases' modeling files
    (``_set_cos_sin_cache(seq_len=max_position_embeddings)``). False: tables computed per forward for the positions
    in use (transformers since, hpcmem's runtime)"""

    loss_chunk_rows: int = 0
    """the loop's cross-entropy runs over chunks of this many rows of the flattened logits, one
    ``F.cross_entropy`` per chunk (litgpt's ``chunked_cross_entropy``, 128 rows by default): each chunk's
    log-probs go as its gradient comes, and ``split``'s backward concatenates the chunks' gradients into one
    gradient of the logits, so the loss's backward holds two logits-sized tensors (the chunks' gradients and
    their concatenation) where one cross-entropy holds three (its log-probs and the two gradients), or the
    log-probs and one chunk's two gradients where a chunk is over half the rows. The chunks are taken of logits
    already in the loss's dtype: the model's own (``logits_fp32`` false) or upcast by the model or its wrapper
    (``logits_upcast_in_model``); a loss that upcasts each chunk itself is refused. 0: one cross-entropy over
    all rows (transformers' loss, ``chunked_cross_entropy(..., chunk_size=0)``)"""

    logits_upcast_in_model: bool = False
    """the causal LM's own forward upcasts its logits (``logits = logits.float()``, transformers before 4.46's
    ``loss_function``: 4.40's and 4.31's ``LlamaForCausalLM`` read), so the 16-bit logits are unreferenced before
    the loss; False: the loss function upcasts a copy and the model's output still holds the 16-bit logits
    (transformers since ``ForCausalLMLoss``, hpcmem's runtime) or there is no upcast"""

    deepspeed_version: str | None = None
    """the DeepSpeed the job ran, where its code allocates differently (``zero3_master_from_clone``,
    ``zero_offload_step_fp32_copy``, ``zero_overflow_check``, ``zero3_stale_available_count``); None: the one
    installed beside hpcmem (``installed_deepspeed``: hpcmem's jobs run it), else ``CURRENT_DEEPSPEED``"""

    zero3_linear_wrapped: bool = True
    """DeepSpeed ZeRO-3 installs its memory-efficient linear (``F.linear`` replaced by ``zero3_linear_wrap``, whose
    autograd saves the weight parameter, not a view of its gathered data): it does for a model built inside
    ``zero.Init`` (hpcmem's runtime; transformers' ``from_pretrained`` once a ZeRO-3 config exists), and since
    DeepSpeed PR #8189 (merged 2026-07-28) for a model passed to ``deepspeed.initialize`` already built. False: a
    model built outside ``zero.Init`` and run by an older DeepSpeed, where torch's linear keeps each gathered
    weight (a ``weight.t()`` view) from its forward to its backward (``strategies.deepspeed.zero3_gathered``)"""

    eager_clamps_scores: bool = False
    """the model's eager attention clamps the masked scores with ``torch.max`` before its softmax and upcasts only
    fp16 scores (``softmax(dtype=float32).to(float16)``; other scores keep their dtype): transformers' OPT attention
    of 2022-2023 (4.29's ``OPTAttention``, read in copies of it), which autograd makes keep the clamp's input, one
    more heads x sequence matrix per token (fp32 under autocast, whose fp32 mask promotes the scores). False:
    today's attention functions (``softmax(dtype=float32)`` on scores without a clamp)"""

    model_code: str = "transformers"
    """whose modelling code builds the model: ``transformers`` (the HF class of the config's family),
    ``torchvision`` (``torchvision.models.VisionTransformer`` for a ViT config: packed in-projection and
    ``nn.MultiheadAttention``, whose tensors differ) or ``litgpt`` (Lightning's ``litgpt.model.GPT`` for a
    LLaMA-family config: one fused Q/K/V projection, the query rotated with a ``cat`` that leaves it in (batch,
    heads, tokens) order, so the attention output comes back in that order and is copied for the output
    projection; K and V repeated to every query head). ``litgpt:YYYY-MM-DD``: litgpt's (or lit-gpt's) code as of
    that date, whose RMSNorm changed over time (``activations.LITGPT_RMS_NORM``); plain ``litgpt`` is today's.
    See ``activations.layer_bytes_per_token``"""

    def __post_init__(self):
        for name in ("logits_fp32", "sdpa_repeats_kv", "logits_upcast_in_model", "zero3_linear_wrapped",
                     "fsdp_no_sync", "ddp_side_stream", "eager_clamps_scores", "fsdp_embedding_unit",
                     "fsdp_keep_last_block", "ddp_single_process", "rotary_tables"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Runtime.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.shifted_logits_copy not in SHIFTED_COPIES:
            raise ValueError(f"Runtime.shifted_logits_copy: {self.shifted_logits_copy!r} is not one of "
                             f"{', '.join(str(x) for x in SHIFTED_COPIES)}")
        if isinstance(self.loss_chunk_rows, bool) or not isinstance(self.loss_chunk_rows, int) \
                or not 0 <= self.loss_chunk_rows <= 2**31:
            raise ValueError(f"Runtime.loss_chunk_rows: expected a whole number of rows (0: no chunks), "
                             f"got {self.loss_chunk_rows!r}")
        if self.loss_chunk_rows and ((self.logits_fp32 and not self.logits_upcast_in_model)
                                     or self.shifted_logits_copy == "before_upcast"):
            raise ValueError("Runtime.loss_chunk_rows: a chunked loss is known on logits already in its dtype "
                             "(logits_fp32 false, or logits_upcast_in_model true), not one that upcasts each chunk")
        if self.output_kept not in OUTPUT_KEPT:
            raise ValueError(f"Runtime.output_kept: {self.output_kept!r} is not one of "
                             f"{', '.join(str(x) for x in OUTPUT_KEPT)}")
        if self.deepspeed_version is not None and not re.match(_VERSION + r"\S{0,40}\Z", str(self.deepspeed_version)):
            raise ValueError(f"Runtime.deepspeed_version: expected a version such as 0.14.2, "
                             f"got {self.deepspeed_version!r}")
        if self.engine_config is not None and not isinstance(self.engine_config, Mapping):
            raise ValueError(f"Runtime.engine_config: expected an object, got {self.engine_config!r}")
        if self.zero_grad not in ZERO_GRAD_PLACES:
            raise ValueError(f"Runtime.zero_grad: {self.zero_grad!r} is not one of {', '.join(ZERO_GRAD_PLACES)}")
        dated = _LITGPT_DATED.match(self.model_code) if isinstance(self.model_code, str) else None
        if dated:
            try:
                datetime.date.fromisoformat(dated.group(1))
            except ValueError:
                raise ValueError(f"Runtime.model_code: {self.model_code!r} has no valid date (YYYY-MM-DD)") from None
        elif self.model_code not in MODEL_CODES:
            raise ValueError(f"Runtime.model_code: {self.model_code!r} is not one of {', '.join(MODEL_CODES)} "
                             f"or litgpt:YYYY-MM-DD")
        if self.fsdp_api not in FSDP_APIS:
            raise ValueError(f"Runtime.fsdp_api: {self.fsdp_api!r} is not one of fsdp1, fsdp2")

    def _deepspeed_before(self, release: tuple[int, int, int]) -> bool:
        """The job's DeepSpeed (``deepspeed_version``, else the one installed beside hpcmem, else
        ``CURRENT_DEEPSPEED``) is older than ``release``."""
        m = re.match(_VERSION, self.deepspeed_version or installed_deepspeed() or CURRENT_DEEPSPEED)
        return bool(m) and (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) < release

    @property
    def zero3_stale_available_count(self) -> bool:
        """ZeRO-3's coordinator reset its count of available parameters at the backward's end, so each later step
        started below zero by the embeddings' and persistent parameters' elements and prefetched further
        (``strategies.deepspeed.zero3_gathered``), before DeepSpeed PR #6662 (v0.15.4, 2024-11; read in v0.9.2,
        v0.12.0, v0.14.2 and 0.19.8)."""
        return self._deepspeed_before((0, 15, 4))

    @property
    def zero3_master_from_clone(self) -> bool:
        """ZeRO-3 made each sub-group's fp32 master as ``.clone().float()`` of its 16-bit partition (a 16-bit clone
        freed at once; with fp32 weights the clone is the master, a copy of its own) before DeepSpeed PR #7700
        (v0.18.3, 2025-12; read in v0.14.2 and v0.16.4); since, ``.to(dtype=fp32)`` then ``.clone()``
        (``strategies.deepspeed.zero3_startup``)."""
        return self._deepspeed_before((0, 18, 3))

    @property
    def zero_offload_step_fp32_copy(self) -> bool:
        """ZeRO-1/2 with CPU optimizer offload copy each updated fp32 partition back as
        ``bit16_partition.copy_(fp32_partition.to(device))``: the whole fp32 partition on the device during the
        step. From DeepSpeed PR #5301 ("fix pagable h2d memcpy", v0.14.1; read in v0.14.2 and v0.16.0) until PR
        #7309 (v0.17.0, "Fix the GPU memory usage of ZeRO-Offload": a 16-bit pinned host buffer instead); before
        and since, nothing of the partition's size on the device."""
        return not self._deepspeed_before((0, 14, 1)) and self._deepspeed_before((0, 17, 0))

    @property
    def zero_overflow_check(self) -> str | None:
        """How ZeRO-1/2's overflow check ``_has_inf_or_nan`` allocates (with CPU offload it runs on each gradient
        handed to the host; ``strategies.deepspeed.overflow_check``):

        - ``"sum"`` before DeepSpeed PR #5115 (v0.13.3): ``float(x.float().sum())``, an fp32 copy of a 16-bit
          tensor (read in v0.7.0 and v0.13.2);
        - ``"elementwise"`` from v0.13.3: an fp32 copy, three bool masks and an fp32 copy of the last, all alive at
          once (read in v0.14.2, every tag to v0.19.5 and the 0.19.6 tree of 2026-08-22);
        - None from DeepSpeed PR #8325 (merged 2026-08-26, "stop allocating per-element temporaries in the overflow
          check"): a reduction first, nothing of the tensor's size (read in 0.19.8). 0.19.6 and 0.19.7 were not
          read and count as elementwise, the larger."""
        if self._deepspeed_before((0, 13, 3)):
            return "sum"
        return "elementwise" if self._deepspeed_before((0, 19, 8)) else None

    @property
    def grads_through_forward(self) -> bool:
        """The previous step's gradients are alive during the forward (freed only before the backward)."""
        return self.frees_grads and self.zero_grad == "before_backward"

    @property
    def frees_grads(self) -> bool:
        if self.grads_set_to_none is not None:
            return self.grads_set_to_none
        return version_tuple(self.torch_version) >= (2, 0)

    @property
    def softmax_saves_input(self) -> bool:
        """torch < 1.11's autograd saved softmax's (and log_softmax's) input as well as its output for the
        backward (``_softmax_backward_data(grad, output, dim, self)``; pytorch/pytorch issue #49600, fixed
        by passing the input's dtype instead, PR #65242, after the 1.10 branch cut)."""
        return version_tuple(self.torch_version) < (1, 11)

    @property
    def foreach_adam_intermediates(self) -> int:
        """Parameter-sized intermediate lists torch's foreach Adam/AdamW step holds at once: 2 until
        pytorch/pytorch PR #104780 / #104898 (nightlies from 2023-07-08, the 2.1 release), where
        ``exp_avg_sq_sqrt = _foreach_sqrt(...)`` stayed referenced while ``denom = _foreach_add(
        exp_avg_sq_sqrt, eps)`` made a second list (issue #97712); 1 after (the eps add is in place)."""
        if version_tuple(self.torch_version) < (2, 1):
            return 2
        if version_tuple(self.torch_version) == (2, 1):
            dev = re.search(r"dev(\d{8})", self.torch_version or "")
            if dev and dev.group(1) < FOREACH_ADAM_ONE_INTERMEDIATE_NIGHTLY:
                return 2
        return 1

    @property
    def fsdp_flat_params(self) -> bool:
        """A ``fsdp`` launch is FSDP1 (torch before 2.4, when the job states its torch): each wrapped unit's
        parameters are one flat parameter, sharded as one (what the optimizer then steps over:
        ``fsdp_use_orig_params``); FSDP2 shards each parameter as a DTensor of its own. ``fsdp_api`` says which
        when the job states it."""
        if self.fsdp_api is not None:
            return self.fsdp_api == "fsdp1"
        return self.torch_version is not None and version_tuple(self.torch_version) < FSDP2_TORCH

    @property
    def fsdp_root_reshards_after_forward(self) -> bool:
        """FSDP2 frees the root unit's gathered weights after its forward and gathers them again for its backward,
        where the job passes ``reshard_after_forward=True`` (hpcmem's runtime and HF Accelerate pass the plan's
        value): from torch 2.8 (pytorch PRs #154704 and #155319, merged 2025-06; read in torch 2.13's
        ``FSDPState._lazy_init``, which keeps the root only when the job passes nothing). Before, FSDP2 kept the
        root gathered whatever the job said (pytorch issue #154655); FSDP1 keeps its root (``_post_forward_reshard``).
        The root's forward holds the loss, so this changes the allocator's blocks, not the peaks."""
        return not self.fsdp_flat_params and version_tuple(self.torch_version) >= (2, 8)

    @property
    def fsdp_unlimited_all_gathers(self) -> bool:
        """FSDP1 without its rate limiter: torch before 2.1.0.dev20230712 (``limit_all_gathers: bool =
        False`` in ``FullyShardedDataParallel.__init__`` until PR #104900), when the caller passes none
        (Lightning Fabric's ``FSDPStrategy`` forwards its ``**kwargs`` and sets only ``use_orig_params``).
        FSDP1 frees each unit's unsharded flat parameter after ``record_stream`` on the compute stream
        (``FlatParamHandle._free_unsharded_flat_param``; all-gathered on its ``unshard`` stream) and each
        unit's unsharded gradient after ``record_stream`` on the ``post_backward`` stream; the caching
        allocator reuses such a block only once those streams pass the recorded point. The limiter makes
        the CPU wait for the free of the unit two back; without it, a GPU-bound step's CPU thread issues
        the whole forward and backward before the GPU is through the first units, so no such block is
        reused within the step: every unit's forward and backward gather and every unit's unsharded
        gradient are reserved at once (the bound; ``memory_allocated`` does not see it: the frees have
        happened). False from 2.1 on and for FSDP2 (which reuses its all-gather buffers by stream order)."""
        if not self.fsdp_flat_params:
            return False
        if self.fsdp_limit_all_gathers is not None:
            return not self.fsdp_limit_all_gathers
        if version_tuple(self.torch_version) < (2, 1):
            return True
        if version_tuple(self.torch_version) == (2, 1):
            dev = re.search(r"dev(\d{8})", self.torch_version or "")
            return bool(dev and dev.group(1) < FSDP_LIMIT_ALL_GATHERS_NIGHTLY)
        return False

    @property
    def cublas_in_allocator(self) -> bool:
        """PyTorch >= 1.11 gives cuBLAS its workspace from the caching allocator (CublasHandlePool.cpp)."""
        return version_tuple(self.torch_version) >= (1, 11)

    @property
    def cublaslt_separate(self) -> bool:
        """torch 2.0-2.4 kept a separate 1 MiB cuBLASLt workspace; from 2.5 it shares cuBLAS's."""
        return (2, 0) <= version_tuple(self.torch_version) < (2, 5)


DEFAULT_RUNTIME = Runtime()


CURRENT_DEEPSPEED = "0.19.8"
"""The newest DeepSpeed whose allocations were read (setup.cfg allows >= 0.14): what a Runtime without a
``deepspeed_version`` assumes where no DeepSpeed is installed."""


@lru_cache(maxsize=1)
def installed_deepspeed() -> str | None:
    """The version of the DeepSpeed installed beside hpcmem, from its distribution metadata (nothing is imported);
    None when it is not installed. Read once per process."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def nccl_buffer_bytes(world_size: int) -> int:
    """NCCL's own device buffers per rank (outside the allocator), a lower bound; 0 on one rank."""
    if world_size <= 1:
        return 0
    return NCCL_MIN_CHANNELS * 2 * (NCCL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE)


def bucket_members(sizes, limits: tuple[int, ...]) -> list[list[int]]:
    """torch's ``compute_bucket_assignment_by_size`` (c10d ``reducer.cpp``) for tensors of one dtype and device, in
    bytes: each tensor joins the open bucket, which closes once it has reached its limit (so it overshoots by up to
    its last tensor); the limits are taken in turn, the last for the rest. Each bucket as its tensors' sizes."""
    out: list[list[int]] = []
    cur: list[int] = []
    k = 0
    for size in sizes:
        cur.append(size)
        if sum(cur) >= limits[k]:
            out.append(cur)
            cur, k = [], min(k + 1, len(limits) - 1)
    if cur:
        out.append(cur)
    return out


def buckets_by_size(sizes, limits: tuple[int, ...]) -> list[int]:
    """The bytes of each bucket ``bucket_members`` forms."""
    return [sum(m) for m in bucket_members(sizes, limits)]


def ddp_bucket_sizes(grad_bytes_in_order: list[int]) -> list[int]:
    """DDP's gradient buckets (bytes) as the Reducer rebuilds them, over the gradients in the order the backward
    makes them (the parameters' reverse order of registration): the first closed at 1 MiB, the others at 25 MiB."""
    return buckets_by_size(reversed(grad_bytes_in_order), (DDP_FIRST_BUCKET, DDP_BUCKET_CAP))


def ddp_broadcast_sizes(state_bytes_in_order: list[int]) -> list[int]:
    """The flat copies DDP's construction broadcasts rank 0's parameters through (bytes, in order): one per bucket
    of more than one tensor (a lone tensor is broadcast in place)."""
    return [sum(m) for m in bucket_members(state_bytes_in_order, (DDP_BROADCAST_BUCKET,)) if len(m) > 1]


def paged_states(paged_mib: float, room_mib: float, ranks: int) -> tuple[float, str]:
    """Where a paged optimizer's states (``ModelStates.paged_optimizer_bytes``: CUDA unified memory, outside the
    caching allocator) sit, per rank: resident on the device as far as ``room_mib`` (what the card has left beside
    everything the step needs) allows, the rest paged out to host memory by the driver, which it does whenever the
    device needs the room. So they never make a step fail and are not in ``device_used_mib``, the memory a fit
    needs: nvidia-smi shows the resident part on top of it. Returns (host MiB per node for the ``ranks`` of a node,
    the estimate's note)."""
    resident = min(paged_mib, max(room_mib, 0.0))
    out = paged_mib - resident
    note = (f"paged optimizer states: {paged_mib:.0f} MiB per rank in CUDA unified memory, outside the caching "
            f"allocator and device used (nvidia-smi shows {resident:.0f} MiB of them resident on top)"
            + (f"; {out:.0f} MiB paged out to host memory" if out >= 0.5 else ""))
    return out * ranks, note


def gpu_extras_mib(world_size: int, gpu_model: str | None, runtime: Runtime = DEFAULT_RUNTIME) -> dict[str, float]:
    """Device memory outside the caching allocator (MiB, by name): NCCL's buffers on more than one
    rank; cuBLAS's own workspace where torch did not route it through the allocator (< 1.11)."""
    out: dict[str, float] = {}
    nccl = nccl_buffer_bytes(world_size)
    if nccl:
        out["nccl_buffers"] = nccl / MIB
    if not runtime.cublas_in_allocator:
        out["cublas_workspace"] = cublas_workspace_bytes(gpu_model, runtime.cublas_workspace_config) / MIB
    return out
