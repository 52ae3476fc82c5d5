"""Tiny random DeepSeek checkpoints built with transformers (the independent reference) for parity tests.

transformers' default init (std 0.02) gives near-uniform logits whose top tokens differ by less than float
noise; weights are redrawn with a larger spread so greedy decoding has real margins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.quant import quantize_fp8_block
from deepinfer.spec.dspark_model import DSparkConfig, DSparkModel, save_dspark

BASE_V3: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, max_position_embeddings=256, num_nextn_predict_layers=0,
    routed_scaling_factor=2.5, bos_token_id=0, eos_token_id=1,
)
BASE_V2: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, topk_method="greedy",
    first_k_dense_replace=1, max_position_embeddings=256, routed_scaling_factor=1.0, norm_topk_prob=False,
    bos_token_id=0, eos_token_id=1,
)


def _spread_weights(model: torch.nn.Module, seed: int, gain: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight") and p.dim() == 2 and "proj" not in name:
                # Router logits of std ~2: sigmoid scores spread out instead of saturating near 1, where
                # expert choices would hinge on float noise.
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p.shape[-1] ** 0.5))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (gain / fan_in**0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_hf_model(model_type: str, seed: int = 0, gain: float = 1.5, **overrides: Any):
    """A random transformers DeepseekV3/V2ForCausalLM in float32, eval mode."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if model_type == "deepseek_v3":
        cfg, cls = DeepseekV3Config(**{**BASE_V3, **overrides}), DeepseekV3ForCausalLM
    else:
        cfg, cls = DeepseekV2Config(**{**BASE_V2, **overrides}), DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    freq = overrides.get("moe_layer_freq", 1)
    if freq > 1:
        # transformers ignores moe_layer_freq; DeepSeek's layers between MoE layers are dense MLPs.
        mlp_cls = type(model.model.layers[0].mlp)
        for i, layer in enumerate(model.model.layers):
            if i >= cfg.first_k_dense_replace and i % freq != 0:
                layer.mlp = mlp_cls(cfg)
    _spread_weights(model, seed, gain)
    return model.float().eval()


def save_checkpoint(model, path: Path, mtp: bool = False, seed: int = 0) -> Path:
    """save_pretrained, plus DeepSeek-V3 MTP weights (transformers has none) when `mtp`."""
    model.save_pretrained(path)
    if mtp:
        add_mtp_layer(path, seed)
    return path


def add_mtp_layer(path: Path, seed: int = 0) -> None:
    """Append model.layers.{N} as an MTP module: a copy-shaped decoder layer plus enorm/hnorm/eh_proj/head."""
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{n - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            noise = 0.1 * t.float().std() * torch.randn(t.shape, generator=g) if t.numel() > 1 else 0.0
            tensors[f"model.layers.{n}." + name[len(last):]] = (t + noise).contiguous()
    mtp = f"model.layers.{n}."
    tensors[mtp + "enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * (1.5 / (2 * h) ** 0.5)
    tensors[mtp + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "shared_head.head.weight"] = torch.randn(cfg["vocab_size"], h, generator=g) * (1.5 / h**0.5)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


NOT_QUANTIZED = ("norm", "embed_tokens", "lm_head", "mlp.gate.weight", "e_score_correction_bias", "shared_head.head")


def write_fp8_copy(src: Path, dst: Path) -> Path:
    """The checkpoint at src with every projection stored as FP8 128x128 blocks + weight_scale_inv."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and not any(k in name for k in NOT_QUANTIZED):
            q, scale_inv = quantize_fp8_block(t)
            out[name], out[name + "_scale_inv"] = q, scale_inv
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def write_dequantized_copy(src: Path, dst: Path) -> Path:
    """An FP8 checkpoint's weights dequantised back to float32 (the model the FP8 one approximates)."""
    from deepinfer.quant import dequantize_fp8_block

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        out[name] = dequantize_fp8_block(t, tensors[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def random_dspark(path: Path, out: Path, seed: int = 0, block: int = 4, window: int = 48) -> Path:
    """A randomly initialised DSpark drafter for the checkpoint at `path` (losslessness does not need a good one)."""
    cfg = ModelConfig.from_hf_dir(path)
    dcfg = DSparkConfig(target_hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                        target_layers=(0, cfg.num_hidden_layers - 1), hidden_size=cfg.hidden_size, num_layers=1,
                        num_heads=2, head_dim=cfg.hidden_size // 2, intermediate_size=2 * cfg.hidden_size,
                        markov_rank=16, block_size=block, window=window)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = DSparkModel(dcfg, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
                        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    with torch.no_grad():  # a non-zero Markov head and a confidence spread, so every path is exercised
        model.markov_w2.weight.normal_(0, 0.3, generator=gen)
        model.confidence.proj.weight.normal_(0, 0.5, generator=gen)
    save_dspark(out, model)
    return out
