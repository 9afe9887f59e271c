"""toolkit.modelshape: a model's shape and exact parameter count from its config dict.

The counts are checked against the real transformers models of the same configs: tiny
ones built for real on the CPU, the shipped full-size ones built on the meta device
(shapes without memory).
"""

import pytest

from toolkit.errors import ConfigError
from toolkit.models import build_model, load_model_config, transformers_config
from toolkit.modelshape import ModelShape, ffn_size, hidden_size, largest_param_numel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from model_configs import (TINY_GEMMA, TINY_GEMMA2, TINY_GEMMA3, TINY_LLAMA, TINY_OPT, TINY_PHI3,  # noqa: E402
                           TINY_QWEN3, TINY_ROBERTA)

_NO_KV = {k: v for k, v in TINY_LLAMA.items() if k != "num_key_value_heads"}
TINY = {
    "tiny-gpt2": load_model_config("tiny-gpt2"),
    "tiny-bert": load_model_config("tiny-bert"),
    "gpt2-untied-default-ffn": {**load_model_config("tiny-gpt2"), "tie_word_embeddings": False, "n_inner": None},
    "bert-untied-5-labels": {**load_model_config("tiny-bert"), "tie_word_embeddings": False, "num_labels": 5},
    "llama-gqa": TINY_LLAMA,
    "llama-tied-biases": {**TINY_LLAMA, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    "mistral-head-dim": {**TINY_LLAMA, "model_type": "mistral", "head_dim": 48},
    "mistral-ignores-attention-bias": {**TINY_LLAMA, "model_type": "mistral", "attention_bias": True},
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2"},
    # config.json without num_key_value_heads: each config class's own default (Mistral 8, Qwen2 32, Gemma 16)
    "mistral-default-kv-heads": {**_NO_KV, "model_type": "mistral", "num_attention_heads": 16},
    "qwen2-default-kv-heads": {**_NO_KV, "model_type": "qwen2", "num_attention_heads": 64},
    "gemma-default-kv-heads": {**_NO_KV, "model_type": "gemma", "num_attention_heads": 32, "head_dim": 64},
    "qwen3": TINY_QWEN3,
    "qwen3-biases-default-head-dim": {**{k: v for k, v in TINY_QWEN3.items() if k != "head_dim"},
                                      "attention_bias": True},
    "gemma": TINY_GEMMA,
    "gemma2": TINY_GEMMA2,
    "gemma2-no-softcaps": {**TINY_GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma3": TINY_GEMMA3,
    "gemma3-biases-softcapped": {**TINY_GEMMA3, "attention_bias": True, "final_logit_softcapping": 30.0},
    "phi3": TINY_PHI3,
    # Phi-4-mini's shape of things: tied, more query heads than key/value heads, a partial rotary embedding
    "phi3-tied-partial-rotary": {**TINY_PHI3, "tie_word_embeddings": True,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.75}},
    "phi3-wide-mlp": {**TINY_PHI3, "intermediate_size": 8192},  # gate_up_proj outgrows the embedding
    "roberta": TINY_ROBERTA,
    "xlm-roberta-5-labels": {**TINY_ROBERTA, "model_type": "xlm-roberta", "num_labels": 5},
    "opt": TINY_OPT,
    "opt-untied-no-biases-no-affine": {**TINY_OPT, "tie_word_embeddings": False, "enable_bias": False,
                                       "layer_norm_elementwise_affine": False},
}
TASKS = ("causal-lm", "seq-cls")


def real_model(cfg, task, meta=False):
    """The transformers model (eager attention: its parameters are the same, and Gemma 2 has no SDPA path)."""
    config = transformers_config(cfg, task)
    if meta:
        with torch.device("meta"):
            return build_model(config, task, attn_implementation="eager")
    return build_model(config, task, attn_implementation="eager")


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", sorted(TINY))
def test_n_params_and_largest_equal_the_real_tiny_model(name, task):
    model = real_model(TINY[name], task)
    shape = ModelShape.from_config(TINY[name], task)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.largest_param_numel == max(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(n for n, cfg in TINY.items() if ModelShape.from_config(cfg).family == "llama"))
def test_llama_layouts_list_a_layers_tensors_as_named_parameters_does(name):
    """A layer's tensors in the real model's order: the stream loads them so, and DDP's and ZeRO's buckets fill so
    (Phi-3 makes its o_proj before its fused qkv_proj)."""
    model = real_model(TINY[name], "causal-lm")
    real = [n.split(".layers.0.", 1)[1] for n, _ in model.named_parameters() if ".layers.0." in n]
    assert [n for n, _, _ in ModelShape.from_config(TINY[name]).layer_tensors] == real


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", ["gpt2", "bert-large", "llama-7b"])
def test_n_params_equal_the_real_full_size_model(name, task):
    cfg = load_model_config(name)
    model = real_model(cfg, task, meta=True)
    assert ModelShape.from_config(cfg, task).n_params == sum(p.numel() for p in model.parameters())


def test_well_known_counts():
    assert ModelShape.from_config(load_model_config("gpt2")).n_params == 124_439_808
    assert ModelShape.from_config(load_model_config("llama-7b")).n_params == 6_738_415_616
    # published configs (config.json on the Hub) and their models' published parameter counts
    qwen3_06b = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
                 "tie_word_embeddings": True}
    gemma_2b = {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 8,
                "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 16384, "vocab_size": 256000}
    roberta_base = {"model_type": "roberta", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "vocab_size": 50265, "max_position_embeddings": 514,
                    "type_vocab_size": 1}
    assert ModelShape.from_config(qwen3_06b).n_params == 596_049_920
    assert ModelShape.from_config(gemma_2b).n_params == 2_506_172_416
    assert ModelShape.from_config(roberta_base, "seq-cls").n_params == 124_647_170
    phi3_mini = {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064, "sliding_window": 2047,
                 "tie_word_embeddings": False}  # microsoft/Phi-3-mini-4k-instruct
    assert ModelShape.from_config(phi3_mini).n_params == 3_821_079_552
    assert ModelShape.from_config(phi3_mini).sliding_window == 2047
    gemma2_2b = {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000,
                 "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # google/gemma-2-2b
    shape = ModelShape.from_config(gemma2_2b)
    assert shape.n_params == 2_614_341_888
    assert (shape.sandwich_norms, shape.attn_softcap, shape.final_softcap, shape.sdpa) == (True, True, True, False)
    # a field config.json leaves out takes the config class's default: Gemma 2 soft-caps (50, 30), Mistral's window
    absent = {k: v for k, v in gemma2_2b.items() if not k.endswith("softcapping")}
    assert (ModelShape.from_config(absent).attn_softcap, ModelShape.from_config(absent).final_softcap) == (True, True)
    off = {**gemma2_2b, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    assert (ModelShape.from_config(off).attn_softcap, ModelShape.from_config(off).final_softcap) == (False, False)
    assert ModelShape.from_config({**TINY_LLAMA, "model_type": "mistral"}).sliding_window == 4096
    assert ModelShape.from_config({**TINY_LLAMA, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    gemma3_1b = {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144,
                 "sliding_window": 512, "query_pre_attn_scalar": 256}  # google/gemma-3-1b-pt
    shape = ModelShape.from_config(gemma3_1b)
    assert shape.n_params == 999_885_952
    assert (shape.qk_norm, shape.sandwich_norms, shape.final_softcap, shape.sdpa, shape.sliding_window) == \
        (True, True, False, True, 512)
    # Gemma 3's attention does not pass its soft-cap on (transformers 5.24): only the logits' counts
    capped = ModelShape.from_config({**gemma3_1b, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert (capped.attn_softcap, capped.final_softcap) == (False, True)
    # no layer windowed (every layer full attention): no window
    full = {**gemma3_1b, "layer_types": ["full_attention"] * 26}
    assert ModelShape.from_config(full).sliding_window is None
    opt_13b = {"model_type": "opt", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
               "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 5120}
    opt_125m = {**opt_13b, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
                "word_embed_proj_dim": 768}
    assert ModelShape.from_config(opt_125m).n_params == 125_239_296
    assert ModelShape.from_config(opt_13b).n_params == 12_853_473_280


def test_llama_variants_take_their_config_classes_defaults():
    """A field config.json leaves out takes the value of that model type's config class, not LLaMA's."""
    bare = {k: v for k, v in TINY_QWEN3.items() if k not in ("head_dim", "tie_word_embeddings")}
    qwen3 = ModelShape.from_config(bare)
    assert (qwen3.head_dim, qwen3.tied, qwen3.qk_norm, qwen3.norm_fp32) == (128, False, True, False)
    gemma = ModelShape.from_config({k: v for k, v in TINY_GEMMA.items() if k != "head_dim"})
    assert (gemma.head_dim, gemma.tied, gemma.qk_norm, gemma.norm_fp32) == (256, True, False, True)
    assert gemma.activation == "gelu_pytorch_tanh"
    assert ModelShape.from_config({**TINY_GEMMA, "hidden_act": "gelu"}).activation == "gelu_pytorch_tanh"
    assert ModelShape.from_config({**TINY_GEMMA, "hidden_activation": "gelu_new"}).activation == "gelu_new"
    assert ModelShape.from_config({**TINY_LLAMA, "hidden_act": "gelu"}).activation == "gelu"
    llama = ModelShape.from_config(TINY_LLAMA)
    assert (llama.head_dim, llama.tied, llama.qk_norm, llama.norm_fp32) == (32, False, False, False)


def test_layer_tensors_are_one_real_layer():
    cfg = TINY["llama-tied-biases"]
    model = real_model(cfg, "causal-lm")
    shape = ModelShape.from_config(cfg, "causal-lm")
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    linear = sum(m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    assert shape.layer_linear_params == linear


def test_sizes_read_from_each_spelling():
    gpt2 = ModelShape.from_config(load_model_config("gpt2"))
    assert (gpt2.family, gpt2.hidden, gpt2.layers, gpt2.heads, gpt2.ffn, gpt2.vocab) == ("gpt2", 768, 12, 12, 3072, 50257)
    assert gpt2.tied and gpt2.activation == "gelu_new" and not gpt2.gated and gpt2.max_positions == 1024
    llama = ModelShape.from_config(load_model_config("llama-7b"))
    assert (llama.family, llama.ffn, llama.kv_heads, llama.head_dim, llama.gated, llama.tied) == ("llama", 11008, 32, 128, True, False)
    assert ModelShape.from_config(TINY_LLAMA).kv_heads == 2
    bert = ModelShape.from_config(load_model_config("bert-large"), "seq-cls")
    assert (bert.family, bert.hidden, bert.ffn, bert.num_labels, bert.hidden_dropout) == ("bert", 1024, 4096, 2, 0.1)


def test_kv_cache_only_for_decoder_classifiers():
    assert ModelShape.from_config(TINY["tiny-gpt2"], "seq-cls").kv_cache
    assert not ModelShape.from_config(TINY["tiny-gpt2"], "causal-lm").kv_cache
    assert not ModelShape.from_config({**TINY["tiny-gpt2"], "use_cache": False}, "seq-cls").kv_cache
    assert not ModelShape.from_config(TINY["tiny-bert"], "seq-cls").kv_cache


def test_legacy_helpers_keep_their_behaviour():
    cfg = load_model_config("gpt2")
    assert (hidden_size(cfg), ffn_size(cfg), largest_param_numel(cfg)) == (768, 3072, 50257 * 768)
    # Phi-3's fused gate and up projections (2 x ffn x hidden) are the largest weight of a wide enough MLP
    assert largest_param_numel(TINY["phi3-wide-mlp"]) == 2 * 8192 * 128
    llama = load_model_config("llama-7b")
    assert (hidden_size(llama), ffn_size(llama), largest_param_numel(llama)) == (4096, 11008, 32000 * 4096)
    assert largest_param_numel({"hidden_size": 64}) == 4 * 64 * 64  # the default FFN (4 h) beats QKV (3 h^2)


@pytest.mark.parametrize("cfg, field", [
    ({k: v for k, v in load_model_config("gpt2").items() if k != "n_embd"}, "n_embd"),
    ({k: v for k, v in load_model_config("bert-large").items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({k: v for k, v in load_model_config("bert-large").items() if k != "intermediate_size"}, "intermediate_size"),
    ({k: v for k, v in load_model_config("llama-7b").items() if k != "vocab_size"}, "vocab_size"),
    ({k: v for k, v in load_model_config("llama-7b").items() if k != "num_attention_heads"}, "num_attention_heads"),
])
def test_a_missing_field_is_named_in_one_line(cfg, field):
    with pytest.raises(ConfigError, match=field) as err:
        ModelShape.from_config(cfg)
    assert "\n" not in str(err.value)


def test_bad_configs_are_refused():
    with pytest.raises(ConfigError, match="traced"):
        ModelShape.from_config({"model_type": "t5", "d_model": 512})
    for field, value in (("head_dim", "128"), ("num_key_value_heads", 0), ("attention_dropout", "0.1"),
                         ("attention_dropout", 1.5), ("max_position_embeddings", ""), ("num_labels", "two")):
        with pytest.raises(ConfigError, match=field):
            ModelShape.from_config({**TINY_QWEN3, field: value}, "seq-cls")
    with pytest.raises(ConfigError, match="n_embd"):  # read by the renderer and triage's remedies too
        largest_param_numel({"model_type": "gpt2", "n_embd": float("inf")})
    with pytest.raises(ConfigError, match="num_labels"):
        ModelShape.from_config(TINY_QWEN3, "seq-cls", num_labels=10**12)
    with pytest.raises(ConfigError, match="at most 1024"):  # DeepNet's 1,000 layers are the deepest trained
        ModelShape.from_config({**TINY_LLAMA, "num_hidden_layers": 10_000_000})
    with pytest.raises(ConfigError, match="model_type"):
        ModelShape.from_config({**TINY_LLAMA, "model_type": ["llama"]})
    for near_llama in ("phi3small", "gemma3", "mixtral"):  # LLaMA-like, but not in what they keep: named
        with pytest.raises(ConfigError, match=f"'{near_llama}' is not one the analytic estimator knows"):
            ModelShape.from_config({**TINY_LLAMA, "model_type": near_llama})
    with pytest.raises(ConfigError, match="multiple"):
        ModelShape.from_config({**TINY_LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="use_sliding_window") as err:  # a window on some layers only
        ModelShape.from_config({**TINY_LLAMA, "model_type": "qwen2", "use_sliding_window": True,
                                "sliding_window": 64})
    assert "traced" in str(err.value)
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelShape.from_config({**TINY_PHI3, "sliding_window": "2047"})
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):  # EmbeddingGemma's encoder
        ModelShape.from_config({**TINY_GEMMA3, "use_bidirectional_attention": True})
    for types in (["sliding_attention"], ["sliding_attention", "chunked_attention"], "sliding_attention"):
        with pytest.raises(ConfigError, match="layer_types"):
            ModelShape.from_config({**TINY_GEMMA3, "layer_types": types})
    for bad in (0, -30.0, "30", True, float("inf")):
        with pytest.raises(ConfigError, match="final_logit_softcapping"):
            ModelShape.from_config({**TINY_GEMMA2, "final_logit_softcapping": bad})
    # OPT-350m's layout (a projected embedding, post-LayerNorm layers): named, not guessed
    for field, value in (("word_embed_proj_dim", 64), ("do_layer_norm_before", False),
                         ("_remove_final_layer_norm", True)):
        with pytest.raises(ConfigError, match=field) as err:
            ModelShape.from_config({**TINY_OPT, field: value})
        assert "traced" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="ffn_dim"):
        ModelShape.from_config({k: v for k, v in TINY_OPT.items() if k != "ffn_dim"})
    with pytest.raises(ConfigError, match="positive integer"):
        ModelShape.from_config({**TINY_LLAMA, "hidden_size": "128"})
    with pytest.raises(ConfigError, match="task"):
        ModelShape.from_config(TINY_LLAMA, "image-cls")


def test_from_param_count_is_exact_and_shaped():
    shape = ModelShape.from_param_count(7_000_000_000, hidden=4096, layers=32, heads=32, vocab=32000, seq=4096)
    assert shape.n_params == 7_000_000_000
    assert (shape.hidden, shape.layers, shape.heads, shape.vocab, shape.max_positions) == (4096, 32, 32, 32000, 4096)
    assert 4 * 4096 < shape.ffn < 5 * 4096  # GPT-style layers of ~12 h^2 fill the count
    assert shape.largest_param_numel == max(32000 * 4096, 4096 * shape.ffn)
    cls = ModelShape.from_param_count(10**9, hidden=2048, layers=16, heads=16, vocab=50000, task="seq-cls")
    assert cls.n_params == 10**9 and cls.task == "seq-cls"
    with pytest.raises(ConfigError, match="too few"):
        ModelShape.from_param_count(1_000_000, hidden=4096, layers=32, heads=32, vocab=32000)
    with pytest.raises(ConfigError, match="multiple"):
        ModelShape.from_param_count(10**9, hidden=1000, layers=8, heads=16, vocab=1000)


# -- image classification (ViT) -------------------------------------------------------------

TINY_VIT = {
    "tiny-vit": load_model_config("tiny-vit"),
    "vit-no-qkv-bias-grey-rectangular": {**load_model_config("tiny-vit"), "qkv_bias": False, "num_channels": 1,
                                         "image_size": [32, 48], "patch_size": [8, 16]},
    "vit-labels-from-id2label": {**{k: v for k, v in load_model_config("tiny-vit").items() if k != "num_labels"},
                                 "id2label": {str(i): f"class-{i}" for i in range(7)}},
}


@pytest.mark.parametrize("name", sorted(TINY_VIT))
def test_vit_n_params_and_largest_equal_the_real_tiny_model(name):
    model = real_model(TINY_VIT[name], "image-cls")
    assert type(model).__name__ == "ViTForImageClassification"
    shape = ModelShape.from_config(TINY_VIT[name], "image-cls")
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.largest_param_numel == max(p.numel() for p in model.parameters())
    assert shape.num_labels == model.config.num_labels
    assert shape.seq_len == model.vit.embeddings.position_embeddings.shape[1]  # patches + CLS


def test_vit_base_n_params_equal_the_real_full_size_model():
    cfg = load_model_config("vit-base")
    model = real_model(cfg, "image-cls", meta=True)
    shape = ModelShape.from_config(cfg, "image-cls")
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.n_params == 86_567_656  # google/vit-base-patch16-224 as published (ImageNet-1k head)


def test_vit_layer_tensors_are_one_real_layer_and_the_patch_embedding_a_conv():
    cfg = TINY_VIT["tiny-vit"]
    model = real_model(cfg, "image-cls")
    shape = ModelShape.from_config(cfg, "image-cls")
    layer = model.vit.layers[0]
    assert shape.layer_params == sum(p.numel() for p in layer.parameters())
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert shape.layer_linear_params == linear
    conv = model.vit.embeddings.patch_embeddings.projection
    c, p, h = cfg["num_channels"], cfg["patch_size"], cfg["hidden_size"]
    assert conv.weight.numel() + conv.bias.numel() == c * p * p * h + h
    head = conv.weight.numel() + model.classifier.weight.numel()
    assert shape.head_linear_params == head  # what autocast copies outside the layers: patch conv and classifier


def test_vit_sizes_and_sequence():
    vit = ModelShape.from_config(load_model_config("vit-base"), "image-cls")
    assert (vit.family, vit.hidden, vit.layers, vit.heads, vit.ffn, vit.num_labels) == ("vit", 768, 12, 12, 3072, 1000)
    assert vit.seq_len == (224 // 16) ** 2 + 1 and vit.image == (3, 224, 224)
    assert vit.vocab == 0 and not vit.tied and not vit.gated and not vit.kv_cache
    assert (vit.hidden_dropout, vit.attn_dropout) == (0.0, 0.0)
    rect = ModelShape.from_config(TINY_VIT["vit-no-qkv-bias-grey-rectangular"], "image-cls")
    assert rect.seq_len == (32 // 8) * (48 // 16) + 1 and rect.image == (1, 32, 48)
    assert ModelShape.from_config(TINY_VIT["tiny-vit"], "image-cls").to_dict()["seq_len"] == 17
    assert ModelShape.from_config(load_model_config("gpt2")).seq_len is None  # text: the plan's seq_len


@pytest.mark.parametrize("cfg, task, needle", [
    (load_model_config("tiny-vit"), "causal-lm", "image model"),
    (load_model_config("tiny-vit"), "seq-cls", "image model"),
    (load_model_config("tiny-gpt2"), "image-cls", "text model"),
    (load_model_config("bert-large"), "image-cls", "text model"),
    ({k: v for k, v in load_model_config("tiny-vit").items() if k != "image_size"}, "image-cls", "image_size"),
    ({k: v for k, v in load_model_config("tiny-vit").items() if k != "intermediate_size"}, "image-cls",
     "intermediate_size"),
    ({**load_model_config("tiny-vit"), "patch_size": 64}, "image-cls", "larger than image_size"),
    ({**load_model_config("tiny-vit"), "image_size": [32]}, "image-cls", "image_size"),
])
def test_image_and_text_mismatches_are_one_line_errors(cfg, task, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        ModelShape.from_config(cfg, task)
    assert "\n" not in str(err.value)
