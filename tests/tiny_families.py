"""Tiny causal LMs of many transformers families, built from configs with random weights (no download).

`tiny_model(family)` shrinks the family's default configuration to two layers of width 64 and a
vocabulary of 512, keeping what makes the family what it is (sliding windows, ALiBi, absolute
positions, state-space or recurrent layers, the hybrid layouts). Used by tests/test_packing_probe.py
and benchmarks/bench_probe.py.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 1024
HIDDEN = 64

_COMMON = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip

# per family: what replaces or adds to _COMMON (None removes a key the family does not take)
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 24},  # shorter than the probe's context: the window matters
    "gemma": {},
    "gemma2": {"sliding_window": 24, "attn_implementation": "eager"},
    "phi3": {"attn_implementation": "eager"},
    "olmo2": {},
    "gpt2": {"n_embd": HIDDEN, "n_layer": 2, "n_head": 4, "n_positions": 1024},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": HIDDEN},
    "bloom": {"n_layer": 2, "n_head": 4, "attn_implementation": "eager"},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16, "expand": 2,
               "conv_kernel": 4, "chunk_size": 16, "attn_implementation": "eager"},
    "minimax": {"layer_types": ["linear_attention", "full_attention"], "num_local_experts": 2,
                "num_experts_per_tok": 1, "block_size": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "num_experts": 2, "num_experts_per_tok": 1, "mamba_d_state": 8,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1,
              "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16},
}  # fmt: skip


FAMILIES = tuple(_FAMILY)


def tiny_model(
    family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, attention: str | None = None
):
    """A two-layer ``AutoModelForCausalLM`` of ``family`` (a ``model_type``) in eval mode, of ``dtype``.

    >>> tiny_model("llama").config.num_hidden_layers
    2
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**_COMMON, **_FAMILY[family]}
    attention = attention or settings.pop("attn_implementation", "sdpa")
    settings.pop("attn_implementation", None)
    config = AutoConfig.for_model(family, **settings)
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(dtype).eval()
