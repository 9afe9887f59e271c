"""Model configs the tests share that are not shipped in jobs/models."""

TINY_LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
              "max_position_embeddings": 512}
"""A LLaMA-like config: grouped-query attention, SwiGLU, untied head (LLaMA's default)."""
