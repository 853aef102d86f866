"""Small random Hugging Face configs the tests build models from (nothing downloaded)."""

from __future__ import annotations

from typing import Any


def small_gpt2_config(vocab: int = 100) -> Any:
    """``GPT2Config``: 2 layers of width 32, 2 heads, 32 positions, no cache (a cache object
    is not a graph output), the special tokens 0 (inside the small vocabulary)."""
    import transformers

    config = transformers.GPT2Config(
        n_positions=32, n_embd=32, n_layer=2, n_head=2, vocab_size=vocab, use_cache=False
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    return config


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


def small_fnet_config() -> Any:
    """``FNetConfig``: 2 layers of width 32, a vocabulary of 100, 64 positions (FNet mixes
    tokens by Fourier transforms: no attention heads)."""
    import transformers

    return transformers.FNetConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
