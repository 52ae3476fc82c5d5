"""Tiny random DeepSeek V2/V3 models made with transformers (the independent reference), saved to tmp dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

# Small enough to save in milliseconds, big enough to exercise every tensor kind (q_lora, MoE with groups and
# shared experts, a dense first layer). num_key_value_heads must be given: DeepseekV3Config defaults it to 128
# whatever num_attention_heads is, which breaks transformers' own attention at other head counts.
TINY_V3: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, max_position_embeddings=128, num_nextn_predict_layers=0,
)
TINY_V2: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, topk_method="greedy",
    first_k_dense_replace=1, max_position_embeddings=128,
)


def make_hf_config(model_type: str = "deepseek_v3", **overrides: Any):
    """A transformers DeepseekV3Config / DeepseekV2Config with TINY_* defaults and `overrides`."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    if model_type == "deepseek_v3":
        return DeepseekV3Config(**{**TINY_V3, **overrides})
    if model_type == "deepseek_v2":
        return DeepseekV2Config(**{**TINY_V2, **overrides})
    raise ValueError(model_type)


@pytest.fixture
def hf_config():
    """Factory: hf_config(model_type="deepseek_v3", **overrides) -> a transformers config object."""
    return make_hf_config


@pytest.fixture
def tiny_checkpoint(tmp_path: Path):
    """Factory: save a random tiny model; returns (directory, transformers config).

    tiny_checkpoint(model_type="deepseek_v3", name="ckpt", max_shard_size=None, **config_overrides)
    """
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    def save(model_type: str = "deepseek_v3", name: str = "ckpt", max_shard_size: str | None = None, **overrides: Any):
        cfg = make_hf_config(model_type, **overrides)
        model_cls = DeepseekV3ForCausalLM if model_type == "deepseek_v3" else DeepseekV2ForCausalLM
        torch.manual_seed(0)
        model = model_cls(cfg)
        path = tmp_path / name
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(path, **kwargs)
        return path, cfg

    return save
