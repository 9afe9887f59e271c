"""The shape of a transformer from its config dict (pure): sizes the estimator and DeepSpeed need.

Reads the common transformers spellings (GPT-2's n_embd/n_layer/n_inner, BERT's and
LLaMA's hidden_size/num_hidden_layers/intermediate_size).
"""

from __future__ import annotations

from typing import Any, Mapping


def _first(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def hidden_size(cfg: Mapping[str, Any]) -> int:
    return int(_first(cfg, "hidden_size", "n_embd", "d_model"))


def ffn_size(cfg: Mapping[str, Any]) -> int:
    return int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden_size(cfg)))


def largest_param_numel(cfg: Mapping[str, Any]) -> int:
    """Elements of the largest single weight: the embedding or an FFN matrix (or fused QKV)."""
    h = hidden_size(cfg)
    vocab = int(_first(cfg, "vocab_size", default=0))
    return max(vocab * h, ffn_size(cfg) * h, 3 * h * h)
