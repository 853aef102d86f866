"""Small random Hugging Face configs the tests build models from (nothing downloaded)."""

from __future__ import annotations

from typing import Any


def small_llama_config() -> Any:
    """``LlamaConfig``: 2 layers of width 32, 4 heads over 2 key-value heads, a vocabulary of
    100, no cache (a cache object is not a graph output). Import-skips without transformers
    at the caller."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
