"""The shape of a transformer from its config dict (pure): sizes the estimator and DeepSpeed need.

Reads the common transformers spellings (GPT-2's n_embd/n_layer/n_inner, BERT's,
LLaMA's and ViT's hidden_size/num_hidden_layers/intermediate_size).

``ModelShape.from_config`` lists every parameter tensor the transformers model of that
config has (``AutoModelForCausalLM``, ``AutoModelForSequenceClassification`` or, for a
ViT, ``AutoModelForImageClassification``), so that
``n_params`` is the model's exact ``sum(p.numel() for p in model.parameters())``; the
estimator also reads the block layout (``family``), the activation function and the
dropout rates from it. ``ModelShape.from_param_count`` is for a model known only by its
parameter count and a few sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any, Mapping

from .errors import ConfigError

TASKS = ("causal-lm", "seq-cls", "image-cls")
TEXT_TASKS = ("causal-lm", "seq-cls")
IMAGE_TASKS = ("image-cls",)



@dataclass(frozen=True)
class LlamaVariant:
    """What sets one LLaMA-layout model type apart, read in transformers' ``modeling_<type>.py``."""

    qkv_bias: bool = False
    """Q/K/V always carry biases (Qwen2); otherwise the config's ``attention_bias`` decides, where honoured."""
    attention_bias: bool = True
    """The config's ``attention_bias`` is honoured (Mistral's projections have no bias whatever it says)."""
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys before the rotary embedding (Qwen3's q_norm, k_norm)."""
    norm_fp32: bool = False
    """The RMSNorm scales its fp32 normalised tensor by (1 + weight) and keeps it for backward (Gemma);
    LLaMA's casts it back to the input's dtype first and keeps that."""
    head_dim: int | None = None
    """The config class's ``head_dim`` default when config.json states none (None: hidden / heads)."""
    kv_heads: int | None = None
    """The config class's ``num_key_value_heads`` default when config.json states none (None: as many as the
    query heads). Mistral's is 8, Qwen2's and Qwen3's 32, Gemma's 16, whatever the query heads."""
    tied: bool = False
    """The config class's ``tie_word_embeddings`` default."""
    o_bias: bool = True
    """``attention_bias`` also gives o_proj a bias (not Qwen2, whose config has no such field)."""
    mlp_bias: bool = False
    """The config's ``mlp_bias`` is honoured (LLaMA)."""
    activation: str = "silu"
    """The MLP's activation when the config names none."""
    activation_keys: tuple[str, ...] = ("hidden_act",)
    """The config fields that name the activation, the first present winning (older GemmaConfigs read
    ``hidden_activation`` before ``hidden_act``)."""
    gelu_is: str = "gelu"
    """What an exact "gelu" in the config runs as: Gemma's config turns it into the tanh approximation, its
    default (transformers' GemmaConfig: "a legacy value of the official releases")."""
    fused: bool = False
    """One ``qkv_proj`` for the queries, keys and values and one ``gate_up_proj`` for the gated MLP's two inputs
    (Phi-3), whose outputs the layer slices into views (``ModelShape.fused``)."""
    sliding_window: str | None = None
    """How the config's ``sliding_window`` is honoured: "always" (Mistral, Phi-3: every layer attends within it),
    "layers" (Gemma 3: the layers ``layer_types`` names ``sliding_attention``), "flag" (Qwen2, Qwen3: only with
    ``use_sliding_window``, which is refused), None (no window: LLaMA, Gemma, and Gemma 2, which never runs on
    SDPA)."""
    dropout_key: str | None = None
    """The config field of the dropout on each residual branch (Phi-3's ``resid_pdrop``); None: none."""
    sandwich_norms: bool = False
    """Four norms per layer (Gemma 2): after the attention and after the MLP too, each normalising a projection's
    output before it joins the residual stream (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
    ``post_feedforward_layernorm``)."""
    softcaps: tuple[tuple[str, float | None], ...] = ()
    """The soft-capping fields the model's code applies, each with its config class's default (used when
    config.json leaves the field out): ``attn_logit_softcapping`` and ``final_logit_softcapping`` squash the
    attention scores and the logits through ``cap * tanh(x / cap)``, whose backward keeps the tanh's output.
    Gemma 2 applies both (50 and 30 by default); Gemma 3's attention does not pass its field on, so only the
    logits' counts there (None by default)."""
    window_default: int | None = None
    """The config class's ``sliding_window`` when config.json leaves it out (Mistral's and Gemma 3's 4096); an
    explicit null is no window."""
    sdpa: bool = True
    """transformers runs the model on SDPA (Gemma 2 does not: ``_supports_sdpa = False``, SDPA has no soft-capping)."""


LLAMA_VARIANTS = {
    "llama": LlamaVariant(mlp_bias=True),
    "mistral": LlamaVariant(attention_bias=False, kv_heads=8, sliding_window="always", window_default=4096),
    "qwen2": LlamaVariant(qkv_bias=True, o_bias=False, kv_heads=32, sliding_window="flag"),
    "qwen3": LlamaVariant(qk_norm=True, head_dim=128, kv_heads=32, sliding_window="flag"),
    "gemma": LlamaVariant(norm_fp32=True, head_dim=256, tied=True, kv_heads=16, activation="gelu_pytorch_tanh",
                          activation_keys=("hidden_activation", "hidden_act"), gelu_is="gelu_pytorch_tanh"),
    "phi3": LlamaVariant(attention_bias=False, fused=True, sliding_window="always", dropout_key="resid_pdrop"),
    "gemma3_text": LlamaVariant(norm_fp32=True, head_dim=256, tied=True, kv_heads=4, activation="gelu_pytorch_tanh",
                                activation_keys=("hidden_activation",), sandwich_norms=True,
                                softcaps=(("final_logit_softcapping", None),), qk_norm=True, sliding_window="layers",
                                window_default=4096),
    # eager or flash attention only, so its window (on every other layer) changes nothing kept: not read
    "gemma2": LlamaVariant(norm_fp32=True, head_dim=256, tied=True, kv_heads=4, activation="gelu_pytorch_tanh",
                           activation_keys=("hidden_activation",), sandwich_norms=True, sdpa=False,
                           softcaps=(("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))),
}
"""The model types the "llama" layout covers (Phi-3's "phi3" also covers Phi-3.5-mini, Phi-4 and Phi-4-mini,
which transformers builds with the same classes; Gemma 3's text model "gemma3_text", the 1B model and the
language model of the larger ones). Not among them, and refused rather than guessed: Gemma 3's multimodal
"gemma3" (a vision tower), Phi-3-small ("phi3small": block-sparse attention), mixtures of experts."""

# model_type -> block layout. "gpt2": fused QKV, LayerNorm, plain MLP; "bert": separate
# Q/K/V, post-LayerNorm, plain MLP (RoBERTa's layers are BERT's; its embeddings and heads hold the
# same tensors); "llama": separate Q/K/V (GQA), RMSNorm, rotary positions, gated (SwiGLU/GeGLU) MLP,
# with the variants above; "vit": an image encoder, separate Q/K/V, pre-LayerNorm, plain MLP, on
# patches instead of tokens; "opt": a decoder with ViT's layer (separate biased Q/K/V, pre-LayerNorm, plain
# ReLU MLP, dropout on both residual branches) and learned positions.
FAMILIES = {"gpt2": "gpt2", "bert": "bert", "roberta": "bert", "xlm-roberta": "bert",
            **{t: "llama" for t in LLAMA_VARIANTS}, "vit": "vit", "opt": "opt"}
IMAGE_FAMILIES = ("vit",)

# Parameter kinds: a "linear" weight feeds a matmul (autocast keeps a 16-bit copy of it
# for backward); "bias", "norm", "embedding" and "other" do not.
KINDS = ("linear", "bias", "norm", "embedding", "other")

Tensor = tuple[str, tuple[int, ...], str]
"""(name, shape, kind) of one parameter tensor."""


def _first(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


ACTIVATIONS = frozenset((
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
    "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu", "relu",
    "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu"))
"""The activation names transformers builds (``transformers.activations.ACT2FN``, read in 5.24); a config
naming another would not build, so the estimate refuses it by name rather than sizing a guess."""


def _activation(cfg: Mapping[str, Any], *names: str, default: str) -> str:
    """The activation the config names under the first of ``names`` present (``default`` if none), checked
    against ``ACTIVATIONS``."""
    value = _first(cfg, *names, default=default)
    if not isinstance(value, str) or value not in ACTIVATIONS:
        spelled = " or ".join(repr(n) for n in names)
        raise ConfigError(f"model config {spelled} {str(value)[:60]!r} is not an activation transformers knows")
    return value


def hidden_size(cfg: Mapping[str, Any]) -> int:
    """The hidden size under any of its spellings (a ConfigError naming them when absent or not a size)."""
    return _need(cfg, "hidden_size", "n_embd", "d_model")


def ffn_size(cfg: Mapping[str, Any]) -> int:
    return _optional(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden_size(cfg))


def largest_param_numel(cfg: Mapping[str, Any]) -> int:
    """Elements of the largest single weight: the embedding or an FFN matrix (or fused QKV, or Phi-3's fused
    gate and up projections): exact for a family the analytic shapes know, else the largest of those."""
    if cfg.get("model_type") in FAMILIES and FAMILIES[cfg["model_type"]] not in IMAGE_FAMILIES:
        try:
            return ModelShape.from_config(cfg, task="causal-lm").largest_param_numel
        except ConfigError:
            pass  # a config the shapes cannot read: the rough rule below
    h = hidden_size(cfg)
    vocab = _optional(cfg, "vocab_size", default=0)
    return max(vocab * h, ffn_size(cfg) * h, 3 * h * h)


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes and its parameter tensors (elements, not bytes)."""

    family: str
    """Block layout the activation formulas follow: gpt2, bert, llama, vit or opt."""
    model_type: str
    task: str
    """causal-lm, seq-cls or image-cls (decides the head: vocabulary logits or a few labels)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    """Key/value heads (grouped-query attention; = heads without it)."""
    head_dim: int
    ffn: int
    """FFN intermediate width (per matrix; a gated MLP has three of them)."""
    activation: str
    """The config's activation name (gelu_new, gelu, silu, ...)."""
    gated: bool
    vocab: int
    """Token vocabulary (0 for an image model: it has no token embeddings)."""
    max_positions: int | None
    """Longest sequence the position embeddings allow (None: rotary, no table)."""
    tied: bool
    """Input embedding and LM head share one matrix."""
    num_labels: int
    attn_dropout: float
    hidden_dropout: float
    """Dropout on the residual branches inside each layer."""
    embd_dropout: float
    kv_cache: bool
    """The forward builds a KV cache although it trains (transformers' use_cache default for a
    decoder's classification head; the runtime turns it off for causal LMs only)."""
    layer_tensors: tuple[Tensor, ...]
    """The parameters of one transformer layer (every layer has the same)."""
    other_tensors: tuple[Tensor, ...]
    """Embeddings, final norm, head: everything outside the layers."""
    seq_len: int | None = None
    """Tokens per sample fixed by the model itself: a ViT's patches plus its CLS token,
    (image_size / patch_size)^2 + 1. None: the plan's seq_len (text models)."""
    image: tuple[int, int, int] | None = None
    """(channels, height, width) of one input image (pixels); None for a text model."""
    qk_norm: bool = False
    """Each layer normalises its queries and keys per head (``LlamaVariant.qk_norm``)."""
    norm_fp32: bool = False
    """The RMSNorms keep their fp32 normalised tensor (``LlamaVariant.norm_fp32``)."""
    fused: bool = False
    """Queries, keys and values come from one projection and the gated MLP's two inputs from another
    (``LlamaVariant.fused``): SDPA's saved value, a view, keeps the whole query/key/value output alive."""
    sandwich_norms: bool = False
    """Each layer also normalises its attention's and its MLP's outputs (``LlamaVariant.sandwich_norms``)."""
    attn_softcap: bool = False
    """The attention scores are soft-capped (``attn_logit_softcapping``): eager attention keeps the tanh's output."""
    final_softcap: bool = False
    """The logits are soft-capped (``final_logit_softcapping``): the tanh's output is kept for backward."""
    sdpa: bool = True
    """transformers can run the model's attention on SDPA (``LlamaVariant.sdpa``)."""
    sliding_window: int | None = None
    """Layers attend within this many tokens (Mistral, Phi-3: every layer; Gemma 3: most, and where the others
    keep less, every layer is taken as keeping what a windowed one does: a bound); None: no window."""

    # -- constructors --------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], task: str = "causal-lm", num_labels: int | None = None) -> "ModelShape":
        """The shape of the transformers model for ``cfg`` (a config.json dict) and ``task``.

        ``num_labels`` defaults to the config's ``num_labels``, else the length of its
        ``id2label``, else 2, as transformers does. A missing size raises a one-line
        ``ConfigError`` naming the field; an architecture the analytic formulas do not know
        raises one listing those they do; an image model with a text task (or the reverse)
        raises one naming the tasks that fit.
        """
        if task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ConfigError(f"model_type {model_type!r} is not one the analytic estimator knows "
                              f"({', '.join(sorted(FAMILIES))}); use --method traced")
        image_model = FAMILIES[model_type] in IMAGE_FAMILIES
        if image_model and task not in IMAGE_TASKS:
            raise ConfigError(f"model_type {model_type!r} is an image model: task must be "
                              f"{' or '.join(IMAGE_TASKS)}, got {task!r}")
        if not image_model and task in IMAGE_TASKS:
            raise ConfigError(f"task {task!r} needs an image model (model_type {' or '.join(IMAGE_FAMILIES)}); "
                              f"{model_type!r} is a text model: use {' or '.join(TEXT_TASKS)}")
        labels = _need({"num_labels": num_labels}, "num_labels") if num_labels is not None else _labels(cfg)
        build = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "vit": _vit, "opt": _opt}[FAMILIES[model_type]]
        return build(cfg, task, labels)

    @classmethod
    def from_param_count(cls, n: int, hidden: int, layers: int, heads: int, vocab: int, seq: int | None = None, *,
                         task: str = "causal-lm", kv_heads: int | None = None, activation: str = "gelu",
                         num_labels: int = 2) -> "ModelShape":
        """A GPT-style model of exactly ``n`` parameters with these sizes.

        Tied embeddings (vocab x hidden) and a final LayerNorm outside the layers; each
        layer a GPT-2 block (fused QKV, LayerNorm, non-gated MLP) whose FFN width is
        what makes the count come out (the few parameters left over by rounding are an
        extra "unattributed" tensor). ``seq``: the longest sequence (None: unbounded).
        """
        if task not in TEXT_TASKS:
            raise ConfigError(f"task must be one of {', '.join(TEXT_TASKS)}; got {task!r}")
        for name, value in (("n", n), ("hidden", hidden), ("layers", layers), ("heads", heads), ("vocab", vocab)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if hidden % heads:
            raise ConfigError(f"hidden {hidden} is not a multiple of heads {heads}")
        kv = kv_heads or heads
        d = hidden // heads
        outside = vocab * hidden + 2 * hidden + (hidden * num_labels if task == "seq-cls" else 0)
        # Layer: QKV (h x (h + 2 kv d)) + out (h x h) + biases + 2 LayerNorms + MLP (2 h f + f + h).
        attn = hidden * (hidden + 2 * kv * d) + (hidden + 2 * kv * d) + hidden * hidden + hidden + 4 * hidden
        per_layer = (n - outside) // layers
        ffn = (per_layer - attn - hidden) // (2 * hidden + 1)
        if ffn < 1:
            raise ConfigError(f"{n} parameters are too few for hidden {hidden}, {layers} layers and vocab {vocab}")
        layer = _gpt2_layer(hidden, heads * d, kv * d, ffn)
        other = [("wte", (vocab, hidden), "embedding"), ("ln_f.weight", (hidden,), "norm"),
                 ("ln_f.bias", (hidden,), "norm")]
        if task == "seq-cls":
            other.append(("score.weight", (num_labels, hidden), "linear"))
        rest = n - sum(prod(s) for _, s, _ in other) - layers * sum(prod(s) for _, s, _ in layer)
        if rest:
            other.append(("unattributed", (rest,), "other"))
        return cls(family="gpt2", model_type="generic", task=task, hidden=hidden, layers=layers, heads=heads,
                   kv_heads=kv, head_dim=d, ffn=ffn, activation=activation, gated=False, vocab=vocab,
                   max_positions=seq, tied=True, num_labels=num_labels, attn_dropout=0.0, hidden_dropout=0.0,
                   embd_dropout=0.0, kv_cache=False, layer_tensors=tuple(layer), other_tensors=tuple(other))

    # -- sizes (elements) ------------------------------------------------------------

    @cached_property
    def layer_params(self) -> int:
        """Parameters of one layer."""
        return sum(prod(s) for _, s, _ in self.layer_tensors)

    @cached_property
    def n_params(self) -> int:
        """Every parameter, counted once (tied matrices once), as ``model.parameters()`` does."""
        return self.layers * self.layer_params + sum(prod(s) for _, s, _ in self.other_tensors)

    @cached_property
    def largest_param_numel(self) -> int:
        """Elements of the largest single parameter tensor."""
        return max(prod(s) for _, s, _ in self.layer_tensors + self.other_tensors)

    @cached_property
    def layer_linear_params(self) -> int:
        """Elements of one layer's matmul weights (what autocast keeps 16-bit copies of)."""
        return sum(prod(s) for _, s, k in self.layer_tensors if k == "linear")

    @cached_property
    def head_linear_params(self) -> int:
        """Elements of the matmul weights outside the layers: the LM head (tied or not), classifier, pooler."""
        linear = sum(prod(s) for _, s, k in self.other_tensors if k == "linear")
        if self.task == "causal-lm" and self.tied:
            linear += self.vocab * self.hidden  # the input embedding doubles as the LM head's weight
        return linear

    @cached_property
    def shape_counts(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """(shape, how many tensors of that shape) over the whole model, for per-tensor optimizer states."""
        counts: dict[tuple[int, ...], int] = {}
        for _, shape, _ in self.layer_tensors:
            counts[shape] = counts.get(shape, 0) + self.layers
        for _, shape, _ in self.other_tensors:
            counts[shape] = counts.get(shape, 0) + 1
        return tuple(counts.items())

    def to_dict(self) -> dict[str, Any]:
        """The sizes as numbers (for --json); tensors summarised."""
        return {"family": self.family, "model_type": self.model_type, "task": self.task, "hidden": self.hidden,
                "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "ffn": self.ffn, "activation": self.activation, "gated": self.gated, "vocab": self.vocab,
                "max_positions": self.max_positions, "tied": self.tied, "n_params": self.n_params,
                "fused": self.fused, "sliding_window": self.sliding_window, "sandwich_norms": self.sandwich_norms,
                "attn_softcap": self.attn_softcap, "final_softcap": self.final_softcap,
                "largest_param_numel": self.largest_param_numel, "seq_len": self.seq_len,
                "image": list(self.image) if self.image else None}


# -- reading a config --------------------------------------------------------------------

def _optional(cfg: Mapping[str, Any], *names: str, default: int | None) -> int | None:
    """The first of ``names`` the config has, as a positive int, else ``default``; a ConfigError naming it when
    it is there but not a positive integer."""
    value = _first(cfg, *names)
    return default if value is None else _need(cfg, *names)


MOST = {"n_layer": 1024, "num_hidden_layers": 1024}
"""A size field -> the largest value read (others: ``MOST_SIZE``). Beyond any model trained so far (the deepest
published transformer, DeepNet, has 1,000 layers; the largest LLMs under 200; hidden sizes, vocabularies and image
sides stay under a million): they keep an untrusted config.json from driving the estimator's per-layer stream
(about 120 allocator events a layer, replayed twice) and its arithmetic for minutes."""
MOST_SIZE = 2**24


def _need(cfg: Mapping[str, Any], *names: str) -> int:
    """The first of ``names`` the config has, as a positive int within ``MOST``; a ConfigError naming it otherwise."""
    value = _first(cfg, *names)
    spelled = " or ".join(repr(n) for n in names)
    if value is None:
        raise ConfigError(f"model config ({cfg.get('model_type')}) is missing {spelled}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model config {spelled} must be a positive integer, got {value!r}")
    most = min(MOST.get(n, MOST_SIZE) for n in names)
    if value > most:
        raise ConfigError(f"model config {spelled} is {value}, more than any model the estimator covers (at most {most})")
    return value



def _needs(cfg: Mapping[str, Any], *names: str) -> tuple:
    """Several required fields, one spelling each, in order (``_need`` takes alternative spellings of one)."""
    return tuple(_need(cfg, name) for name in names)

def _labels(cfg: Mapping[str, Any]) -> int:
    """The config's label count: num_labels, else the length of id2label, else 2 (as transformers)."""
    if cfg.get("num_labels") is not None:
        return _need(cfg, "num_labels")
    if isinstance(cfg.get("id2label"), Mapping) and cfg["id2label"]:
        return _need({"id2label": len(cfg["id2label"])}, "id2label")
    return 2


def _pair(cfg: Mapping[str, Any], name: str) -> tuple[int, int]:
    """An image size field as (height, width): one positive int, or a list of two."""
    value = cfg.get(name)
    if value is None:
        raise ConfigError(f"model config ({cfg.get('model_type')}) is missing {name!r}")
    pair = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MOST_SIZE for v in pair):
        raise ConfigError(f"model config {name!r} must be a positive integer (at most {MOST_SIZE}) or two of them, "
                          f"got {value!r}")
    return pair[0], pair[1]


def image_sequence(cfg: Mapping[str, Any]) -> int:
    """Tokens a ViT's encoder sees per image: (image_size / patch_size)^2 patches + the CLS token."""
    (ih, iw), (ph, pw) = _pair(cfg, "image_size"), _pair(cfg, "patch_size")
    if ih < ph or iw < pw:
        raise ConfigError(f"model config patch_size {cfg.get('patch_size')!r} is larger than image_size "
                          f"{cfg.get('image_size')!r}")
    return (ih // ph) * (iw // pw) + 1


def _rate(cfg: Mapping[str, Any], name: str, default: float) -> float:
    """A dropout probability: a number from 0 to 1, else a ConfigError naming the field."""
    value = cfg.get(name)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"model config {name!r} must be a probability from 0 to 1, got {value!r}")
    return float(value)


def _heads(cfg: Mapping[str, Any], hidden: int, heads: int, default_head_dim: int | None = None,
           default_kv: int | None = None) -> tuple[int, int]:
    """(kv_heads, head_dim), checking that they divide as transformers needs; ``default_head_dim`` and
    ``default_kv``: the config class's own defaults when config.json states none (None: hidden / heads and
    heads)."""
    kv = _optional(cfg, "num_key_value_heads", default=default_kv or heads)
    if heads % kv:
        raise ConfigError(f"model config num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = _optional(cfg, "head_dim", default=default_head_dim)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"model config hidden size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return kv, int(head_dim)


def _kv_cache(cfg: Mapping[str, Any], task: str) -> bool:
    """toolkit/models.py turns the cache off for causal LMs; a classifier keeps the config's use_cache."""
    return task == "seq-cls" and bool(_first(cfg, "use_cache", default=True))


def _gpt2_layer(h: int, q_dim: int, kv_dim: int, f: int) -> list[Tensor]:
    qkv = q_dim + 2 * kv_dim
    return [("ln_1.weight", (h,), "norm"), ("ln_1.bias", (h,), "norm"),
            ("attn.c_attn.weight", (h, qkv), "linear"), ("attn.c_attn.bias", (qkv,), "bias"),
            ("attn.c_proj.weight", (q_dim, h), "linear"), ("attn.c_proj.bias", (h,), "bias"),
            ("ln_2.weight", (h,), "norm"), ("ln_2.bias", (h,), "norm"),
            ("mlp.c_fc.weight", (h, f), "linear"), ("mlp.c_fc.bias", (f,), "bias"),
            ("mlp.c_proj.weight", (f, h), "linear"), ("mlp.c_proj.bias", (h,), "bias")]


def _gpt2(cfg: Mapping[str, Any], task: str, labels: int) -> ModelShape:
    h = _need(cfg, "n_embd", "hidden_size")
    layers = _need(cfg, "n_layer", "num_hidden_layers")
    heads = _need(cfg, "n_head", "num_attention_heads")
    vocab = _need(cfg, "vocab_size")
    positions = _optional(cfg, "n_positions", "max_position_embeddings", default=1024)
    if h % heads:
        raise ConfigError(f"model config n_embd {h} is not a multiple of n_head {heads}")
    if cfg.get("add_cross_attention"):
        raise ConfigError("model config add_cross_attention: GPT-2 with cross-attention is not covered; use --method traced")
    f = _optional(cfg, "n_inner", default=4 * h)
    tied = bool(_first(cfg, "tie_word_embeddings", default=True))
    other: list[Tensor] = [("wte", (vocab, h), "embedding"), ("wpe", (positions, h), "embedding"),
                           ("ln_f.weight", (h,), "norm"), ("ln_f.bias", (h,), "norm")]
    if task == "seq-cls":
        other.append(("score.weight", (labels, h), "linear"))
    elif not tied:
        other.append(("lm_head.weight", (vocab, h), "linear"))
    return ModelShape(family="gpt2", model_type=cfg["model_type"], task=task, hidden=h, layers=layers, heads=heads,
                      kv_heads=heads, head_dim=h // heads, ffn=f, activation=_activation(cfg, "activation_function", default="gelu_new"),
                      gated=False, vocab=vocab, max_positions=positions, tied=tied, num_labels=labels,
                      attn_dropout=_rate(cfg, "attn_pdrop", 0.1), hidden_dropout=_rate(cfg, "resid_pdrop", 0.1),
                      embd_dropout=_rate(cfg, "embd_pdrop", 0.1), kv_cache=_kv_cache(cfg, task),
                      layer_tensors=tuple(_gpt2_layer(h, h, h, f)), other_tensors=tuple(other))


def _bert(cfg: Mapping[str, Any], task: str, labels: int) -> ModelShape:
    h, layers, heads, vocab, f = _needs(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                        "intermediate_size")
    positions = _optional(cfg, "max_position_embeddings", default=512)
    types = _optional(cfg, "type_vocab_size", default=2)
    if h % heads:
        raise ConfigError(f"model config hidden_size {h} is not a multiple of num_attention_heads {heads}")
    tied = bool(_first(cfg, "tie_word_embeddings", default=True))
    layer: list[Tensor] = []
    for name in ("query", "key", "value"):
        layer += [(f"attention.self.{name}.weight", (h, h), "linear"), (f"attention.self.{name}.bias", (h,), "bias")]
    layer += [("attention.output.dense.weight", (h, h), "linear"), ("attention.output.dense.bias", (h,), "bias"),
              ("attention.output.LayerNorm.weight", (h,), "norm"), ("attention.output.LayerNorm.bias", (h,), "norm"),
              ("intermediate.dense.weight", (f, h), "linear"), ("intermediate.dense.bias", (f,), "bias"),
              ("output.dense.weight", (h, f), "linear"), ("output.dense.bias", (h,), "bias"),
              ("output.LayerNorm.weight", (h,), "norm"), ("output.LayerNorm.bias", (h,), "norm")]
    other: list[Tensor] = [("embeddings.word_embeddings", (vocab, h), "embedding"),
                           ("embeddings.position_embeddings", (positions, h), "embedding"),
                           ("embeddings.token_type_embeddings", (types, h), "embedding"),
                           ("embeddings.LayerNorm.weight", (h,), "norm"), ("embeddings.LayerNorm.bias", (h,), "norm")]
    if task == "seq-cls":  # BertForSequenceClassification: pooler + classifier; RoBERTa's head holds the same
        dense, out = ("classifier.dense", "classifier.out_proj") if cfg["model_type"] != "bert" else \
            ("pooler.dense", "classifier")
        other += [(f"{dense}.weight", (h, h), "linear"), (f"{dense}.bias", (h,), "bias"),
                  (f"{out}.weight", (labels, h), "linear"), (f"{out}.bias", (labels,), "bias")]
    else:  # BertLMHeadModel: no pooler; transform + decoder (+ its own bias)
        other += [("cls.transform.dense.weight", (h, h), "linear"), ("cls.transform.dense.bias", (h,), "bias"),
                  ("cls.transform.LayerNorm.weight", (h,), "norm"), ("cls.transform.LayerNorm.bias", (h,), "norm"),
                  ("cls.bias", (vocab,), "bias")]
        if not tied:  # the decoder's weight and bias are tied to the embedding and cls.bias only together
            other += [("cls.decoder.weight", (vocab, h), "linear"), ("cls.decoder.bias", (vocab,), "bias")]
    return ModelShape(family="bert", model_type=cfg["model_type"], task=task, hidden=h, layers=layers, heads=heads,
                      kv_heads=heads, head_dim=h // heads, ffn=f, activation=_activation(cfg, "hidden_act", default="gelu"),
                      gated=False, vocab=vocab, max_positions=positions, tied=tied, num_labels=labels,
                      attn_dropout=_rate(cfg, "attention_probs_dropout_prob", 0.1),
                      hidden_dropout=_rate(cfg, "hidden_dropout_prob", 0.1),
                      embd_dropout=_rate(cfg, "hidden_dropout_prob", 0.1), kv_cache=False,
                      layer_tensors=tuple(layer), other_tensors=tuple(other))


def _llama(cfg: Mapping[str, Any], task: str, labels: int) -> ModelShape:
    h, layers, heads, vocab, f = _needs(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                        "intermediate_size")
    model_type = cfg["model_type"]
    variant = LLAMA_VARIANTS[model_type]
    kv, d = _heads(cfg, h, heads, variant.head_dim, variant.kv_heads)
    attention_bias = variant.attention_bias and bool(cfg.get("attention_bias"))
    qkv_bias = variant.qkv_bias or attention_bias
    o_bias = variant.o_bias and attention_bias
    mlp_bias = variant.mlp_bias and bool(cfg.get("mlp_bias"))
    tied = bool(_first(cfg, "tie_word_embeddings", default=variant.tied))
    q_dim, kv_dim = heads * d, kv * d
    layer: list[Tensor] = []
    projections = ((("qkv_proj", q_dim + 2 * kv_dim),) if variant.fused
                   else (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)))
    for name, out_dim in projections:
        layer.append((f"self_attn.{name}.weight", (out_dim, h), "linear"))
        if qkv_bias:
            layer.append((f"self_attn.{name}.bias", (out_dim,), "bias"))
    o_proj = [("self_attn.o_proj.weight", (h, q_dim), "linear")] + ([("self_attn.o_proj.bias", (h,), "bias")]
                                                                    if o_bias else [])
    # in named_parameters() order (the stream's load order, DDP's and ZeRO's buckets): Phi-3 makes o_proj first
    layer = o_proj + layer if variant.fused else layer + o_proj
    if variant.qk_norm:  # registered after o_proj, as transformers' named_parameters() lists them
        layer += [("self_attn.q_norm.weight", (d,), "norm"), ("self_attn.k_norm.weight", (d,), "norm")]
    mlp = ((("gate_up_proj", (2 * f, h)),) if variant.fused else (("gate_proj", (f, h)), ("up_proj", (f, h))))
    for name, shape in (*mlp, ("down_proj", (h, f))):
        layer.append((f"mlp.{name}.weight", shape, "linear"))
        if mlp_bias:
            layer.append((f"mlp.{name}.bias", (shape[0],), "bias"))
    layer += [("input_layernorm.weight", (h,), "norm"), ("post_attention_layernorm.weight", (h,), "norm")]
    if variant.sandwich_norms:
        layer += [("pre_feedforward_layernorm.weight", (h,), "norm"), ("post_feedforward_layernorm.weight", (h,), "norm")]
    other: list[Tensor] = [("embed_tokens", (vocab, h), "embedding"), ("norm.weight", (h,), "norm")]
    if task == "seq-cls":
        other.append(("score.weight", (labels, h), "linear"))
    elif not tied:
        other.append(("lm_head.weight", (vocab, h), "linear"))
    act = _activation(cfg, *variant.activation_keys, default=variant.activation)
    act = variant.gelu_is if act == "gelu" else act
    return ModelShape(family="llama", model_type=model_type, task=task, hidden=h, layers=layers, heads=heads,
                      kv_heads=kv, head_dim=d, ffn=f, activation=act, gated=True, vocab=vocab,
                      max_positions=_optional(cfg, "max_position_embeddings", default=None), tied=tied,
                      num_labels=labels,
                      attn_dropout=_rate(cfg, "attention_dropout", 0.0),
                      hidden_dropout=_rate(cfg, variant.dropout_key, 0.0) if variant.dropout_key else 0.0,
                      embd_dropout=0.0, kv_cache=_kv_cache(cfg, task),
                      layer_tensors=tuple(layer), other_tensors=tuple(other),
                      qk_norm=variant.qk_norm, norm_fp32=variant.norm_fp32, fused=variant.fused,
                      sliding_window=_window(cfg, variant), sandwich_norms=variant.sandwich_norms,
                      attn_softcap=_softcap(cfg, variant, "attn_logit_softcapping"),
                      final_softcap=_softcap(cfg, variant, "final_logit_softcapping"), sdpa=variant.sdpa)


def _softcap(cfg: Mapping[str, Any], variant: LlamaVariant, name: str) -> bool:
    """Whether the model's code soft-caps with ``name`` (``LlamaVariant.softcaps``): the config's value, else its
    class's default, a positive number; null: none."""
    defaults = dict(variant.softcaps)
    if name not in defaults:
        return False
    value = cfg[name] if name in cfg else defaults[name]
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(f"model config {name!r} must be a positive number or null, got {value!r}")
    return True


def _window(cfg: Mapping[str, Any], variant: LlamaVariant) -> int | None:
    """The attention window every layer keeps (``LlamaVariant.sliding_window``); None: none. Qwen's
    ``use_sliding_window`` (a window on some layers only, from ``max_window_layers``) is refused by name."""
    if variant.sliding_window == "flag":
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"model config ({cfg.get('model_type')}) sets use_sliding_window: the analytic "
                              "estimator does not model a window on some layers only; use --method traced")
        return None
    if variant.sliding_window not in ("always", "layers"):
        return None
    if cfg.get("use_bidirectional_attention"):  # EmbeddingGemma's encoder: no causal mask to skip
        raise ConfigError(f"model config ({cfg.get('model_type')}) sets use_bidirectional_attention: the analytic "
                          "estimator models causal attention only; use --method traced")
    window = _optional(cfg, "sliding_window", default=None) if "sliding_window" in cfg else variant.window_default
    if variant.sliding_window == "layers" and window is not None and not _sliding_layers(cfg):
        return None
    return window


def _sliding_layers(cfg: Mapping[str, Any]) -> int:
    """How many layers attend within the window (Gemma 3): those ``layer_types`` names "sliding_attention", else
    every layer but each ``sliding_window_pattern``-th (transformers' default pattern, 6)."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != _need(cfg, "num_hidden_layers") \
                or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ConfigError(f"model config ({cfg.get('model_type')}) layer_types must list 'sliding_attention' or "
                              "'full_attention' for each of its num_hidden_layers")
        return types.count("sliding_attention")
    pattern = _optional(cfg, "sliding_window_pattern", "_sliding_window_pattern", default=6)
    return sum(1 for i in range(_need(cfg, "num_hidden_layers")) if (i + 1) % pattern)


def _opt(cfg: Mapping[str, Any], task: str, labels: int) -> ModelShape:
    """OPTForCausalLM / OPTForSequenceClassification (transformers' modeling_opt.py): token and learned position
    embeddings (``max_position_embeddings`` + 2 rows: OPT offsets positions past the padding index), pre-LayerNorm
    decoder layers (k/v/q/out projections, fc1, ReLU, fc2; biases unless ``enable_bias`` is false), a final
    LayerNorm, the head tied to the token embedding unless the config says not. The 350M checkpoint's layout
    (``word_embed_proj_dim`` apart from the hidden size, post-LayerNorm layers) is refused, not guessed."""
    h, layers, heads, vocab, f = _needs(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                        "ffn_dim")
    positions = _optional(cfg, "max_position_embeddings", default=2048)
    if h % heads:
        raise ConfigError(f"model config hidden_size {h} is not a multiple of num_attention_heads {heads}")
    proj = _optional(cfg, "word_embed_proj_dim", default=h)
    if proj != h:
        raise ConfigError(f"model config word_embed_proj_dim {proj} differs from hidden_size {h} (OPT-350m's "
                          f"project_in/project_out): not covered; use --method traced")
    if not bool(_first(cfg, "do_layer_norm_before", default=True)):
        raise ConfigError("model config do_layer_norm_before false (OPT-350m's post-LayerNorm layers): not covered; "
                          "use --method traced")
    if cfg.get("_remove_final_layer_norm"):
        raise ConfigError("model config _remove_final_layer_norm: an OPT without its final LayerNorm is not covered; "
                          "use --method traced")
    bias = bool(_first(cfg, "enable_bias", default=True))
    affine = bool(_first(cfg, "layer_norm_elementwise_affine", default=True))
    tied = bool(_first(cfg, "tie_word_embeddings", default=True))

    def linear(name: str, out_dim: int, in_dim: int) -> list[Tensor]:
        return [(f"{name}.weight", (out_dim, in_dim), "linear")] + ([(f"{name}.bias", (out_dim,), "bias")] if bias else [])

    def norm(name: str) -> list[Tensor]:
        return [(f"{name}.weight", (h,), "norm"), (f"{name}.bias", (h,), "norm")] if affine else []

    layer: list[Tensor] = []
    for name in ("k_proj", "v_proj", "q_proj", "out_proj"):  # OPTAttention registers them in this order
        layer += linear(f"self_attn.{name}", h, h)
    layer += norm("self_attn_layer_norm") + linear("fc1", f, h) + linear("fc2", h, f) + norm("final_layer_norm")
    other: list[Tensor] = [("decoder.embed_tokens", (vocab, h), "embedding"),
                           ("decoder.embed_positions", (positions + 2, h), "embedding")] + norm("decoder.final_layer_norm")
    if task == "seq-cls":
        other.append(("score.weight", (labels, h), "linear"))
    elif not tied:
        other.append(("lm_head.weight", (vocab, h), "linear"))
    return ModelShape(family="opt", model_type=cfg["model_type"], task=task, hidden=h, layers=layers, heads=heads,
                      kv_heads=heads, head_dim=h // heads, ffn=f,
                      activation=_activation(cfg, "activation_function", default="relu"), gated=False, vocab=vocab,
                      max_positions=positions, tied=tied, num_labels=labels,
                      attn_dropout=_rate(cfg, "attention_dropout", 0.0), hidden_dropout=_rate(cfg, "dropout", 0.1),
                      embd_dropout=0.0, kv_cache=False, layer_tensors=tuple(layer), other_tensors=tuple(other))


def _vit(cfg: Mapping[str, Any], task: str, labels: int) -> ModelShape:
    """ViTForImageClassification: patch conv + CLS token + positions, pre-LN encoder layers, final
    LayerNorm, a linear classifier on the CLS token (no pooler)."""
    h, layers, heads, f = _needs(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    (ih, iw), (ph, pw) = _pair(cfg, "image_size"), _pair(cfg, "patch_size")
    channels = _optional(cfg, "num_channels", default=3)
    seq = image_sequence(cfg)
    head_dim = _optional(cfg, "head_dim", default=None)
    if head_dim is None:
        if h % heads:
            raise ConfigError(f"model config hidden_size {h} is not a multiple of num_attention_heads {heads}")
        head_dim = h // heads
    q_dim = heads * int(head_dim)
    qkv_bias = bool(_first(cfg, "qkv_bias", default=True))
    layer: list[Tensor] = [("layernorm_before.weight", (h,), "norm"), ("layernorm_before.bias", (h,), "norm")]
    for name in ("q_proj", "k_proj", "v_proj"):
        layer.append((f"attention.{name}.weight", (q_dim, h), "linear"))
        if qkv_bias:
            layer.append((f"attention.{name}.bias", (q_dim,), "bias"))
    layer += [("attention.o_proj.weight", (h, q_dim), "linear"), ("attention.o_proj.bias", (h,), "bias"),
              ("layernorm_after.weight", (h,), "norm"), ("layernorm_after.bias", (h,), "norm"),
              ("mlp.fc1.weight", (f, h), "linear"), ("mlp.fc1.bias", (f,), "bias"),
              ("mlp.fc2.weight", (h, f), "linear"), ("mlp.fc2.bias", (h,), "bias")]
    # The patch embedding is a convolution (a matmul over C x P x P patches: "linear").
    other: list[Tensor] = [("embeddings.cls_token", (1, 1, h), "embedding"),
                           ("embeddings.position_embeddings", (1, seq, h), "embedding"),
                           ("embeddings.patch_embeddings.projection.weight", (h, channels, ph, pw), "linear"),
                           ("embeddings.patch_embeddings.projection.bias", (h,), "bias"),
                           ("layernorm.weight", (h,), "norm"), ("layernorm.bias", (h,), "norm"),
                           ("classifier.weight", (labels, h), "linear"), ("classifier.bias", (labels,), "bias")]
    hidden_dropout = _rate(cfg, "hidden_dropout_prob", 0.0)
    return ModelShape(family="vit", model_type=cfg["model_type"], task=task, hidden=h, layers=layers, heads=heads,
                      kv_heads=heads, head_dim=int(head_dim), ffn=f, activation=_activation(cfg, "hidden_act", default="gelu"),
                      gated=False, vocab=0, max_positions=seq, tied=False, num_labels=labels,
                      attn_dropout=_rate(cfg, "attention_probs_dropout_prob", 0.0), hidden_dropout=hidden_dropout,
                      embd_dropout=hidden_dropout, kv_cache=False,
                      layer_tensors=tuple(layer), other_tensors=tuple(other), seq_len=seq, image=(channels, ih, iw))
