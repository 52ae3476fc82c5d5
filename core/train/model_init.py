"""The tiny DeepSeek-V3 configuration, its trainable parameters, and a DeepseekModel built from them.

Parameters are float32 leaf tensors keyed by their HF checkpoint names (the exact set `expected_tensors`
says DeepInfer loads), so export is a rename-free dump. The model classes convert weights at construction
(kv_b_proj split per head, experts stacked, gate/up concatenated) with differentiable torch ops, so the
trainer rebuilds the model from the leaves every step: the graph of one step is never reused.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch

from deepinfer.backend import Backend
from deepinfer.config import ModelConfig
from deepinfer.model.checkpoint import expected_tensors
from deepinfer.model.deepseek import DecoderLayer, DeepseekModel, MTPLayer
from deepinfer.weights import LinearWeight

# config.json fields as transformers' DeepseekV3Config(...).to_json_string() writes them (transformers 5).
# MLA with q_lora; one dense layer then MoE layers; sigmoid group-limited routing (4 groups, best 2 kept);
# one shared expert; one MTP layer. Dimensions are multiples of 128 where FP8 blocks should tile them.
TINY_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "kv_lora_rank": 128,
    "max_position_embeddings": 2048,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 128,
    "n_group": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "output_router_logits": False,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "q_lora_rank": 128,
    "qk_head_dim": 96,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "rms_norm_eps": 1e-06,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 6144,
    "dtype": "bfloat16",
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def hf_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The config.json dict; overrides (smaller dims for smoke runs) keep derived keys consistent."""
    cfg = {**TINY_V3, **overrides, "vocab_size": vocab_size}
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    cfg["head_dim"] = cfg["qk_rope_head_dim"]  # what transformers writes for DeepSeek-V3
    return cfg


def shared_name(config: ModelConfig, name: str) -> str:
    """DeepSeek-V3's MTP modules share the main model's output head: one trained tensor, stored twice."""
    for layer in config.mtp_layer_ids:
        if name == f"model.layers.{layer}.shared_head.head.weight":
            return "lm_head.weight"
    return name


def is_correction_bias(name: str) -> bool:
    return name.endswith("mlp.gate.e_score_correction_bias")


def init_params(config: ModelConfig, seed: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """float32 leaves (requires_grad) for every trained tensor, plus the correction biases (no grad:
    they move by the aux-loss-free rule, not by gradients)."""
    g = torch.Generator().manual_seed(seed)
    std = 0.02
    # GPT-2 style: residual-branch outputs shrink with depth so the stream's scale stays put.
    out_std = std / (2 * (config.num_hidden_layers + config.num_nextn_predict_layers)) ** 0.5
    params: dict[str, torch.Tensor] = {}
    for name, spec in sorted(expected_tensors(config, include_mtp=True).items()):
        if shared_name(config, name) != name:
            continue
        if is_correction_bias(name):
            params[name] = torch.zeros(spec.shape, device=device)
            continue
        if len(spec.shape) == 1:  # every 1-D tensor left is an RMSNorm weight
            t = torch.ones(spec.shape)
        else:
            t = torch.randn(spec.shape, generator=g) * (out_std if name.endswith(_OUTPUT_PROJECTIONS) else std)
        params[name] = t.to(device).requires_grad_(True)
    return params


def trainable(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p for n, p in params.items() if p.requires_grad}


def build_model(backend: Backend, config: ModelConfig, params: dict[str, torch.Tensor], cos_sin_cache: torch.Tensor) -> DeepseekModel:
    """A DeepseekModel whose weights are (differentiable functions of) `params`, as the loader would build it."""
    specs = expected_tensors(config, include_mtp=True)
    top: dict[str, object] = {}
    per_layer: dict[int, dict[str, object]] = defaultdict(dict)
    for name, spec in specs.items():
        tensor = params[shared_name(config, name)]
        value = LinearWeight.dense(tensor) if spec.quantizable else tensor
        m = _LAYER.match(name)
        if m:
            per_layer[int(m.group(1))][m.group(2)] = value
        else:
            top[name] = value
    n = config.num_hidden_layers
    layers = [DecoderLayer(backend, config, i, per_layer[i], cos_sin_cache) for i in range(n)]
    mtp = [MTPLayer(backend, config, i, per_layer[i], cos_sin_cache) for i in config.mtp_layer_ids]
    return DeepseekModel(backend, config, top, layers, mtp)


def moe_layer_ids(config: ModelConfig) -> list[int]:
    """MoE layers in forward order (main stack, then MTP): the order their routers run in."""
    ids = list(range(config.num_hidden_layers)) + list(config.mtp_layer_ids)
    return [i for i in ids if config.is_moe_layer(i)]


def count_params(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() for p in params.values())
