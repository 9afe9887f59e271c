"""Analytic estimate: a training step's memory from the model's shape, by arithmetic alone.

Three layers, as in accelerate's estimator: the arithmetic here (pure functions of a
``ModelShape``, a ``Plan`` and a ``Partition``, all in bytes), data gathering in the
caller (``ModelShape.from_config``), formatting in the CLI.

What a rank holds (bytes, per GPU):

model states   params, grads, optimizer states, as the runtime (toolkit/train.py) makes them.
               torchrun: torch autocast keeps fp32 weights and grads under fp16/bf16-mixed
               (the weights are the master copy: 4 + 4 + 8 = 16 B/param with AdamW) and
               bf16-true keeps everything in bf16 (AdamW states too: 2 + 2 + 4 B/param).
               DeepSpeed: 16-bit weights and grads plus an fp32 master copy and the
               states (2 + 2 + 12 = 16 B/param with AdamW), sharded by ZeRO stage:
               1: 4Ψ + 12Ψ/N, 2: 2Ψ + 14Ψ/N, 3: 16Ψ/N (+ the largest layer gathered).
               Optimizer states on top of any master copy: AdamW 2 states; 8-bit AdamW
               1 byte per state + an fp32 absmax per 256-block (32-bit states for tensors
               under 4096 elements, as bitsandbytes does); Adafactor (no momentum) a row
               and a column vector per matrix, a full vector per 1-D tensor; SGD one
               momentum buffer.
activations    what autograd saves in the forward, per transformer layer, tensor by tensor
               for the HF block of the model's family (see ``layer_bytes_per_token``).
               It reduces to Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) bytes for the
               Megatron GPT layer in 16-bit (``korthikanti_layer_bytes``). Eager attention
               stores the a·s² matrix; SDPA and flash do not. Full checkpointing keeps each
               layer's input (s·b·h in the residual's dtype) and recomputes one layer at a
               time in the backward. Outside the layers: embeddings, final norm, the head's
               input, and for a causal LM the fp32 log-probabilities of the loss (4·b·s·V;
               transformers upcasts the logits), plus the input ids and labels.
               An image classifier (ViT, task image-cls) is a pre-LayerNorm encoder on
               s = (image_size / patch_size)^2 + 1 tokens fixed by its config (the plan's
               seq_len does not apply): its layers follow BERT's inventory, and outside
               them it keeps the input pixels (and the patch convolution's 16-bit copy of
               them), the final LayerNorm's input and the classifier's CLS input. Dropout
               keeps a mask: a byte per element on CUDA, a tensor of the input's dtype on
               the CPU. A decoder's classifier builds a KV cache (transformers' use_cache).
               CUDA's autocast runs a few more ops in fp32 than the CPU's (pow in
               gelu_new, LayerNorm and softmax on 16-bit inputs): the formulas follow the
               partition's kind. The CPU side is checked against real steps; the CUDA
               side is by reading the kernels' autocast lists.
temporaries    short-lived tensors at the peak: the loss's gradients (2 x 4·b·s·V at the
               start of the backward), one layer's backward, the optimizer's step copies
               (torch's foreach AdamW on a GPU copies exp_avg_sq whole; on a CPU one
               tensor at a time), autocast's 16-bit weight copies, ZeRO/DDP buckets.

Phases, the peak being the largest (model states are not all live at once):
  forward end     params + optimizer + (grads, when accumulating) + activations + logits
  backward start  the above + the loss's gradients (grads not yet allocated with accum 1)
  backward        activations freed layer by layer as gradients are allocated (the two ends
                  of that straight line, plus one layer's transient and its recompute)
  backward end    params + optimizer + all grads + the embedding's dense gradient
  optimizer step  params + grads + optimizer + the step's transient copies

``components`` are what is live at the peak phase, so they add up to the peak.
Device memory as nvidia-smi shows it: CUDA context + peak allocated x (1 + allocator
overhead). Fits: that is at most capacity minus a safety margin, and the host memory
(offload, and the model each rank builds on the host first) within the job's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

from ..modelshape import ModelShape
from ..plan import Plan
from ..sites import Partition
from ..strategies import Dtypes, ModelStates
from ..strategies.deepspeed import OFFLOAD_BUFFER_FACTOR
from . import COMPONENTS, Estimate
from .device import plan_device_memory
from .gpu import CUDA_CONTEXT_EAGER_MIB, DEFAULT_RUNTIME, Runtime, lazy_loading

MIB = 1024 * 1024

SAFETY_MARGIN_FRAC = 0.03
"""Kept free when deciding "fits": a card's usable memory is ~1.5 % under its nominal size
(ECC, driver), and NCCL/cuDNN allocate outside the caching allocator."""
SAFETY_MARGIN_MIN_MIB = 256.0
LN_STATS_BYTES = 8
"""LayerNorm saves fp32 mean and rstd per token."""
ID_BYTES = 8


# -- model states ----------------------------------------------------------------------------


def dtypes_for(plan: Plan, gpu: bool) -> Dtypes:
    """How the plan's engine stores things on a GPU (or CPU) rank (toolkit/strategies/)."""
    return plan.strategy.dtypes(plan, gpu)


def model_states(shape: ModelShape, plan: Plan, dt: Dtypes) -> ModelStates:
    """Params, grads and optimizer per rank, as the plan's engine holds them (toolkit/strategies/)."""
    return plan.strategy.model_states(shape, plan, dt)


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


def _attention_bytes(shape: ModelShape, plan: Plan, dt: Dtypes) -> float:
    """Per token: the attention kernel's saved Q, K, V and output, and the score matrix when stored."""
    c, a, s = dt.compute, shape.heads, sequence_length(shape, plan)
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if not stores_scores(shape, plan, dt):
        return (2 * q_dim + 2 * kv_dim) * c + 4 * a  # q, k, v, out; fp32 log-sum-exp per head
    # Eager: K and V repeated to every head (GQA), softmax output, its 16-bit copy or dropout.
    causal = shape.family not in ("bert", "vit")
    # The causal mask is in the weights' dtype (fp32 under autocast) and CUDA's autocast
    # runs softmax in fp32: then softmax's output is fp32 and a 16-bit copy feeds the matmul.
    # LLaMA's and ViT's eager attention ask softmax for fp32 outright.
    soft = 4 if shape.family in ("llama", "vit") or (dt.autocast and (causal or dt.gpu)) else c
    if shape.attn_dropout > 0:
        extra = dt.mask + c
    else:
        extra = c if soft != c else 0
    return 4 * q_dim * c + a * s * (soft + extra)


def stores_scores(shape: ModelShape, plan: Plan, dt: Dtypes) -> bool:
    """Whether attention keeps the a x s x s matrix: eager always; PyTorch's CPU SDPA with dropout
    (its fused CPU kernel has none, so it falls back to the math path)."""
    if plan.attention == "eager":
        return True
    return not dt.gpu and shape.attn_dropout > 0


def layer_bytes_per_token(shape: ModelShape, plan: Plan, dt: Dtypes) -> float:
    """Bytes one transformer layer saves for backward, per token of the micro-batch.

    Tensor by tensor for the HF block of the model's family (verified against a real
    training step's live tensors on the CPU). Under autocast a matmul whose input is fp32
    (a norm's output) saves its own 16-bit copy of it.
    """
    h, p, c = shape.hidden, dt.param, dt.compute
    drop = 2 * h * dt.mask if shape.hidden_dropout > 0 else 0
    core = _attention_bytes(shape, plan, dt) + _ffn_bytes(shape, dt) + drop
    if shape.family == "gpt2":
        # A KV cache (kept off by checkpointing) concatenates copies of K and V for the
        # kernel, while Q's view keeps the fused QKV output alive too.
        cache = 2 * shape.kv_heads * shape.head_dim * c if shape.kv_cache and not plan.checkpointing else 0
        # ln_1 input, c_attn input, ln_2 input, c_fc input (+ LayerNorm stats)
        return core + cache + 2 * (h * p + LN_STATS_BYTES) + 2 * h * c
    if shape.family in ("bert", "vit"):
        qkv_in = 3 * h * c if dt.autocast else h * p
        # Q/K/V input, two LayerNorm inputs (BERT: after each residual add; ViT: the residual
        # stream before attention and before the MLP), the intermediate dense's input
        return core + qkv_in + 2 * (h * p + LN_STATS_BYTES) + h * c
    # llama: RMSNorm in python keeps its fp32 input, rstd and the normalised tensor
    rms = 4 * h + 4 + h * p
    qkv_in = 3 * h * c if dt.autocast else h * p
    mlp_in = 2 * h * c if dt.autocast else h * p
    return core + 2 * rms + qkv_in + mlp_in


def outside_bytes_per_token(shape: ModelShape, dt: Dtypes) -> float:
    """Per token, what is saved outside the layers: ids, embeddings, final norm, head input, log-probs."""
    h, p, c = shape.hidden, dt.param, dt.compute
    if shape.family == "vit":
        # embedding dropout, the final LayerNorm's input; the classifier's CLS view keeps the whole
        # normalised output alive unless autocast copied the CLS rows (see outside_bytes_per_sample)
        emb = h * dt.mask if shape.embd_dropout > 0 else 0
        return emb + h * p + LN_STATS_BYTES + (0 if dt.autocast else h * p)
    causal = shape.task == "causal-lm"
    ids = ID_BYTES * (3 if causal else 1)  # input ids; labels and their shifted copy for the loss
    logprobs = 4 * shape.vocab if causal else 0  # transformers upcasts the logits; log_softmax keeps fp32
    if shape.family == "gpt2":
        emb = h * dt.mask if shape.embd_dropout > 0 else 0
        return ids + emb + h * p + LN_STATS_BYTES + h * c + logprobs
    if shape.family == "bert":
        emb = ID_BYTES + h * p + LN_STATS_BYTES + (h * dt.mask if shape.embd_dropout > 0 else 0)  # token types, LN
        if causal:  # transform dense, GELU, LayerNorm, decoder inputs (CUDA autocast: LayerNorm in fp32)
            head = 3 * h * c + 4 * h + LN_STATS_BYTES if dt.autocast and dt.gpu else 4 * h * c + LN_STATS_BYTES
        else:  # the pooler's first-token view keeps the whole last hidden state, unless autocast copied it
            head = 0 if dt.autocast else h * p
        return ids + emb + head + logprobs
    return ids + (4 * h + 4 + h * p) + h * c + logprobs


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
                       "vit": (1.0, 1.0)}
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
    """the part of outside_bytes kept through the whole backward: an image model's pixels (0 for text)"""
    layer_cast_bytes: float
    """autocast's 16-bit copies of one layer's matmul weights"""
    head_cast_bytes: float
    loss_forward_temp_bytes: float
    """the logits and their fp32 copy while the loss is computed"""
    loss_backward_temp_bytes: float
    """the gradients of the log-probs and of the logits (fp32) at the start of the backward"""
    head_backward_temp_bytes: float
    """the logits' gradient in the compute dtype and the head weight's 16-bit gradient"""
    layer_backward_temp_bytes: float
    """gradients flowing through one layer's backward (and its recompute under checkpointing)"""


def activations(shape: ModelShape, plan: Plan, dt: Dtypes, runtime: Runtime = DEFAULT_RUNTIME) -> Activations:
    """Activation bytes of one micro-batch (plan.micro_batch x sequence_length tokens) on one rank."""
    seq = sequence_length(shape, plan)
    tokens = plan.micro_batch * seq
    h, c = shape.hidden, dt.compute
    layer = tokens * layer_bytes_per_token(shape, plan, dt)
    kept = tokens * h * dt.param if plan.checkpointing else layer
    layer_cast = 2.0 * shape.layer_linear_params if dt.autocast else 0.0
    head_cast = 2.0 * shape.head_linear_params if dt.autocast else 0.0
    causal = shape.task == "causal-lm"
    logits = tokens * shape.vocab if causal else 0
    upcast = runtime.logits_fp32 or c == 4
    # transformers' loss upcasts the logits (an fp32 copy; log_softmax keeps fp32 log-probs and the
    # backward makes two fp32 gradients); a loss on 16-bit logits keeps them all in the compute dtype
    loss_fwd = logits * (c + (4 if c != 4 else 0)) if upcast else logits * c
    if shape.image is not None and dt.autocast:
        loss_fwd += tokens * h * dt.param  # the final LayerNorm's output, alive in the forward until it returns
    loss_bwd = 8.0 * logits if upcast else 2.0 * c * logits
    head_weight = shape.vocab * h if causal else 0
    head_bwd = logits * c + (head_weight * c if dt.autocast else 0)
    layer_bwd = tokens * layer_backward_temp_per_token(shape, plan, dt) + (c * shape.ffn * h if dt.autocast else 0)
    if plan.checkpointing:
        layer_bwd += layer + layer_cast  # the layer is recomputed (and its weights re-cast) first
        if shape.family == "vit":
            layer_bwd -= kept  # a pre-LN layer saves its input, which is the tensor checkpointing kept
    outside = tokens * outside_bytes_per_token(shape, dt) + plan.micro_batch * outside_bytes_per_sample(shape, dt)
    if not upcast:
        outside -= logits * (4 - c)  # the log-probs kept in the compute dtype
    if shape.image is None:
        outside += ID_BYTES * seq  # position ids
    return Activations(layer_bytes=layer, kept_layer_bytes=kept, outside_bytes=outside,
                       input_bytes=plan.micro_batch * input_bytes_per_sample(shape, dt),
                       layer_cast_bytes=layer_cast, head_cast_bytes=head_cast,
                       loss_forward_temp_bytes=loss_fwd, loss_backward_temp_bytes=loss_bwd,
                       head_backward_temp_bytes=head_bwd, layer_backward_temp_bytes=layer_bwd)


# -- phases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """What is live at one moment of the step (bytes per rank, by component)."""

    name: str
    params: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries


def phases(shape: ModelShape, plan: Plan, dt: Dtypes, states: ModelStates, acts: Activations) -> tuple[Phase, ...]:
    """The moments of a steady-state step (optimizer states exist) where the peak can be."""
    L, ckpt, causal = shape.layers, plan.checkpointing, shape.task == "causal-lm"
    params, opt, buf, grads = states.params_bytes, states.optimizer_bytes, states.buffer_bytes, states.grads_bytes
    fwd_params = params + states.gathered_bytes
    # Grads present from the start of the backward (DeepSpeed's buffers, a previous
    # micro-batch's); the rest is allocated during it: the head's first, then layer by layer.
    live = grads if states.persistent_grads or plan.grad_accum > 1 else 0.0
    head_g = (grads - live) * shape.head_linear_params / shape.n_params
    layer_g = (grads - live) * shape.layer_params / shape.n_params
    kept = L * acts.kept_layer_bytes
    pixels = acts.input_bytes  # an image model's input, saved by its first op: kept to the end of the backward
    layer_casts = 0.0 if ckpt else L * acts.layer_cast_bytes  # recomputed layers re-cast their weights
    # Adding a new gradient to an existing one (the tied LM head's, or a previous
    # micro-batch's) holds the new one and the sum at once: two vocab x hidden transients.
    vocab_grad = 2.0 * dt.grad * shape.vocab * shape.hidden
    emb_temp = vocab_grad if live or (causal and shape.tied) else 0.0
    head_temp = acts.head_backward_temp_bytes + (vocab_grad if live and causal else 0.0)
    return (
        # autocast's cache holds every 16-bit weight copy until the forward returns
        Phase("forward end", fwd_params, live, opt, kept + acts.outside_bytes,
              buf + L * acts.layer_cast_bytes + acts.head_cast_bytes + acts.loss_forward_temp_bytes),
        Phase("backward start", fwd_params, live, opt, kept + acts.outside_bytes,
              buf + layer_casts + acts.head_cast_bytes + acts.loss_backward_temp_bytes),
        Phase("head backward", fwd_params, live + head_g, opt, kept + pixels, buf + layer_casts + head_temp),
        Phase("backward, last layer", fwd_params, live + head_g, opt, kept + pixels,
              buf + layer_casts + acts.layer_backward_temp_bytes),
        Phase("backward, first layer", fwd_params, live + head_g + (L - 1) * layer_g, opt,
              acts.kept_layer_bytes + pixels,
              buf + (0.0 if ckpt else acts.layer_cast_bytes) + acts.layer_backward_temp_bytes),
        Phase("backward end", fwd_params, grads, opt, 0.0, buf + emb_temp),
        Phase("optimizer step", params, grads, opt, 0.0, buf + states.step_temp_bytes),
    )


# -- the estimate ------------------------------------------------------------------------------------


def estimate_analytic(shape: ModelShape, plan: Plan, partition: Partition, *,
                      allocator_overhead_frac: float | None = None,
                      cuda_context_mib: float | None = None, runtime: Runtime | None = None,
                      allocator_model: bool = True) -> Estimate:
    """A training step's memory per rank for ``plan`` on ``partition``, from ``shape`` alone (MiB).

    ``components`` are what is live at the peak phase (they add up to ``peak_allocated_mib``;
    with the CUDA context and ``allocator_overhead`` = peak reserved - peak allocated, to
    ``device_used_mib`` less ``gpu_extras_mib``). On a GPU the step's alloc/free stream
    (``stream.step_events``, steps 1 and 2) is replayed through the caching-allocator model
    (``allocator.py``) under the plan's ``alloc_conf`` and the memory the allocator may take
    (capacity - safety margin - context - memory outside the allocator): that gives the
    reserved peak, the fragmentation, the fit, and when only fragmentation fails the setting
    that fixes it. ``allocator_overhead_frac`` (a partition's measured reserved/allocated - 1,
    from calibration) raises the reserved peak where it says more than the replay.
    ``cuda_context_mib`` (default: the partition's) replaces the profile's value. ``runtime``
    describes software other than hpcmem's own (``gpu.Runtime``). ``allocator_model=False``
    skips the replay (reserved = allocated: a lower bound, for quick screening of many plans).
    On a CPU partition the "device" is the host: capacity is the job's memory per rank and
    there is no CUDA context and no caching allocator.
    """
    runtime = runtime or DEFAULT_RUNTIME
    gpu = partition.has_gpu
    dt = dtypes_for(plan, gpu)
    states = model_states(shape, plan, dt)
    if gpu and not runtime.frees_grads and not states.persistent_grads:
        states = replace(states, persistent_grads=True)  # torch 1.x: zero_grad kept them allocated
    acts = activations(shape, plan, dt, runtime)
    peak = max(phases(shape, plan, dt, states, acts), key=lambda ph: ph.total)
    context = (partition.cuda_context_mib if cuda_context_mib is None else cuda_context_mib) if gpu else 0.0
    if gpu and cuda_context_mib is None and not getattr(partition, "calibrated", False) \
            and not lazy_loading(runtime.torch_version):
        context = max(context, CUDA_CONTEXT_EAGER_MIB)  # every kernel loaded at start-up (no lazy loading)
    peak_mib = peak.total / MIB
    capacity = capacity_mib(partition, plan)
    margin = safety_margin_mib(capacity)
    dm = None
    if gpu and allocator_model:
        dm = plan_device_memory(shape, plan, dt, states, acts, gpu_model=partition.gpu_model,
                                capacity_mib=capacity - margin - context, runtime=runtime)
        reserved = max(dm.peak_reserved_mib, peak_mib)
        extras = dict(dm.extras_mib)
    else:
        reserved, extras = peak_mib, {}
    if gpu and allocator_overhead_frac is not None:
        reserved = max(reserved, peak_mib * (1 + allocator_overhead_frac))
    components = {"params": peak.params / MIB, "grads": peak.grads / MIB, "optimizer": peak.optimizer / MIB,
                  "activations": peak.activations / MIB, "temporaries": peak.temporaries / MIB,
                  "cuda_context": context, "allocator_overhead": reserved - peak_mib}
    assert tuple(components) == COMPONENTS
    device_used = context + reserved + sum(extras.values())
    ranks = plan.gpus_per_node
    host = states.host_bytes_per_rank * ranks / MIB
    fits_device = device_used <= capacity - margin and (dm is None or dm.fits)
    # On a CPU partition the ranks' own memory comes out of the same host memory; on a GPU
    # partition the ranks first build the model on the host (before the offload buffers exist).
    host_needed = max(host, startup_host_bytes_per_rank(shape, plan) * ranks / MIB) if gpu else host + device_used * ranks
    fits_host = host_needed <= job_host_mib(partition, plan)
    notes = _notes(shape, plan, partition, peak, host_needed, fits_host, cuda_context_mib, allocator_overhead_frac,
                   dm, runtime, allocator_model)
    fix = dm.fix if dm is not None and dm.fragmentation_only else None
    return Estimate(method="analytic", components=components, peak_allocated_mib=peak_mib,
                    device_used_mib=device_used, host_mib_per_node=host, capacity_mib=capacity,
                    headroom_mib=capacity - device_used, fits=fits_device and fits_host, notes=notes,
                    peak_reserved_mib=reserved, fragmentation=dm.fragmentation if dm else 0.0,
                    segments=dm.segments if dm else 0, gpu_extras_mib=extras,
                    fits_allocated=(dm.fits_allocated if dm else None),
                    fragmentation_only=bool(dm and dm.fragmentation_only), alloc_conf_fix=fix,
                    fix_device_used_mib=(context + dm.fix_peak_reserved_mib + sum(extras.values())
                                         if fix and dm.fix_peak_reserved_mib is not None else None),
                    oom=oom_figures(dm.oom) if dm is not None and dm.oom is not None else None)


def oom_figures(oom) -> dict:
    """PyTorch's OOM figures in MiB, from the replay's ``OutOfMemory``."""
    return {"request_mib": oom.request / MIB, "allocated_mib": oom.allocated / MIB,
            "reserved_mib": oom.reserved / MIB, "free_mib": oom.free / MIB}


def startup_host_bytes_per_rank(shape: ModelShape, plan: Plan) -> float:
    """Host bytes a GPU rank holds while it builds the model, before moving it to its GPU (the engine's)."""
    return plan.strategy.startup_host_bytes(shape, plan)


def job_host_mib(partition: Partition, plan: Plan) -> float:
    """Host memory a job gets per node: --mem (plan.mem_mib), else the partition's default, else the node's."""
    return float(plan.mem_mib or partition.default_mem_mib or partition.host_mem_gib * 1024)


def capacity_mib(partition: Partition, plan: Plan) -> float:
    """Memory one rank may use: the GPU's; on a CPU partition the job's host memory
    (--mem, else the partition's default, else the node's) shared by the ranks of a node."""
    if partition.has_gpu:
        return partition.gpu_mem_gib * 1024
    return job_host_mib(partition, plan) / plan.gpus_per_node


def safety_margin_mib(capacity: float) -> float:
    """Left free when deciding whether a plan fits (see SAFETY_MARGIN_FRAC)."""
    return max(SAFETY_MARGIN_MIN_MIB, SAFETY_MARGIN_FRAC * capacity)


def _notes(shape: ModelShape, plan: Plan, partition: Partition, peak: Phase, host_needed: float, fits_host: bool,
           context_arg: float | None, overhead_arg: float | None, dm=None, runtime: Runtime | None = None,
           allocator_model: bool = True) -> tuple[str, ...]:
    """The assumptions that matter for this estimate, for a person to read."""
    notes = [f"peak at the {peak.name} (steady state: optimizer states exist)"]
    if partition.has_gpu and context_arg is None:
        if getattr(partition, "calibrated", False):
            notes.append(f"CUDA context {partition.cuda_context_mib:g} MiB as measured on the partition")
        else:
            notes.append(f"partition not calibrated: using the profile's cuda_context_mib ({partition.cuda_context_mib:g} MiB)")
    if dm is not None:
        notes.append(f"caching allocator replayed (steps 1-2{', ' + dm.alloc_conf if dm.alloc_conf else ''}): "
                     f"{dm.peak_reserved_mib:.0f} MiB reserved, {dm.fragmentation:.0%} of it unallocated at its peak, "
                     f"{dm.segments} segments")
        if dm.fragmentation_only:
            notes.append("the tensors fit but the allocator's reserved memory does not (fragmentation)"
                         + (f": PYTORCH_CUDA_ALLOC_CONF={dm.fix} makes it fit ({dm.fix_peak_reserved_mib:.0f} MiB reserved)"
                            if dm.fix else "; no allocator setting tried makes it fit"))
        for name, mib in dm.extras_mib.items():
            notes.append(f"{name.replace('_', ' ')}: {mib:.0f} MiB outside the caching allocator")
    elif partition.has_gpu and not allocator_model:
        notes.append("allocator not replayed: reserved taken as the allocated peak (a lower bound)")
    if overhead_arg is not None and partition.has_gpu:
        notes.append(f"reserved at least {overhead_arg:.0%} over allocated, as measured on the partition")
    if runtime is not None and runtime != DEFAULT_RUNTIME:
        notes.append(f"runtime: {runtime}")
        if partition.has_gpu and not lazy_loading(runtime.torch_version) and context_arg is None \
                and not getattr(partition, "calibrated", False):
            notes.append(f"torch {runtime.torch_version} loads every CUDA kernel at start-up: CUDA context at least "
                         f"{CUDA_CONTEXT_EAGER_MIB:g} MiB")
    if not partition.has_gpu:
        notes.append(f"CPU partition: capacity is the job's host memory shared by {plan.gpus_per_node} rank(s); "
                     "the Python/torch process itself is not counted")
    layout_note = plan.strategy.layout(plan).note
    if layout_note:
        notes.append(layout_note)
    if shape.seq_len is not None:
        notes.append(f"{shape.task}: {shape.seq_len} tokens per sample (patches + CLS) from the model's config; "
                     f"the plan's seq_len ({plan.seq_len}) does not apply")
    elif shape.max_positions is not None and plan.seq_len > shape.max_positions:
        notes.append(f"seq_len {plan.seq_len} is longer than the model's {shape.max_positions} positions")
    if shape.kv_cache and not plan.checkpointing and shape.family == "gpt2":
        notes.append("the classifier's forward builds a KV cache (config use_cache), copying K and V in every layer")
    if "nvme" in (plan.offload_optimizer, plan.offload_params) or plan.offload_optimizer == "cpu" or plan.offload_params == "cpu":
        notes.append(f"offload: {plan.strategy.describe(plan)}; host memory x{OFFLOAD_BUFFER_FACTOR:g} for DeepSpeed's "
                     "buffers (CPU), pinned NVMe buffers" if plan.launcher == "deepspeed" else
                     f"offload: {plan.strategy.describe(plan)}: sharded weights, grads and optimizer states in host memory")
    if not fits_host:
        notes.append(f"host memory: {host_needed:.0f} MiB needed per node, {job_host_mib(partition, plan):.0f} MiB available")
    return tuple(notes)
