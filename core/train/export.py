"""Write trained parameters as a Hugging Face DeepSeek-V3 checkpoint folder.

Projections are stored as DeepSeek-V3 stores them: float8_e4m3fn with one fp32 `weight_scale_inv` per 128x128
block (the last block of a dimension that is not a multiple of 128 is partial, as in DeepSeek's own
kv_a_proj_with_mqa). Embeddings, norms and output heads stay bf16; the router and its correction bias fp32.
The MTP layer is `model.layers.{num_hidden_layers}` with its own copy of the shared output head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.config import ModelConfig
from deepinfer.model.checkpoint import expected_tensors, scale_name
from deepinfer.quant import quantize_fp8_block
from deepinfer.train.model_init import shared_name

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
WEIGHTS_FILE = "model.safetensors"
_FP32_KEPT = ("mlp.gate.weight", "e_score_correction_bias")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def checkpoint_tensors(config: ModelConfig, params: dict[str, torch.Tensor], fp8: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF name -> stored tensor, for every tensor DeepInfer loads (MTP included)."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in sorted(expected_tensors(config, include_mtp=True).items()):
        tensor = params[shared_name(config, name)].detach().float().cpu()
        if spec.quantizable and fp8:
            out[name], out[scale_name(name)] = quantize_fp8_block(tensor)
        elif name.endswith(_FP32_KEPT):
            out[name] = tensor.clone()  # expert choice hinges on small score gaps
        else:
            out[name] = tensor.to(dtype, copy=True)  # a copy: the shared head is stored twice
    return out


def write_checkpoint(
    folder: Path, hf_config: dict[str, Any], params: dict[str, torch.Tensor], fp8: bool = True, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """config.json + model.safetensors in `folder` (created); tokenizer files are written by the caller."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config)
    cfg["dtype"] = _DTYPE_NAMES[dtype]
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        cfg.pop("quantization_config", None)
    config = ModelConfig.from_hf_dict(cfg)
    save_file(checkpoint_tensors(config, params, fp8, dtype), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return folder
