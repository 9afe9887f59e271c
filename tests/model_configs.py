"""Model configs the tests share that are not shipped in jobs/models."""

TINY_LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
              "max_position_embeddings": 512}
"""A LLaMA-like config: grouped-query attention, SwiGLU, untied head (LLaMA's default)."""

TINY_QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 64, "tie_word_embeddings": True}
"""Qwen3's layout: a per-head RMSNorm on queries and keys, head_dim apart from hidden / heads, tied head."""

TINY_GEMMA = {**TINY_LLAMA, "model_type": "gemma", "num_key_value_heads": 1, "head_dim": 64,
              "hidden_act": "gelu_pytorch_tanh"}
"""Gemma's layout: RMSNorms that keep their fp32 normalised tensor (scaled by 1 + weight after), GeGLU, multi-query
attention, tied head (its config's default)."""

TINY_PHI3 = {**TINY_LLAMA, "model_type": "phi3", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Phi-3's layout: one qkv_proj and one gate_up_proj, whose outputs the layer slices into views (GQA: two key/value
heads for four query heads); no window (Phi3Config's default). Its own pad token (Phi3Config's 32000) would lie
outside the tiny vocabulary."""

TINY_GEMMA2 = {**TINY_LLAMA, "model_type": "gemma2", "num_key_value_heads": 2, "head_dim": 64,
               "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64, "sliding_window": 64}
"""Gemma 2's layout: Gemma's norms, four to a layer; the attention scores and the logits soft-capped; a window on
every other layer (shorter than the tests' sequences); tied head. transformers runs it eager or flash, not SDPA."""

TINY_GEMMA3 = {**TINY_LLAMA, "model_type": "gemma3_text", "num_key_value_heads": 2, "head_dim": 64,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64, "sliding_window": 64}
"""Gemma 3's text model: Gemma 2's four norms per layer, Gemma-style norms on each head's queries and keys, no soft-capping
(its config's default), a window shorter than the tests' sequences on five layers of every six (the first five)."""

TINY_ROBERTA = {"model_type": "roberta", "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 512, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 514, "type_vocab_size": 1,
                "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
"""RoBERTa: BERT's layers, one token type, positions offset past the padding index, its own classification head."""

TINY_OPT = {"model_type": "opt", "vocab_size": 4096, "hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 512, "word_embed_proj_dim": 128,
            "do_layer_norm_before": True, "activation_function": "relu", "dropout": 0.1, "attention_dropout": 0.0,
            "enable_bias": True, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}
"""OPT's layout (OPT-125m's config at a tiny size): pre-LayerNorm layers with biased k/v/q/out projections, a ReLU
MLP, dropout on both residual branches, learned positions offset by 2, tied head."""
