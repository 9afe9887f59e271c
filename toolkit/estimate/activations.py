"""The activation inventory: what autograd saves per transformer layer and outside the layers, tensor by
tensor for the model family's HF blocks (bytes; pure arithmetic on a ``ModelShape``, a ``Plan`` and the engine's
``Dtypes``). ``analytic`` sums it by phase, ``stream`` lays it out as the allocator sees it; both import it from
here, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..modelshape import ModelShape
from ..plan import Plan
from ..strategies import Dtypes
from ..strategies.base import recipe_sizes
from .gpu import DEFAULT_RUNTIME, Runtime, version_tuple

LN_STATS_BYTES = 8
"""LayerNorm saves fp32 mean and rstd per token."""
ID_BYTES = 8


# -- activations -------------------------------------------------------------------------------

# Tensors of the FFN's width an activation function leaves saved, counting the output the
# next matmul saves: a fused kernel keeps its input and output (2); HF's python GELUs keep
# their intermediates (gelu_new: x, tanh, 1 + tanh, x/2 and the product); ReLU only its output.
ACTIVATION_SAVED = {"gelu_new": 5, "quick_gelu": 3, "relu": 1}
DEFAULT_ACTIVATION_SAVED = 2


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, stores_scores: bool = True) -> float:
    """Korthikanti et al. (2022): bytes one Megatron GPT layer saves with 16-bit activations.

    s·b·h·(34 + 5·a·s/h); without the attention matrix (flash/SDPA) s·b·h·34.
    """
    return s * b * h * (34 + (5 * a * s / h if stores_scores else 0))


def _ffn_bytes(shape: ModelShape, dt: Dtypes) -> float:
    """Per token: what the MLP's activation function and its output keep (width ffn)."""
    c, f = dt.compute, shape.ffn
    if shape.gated:  # act(gate) keeps gate and act out; the product keeps both factors; down_proj the product
        return 4 * c * f
    if shape.activation == "gelu_new" and dt.autocast and dt.gpu:
        # CUDA autocast runs pow in fp32: x, tanh and 1 + tanh become fp32, the product is cast back.
        return (3 * 4 + 2 * c) * f
    return ACTIVATION_SAVED.get(shape.activation, DEFAULT_ACTIVATION_SAVED) * c * f


def sequence_length(shape: ModelShape, plan: Plan) -> int:
    """Tokens per sample: fixed by an image model's config (patches + CLS), else the plan's seq_len."""
    return shape.seq_len if shape.seq_len is not None else plan.seq_len


def _attention_bytes(shape: ModelShape, plan: Plan, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Per token: the attention kernel's saved Q, K, V and output, and the score matrix when stored.

    torch < 1.11 (``runtime.softmax_saves_input``): softmax saved its input too (the masked scores, in
    softmax's dtype), one more a x s x s matrix per layer. An eager attention that clamps the masked scores
    (``runtime.eager_clamps_scores``) keeps them for the clamp's backward."""
    c, a, s = dt.compute, shape.heads, sequence_length(shape, plan)
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if not stores_scores(shape, plan, dt):
        masked = window_masked(shape, plan)
        litgpt = litgpt_code(shape, runtime)
        repeated = kv_dim != q_dim and (runtime.sdpa_repeats_kv or masked or litgpt is not None)
        if repeated:
            # K and V repeated to every query head before SDPA: older transformers always
            # (Runtime.sdpa_repeats_kv), today's whenever a mask is passed (use_gqa_in_sdpa), litgpt in training
            kv_dim = q_dim
        width = flash_padded_head_dim(shape, plan, dt, masked, runtime)
        # q, k, v, out (at the padded width where CUDA's flash kernel pads them); fp32 log-sum-exp per head
        saved = (2 * q_dim + 2 * kv_dim) * c * width / shape.head_dim + 4 * a
        if masked:
            saved += s * c  # the window's mask, made additive in the compute dtype by each layer's SDPA call
        code = shape.fused or litgpt is not None
        # the saved value is a view of a fused projection (Phi-3's; litgpt's for a multi-head model: split off as
        # a view today, and before its PR #1013 reshaped from (B, groups, 1, T, hs), which merges a size-1
        # dimension and so is a view too), whose q and k parts then live on too; not where it was repeated,
        # padded, or concatenated to a KV cache (a classifier's, kept off by checkpointing)
        if code and not repeated and width == shape.head_dim and not (shape.kv_cache and not plan.checkpointing):
            saved += (q_dim + shape.kv_heads * shape.head_dim) * c
        # o_proj's input, the output made contiguous again: where the query left a ``cat`` in (batch, heads,
        # tokens) order (Phi-3's and litgpt's rotary) and the kernel lays its output out as its query, or where
        # the kernel's padded output was sliced back
        if (code and output_follows_query(plan, dt, masked)) or width != shape.head_dim:
            saved += q_dim * c
        return saved
    if runtime.eager_clamps_scores:
        # the clamp's input (the masked scores: fp32 under autocast), softmax's output (fp32 for fp16 or fp32
        # scores, else their own dtype), and what the second matmul takes: dropout's output, or the 16-bit copy
        scores = 4 if dt.autocast else c
        fp16 = not dt.autocast and c == 2 and plan.precision.startswith("fp16")
        soft = 4 if fp16 or scores == 4 else scores
        rest = dt.mask + c if shape.attn_dropout > 0 else (c if soft != c else 0)
        return 4 * q_dim * c + a * s * (scores + soft + rest)
    # Eager: K and V repeated to every head (GQA), softmax output, its 16-bit copy or dropout.
    causal = shape.family not in ("bert", "vit")
    # The causal mask is in the weights' dtype (fp32 under autocast) and CUDA's autocast
    # runs softmax in fp32: then softmax's output is fp32 and a 16-bit copy feeds the matmul.
    # LLaMA's and ViT's eager attention ask softmax for fp32 outright.
    soft = 4 if shape.family in ("llama", "vit", "opt") or (dt.autocast and (causal or dt.gpu)) else c
    if shape.attn_dropout > 0:
        extra = dt.mask + c
    else:
        extra = c if soft != c else 0
    if runtime.softmax_saves_input:
        extra += soft
    if shape.attn_softcap:
        extra += c  # cap * tanh(scores / cap): the tanh's output, in the scores' dtype
    return 4 * q_dim * c + a * s * (soft + extra)


LITGPT_TODAY = "9999-12-31"
"""The date plain ``Runtime.model_code`` ``litgpt`` stands for: today's code."""
LITGPT_RMS_NORM = (("2023-10-24", "fp32_normed"),  # lit-gpt PR #606: x.float(), (weight * x_normed).to(dtype)
                   ("2024-02-23", "transformers"),  # PR #941: x_normed.to(dtype) before the weight, as transformers
                   ("2024-07-22", "fp32_normed"))  # PR #1545: (x_normed * weight.float()).to(dtype)
"""From which date litgpt's RMSNorm keeps what (``rms_norm_bytes``' styles); before the first, it computed in
the input's dtype (``input_dtype``)."""


def litgpt_code(shape: ModelShape, runtime: Runtime) -> str | None:
    """The date of the litgpt code that builds this LLaMA-family model (``Runtime.model_code`` ``litgpt`` or
    ``litgpt:YYYY-MM-DD``; plain ``litgpt`` is ``LITGPT_TODAY``), else None."""
    code = runtime.model_code
    if not code.startswith("litgpt") or shape.family != "llama":
        return None
    return code.partition(":")[2] or LITGPT_TODAY


def litgpt_rms_norm(date: str | None) -> str:
    """The RMSNorm style (``rms_norm_bytes``) of litgpt's code of ``date``; None (not litgpt): transformers'."""
    if date is None:
        return "transformers"
    style = "input_dtype"
    for since, kind in LITGPT_RMS_NORM:
        if date >= since:
            style = kind
    return style


def rotary_table_bytes(shape: ModelShape, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> tuple[int, ...]:
    """The per-layer rotary cos and sin tables an older transformers keeps as model buffers
    (``Runtime.rotary_tables``), each ``max_position_embeddings`` x head_dim in the model's dtype: two per layer;
    () where the runtime computes them per forward."""
    if not runtime.rotary_tables:
        return ()
    return (int(shape.max_positions * shape.head_dim * dt.param),) * (2 * shape.layers)


def runtime_refusal(shape: ModelShape, runtime: Runtime) -> str | None:
    """Why the runtime cannot describe this model (one line), or None: torchvision's code is its ViT, litgpt's
    is followed for the LLaMA family only (its GPT-NeoX, Phi or Falcon blocks are not), and rotary tables need
    a rotary model that states its ``max_position_embeddings``."""
    if runtime.rotary_tables and (shape.family != "llama" or not shape.max_positions):
        return (f"Runtime.rotary_tables: the {shape.family} family has no rotary embedding with a stated "
                f"max_position_embeddings")
    code = runtime.model_code
    if code == "torchvision" and shape.family != "vit":
        return f"Runtime.model_code torchvision builds ViT models only, not the {shape.family} family"
    if code.startswith("litgpt") and shape.family != "llama":
        return (f"Runtime.model_code {code}: litgpt's tensors are known for the LLaMA family only, not the "
                f"{shape.family} family")
    return None


def sdpa_flash_on_cuda(plan: Plan, dt: Dtypes, masked: bool) -> bool:
    """Whether SDPA runs CUDA's flash kernel: 16-bit compute, no mask, a card that has it (``Dtypes.flash_sdpa``:
    not V100 or T4, which run the memory-efficient kernel)."""
    return plan.attention == "sdpa" and dt.gpu and dt.compute == 2 and not masked and dt.flash_sdpa


def flash_padded_head_dim(shape: ModelShape, plan: Plan, dt: Dtypes, masked: bool,
                          runtime: Runtime = DEFAULT_RUNTIME) -> int:
    """The head width a flash kernel runs at: a head dimension that is not a multiple of 8 is padded with zeros
    to the next one where autograd sees it, so the padded query, key, value and output are what is saved, and the
    output is sliced back. SDPA does so before CUDA's flash kernel from torch 2.1 (PR #105602, FlashAttention-2:
    ``pad_last_dim<8>`` in the composite); the flash-attn package's ``FlashAttnFunc`` pads and saves the padded
    tensors too. Else the model's head dimension."""
    hd = shape.head_dim
    pads = plan.attention == "flash" or (sdpa_flash_on_cuda(plan, dt, masked)
                                         and version_tuple(runtime.torch_version) >= (2, 1))
    return hd + 8 - hd % 8 if pads and hd % 8 else hd


def window_masked(shape: ModelShape, plan: Plan) -> bool:
    """Whether SDPA gets a mask: the model's attention window is no longer than the sequence (transformers skips
    the mask only while the keys are fewer than the window, ``masking_utils._ignore_causal_mask_sdpa``). Flash
    attention takes the window as an argument, and eager attention adds its one mask to the scores it keeps."""
    return plan.attention == "sdpa" and shape.sliding_window is not None and plan.seq_len >= shape.sliding_window


def output_follows_query(plan: Plan, dt: Dtypes, masked: bool) -> bool:
    """Whether the attention kernel lays its output out as its query (``empty_like``): the CPU's SDPA kernel,
    CUDA's flash kernel (16-bit, no mask: ``flash_api.cpp`` ``at::empty_like(q_padded)``) and the flash-attn
    package. Phi-3's rotary embedding ends in a ``cat`` that leaves the query in (batch, heads, tokens) order, so
    there the output needs a copy to become (batch, tokens, hidden) again. CUDA's memory-efficient kernel (fp32,
    a mask, or a GPU without the flash kernel: ``Dtypes.flash_sdpa``, V100 and T4) allocates (batch, tokens,
    heads, dim) itself."""
    return plan.attention == "flash" or not dt.gpu or sdpa_flash_on_cuda(plan, dt, masked)


def stores_scores(shape: ModelShape, plan: Plan, dt: Dtypes) -> bool:
    """Whether attention keeps the a x s x s matrix: eager always; PyTorch's CPU SDPA with dropout
    (its fused CPU kernel has none, so it falls back to the math path)."""
    if plan.attention == "eager":
        return True
    return not dt.gpu and shape.attn_dropout > 0


def layer_bytes_per_token(shape: ModelShape, plan: Plan, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Bytes one transformer layer saves for backward, per token of the micro-batch.

    Tensor by tensor for the HF block of the model's family (verified against a real
    training step's live tensors on the CPU). Under autocast a matmul whose input is fp32
    (a norm's output) saves its own 16-bit copy of it.

    torchvision's ViT (``runtime.model_code``) differs in two tensors, from its source
    (torchvision/models/vision_transformer.py EncoderBlock; torch/nn/functional.py
    multi_head_attention_forward, need_weights=False, the training path): one packed in-projection
    ``linear(x, in_proj_weight)`` takes the norm's output, so autocast makes one 16-bit copy of it
    where HF's three query/key/value linears make three; and the attention output is made
    contiguous in (seq, batch) order for ``out_proj`` (``attn_output.permute(2, 0, 1, 3).contiguous()``),
    a copy that HF's ``context.permute(0, 2, 1, 3).contiguous()`` does not make (the fused
    kernels' output already has that layout), saved by ``out_proj`` next to the output the
    attention kernel saves.
    """
    h, p, c = shape.hidden, dt.param, dt.compute
    drop = 2 * h * dt.mask if shape.hidden_dropout > 0 else 0
    core = _attention_bytes(shape, plan, dt, runtime) + _ffn_bytes(shape, dt) + drop
    if shape.family == "gpt2":
        # A KV cache (kept off by checkpointing) concatenates copies of K and V for the
        # kernel, while Q's view keeps the fused QKV output alive too.
        cache = 2 * shape.kv_heads * shape.head_dim * c if shape.kv_cache and not plan.checkpointing else 0
        # ln_1 input, c_attn input, ln_2 input, c_fc input (+ LayerNorm stats)
        return core + cache + 2 * (h * p + LN_STATS_BYTES) + 2 * h * c
    if shape.family in ("bert", "vit", "opt"):
        qkv_in = 3 * h * c if dt.autocast else h * p
        if shape.family == "vit" and runtime.model_code == "torchvision" and not stores_scores(shape, plan, dt):
            qkv_in = (h * c if dt.autocast else h * p) + h * c  # one cast for the packed projection; out_proj's copy
        # Q/K/V input, two LayerNorm inputs (BERT: after each residual add; ViT: the residual
        # stream before attention and before the MLP), the intermediate dense's input
        return core + qkv_in + 2 * (h * p + LN_STATS_BYTES) + h * c
    # llama: RMSNorm in python keeps its fp32 input, rstd and the normalised tensor
    litgpt = litgpt_code(shape, runtime)
    norm = litgpt_rms_norm(litgpt)
    rms = rms_norm_bytes(shape, h, p, style=norm)
    # autocast casts the norm's output once per projection (litgpt: one fused Q/K/V linear)
    projections = 1 if shape.fused or litgpt else 3
    qkv_in = projections * h * c if dt.autocast else h * p
    mlp_in = (1 if shape.fused else 2) * h * c if dt.autocast else h * p
    qk = 0
    if shape.qk_norm:  # Qwen3: an RMSNorm over each head of q and of k, whose input is the projection's output
        qk = (rms_norm_bytes(shape, shape.heads * shape.head_dim, c, shape.heads, norm)
              + rms_norm_bytes(shape, shape.kv_heads * shape.head_dim, c, shape.kv_heads, norm))
    if shape.sandwich_norms:  # Gemma 2's norms of the attention's and the MLP's outputs (the compute dtype)
        rms += rms_norm_bytes(shape, h, c, style=norm)
    return core + 2 * rms + qkv_in + mlp_in + qk


def rms_norm_bytes(shape: ModelShape, width: int, elem: int, rows: int = 1, style: str = "transformers") -> float:
    """Per token, what a python RMSNorm over ``width`` elements (``rows`` normalised groups: heads) keeps for
    backward when its input has ``elem``-byte elements. ``transformers``: the fp32 input, one fp32 rstd per group,
    and the normalised tensor the weight multiplies, cast back to the input's dtype (LLaMA) or kept in fp32
    (Gemma, ``shape.norm_fp32``); ``fp32_normed``: that tensor kept in fp32 (litgpt's
    ``(x_normed * weight.float()).to(dtype)``); ``input_dtype``: no upcast at all, the input, rstd and normalised
    tensor in the input's dtype (lit-gpt before its PR #606)."""
    if style == "input_dtype":
        return elem * (2 * width + rows)
    normed = 4 if shape.norm_fp32 or style == "fp32_normed" else elem
    return 4 * width + 4 * rows + width * normed


def embedding_bytes_per_token(shape: ModelShape, dt: Dtypes) -> float:
    """Per token, the part of ``outside_bytes_per_token`` the embeddings saved, kept to the end of the backward
    (their backward comes last): the input ids, OPT's position ids (per sample, a cumsum of the attention mask:
    the embedding saves them, offset), the embedding dropout's mask and BERT's embedding LayerNorm (token types,
    its input and statistics). The rest (the final norm, the head's input, the loss's tensors) is freed as the
    head's backward ends."""
    h = shape.hidden
    drop = h * dt.mask if shape.embd_dropout > 0 else 0
    if shape.family == "vit":
        return drop
    if shape.family == "bert":
        return ID_BYTES + ID_BYTES + h * dt.param + LN_STATS_BYTES + drop
    if shape.family in ("gpt2", "opt"):
        return ID_BYTES + (ID_BYTES if shape.family == "opt" else 0) + drop
    return ID_BYTES


def outside_bytes_per_token(shape: ModelShape, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Per token, what is saved outside the layers: the embeddings' (``embedding_bytes_per_token``), then the
    labels, final norm, head input and log-probs."""
    h, p, c = shape.hidden, dt.param, dt.compute
    emb = embedding_bytes_per_token(shape, dt)
    if shape.family == "vit":
        # the final LayerNorm's input; the classifier's CLS view keeps the whole normalised output alive unless
        # autocast copied the CLS rows (see outside_bytes_per_sample)
        return emb + h * p + LN_STATS_BYTES + (0 if dt.autocast else h * p)
    causal = shape.task == "causal-lm"
    labels = ID_BYTES * 2 if causal else 0  # the labels and their shifted copy for the loss
    logprobs = 4 * shape.vocab if causal else 0  # transformers upcasts the logits; log_softmax keeps fp32
    if shape.family in ("gpt2", "opt"):
        return emb + labels + h * p + LN_STATS_BYTES + h * c + logprobs
    if shape.family == "bert":
        if causal:  # transform dense, GELU, LayerNorm, decoder inputs (CUDA autocast: LayerNorm in fp32)
            head = 3 * h * c + 4 * h + LN_STATS_BYTES if dt.autocast and dt.gpu else 4 * h * c + LN_STATS_BYTES
        else:  # the pooler's first-token view keeps the whole last hidden state, unless autocast copied it
            head = 0 if dt.autocast else h * p
        return emb + labels + head + logprobs
    softcap = shape.vocab * c if causal and shape.final_softcap else 0  # the logits' tanh output, kept for backward
    final_norm = rms_norm_bytes(shape, h, p, style=litgpt_rms_norm(litgpt_code(shape, runtime)))
    return emb + labels + final_norm + h * c + logprobs + softcap


def input_bytes_per_sample(shape: ModelShape, dt: Dtypes) -> float:
    """Per sample, what the patch convolution saves and keeps to the end of the backward: its
    input pixels in the compute dtype (the batch's own fp32 tensor in fp32, else a 16-bit copy).
    0 for a text model."""
    return 0.0 if shape.image is None else prod(shape.image) * dt.compute


def outside_bytes_per_sample(shape: ModelShape, dt: Dtypes) -> float:
    """Per sample, what an image model holds outside the layers in the forward: the patch
    convolution's input, the batch's fp32 pixels when that is a copy of them, the label, and under
    autocast the classifier's 16-bit copy of the CLS token. 0 for a text model."""
    if shape.image is None:
        return 0.0
    batch = 4 * prod(shape.image) if dt.compute != 4 else 0
    return input_bytes_per_sample(shape, dt) + batch + ID_BYTES + (shape.hidden * dt.compute if dt.autocast else 0)


# Net transient of one layer's backward: gradients alive while that layer's saved tensors
# are not yet freed, per token, as (x ffn in the compute dtype, x hidden in the residual
# gradient's dtype: the weights' dtype, fp32 inside LLaMA's RMSNorm). Fitted on real
# training steps on the CPU (torch 2.13, transformers 5.23; see tests/unit/test_estimate_analytic.py).
LAYER_BACKWARD_TEMP = {("gpt2", "gelu_new"): (2.25, 0.5), "gpt2": (0.8, 2.3), "bert": (0.4, 4.4), "llama": (0.55, 5.3),
                       "vit": (1.0, 1.0), "opt": (2.0, 1.0)}
# With eager attention, in (a x s per token) in the compute dtype: GPT-2's peak inside a
# layer's backward comes after part of its score matrix is freed.
EAGER_BACKWARD_TEMP = {"gpt2": -1.0}


def layer_backward_temp_per_token(shape: ModelShape, plan: Plan, dt: Dtypes) -> float:
    """Bytes per token one layer's backward holds beyond its saved tensors."""
    ffn, hid = LAYER_BACKWARD_TEMP.get((shape.family, shape.activation)) or LAYER_BACKWARD_TEMP[shape.family]
    grad = 4 if shape.family == "llama" else dt.param
    temp = ffn * shape.ffn * dt.compute + hid * shape.hidden * grad
    if shape.family == "vit" and dt.autocast:
        temp += shape.hidden * dt.compute  # the residual's fp32 gradient cast to 16-bit for the MLP's matmul
    if stores_scores(shape, plan, dt):
        temp += EAGER_BACKWARD_TEMP.get(shape.family, 0.0) * shape.heads * sequence_length(shape, plan) * dt.compute
    return temp


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's forward and backward on one rank."""

    layer_bytes: float
    """one layer's saved tensors"""
    kept_layer_bytes: float
    """what one layer keeps until its backward: layer_bytes, or its input under checkpointing"""
    outside_bytes: float
    """saved outside the layers (embeddings, final norm, head input, log-probs, ids)"""
    input_bytes: float
    """the part of outside_bytes kept through the whole backward: an image model's pixels, the embeddings' saved
    ids, masks and norm input (``embedding_bytes_per_token``), a text model's position ids"""
    layer_cast_bytes: float
    """autocast's 16-bit copies of one layer's matmul weights"""
    head_cast_bytes: float
    loss_forward_temp_bytes: float
    """the logits and their fp32 copy while the loss is computed"""
    loss_backward_temp_bytes: float
    """what the loss's backward holds beyond the log-probs: their gradient and the logits' (in the log-probs'
    dtype); over chunks (``loss_chunk_bytes``), the larger of the chunks' gradients with their concatenation less
    the freed log-probs, and one chunk's two gradients"""
    head_backward_temp_bytes: float
    """the logits' gradient in the compute dtype and the head weight's 16-bit gradient"""
    layer_backward_temp_bytes: float
    """gradients flowing through one layer's backward (and its recompute under checkpointing)"""
    loss_forward_order: tuple = ()
    """a causal LM's ``loss_forward_temp_bytes`` tensor by tensor in the order the loss makes and frees them
    (``causal_loss_forward``), before the log-probs it saves; () for other tasks"""
    kept_output: str | None = None
    """the tensor of ``loss_forward_order`` the training loop keeps (``Runtime.output_kept``), by name: alive after
    the loss, through the backward and the optimizer step, into the next micro-batch's loss forward as
    ``PREVIOUS_OUTPUT``; None: dropped with the loss's other tensors"""
    kept_output_bytes: float = 0.0
    """its bytes (0 when none is kept)"""
    loss_chunk_bytes: float = 0.0
    """one chunk's log-probs when the loss runs over chunks of rows (``Runtime.loss_chunk_rows``): the
    backward frees the log-probs and makes the chunks' gradients chunk by chunk, then their concatenation;
    0: one cross-entropy"""


PREVIOUS_OUTPUT = "previous output"
"""The name ``loss_forward_order`` frees the previous micro-batch's kept output under (``Activations.kept_output``)."""


def causal_loss_forward(logits: float, c: int, upcast: bool, shifted_copy: str | None,
                        upcast_in_model: bool, output_kept: str | None = None) -> tuple:
    """A causal LM's loss forward up to the log-probs it saves, tensor by tensor: ``(name, bytes)`` makes one,
    ``(name, None)`` frees it; what is alive at the end is freed once the loss is computed. The head's logits in
    the compute dtype ``c``; their fp32 upcast; where the loss makes one, the shifted contiguous copy
    (``Runtime.shifted_logits_copy``): of the fp32 logits after the upcast, or of the 16-bit ones before it, when
    autocast's cross-entropy casts the copy (then the upcast is of the shifted copy, one token fewer: counted as
    the whole). The 16-bit logits are unreferenced after the upcast only where the model's forward rebinds them
    (``logits = logits.float()``, ``Runtime.logits_upcast_in_model``); an upcast in the loss leaves them alive in
    the model's output. Where the loop keeps the model's output (``Runtime.output_kept``), the previous
    micro-batch's (``PREVIOUS_OUTPUT``, alive as the recipe starts) is freed as soon as the model has returned
    the new logits (``"logits"``: after its own upcast, where it makes one), or with the rest once the loss is
    computed (``"model_output"``: no step of its own). ``logits``: tokens x vocabulary."""
    order: list = [("logits", c * logits)]
    if shifted_copy == "before_upcast":
        order.append(("shifted logits", c * logits))
    if upcast and c != 4:
        order.append(("fp32 logits", 4.0 * logits))
        if upcast_in_model:
            order.append(("logits", None))
    if output_kept == "logits":  # the loop's variable rebinds once the model's forward has returned
        returned = order.index(("logits", None)) + 1 if ("logits", None) in order else 1
        order.insert(returned, (PREVIOUS_OUTPUT, None))
    if shifted_copy == "after_upcast":
        order.append(("shifted logits", (4 if upcast else c) * logits))
    return tuple(order)


def model_output(c: int, upcast: bool, upcast_in_model: bool) -> str:
    """The name, in ``causal_loss_forward``'s recipe, of the logits the model returns: the fp32 ones where its
    forward upcasts them, else the compute dtype's."""
    return "fp32 logits" if upcast and c != 4 and upcast_in_model else "logits"


def loss_forward_temp(order, logprobs: float, kept_output: float = 0.0) -> float:
    """The loss's forward transients as one figure beside the log-probs (which the phases count among the
    saved tensors): the larger of what is alive at once before the log-probs are made, less them, and what is
    alive beside them. ``kept_output``: the previous micro-batch's output the loop still holds as the loss starts
    (``Activations.kept_output``), freed where the recipe says."""
    alive, peak = recipe_sizes(order, {PREVIOUS_OUTPUT: kept_output}
                               if kept_output or (PREVIOUS_OUTPUT, None) in order else None)
    return max(peak - logprobs, sum(alive.values()))


def activations(shape: ModelShape, plan: Plan, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> Activations:
    """Activation bytes of one micro-batch (plan.micro_batch x sequence_length tokens) on one rank."""
    seq = sequence_length(shape, plan)
    tokens = plan.micro_batch * seq
    h, c = shape.hidden, dt.compute
    layer = tokens * layer_bytes_per_token(shape, plan, dt, runtime)
    kept = tokens * h * dt.param if plan.checkpointing else layer
    layer_cast = 2.0 * shape.layer_linear_params if dt.autocast else 0.0
    head_cast = 2.0 * shape.head_linear_params if dt.autocast else 0.0
    causal = shape.task == "causal-lm"
    logits = tokens * shape.vocab if causal else 0
    upcast = runtime.logits_fp32 or c == 4
    # transformers' loss upcasts the logits (an fp32 copy; log_softmax keeps fp32 log-probs and the
    # backward makes two fp32 gradients); a loss on 16-bit logits keeps them all in the compute dtype
    kept_name = model_output(c, upcast, runtime.logits_upcast_in_model) if causal and runtime.output_kept else None
    loss_order = causal_loss_forward(logits, c, upcast, runtime.shifted_logits_copy,
                                     runtime.logits_upcast_in_model, runtime.output_kept if kept_name else None) \
        if causal else ()
    kept_bytes = (4.0 if kept_name == "fp32 logits" else c) * logits if kept_name else 0.0
    loss_fwd = loss_forward_temp(loss_order, (4 if upcast else c) * logits, kept_bytes) if causal else logits * c
    if shape.image is not None and dt.autocast:
        loss_fwd += tokens * h * dt.param  # the final LayerNorm's output, alive in the forward until it returns
    rows = plan.micro_batch * seq
    chunked = causal and 0 < runtime.loss_chunk_rows < rows
    elem = 4.0 if upcast else c
    chunk = elem * runtime.loss_chunk_rows * shape.vocab if chunked else 0.0
    # one cross-entropy: the log-probs' gradient and the logits' (the log-probs are counted outside). Over chunks:
    # a chunk's two gradients beside the log-probs not yet freed; at the end the chunks' gradients and their
    # concatenation, the log-probs gone
    loss_bwd = max(elem * logits, 2 * chunk) if chunked else 2 * elem * logits
    head_weight = shape.vocab * h if causal else 0
    head_bwd = logits * c + (head_weight * c if dt.autocast else 0)
    layer_bwd = tokens * layer_backward_temp_per_token(shape, plan, dt) + (c * shape.ffn * h if dt.autocast else 0)
    if plan.checkpointing:
        layer_bwd += layer + layer_cast  # the layer is recomputed (and its weights re-cast) first
        if shape.family in ("vit", "opt"):
            layer_bwd -= kept  # a pre-LN layer saves its input, which is the tensor checkpointing kept
    outside = (tokens * outside_bytes_per_token(shape, dt, runtime)
               + plan.micro_batch * outside_bytes_per_sample(shape, dt))
    if not upcast:
        outside -= logits * (4 - c)  # the log-probs kept in the compute dtype
    positions = ID_BYTES * seq if shape.image is None else 0  # position ids, kept with the embeddings' tensors
    outside += positions
    return Activations(layer_bytes=layer, kept_layer_bytes=kept, outside_bytes=outside,
                       input_bytes=(plan.micro_batch * input_bytes_per_sample(shape, dt)
                                    + tokens * embedding_bytes_per_token(shape, dt) + positions),
                       layer_cast_bytes=layer_cast, head_cast_bytes=head_cast,
                       loss_forward_temp_bytes=loss_fwd, loss_forward_order=loss_order,
                       kept_output=kept_name, kept_output_bytes=kept_bytes, loss_chunk_bytes=chunk,
                       loss_backward_temp_bytes=loss_bwd,
                       head_backward_temp_bytes=head_bwd, layer_backward_temp_bytes=layer_bwd)
